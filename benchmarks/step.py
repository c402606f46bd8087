"""End-to-end optimizer step on transformer-shaped parameter sets: ShardedAdamW vs fused torch.optim.AdamW (fp32)
vs FSDP2 ``fully_shard`` with bf16 parameters, and ShardedMuon vs torch.optim.Muon + AdamW (fp32), with peak
memory and, for Muon, the Newton-Schulz share of the step.

    python -m benchmarks.step --model 125M --out benchmarks/out      # GPU
    python -m benchmarks.step --model tiny --out /tmp/bench          # CPU smoke run (CI)

One process, a 1-rank process group (world size 1): the step is flatten -> reduce-scatter -> scale -> update ->
all-gather with trivial collectives, i.e. the kernels' share of a real step. Gradients are set as ``param.grad``
before every timed step (the flatten is part of the step, as when grads arrive from backward).

Order: ShardedAdamW, fused torch AdamW, then ShardedAdamW's kernel table, bucket sweep, host timeline and scalars'
side by side, then FSDP2 and the Muons; SIGTERM (the GPU check's ``timeout``) or Ctrl-C stops it, and what was
measured is still written (JSON and ``--markdown``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import time

import torch

import tritonshard
from tritonshard import comm
from tritonshard.comm import local_device

SHAPES = {  # (n_layer, d_model, vocab) of GPT-2-like configs; per layer 12 d^2 + 13 d parameters
    "tiny": (2, 64, 512),
    "125M": (12, 768, 50304),
    "1B": (24, 2048, 50304),
}


def gpt_param_shapes(n_layer: int, d: int, vocab: int) -> list[tuple[int, ...]]:
    shapes = [(vocab, d), (1024, d)]
    for _ in range(n_layer):
        shapes += [(d,), (d,), (3 * d, d), (3 * d,), (d, d), (d,), (d,), (d,), (4 * d, d), (4 * d,), (d, 4 * d), (d,)]
    return shapes + [(d,), (d,)]


#: untimed calls before the timed ones: a ShardedOptimizer's step reaches its steady state at the third (the first
#: launches every kernel through its checked launcher and allocates the state, the second records the bound
#: launches through Triton's own path, the third replays them; kernels/_launch.py). With one, a 5-rep median could
#: hold the recording step: on the H200 (2026-12-04) the 125M step read 2.68 ms here and 2.07 in the sweep
WARMUP = 3


def timed(fn, device, reps: int) -> float:
    for _ in range(WARMUP):
        fn()
    return statistics.median(host_and_wall(fn, device)[1] for _ in range(reps))


def timed_host(fn, device, reps: int) -> tuple[float, float]:
    """(host seconds, wall seconds), medians: host = until ``fn`` returns (what the CPU spends launching), wall =
    until the device has finished too. host ~ wall means the GPU waits on Python (host-bound)."""
    return timed_after(lambda: None, fn, device, reps)


def host_and_wall(fn, device) -> tuple[float, float]:
    """One call of ``fn`` from an idle device: (seconds until it returns, seconds until the device is done too)."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    host = time.perf_counter() - t0
    if device.type == "cuda":
        torch.cuda.synchronize()
    return host, time.perf_counter() - t0


def bench_bucket_sweep(shapes, device, reps, caps, graph_caps=()) -> list[dict]:
    """ShardedAdamW's step at each ``bucket_cap_mb``: host and wall ms, buckets (issue 20's measure); at each of
    ``graph_caps`` also with ``cuda_graph=True`` (CUDA only; the warm-up steps capture, the timed ones replay)."""
    rows = []
    runs = [(cap, False) for cap in caps]
    runs += [(cap, True) for cap in graph_caps if device.type == "cuda"]
    for cap, graphed in runs:
        name = f"ShardedAdamW bucket_cap_mb={cap:g}" + (", cuda_graph" if graphed else "")
        try:
            rows.append(_sweep_row(shapes, device, reps, cap, graphed, name))
        except Exception as exc:  # noqa: BLE001 -- a graph that fails to capture must not cost the other rows
            if not graphed:
                raise
            rows.append({"impl": name, "error": f"{type(exc).__name__}: {exc}"})
    return rows


def bench_params(shapes, device) -> list:
    """The parameters every implementation steps: N(0, 0.02) of ``shapes``, fp32 (tritonshard's optimizers make
    them bf16)."""
    return [torch.nn.Parameter(torch.randn(s, device=device) * 0.02) for s in shapes]


