"""Train a small GPT with ShardedAdamW: bf16 weights and gradients, fp32 master weights sharded over the ranks.

Run it (2 processes on CPU with gloo; on GPUs the same script uses NCCL, one process per GPU):

    torchrun --standalone --nproc-per-node 2 examples/train_gpt.py
    torchrun --standalone --nproc-per-node 2 examples/train_gpt.py --optimizer torch   # fp32 DDP + AdamW baseline
    torchrun --standalone --nproc-per-node 2 examples/train_gpt.py --optimizer muon    # ShardedMuon (+ AdamW)
    torchrun --standalone --nproc-per-node 2 examples/train_gpt.py --optimizer amp     # torch AMP baseline
    torchrun --standalone --nproc-per-node 2 examples/train_gpt.py --optimizer fsdp2   # FSDP2 bf16 baseline
    torchrun --standalone --nproc-per-node 2 examples/train_gpt.py --resume            # continue from a checkpoint

The data is generated, not downloaded: a character-level stream of addition problems ("123+45=168;"), so the
loss has something to learn (the digits of the sum) and falls well below the entropy of random digits.

The baselines are what a user would otherwise run, on the same model, data, seed and schedule: ``torch`` (fp32
weights and compute, DDP, torch.optim.AdamW), ``amp`` (torch AMP: fp32 weights, bf16 autocast, DDP, fused
torch.optim.AdamW) and ``fsdp2`` (``fully_shard`` per block and at the root with
``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)``, fused torch.optim.AdamW); all clip with
torch's ``clip_grad_norm_``. ``benchmarks/e2e.py`` runs them side by side.

What it prints: a progress bar with loss, tokens/s, gradient norm and skipped steps; the optimizer's memory per
rank next to what plain fp32 AdamW would hold; at the end the peak memory per rank (CUDA: max allocated; CPU: peak
RSS of the process). What it writes to --out-dir: metrics.jsonl (one line per step), summary.json and loss.png. Checkpoints go to --out-dir/checkpoints every --ckpt-interval steps and on Ctrl-C / SIGTERM.
Batches and learning rates are pure functions of (seed, step, rank), so --resume continues exactly where the
checkpoint left off.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import functools
import json
import math
import os
import signal
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import tritonshard
from tritonshard.comm import destroy_process_group, local_device
from tritonshard.checkpoint import latest_checkpoint, load_sharded, save_checkpoint


# ----------------------------------------------------------------------------- data
VOCAB = "0123456789+=;"
STOI = {c: i for i, c in enumerate(VOCAB)}


def make_corpus(seed: int, n_problems: int = 100_000) -> torch.Tensor:
    """A long token stream of 'a+b=c;' problems with 1-3 digit operands."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randint(0, 1000, (n_problems,), generator=g).tolist()
    b = torch.randint(0, 1000, (n_problems,), generator=g).tolist()
    text = "".join(f"{x}+{y}={x + y};" for x, y in zip(a, b))
    return torch.tensor([STOI[c] for c in text], dtype=torch.long)


