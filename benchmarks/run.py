"""Microbenchmarks: every tritonshard kernel against the memory-bandwidth limit and against PyTorch, side by side.

    python -m benchmarks.run --out benchmarks/out            # GPU: 1M .. 256M elements
    python -m benchmarks.run --out /tmp/bench --quick        # CPU smoke run (what CI does): tiny sizes

For each kernel and size: the median time over repeated runs (GPU: ``triton.testing.do_bench``, which warms up
and flushes L2 between runs; CPU: ``time.perf_counter``), the bytes the job must move at minimum (an explicit
formula per kernel, below), GB/s, the percentage of a device-to-device copy of the same number of bytes measured
in the same run, and the same job done each PyTorch way (``_foreach_copy_`` and ``torch.cat`` for the flatten,
``mul_`` + ``vector_norm`` + ``isfinite`` for the scale, fused ``torch.optim.AdamW`` with the casts around it and
the bare ``torch._fused_adamw_`` kernel on fp32 for AdamW, ...), one row per way, with the speed ratio. Every
output is validated against the reference before it is timed. A failing job is reported (table and exit status)
and the others still run; SIGTERM or Ctrl-C writes what was measured.

On a CPU, our launchers take the PyTorch reference path, or the Triton interpreter when TRITON_INTERPRET=1 (as
under the tests); rows say which (``cpu-reference`` / ``triton-interpreter``) and such timings mean nothing: they
only prove the harness runs.

Writes ``results.csv`` and ``results.json`` (rows + environment: device name, torch/triton versions, git
revision, date), one PNG per kernel (GB/s vs size, ours vs PyTorch) when matplotlib is installed, and prints a
compact table last.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from typing import Callable

import torch

from tritonshard.comm import local_device
from tritonshard.kernels import (adamw_step_, adamw_step_ref, flatten_into, flatten_into_ref, interpreter_enabled,
                                 last_backend, lion_step_, lion_step_ref, scale_, scale_ref, sgd_step_, sgd_step_ref,
                                 sum_sq_nonfinite, sum_sq_nonfinite_ref)

# Minimum bytes per element (each element read once and written once at the narrowest dtype the job allows)
BYTES = {
    "flatten fp32->bf16": 4 + 2,
    "flatten bf16->bf16": 2 + 2,
    "flatten fp32->bf16 accumulate": 4 + 2 + 2,
    "scale bf16": 2 + 2,
    "sum_sq bf16": 2,  # read-only
    # grad bf16 read (2), param/exp_avg/exp_avg_sq fp32 read+write (24), param_out bf16 write (2)
    "adamw": 2 + 24 + 2,
    # grad bf16 read (2), param and one state fp32 read+write (16), param_out bf16 write (2)
    "sgd momentum": 2 + 16 + 2,
    "lion": 2 + 16 + 2,
}


# ----------------------------------------------------------------------------- timing
def bench(fn: Callable[[], None], device: torch.device, reps: int) -> float:
    """Median seconds per call."""
    if device.type == "cuda":
        import triton.testing
        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") / 1e3
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def copy_seconds(nbytes: int, device: torch.device, reps: int) -> float:
    """A device-to-device copy moving ``nbytes`` in total (half read, half written)."""
    n = max(1, nbytes // 8)
    src = torch.randn(n, device=device)
    dst = torch.empty_like(src)
    return bench(lambda: dst.copy_(src), device, reps)


# ----------------------------------------------------------------------------- jobs
def _split_sizes(n: int, pieces: int) -> list[int]:
    base = n // pieces
    return [base + (1 if i < n - base * pieces else 0) for i in range(pieces)]


def flatten_job(n, device, src_dtype, accumulate, many):
    sizes = _split_sizes(n, max(1, n // 4096) if many else 4)
    g = torch.Generator(device="cpu").manual_seed(0)
    srcs = [torch.randn(s, generator=g).to(device=device, dtype=src_dtype) for s in sizes]
    offsets, o = [], 0
    for s in sizes:
        offsets.append(o)
        o += s
    out = torch.randn(n, device=device).to(torch.bfloat16)
    ref = out.clone()
    flatten_into(out, srcs, offsets, accumulate=accumulate)
    flatten_into_ref(ref, srcs, offsets, accumulate=accumulate)
    assert torch.equal(out.view(torch.int16), ref.view(torch.int16)), "flatten output != reference"
    views = [out[off:off + s] for off, s in zip(offsets, sizes)]

    def ours():
        flatten_into(out, srcs, offsets, accumulate=accumulate)

    if accumulate:
        def foreach():
            torch._foreach_add_(views, srcs)
        return ours, [("_foreach_add_", foreach)]

    def foreach():
        torch._foreach_copy_(views, srcs)

    if src_dtype == out.dtype:
        def cat():
            torch.cat(srcs, out=out)

        def one_block():  # (the kernel the H200 measured at 83 % of copy from bf16, 2026-11-30; session 37's A/B)
            from tritonshard.kernels.flatten import one_block_per_program
            with one_block_per_program():
                flatten_into(out, srcs, offsets, accumulate=accumulate)
        if not accumulate:
            one_block()
            assert torch.equal(out.view(torch.int16), ref.view(torch.int16)), "one block per program != reference"
        return ours, [("_foreach_copy_", foreach), ("torch.cat(out=)", cat),
                      ("same launch, one block per program", one_block)]

    def cat():  # torch.cat cannot change the dtype: concatenate, then cast (one more pass over the data)
        out.copy_(torch.cat(srcs))
    return ours, [("_foreach_copy_", foreach), ("torch.cat + cast", cat)]


def scale_job(n, device):
    x = torch.randn(n, device=device).to(torch.bfloat16)
    y = x.clone()
    s1, f1 = scale_(x, 0.5)
    s2, f2 = scale_ref(y, 0.5)
    assert torch.equal(x.view(torch.int16), y.view(torch.int16)), "scale_ output != reference"
    assert abs(float(s1) - float(s2)) <= 1e-5 * float(s2) and float(f1) == float(f2) == 0.0

    def ours():
        scale_(x, 1.0)  # factor 1.0 keeps the data stable across repetitions; the work is the same

    def theirs():
        x.mul_(1.0)
        torch.linalg.vector_norm(x, dtype=torch.float32)
        torch.isfinite(x).all()
    return ours, [("mul_+vector_norm+isfinite", theirs)]


def sum_sq_job(n, device):
    x = torch.randn(n, device=device).to(torch.bfloat16)
    s1, f1 = sum_sq_nonfinite(x, 0.5)
    s2, f2 = sum_sq_nonfinite_ref(x, 0.5)
    assert abs(float(s1) - float(s2)) <= 1e-5 * float(s2) and float(f1) == float(f2) == 0.0

    def ours():
        sum_sq_nonfinite(x, 0.5)

    def theirs():
        torch.linalg.vector_norm(x, dtype=torch.float32)
        torch.isfinite(x).all()
    return ours, [("vector_norm+isfinite", theirs)]


def norm_pass_job(n, device):
    """The norm pass as ShardedOptimizer's step() launches it: one launch over every parameter's piece of the grad
    shards (since session 38; every bucket's shard before; here ``n`` elements in tensors of ~1M, each its own
    allocation, sizes off the block), partials into one workspace, then the one-program finalize. Ours: the default four blocks per program; beside it the
    same launch with one block per program (the kernel the H200 measured at ~48 % of the copy bandwidth in the
    1B step, session 32; the same partials, checked here bit for bit) and PyTorch's per-tensor norms."""
    from tritonshard.kernels import _launch, finalize_sum_sq_
    from tritonshard.kernels.scale import partials_multi_launch_spec, shared_sum_sq_workspace
    g = torch.Generator(device="cpu").manual_seed(4)
    xs = [torch.randn(s, generator=g).to(device=device, dtype=torch.bfloat16)
          for s in _split_sizes(n, max(1, n >> 20))]
    totals = torch.empty(2, dtype=torch.float32, device=device)
    launches = {}

    def launcher(blocks_per_program):
        workspace, slices = shared_sum_sq_workspace([x.numel() for x in xs], device)
        spec = partials_multi_launch_spec(xs, 0.5, slices, blocks_per_program=blocks_per_program)

        def run():  # (bound: the compiled launcher, as the optimizer launches it after its first step)
            _launch.launch(launches, blocks_per_program, spec, lambda: spec[0][spec[1]](*spec[2], **spec[3]))
            finalize_sum_sq_(workspace, totals)
        return run, workspace

    ours, four = launcher(4)
    before, one = launcher(1)
    ours()
    before()
    for a, b in zip(four, one):
        assert torch.equal(a.cpu(), b.cpu()), "norm pass partials: four blocks per program != one block per program"
    sum_sq, found_inf = sum_sq_nonfinite_ref(torch.cat(xs), 0.5)
    assert abs(float(totals[0]) - float(sum_sq)) <= 1e-5 * float(sum_sq) and float(totals[1]) == float(found_inf)

    def theirs():
        torch.linalg.vector_norm(torch.stack(torch._foreach_norm(xs)))
        torch.stack([torch.isfinite(x).all() for x in xs]).all()
    return ours, [("same launch, one block per program", before), ("_foreach_norm+isfinite", theirs)]


