"""Host time of an optimizer step on the GPU code path, measured on a CPU: microseconds per bucket and per tensor.

    python -m benchmarks.host_overhead [--buckets 16 64] [--tensors-per-bucket 2] [--reps 20] [--params 292]
                                       [--model-rounds 20]

A step on a GPU is host-bound when Python takes longer to launch its kernels and collectives than the GPU takes
to run them (issue 20: ~270 us of host time per bucket on an H200 made a 1B step 34.7 ms where its kernels needed
12.5 ms). That host time does not need a GPU to be measured: this runs the real GPU path (``Backend.TRITON``:
Triton's own dispatch, the launchers, the optimizer's bookkeeping) through ``benchmarks.compile_check``'s dry-run
driver, which compiles each specialization once for sm_90 and then launches nothing, in a 1-rank gloo group. A
group of one rank issues no collective since session 32 (they are the identity there); before, they were real calls
here, gloo's on CPU tensors.

What it reports: the step (clip_grad_norm_ + step + zero_grad, gradients set as ``param.grad`` by hand, which the
step flattens), its minimum over the repetitions, timed at two bucket counts with the same tensors per bucket; the slope is the host cost per bucket
(the per-step constant cancels), divided further per tensor. Also the same slope for gloo's reduce-scatter +
all-gather alone, which a CUDA run replaces by NCCL's (~60 us each on the H200, PLATFORM.md), so it is reported
apart. Then the host time per *parameter* the optimizer adds to a training iteration (its backward hooks, the
end-of-backward flush, the step's per-parameter work), by phase, with and without ``overlap_comm``: end to end on
a GPU every configuration was host-bound (issue 20), and the 302M GPT of the example has 292 parameters, each
passing through the hooks in every backward. Last, the example's own iteration (its GPT at the 302M layout: 24
layers, 292 parameters, 26 buckets, but 32 wide), phase by phase, with and without ``overlap_comm`` + ``attach``:
what is per bucket and per module there (the forward pre-hooks, the flushes in the backward hooks). Then torch's
``clip_grad_norm_`` over ``param.grad`` (HF Trainer's and accelerate's clip, on the placeholders; ``--clip-params``)
against ``opt.clip_grad_norm_``: host time and torch ops of the clip alone. Then the
125M step's host timeline, event by event (``--timeline-model``; benchmarks.step's ``host_timeline``, which
``benchmarks.step --host-timeline`` measures on a GPU: on one machine the two differ by what only CUDA costs).
Needs TRITON_INTERPRET unset. The numbers are this CPU's: compare runs on one machine, not across machines.

One rank has nothing to overlap, and since session 33 an optimizer there leaves overlap_comm's per-bucket machinery
out (ShardedOptimizer._overlap_machinery): the rows "(many ranks)" and ``--overlap`` build it anyway, in this one
process (``overlap_machinery_on_one_rank``), for its host cost on many GPUs, less their collectives.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time

import torch
import torch.distributed as dist


def _machinery(on: bool):
    """Optimizers built inside run overlap_comm's machinery of many ranks in this one-rank process (see above)."""
    from tritonshard.optim.base import overlap_machinery_on_one_rank
    return overlap_machinery_on_one_rank(on)


