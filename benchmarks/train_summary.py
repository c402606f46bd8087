"""One markdown section summarizing a training run's metrics.jsonl (written by examples/train_gpt.py).

    python -m benchmarks.train_summary runs/gpt/metrics.jsonl >> results.md
"""

from __future__ import annotations

import json
import statistics
import sys


def summary(path: str, last: int = 10, warmup: int = 10) -> str:
    rows = [json.loads(line) for line in open(path) if line.strip()]
    if not rows:
        raise ValueError(f"{path} has no steps")
    tail = rows[-last:]
    speed = [r["tokens_per_s"] for r in rows[warmup:]] or [r["tokens_per_s"] for r in rows]
    return "\n".join([
        f"\n## Training example: examples/train_gpt.py, {len(rows)} steps\n",
        "| first loss | mean loss, last 10 steps | median tokens/s (after 10 steps) | skipped steps |",
        "|---|---|---|---|",
        f"| {rows[0]['loss']:.3f} | {statistics.fmean(r['loss'] for r in tail):.3f} | "
        f"{statistics.median(speed):,.0f} | {rows[-1]['skipped']} |",
        "",
    ])


if __name__ == "__main__":
    print(summary(sys.argv[1]))