def _fused_torch_step(optimizer_cls, p, grad, out, **hp):
    """The PyTorch way of the same update: upcast the bf16 grad, the fused fp32 optimizer, then a separate bf16
    copy of the weights."""
    tp = torch.nn.Parameter(p.clone())
    tp.grad = torch.empty_like(tp)
    topt = optimizer_cls([tp], fused=True, **hp)

    def theirs():
        tp.grad.copy_(grad)
        topt.step()
        out.copy_(tp.detach())
    return theirs


def _adamw_inputs(n, device):
    """fp32 param, bf16 grad, zero moments, a bf16 param_out and the hyper-parameters of both AdamW rows."""
    g = torch.Generator(device="cpu").manual_seed(1)
    p = torch.randn(n, generator=g).to(device)
    grad = (torch.randn(n, generator=g) * 1e-2).to(device=device, dtype=torch.bfloat16)
    out = torch.empty(n, dtype=torch.bfloat16, device=device)
    hp = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
    return p, grad, torch.zeros_like(p), torch.zeros_like(p), out, hp


def adamw_job(n, device):
    p, grad, m, v, out, hp = _adamw_inputs(n, device)
    p2, m2, v2, out2 = p.clone(), m.clone(), v.clone(), out.clone()
    adamw_step_(p, grad, m, v, step=1, param_out=out, **hp)
    adamw_step_ref(p2, grad, m2, v2, step=1, param_out=out2, **hp)
    err = float((p - p2).abs().max() / p2.abs().max())
    assert err <= 1e-6, f"adamw output differs from the reference by {err:.1e}"

    def ours():
        adamw_step_(p, grad, m, v, step=2, param_out=out, **hp)

    g32, m3, v3, steps = grad.float(), m.clone(), v.clone(), [torch.tensor(2.0, device=device)]

    def fused_kernel():  # the fused kernel alone on fp32 tensors: the same 28 bytes/element, no bf16 in or out
        torch._fused_adamw_([p2], [g32], [m3], [v3], [], steps, lr=1e-3, beta1=0.9, beta2=0.999,
                            weight_decay=0.01, eps=1e-8, amsgrad=False, maximize=False)

    return ours, [("fused AdamW+casts", _fused_torch_step(torch.optim.AdamW, p, grad, out2, lr=1e-3,
                                                          weight_decay=0.01)),
                  ("torch._fused_adamw_ fp32", fused_kernel)]


