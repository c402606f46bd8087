"""The benchmark harness runs on CPU at tiny sizes (so it never rots) and validates what it times."""

import csv
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tarfile

import pytest
import torch

from benchmarks import run as bench_run
from benchmarks import step as bench_step

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_microbenchmarks_smoke(tmp_path):
    rows = bench_run.main(["--out", str(tmp_path), "--sizes", "4099,16384", "--reps", "2",
                           "--markdown", str(tmp_path / "results.md")])
    with open(tmp_path / "results.csv") as f:
        csv_rows = list(csv.DictReader(f))
    assert len(csv_rows) == len(rows)
    pairs = [(r["kernel"], r["torch_impl"]) for r in csv_rows]
    assert {k for k, _ in pairs} == set(bench_run.JOBS)
    assert all(pairs.count(p) == 2 for p in pairs), "every (kernel, PyTorch way) at both sizes"
    ways = {w for _, w in pairs}
    assert {"_foreach_copy_", "torch.cat + cast", "torch.cat(out=)", "_foreach_add_", "mul_+vector_norm+isfinite",
            "vector_norm+isfinite", "same launch, one block per program", "_foreach_norm+isfinite",
            "fused AdamW+casts", "torch._fused_adamw_ fp32"} <= ways
    for r in csv_rows:
        n, per = int(r["numel"]), int(r["bytes_per_elem"])
        assert int(r["bytes_moved"]) == n * per
        assert float(r["ours_GBps"]) > 0 and float(r["torch_GBps"]) > 0 and float(r["copy_GBps"]) > 0
        assert r["torch"] and r["git"] and r["device"]
    env = json.load(open(tmp_path / "results.json"))["environment"]
    assert env["backend"] == "triton-interpreter"  # tests/conftest.py turns the interpreter on without a GPU
    assert {r["our_backend"] for r in csv_rows} == {"triton-interpreter"}
    assert "| kernel |" in (tmp_path / "results.md").read_text()
    assert "CPU run: these timings say nothing about GPUs" in (tmp_path / "results.md").read_text()


def test_step_benchmark_smoke(tmp_path):
    rows = bench_step.main(["--model", "tiny", "--reps", "2", "--out", str(tmp_path), "--skip", "ours_fp32_grads"])
    ours, theirs, after_backward, hf_clip, fsdp, muon, torch_muon = rows  # (its order: the GPU check's stage 4)
    fp32_grads = bench_step.bench_ours_fp32_grads(bench_step.gpt_param_shapes(*bench_step.SHAPES["tiny"]),
                                                  torch.device("cpu"), 1)  # (one rep: the row, not its time)
    # after a backward (its placeholders): the optimizer's clip, and torch's over param.grad (the HF Trainer's)
    for row in (after_backward, hf_clip):
        assert "error" not in row and row["step_ms"] > 0 and row["host_ms"] > 0, row
    assert "HF Trainer" in hf_clip["impl"] and "opt.clip_grad_norm_" in after_backward["impl"]
    assert "error" not in muon and muon["step_ms"] > 0 and 0 < muon["newton_schulz_ms"]
    assert "error" not in torch_muon and torch_muon["step_ms"] > 0
    # Muon keeps one state (momentum) where AdamW keeps two: fewer optimizer bytes than ShardedAdamW at world size 1
    assert muon["optimizer_bytes"] < ours["optimizer_bytes"]
    assert "error" not in ours and ours["step_ms"] > 0
    assert "error" not in theirs and theirs["step_ms"] > 0
    assert "error" not in fsdp and fsdp["step_ms"] > 0  # main() starts a 1-rank gloo group for FSDP2
    # world size 1: 2 + 2 + 12 B/param, the same 16 B/param as fp32 AdamW, plus alignment padding (< 64 elements
    # per tensor, ~1% here)
    assert theirs["optimizer_bytes"] <= ours["optimizer_bytes"] <= 1.05 * theirs["optimizer_bytes"]
    # grad_dtype=fp32: 2 B/param more of gradient buffers, all else the same (padding included: the same layout)
    assert "error" not in fp32_grads and fp32_grads["step_ms"] > 0 and "fp32 grads" in fp32_grads["impl"]
    assert fp32_grads["optimizer_bytes"] - ours["optimizer_bytes"] == pytest.approx(
        ours["optimizer_bytes"] / 16 * 2, rel=0.05)