def bf16_grads(shapes, device) -> list:
    """The bf16 gradients a tritonshard step is timed with (:func:`sharded_step`), N(0, 1e-3)."""
    return [torch.randn(s, device=device).to(torch.bfloat16) * 1e-3 for s in shapes]


def _sweep_row(shapes, device, reps, cap, graphed, name) -> dict:
    reset_peak(device)
    params = bench_params(shapes, device)
    opt = tritonshard.ShardedAdamW(params, lr=1e-4, bucket_cap_mb=cap, cuda_graph=graphed)
    grads = bf16_grads(shapes, device)
    step = sharded_step(opt, params, grads)
    if graphed:
        step()  # (then timed_host's warm-up: the first sight, the capture, replays)
    host, wall = timed_host(step, device, reps)
    return {"impl": name, "bucket_cap_mb": cap, "cuda_graph": graphed, "buckets": len(opt.buckets),
            "host_ms": host * 1e3, "wall_ms": wall * 1e3, "step_ms": wall * 1e3,
            "host_us_per_bucket": host * 1e6 / len(opt.buckets), "peak_bytes": peak_bytes(device),
            "graph_replays": opt._graphs.replays if graphed else 0}


def bench_scalars_ab(shapes, device, reps: int, cap: float) -> dict:
    """ShardedAdamW's step with the step's scalars in single-program launches (kernels/scalars.py, session 34: the
    clip coefficient, the flags and counters, grad_scale) against the same step with the torch ops they replace (a
    launch each on a GPU), side by side: two optimizers on their own copies, their steps taking turns, so that the
    host's drift (10-30 % between rounds on the H200) falls on both alike. Host and wall ms, medians."""
    runs = {}
    for kernels in (True, False):
        params = bench_params(shapes, device)
        opt = tritonshard.ShardedAdamW(params, lr=1e-4, bucket_cap_mb=cap)
        if not kernels:
            opt._scalar_kernels_run = lambda: False  # (the instance's: the torch ops, as before session 34)
        runs[kernels] = (opt, sharded_step(opt, params, bf16_grads(shapes, device)), [], [])
    for _ in range(WARMUP):
        for _, step, _, _ in runs.values():
            step()
    for _ in range(reps):
        for _, step, host, wall in runs.values():
            h, w = host_and_wall(step, device)
            host.append(h)
            wall.append(w)
    row = {"impl": f"ShardedAdamW bucket_cap_mb={cap:g}, step scalars: kernels vs torch ops", "scalars_cap_mb": cap,
           "buckets": len(runs[True][0].buckets)}
    for kernels, (opt, _, host, wall) in runs.items():
        side = "kernels" if kernels else "torch_ops"
        row.update({f"{side}_host_ms": statistics.median(host) * 1e3, f"{side}_wall_ms": statistics.median(wall) * 1e3,
                    f"{side}_scalar_launches": len(opt._scalar_launches)})
    return row


#: the optimizer's calls whose entry and exit the host timeline marks (see :func:`host_timeline`)
TIMELINE_CALLS = ("clip_grad_norm_", "_flush_buckets", "_run_reduction", "step", "_before_update", "_update_phase",
                  "zero_grad")


