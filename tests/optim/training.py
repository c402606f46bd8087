"""A tiny model, its data, our training loop and a single-process reference of it, shared by the optimizer tests.

The reference simulates d data-parallel ranks in one process with plain torch: a bf16 copy of the model per
rank (identical weights), gradients accumulated by autograd in bf16 over the micro-batches, summed over ranks in
bf16 in rank order (what reduce-scatter(SUM) computes) and multiplied by 1/d in fp32 (the optimizer applies the
average inside the update, with no further bf16 rounding), then
torch.nn.utils.clip_grad_norm_ and torch.optim.AdamW(foreach=False) on an fp32 master copy, and the bf16 weights
re-derived from the master. A parameter whose grad is None on every rank and micro-batch keeps None, and
torch.optim skips it, as step() does (one with a gradient on some ranks only gets zeros on the others: DDP's sum).
"""

from __future__ import annotations

import contextlib
import copy

import torch
from torch import nn

import tritonshard

MICRO_BATCHES = 3
MAX_NORM = 0.5
LR = 2e-2


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(13, 11)      # 143 + 11: odd sizes, so shards split parameters
        self.norm = nn.LayerNorm(11)
        self.fc2 = nn.Linear(11, 5)       # 55 + 5
        self.unused = nn.Parameter(torch.randn(3))                       # its grad stays None
        self.frozen = nn.Parameter(torch.randn(5), requires_grad=False)  # left out of the optimizer's buffers

    def forward(self, x):
        h = torch.relu(self.norm(self.fc1(x)))
        return self.fc2(h) + self.frozen.to(h.dtype)


def make_model(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net()


def param_groups(model: Net):
    decay = [model.fc1.weight, model.fc2.weight, model.unused]
    no_decay = [model.fc1.bias, model.fc2.bias, model.norm.weight, model.norm.bias]
    return [dict(params=decay, weight_decay=0.1), dict(params=no_decay, weight_decay=0.0, lr=LR / 2)]


def batch(rank: int, step: int, micro: int, poison: bool = False) -> torch.Tensor:
    g = torch.Generator().manual_seed(10_000 * step + 100 * micro + rank)
    x = torch.randn(6, 13, generator=g)
    if poison:
        x[0, 0] = float("nan")
    return x.to(torch.bfloat16)


def loss_fn(model, x):
    return model(x.to(model.fc1.weight.dtype)).float().square().mean()


def schedule(step: int) -> float:
    return 1.0 / (1.0 + 0.5 * step)


def train_step(model, opt, sched, rank: int, step: int, poison: bool = False) -> torch.Tensor:
    """One step of our loop: accumulation over MICRO_BATCHES with no_sync, clipping, an LR scheduler."""
    for micro in range(MICRO_BATCHES):
        ctx = opt.no_sync() if micro < MICRO_BATCHES - 1 else contextlib.nullcontext()
        with ctx:
            loss = loss_fn(model, batch(rank, step, micro, poison and micro == 1))
            (loss * opt.loss_scale if getattr(opt, "loss_scale", None) is not None else loss).backward()
    norm = opt.clip_grad_norm_(MAX_NORM)
    opt.step()
    sched.step()
    opt.zero_grad()
    return norm


class PaperLion(torch.optim.Optimizer):
    """Lion as the paper's Algorithm 2 (decoupled weight decay), in plain torch, for the references."""

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0):
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self):
        for g in self.param_groups:
            beta1, beta2 = g["betas"]
            for p in g["params"]:
                if p.grad is None:
                    continue
                m = self.state[p].setdefault("exp_avg", torch.zeros_like(p))
                p.mul_(1 - g["lr"] * g["weight_decay"])
                p.add_((m * beta1 + (1 - beta1) * p.grad).sign(), alpha=-g["lr"])
                m.mul_(beta2).add_(p.grad, alpha=1 - beta2)


def muon_groups(model: Net):
    """ShardedMuon's groups for Net: the two weight matrices in Muon, the rest in AdamW (with its own lr)."""
    return [dict(params=[model.fc1.weight, model.fc2.weight]),
            dict(params=[model.fc1.bias, model.fc2.bias, model.norm.weight, model.norm.bias, model.unused],
                 use_muon=False, lr=LR / 2, weight_decay=0.0)]