def adamw_as_launched_job(n, device):
    """The specialization ShardedAdamW's step() launches: step, grad_scale (1/d x clip x unscale) and found_inf as
    device tensors, lr a number, the bf16 param shard as param_out; the launcher's on-device coefficient math
    included (ShardedAdamW computes it once per param group and step and shares it between its buckets)."""
    p, grad, m, v, out, hp = _adamw_inputs(n, device)
    step = torch.ones((), device=device)
    grad_scale = torch.full((), 0.5, device=device)
    found_inf = torch.zeros((), device=device)
    p2, m2, v2, out2 = p.clone(), m.clone(), v.clone(), out.clone()
    adamw_step_(p, grad, m, v, step=step, grad_scale=grad_scale, found_inf=found_inf, param_out=out, **hp)
    adamw_step_ref(p2, grad, m2, v2, step=step, grad_scale=grad_scale, found_inf=found_inf, param_out=out2, **hp)
    err = float((p - p2).abs().max() / p2.abs().max())
    assert err <= 1e-6, f"adamw output differs from the reference by {err:.1e}"

    def ours():
        adamw_step_(p, grad, m, v, step=step, grad_scale=grad_scale, found_inf=found_inf, param_out=out, **hp)

    return ours, [("fused AdamW+casts", _fused_torch_step(torch.optim.AdamW, p, grad, out2, lr=1e-3,
                                                          weight_decay=0.01))]