def host_timeline(opt, params, grads, device, reps: int) -> dict:
    """Where one step's host time goes, in order (issue 20: the 125M step is host-bound on the H200, its wall =
    the host's time to the update's launch + the update): :func:`sharded_step`'s calls, each of ``TIMELINE_CALLS``
    entered and left and every bound kernel launch (kernels/_launch.py), as microseconds from the step's start,
    each event's minimum over ``reps`` steps from an idle device (the host's drift falls out; the events come in
    the same order every steady step). The same function runs on a GPU (``--host-timeline``) and through the
    dry-run driver on a CPU (benchmarks.host_overhead, also in the GPU check's host stage, on the GPU machine's
    own CPU): the difference between the two on one machine is what only CUDA costs (launches, small torch ops,
    events), between machines the CPUs' speed. The marks cost ~1 us each (a list append and a clock read)."""
    from tritonshard.kernels import _launch
    log = []
    clock = time.perf_counter

    def marked(name):
        call = getattr(opt, name)

        def mark(*args, **kwargs):
            log.append((clock(), f"> {name}"))
            try:
                return call(*args, **kwargs)
            finally:
                log.append((clock(), f"< {name}"))
        return mark

    real_launch = _launch.launch

    def launch(cache, key, spec, first, **options):
        kernel = getattr(spec[0], "fn", spec[0])
        log.append((clock(), f"launch {getattr(kernel, '__name__', kernel)}"))
        real_launch(cache, key, spec, first, **options)

    for name in TIMELINE_CALLS:  # (instance attributes: the class's methods again once deleted below)
        setattr(opt, name, marked(name))
    _launch.launch = launch
    runs, walls = [], []
    try:
        for i in range(WARMUP + reps):
            if device.type == "cuda":
                torch.cuda.synchronize()
            log.clear()
            t0 = clock()
            for p, g in zip(params, grads):
                _SET_GRAD(p, g)
            log.append((clock(), "gradients set"))
            opt.clip_grad_norm_(1.0)
            opt.step()
            opt.zero_grad()
            log.append((clock(), "zero_grad returned"))
            if device.type == "cuda":
                torch.cuda.synchronize()
            walls.append(clock() - t0)
            if i >= WARMUP:
                runs.append([(t - t0, name) for t, name in log])
    finally:
        _launch.launch = real_launch
        for name in TIMELINE_CALLS:
            delattr(opt, name)
    names = [name for _, name in runs[0]]
    if any([name for _, name in run] != names for run in runs):
        raise RuntimeError("the host timeline's events changed between steady steps: " + repr(names))
    events = [{"event": name, "us": min(run[j][0] for run in runs) * 1e6} for j, name in enumerate(names)]
    return {"impl": "ShardedAdamW host timeline", "events": events, "buckets": len(opt.buckets),
            "tensors": len(params), "wall_us": min(walls[WARMUP:]) * 1e6, "reps": reps,
            "host_ops": host_ops(sharded_step(opt, params, grads), device, reps)}


