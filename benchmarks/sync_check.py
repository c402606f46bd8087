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

It also checks the streams' rule 4 (optim/base.py): gradients made on a side stream and flushed on another one are
read before their memory is reused (:func:`side_stream_check`, with and without overlap_comm), after a control that
shows the scenario catches an unprotected read on this machine (:func:`race_reproduces`).
"""

from __future__ import annotations

import sys
from typing import Callable

import torch
import torch.distributed as dist

import tritonshard
from tritonshard import comm
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


def _model(device: torch.device) -> torch.nn.Module:
    """The small model every check trains (odd sizes: no dimension a multiple of a block)."""
    return torch.nn.Sequential(torch.nn.Linear(257, 129), torch.nn.GELU(), torch.nn.Linear(129, 61)).to(device)


def check(name: str, make: Callable, device: torch.device, steps: int = 3) -> str:
    torch.manual_seed(0)
    model = _model(device)
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


def race_reproduces(device: torch.device) -> bool:
    """The control for :func:`side_stream_check`: in the same scenario, a copy of a side-stream tensor enqueued late
    on the default stream, the tensor then freed without any stream action, and a new tensor of its size filled on
    the side stream. True when the copy read the fill (the allocator reused the memory before the copy ran): the
    scenario does catch an unprotected flush on this machine, so the optimizer's passing it means something."""
    side = torch.cuda.Stream(device)
    n = 129 * 257
    with torch.cuda.stream(side):
        g = torch.randn(n, device=device).to(torch.bfloat16)
    out = torch.empty(n, device=device, dtype=torch.bfloat16)
    torch.cuda.current_stream(device).wait_stream(side)
    torch.cuda._sleep(100_000_000)
    out.copy_(g)
    del g
    with torch.cuda.stream(side):
        junk = torch.full((n,), 1e4, device=device, dtype=torch.bfloat16)
    torch.cuda.synchronize()
    del junk
    return bool((out == 1e4).any())


def side_stream_check(overlap: bool, device: torch.device) -> str:
    """Streams, rule 4 (optim/base.py): gradients that autograd makes on a side stream while the flush runs on
    another one must be read by the flatten before the caching allocator hands their memory to new work there.

    The forward (so the backward) runs on a side stream and backward() is called from the default stream, which a
    sleep holds back: without overlap_comm the end-of-backward flush is enqueued on the default stream behind the
    sleep, while the side stream runs on. Right after backward, new tensors of the gradients' sizes are filled with
    1e4 on the side stream: where the allocator reused a gradient's memory before the flatten read it, the grad
    buffer holds 1e4s. With overlap_comm the flush runs in the hook on the side stream itself. The grad buffer
    must hold the gradients a separate copy of the model gets on the default stream. On CPU the same steps run
    without streams (nothing to race): it keeps the check working between GPU runs."""
    import contextlib
    torch.manual_seed(0)
    model = _model(device)
    reference = _model(device)
    opt = tritonshard.ShardedAdamW(model.parameters(), lr=1e-3, overlap_comm=overlap, bucket_cap_mb=0.05)
    reference = reference.to(torch.bfloat16)
    reference.load_state_dict(model.state_dict())
    x = torch.randn(32, 257, device=device, dtype=torch.bfloat16)
    cuda = device.type == "cuda"
    side = torch.cuda.Stream(device) if cuda else None
    on_side = (lambda: torch.cuda.stream(side)) if cuda else contextlib.nullcontext
    reference(x).float().square().mean().backward()
    want = {id(p): r.grad for p, r in zip(model.parameters(), reference.parameters())}
    shapes = [p.shape for p in model.parameters()]
    for step in range(3):
        if cuda:
            side.wait_stream(torch.cuda.current_stream(device))
        with on_side():
            loss = model(x).float().square().mean()
        if cuda:
            torch.cuda._sleep(100_000_000)  # ~50 ms at 2 GHz: the default stream's flush runs late
        loss.backward()
        with on_side():
            junk = [torch.full(shape, 1e4, device=device, dtype=torch.bfloat16) for shape in shapes]
        if cuda:
            torch.cuda.synchronize()
        for b in opt.buckets:
            for p, view in zip(b.params, b.grad_buffer.get_views()):
                # the same bf16 gradients, up to the order of the matmuls' sums (a second model, other launches);
                # a reused gradient's memory would hold 1e4s
                if not torch.allclose(view.float(), want[id(p)].float(), rtol=1e-2, atol=1e-3):
                    worst = float((view.float() - want[id(p)].float()).abs().max())
                    raise AssertionError(f"step {step}: a gradient in bucket {b.index} differs from the reference "
                                         f"by up to {worst:.3g} (1e4 = memory reused before the flatten read it)")
        del junk
        opt.zero_grad()  # (no step: the model's weights stay those of the reference)
    where = "forward and backward on a side stream, flush " + ("in the hooks" if overlap else "on the default stream")
    return f"side-stream gradients{', overlap_comm' if overlap else ''}: 3 backwards ({where if cuda else 'no CUDA'})" \
           ", grad buffers equal the reference"


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
            comm.destroy_process_group()  # (a collection first: see there)


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
    if device.type == "cuda":
        print("sync_check: side-stream control: an unprotected copy "
              + ("read reused memory (the check below can fail)" if race_reproduces(device)
                 else "did NOT read reused memory: the side-stream check below proves nothing here"), flush=True)
    for overlap in (False, True):
        try:
            print("sync_check: " + side_stream_check(overlap, device), flush=True)
        except Exception as exc:  # noqa: BLE001
            failed += 1
            print(f"sync_check: FAILED side-stream gradients (overlap_comm={overlap}): {type(exc).__name__}: {exc}",
                  flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