def get_batch(corpus: torch.Tensor, seed: int, step: int, rank: int, micro: int, batch_size: int,
              block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(hash((seed, step, rank, micro)) % 2 ** 62)
    starts = torch.randint(0, corpus.numel() - block_size - 1, (batch_size,), generator=g)
    x = torch.stack([corpus[s:s + block_size] for s in starts.tolist()])          # (B, T)
    y = torch.stack([corpus[s + 1:s + 1 + block_size] for s in starts.tolist()])  # (B, T)
    return x, y


# ----------------------------------------------------------------------------- model
@dataclasses.dataclass(kw_only=True)
class GPTConfig:
    vocab_size: int = len(VOCAB)
    block_size: int = 64  #: context length
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(cfg.n_embd), nn.LayerNorm(cfg.n_embd)
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.fc, self.fc_out = nn.Linear(cfg.n_embd, 4 * cfg.n_embd), nn.Linear(4 * cfg.n_embd, cfg.n_embd)
        self.n_head = cfg.n_head

    def forward(self, x):                                                        # (B, T, C)
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))  # (B, H, T, D)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)              # (B, H, T, D)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.fc_out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.head.weight = self.tok.weight  # tied: one parameter used twice in forward
        for name, p in self.named_parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * cfg.n_layer) if name.endswith(("proj.weight",
                                                                                           "fc_out.weight")) else 0.02)

    def forward(self, idx, targets):                                             # (B, T), (B, T)
        T = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(T, device=idx.device))         # (B, T, C)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))                                         # (B, T, V)
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def param_groups(model: nn.Module, weight_decay: float):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def muon_param_groups(model: nn.Module, args):
    """Muon for the blocks' matrices; AdamW for the embeddings (and the head tied to them), positions, norms and
    biases, as Muon's authors prescribe. Each group keeps its own peak lr (``base_lr``) for the schedule."""
    matrices = [p for n, p in model.named_parameters() if n.startswith("blocks.") and p.dim() == 2]
    embeddings = [p for n, p in model.named_parameters() if not n.startswith("blocks.") and p.dim() == 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    adamw = dict(use_muon=False, lr=args.lr, base_lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    return [{"params": matrices, "lr": args.muon_lr, "base_lr": args.muon_lr},
            {"params": embeddings, "weight_decay": args.weight_decay, **adamw},
            {"params": rest, "weight_decay": 0.0, **adamw}]


def lr_at(step: int, args) -> float:
    """Linear warmup, then cosine decay to min_lr at the last step."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.min_lr + 0.5 * (args.lr - args.min_lr) * (1 + math.cos(math.pi * min(1.0, progress)))


#: the torch.optim baselines (the rest are tritonshard's optimizers)
BASELINES = ("torch", "amp", "fsdp2")
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}  # (--state-dtype, --grad-dtype)


def shard_fsdp2(model: "GPT") -> None:
    """FSDP2 as its docs recommend: every block, then the root; bf16 compute, fp32 gradient reduction."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mp_policy=mp)
    fully_shard(model, mp_policy=mp)


@contextlib.contextmanager
def fsdp2_no_sync(model):
    """FSDP2's gradient accumulation without communication (set_requires_gradient_sync, its no_sync)."""
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def peak_memory_bytes(device) -> int:
    """This process's peak memory: CUDA's max allocated, or on a CPU the peak resident set size."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated()  # the current device (no argument: see tritonshard.comm)
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


# ----------------------------------------------------------------------------- main
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--optimizer", choices=["tritonshard", "muon", *BASELINES], default="tritonshard",
                   help="tritonshard: ShardedAdamW, bf16 model; muon: ShardedMuon for the blocks' matrices and AdamW "
                        "for the rest, bf16 model; torch: fp32 model, DDP, torch.optim.AdamW; amp: torch AMP (fp32 "
                        "weights, bf16 autocast, DDP, fused AdamW); fsdp2: fully_shard with bf16 MixedPrecisionPolicy, "
                        "fused AdamW")
    p.add_argument("--muon-lr", type=float, default=0.02, help="peak lr of the Muon group (--optimizer muon)")
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=16, help="sequences per micro-batch per rank")
    p.add_argument("--grad-accum", type=int, default=2, help="micro-batches per step")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--min-lr", type=float, default=3e-4)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--clip", type=float, default=1.0, help="max global gradient norm (0: no clipping)")
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--bucket-cap-mb", type=float, default=25.0)
    p.add_argument("--state-dtype", choices=["fp32", "bf16"], default="fp32",
                   help="optimizer state (moments) dtype; bf16 halves it")
    p.add_argument("--state-rounding", choices=["stochastic", "nearest"], default="stochastic",
                   help="rounding of bf16 optimizer states")
    p.add_argument("--grad-dtype", choices=["bf16", "fp32"], default="bf16",
                   help="gradient buffers and reduce-scatter dtype; fp32 for many ranks (README: Gradient precision)")
    p.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=True,
                   help="overlap reduce-scatters with backward and all-gathers with the next forward")
    p.add_argument("--cuda-graph", action="store_true",
                   help="--optimizer tritonshard: capture the step in CUDA graphs (needs a GPU and --no-overlap)")
    p.add_argument("--ckpt-interval", type=int, default=100, help="steps between checkpoints (0: only at the end)")
    p.add_argument("--no-save", action="store_true", help="write no checkpoints at all (benchmark runs)")
    p.add_argument("--no-plot", action="store_true",
                   help="write no loss.png (benchmark runs plot every run together; matplotlib costs ~2 s here)")
    p.add_argument("--out-dir", default="runs/gpt")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --out-dir")
    p.add_argument("--stop-after", type=int, default=0,
                   help="checkpoint and exit after this step, as on Ctrl-C (for time-boxed jobs); 0: never")
    p.add_argument("--no-progress", action="store_true", help="plain log lines instead of a progress bar")
    p.add_argument("--profile-step", type=int, default=0,
                   help="trace this step with torch.profiler (host and device): rank 0 writes "
                        "profile_step<N>.json (chrome trace) and .txt (top ops) to the run directory; 0: off")
    p.add_argument("--profile-with-stack", action="store_true",
                   help="record Python call stacks in the trace too (which Python function the host time of a "
                        "hook or a step goes to; it slows the traced iteration down)")
    return p.parse_args(argv)


def start_profile(device, with_stack: bool = False):
    """torch.profiler over one training iteration (forward, backward, clipping, step, zero_grad), host and device;
    ``with_stack``: Python functions too (python_function events in the chrome trace)."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    profiler = torch.profiler.profile(activities=activities, with_stack=with_stack)
    profiler.__enter__()
    return profiler


def _ranges_table(averages, prefixes: tuple) -> str:
    """Every profiler range whose name starts with one of ``prefixes``, by inclusive host time: the tables above
    keep the top rows only, where the optimizer's short ranges can rank below the model's ops."""
    rows = sorted((e for e in averages if e.key.startswith(prefixes)), key=lambda e: -e.cpu_time_total)
    lines = [f"{'name':<60} {'calls':>6} {'host total us':>14} {'host self us':>13} {'device total us':>16}"]
    lines += [f"{e.key[:60]:<60} {e.count:>6} {e.cpu_time_total:>14.1f} {e.self_cpu_time_total:>13.1f} "
              f"{getattr(e, 'device_time_total', 0.0):>16.1f}" for e in rows]
    return "\n".join(lines)


def end_profile(profiler, device, out_dir, step: int) -> None:
    """Close the trace once the device has finished the step; ``out_dir`` (rank 0): write the chrome trace and the
    top ops by host time and by device time."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    profiler.__exit__(None, None, None)
    if out_dir is None:
        return
    profiler.export_chrome_trace(os.path.join(out_dir, f"profile_step{step}.json"))
    averages = profiler.key_averages()
    tables = [f"step {step}, top ops by host (self CPU) time\n"
              + averages.table(sort_by="self_cpu_time_total", row_limit=25),
              f"step {step}, top ranges by inclusive host time (the optimizer's: Optimizer.step, tritonshard.*)\n"
              + averages.table(sort_by="cpu_time_total", row_limit=40)]
    if device.type == "cuda":
        tables.append(f"step {step}, top ops by device time\n"
                      + averages.table(sort_by="self_device_time_total", row_limit=25))
    tables.append(f"step {step}, the optimizer's ranges (Optimizer.*, tritonshard.*), all of them\n"
                  + _ranges_table(averages, ("Optimizer.", "tritonshard.")))
    with open(os.path.join(out_dir, f"profile_step{step}.txt"), "w") as f:
        f.write("\n\n".join(tables))


def setup_distributed():
    if "RANK" not in os.environ:  # plain `python train_gpt.py`: one process, no process group
        device = local_device()  # cuda:<current> (always with an index: device_id= and memory stats need it)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        return 0, 1, device
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    # a timeout a user would choose: a hung or stopped rank ends the job in minutes, not gloo's/NCCL's default 30
    dist.init_process_group(backend, timeout=datetime.timedelta(minutes=float(os.environ.get("DIST_TIMEOUT_MIN", 10))))
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    return dist.get_rank(), dist.get_world_size(), device


def main(argv=None):
    args = parse_args(argv)
    rank, world, device = setup_distributed()
    if device.type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    out_dir = os.path.join(args.out_dir, args.optimizer)
    ckpt_dir = os.path.join(out_dir, "checkpoints")
    torch.manual_seed(args.seed)
    cfg = GPTConfig(block_size=args.block_size, n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd)
    model = GPT(cfg).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    corpus = make_corpus(args.seed)

    if args.optimizer == "tritonshard":
        opt = tritonshard.ShardedAdamW(param_groups(model, args.weight_decay), lr=args.lr, betas=(0.9, 0.95),
                                       bucket_cap_mb=args.bucket_cap_mb, overlap_comm=args.overlap,
                                       state_dtype=DTYPES[args.state_dtype],
                                       state_rounding=args.state_rounding, cuda_graph=args.cuda_graph,
                                       grad_dtype=DTYPES[args.grad_dtype])
    elif args.optimizer == "muon":
        opt = tritonshard.ShardedMuon(muon_param_groups(model, args), lr=args.muon_lr, weight_decay=args.weight_decay,
                                      bucket_cap_mb=args.bucket_cap_mb, overlap_comm=args.overlap,
                                      state_dtype=DTYPES[args.state_dtype],
                                      state_rounding=args.state_rounding, grad_dtype=DTYPES[args.grad_dtype])
    if args.optimizer not in BASELINES:
        if args.overlap:
            opt.attach(model)
        train_model = model
        mem = opt.memory_bytes()
        no_sync = opt.no_sync
    elif args.optimizer == "fsdp2":
        if args.resume:
            raise SystemExit("--optimizer fsdp2 is a speed and memory baseline: it writes no checkpoints to resume")
        shard_fsdp2(model)
        train_model = model
        # fused: the fastest torch.optim AdamW, as a user would pick it (on CUDA and, since torch 2.4, on CPUs)
        opt = torch.optim.AdamW(param_groups(model, args.weight_decay), lr=args.lr, betas=(0.9, 0.95), fused=True)
        mem = {"params": 4 * n_params // world, "grads": 4 * n_params // world, "state": 8 * n_params // world}
        mem["total"] = sum(mem.values())
        no_sync = functools.partial(fsdp2_no_sync, model)
    else:
        train_model = nn.parallel.DistributedDataParallel(model) if world > 1 else model
        opt = torch.optim.AdamW(param_groups(model, args.weight_decay), lr=args.lr, betas=(0.9, 0.95),
                                fused=True if args.optimizer == "amp" else None)
        mem = {"params": 4 * n_params, "grads": 4 * n_params, "state": 8 * n_params}
        mem["total"] = sum(mem.values())
        no_sync = train_model.no_sync if world > 1 else contextlib.nullcontext
    # torch AMP: the forward under bf16 autocast (backward outside it, as torch's AMP recipe says)
    autocast = (functools.partial(torch.autocast, device.type, dtype=torch.bfloat16) if args.optimizer == "amp"
                else contextlib.nullcontext)

    start = 0
    if args.resume:
        start = load_checkpoint(args, opt, model, ckpt_dir)

    stop = {"requested": False}

    def request_stop(signum, frame):
        stop["requested"] = True

    signal.signal(signal.SIGINT, request_stop)
    signal.signal(signal.SIGTERM, request_stop)

    if rank == 0:
        os.makedirs(out_dir, exist_ok=True)
        plain = 16 * n_params
        print(f"{args.optimizer}: {n_params / 1e6:.2f}M parameters, world size {world}, device {device}")
        print(f"optimizer memory per rank: {fmt_bytes(mem['total'])} "
              f"({mem['total'] / n_params:.1f} B/param; plain fp32 AdamW: {fmt_bytes(plain)}, 16.0 B/param)  "
              + " ".join(f"{k}={fmt_bytes(v)}" for k, v in mem.items() if k != "total"))
        if start:
            print(f"resumed from step {start}")
    metrics_path = os.path.join(out_dir, "metrics.jsonl")
    metrics = open(metrics_path, "a" if args.resume else "w") if rank == 0 else None
    bar = make_progress(args, start) if rank == 0 else None
    tokens_per_step = args.batch_size * args.block_size * args.grad_accum * world

    step = start
    while step < args.steps:
        profiler = start_profile(device, args.profile_with_stack) if step + 1 == args.profile_step else None
        t0 = time.perf_counter()
        lr = lr_at(step, args)
        for g in opt.param_groups:  # every group follows the schedule relative to its own peak
            g["lr"] = lr * g.get("base_lr", args.lr) / args.lr
        loss_sum = torch.zeros((), device=device)
        for micro in range(args.grad_accum):
            x, y = get_batch(corpus, args.seed, step, rank, micro, args.batch_size, args.block_size)
            ctx = no_sync() if micro < args.grad_accum - 1 else contextlib.nullcontext()
            with ctx:
                with autocast():
                    loss = train_model(x.to(device), y.to(device)) / args.grad_accum
                loss.backward()
            loss_sum += loss.detach()
        if args.optimizer not in BASELINES:
            gnorm = opt.clip_grad_norm_(args.clip) if args.clip > 0 else opt.grad_norm()
        else:
            gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip if args.clip > 0 else math.inf)
            gnorm = gnorm.full_tensor() if hasattr(gnorm, "full_tensor") else gnorm  # FSDP2: a DTensor
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        if profiler is not None:
            end_profile(profiler, device, out_dir if rank == 0 else None, step)

        if world > 1:  # the mean loss over ranks, and whether any rank was asked to stop
            flag = torch.tensor([loss_sum.item(), float(stop["requested"])], device=device)
            dist.all_reduce(flag)
            loss_value, stop_now = flag[0].item() / world, flag[1].item() > 0
        else:
            loss_value, stop_now = loss_sum.item(), stop["requested"]
        skipped = int(opt.skipped_steps) if args.optimizer not in BASELINES else 0
        dt = time.perf_counter() - t0
        if rank == 0:
            row = {"step": step, "loss": loss_value, "grad_norm": float(gnorm), "lr": lr,
                   "tokens_per_s": tokens_per_step / dt, "skipped": skipped}
            metrics.write(json.dumps(row) + "\n")
            metrics.flush()
            bar.update(row)
        last = step == args.steps
        stop_now = stop_now or step == args.stop_after
        if not args.no_save and (stop_now or last or (args.ckpt_interval and step % args.ckpt_interval == 0)):
            save(args, opt, model, ckpt_dir, step, world)
        if stop_now and not last:  # (with --no-save too: Ctrl-C stops a benchmark run)
            if rank == 0:
                bar.close()
                saved = ("no checkpoint (--no-save)" if args.no_save
                         else "no checkpoint (fsdp2 writes none)" if args.optimizer == "fsdp2"
                         else "checkpoint saved, continue with --resume")
                print(f"stopped at step {step}; {saved}")
            break
    peak = torch.tensor([float(peak_memory_bytes(device))], device=device)
    if world > 1:
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    if rank == 0:
        bar.close()
        metrics.close()
        summary = {"optimizer": args.optimizer, "overlap": args.overlap, "world_size": world, "device": str(device),
                   "params": n_params, "steps": step, "peak_memory_bytes_per_rank": int(peak.item()),
                   "peak_memory_kind": "cuda max_memory_allocated" if device.type == "cuda" else "cpu peak RSS",
                   "optimizer_memory_bytes_per_rank": int(mem["total"])}
        with open(os.path.join(out_dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=1)
        print(f"peak memory per rank: {fmt_bytes(summary['peak_memory_bytes_per_rank'])} "
              f"({summary['peak_memory_kind']})")
        if args.no_plot:
            print(f"metrics: {metrics_path}")
        else:
            plot_losses({args.optimizer: metrics_path}, os.path.join(out_dir, "loss.png"))
            print(f"metrics: {metrics_path}; loss curve: {os.path.join(out_dir, 'loss.png')}")
    if dist.is_initialized():
        # Teardown: while rank 0 saves and plots, the others must not destroy the group under it, and nothing that
        # holds the group (DDP's reducer, the optimizer) may outlive it into interpreter shutdown: 2 of 6 runs of
        # the HF example's DDP baseline hung there (2026-11-30) before this barrier and del. ``no_sync`` too: as
        # DDP's bound method it kept DDP, so its reducer, alive past destroy_process_group(); the reducer was then
        # the group's last owner, and freeing it at exit joined gloo's worker thread while holding the GIL that
        # thread waited for (a py-spy stack of a DDP baseline hung at exit, 2026-12-01)
        dist.barrier()
        del train_model, opt, no_sync
        destroy_process_group()  # (tritonshard's: cycles holding the group are collected first, not at shutdown)


# ----------------------------------------------------------------------------- checkpoints
def save(args, opt, model, ckpt_dir, step, world):
    if args.optimizer == "fsdp2":
        return  # a speed and memory baseline (see --optimizer): nothing to resume from
    if args.optimizer not in BASELINES:
        save_checkpoint(opt, ckpt_dir, step, extra={"step": step})
    else:  # the baseline: replicated state, rank 0 writes one file
        if dist.get_rank() == 0 if dist.is_initialized() else True:
            os.makedirs(ckpt_dir, exist_ok=True)
            tritonshard.checkpoint.atomic_save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step},
                                               os.path.join(ckpt_dir, "torch.pt"))
        if world > 1:
            dist.barrier()


def load_checkpoint(args, opt, model, ckpt_dir) -> int:
    if args.optimizer not in BASELINES:
        path = latest_checkpoint(ckpt_dir)
        if path is None:
            raise SystemExit(f"--resume: no checkpoint in {ckpt_dir}")
        return int(load_sharded(opt, path)["step"])
    path = os.path.join(ckpt_dir, "torch.pt")
    if not os.path.isfile(path):
        raise SystemExit(f"--resume: no checkpoint in {ckpt_dir}")
    state = tritonshard.checkpoint.load_file(path)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
    return int(state["step"])


# ----------------------------------------------------------------------------- reporting
def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}"
        n /= 1024


class make_progress:
    """tqdm when available (a live bar), plain lines otherwise or with --no-progress."""

    def __init__(self, args, start):
        self.bar = None
        if not args.no_progress:
            try:
                from tqdm import tqdm
                self.bar = tqdm(total=args.steps, initial=start, desc="train", unit="step", dynamic_ncols=True)
            except ImportError:
                pass
        self.every = max(1, args.steps // 20)

    def update(self, row):
        text = (f"loss {row['loss']:.4f} | {row['tokens_per_s']:,.0f} tok/s | gnorm {row['grad_norm']:.3f} | "
                f"skipped {row['skipped']}")
        if self.bar is not None:
            self.bar.set_postfix_str(text, refresh=False)
            self.bar.update(1)
        elif row["step"] % self.every == 0:
            print(f"step {row['step']:5d} | {text} | lr {row['lr']:.2e}", flush=True)

    def close(self):
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def plot_losses(runs: dict[str, str], png: str) -> None:
    """Loss vs step for each metrics.jsonl in ``runs`` (label -> path), into ``png``. Needs matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no loss curve (pip install matplotlib)")
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    for label, path in runs.items():
        rows = [json.loads(line) for line in open(path)]
        ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], label=label)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right", fontsize="small")
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