def host_ops(step, device, reps: int, top: int = 20) -> list:
    """What the host runs in ``step`` that is not our Python: torch.profiler's host events (aten ops; on CUDA also
    the runtime and driver calls: cudaLaunchKernel, cuLaunchKernelEx, event records, copies), each name's self
    time and calls per step over ``reps`` steps, the ``top`` by self time. The H200's 125M step spent ~1.5 ms of
    host time where the same step through the dry-run driver on a CPU of about the same speed spends ~0.5 ms
    (2026-12-04): this table says which calls only CUDA pays for (the profiler adds ~1-2 us per op, so read the
    counts and the order, not the sums)."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":  # (the runtime and driver calls are recorded with the CUDA activity)
        activities.append(torch.profiler.ProfilerActivity.CUDA)
        torch.cuda.synchronize()
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(reps):
            step()
        if device.type == "cuda":
            torch.cuda.synchronize()
    rows = [{"op": e.key, "self_us_per_step": e.self_cpu_time_total / reps, "calls_per_step": e.count / reps}
            for e in prof.key_averages()
            # (not the ranges the optimizer opens while a profiler records: their self time is our Python)
            if e.self_cpu_time_total > 0 and not e.key.startswith(("ProfilerStep", "tritonshard.", "Optimizer."))]
    rows.sort(key=lambda r: -r["self_us_per_step"])
    return rows[:top]


def timeline_markdown(row: dict, title: str) -> list[str]:
    """:func:`host_timeline`'s row as a table: each event's host microseconds from the step's start, and since the
    event before it."""
    if "error" in row:
        return ["", f"{title}: did not run: {row['error']}"]
    buckets = f"{row['buckets']} bucket" + ("s" if row["buckets"] != 1 else "")
    lines = ["", f"{title} ({row['tensors']} tensors, {buckets}; each event's minimum over "
             f"{row['reps']} steps from an idle device, us from the step's start; the fastest step's wall "
             f"{row['wall_us']:.0f} us):", "", "| us | + us | event |", "|---:|---:|---|"]
    last = 0.0
    for e in row["events"]:
        lines.append(f"| {e['us']:.0f} | {e['us'] - last:.0f} | {e['event']} |")
        last = e["us"]
    if row.get("host_ops"):
        lines += ["", f"The same step's host calls under torch.profiler (self time and calls per step, mean of "
                  f"{row['reps']} steps; the profiler adds ~1-2 us per call):", "",
                  "| call | self us per step | calls per step |", "|---|---:|---:|"]
        lines += [f"| `{r['op'][:80]}` | {r['self_us_per_step']:.1f} | {r['calls_per_step']:g} |"
                  for r in row["host_ops"]]
    return lines


def kernel_breakdown(shapes, device, reps: int) -> dict:
    """Where one ShardedAdamW step's time goes, kernel by kernel (default ``bucket_cap_mb``): ``reps`` steps under
    torch.profiler, each kernel's device time per step (its launches summed), its launches per step, and its share
    of the device's busy time. On the H200 the 1B step is device-bound (13.5 ms wall, ~3.8 ms host; 2026-12-04)
    while its update alone needs ~9.1 ms at the copy bandwidth: this says which kernel takes the rest. Off CUDA the
    same table from the host ranges of the kernel launchers (``tritonshard.kernel.*``): the harness's smoke, not a
    measurement."""
    params = bench_params(shapes, device)
    opt = tritonshard.ShardedAdamW(params, lr=1e-4)
    grads = bf16_grads(shapes, device)
    step = sharded_step(opt, params, grads)
    for _ in range(WARMUP):
        step()
    cuda = device.type == "cuda"
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    if cuda:
        torch.cuda.synchronize()
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(reps):
            step()
        if cuda:
            torch.cuda.synchronize()
    totals: dict = {}
    for e in prof.events():
        if cuda:
            # (the device timeline also mirrors the host's ranges, record_function's: Optimizer.step#...,
            # tritonshard.kernel.*; on the H200 they doubled every kernel's row, 2026-12-04)
            if (e.device_type != torch.autograd.DeviceType.CUDA or getattr(e, "is_user_annotation", False)
                    or e.name.startswith(("tritonshard.", "Optimizer."))):
                continue
            name = e.name
        elif e.name.startswith("tritonshard.kernel."):
            name = e.name.removeprefix("tritonshard.kernel.")
        else:
            continue
        us, calls = totals.get(name, (0.0, 0))
        totals[name] = (us + (e.time_range.end - e.time_range.start), calls + 1)
    busy = sum(us for us, _ in totals.values()) or 1.0
    kernels = [{"kernel": name, "ms_per_step": us / reps / 1e3, "launches_per_step": calls / reps,
                "share": us / busy} for name, (us, calls) in sorted(totals.items(), key=lambda kv: -kv[1][0])]
    return {"impl": "ShardedAdamW per kernel", "kernels": kernels, "busy_ms_per_step": busy / reps / 1e3,
            "buckets": len(opt.buckets), "timeline": "device" if cuda else "host (launcher ranges)"}


def peak_bytes(device) -> int:
    # the no-argument forms, on the current device (main() made `device` current): given a device, these calls
    # raised "Invalid device argument" on the H200 with torch 2.11 (2026-11-30)
    return torch.cuda.max_memory_allocated() if device.type == "cuda" else 0


def reset_peak(device):
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


#: ``param.grad = g`` through the C setter, as autograd's AccumulateGrad stores a gradient: not through the Python
#: ``__setattr__`` of tritonshard's parameter class, which notes a loop's assignment for a compiled step (~0.2 us
#: each, session 24) and is no part of a training step's backward
_SET_GRAD = torch._C.TensorBase.grad.__set__


def sharded_step(opt, params, grads):
    """One step of a tritonshard optimizer as the benchmarks time it: ``grads`` set as ``param.grad`` (the step
    flattens them), clip, step, zero_grad."""
    def step():
        for p, g in zip(params, grads):
            _SET_GRAD(p, g)
        opt.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
    return step


def time_sharded_step(opt, params, shapes, device, reps) -> float:
    """Seconds per step of a tritonshard optimizer: bf16 gradients set as ``param.grad``, clip, step, zero_grad."""
    grads = bf16_grads(shapes, device)
    return timed(sharded_step(opt, params, grads), device, reps)


def time_torch_step(optimizers, params, shapes, device, reps) -> float:
    """Seconds per step of torch optimizers on fp32 ``params``: fp32 gradients set as ``param.grad``, torch's
    clip_grad_norm_ over all of them, every optimizer's step and zero_grad."""
    grads = [torch.randn(s, device=device) * 1e-3 for s in shapes]

    def step():
        for p, g in zip(params, grads):
            p.grad = g
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        for opt in optimizers:
            opt.step()
        for opt in optimizers:
            opt.zero_grad()
    return timed(step, device, reps)