class TorchMuonAdamW(torch.optim.Optimizer):
    """torch.optim.Muon for the groups with use_muon (default True) and torch.optim.AdamW(foreach=False) for the
    others, stepped as one optimizer (so one LR scheduler drives both): the reference for ShardedMuon."""

    def __init__(self, groups, **muon_kw):
        groups = [dict(g) for g in groups]
        muon = [{k: v for k, v in g.items() if k != "use_muon"} for g in groups if g.get("use_muon", True)]
        adamw = [{k: v for k, v in g.items() if k != "use_muon"} for g in groups if not g.get("use_muon", True)]
        self.muon = torch.optim.Muon(muon, **muon_kw)
        self.adamw = torch.optim.AdamW(adamw, foreach=False)
        super().__init__([p for g in groups for p in g["params"]], {})
        self.param_groups = self.muon.param_groups + self.adamw.param_groups  # the same dicts: lr changes reach them

    @torch.no_grad()
    def step(self, closure=None):
        self.muon.step()
        self.adamw.step()

    def zero_grad(self, set_to_none: bool = True):
        self.muon.zero_grad(set_to_none)
        self.adamw.zero_grad(set_to_none)


class Reference:
    """Single-process simulation of `world_size` ranks training with fp32 master weights and torch AdamW."""

    def __init__(self, world_size: int, seed: int = 0, grad_dtype: torch.dtype = torch.bfloat16, make_opt=None,
                 model_dtype: torch.dtype = torch.bfloat16, loss_scale: float = 1.0, groups_fn=None):
        self.world_size = world_size
        self.grad_dtype = grad_dtype
        self.loss_scale = loss_scale  # constant: the tests that use it choose one that never overflows
        self.fp32 = make_model(seed)
        self.groups = (groups_fn or param_groups)(self.fp32)
        self.master = [p for g in self.groups for p in g["params"]]
        self.opt = (make_opt or (lambda groups: torch.optim.AdamW(groups, lr=LR, foreach=False)))(self.groups)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, schedule)
        self.bf16 = copy.deepcopy(self.fp32).to(model_dtype)
        self.bf16.frozen.data = self.fp32.frozen.data  # the frozen parameter keeps its storage and dtype
        self._sync_weights()

    def _bf16_params(self):
        name_of = {id(p): n for n, p in self.fp32.named_parameters()}
        own = dict(self.bf16.named_parameters())
        return [own[name_of[id(p)]] for p in self.master]

    def _sync_weights(self):
        for p, q in zip(self.master, self._bf16_params()):
            q.data.copy_(p.detach())  # round to nearest even

    def step(self, step: int):
        bf16_params = self._bf16_params()
        total = None
        dt = self.grad_dtype
        got = [False] * len(bf16_params)  # a gradient on some rank
        for rank in range(self.world_size):
            acc = [torch.zeros_like(q, dtype=dt) for q in bf16_params]
            for micro in range(MICRO_BATCHES):
                (loss_fn(self.bf16, batch(rank, step, micro)) * self.loss_scale).backward()
                for i, q in enumerate(bf16_params):  # each backward's grad added into the accumulator, rounded
                    if q.grad is not None:
                        acc[i] = (acc[i].float() + q.grad.float()).to(dt)
                        q.grad, got[i] = None, True
            total = acc if total is None else [(a.float() + b.float()).to(dt) for a, b in zip(total, acc)]
        avg = [g.float() * (1.0 / self.world_size) for g in total]
        for p, g, has in zip(self.master, avg, got):
            p.grad = g / self.loss_scale if has else None
        norm = torch.nn.utils.clip_grad_norm_(self.master, MAX_NORM)
        self.opt.step()
        self.sched.step()
        self.opt.zero_grad()
        self._sync_weights()
        return norm

    def bf16_weights(self):
        return [q.detach() for q in self._bf16_params()]


#: the four optimizers over a small bf16 model, for tests of what any of them must do (loads of damaged state
#: dicts, tests/optim/test_state_dict_fuzz.py; an lr below fp32's range, tests/optim/test_schedulers.py)
SMALL_KINDS = {
    "adamw": lambda params: tritonshard.ShardedAdamW(params, lr=0.1),
    "sgd": lambda params: tritonshard.ShardedSGD(params, lr=0.1, momentum=0.9, dampening=0.1),
    "lion": lambda params: tritonshard.ShardedLion(params, lr=0.1),
    # (the matrices in Muon groups, the biases in AdamW groups: both kinds of group in one dict)
    "muon": lambda params: tritonshard.ShardedMuon([{"params": [p for p in params if p.ndim == 2]},
                                                    {"params": [p for p in params if p.ndim < 2], "use_muon": False}],
                                                   lr=0.1),
}


def small_trained(kind: str):
    """(model, optimizer of ``SMALL_KINDS[kind]``, its state dict) after two steps from seed 0."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 4), nn.Linear(4, 3)).to(torch.bfloat16)
    opt = SMALL_KINDS[kind](list(model.parameters()))
    small_step(model, opt)
    small_step(model, opt)
    return model, opt, opt.state_dict()


def small_step(model, opt) -> None:
    """A backward of a fresh random batch and a step of ``opt``."""
    model(torch.randn(2, 5, dtype=torch.bfloat16)).float().square().sum().backward()
    opt.step()
    opt.zero_grad()
