"""End to end, side by side: the training example with tritonshard and with the baselines a user would pick.

    python -m benchmarks.e2e --model 85M --nproc 1 --steps 25          # one GPU (NCCL world size 1)
    python -m benchmarks.e2e --model tiny --nproc 2 --steps 6          # the CPU smoke run CI does (gloo)

Every configuration trains ``examples/train_gpt.py`` on the same model, data, seed and lr schedule, in fresh
processes (so one run's allocator state or compile cache cannot help the next): a ``torchrun``, or with
``--nproc 1`` the one worker such a torchrun would start, with the environment torchrun gives it (a process group
of one rank: NCCL world size 1 on a GPU), without the agent process, which cost ~4 s per run here (importing torch
a second time) and on the GPU machine too. Each run writes no plot of its own (~2 s of matplotlib); this script
plots them all together:

* ``amp``: torch AMP: fp32 weights, bf16 autocast, DDP, fused ``torch.optim.AdamW``, torch's ``clip_grad_norm_``;
* ``fsdp2``: ``fully_shard`` per block and at the root, ``MixedPrecisionPolicy(param_dtype=bfloat16,
  reduce_dtype=float32)``, fused AdamW;
* ``sharded``: ``ShardedAdamW`` without ``overlap_comm``; ``sharded-overlap``: with ``overlap_comm`` + ``attach``;
  ``sharded-graph`` (GPU only, not in the default set): without ``overlap_comm``, with ``cuda_graph=True``;
* ``muon``: ``ShardedMuon`` (Muon on the blocks' matrices, AdamW on the rest; overlap on, the example's default);
* ``torch`` (not in the default set): fp32 weights and compute, DDP, ``torch.optim.AdamW``.

Reported per configuration: median tokens/s over the steps after the first fifth (compilation, allocator warm-up),
the ratio to ``amp``, the peak memory per rank (CUDA: max allocated; CPU: peak RSS, which includes the interpreter
and says little), the optimizer's own memory per rank, the mean loss over the last steps, skipped steps; and one
loss-curve plot of all runs. CPU timings mean nothing for GPUs: the CPU run proves the harness and the baselines work.

``--rounds R`` runs every configuration R times, round-robin, the order reversed every other round (A B C, C B A,
...), and reports per configuration the median of its runs' tokens/s, and the ratio to ``amp`` as the median of the
per-round ratios (each configuration against the ``amp`` run of its own round) with their range. Why: at these sizes
every configuration is host-bound on the H200 machine, and that host's speed drifted by up to +-30 % within one
run and between runs of one session (2026-12-04: AMP at 302M 83.7k tok/s in one run, 113k in the next, sharded
without overlap 1.14x of AMP in the first, 0.82x in the second). One run per configuration in a row compares the
machine's moods as much as the code.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import socket
import statistics
import subprocess
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "train_gpt.py")

CONFIGS = {
    "amp": ["--optimizer", "amp"],
    "fsdp2": ["--optimizer", "fsdp2"],
    "sharded": ["--optimizer", "tritonshard", "--no-overlap"],
    "sharded-overlap": ["--optimizer", "tritonshard", "--overlap"],
    "sharded-graph": ["--optimizer", "tritonshard", "--no-overlap", "--cuda-graph"],
    "muon": ["--optimizer", "muon"],
    "torch": ["--optimizer", "torch"],
}
DEFAULT_CONFIGS = ["amp", "fsdp2", "sharded", "sharded-overlap", "muon"]

#: model and batch: (n_layer, n_head, n_embd, block_size, batch_size, grad_accum). 85M and 302M are the shapes of
#: the first H200 comparison (16 sequences x 256 tokens x 2 micro-batches per rank).
MODELS = {
    "tiny": (2, 2, 32, 32, 4, 2),
    "example": (4, 4, 128, 64, 16, 2),
    "85M": (12, 12, 768, 256, 16, 2),
    "302M": (24, 16, 1024, 256, 16, 2),
}


#: the example's lr (3e-3) where a model trains stably with it; 302M diverged there in the first steps (loss 2.9 ->
#: 7-9 by step 5 under every optimizer, torch AMP included), and in that chaos 1-ulp differences grow into losses
#: 3.03 (AMP) against 3.98 (ShardedAdamW) after 15 steps (H200, 2026-12-04), a column that compared nothing. At
#: 6e-4 all three runs ended at 2.5605. Given last, so --example-args --lr still wins.
MODEL_LR = {"302M": 6e-4}


def _train_gpt():
    spec = importlib.util.spec_from_file_location("train_gpt", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules["train_gpt"] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def one_worker_env() -> dict:
    """What ``torchrun --standalone --nproc-per-node 1`` puts in its worker's environment for
    ``init_process_group``: rank 0 of 1, and a free port on this host for the store."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": "0",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}


