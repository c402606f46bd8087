"""What a ShardedAdamW step hands Triton's compiled launchers, with and without bound launches (issue 20).

Run by tests/optim/test_launch_plans.py in a subprocess with TRITON_INTERPRET unset (the compiled path; the dry-run
driver of benchmarks.compile_check compiles for sm_90 and records every launch instead of running it). Prints one
JSON object: per recorded step, the launches as (kernel, normalized arguments).
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from triton.backends.compiler import GPUTarget
from triton.runtime import driver

from benchmarks.compile_check import DryRunDriver


class RecordingDriver(DryRunDriver):
    """The dry-run driver, its launcher recording what it is handed."""

    def __init__(self, target):
        super().__init__(target)
        self.calls: list = []

        def launcher_cls(src, metadata):
            name = metadata.name

            def launch(*args, **kwargs):
                self.calls.append((name, args))
            return launch
        self.launcher_cls = launcher_cls


def _normal(x):
    """An argument as comparable data: tensors by storage, dtype and shape; floats by their bits."""
    if isinstance(x, torch.Tensor):
        return ["tensor", x.data_ptr(), str(x.dtype), list(x.shape)]
    if isinstance(x, float):
        return ["float", x.hex()]
    if isinstance(x, (int, bool, str)) or x is None:
        return x
    if isinstance(x, (tuple, list)):
        return [_normal(v) for v in x]
    return ["object", type(x).__name__, id(x)]


def _launches(calls):
    # (grid x3, stream, function, packed metadata, launch metadata, enter hook, exit hook, kernel arguments...):
    # the launch metadata is built per launch for the launch hooks, which are empty here: compared by type only
    return [[name, [_normal(a) if i != 6 else type(a).__name__ for i, a in enumerate(args)]] for name, args in calls]


def main() -> None:
    from tritonshard import ShardedAdamW
    from tritonshard.kernels import _dispatch, _launch
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    rec = RecordingDriver(GPUTarget("cuda", 90, 32))
    driver.set_active(rec)
    out = {}
    with _dispatch.compile_for_target():
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(n)) for n in (4099, 199, 1, 12_289, 640)]
        # bf16 states with stochastic rounding: the seed tensor is an argument too; two groups, several buckets
        opt = ShardedAdamW([{"params": params[:3]}, {"params": params[3:], "lr": 5e-4, "weight_decay": 0.0}],
                           lr=1e-3, bucket_cap_mb=5000 * 2 / 2 ** 20, state_dtype=torch.bfloat16)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
        grads = [torch.randn(p.shape).to(torch.bfloat16) for p in params]
        step = _stepper(rec, opt, sched, params, grads)
        _launch.set_bound_launches(False)
        out["buckets"] = len(opt.buckets)
        out["triton_dispatch"] = [step(), step()]   # every launch through Triton's own dispatch
        _launch.set_bound_launches(True)
        out["binding"] = [step(), step()]           # checked launch, then the recording one
        out["bound"] = [step(), step()]             # replayed
        for g in opt.param_groups:                  # a hyper-parameter changes: the launches must rebind
            g["betas"] = (0.8, 0.99)
        out["new_betas"] = [step(), step(), step()]
        _launch.set_bound_launches(False)
        out["new_betas_triton_dispatch"] = [step()]
        _launch.set_bound_launches(True)
        out["no_clip"] = [step(clip=False), step(clip=False), step(clip=False)]  # grad_scale becomes a number
        _launch.set_bound_launches(False)
        out["no_clip_triton_dispatch"] = [step(clip=False)]
        _launch.set_bound_launches(True)
        out["transposed"] = _transposed(rec)
        out["new_addresses"] = _new_addresses(rec)
        out["sgd"] = _other_optimizer(rec, "ShardedSGD", dict(momentum=0.9, weight_decay=1e-2, nesterov=True))
        out["lion"] = _other_optimizer(rec, "ShardedLion", dict(weight_decay=0.1, state_dtype=torch.bfloat16))
        out["adamw_overlap"] = _other_optimizer(rec, "ShardedAdamW", dict(overlap_comm=True,
                                                                          state_dtype=torch.bfloat16))
        out["torch_clip"] = _torch_clip(rec)
    json.dump(out, sys.stdout)
    from tritonshard.comm import destroy_process_group
    destroy_process_group()  # (freed now: at interpreter shutdown gloo can abort, failing the exit code)


def _other_optimizer(rec, name: str, kwargs: dict) -> dict:
    """ShardedSGD / ShardedLion (or ShardedAdamW with other options) steps under an LR schedule (the lr changes every step): through Triton's dispatch,
    then bound (the checked launch, the recording one, replays)."""
    import tritonshard
    from tritonshard.kernels import _launch
    torch.manual_seed(1)
    params = [torch.nn.Parameter(torch.randn(n)) for n in (4099, 199, 12_289)]
    opt = getattr(tritonshard, name)(params, lr=1e-3, bucket_cap_mb=5000 * 2 / 2 ** 20, **kwargs)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    grads = [torch.randn(p.shape).to(torch.bfloat16) for p in params]
    step = _stepper(rec, opt, sched, params, grads)
    _launch.set_bound_launches(False)
    dispatch = [step(), step()]
    _launch.set_bound_launches(True)
    return {"buckets": len(opt.buckets), "dispatch": dispatch, "bound": [step(), step(), step(), step()]}


def _torch_clip(rec) -> dict:
    """Steps with torch's clip_grad_norm_ over param.grad (HF Trainer's, accelerate's), each step's kernels by
    name: plain, and with a clip_grad_value_ first (the shards changed since the reduction: the per-parameter
    norms read the pieces again)."""
    from tritonshard import ShardedAdamW
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(64, 67), torch.nn.Tanh(), torch.nn.Linear(67, 5))
    params = list(model.parameters())
    opt = ShardedAdamW(params, lr=1e-3, bucket_cap_mb=1e-9)  # (a bucket per parameter)
    x = torch.randn(3, 64).to(torch.bfloat16)
    steps = []
    for clamp in (False, False, False, True, True, True):
        model(x).float().square().mean().backward()  # (a backward's gradients: placeholders, which torch's clip
        if clamp:                                     # asks for their norms)
            torch.nn.utils.clip_grad_value_(params, 1e30)
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad()
        calls, rec.calls = rec.calls, []
        steps.append({"clamp": clamp, "kernels": [name for name, _ in calls]})
    return {"buckets": len(opt.buckets), "steps": steps}


def _stepper(rec, opt, sched, params, grads):
    """step(clip=True): one recorded optimizer step (gradients set by hand), its launches and how many replayed."""
    from tritonshard.kernels import _launch

    def step(clip=True):
        before = _launch.replays
        lrs = [float(g["lr"]) for g in opt.param_groups]  # (this step's: the scheduler steps after it)
        decays = [float(g["weight_decay"]) for g in opt.param_groups]
        for p, g in zip(params, grads):
            p.grad = g
        norm = opt.clip_grad_norm_(1.0) if clip else None  # (a new tensor per clip, which its launch writes)
        opt.step()
        sched.step()
        opt.zero_grad()
        calls, rec.calls = rec.calls, []
        return {"launches": _launches(calls), "replays": _launch.replays - before, "lrs": lrs, "decays": decays,
                "norm": None if norm is None else _normal(norm)}
    return step


def _transposed(rec) -> dict:
    """The flatten's plan is found by the gradients' addresses: a gradient at the same address that is not
    contiguous (a square matrix's transpose set by hand) must not reuse it. Records the pointer table the flatten
    launch reads (the source addresses) per step."""
    from tritonshard import ShardedAdamW
    square = torch.nn.Parameter(torch.randn(64, 64))
    opt = ShardedAdamW([square], lr=1e-3)
    g = torch.randn(64, 64).to(torch.bfloat16)
    tables = []
    for grad in (g, g, g, g.t(), g):
        square.grad = grad
        opt.step()
        opt.zero_grad()
        calls, rec.calls = rec.calls, []
        tables.append([args[9].tolist() for name, args in calls if name == "_flatten_kernel"])
    return {"grad_address": g.data_ptr(), "tables": tables}


def _new_addresses(rec) -> dict:
    """Gradients at new addresses every step (the earlier ones kept, so the allocator cannot hand the blocks back):
    the flatten's plan rewrites its own address table and replays its launch (per step: the launches, how many
    replayed, the table the flatten read and the addresses it should hold)."""
    from tritonshard import ShardedAdamW
    from tritonshard.kernels import _launch
    torch.manual_seed(2)
    params = [torch.nn.Parameter(torch.randn(n)) for n in (4099, 199, 640)]
    opt = ShardedAdamW(params, lr=1e-3)
    kept, steps = [], []
    for _ in range(5):
        grads = [torch.randn(p.shape).to(torch.bfloat16) for p in params]
        kept.append(grads)
        before = _launch.replays
        for p, g in zip(params, grads):
            p.grad = g
        opt.step()
        opt.zero_grad()
        calls, rec.calls = rec.calls, []
        steps.append({"launches": len(calls), "replays": _launch.replays - before,
                      "table": [args[9].tolist() for name, args in calls if name == "_flatten_kernel"],
                      "addresses": [g.data_ptr() for g in grads]})
    return {"steps": steps}


if __name__ == "__main__":
    main()
