"""What a bf16 SUM reduce-scatter loses against fp32, by world size: when is grad_dtype=torch.float32 worth it?

    python -m benchmarks.reduce_error [--world-sizes 2,4,8,16,32] [--numel 65536] [--out DIR]

Every rank holds a gradient-like tensor (independent normal values, seeded by rank); the flat buffer is
reduce-scattered with SUM through real gloo processes, once in bf16 (``grad_dtype=torch.bfloat16``: each add of
the reduction rounds to bf16) and once in fp32. Each rank rebuilds every rank's contribution from the seeds, so
it knows the exact (float64) sum of its shard. Reported per world size d, relative to the RMS of the exact sum:
the RMS and max error of the bf16 reduction, of the fp32 one, and of rounding the exact sum to bf16 once (the
floor any bf16 result has). The bf16 error grows with the number of rounded adds a value goes through (about
sqrt(d) roundings of 2^-9 relative each, if they are independent); gloo's CPU algorithm need not be NCCL's ring,
so this measures the order of magnitude, not NCCL's exact figure.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tritonshard import comm


def _grad(rank: int, numel: int) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(1000 + rank))


def _worker(rank: int, world: int, numel: int, store_path: str, result_path: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    try:
        shard = numel // world
        lo, hi = rank * shard, (rank + 1) * shard
        exact = sum(_grad(r, numel)[lo:hi].double() for r in range(world))
        stats = []
        for dtype in (torch.bfloat16, torch.float32):
            out = torch.empty(shard, dtype=dtype)
            comm.reduce_scatter_single(out, _grad(rank, numel).to(dtype), op=dist.ReduceOp.SUM)
            err = out.double() - exact
            stats += [float(err.square().sum()), float(err.abs().max())]
        once = exact.to(torch.bfloat16).double() - exact  # one rounding of the exact sum
        stats += [float(once.square().sum()), float(once.abs().max()), float(exact.square().sum())]
        totals = torch.tensor(stats, dtype=torch.float64)
        sums, maxes = totals.clone(), totals.clone()
        dist.all_reduce(sums, op=dist.ReduceOp.SUM)
        dist.all_reduce(maxes, op=dist.ReduceOp.MAX)
        if rank == 0:
            rms = math.sqrt(sums[6] / numel)
            row = {"world_size": world, "numel": numel, "exact_rms": rms}
            for i, name in enumerate(("bf16", "fp32", "bf16_once")):
                row[f"{name}_rms_rel"] = math.sqrt(sums[2 * i] / numel) / rms
                row[f"{name}_max_rel"] = float(maxes[2 * i + 1]) / rms
            with open(result_path, "w") as f:
                json.dump(row, f)
    finally:
        comm.destroy_process_group()  # (a collection first: see there)


def measure(world: int, numel: int) -> dict:
    numel -= numel % world
    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "row.json")
        mp.start_processes(_worker, args=(world, numel, os.path.join(tmp, "store"), result), nprocs=world,
                           join=True, start_method="spawn")
        with open(result) as f:
            return json.load(f)


def table(rows: list[dict]) -> str:
    lines = ["| ranks | bf16 reduce RMS err | bf16 max err | fp32 RMS err | one bf16 rounding RMS | bf16 / one rounding |",
             "|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['world_size']} | {r['bf16_rms_rel']:.2e} | {r['bf16_max_rel']:.2e} | "
                     f"{r['fp32_rms_rel']:.1e} | {r['bf16_once_rms_rel']:.2e} | "
                     f"{r['bf16_rms_rel'] / r['bf16_once_rms_rel']:.1f}x |")
    return "\n".join(lines) + "\n\n(errors relative to the RMS of the exact sum)\n"


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world-sizes", default="2,4,8,16,32")
    ap.add_argument("--numel", type=int, default=65536)
    ap.add_argument("--out", help="folder for reduce_error.json and reduce_error.md")
    args = ap.parse_args(argv)
    rows = []
    for world in (int(w) for w in args.world_sizes.split(",")):
        rows.append(measure(world, args.numel))
        print(f"d={world}: bf16 RMS error {rows[-1]['bf16_rms_rel']:.2e} of the sum's RMS", flush=True)
    text = table(rows)
    print(text)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "reduce_error.json"), "w") as f:
            json.dump(rows, f, indent=1)
        with open(os.path.join(args.out, "reduce_error.md"), "w") as f:
            f.write(text)
    return rows


if __name__ == "__main__":
    main()