def sgd_job(n, device):
    g = torch.Generator(device="cpu").manual_seed(2)
    p = torch.randn(n, generator=g).to(device)
    grad = (torch.randn(n, generator=g) * 1e-2).to(device=device, dtype=torch.bfloat16)
    buf, out = torch.zeros_like(p), torch.empty(n, dtype=torch.bfloat16, device=device)
    hp = dict(lr=1e-2, momentum=0.9, weight_decay=1e-4)
    p2, buf2, out2 = p.clone(), buf.clone(), out.clone()
    sgd_step_(p, grad, buf, step=1, param_out=out, **hp)
    sgd_step_ref(p2, grad, buf2, step=1, param_out=out2, **hp)
    assert float((p - p2).abs().max() / p2.abs().max()) <= 1e-6, "sgd output differs from the reference"

    def ours():
        sgd_step_(p, grad, buf, step=2, param_out=out, **hp)

    return ours, [("fused SGD+casts", _fused_torch_step(torch.optim.SGD, p, grad, out2, **hp))]


def lion_job(n, device):
    g = torch.Generator(device="cpu").manual_seed(3)
    p = torch.randn(n, generator=g).to(device)
    grad = (torch.randn(n, generator=g) * 1e-2).to(device=device, dtype=torch.bfloat16)
    m, out = torch.zeros_like(p), torch.empty(n, dtype=torch.bfloat16, device=device)
    p2, m2, out2 = p.clone(), m.clone(), out.clone()
    lion_step_(p, grad, m, lr=1e-4, weight_decay=0.1, param_out=out)
    lion_step_ref(p2, grad, m2, lr=1e-4, weight_decay=0.1, param_out=out2)
    assert float((p - p2).abs().max() / p2.abs().max()) <= 1e-6, "lion output differs from the reference"

    def ours():
        lion_step_(p, grad, m, lr=1e-4, weight_decay=0.1, param_out=out)

    def theirs():  # no Lion in torch.optim: the same update composed of torch ops (what lion-pytorch does)
        g32 = grad.float()
        p2.mul_(1 - 1e-4 * 0.1)
        p2.add_((m2 * 0.9).add_(g32, alpha=0.1).sign_(), alpha=-1e-4)
        m2.mul_(0.99).add_(g32, alpha=0.01)
        out2.copy_(p2)
    return ours, [("torch ops (lion-pytorch)", theirs)]


# name -> (key into BYTES, launcher name for last_backend, job factory). A factory validates our kernel against
# the reference, then returns (ours, [(name of a PyTorch way, fn), ...]): one table row per PyTorch way.
JOBS = {
    # (first: a stage that runs out of time keeps it; session 37's open question, four blocks per program or one)
    "norm pass bf16 (what step() runs: one launch over ~1M-element pieces of the grad shards)":
        ("sum_sq bf16", "finalize_sum_sq_", norm_pass_job),
    "flatten fp32->bf16 (4 tensors)":
        ("flatten fp32->bf16", "flatten_into", lambda n, d: flatten_job(n, d, torch.float32, False, False)),
    "flatten fp32->bf16 (4K-elem tensors)":
        ("flatten fp32->bf16", "flatten_into", lambda n, d: flatten_job(n, d, torch.float32, False, True)),
    "flatten bf16->bf16 (4 tensors)":
        ("flatten bf16->bf16", "flatten_into", lambda n, d: flatten_job(n, d, torch.bfloat16, False, False)),
    "flatten fp32->bf16 accumulate":
        ("flatten fp32->bf16 accumulate", "flatten_into", lambda n, d: flatten_job(n, d, torch.float32, True, False)),
    "scale_ bf16 (+norm, inf check)": ("scale bf16", "scale_", scale_job),
    "sum_sq_nonfinite bf16 (read-only, one tensor)": ("sum_sq bf16", "sum_sq_nonfinite", sum_sq_job),
    "adamw_step_ (bf16 grad, bf16 out)": ("adamw", "adamw_step_", adamw_job),
    "adamw_step_ as ShardedAdamW launches it (tensor step/grad_scale, found_inf)":
        ("adamw", "adamw_step_", adamw_as_launched_job),
    "sgd_step_ momentum (bf16 grad, bf16 out)": ("sgd momentum", "sgd_step_", sgd_job),
    "lion_step_ (bf16 grad, bf16 out)": ("lion", "lion_step_", lion_job),
}


