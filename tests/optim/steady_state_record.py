"""What a steady-state optimizer step allocates and copies from the host, on the GPU code path (issue 20.6).

Run by tests/optim/test_steady_state.py in a subprocess with TRITON_INTERPRET unset: the compiled path on CPU
tensors through benchmarks.compile_check's dry-run driver (every launch compiled for sm_90, none run), in a 1-rank
gloo group. A TorchDispatchMode sees every aten op of the step (kernel launches are not aten ops: what it sees is the
optimizer's own tensor work) and records those whose output is a new tensor (an allocation) and those that make a
tensor from host data (a host-to-device copy on a GPU). Prints one JSON object: per configuration, the ops of the
steps after the first three.
"""

from __future__ import annotations

import collections
import json
import sys

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from triton.backends.compiler import GPUTarget
from triton.runtime import driver

from benchmarks.compile_check import DryRunDriver

#: ops that build a tensor from host (Python) data: torch.tensor(...), a Python scalar made a tensor
FROM_HOST = ("aten.lift_fresh", "aten.lift_fresh_copy", "aten.scalar_tensor")


class Recorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.allocations: collections.Counter = collections.Counter()
        self.from_host: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = str(func.overloadpacket) if hasattr(func, "overloadpacket") else str(func)
        if name.startswith(FROM_HOST):
            self.from_host[name] += 1
        inputs = {t.untyped_storage().data_ptr() for a in (*args, *kwargs.values())
                  for t in (a if isinstance(a, (list, tuple)) else (a,)) if isinstance(t, torch.Tensor)}
        for t in out if isinstance(out, (list, tuple)) else (out,):
            # a new storage (views and in-place / out= results share an input's); empty outputs allocate nothing
            if isinstance(t, torch.Tensor) and t.numel() and t.untyped_storage().data_ptr() not in inputs:
                self.allocations[name] += 1
        return out


def _run(name: str, kind: str, **options) -> dict:
    import tritonshard
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n)) for n in (4099, 199, 12_289, 640, 7)]
    groups = [{"params": params[:3]}, {"params": params[3:], "weight_decay": 0.0}]
    extra = {"sgd": dict(momentum=0.9, nesterov=True)}.get(kind, {})
    opt = getattr(tritonshard, kind)(groups, lr=1e-3, bucket_cap_mb=5000 * 2 / 2 ** 20, **extra, **options)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))  # the lr changes every step
    dtype = options.get("param_dtype", torch.bfloat16)
    # the same gradient tensors every step, as the caching allocator gives backward the same addresses (at new ones
    # the flatten uploads their address table: the backward's work, not the step's); with loss scaling, those of a
    # loss multiplied by the scale (which stays put: no overflow, growth only after 2000 steps)
    scale = float(opt.loss_scale) if opt.loss_scale is not None else 1.0
    grads = [(torch.randn(p.shape) * 1e-3 * scale).to(dtype) for p in params]
    norms = []

    def step():
        for p, g in zip(params, grads):
            p.grad = g
        norms.append(opt.clip_grad_norm_(1.0))
        opt.step()
        sched.step()
        opt.zero_grad()

    for _ in range(3):
        step()
    recorder = Recorder()
    for _ in range(2):
        for p, g in zip(params, grads):  # (setting the gradients is the test's own work, outside the record)
            p.grad = g
        with recorder:
            norms.append(opt.clip_grad_norm_(1.0))
            opt.step()
        sched.step()
        opt.zero_grad()
    distinct = len({n.data_ptr() for n in norms})
    return {"name": name, "buckets": len(opt.buckets), "allocations": dict(recorder.allocations),
            "from_host": dict(recorder.from_host), "distinct_norms": distinct, "norms": len(norms)}


def main() -> None:
    from tritonshard.kernels import _dispatch
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    driver.set_active(DryRunDriver(GPUTarget("cuda", 90, 32)))
    out = []
    with _dispatch.compile_for_target():
        out.append(_run("adamw", "ShardedAdamW"))
        out.append(_run("adamw, bf16 states", "ShardedAdamW", state_dtype=torch.bfloat16))
        out.append(_run("adamw, overlap_comm", "ShardedAdamW", overlap_comm=True))
        out.append(_run("sgd", "ShardedSGD"))
        out.append(_run("lion", "ShardedLion"))
        out.append(_run("adamw, fp16 with loss scaling", "ShardedAdamW", param_dtype=torch.float16))
    json.dump(out, sys.stdout)
    from tritonshard.comm import destroy_process_group
    destroy_process_group()  # (freed now: at interpreter shutdown gloo can abort, failing the exit code)


if __name__ == "__main__":
    main()