def _measure(num_buckets: int, per_bucket: int, numel: int, reps: int, opt_kwargs: dict,
             moving_betas: bool = False) -> tuple[float, float]:
    """(seconds per step, seconds per step of the bare collectives) for ``num_buckets`` buckets; ``moving_betas``:
    new betas before every step, as torch's OneCycleLR cycles beta1 (its default ``cycle_momentum``)."""
    import tritonshard
    from benchmarks.step import sharded_step
    params = [torch.nn.Parameter(torch.randn(numel)) for _ in range(num_buckets * per_bucket)]
    cap_mb = per_bucket * numel * 2 / 2 ** 20  # exactly per_bucket bf16 tensors per bucket
    coalesce = opt_kwargs.pop("coalesce", True)
    with _machinery(opt_kwargs.get("overlap_comm", False)):  # (--overlap: the per-bucket calls of many ranks)
        opt = tritonshard.ShardedAdamW(params, lr=1e-3, bucket_cap_mb=cap_mb, **opt_kwargs)
    opt._coalesce = opt._coalesce and coalesce
    assert len(opt.buckets) == num_buckets, (len(opt.buckets), num_buckets)
    grads = [torch.randn(numel).to(torch.bfloat16) for _ in params]
    step = sharded_step(opt, params, grads)

    def collectives():  # as step() issues them: without overlap_comm one coalesced call for every bucket's
        # reduce-scatter, then one for the all-gathers (else one call per bucket, all launched, then waited,
        # through the ProcessGroup methods as the step's hot path calls them)
        from tritonshard import comm
        if opt._coalesce:
            comm.reduce_scatter_coalesced([b.grad_buffer.get_local_shard() for b in opt.buckets],
                                          [b.grad_buffer.get_data() for b in opt.buckets]).wait()
            comm.all_gather_coalesced([b.param_buffer.get_data() for b in opt.buckets],
                                      [b.param_buffer.get_local_shard() for b in opt.buckets]).wait()
            return
        pg = comm.group_object(None)
        for work in [comm.reduce_scatter_async(b.grad_buffer.get_local_shard(), b.grad_buffer.get_data(), pg)
                     for b in opt.buckets]:
            work.wait()
        for work in [comm.all_gather_async(b.param_buffer.get_data(), b.param_buffer.get_local_shard(), pg)
                     for b in opt.buckets]:
            work.wait()

    for _ in range(3):  # compile every specialization, fill the caches
        step()
        collectives()
    times, comm = [], []
    for i in range(reps):
        if moving_betas:
            for group in opt.param_groups:
                group["betas"] = (0.85 + 0.001 * (i % 100), 0.999)
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        collectives()
        comm.append(time.perf_counter() - t0)
    # the minimum over repetitions: host time is CPU work plus additive noise (other processes, the VM), and the
    # minimum is what the code itself costs (timeit's rule); medians moved by +-30 % between runs here
    return min(times), min(comm)


def _measure_flatten(num_tensors: int, numel: int, reps: int) -> tuple[float, float]:
    """(seconds per tensor, repeating; seconds per tensor, fresh tensors each call) of the optimizer's flatten
    launches (``launch_unchecked`` with a per-bucket launch cache): the host cost per gradient of every backward.
    Repeating = the same gradient tensors at the same addresses every step, as the caching allocator gives."""
    from tritonshard.kernels.flatten import launch_unchecked
    out = torch.empty(num_tensors * numel, dtype=torch.bfloat16)
    offsets = [i * numel for i in range(num_tensors)]
    same = [torch.randn(numel).to(torch.bfloat16) for _ in range(num_tensors)]
    launches: dict = {}
    for _ in range(3):
        launch_unchecked(out, same, offsets, False, 1.0, launches)
    repeating, fresh = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        launch_unchecked(out, same, offsets, False, 1.0, launches)
        repeating.append(time.perf_counter() - t0)
        new = [t.clone() for t in same]  # other addresses
        t0 = time.perf_counter()
        launch_unchecked(out, new, offsets, False, 1.0, launches)
        fresh.append(time.perf_counter() - t0)
    return min(repeating) / num_tensors, min(fresh) / num_tensors


#: the per-parameter loops (besides torch alone): on one rank, where overlap_comm has nothing to overlap, and with
#: its machinery of many ranks
PER_PARAM_MODES = ("no overlap_comm", "overlap_comm", "overlap_comm (many ranks)")
#: the example's loops, likewise
MODEL_MODES = ("no overlap_comm", "overlap_comm + attach", "overlap_comm + attach (many ranks)")


class _PerParamLoop:
    """One of :func:`_measure_per_param`'s loops: ``num_params`` 16-element bf16 parameters, each used once in a
    trivial forward, trained in steps of two micro-batches (the first in ``no_sync()``), with no optimizer
    (``mode="bare"``: ``param.grad = None`` after the step) or a ShardedAdamW with or without ``overlap_comm`` (on
    one rank, or with the machinery of many: ``PER_PARAM_MODES``)."""

    def __init__(self, mode: str, num_params: int):
        import tritonshard
        torch.manual_seed(0)
        self.params = [torch.nn.Parameter(torch.randn(16, dtype=torch.bfloat16)) for _ in range(num_params)]
        with _machinery(mode.endswith("(many ranks)")):
            self.opt = None if mode == "bare" else tritonshard.ShardedAdamW(
                self.params, lr=1e-3, overlap_comm=mode.startswith("overlap_comm"))
        self.x = torch.randn(16, dtype=torch.bfloat16)

    def _loss(self):
        return torch.stack([(p * self.x).sum() for p in self.params]).sum()

    def iteration(self) -> dict:
        """Seconds of this iteration's phases: ``backward (no_sync)``, ``last backward``, ``clip + step +
        zero_grad`` (each without the forward that precedes it)."""
        opt = self.opt
        loss = self._loss()
        t0 = time.perf_counter()
        if opt is None:
            loss.backward()
        else:
            with opt.no_sync():
                loss.backward()
        t1 = time.perf_counter()
        loss = self._loss()
        t2 = time.perf_counter()
        loss.backward()
        t3 = time.perf_counter()
        if opt is None:
            for p in self.params:
                p.grad = None
        else:
            opt.clip_grad_norm_(1.0)
            opt.step()
            opt.zero_grad()
        t4 = time.perf_counter()
        return {"backward (no_sync)": t1 - t0, "last backward": t3 - t2, "clip + step + zero_grad": t4 - t3}


