"""Gradient norms read after this step's gradients were clipped or multiplied, as torch.optim's loop reads them.

With torch.optim, ``param.grad`` is the gradient as the loop left it: after ``clip_grad_norm_`` the clipped one,
after ``GradScaler.unscale_`` the unscaled one. A norm read then (a per-parameter log line, torch's
``get_total_norm``, a second clip) is of those gradients. tritonshard folds every such multiply into the update
instead of applying it, so each read must apply them itself. Until session 26 three did not (silently):

* after ``opt.clip_grad_norm_``, ``p.grad.norm()``, torch's total norm and ``opt.grad_norm()`` were the unclipped
  gradients' norms, and a second clip (torch's ``clip_grad_norm_`` after ours, or ours twice) computed its
  coefficient from those: torch's second clip multiplied the update by ~max_norm / norm once more (a step 40x too
  small here);
* after ``GradScaler.unscale_`` or ``p.grad.mul_(c)``, ``opt.grad_norm()`` left the multiplier out (256x the true
  norm after an unscale_ by 2**8);
* after ``opt.clip_grad_norm_`` and ``clip_grad_value_``, the norms left out the clip coefficient.

The reference is torch.optim.SGD on fp32 master weights whose gradients are our bf16 gradients as fp32 (one
rank: the same bits), with torch's own clip, clamp and multiply on them; SGD's update is proportional to the
gradient, so a coefficient missed or applied twice moves it by that factor. Two ranks: a norm read on rank 0 only
after every rank clipped with torch's ``clip_grad_norm_`` reads what that clip computed (no collective of its own),
which until session 26 was a CollectiveMismatchError."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.distributed import run_on_ranks
from tests.helpers import assert_bitwise_equal, assert_close_rel
from tests.optim.training import LR, MAX_NORM, batch, loss_fn, make_model, param_groups
from tritonshard import ShardedAdamW, ShardedSGD

SCALE = 2.0 ** 8  # GradScaler's: a power of two scales and unscales every bf16 gradient exactly
BOUND = 2e-3      # clip_grad_value_'s, after the clip: below the largest clipped gradient values, so it clamps
#: norms: ours from fp64 sums of the same gradient values, torch's from fp32 ones (a few fp32 ulps apart)
NORM_REL = 1e-5
#: the update of the fp32 masters (lr * coefficient * gradient, ~5e-4): read as a difference of masters ~0.5,
#: whose fp32 ulp is 6e-8, i.e. ~1e-4 of the update; a coefficient missed or applied twice is 40x off
UPDATE_REL = 1e-3
#: clip_grad_value_ clamps our bf16 gradients to the bound divided by the clip coefficient rounded once to bf16
#: (README): within 2^-8 relative of torch's fp32 clamp, and so the norms and updates after it
CLAMP_REL = 2.0 ** -7

CASES = ["opt.clip_grad_norm_", "opt.clip_grad_norm_ twice", "opt.clip_grad_norm_, then torch's",
         "GradScaler.unscale_", "GradScaler.unscale_, then opt.clip_grad_norm_", "p.grad.mul_(0.5)",
         "opt.clip_grad_norm_, then clip_grad_value_"]


def _masters(opt) -> torch.Tensor:
    return torch.cat([s["master"].reshape(-1) for _, s in sorted(opt.state_dict()["state"].items())])


def _norms(params) -> list:
    return [p.grad.norm() for p in params if p.grad is not None]


@pytest.mark.parametrize("case", CASES)
def test_norms_read_after_a_clip_or_unscale_are_the_norms_torch_optim_reads(case):
    model = make_model(0)
    opt = ShardedSGD(param_groups(model), lr=LR)
    ours = [p for g in opt.param_groups for p in g["params"]]
    # the reference: fp32 masters (the model's initial weights, as ours), stepped by torch.optim.SGD with our
    # gradients as fp32; a bf16 copy of the model computes them (the same bits as our backward's)
    fp32 = make_model(0)
    bf16 = copy.deepcopy(fp32).to(torch.bfloat16)
    groups = param_groups(fp32)
    ref = torch.optim.SGD(groups, lr=LR)
    masters = [p for g in groups for p in g["params"]]
    loss_fn(bf16, batch(0, 0, 0)).backward()
    name_of, copies = {id(p): n for n, p in fp32.named_parameters()}, dict(bf16.named_parameters())
    for m in masters:
        q = copies[name_of[id(m)]]
        m.grad = None if q.grad is None else q.grad.float()
    before = _masters(opt)

    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE) if "GradScaler" in case else None
    loss = loss_fn(model, batch(0, 0, 0))
    (scaler.scale(loss) if scaler else loss).backward()
    returned, expected = [], []
    if "GradScaler" in case:
        scaler.unscale_(opt)  # (the reference's gradients are unscaled already)
    if "opt.clip_grad_norm_" in case:
        returned.append(opt.clip_grad_norm_(MAX_NORM))
        expected.append(torch.nn.utils.clip_grad_norm_(masters, MAX_NORM))
        assert float(expected[-1]) > MAX_NORM, "the test must clip"
    if case == "opt.clip_grad_norm_ twice":
        returned.append(opt.clip_grad_norm_(MAX_NORM))
        expected.append(torch.nn.utils.clip_grad_norm_(masters, MAX_NORM))
    if case == "opt.clip_grad_norm_, then torch's":
        returned.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM))
        expected.append(torch.nn.utils.clip_grad_norm_(masters, MAX_NORM))
    if case == "p.grad.mul_(0.5)":
        for params in (model.parameters(), masters):
            for p in params:
                if p.grad is not None:
                    p.grad.mul_(0.5)
    clamped = case.endswith("clip_grad_value_")
    if clamped:
        torch.nn.utils.clip_grad_value_(model.parameters(), BOUND)
        torch.nn.utils.clip_grad_value_(masters, BOUND)
    rel = CLAMP_REL if clamped else NORM_REL

    for got, want in zip(returned, expected):  # (a second clip returns the norm of the gradients the first clipped)
        assert_close_rel(got, want, NORM_REL, what=f"{case}: the clip's returned norm")
    assert_close_rel(torch.stack(_norms(ours)), torch.stack(_norms(masters)), rel, what=f"{case}: p.grad.norm()")
    total = torch.nn.utils.get_total_norm([m.grad for m in masters if m.grad is not None])
    assert_close_rel(opt.grad_norm(), total, rel, what=f"{case}: opt.grad_norm()")
    assert_close_rel(torch.nn.utils.get_total_norm([p.grad for p in ours if p.grad is not None]), total, rel,
                     what=f"{case}: torch's get_total_norm over param.grad")

    scaler.step(opt) if scaler else opt.step()
    ref.step()
    want = torch.cat([m.detach().reshape(-1) for m in masters]) - before
    assert float(want.abs().max()) > 0, "the step must move the masters"
    assert_close_rel(_masters(opt) - before, want, CLAMP_REL if clamped else UPDATE_REL,
                     what=f"{case}: the step's update of the masters")


def _logged_on_rank_0(rank, world_size):
    """Every rank clips with torch's clip_grad_norm_ (per-parameter norms: a collective), then rank 0 alone logs
    each parameter's gradient norm, or both ranks do: the same weights, the same logged norms."""
    runs, logged = [], []
    for who in ((0,), (0, 1)):
        model = make_model(0)
        opt = ShardedAdamW(param_groups(model), lr=LR)
        opt.attach(model)
        norms = []
        for step in range(2):
            loss_fn(model, batch(rank, step, 0)).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
            if rank in who:
                norms.append(torch.stack(_norms(model.parameters())))
                norms.append(opt.grad_norm().reshape(1))
            opt.step()
            opt.zero_grad()
        runs.append(torch.cat([p.detach().float().reshape(-1) for p in model.parameters()]))
        logged.append(torch.cat(norms) if norms else None)
    assert_bitwise_equal(runs[0], runs[1], "weights with the norms logged on rank 0 only vs on every rank")
    if rank == 0:
        assert_bitwise_equal(logged[0], logged[1], "the norms rank 0 logged")