def bench_ours(shapes, device, reps, grad_dtype=torch.bfloat16):
    reset_peak(device)
    params = bench_params(shapes, device)
    opt = tritonshard.ShardedAdamW(params, lr=1e-4, grad_dtype=grad_dtype)
    t = time_sharded_step(opt, params, shapes, device, reps)
    what = "bf16 params+grads" if grad_dtype == torch.bfloat16 else "bf16 params, fp32 grads"
    return {"impl": f"tritonshard.ShardedAdamW ({what}, fp32 master)", "step_ms": t * 1e3,
            "peak_bytes": peak_bytes(device), "optimizer_bytes": opt.memory_bytes()["total"]}


def bench_ours_fp32_grads(shapes, device, reps):
    """grad_dtype=torch.float32 (README: many ranks): the flatten writes 4 B per gradient element instead of 2, the
    norm pass and the update read them (30 B per element of the update instead of 28)."""
    return bench_ours(shapes, device, reps, grad_dtype=torch.float32)


class _GradsFrom(torch.autograd.Function):
    """A backward whose gradients are the given tensors: autograd's AccumulateGrad copies each into its parameter's
    ``.grad`` (a new tensor, as every backward's) and the optimizer's hooks flush them at its end, so ``param.grad``
    holds tritonshard's placeholders afterwards, as after a real backward (where torch's clip finds them)."""

    @staticmethod
    def forward(ctx, grads, *params):
        ctx.grads = grads
        return params[0].new_zeros(())

    @staticmethod
    def backward(ctx, _):
        return (None, *ctx.grads)


def timed_after(prepare, fn, device, reps: int) -> tuple[float, float]:
    """:func:`timed_host` of ``fn``, with ``prepare()`` before each call (untimed: ``host_and_wall`` starts from an
    idle device)."""
    for _ in range(WARMUP):
        prepare()
        fn()
    host, wall = [], []
    for _ in range(reps):
        prepare()
        h, w = host_and_wall(fn, device)
        host.append(h)
        wall.append(w)
    return statistics.median(host), statistics.median(wall)


def _after_backward(shapes, device, reps, clip: str) -> dict:
    """ShardedAdamW's clip + step + zero_grad after a backward (untimed, its flush included): the loop of the HF
    Trainer and accelerate, whose clip is torch's ``clip_grad_norm_`` over ``param.grad`` (``clip="torch"``, with
    foreach=True, its default on CUDA), beside the optimizer's own clip (``clip="opt"``) in the same harness."""
    reset_peak(device)
    params = bench_params(shapes, device)
    opt = tritonshard.ShardedAdamW(params, lr=1e-4)
    grads = bf16_grads(shapes, device)

    def backward():
        _GradsFrom.apply(grads, *params).backward()

    def step():
        if clip == "torch":
            torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        else:
            opt.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
    host, wall = timed_after(backward, step, device, reps)
    how = "torch.nn.utils.clip_grad_norm_(foreach=True) over param.grad (HF Trainer's)" if clip == "torch" else \
        "opt.clip_grad_norm_"
    return {"impl": f"tritonshard.ShardedAdamW after a backward: {how} + step + zero_grad", "step_ms": wall * 1e3,
            "host_ms": host * 1e3, "peak_bytes": peak_bytes(device),
            "note": f"host {host * 1e3:.2f} ms; the backward's flush not timed"}


def bench_after_backward(shapes, device, reps):
    return _after_backward(shapes, device, reps, "opt")


def bench_hf_clip(shapes, device, reps):
    return _after_backward(shapes, device, reps, "torch")


def muon_split(shapes):
    """The blocks' matrices (Muon) and the rest: embeddings and positions (the first two shapes), norms, biases."""
    muon = [i for i, s in enumerate(shapes) if len(s) == 2 and i >= 2]
    return muon, [i for i in range(len(shapes)) if i not in muon]


def newton_schulz_ms(shapes, device, reps) -> float:
    """Newton-Schulz alone on bf16 matrices of ``shapes`` (what one rank orthogonalizes at world size 1)."""
    from tritonshard.kernels import newton_schulz
    xs = [torch.randn(s, device=device).to(torch.bfloat16) for s in shapes]
    return timed(lambda: [newton_schulz(x) for x in xs], device, reps) * 1e3