def _interleaved_minima(loops: dict, rounds: int) -> dict:
    """Each loop's minimum seconds per phase over ``rounds`` rounds, the loops taking turns (one ``iteration()``
    each per round) after three rounds of warm-up (compilation, the launch plans, the caching allocator): the VM's
    speed drifts by tens of percent within a minute here, so only loops measured side by side compare."""
    best: dict = {mode: {} for mode in loops}
    for r in range(rounds + 3):
        for mode, loop in loops.items():
            phases = loop.iteration()
            if r >= 3:
                for k, v in phases.items():
                    best[mode][k] = min(best[mode].get(k, math.inf), v)
    return best


def _measure_per_param(num_params: int, rounds: int) -> dict:
    """Host microseconds per parameter that the optimizer adds to a training iteration, by phase, without and with
    ``overlap_comm``: each loop's time minus the same loop's without an optimizer (the autograd graph's own cost),
    over the number of parameters. The loops take turns, one iteration each per round, and each phase's minimum
    over the rounds is kept (the VM's speed drifts by tens of percent within a minute here: only loops measured
    side by side compare). All parameters in one bucket: the per-bucket cost is the step measurement's."""
    loops = {mode: _PerParamLoop(mode, num_params) for mode in ("bare",) + PER_PARAM_MODES}
    best = _interleaved_minima(loops, rounds)
    out = {}
    for mode in PER_PARAM_MODES:
        row = {k: (v - best["bare"][k]) * 1e6 / num_params for k, v in best[mode].items()}
        row["iteration (2 micro-batches)"] = sum(row.values())
        out[mode] = row
    out["bare_us"] = {k: v * 1e6 for k, v in best["bare"].items()}
    return out


class _ModelLoop:
    """One of :func:`_measure_model_iteration`'s loops: the example's GPT (``examples/train_gpt.py``) at 24 layers,
    as its 302M model (292 parameters), but 32 wide, 8 tokens: its own compute is small on a CPU. Trained as the
    example trains it (two micro-batches, the first in ``no_sync()``, clip, step, zero_grad), by torch alone
    (``mode="bare"``: torch's clip_grad_norm_, no step) or by a ShardedAdamW over the example's two param groups
    with one block's matrices per bucket, as 25 MB buckets hold them at 302M (26 buckets), without
    ``overlap_comm`` or with it and ``attach`` (the example's two configurations), on one rank or with the
    machinery of many (``MODEL_MODES``)."""

    def __init__(self, mode: str, n_layer: int = 24, width: int = 32):
        import tritonshard
        from examples.train_gpt import GPT, GPTConfig, param_groups
        torch.manual_seed(0)
        self.model = GPT(GPTConfig(block_size=8, n_layer=n_layer, n_head=4, n_embd=width))
        self.opt = None
        if mode == "bare":
            self.model.to(torch.bfloat16)
        else:
            overlap = mode.startswith("overlap_comm")
            with _machinery(mode.endswith("(many ranks)")):
                self.opt = tritonshard.ShardedAdamW(param_groups(self.model, 0.1), lr=1e-3, betas=(0.9, 0.95),
                                                    bucket_cap_mb=12 * width * width * 2 * 1.05 / 2 ** 20,
                                                    overlap_comm=overlap)
            if overlap:
                self.opt.attach(self.model)
        vocab = self.model.cfg.vocab_size
        self.x, self.y = torch.randint(0, vocab, (1, 8)), torch.randint(0, vocab, (1, 8))

    def iteration(self) -> dict:
        model, opt, phases = self.model, self.opt, {}
        for micro in range(2):
            with opt.no_sync() if opt is not None and micro == 0 else contextlib.nullcontext():
                t0 = time.perf_counter()
                loss = model(self.x, self.y) / 2
                t1 = time.perf_counter()
                loss.backward()
                t2 = time.perf_counter()
            phases[f"forward {micro + 1}"], phases[f"backward {micro + 1}"] = t1 - t0, t2 - t1
        t0 = time.perf_counter()
        if opt is None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            for p in model.parameters():
                p.grad = None
        else:
            opt.clip_grad_norm_(1.0)
            opt.step()
            opt.zero_grad()
        phases["clip + step + zero_grad"] = time.perf_counter() - t0
        return phases