def test_norms_logged_on_one_rank_after_torch_clip_on_every_rank_need_no_collective():
    run_on_ranks(_logged_on_rank_0, 2)


def _torch_clip_run(rank, world_size, read_again: bool):
    """One step of ShardedSGD over training.py's model (a bucket per parameter), torch's clip over param.grad (HF
    Trainer's, accelerate's): per-parameter norms (a log line's ``torch._foreach_norm``), the clip's total norm,
    the weights after the step. ``read_again``: a clip_grad_value_ by a bound no gradient reaches comes first,
    which changes no value but marks the shards changed since the reduction, so the per-parameter norms are read
    from the gradients again instead of the reduction's partials."""
    torch.manual_seed(0)
    model = make_model()
    opt = ShardedSGD(param_groups(model), lr=LR, bucket_cap_mb=1e-9)
    loss_fn(model, batch(rank, 0, 0)).backward()
    if read_again:
        torch.nn.utils.clip_grad_value_(model.parameters(), 1e30)
    params = [p for p in model.parameters() if p.grad is not None]
    norms = torch.stack(torch._foreach_norm([p.grad for p in params]))
    total = torch.nn.utils.clip_grad_norm_(params, MAX_NORM)
    pieces = opt._partials_of_pieces and not opt._clamped  # (the path the norms took)
    opt.step()
    return norms, total, torch.cat([p.detach().float().reshape(-1) for p in model.parameters()]), pieces


