"""Plot the loss curves of every run under a --out-dir of train_gpt.py into one PNG.

    python examples/plot_runs.py runs/gpt docs/loss_curves.png
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_gpt import plot_losses  # noqa: E402


def main(out_dir: str, png: str) -> None:
    labels = {"tritonshard": "tritonshard.ShardedAdamW (bf16 weights/grads, sharded fp32 master)",
              "torch": "torch.optim.AdamW (fp32, DDP)",
              "muon": "tritonshard.ShardedMuon (Muon on the blocks' matrices, AdamW on the rest)"}
    runs = {labels.get(name, name): os.path.join(out_dir, name, "metrics.jsonl") for name in sorted(os.listdir(out_dir))
            if os.path.isfile(os.path.join(out_dir, name, "metrics.jsonl"))}
    if not runs:
        raise SystemExit(f"no metrics.jsonl under {out_dir}")
    plot_losses(runs, png)
    print(f"{png}: {', '.join(runs)}")


if __name__ == "__main__":
    main(*sys.argv[1:3])