def run_config(name: str, args, out_dir: str) -> dict:
    n_layer, n_head, n_embd, block, batch, accum = MODELS[args.model]
    example = [EXAMPLE, *CONFIGS[name], "--n-layer", str(n_layer), "--n-head", str(n_head), "--n-embd", str(n_embd),
               "--block-size", str(block), "--batch-size", str(batch), "--grad-accum", str(accum),
               "--steps", str(args.steps), "--warmup", str(max(1, args.steps // 5)), "--no-progress", "--no-save",
               "--no-plot", "--out-dir", os.path.join(out_dir, name),
               *(["--lr", str(MODEL_LR[args.model])] if args.model in MODEL_LR else []), *args.example_args]
    env = None
    if args.nproc == 1:  # torchrun's one worker, without the agent (see the module's docstring)
        cmd = [sys.executable, *example]
        env = {**os.environ, **one_worker_env()}
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.nproc),
               *example]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=args.timeout, env=env)
    row = {"config": name, "wall_s": time.perf_counter() - t0}
    run_dir = os.path.join(out_dir, name, CONFIGS[name][1])
    with open(os.path.join(out_dir, f"{name}.log"), "w") as f:
        f.write(" ".join(cmd) + "\n" + proc.stdout + proc.stderr)
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-3:]
        return {**row, "error": f"exit {proc.returncode}: " + " | ".join(tail)}
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl")) if line.strip()]
    summary = json.load(open(os.path.join(run_dir, "summary.json")))
    warm = max(1, len(rows) // 5)
    last = max(1, min(10, len(rows) // 3))
    row.update(
        steps=len(rows), tokens_per_s=statistics.median(r["tokens_per_s"] for r in rows[warm:] or rows),
        final_loss=statistics.fmean(r["loss"] for r in rows[-last:]), last_steps=last,
        skipped=rows[-1]["skipped"], peak_memory_bytes=summary["peak_memory_bytes_per_rank"],
        peak_memory_kind=summary["peak_memory_kind"], optimizer_bytes=summary["optimizer_memory_bytes_per_rank"],
        params=summary["params"], world_size=summary["world_size"], device=summary["device"],
        metrics=os.path.join(run_dir, "metrics.jsonl"))
    return row


def combine(runs: list[dict], amp_runs: list[dict] | None) -> dict:
    """One row from a configuration's runs (one per round): the first run's row with tokens/s the median over the
    rounds, the largest peak memory, and, where ``amp_runs`` (the same rounds of ``amp``) ran too, the per-round
    ratios to them (``vs_amp_rounds``). The first error, if any run failed."""
    failed = next((r for r in runs if "error" in r), None)
    if failed is not None:
        return failed
    row = dict(runs[0])
    row["tokens_per_s_rounds"] = [r["tokens_per_s"] for r in runs]
    row["tokens_per_s"] = statistics.median(row["tokens_per_s_rounds"])
    row["peak_memory_bytes"] = max(r["peak_memory_bytes"] for r in runs)
    row["wall_s"] = sum(r["wall_s"] for r in runs)
    if amp_runs and all("tokens_per_s" in a for a in amp_runs):
        row["vs_amp_rounds"] = [r["tokens_per_s"] / a["tokens_per_s"] for r, a in zip(runs, amp_runs)]
    return row


def markdown(rows: list[dict], args) -> str:
    device = next((r["device"] for r in rows if "device" in r), "?")
    name = torch.cuda.get_device_name() if device.startswith("cuda") else f"CPU ({os.cpu_count()} cores)"
    params = next((r["params"] for r in rows if "params" in r), 0)
    amp = next((r["tokens_per_s"] for r in rows if r["config"] == "amp" and "tokens_per_s" in r), None)
    n_layer, n_head, n_embd, block, batch, accum = MODELS[args.model]
    lines = [f"\n## End to end, {args.model} ({params / 1e6:.1f}M parameters), {args.nproc} rank(s), {name}\n",
             f"examples/train_gpt.py, {n_layer} x {n_embd}, {batch} x {block} tokens x {accum} micro-batches per "
             f"rank, {args.steps} steps, same data and seed; torch {torch.__version__}; `python -m benchmarks.e2e "
             f"--model {args.model} --nproc {args.nproc} --steps {args.steps}"
             f"{f' --rounds {args.rounds}' if args.rounds > 1 else ''}"
             f"{' --example-args ' + ' '.join(args.example_args) if args.example_args else ''}`"
             + (f"; {args.rounds} rounds, round-robin: tokens/s the median over the rounds, vs amp the median of "
                "the per-round ratios (their range in brackets)" if args.rounds > 1 else "") + "\n",
             "| run | tokens/s (median) | vs amp | peak memory / rank | optimizer memory / rank | loss (mean of last "
             "steps) | skipped |", "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['config']} | - | - | - | - | - | did not run: {r['error']} |")
            continue
        if len(r.get("vs_amp_rounds", ())) > 1:
            ratios = r["vs_amp_rounds"]
            ratio = f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})"
        else:
            ratio = f"{r['tokens_per_s'] / amp:.2f}x" if amp else "-"
        lines.append(f"| {r['config']} | {r['tokens_per_s']:,.0f} | {ratio} | {r['peak_memory_bytes'] / 2**30:.2f} GiB "
                     f"| {r['optimizer_bytes'] / 2**30:.3f} GiB | {r['final_loss']:.4f} (last {r['last_steps']}) "
                     f"| {r['skipped']} |")
    kind = next((r["peak_memory_kind"] for r in rows if "peak_memory_kind" in r), "")
    lines.append(f"\nPeak memory: {kind}.")
    return "\n".join(lines) + "\n"


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=list(MODELS), default="tiny")
    p.add_argument("--nproc", type=int, default=2, help="ranks (processes) per run")
    p.add_argument("--steps", type=int, default=25)
    p.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=DEFAULT_CONFIGS)
    p.add_argument("--timeout", type=float, default=600, help="seconds per configuration")
    p.add_argument("--out", default="benchmarks/out/e2e", help="runs, logs, e2e-<model>.json and the loss plot")
    p.add_argument("--markdown", help="append the table to FILE")
    p.add_argument("--rounds", type=int, default=1,
                   help="run every configuration this many times, round-robin (see the module's docstring)")
    p.add_argument("--example-args", nargs=argparse.REMAINDER, default=[],
                   help="passed on to examples/train_gpt.py (last on the command line)")
    args = p.parse_args(argv)
    out_dir = os.path.join(args.out, args.model)
    os.makedirs(out_dir, exist_ok=True)
    if args.rounds < 1:
        raise SystemExit(f"--rounds must be at least 1, got {args.rounds}")
    runs: dict[str, list[dict]] = {name: [] for name in args.configs}
    for r in range(args.rounds):
        round_dir = out_dir if args.rounds == 1 else os.path.join(out_dir, f"round{r}")
        for name in (args.configs if r % 2 == 0 else args.configs[::-1]):
            try:
                row = run_config(name, args, round_dir)
            except subprocess.TimeoutExpired:
                row = {"config": name, "error": f"timed out after {args.timeout:.0f} s"}
            runs[name].append(row)
            print("  " + (f"round {r}: " if args.rounds > 1 else "")
                  + ", ".join(f"{k}={v:,.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()
                              if k != "metrics"), flush=True)
    rows = [combine(runs[name], runs.get("amp")) for name in args.configs]
    with open(os.path.join(args.out, f"e2e-{args.model}.json"), "w") as f:
        json.dump(rows, f, indent=1)
    curves = {r["config"]: r["metrics"] for r in rows if "metrics" in r}
    if curves:
        _train_gpt().plot_losses(curves, os.path.join(args.out, f"e2e-{args.model}-loss.png"))
    table = markdown(rows, args)
    print(table)
    if args.markdown:
        with open(args.markdown, "a") as f:
            f.write(table)
    return rows


if __name__ == "__main__":
    rows = main()
    sys.exit(1 if any("error" in r for r in rows) else 0)