def bench_muon(shapes, device, reps):
    reset_peak(device)
    params = bench_params(shapes, device)
    mi, ai = muon_split(shapes)
    opt = tritonshard.ShardedMuon([{"params": [params[i] for i in mi]},
                                   {"params": [params[i] for i in ai], "use_muon": False, "lr": 3e-4}],
                                  lr=0.02, adjust_lr_fn="match_rms_adamw")
    t = time_sharded_step(opt, params, shapes, device, reps) * 1e3
    ns = newton_schulz_ms([shapes[i] for i in mi], device, reps)
    return {"impl": "tritonshard.ShardedMuon (Muon on blocks' matrices + AdamW, bf16 params+grads, fp32 master)",
            "step_ms": t, "peak_bytes": peak_bytes(device), "optimizer_bytes": opt.memory_bytes()["total"],
            "newton_schulz_ms": ns, "note": f"Newton-Schulz {ns:.2f} ms = {100 * ns / t:.0f}% of the step"}


def bench_torch_muon(shapes, device, reps):
    reset_peak(device)
    params = bench_params(shapes, device)
    mi, ai = muon_split(shapes)
    muon = torch.optim.Muon([params[i] for i in mi], lr=0.02, adjust_lr_fn="match_rms_adamw")
    adamw = torch.optim.AdamW([params[i] for i in ai], lr=3e-4, fused=True)
    t = time_torch_step([muon, adamw], params, shapes, device, reps) * 1e3
    n_muon, n = sum(params[i].numel() for i in mi), sum(p.numel() for p in params)
    return {"impl": "torch.optim.Muon + AdamW(fused) fp32", "step_ms": t, "peak_bytes": peak_bytes(device),
            "optimizer_bytes": 8 * n + 4 * n_muon + 8 * (n - n_muon)}  # params + grads, momentum, moments


def bench_torch(shapes, device, reps):
    reset_peak(device)
    params = bench_params(shapes, device)
    fused = True  # fused AdamW exists for CUDA and (torch >= 2.4) CPU
    opt = torch.optim.AdamW(params, lr=1e-4, fused=fused)
    t = time_torch_step([opt], params, shapes, device, reps)
    n = sum(p.numel() for p in params)
    return {"impl": f"torch.optim.AdamW(fused={fused}) fp32", "step_ms": t * 1e3, "peak_bytes": peak_bytes(device),
            "optimizer_bytes": 16 * n}


