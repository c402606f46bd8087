"""Train a Hugging Face LlamaForCausalLM with ShardedAdamW, written the way Hugging Face training loops are written.

Run it (2 processes on CPU with gloo; on GPUs the same script uses NCCL, one process per GPU):

    torchrun --standalone --nproc-per-node 2 examples/train_hf.py
    torchrun --standalone --nproc-per-node 2 examples/train_hf.py --optimizer torch   # fp32 DDP + torch AdamW

The model comes from a tiny ``LlamaConfig`` (no downloads); the data is the main example's generated stream of
addition problems (examples/train_gpt.py), one character per token. The loop uses the idioms of Hugging Face code,
unchanged for tritonshard: the loss from ``model(input_ids=..., labels=...)``, ``torch.nn.utils.clip_grad_norm_``
on ``model.parameters()``, a ``transformers`` cosine schedule, ``model.save_pretrained`` right after the last
``step()``. What tritonshard needs is two lines: build the optimizer, ``opt.attach(model)``.

Writes --out-dir/<optimizer>/metrics.jsonl, loss.png (both runs side by side when both exist) and the trained model
(save_pretrained) to --out-dir/<optimizer>/model.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is built locally
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, get_cosine_schedule_with_warmup  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_gpt import VOCAB, fmt_bytes, get_batch, make_corpus, make_progress, plot_losses  # noqa: E402

import tritonshard  # noqa: E402
from tritonshard.comm import destroy_process_group, local_device  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--optimizer", choices=["tritonshard", "torch"], default="tritonshard",
                   help="tritonshard: ShardedAdamW (bf16 weights, sharded fp32 master); torch: fp32 DDP + AdamW")
    p.add_argument("--hidden-size", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=16, help="sequences per micro-batch per rank")
    p.add_argument("--grad-accum", type=int, default=2, help="micro-batches per step")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--clip", type=float, default=1.0, help="max global gradient norm")
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=False,
                   help="tritonshard's overlap_comm (reduce-scatter during backward, all-gather during forward)")
    p.add_argument("--out-dir", default="runs/hf")
    p.add_argument("--no-progress", action="store_true", help="plain log lines instead of a progress bar")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    device = local_device()  # cuda:<LOCAL_RANK> (indexed), made current before NCCL starts; else the CPU
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if "RANK" in os.environ:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        # a hung or stopped rank ends the job within minutes, not the 30-minute default
        dist.init_process_group(backend, timeout=datetime.timedelta(minutes=float(os.environ.get("DIST_TIMEOUT_MIN",
                                                                                                  10))))
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    out_dir = os.path.join(args.out_dir, args.optimizer)

    torch.manual_seed(args.seed)
    config = LlamaConfig(vocab_size=len(VOCAB), hidden_size=args.hidden_size, intermediate_size=4 * args.hidden_size,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.kv_heads, max_position_embeddings=args.block_size)
    model = LlamaForCausalLM(config).to(device)           # move first, then build the optimizer
    n_params = sum(p.numel() for p in model.parameters())
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]

    if args.optimizer == "tritonshard":
        opt = tritonshard.ShardedAdamW(groups, lr=args.lr, betas=(0.9, 0.95), overlap_comm=args.overlap)
        opt.attach(model)                                  # names in errors; the model's reads wait for gathers
        train_model, no_sync = model, opt.no_sync
        memory = opt.memory_bytes()["total"]
    else:
        train_model = torch.nn.parallel.DistributedDataParallel(model) if world > 1 else model
        opt = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95))
        no_sync = train_model.no_sync if world > 1 else contextlib.nullcontext
        memory = 16 * n_params
    sched = get_cosine_schedule_with_warmup(opt, args.warmup, args.steps)

    corpus = make_corpus(args.seed)
    metrics = None
    if rank == 0:
        os.makedirs(out_dir, exist_ok=True)
        metrics = open(os.path.join(out_dir, "metrics.jsonl"), "w")
        print(f"{args.optimizer}: LlamaForCausalLM, {n_params / 1e6:.2f}M parameters, world size {world}, "
              f"device {device}; optimizer memory per rank {fmt_bytes(memory)} ({memory / n_params:.1f} B/param)")
    bar = make_progress(args, 0) if rank == 0 else None
    model.train()
    for step in range(args.steps):
        t0 = time.perf_counter()
        loss_sum = torch.zeros((), device=device)
        for micro in range(args.grad_accum):
            ids, _ = get_batch(corpus, args.seed, step, rank, micro, args.batch_size, args.block_size)  # (B, T)
            ids = ids.to(device)
            with no_sync() if micro < args.grad_accum - 1 else contextlib.nullcontext():
                loss = train_model(input_ids=ids, labels=ids).loss / args.grad_accum  # HF shifts the labels
                loss.backward()
            loss_sum += loss.detach()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)  # the global norm, all ranks
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if world > 1:
            dist.all_reduce(loss_sum)
        if rank == 0:
            row = {"step": step + 1, "loss": loss_sum.item() / world, "grad_norm": float(grad_norm),
                   "lr": sched.get_last_lr()[0],
                   "tokens_per_s": args.batch_size * args.block_size * args.grad_accum * world
                   / (time.perf_counter() - t0),
                   "skipped": int(opt.skipped_steps) if args.optimizer == "tritonshard" else 0}
            metrics.write(json.dumps(row) + "\n")
            bar.update(row)
    # right after the last step(): save_pretrained reads model.state_dict(), which waits for in-flight gathers
    if rank == 0:
        bar.close()
        metrics.close()
        model.save_pretrained(os.path.join(out_dir, "model"))
        runs = {name: os.path.join(args.out_dir, name, "metrics.jsonl") for name in ("tritonshard", "torch")}
        plot_losses({k: v for k, v in runs.items() if os.path.isfile(v)}, os.path.join(out_dir, "loss.png"))
        print(f"metrics: {os.path.join(out_dir, 'metrics.jsonl')}; loss curve: {os.path.join(out_dir, 'loss.png')}")
    if dist.is_initialized():
        # Teardown: while rank 0 saves and plots, the others must not destroy the group under it, and nothing that
        # holds the group (DDP's reducer, the optimizer) may outlive it into interpreter shutdown: 2 of 6 runs of
        # the HF example's DDP baseline hung there (2026-11-30) before this barrier and del. ``no_sync`` too: as
        # DDP's bound method it kept DDP, so its reducer, alive past destroy_process_group(); the reducer was then
        # the group's last owner, and freeing it at exit joined gloo's worker thread while holding the GIL that
        # thread waited for (a py-spy stack of a DDP baseline hung at exit, 2026-12-01)
        dist.barrier()
        del train_model, opt, sched, no_sync
        destroy_process_group()  # (tritonshard's: cycles holding the group are collected first, not at shutdown)


if __name__ == "__main__":
    main()