def _measure_timeline(model: str, reps: int) -> dict:
    """benchmarks.step's host timeline of one ShardedAdamW step (default ``bucket_cap_mb``) at ``model``'s parameter
    shapes, on the GPU code path through the dry-run driver: the CPU counterpart of ``benchmarks.step
    --host-timeline`` on a GPU. Run on the GPU machine (the GPU check's host stage), the two tables differ by what
    only CUDA costs there; the 125M layout holds ~125M parameters on the host (~3 GB with the optimizer's)."""
    import tritonshard
    from benchmarks.step import SHAPES, bench_params, bf16_grads, gpt_param_shapes, host_timeline
    cpu = torch.device("cpu")
    shapes = gpt_param_shapes(*SHAPES[model])
    params = bench_params(shapes, cpu)
    opt = tritonshard.ShardedAdamW(params, lr=1e-4)
    return host_timeline(opt, params, bf16_grads(shapes, cpu), cpu, reps)


def _measure_model_iteration(rounds: int) -> dict:
    """Host milliseconds the optimizer adds to each phase of the example's iteration (:class:`_ModelLoop`), without
    and with ``overlap_comm`` + ``attach``: each loop's minimum minus torch's alone, the loops taking turns (see
    :func:`_measure_per_param`). On the H200 the 302M example is host-bound in every configuration, and with
    overlap it ran ~25 % slower than without (2026-12-04, session 32): per bucket and per module, which the
    one-bucket per-parameter measurement does not see."""
    loops = {mode: _ModelLoop(mode) for mode in ("bare",) + MODEL_MODES}
    best = _interleaved_minima(loops, rounds)
    out = {"buckets": len(loops["no overlap_comm"].opt.buckets)}
    for mode in MODEL_MODES:
        row = {k: (v - best["bare"][k]) * 1e3 for k, v in best[mode].items()}
        row["iteration"] = sum(row.values())
        out[mode] = row
    out["bare_ms"] = {k: v * 1e3 for k, v in best["bare"].items()}
    return out