def test_step_scalars_side_by_side_smoke(tmp_path):
    # session 34's small-op work, for the next GPU run to measure: two optimizers, one with the step's scalars in
    # launches and one with the torch ops (its own switch), taking turns
    md = tmp_path / "results.md"
    rows = bench_step.main(["--model", "tiny", "--reps", "2", "--out", str(tmp_path), "--scalars-ab", "25",
                            "--markdown", str(md), "--skip", "torch", "fsdp2", "muon", "torch_muon", "after_backward",
                            "hf_clip", "ours_fp32_grads"])
    ours, ab = rows
    assert "error" not in ab, ab
    assert all(ab[f"{side}_{t}_ms"] > 0 for side in ("kernels", "torch_ops") for t in ("host", "wall")), ab
    # the kernels' side launched the clip coefficient and the flags (its bound launches' keys); the other none
    assert ab["kernels_scalar_launches"] == 2 and ab["torch_ops_scalar_launches"] == 0, ab
    assert "| kernels |" in md.read_text() and "| torch ops |" in md.read_text()


def test_step_kernel_breakdown_smoke(tmp_path):
    # the 1B step is device-bound on the H200: the next GPU run says which kernel takes what (on a CPU, the
    # launchers' host ranges stand in for the device's kernels: the same table, no measurement)
    md = tmp_path / "results.md"
    rows = bench_step.main(["--model", "tiny", "--reps", "2", "--out", str(tmp_path), "--kernels", "--markdown",
                            str(md), "--skip", "torch", "fsdp2", "muon", "torch_muon", "after_backward", "hf_clip",
                            "ours_fp32_grads"])
    ours, breakdown = rows
    assert "error" not in breakdown, breakdown
    names = [k["kernel"] for k in breakdown["kernels"]]
    # what a step launches: the flatten of the gradients, the norm pass and its finalize, the update
    assert any("flatten" in n for n in names) and any("adamw" in n for n in names), names
    assert any("sum_sq" in n for n in names), names
    assert math.isclose(sum(k["share"] for k in breakdown["kernels"]), 1.0)
    assert all(k["ms_per_step"] > 0 and k["launches_per_step"] > 0 for k in breakdown["kernels"])
    assert "kernel by kernel (tiny" in md.read_text() and "| `" in md.read_text()


def test_step_benchmark_stopped_by_timeout_writes_what_it_measured(tmp_path, monkeypatch):
    # the GPU check's stage 4 shares one budget between its models, under `timeout` (SIGTERM): a 1B run stopped
    # there must still leave ours against torch, the kernel table and the sweep in results.md, measured first
    md = tmp_path / "results.md"

    def stopped(*args):
        raise KeyboardInterrupt  # what the SIGTERM handler raises when `timeout` stops the run

    monkeypatch.setattr(bench_step, "bench_scalars_ab", stopped)
    handler = signal.getsignal(signal.SIGTERM)
    rows = bench_step.main(["--model", "tiny", "--reps", "2", "--out", str(tmp_path), "--kernels", "--bucket-caps",
                            "25", "--scalars-ab", "25", "--markdown", str(md)])
    assert signal.getsignal(signal.SIGTERM) is handler
    impls = [r["impl"] for r in rows]
    assert impls[0].startswith("tritonshard.ShardedAdamW") and impls[1].startswith("torch.optim.AdamW"), impls
    assert "ShardedAdamW per kernel" in impls and any("bucket_cap_mb" in r for r in rows), impls
    assert rows[-1]["impl"] == "the rest" and "stopped" in rows[-1]["error"], rows[-1]
    assert not any(r.get("impl", "").startswith(("FSDP2", "tritonshard.ShardedMuon")) for r in rows), impls
    text = md.read_text()
    assert "kernel by kernel (tiny" in text and "| 25 |" in text and "not measured: stopped" in text, text
    assert json.loads((tmp_path / "step-tiny.json").read_text())[-1]["impl"] == "the rest"


def test_overlap_benchmark_smoke(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "-m", "benchmarks.overlap", "--tiny", "--out", str(tmp_path)], cwd=REPO,
                          # the PyTorch reference kernels, as a CPU user runs it (the interpreter: ~4 s more)
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO, "TRITON_INTERPRET": "0"},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = json.load(open(tmp_path / "overlap.json"))
    assert [r["overlap_comm"] for r in rows] == [False, True]
    assert all(r["median_step_ms"] > 0 and r["world_size"] == 2 for r in rows)