def _one_read_against_two(rank, world_size):
    norms, total, weights, pieces = _torch_clip_run(rank, world_size, read_again=False)
    norms2, total2, weights2, pieces2 = _torch_clip_run(rank, world_size, read_again=True)
    assert pieces and not pieces2, "the two runs must take the two paths"
    where = f"rank {rank} of {world_size}"
    assert_bitwise_equal(norms, norms2, f"per-parameter norms from the reduction's partials, {where}")
    assert_bitwise_equal(total, total2, f"torch's clip norm, {where}")
    assert_bitwise_equal(weights, weights2, f"weights after the clipped step, {where}")


@pytest.mark.parametrize("world_size", [1, 2])
def test_torchs_per_parameter_norms_from_the_reductions_partials_are_those_of_a_second_read(world_size):
    """Session 38: the step's norm pass cuts its blocks at the pieces of the shards (each parameter's part), so
    torch's per-parameter norms over param.grad (HF Trainer's clip) add up the reduction's partials instead of
    reading every gradient again (one read of the gradients per step instead of two: ~0.6 ms per step at 1B on an
    H200, by bandwidth). The reduction's partials are of the gradient times 1/d, a power of two here, so each
    norm has the bits of the second read's (times 1/d after the square root), and so do the clip and the step."""
    run_on_ranks(_one_read_against_two, world_size)


def _per_parameter_norms_on_every_rank(rank, world_size):
    torch.manual_seed(0)
    model = make_model()
    ref = copy.deepcopy(model).to(torch.bfloat16)
    opt = ShardedSGD(param_groups(model), lr=LR, bucket_cap_mb=1e-9)
    pieces = sum(1 for b in opt.buckets for piece in b.param_buffer.shard_pieces() if piece.numel)
    for m in (model, ref):
        loss_fn(m, batch(rank, 0, 0)).backward()
    params = [p for p in model.parameters() if p.grad is not None]
    norms = torch.stack(torch._foreach_norm([p.grad for p in params])).float()
    every = [torch.empty_like(norms) for _ in range(world_size)]
    torch.distributed.all_gather(every, norms)
    for r, theirs in enumerate(every):
        assert_bitwise_equal(theirs, norms, f"per-parameter norms of rank {r} against rank {rank} of {world_size} "
                                            f"(this rank holds {pieces} pieces)")
    want = []  # DDP's: the average of every rank's bf16 gradient, here in fp32
    for p, q in zip(model.parameters(), ref.parameters()):
        g = q.grad.float() if q.grad is not None else torch.zeros(q.shape)
        torch.distributed.all_reduce(g)
        if p.grad is not None:
            want.append((g / world_size).norm())
    # (ours: the reduce-scatter's bf16 sums, one rounding of ~2^-9 relative per element; 1/d off is 4x)
    assert_close_rel(norms, torch.stack(want), 1e-2, what=f"per-parameter norms, rank {rank} of {world_size}")
    counts = [torch.zeros((), dtype=torch.int64) for _ in range(world_size)]
    torch.distributed.all_gather(counts, torch.tensor(pieces))
    if world_size == 4:
        assert min(int(c) for c in counts) == 0, f"the case needs a rank without pieces: {counts}"


@pytest.mark.parametrize("world_size", [3, 4])
def test_per_parameter_norms_agree_on_every_rank_also_one_holding_no_piece(world_size):
    """torch's per-parameter norms are sums over the ranks' pieces, added up by an all-reduce, then scaled once:
    every rank must put its sums in the same units. The day session 38 made them come from the step's norm pass
    (the gradient times 1/d) where a rank's pieces were there, a rank holding no piece at all (4 ranks over this
    small model: rank 3's shards are all padding) kept the old units and multiplied by 1/d after: its norms, and so
    its clip coefficient, were 1/4 of the other ranks' (found by a probe before it landed). 3 ranks: 1/3 is no
    power of two, the pieces are read again."""
    run_on_ranks(_per_parameter_norms_on_every_rank, world_size)
