"""Prove that sharded optimizer steps never wait on the host: run them under torch.cuda.set_sync_debug_mode("error").

    python -m benchmarks.sync_check        # on CUDA: the check; on CPU: the same steps, nothing to detect

Backward, clip_grad_norm_, step and zero_grad of a small model run with synchronizing CUDA calls turned into
errors, after one warm-up step (which fills the flatten kernel's device-side tables and compiles the kernels), for
each configuration below: the default ShardedAdamW, bf16 optimizer states with stochastic rounding plus the
remainder-stored master, fp16 parameters with dynamic loss scaling (where an overflow must skip a step without a
host read), ShardedSGD and ShardedLion, and the communicating paths: overlap_comm with attach() (reduce-scatters
launched from backward hooks, all-gathers waited for in forward pre-hooks) with bf16 states, and clipping through
torch.nn.utils.clip_grad_norm_ on param.grad placeholders. main() starts a 1-rank process group (NCCL on CUDA,
gloo on CPU) when none exists, so the collectives really run. On CPU (CI) the steps run without the detector,
which keeps this script from rotting between GPU runs; only a CUDA run proves anything.
"""

from __future__ import annotations

import sys
from typing import Callable

import torch
import torch.distributed as dist

import tritonshard
from tritonshard.comm import local_device

CONFIGS: dict[str, Callable] = {
    "ShardedAdamW": lambda ps: tritonshard.ShardedAdamW(ps, lr=1e-3),
    "ShardedAdamW bf16 states + remainders": lambda ps: tritonshard.ShardedAdamW(
        ps, lr=1e-3, state_dtype=torch.bfloat16, store_param_remainders=True),
    "ShardedAdamW fp16 + loss scaling": lambda ps: tritonshard.ShardedAdamW(ps, lr=1e-3, param_dtype=torch.float16),
    "ShardedSGD momentum": lambda ps: tritonshard.ShardedSGD(ps, lr=1e-2, momentum=0.9),
    "ShardedLion": lambda ps: tritonshard.ShardedLion(ps, lr=1e-4),
    "ShardedAdamW overlap_comm + attach, bf16 states": lambda ps: tritonshard.ShardedAdamW(
        ps, lr=1e-3, overlap_comm=True, state_dtype=torch.bfloat16, bucket_cap_mb=0.05),
    "ShardedAdamW, torch.nn.utils.clip_grad_norm_": lambda ps: tritonshard.ShardedAdamW(ps, lr=1e-3),
    # the weight matrices in Muon (Newton-Schulz in the step), the biases in AdamW
    "ShardedMuon + AdamW groups": lambda ps: tritonshard.ShardedMuon(
        [{"params": [p for p in ps if p.ndim == 2]}, {"params": [p for p in ps if p.ndim != 2], "use_muon": False}],
        lr=0.02),
}
# how each configuration's loop differs from the plain one
ATTACH = {"ShardedAdamW overlap_comm + attach, bf16 states"}
TORCH_CLIP = {"ShardedAdamW, torch.nn.utils.clip_grad_norm_"}


def check(name: str, make: Callable, device: torch.device, steps: int = 3) -> str:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(257, 129), torch.nn.GELU(), torch.nn.Linear(129, 61)).to(device)
    opt = make(list(model.parameters()))
    if name in ATTACH:
        opt.attach(model)
    dtype = next(model.parameters()).dtype
    x = torch.randn(32, 257, device=device, dtype=dtype)

    def one_step(poison: bool = False):
        loss = model(x).float().square().mean()
        if poison:  # an overflowing backward: with loss scaling the step must be skipped on the device
            loss = loss * float("inf")
        opt.scale_loss(loss).backward()
        if name in TORCH_CLIP:  # the placeholders' per-parameter global norms, the multiply folded into step()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        else:
            norm = opt.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
        return norm

    scaled = opt.loss_scale is not None
    one_step()  # warm-up: compiles kernels, uploads the flatten schedule
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
    try:
        for i in range(steps):
            norm = one_step(poison=i == 1 and scaled)
    finally:
        if cuda:
            torch.cuda.set_sync_debug_mode(0)
            torch.cuda.synchronize()
    skipped = int(opt.skipped_steps)
    if not torch.isfinite(norm):
        raise AssertionError(f"{name}: last grad norm is {float(norm)}")
    if skipped != int(scaled):  # the poisoned step, and only it, is skipped
        raise AssertionError(f"{name}: {skipped} skipped steps, expected {int(scaled)}")
    return f"{name}: {steps} steps{' under set_sync_debug_mode(error)' if cuda else ''}, last grad norm " \
           f"{float(norm):.4f}, skipped steps {skipped}"


def main() -> int:
    device = local_device()  # indexed on CUDA: torch 2.11's init_process_group(device_id=) needs the index
    if device.type == "cuda":
        torch.cuda.set_device(device)
    owned_group = not dist.is_initialized()
    if owned_group:  # a real process group: the collectives run (NCCL) instead of being skipped
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0,
                                world_size=1, device_id=device if device.type == "cuda" else None)
    try:
        return _check_all(device)
    finally:
        if owned_group:
            dist.destroy_process_group()


def _check_all(device: torch.device) -> int:
    if device.type != "cuda":
        print("sync_check: no CUDA device; running the steps without the sync detector (proves nothing about syncs)")
    failed = 0
    for name, make in CONFIGS.items():
        try:
            print("sync_check: " + check(name, make, device), flush=True)
        except Exception as exc:  # noqa: BLE001 -- one configuration's failure must not hide the others
            failed += 1
            print(f"sync_check: FAILED {name}: {type(exc).__name__}: {exc}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