SCALE = "scale_ bf16 (+norm, inf check)"


def test_a_failing_job_is_reported_and_the_rest_still_run(tmp_path, monkeypatch):
    real = bench_run.JOBS[SCALE]

    def broken(n, device):
        raise AssertionError("validation failed: ours != torch")

    monkeypatch.setattr(bench_run, "JOBS", {"broken": (real[0], real[1], broken), SCALE: real})
    errors = []
    rows = bench_run.main(["--out", str(tmp_path), "--sizes", "4099", "--reps", "1",
                           "--markdown", str(tmp_path / "results.md")], errors=errors)
    assert [r["kernel"] for r in rows] == [SCALE]
    assert len(errors) == 1 and "broken at 4099 elements: AssertionError: validation failed" in errors[0]
    assert "Not measured" in (tmp_path / "results.md").read_text()
    assert json.load(open(tmp_path / "results.json"))["errors"] == errors


def test_an_interrupted_run_writes_what_it_measured(tmp_path, monkeypatch):
    real = bench_run.JOBS[SCALE]
    calls = []

    def interrupted_on_second_size(n, device):
        calls.append(n)
        if len(calls) == 2:
            raise KeyboardInterrupt  # what the SIGTERM handler raises when `timeout` stops the run
        return real[2](n, device)

    monkeypatch.setattr(bench_run, "JOBS", {SCALE: (real[0], real[1], interrupted_on_second_size)})
    handler = signal.getsignal(signal.SIGTERM)
    errors = []
    rows = bench_run.main(["--out", str(tmp_path), "--sizes", "4099,8191", "--reps", "1"], errors=errors)
    assert [r["numel"] for r in rows] == [4099]
    assert "stopped after 1 of 2" in errors[0]
    with open(tmp_path / "results.csv") as f:
        assert [int(r["numel"]) for r in csv.DictReader(f)] == [4099]
    assert signal.getsignal(signal.SIGTERM) is handler