def _measure_torch_clip(num_params: int, rounds: int) -> dict:
    """Host time and torch ops of one clip, torch's ``clip_grad_norm_`` over ``param.grad`` (HF Trainer's and
    accelerate's clip: the placeholders' per-parameter norms and multiplies) with its CPU default and with
    ``foreach=True`` (its default on CUDA), against ``opt.clip_grad_norm_``: ``num_params`` parameters of 64 x 64 in
    ~25 buckets, their gradients from a real backward (placeholders, as a loop has them), the clip alone timed (the
    reduction it starts included), each way's minimum over ``rounds`` rounds, the ways taking turns. The ops: those
    of one more clip, untimed, counted by a TorchDispatchMode (on a GPU each is a launch, beside the Triton kernels')."""
    import collections

    import tritonshard
    from torch.utils._python_dispatch import TorchDispatchMode

    class _Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops += 1
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(64, 64).bfloat16()) for _ in range(num_params)]
    opt = tritonshard.ShardedAdamW(params, lr=1e-4, bucket_cap_mb=num_params * 64 * 64 * 2 / 25 / 2 ** 20)
    weights = [torch.randn(64, 64) for _ in params]
    ways = {"torch": dict(foreach=None), "torch, foreach=True": dict(foreach=True), "opt.clip_grad_norm_": None}
    best, ops = collections.defaultdict(lambda: math.inf), {}
    for r in range(rounds + 4):  # (3 rounds of warm-up, ``rounds`` timed, then one counted, not timed)
        counted = r == rounds + 3
        for way, kwargs in ways.items():
            sum((p.float() * w).sum() for p, w in zip(params, weights)).backward()
            counter = _Count() if counted else contextlib.nullcontext()
            with counter:
                t0 = time.perf_counter()
                if kwargs is None:
                    opt.clip_grad_norm_(1.0)
                else:
                    torch.nn.utils.clip_grad_norm_(params, 1.0, **kwargs)
                elapsed = time.perf_counter() - t0
            if counted:
                ops[way] = counter.ops
            elif r >= 3:
                best[way] = min(best[way], elapsed)
            opt.step()
            opt.zero_grad()
    return {way: {"host_ms": best[way] * 1e3, "torch_ops": ops[way]} for way in ways} | {
        "params": num_params, "buckets": len(opt.buckets)}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--buckets", type=int, nargs=2, default=[16, 128], help="two bucket counts (the slope's ends)")
    p.add_argument("--tensors-per-bucket", type=int, default=2)
    p.add_argument("--numel", type=int, default=4096, help="elements per tensor")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--arch", type=int, default=90)
    p.add_argument("--no-bound-launches", action="store_true",
                   help="every launch through Triton's own dispatch (what bound launches save, issue 20)")
    p.add_argument("--overlap", action="store_true",
                   help="overlap_comm=True with the machinery of many ranks: per bucket its reduce-scatter call, its "
                        "update and its all-gather call (the gradients are set by hand, so the backward hooks' own "
                        "cost is not in it)")
    p.add_argument("--no-coalesce", action="store_true",
                   help="one reduce-scatter and one all-gather call per bucket, as before issue 20.3's coalescing")
    p.add_argument("--flatten-tensors", type=int, default=4096, help="tensors of the flatten measurement")
    p.add_argument("--params", type=int, default=292,
                   help="parameters of the per-parameter measurement (292: the example's 302M GPT; 0: skip it)")
    p.add_argument("--param-rounds", type=int, default=60, help="rounds of the per-parameter measurement")
    p.add_argument("--model-rounds", type=int, default=20,
                   help="rounds of the example's iteration at its 302M layout (0: skip it)")
    p.add_argument("--clip-params", type=int, default=292,
                   help="parameters of the measurement of torch's clip over the placeholders (0: skip it)")
    p.add_argument("--clip-rounds", type=int, default=10, help="rounds of that measurement")
    p.add_argument("--timeline-model", default="125M", choices=["none", "tiny", "125M", "1B"],
                   help="the step's host timeline, event by event, at this model's parameter shapes (benchmarks.step's"
                        "; none: skip it)")
    p.add_argument("--timeline-reps", type=int, default=40, help="steps of the host timeline (each event's minimum)")
    p.add_argument("--out", help="write the row as JSON to this file")
    args = p.parse_args(argv)

    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver
    from benchmarks.compile_check import DryRunDriver
    from tritonshard import comm
    from tritonshard.kernels import _dispatch, _launch
    _launch.set_bound_launches(not args.no_bound_launches)
    if _dispatch.interpreter_enabled():
        raise SystemExit("benchmarks.host_overhead times the compiled path: run it with TRITON_INTERPRET unset")
    torch.set_num_threads(1)
    own_group = not dist.is_initialized()
    if own_group:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    dry = DryRunDriver(GPUTarget("cuda", args.arch, 32))
    previous = driver._active
    driver.set_active(dry)
    try:
        with _dispatch.compile_for_target():
            lo, hi = args.buckets
            options = {"coalesce": not args.no_coalesce, "overlap_comm": args.overlap}
            step_lo, comm_lo = _measure(lo, args.tensors_per_bucket, args.numel, args.reps, dict(options))
            step_hi, comm_hi = _measure(hi, args.tensors_per_bucket, args.numel, args.reps, dict(options))
            counts = []  # launches of a steady-state step: 3 warm-up steps + 2 timed minus 3 + 1
            for reps in (1, 2):
                before = dry.launches
                _measure(lo, args.tensors_per_bucket, args.numel, reps, dict(options))
                counts.append(dry.launches - before)
            launches_at_lo = counts[1] - counts[0]
            step_moving, _ = _measure(hi, args.tensors_per_bucket, args.numel, args.reps, dict(options),
                                      moving_betas=True)
            flat_same, flat_fresh = _measure_flatten(args.flatten_tensors, 64, args.reps)
            per_param = _measure_per_param(args.params, args.param_rounds) if args.params else None
            model_iteration = _measure_model_iteration(args.model_rounds) if args.model_rounds else None
            torch_clip = _measure_torch_clip(args.clip_params, args.clip_rounds) if args.clip_params else None
            timeline = (_measure_timeline(args.timeline_model, args.timeline_reps)
                        if args.timeline_model != "none" else None)
    finally:
        driver._active = previous
        if own_group:
            comm.destroy_process_group()  # (a collection first: see there)
    per_bucket = (step_hi - step_lo) / (hi - lo)
    comm_per_bucket = (comm_hi - comm_lo) / (hi - lo)
    row = {
        "buckets": [lo, hi], "tensors_per_bucket": args.tensors_per_bucket, "numel": args.numel,
        "step_ms": [step_lo * 1e3, step_hi * 1e3],
        "host_us_per_bucket": per_bucket * 1e6,
        "host_us_per_tensor": per_bucket * 1e6 / args.tensors_per_bucket,
        "gloo_collectives_us_per_bucket": comm_per_bucket * 1e6,
        # (a group of one rank issues no collective since session 32: the step's slope has none in it)
        "host_us_per_bucket_without_gloo": per_bucket * 1e6,
        "launches_per_step_at_lo": launches_at_lo,
        "step_ms_moving_betas": step_moving * 1e3,
        "flatten_host_us_per_tensor_repeating": flat_same * 1e6,
        "flatten_host_us_per_tensor_fresh": flat_fresh * 1e6,
        "per_param_us": per_param, "params": args.params, "model_iteration_ms": model_iteration,
        "torch_clip": torch_clip,
        "timeline": timeline, "timeline_model": args.timeline_model,
        "bound_launches": not args.no_bound_launches, "coalesced": not args.no_coalesce and not args.overlap,
        "overlap_comm": args.overlap,
        "torch": torch.__version__, "cpu_count": os.cpu_count(),
    }
    print(f"host time of one ShardedAdamW step on the GPU code path (dry-run driver, sm_{args.arch}; 1-rank gloo; "
          f"bound launches {'off' if args.no_bound_launches else 'on'}; collectives "
          f"{'one call per bucket' if args.no_coalesce or args.overlap else 'coalesced'}"
          f"{'; overlap_comm' if args.overlap else ''}):")
    print(f"  {lo} buckets: {step_lo * 1e3:.2f} ms, {hi} buckets: {step_hi * 1e3:.2f} ms "
          f"({args.tensors_per_bucket} tensors of {args.numel} per bucket)")
    print(f"  per bucket: {row['host_us_per_bucket']:.0f} us (per tensor {row['host_us_per_tensor']:.0f} us), no "
          f"collective in it (a 1-rank group issues none); on more ranks their calls add to it: gloo's "
          f"reduce-scatter + all-gather here {row['gloo_collectives_us_per_bucket']:.0f} us per bucket")
    print(f"  with new betas before every step (torch's OneCycleLR cycles beta1): {step_moving * 1e3:.2f} ms at {hi} "
          f"buckets, against {step_hi * 1e3:.2f} ms with fixed ones (until session 36 every launch bound anew then)")
    print(f"  flatten of {args.flatten_tensors} gradients: {row['flatten_host_us_per_tensor_repeating']:.2f} us per "
          f"tensor at repeating addresses, {row['flatten_host_us_per_tensor_fresh']:.2f} us at new ones")
    if per_param:
        print(f"  per parameter, what the optimizer adds to an iteration of two micro-batches ({args.params} "
              f"parameters in one bucket, minus the same loop without an optimizer; minimum of {args.param_rounds} "
              "rounds):")
        for mode in PER_PARAM_MODES:
            print(f"    {mode:25s} " + ", ".join(f"{k} {v:.1f} us" for k, v in per_param[mode].items()))
    if model_iteration:
        print(f"  the example's iteration at its 302M layout (24 layers, 292 parameters, "
              f"{model_iteration['buckets']} buckets; 32 wide), ms the optimizer adds to each phase (minus torch "
              f"alone: {sum(model_iteration['bare_ms'].values()):.1f} ms; minimum of {args.model_rounds} rounds):")
        for mode in MODEL_MODES:
            print(f"    {mode:34s} " + ", ".join(f"{k} {v:.2f}" for k, v in model_iteration[mode].items()))
    if torch_clip:
        print(f"  torch's clip_grad_norm_ over param.grad (HF Trainer's, accelerate's) against the optimizer's, "
              f"{torch_clip['params']} parameters in {torch_clip['buckets']} buckets, gradients from a backward "
              f"(the clip alone; minimum of {args.clip_rounds} rounds): " + ", ".join(
                  f"{way} {v['host_ms']:.2f} ms and {v['torch_ops']} torch ops" for way, v in torch_clip.items()
                  if isinstance(v, dict)))
    if timeline:
        from benchmarks.step import timeline_markdown
        print("\n".join("  " + line if line else "" for line in timeline_markdown(
            timeline, f"the step's host timeline at the {args.timeline_model} layout")))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(row, f, indent=1)
    return row


if __name__ == "__main__":
    main()
    sys.exit(0)