# ----------------------------------------------------------------------------- environment
def environment(device: torch.device) -> dict:
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip() or "unknown"
    except OSError:
        rev = "unknown"
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = "absent"
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({os.cpu_count()} cores)"
    if device.type == "cuda":
        backend = "triton"
    else:
        backend = "triton-interpreter" if interpreter_enabled() else "cpu-reference"
    return {"device": name, "backend": backend,
            "torch": torch.__version__, "triton": triton_version, "git": rev,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "python": sys.version.split()[0]}


# ----------------------------------------------------------------------------- main
def run(out_dir: str, sizes: list[int], device: torch.device, reps: int, only: list[str] | None = None,
        markdown: str | None = None, errors: list[str] | None = None) -> list[dict]:
    """Every job at every size. A job that fails (its validation included) is reported in ``errors`` and in the
    table, and the others still run; SIGTERM (``timeout``) or Ctrl-C stops early and writes what was measured."""
    os.makedirs(out_dir, exist_ok=True)
    errors = [] if errors is None else errors
    env = environment(device)
    print(f"tritonshard microbenchmarks on {env['device']} ({env['backend']}), torch {env['torch']}, "
          f"triton {env['triton']}, git {env['git']}", flush=True)
    rows = []
    jobs = [(k, v) for k, v in JOBS.items() if not only or any(o in k for o in only)]
    total = len(jobs) * len(sizes)
    done = 0

    def stop(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        for name, (bytes_key, op, make) in jobs:
            for n in sizes:
                done += 1
                print(f"[{done}/{total}] {name}, {n / 2 ** 20:g}M elements ...", flush=True)
                try:
                    rows.extend(_measure(name, bytes_key, op, make, n, device, reps, env, errors))
                except (KeyboardInterrupt, SystemExit):
                    raise
                except Exception as exc:  # noqa: BLE001 -- reported in the table and the exit status
                    errors.append(f"{name} at {n} elements: {type(exc).__name__}: {exc}")
                    print(f"  FAILED: {errors[-1]}", flush=True)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    except KeyboardInterrupt:
        errors.append(f"stopped after {done - 1} of {total} measurements (SIGTERM or Ctrl-C)")
        print(errors[-1], flush=True)
    finally:
        signal.signal(signal.SIGTERM, previous)
    if rows:
        write(out_dir, rows, env, markdown, errors)
    return rows


def _measure(name, bytes_key, op, make, n, device, reps, env, errors: list[str]) -> list[dict]:
    ours, ways = make(n, device)  # validates our output against the reference first
    backend = last_backend(op)
    nbytes = BYTES[bytes_key] * n
    t_ours = bench(ours, device, reps)
    t_copy = copy_seconds(nbytes, device, reps)
    rows = []
    for their_name, theirs in ways:
        try:
            t_theirs = bench(theirs, device, reps)
        except Exception as exc:  # noqa: BLE001 -- a PyTorch way missing from this torch loses its row only
            errors.append(f"{name} at {n} elements, PyTorch way {their_name}: {type(exc).__name__}: {exc}")
            print(f"  FAILED: {errors[-1]}", flush=True)
            continue
        rows.append({
            "kernel": name, "numel": n, "bytes_moved": nbytes, "bytes_per_elem": BYTES[bytes_key],
            "ours_ms": t_ours * 1e3, "ours_GBps": nbytes / t_ours / 1e9,
            "copy_GBps": nbytes / t_copy / 1e9, "pct_of_copy": 100 * t_copy / t_ours,
            "torch_impl": their_name, "torch_ms": t_theirs * 1e3, "torch_GBps": nbytes / t_theirs / 1e9,
            "speedup_vs_torch": t_theirs / t_ours, "our_backend": str(backend.value if backend else "?"),
            **env,
        })
    return rows


def write(out_dir: str, rows: list[dict], env: dict, markdown: str | None = None,
          errors: list[str] | None = None) -> None:
    with open(os.path.join(out_dir, "results.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump({"environment": env, "rows": rows, "errors": errors or []}, f, indent=1)
    plot(out_dir, rows)
    text = table(rows, env)
    if errors:
        text += "\n\nNot measured:\n" + "\n".join(f"- {e}" for e in errors) + "\n"
    if markdown:
        with open(markdown, "a") as f:
            f.write(f"# tritonshard microbenchmarks: {env['device']}\n\n"
                    f"Reproduce: `python -m benchmarks.run --out DIR` (or `bash benchmarks/gpu_check.sh`).\n"
                    f"Bytes moved are the minimum per element (see BYTES in benchmarks/run.py); % of copy is "
                    f"against a device-to-device copy of the same bytes measured in the same run.\n\n{text}\n")
    print()
    print(text)


#: printed above every table not measured on a GPU (issue 22: a CPU run printed "25355 % of copy" unexplained)
CPU_CAVEAT = ("**CPU run: these timings say nothing about GPUs.** The kernels ran through the Triton interpreter or "
              "the PyTorch reference, and '% of copy' compares them with a CPU memcpy of the same bytes (values far "
              "above 100 % are the interpreter's fixed costs meeting tiny copies). This run only proves the harness "
              "works; GPU figures: benchmarks/results/.")


def table(rows: list[dict], env: dict) -> str:
    caveat = [CPU_CAVEAT, ""] if env.get("backend") != "triton" else []
    lines = caveat + [f"{env['device']} | backend {env['backend']} | torch {env['torch']} | triton {env['triton']} | "
                      f"git {env['git']} | {env['date']}", "",
             "| kernel | elements | B/elem | ours ms | ours GB/s | % of copy | PyTorch way | torch GB/s | speedup |",
             "|---|---:|---:|---:|---:|---:|---|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['kernel']} | {r['numel'] / 2 ** 20:g}M | {r['bytes_per_elem']} | {r['ours_ms']:.3f} | "
                     f"{r['ours_GBps']:.1f} | {r['pct_of_copy']:.0f}% | {r['torch_impl']} | {r['torch_GBps']:.1f} | "
                     f"{r['speedup_vs_torch']:.2f}x |")
    return "\n".join(lines)


def plot(out_dir: str, rows: list[dict]) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plots")
        return
    for kernel in dict.fromkeys(r["kernel"] for r in rows):
        rs = [r for r in rows if r["kernel"] == kernel]
        fig, ax = plt.subplots(figsize=(6, 3.5))
        first = [r for r in rs if r["torch_impl"] == rs[0]["torch_impl"]]  # one row per size
        xs = [r["numel"] for r in first]
        ax.plot(xs, [r["ours_GBps"] for r in first], "o-", label="tritonshard")
        for way, marker in zip(dict.fromkeys(r["torch_impl"] for r in rs), "sd^v"):
            ax.plot([r["numel"] for r in rs if r["torch_impl"] == way],
                    [r["torch_GBps"] for r in rs if r["torch_impl"] == way], f"{marker}--", label=f"PyTorch: {way}")
        ax.plot(xs, [r["copy_GBps"] for r in first], ":", color="gray", label="device copy")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("elements")
        ax.set_ylabel("GB/s (minimum bytes moved)")
        ax.set_title(f"{kernel}\n{rs[0]['device']}", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        safe = "".join(c if c.isalnum() else "_" for c in kernel).strip("_")
        fig.savefig(os.path.join(out_dir, f"{safe}.png"), dpi=110)
        plt.close(fig)


def main(argv=None, errors: list[str] | None = None):
    p = argparse.ArgumentParser(description="tritonshard microbenchmarks")
    p.add_argument("--out", default="benchmarks/out", help="directory for results.csv/json and plots")
    p.add_argument("--quick", action="store_true", help="tiny sizes (CPU smoke run, CI)")
    p.add_argument("--sizes", type=str, default=None, help="comma-separated element counts, e.g. 1048576,4194304")
    p.add_argument("--only", type=str, default=None, help="comma-separated substrings of kernel names")
    p.add_argument("--reps", type=int, default=5, help="CPU repetitions (GPU uses do_bench)")
    p.add_argument("--markdown", default=None, help="also append the table to this markdown file")
    args = p.parse_args(argv)
    device = local_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if args.sizes:
        sizes = [int(s) for s in args.sizes.split(",")]
    elif args.quick or device.type == "cpu":
        sizes = [2 ** 14, 2 ** 16]
    else:
        sizes = [2 ** 20, 2 ** 22, 2 ** 24, 2 ** 26, 2 ** 28]
    rows = run(args.out, sizes, device, args.reps, args.only.split(",") if args.only else None, args.markdown,
               errors)
    return rows


if __name__ == "__main__":
    errors: list[str] = []
    main(errors=errors)
    sys.exit(1 if errors else 0)