def bench_fsdp2(shapes, device, reps):
    """FSDP2 needs a process group and a module; one rank here."""
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if not dist.is_initialized():
        return {"impl": "FSDP2 fully_shard bf16", "error": "needs torch.distributed (main() starts a 1-rank group)"}
    reset_peak(device)
    module = torch.nn.Module()
    module.ps = torch.nn.ParameterList(bench_params(shapes, device))
    fully_shard(module, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    opt = torch.optim.AdamW(module.parameters(), lr=1e-4, fused=device.type == "cuda")
    grads = [torch.randn(p.shape, device=device) * 1e-3 for p in module.parameters()]

    def step():
        for p, g in zip(module.parameters(), grads):
            p.grad = torch.distributed.tensor.DTensor.from_local(g, p.device_mesh, p.placements)
        torch.nn.utils.clip_grad_norm_(list(module.parameters()), 1.0)
        opt.step()
        opt.zero_grad()
        module.unshard()  # the bf16 all-gather of the updated shards that the next forward would start with
        module.reshard()
    t = timed(step, device, reps)
    return {"impl": "FSDP2 fully_shard + fused AdamW (fp32 sharded params)", "step_ms": t * 1e3,
            "peak_bytes": peak_bytes(device),
            "note": "clip + update + bf16 all-gather (unshard); its reduce-scatter runs in backward hooks, "
                    "outside this step"}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=list(SHAPES), default="125M")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--out", default="benchmarks/out")
    p.add_argument("--markdown", help="append this model's table to FILE (gpu_check.sh's results.md)")
    p.add_argument("--bucket-caps", type=float, nargs="*", default=[],
                   help="also sweep ShardedAdamW's bucket_cap_mb over these values (host and wall ms per step)")
    p.add_argument("--graph-caps", type=float, nargs="*", default=[],
                   help="and at these bucket_cap_mb values with cuda_graph=True (CUDA only)")
    p.add_argument("--scalars-ab", type=float, metavar="CAP",
                   help="also, at this bucket_cap_mb, the step with its scalars in launches against the torch ops "
                        "(side by side, steps taking turns)")
    p.add_argument("--kernels", action="store_true",
                   help="also ShardedAdamW's step kernel by kernel (torch.profiler: device ms per step on CUDA)")
    p.add_argument("--host-timeline", action="store_true",
                   help="also where ShardedAdamW's step spends its host time, event by event (default bucket_cap_mb)")
    p.add_argument("--skip", nargs="*", default=[],
                   choices=["ours", "torch", "after_backward", "hf_clip", "fsdp2", "muon", "torch_muon",
                            "ours_fp32_grads"],
                   help="implementations to leave out (a GPU check short of time)")
    args = p.parse_args(argv)
    device = local_device()  # indexed on CUDA: device_id= below and the memory stats need the index
    if device.type == "cuda":
        torch.cuda.set_device(device)
    shapes = gpt_param_shapes(*SHAPES[args.model])
    n = sum(torch.Size(s).numel() for s in shapes)
    print(f"optimizer step, {args.model}: {n / 1e6:.1f}M parameters in {len(shapes)} tensors on {device}", flush=True)
    import torch.distributed as dist

    own_group = not dist.is_initialized()
    if own_group:  # a 1-rank group (NCCL on GPUs) so FSDP2 runs too; under torchrun, the launcher's group is used
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0,
                                world_size=1, device_id=device if device.type == "cuda" else None)
    rows = []
    where = dict(model=args.model, params=n, device=str(device))
    benches = {"ours": bench_ours, "torch": bench_torch, "fsdp2": bench_fsdp2, "muon": bench_muon,
               "torch_muon": bench_torch_muon, "after_backward": bench_after_backward, "hf_clip": bench_hf_clip,
               "ours_fp32_grads": bench_ours_fp32_grads}

    def implementations(keys):
        for key in keys:
            if key in args.skip:
                continue
            fn = benches[key]
            try:
                row = fn(shapes, device, args.reps)
            except Exception as exc:  # report, do not hide: the row says why it did not run
                row = {"impl": fn.__name__, "error": f"{type(exc).__name__}: {exc}"}
            row.update(where)
            rows.append(row)
            print("  " + ", ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()),
                  flush=True)

    def kernels():
        try:
            breakdown = kernel_breakdown(shapes, device, min(args.reps, 5))
        except Exception as exc:  # noqa: BLE001 -- the row says why
            breakdown = {"impl": "ShardedAdamW per kernel", "error": f"{type(exc).__name__}: {exc}"}
        breakdown.update(where)
        for k in breakdown.get("kernels", ()):
            print(f"  kernel {k['kernel'][:70]}: {k['ms_per_step']:.3f} ms per step, {k['launches_per_step']:g} "
                  f"launches, {100 * k['share']:.1f} %", flush=True)
        if "error" in breakdown:
            print(f"  kernel breakdown did not run: {breakdown['error']}", flush=True)
        rows.append(breakdown)

    def timeline():
        params = bench_params(shapes, device)
        opt = tritonshard.ShardedAdamW(params, lr=1e-4)
        return [host_timeline(opt, params, bf16_grads(shapes, device), device, max(args.reps, 20))]

    # What the GPU check needs most comes first (ours against fused torch AdamW, where its time goes, the sweep),
    # the other implementations last: its stage shares one budget between the models, and a run stopped by
    # `timeout` (SIGTERM) or Ctrl-C still writes what it measured.
    def stop(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        implementations(("ours", "torch"))
        if args.kernels:
            kernels()
        if args.bucket_caps or args.graph_caps:
            rows.extend(_measured("bucket sweep", lambda: bench_bucket_sweep(
                shapes, device, args.reps, args.bucket_caps, args.graph_caps), where))
        if args.host_timeline:
            rows.extend(_measured("ShardedAdamW host timeline", timeline, where))
        implementations(("after_backward", "hf_clip"))  # (the HF Trainer's loop: session 38)
        if args.scalars_ab is not None:
            rows.extend(_measured("step scalars A/B", lambda: [
                bench_scalars_ab(shapes, device, args.reps, args.scalars_ab)], where))
        implementations(("fsdp2", "muon", "torch_muon", "ours_fp32_grads"))
    except KeyboardInterrupt:
        rows.append({"impl": "the rest", "error": "not measured: stopped (SIGTERM or Ctrl-C)", **where})
        print("  stopped (SIGTERM or Ctrl-C): writing what was measured", flush=True)
    finally:
        signal.signal(signal.SIGTERM, previous)
    if own_group:
        comm.destroy_process_group()  # (a collection first: see there)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"step-{args.model}.json"), "w") as f:
        json.dump(rows, f, indent=1)
    if args.markdown:
        with open(args.markdown, "a") as f:
            f.write(markdown(rows, args.model, n, device))
    return rows


def _measured(label: str, make, where: dict) -> list[dict]:
    """``make()``'s rows, or one row saying why it did not run (the other measurements still run), each with
    ``where`` added and printed."""
    try:
        rows = make()
    except Exception as exc:  # noqa: BLE001 -- the row says why
        rows = [{"impl": label, "error": f"{type(exc).__name__}: {exc}"}]
    for row in rows:
        row.update(where)
        print("  " + ", ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()),
              flush=True)
    return rows


def markdown(rows: list[dict], model: str, n: int, device) -> str:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    lines = [f"\n## Optimizer step, {model} ({n / 1e6:.1f}M parameters), {name}, torch {torch.__version__}\n",
             "| implementation | step ms | peak memory GiB | optimizer state B/param | note |", "|---|---|---|---|---|"]
    sweep = [r for r in rows if "bucket_cap_mb" in r]
    breakdowns = [r for r in rows if r.get("impl") == "ShardedAdamW per kernel"]
    scalars_ab = [r for r in rows if "kernels_host_ms" in r]
    timelines = [r for r in rows if r.get("impl") == "ShardedAdamW host timeline"]
    for r in rows:
        if r in sweep or r in breakdowns or r in scalars_ab or r in timelines:
            continue
        if "error" in r:
            lines.append(f"| {r['impl']} | - | - | - | did not run: {r['error']} |")
            continue
        state = f"{r['optimizer_bytes'] / n:.1f}" if "optimizer_bytes" in r else "-"
        lines.append(f"| {r['impl']} | {r['step_ms']:.2f} | {r['peak_bytes'] / 2**30:.2f} | {state} "
                     f"| {r.get('note', '')} |")
    if sweep:
        lines += ["", f"ShardedAdamW, bucket_cap_mb swept ({model}; median; host = until step() returns, wall = "
                  "until the device is done too):", "",
                  "| bucket_cap_mb | cuda_graph | buckets | host ms | wall ms | host us / bucket |",
                  "|---:|---|---:|---:|---:|---:|"]
        lines += [f"| {r['bucket_cap_mb']:g} | {'yes (%d replays)' % r['graph_replays'] if r['cuda_graph'] else 'no'} "
                  f"| {r['buckets']} | {r['host_ms']:.2f} | {r['wall_ms']:.2f} | {r['host_us_per_bucket']:.0f} |"
                  for r in sweep]
    for r in scalars_ab:
        lines += ["", f"The step's scalars in launches (kernels/scalars.py) against the torch ops they replace ({model}, "
                  f"bucket_cap_mb={r['scalars_cap_mb']:g}, {r['buckets']} buckets; two optimizers, steps taking turns; "
                  "median):", "", "| step scalars | host ms | wall ms |", "|---|---:|---:|",
                  f"| kernels | {r['kernels_host_ms']:.2f} | {r['kernels_wall_ms']:.2f} |",
                  f"| torch ops | {r['torch_ops_host_ms']:.2f} | {r['torch_ops_wall_ms']:.2f} |"]
    for r in timelines:
        lines += timeline_markdown(r, f"ShardedAdamW's step, host timeline ({model}, {name})")
    for r in breakdowns:
        if "error" in r:
            lines += ["", f"ShardedAdamW kernel by kernel: did not run: {r['error']}"]
            continue
        lines += ["", f"ShardedAdamW's step kernel by kernel ({model}, {r['buckets']} buckets; torch.profiler, "
                  f"{r['timeline']} time; busy {r['busy_ms_per_step']:.2f} ms per step):", "",
                  "| kernel | ms per step | launches per step | share of busy |", "|---|---:|---:|---:|"]
        lines += [f"| `{k['kernel'][:80]}` | {k['ms_per_step']:.3f} | {k['launches_per_step']:g} | "
                  f"{100 * k['share']:.1f} % |" for k in r["kernels"]]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