def _gpu_check(tmp_path, **knobs):
    env = {**os.environ, "OUT": str(tmp_path), "PY": sys.executable, "XDIST": "", "OMP_NUM_THREADS": "1",
           # CPU stage timeouts: generous (the harness is under test, not the speed); the GPU defaults sum to 410 s
           "T1": "300", "T2": "300", "T3": "300", "T4": "300", "T5": "300", "T6": "300",
           "PROFILE_ARGS": "--n-layer 1 --n-head 2 --n-embd 32 --block-size 16 --batch-size 2 --grad-accum 1",
           "PROFILE_STEPS": "2", "PROFILE_MODES": "overlap", **knobs}
    # stage 1's pytest turns the interpreter on itself (tests/conftest.py); the other stages run as a CPU user's
    # code does, on the PyTorch reference kernels (the interpreter would cost ~1 s per optimizer step)
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run(["bash", "benchmarks/gpu_check.sh"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # what comes back from a device call: at most 8 files, here exactly three
    assert sorted(os.listdir(tmp_path)) == ["env.txt", "gpu_check.tar.gz", "results.md"], os.listdir(tmp_path)
    with tarfile.open(tmp_path / "gpu_check.tar.gz") as tar:
        members = {m.name: m for m in tar.getmembers()}
        texts = {name: tar.extractfile(m).read().decode() for name, m in members.items()
                 if m.isfile() and name.endswith((".log", ".md", ".json", ".jsonl"))}
    return (tmp_path / "results.md").read_text(), members, texts


def test_gpu_check_script_runs_end_to_end_on_cpu(tmp_path):
    # the one prepared GPU script, shrunk by its knobs: a failure here would have cost a rare GPU run
    results, members, texts = _gpu_check(
        tmp_path, TESTS="tests/kernels/test_scale.py::test_deterministic_sum",
        BENCH_ARGS="--sizes 4099 --reps 1 --only scale_", MODELS="tiny",
        STEP_ARGS="--reps 2 --skip fsdp2 muon torch_muon ours_fp32_grads --kernels", BUCKET_CAPS="25 0.01",
        TIMELINE_MODELS="tiny",
        E2E_RUNS="tiny:1:3:amp,fsdp2,sharded-overlap:2",  # (one process, as on the GPU; two rounds)
        HOST_ARGS="--buckets 2 6 --reps 2 --params 12 --param-rounds 2 --model-rounds 1 --timeline-model tiny "
                  "--timeline-reps 2",
        STAGES="1 2 3 4 5 host 6")  # (6 is not in the default set any more)
    # (each message carries what it read: this test failed once in a full run, and its output was lost)
    assert " passed" in texts["gpu_check/kernel_tests.log"], texts["gpu_check/kernel_tests.log"][-3000:]
    # stage 2, sync_check: on CPU the detector is off (set_sync_debug_mode is CUDA's), so this keeps its
    # configurations working (the fp16 one skipping exactly its poisoned step), and the side-stream checks run their
    # comparison with the reference without streams (it ran in-process through the interpreter before session 15,
    # a second time: the optimizer tests run the interpreted kernels)
    from benchmarks import sync_check
    log = texts["gpu_check/sync_check.log"]
    assert log.count("3 steps") == len(sync_check.CONFIGS) and "FAILED" not in log, log[-3000:]
    assert log.count("grad buffers equal the reference") == 2, log[-3000:]
    assert "fp16 + loss scaling: 3 steps, last grad norm" in log and "skipped steps 1" in log, log[-3000:]
    assert "| kernel |" in results and "## Optimizer step, tiny" in results, results
    assert "| 0.01 |" in results and "host us / bucket" in results, "the bucket_cap_mb sweep:\n" + results
    assert "kernel by kernel (tiny" in results, "the step's kernels:\n" + results
    # the HF Trainer's loop (torch's clip over the placeholders a backward left) beside the optimizer's clip, in the
    # same harness (session 38)
    for how in ("opt.clip_grad_norm_", "torch.nn.utils.clip_grad_norm_(foreach=True)"):
        row = next(line for line in results.splitlines() if f"after a backward: {how}" in line)
        assert "did not run" not in row and "host " in row, row
    assert "## End to end, tiny" in results, results
    # stage host: the dry-run host measurement, both its figures in results.md
    host = results.split("## Host time of the GPU code path")[1]
    assert "per bucket:" in host and "no overlap_comm" in host and "iteration (2 micro-batches)" in host, host
    assert "the example's iteration at its 302M layout" in host and "overlap_comm + attach (many ranks)" in host, host
    # the step's host timeline, on the CPU of the GPU machine (dry-run: the launches are marked) and in stage 4
    assert "host timeline at the tiny layout" in host and "launch _adamw_kernel" in host, host
    assert "host timeline (tiny" in results and "| > _update_phase |" in results, results
    for config in ("amp", "fsdp2", "sharded-overlap"):
        row = next(line for line in results.splitlines() if line.startswith(f"| {config} |"))
        assert "did not run" not in row, row
    assert "gpu_check/e2e/e2e-tiny-loss.png" in members
    # two rounds, round-robin, the order reversed in the second; the ratio to amp is the median of the per-round
    # ratios, recomputed here from each run's own metrics (the median tokens/s after the first fifth of the steps)
    order = [line.split("config=")[1].split(",")[0] for line in texts["gpu_check/e2e.log"].splitlines()
             if line.strip().startswith("round ")]
    assert order == ["amp", "fsdp2", "sharded-overlap", "sharded-overlap", "fsdp2", "amp"], order

    def run_median(r, config):
        name = {"amp": "amp", "fsdp2": "fsdp2"}.get(config, "tritonshard")
        text = texts[f"gpu_check/e2e/tiny/round{r}/{config}/{name}/metrics.jsonl"]
        rows = [json.loads(x) for x in text.splitlines() if x.strip()]
        return statistics.median(x["tokens_per_s"] for x in rows[max(1, len(rows) // 5):])
    combined = {row["config"]: row for row in json.loads(texts["gpu_check/e2e/e2e-tiny.json"])}
    ratios = [run_median(r, "sharded-overlap") / run_median(r, "amp") for r in (0, 1)]
    assert combined["sharded-overlap"]["vs_amp_rounds"] == pytest.approx(ratios, rel=1e-12), (combined, ratios)
    assert len(combined["amp"]["tokens_per_s_rounds"]) == 2
    row = next(line for line in results.splitlines() if line.startswith("| sharded-overlap |"))
    assert f"({min(ratios):.2f}-{max(ratios):.2f})" in row, row
    # stage 6, the traced iteration (one of its two modes here, for time): its tables in results.md
    assert "## Traced iteration (step 2), --overlap" in results, results
    assert "gpu_check/profile-overlap/tritonshard/profile_step2.json" in members, sorted(members)
    assert "tritonshard.update[group 0]" in results, results  # (one process: a range per param group)
    # (a CUDA build of torch on a machine without a GPU, e.g. torch 2.11 from PyPI as docs/testing.md installs it,
    # makes its profiler log "gpuGetDeviceCount failed" into the host stage's output: the machine's, not a stage's)
    stages = "\n".join(line for line in results.splitlines() if "gpuGetDeviceCount failed" not in line)
    assert "failed" not in stages and "timed out" not in stages, results


def test_gpu_check_reports_a_stage_that_times_out_and_runs_only_the_stages_asked_for(tmp_path):
    # a hung stage must end within its budget and say so in results.md, and the next stage must still run
    env = {**os.environ, "OUT": str(tmp_path), "PY": sys.executable, "XDIST": "", "OMP_NUM_THREADS": "1",
           "STAGES": "2 4", "T2": "1", "T4": "300", "MODELS": "tiny",
           "STEP_ARGS": "--reps 1 --skip fsdp2 muon torch_muon ours_fp32_grads", "BUCKET_CAPS": "25"}
    env.pop("TRITON_INTERPRET", None)  # the reference kernels, as in _gpu_check (the interpreter: 25 s, not 11)
    proc = subprocess.run(["bash", "benchmarks/gpu_check.sh"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 1, "a timed-out stage fails the check"
    results = (tmp_path / "results.md").read_text()
    assert "**stage 2 timed out**" in results and "## Optimizer step, tiny" in results, results
    assert "## Sync check" in results, results
    # and only the stages asked for ran: a stage that ran twice or never would waste or lose part of a rare GPU run
    with tarfile.open(tmp_path / "gpu_check.tar.gz") as tar:
        logs = {os.path.basename(m.name) for m in tar.getmembers() if m.name.endswith(".log")}
    assert logs == {"sync_check.log", "step.log"}, logs


def test_host_overhead_benchmark_smoke(tmp_path):
    # the compiled path on a CPU (dry-run driver): needs the interpreter off, so a subprocess
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / "host.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.host_overhead", "--buckets", "2", "6", "--reps", "3",
                           "--params", "12", "--param-rounds", "2", "--model-rounds", "1", "--timeline-model", "tiny",
                           "--timeline-reps", "3", "--clip-params", "40", "--clip-rounds", "1", "--out", str(out)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    row = json.loads(out.read_text())
    assert row["buckets"] == [2, 6] and row["bound_launches"] is True
    # for all buckets at once (issue 20.3): one flatten, one norm pass, one update (segmented), one finalize; and
    # AdamW's coefficients (session 31), the clip's coefficient and the step's scalars (session 34)
    assert row["launches_per_step_at_lo"] == 7
    assert "per bucket:" in proc.stdout
    # torch's clip over the placeholders (session 37): the same few torch ops whatever the number of parameters
    # (until then a norm per piece: 40 + 14 here), against the optimizer's own clip
    clip = row["torch_clip"]
    assert clip["params"] == 40 and clip["buckets"] > 1, clip
    for way in ("torch", "torch, foreach=True", "opt.clip_grad_norm_"):
        assert clip[way]["host_ms"] > 0 and clip[way]["torch_ops"] < 40, clip
    assert "torch's clip_grad_norm_ over param.grad" in proc.stdout
    # a step under moving betas (OneCycleLR's momentum cycling, session 36) is reported beside the fixed ones (the
    # replays it must make: tests/optim/test_launch_plans.py)
    assert row["step_ms_moving_betas"] > 0 and "OneCycleLR cycles beta1" in proc.stdout
    # the step's host timeline (session 35): the calls and the bound launches in the order a step makes them, each
    # event's minimum over the steps, so never before the event it follows
    events = row["timeline"]["events"]
    names = [e["event"] for e in events]
    # (the tiny model's one bucket: its norm pass is _scale_kernel's read-only mode, several buckets' one launch is
    # _partials_multi_kernel)
    norm = "launch _scale_kernel" if row["timeline"]["buckets"] == 1 else "launch _partials_multi_kernel"
    order = ["gradients set", "> clip_grad_norm_", "> _flush_buckets", "launch _flatten_kernel", "< _flush_buckets",
             norm, "launch _finalize_kernel", "launch _clip_coefficient_kernel",
             "< clip_grad_norm_", "> step", "< _before_update", "launch _step_flags_kernel",
             "launch _coefficients_kernel", "launch _adamw_kernel", "< step", "< zero_grad", "zero_grad returned"]
    assert [n for n in names if n in order] == order, names
    assert sum(n.startswith("launch ") for n in names) == row["launches_per_step_at_lo"], names
    assert all(a["us"] <= b["us"] for a, b in zip(events, events[1:])) and events[0]["us"] > 0, events
    assert "| us | + us | event |" in proc.stdout and "| launch _adamw_kernel |" in proc.stdout
    # ... and the host calls that are not our Python (session 38: on the dry run, the one allocation a steady step
    # makes, the norm clip_grad_norm_ returns; on a GPU also the runtime's and the driver's calls)
    ops = {r["op"]: r for r in row["timeline"]["host_ops"]}
    assert ops["aten::empty"]["calls_per_step"] == 1 and not any(n.startswith("tritonshard.") for n in ops), ops
    assert "The same step's host calls under torch.profiler" in proc.stdout
    # the per-parameter figures: every phase of each mode (overlap_comm on one rank, and with the machinery of many
    # ranks, session 33), and the iteration their sum
    for mode in ("no overlap_comm", "overlap_comm", "overlap_comm (many ranks)"):
        phases = row["per_param_us"][mode]
        assert set(phases) == {"backward (no_sync)", "last backward", "clip + step + zero_grad",
                               "iteration (2 micro-batches)"}, phases
        assert math.isclose(phases["iteration (2 micro-batches)"],
                            sum(v for k, v in phases.items() if not k.startswith("iteration")))
    # the example's iteration at its 302M layout: one block's matrices per bucket (24), the embeddings', and the
    # no-decay group's; every phase of each mode
    model = row["model_iteration_ms"]
    assert model["buckets"] == 26
    for mode in ("no overlap_comm", "overlap_comm + attach", "overlap_comm + attach (many ranks)"):
        phases = model[mode]
        assert set(phases) == {"forward 1", "backward 1", "forward 2", "backward 2", "clip + step + zero_grad",
                               "iteration"}, phases
        assert math.isclose(phases["iteration"], sum(v for k, v in phases.items() if k != "iteration"))


def test_train_summary(tmp_path):
    from benchmarks import train_summary

    path = tmp_path / "metrics.jsonl"
    rows = [{"step": i + 1, "loss": 3.0 - 0.1 * i, "tokens_per_s": 100.0 + i, "skipped": 0} for i in range(20)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    text = train_summary.summary(str(path))
    # last 10 losses: 2.0 .. 1.1, mean 1.55; tokens/s after 10 steps: 110 .. 119, median 114.5 -> "114" or "115"
    assert "20 steps" in text and "| 3.000 | 1.550 |" in text and ("| 114 |" in text or "| 115 |" in text)


def test_a_failing_pytorch_way_loses_only_its_row(tmp_path, monkeypatch):
    real = bench_run.JOBS[SCALE]

    def with_a_missing_way(n, device):
        ours, ways = real[2](n, device)

        def missing():
            raise AttributeError("module 'torch' has no attribute '_fused_thing_'")
        return ours, ways + [("torch._fused_thing_", missing)]

    monkeypatch.setattr(bench_run, "JOBS", {SCALE: (real[0], real[1], with_a_missing_way)})
    errors = []
    rows = bench_run.main(["--out", str(tmp_path), "--sizes", "4099", "--reps", "1"], errors=errors)
    assert [r["torch_impl"] for r in rows] == ["mul_+vector_norm+isfinite"]
    assert len(errors) == 1 and "PyTorch way torch._fused_thing_: AttributeError" in errors[0]


def test_reduce_error_measures_bf16_against_fp32():
    from benchmarks import reduce_error

    (row,) = reduce_error.main(["--world-sizes", "2", "--numel", "4096"])
    # fp32 sums of 2 fp32 values are exact up to one fp32 rounding (2^-24); the bf16 path rounds the inputs and the
    # sum (2^-9 each): the measurement must tell them apart by orders of magnitude, with bf16 above one rounding
    assert row["fp32_rms_rel"] < 1e-6 < 1e-4 < row["bf16_once_rms_rel"] <= row["bf16_rms_rel"] < 1e-2
