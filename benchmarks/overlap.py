"""Training-step time with and without communication overlap (``overlap_comm``), under torchrun.

    torchrun --standalone --nproc-per-node 8 -m benchmarks.overlap --out benchmarks/out      # GPUs (NCCL)
    torchrun --standalone --nproc-per-node 2 -m benchmarks.overlap --tiny --out /tmp/bench   # CPU/gloo smoke run

Each mode trains the same GPT (examples/train_gpt.py's model) for --steps steps after --warmup steps and reports
the median step time (forward + backward + clip + step, synchronized at the end of each step). Overlap can only
help with several ranks: with one GPU there is nothing to overlap. Rank 0 writes ``overlap.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
from train_gpt import GPT, GPTConfig, get_batch, make_corpus, param_groups, setup_distributed  # noqa: E402

import tritonshard  # noqa: E402
from tritonshard import comm  # noqa: E402


def time_mode(overlap: bool, args, rank: int, device: torch.device) -> list[float]:
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd, block_size=args.block_size)
    model = GPT(cfg).to(device)
    opt = tritonshard.ShardedAdamW(param_groups(model, 0.1), lr=1e-3, bucket_cap_mb=args.bucket_cap_mb,
                                   overlap_comm=overlap)
    if overlap:
        opt.attach(model)
    corpus = make_corpus(0, n_problems=10_000)
    times = []
    for step in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        for micro in range(args.grad_accum):
            x, y = get_batch(corpus, 0, step, rank, micro, args.batch_size, args.block_size)
            with opt.no_sync() if micro < args.grad_accum - 1 else contextlib.nullcontext():
                model(x.to(device), y.to(device)).backward()
        opt.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
        opt.wait_for_params()  # the step is over when the weights are back
        if device.type == "cuda":
            torch.cuda.synchronize()
        if step >= args.warmup:
            times.append(time.perf_counter() - t0)
    return times


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="benchmarks/out")
    p.add_argument("--tiny", action="store_true", help="a tiny model and few steps (CPU smoke run)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--bucket-cap-mb", type=float, default=25.0)
    args = p.parse_args(argv)
    size = dict(n_layer=1, n_head=2, n_embd=32, block_size=16, batch_size=4, grad_accum=2) if args.tiny else \
        dict(n_layer=12, n_head=12, n_embd=768, block_size=1024, batch_size=8, grad_accum=2)
    for k, v in size.items():
        setattr(args, k, v)
    if args.tiny:
        args.steps, args.warmup, args.bucket_cap_mb = min(args.steps, 3), min(args.warmup, 1), 0.01
    rank, world, device = setup_distributed()
    rows = []
    for overlap in (False, True):
        times = time_mode(overlap, args, rank, device)
        rows.append({"overlap_comm": overlap, "median_step_ms": 1e3 * statistics.median(times),
                     "steps": len(times), "world_size": world, "device": str(device),
                     "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                     "torch": torch.__version__, **size})
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "overlap.json"), "w") as f:
            json.dump(rows, f, indent=1)
        plain, overlapped = (r["median_step_ms"] for r in rows)
        print(f"world size {world} on {rows[0]['gpu']}: step {plain:.1f} ms without overlap, {overlapped:.1f} ms "
              f"with ({plain / overlapped:.2f}x)")
    if dist.is_initialized():
        comm.destroy_process_group()  # (a collection first: see there)


if __name__ == "__main__":
    main()
