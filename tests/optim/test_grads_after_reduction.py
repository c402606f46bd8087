"""``param.grad`` changed between a reduction made before ``step()`` (a clip, ``GradScaler.unscale_``) and the step.

torch.optim steps with whatever ``param.grad`` holds at its step. tritonshard's reduction (reduce-scatter, the
global norm) cannot take a gradient back, so (README, "gradients changed after a clip"):

* the loop cleared every gradient the reduction took (``model.zero_grad()``, ``p.grad = None`` for each), or
  replaced each by hand: the reduction is forgotten, and the step takes what ``param.grad`` holds then (nothing,
  a new backward's gradients, the ones set by hand), as torch.optim would;
* it replaced, cleared or set some while others are kept: ``step()`` raises, naming one, before anything changes
  (and on two ranks the other rank raises PeerFailedError instead of waiting).

Until session 22 all of these stepped silently with the reduced gradients (found by tests/optim/test_loop_fuzz.py's
GradScaler machine): a gradient replaced after the clip was not used, a cleared one was stepped, one set by hand
on a parameter without a gradient was skipped, and ``model.zero_grad()`` between the clip and ``step()`` stepped
every parameter where torch.optim steps none.

References are our own optimizer in the loop torch.optim would make of it (no clip, the gradients set directly),
bit for bit; that loop is checked against torch.optim elsewhere (tests/optim/test_loop_fuzz.py)."""

from __future__ import annotations

import time

import pytest
import torch

from tests.distributed import run_on_ranks
from tests.helpers import assert_bitwise_equal
from tests.optim.training import LR, MAX_NORM, batch, loss_fn, make_model, param_groups
from tritonshard import ShardedAdamW


def _weights(model) -> torch.Tensor:
    return torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])


def _setup():
    model = make_model(0)
    return model, ShardedAdamW(param_groups(model), lr=LR)


def _reduce(how: str, opt, model, scaler) -> None:
    if how == "opt.clip_grad_norm_":
        opt.clip_grad_norm_(MAX_NORM)
    elif how == "torch's clip_grad_norm_":
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    else:
        scaler.unscale_(opt)


REDUCTIONS = ["opt.clip_grad_norm_", "torch's clip_grad_norm_", "GradScaler.unscale_"]


def _hand_grad(p, seed: int) -> torch.Tensor:
    return torch.randn(p.shape, generator=torch.Generator().manual_seed(seed)).to(p.dtype)


@pytest.mark.parametrize("how", REDUCTIONS)
@pytest.mark.parametrize("change", ["one replaced", "one cleared", "one set where there was none"])
def test_a_gradient_changed_after_the_reduction_while_others_are_kept_is_an_error(how, change):
    model, opt = _setup()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    scaler.scale(loss_fn(model, batch(0, 0, 0))).backward()  # (model.unused gets no gradient)
    _reduce(how, opt, model, scaler)
    if change == "one replaced":
        model.fc1.weight.grad = _hand_grad(model.fc1.weight, 1)
        expected = r"param_groups\[0\]\['params'\]\[0\] \(shape \(11, 13\)\) was replaced"  # (fc1.weight)
    elif change == "one cleared":
        model.fc1.weight.grad = None
        expected = r"param_groups\[0\]\['params'\]\[0\] \(shape \(11, 13\)\) was cleared"
    else:
        model.unused.grad = _hand_grad(model.unused, 2)
        expected = r"param_groups\[0\]\['params'\]\[2\] \(shape \(3,\)\) was set"  # (model.unused)
    before = _weights(model)
    with pytest.raises(RuntimeError, match=expected + r".*after the gradients were reduced"):
        scaler.step(opt) if how == "GradScaler.unscale_" else opt.step()
    assert_bitwise_equal(_weights(model), before, "weights after the refused step")
    assert all(float(opt.state[p].get("step", 0)) == 0 for p in model.parameters() if p.requires_grad)
    # the loop goes on after clearing them, as after any error before the update
    opt.zero_grad()
    loss_fn(model, batch(0, 1, 0)).backward()
    opt.step()
    assert not torch.equal(_weights(model), before)


@pytest.mark.parametrize("how", REDUCTIONS)
def test_a_backward_onto_the_reduced_gradients_is_an_error(how):
    """torch.optim would step with the sum of the reduced (clipped) gradients and the new ones, which a reduction
    cannot give. (The backward takes the placeholders out of param.grad before it accumulates: not a clear.)"""
    model, opt = _setup()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    scaler.scale(loss_fn(model, batch(0, 0, 0))).backward()
    _reduce(how, opt, model, scaler)
    with pytest.raises(RuntimeError, match=r"gradients arrived after clip_grad_norm_\(\) reduced them"):
        loss_fn(model, batch(0, 1, 0)).backward()


@pytest.mark.parametrize("how", REDUCTIONS)
@pytest.mark.parametrize("clear", ["model.zero_grad()", "p.grad = None for each"])
def test_clearing_every_gradient_after_the_reduction_forgets_it(how, clear):
    """torch.optim: no gradient is left, so a clip finds a norm of 0 and the step changes nothing; a backward after
    it gives the step its own, unclipped gradients."""
    model, opt = _setup()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    scaler.scale(loss_fn(model, batch(0, 0, 0))).backward()
    _reduce(how, opt, model, scaler)
    if clear == "model.zero_grad()":
        model.zero_grad()
    else:
        for p in model.parameters():
            p.grad = None
    before = _weights(model)
    if clear != "model.zero_grad()":  # (a clip reduces afresh, the step alone skips every parameter: both ways)
        assert float(opt.clip_grad_norm_(MAX_NORM)) == 0.0  # (torch's clip finds no gradient)
    scaler.step(opt) if how == "GradScaler.unscale_" else opt.step()
    assert_bitwise_equal(_weights(model), before, "a step with every gradient cleared")
    assert all(float(opt.state[p].get("step", 0)) == 0 for p in model.parameters() if p.requires_grad)
    if how == "GradScaler.unscale_":
        scaler.update()
    # cleared again, then a backward before the step: the step takes that backward's gradients only
    scaler.scale(loss_fn(model, batch(0, 1, 0))).backward()
    _reduce(how, opt, model, scaler)
    model.zero_grad()
    loss_fn(model, batch(0, 2, 0)).backward()  # (unscaled: with unscale_ done, GradScaler.step unscales no more)
    scaler.step(opt) if how == "GradScaler.unscale_" else opt.step()
    ref_model, ref = _setup()
    loss_fn(ref_model, batch(0, 2, 0)).backward()
    ref.step()
    assert_bitwise_equal(_weights(model), _weights(ref_model), "the backward after the cleared reduction")


@pytest.mark.parametrize("how", REDUCTIONS)
def test_a_layer_frozen_after_its_gradients_were_cleared_past_the_reduction_is_not_stepped(how):
    """torch.optim: a parameter whose grad is None is skipped, frozen or not. Every gradient cleared after the
    reduction, then a layer frozen (requires_grad_(False)) before step(): nothing changes. Until session 36 the
    frozen layer was stepped with the cleared gradient (its placeholder had been placed, which the frozen look
    took for a gradient held; found by tests.optim.loop_fuzz_long)."""
    model, opt = _setup()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    scaler.scale(loss_fn(model, batch(0, 0, 0))).backward()
    _reduce(how, opt, model, scaler)
    for p in model.parameters():
        p.grad = None
    model.fc1.requires_grad_(False)
    before = _weights(model)
    scaler.step(opt) if how == "GradScaler.unscale_" else opt.step()
    assert_bitwise_equal(_weights(model), before, "a step with every gradient cleared and a layer frozen")
    assert all(float(opt.state[p].get("step", 0)) == 0 for g in opt.param_groups for p in g["params"])


def test_a_new_optimizer_or_param_group_after_the_cleared_reduction():
    model, opt = _setup()
    loss_fn(model, batch(0, 0, 0)).backward()
    opt.clip_grad_norm_(MAX_NORM)
    model.zero_grad()
    opt.add_param_group({"params": [model.frozen.requires_grad_()]})  # (before: "between a backward and its step()")
    model.frozen.requires_grad_(False)
    loss_fn(model, batch(0, 1, 0)).backward()
    opt.clip_grad_norm_(MAX_NORM)
    model.zero_grad()
    ShardedAdamW(param_groups(model), lr=LR)  # (before: "still holds between a backward and its step()")


@pytest.mark.parametrize("how", ["opt.clip_grad_norm_", "torch's clip_grad_norm_"])
def test_replacing_every_gradient_after_the_reduction_steps_with_the_new_ones(how):
    """A gradient from torch.autograd.grad or a custom rule put in place of each one after a clip: torch.optim
    steps with the new ones, unclipped, and so does tritonshard (the reduction is taken again)."""
    model, opt = _setup()
    loss_fn(model, batch(0, 0, 0)).backward()
    _reduce(how, opt, model, None)
    trained = [p for p in model.parameters() if p.grad is not None]
    for i, p in enumerate(trained):
        p.grad = _hand_grad(p, 10 + i)
    opt.step()
    ref_model, ref = _setup()
    for i, p in enumerate(q for q in ref_model.parameters() if q.requires_grad and q is not ref_model.unused):
        p.grad = _hand_grad(p, 10 + i)
    ref.step()
    assert_bitwise_equal(_weights(model), _weights(ref_model), "gradients replaced after the clip")


def _changed_on_one_rank(rank, world_size):
    """Rank 1 replaces a gradient after the clip: it raises, rank 0 raises PeerFailedError naming it (instead of
    waiting in the step's collectives), at once; then both clear their gradients and train on together."""
    from tritonshard.comm import PeerFailedError
    model, opt = _setup()
    loss_fn(model, batch(rank, 0, 0)).backward()
    opt.clip_grad_norm_(MAX_NORM)
    if rank == 1:
        model.fc2.weight.grad = _hand_grad(model.fc2.weight, 3)
    start = time.monotonic()
    if rank == 1:
        with pytest.raises(RuntimeError, match="was replaced after the gradients were reduced"):
            opt.step()
    else:
        with pytest.raises(PeerFailedError, match=r"rank 1: RuntimeError: .*was replaced after the gradients"):
            opt.step()
    assert time.monotonic() - start < 20, "the ranks waited for each other"  # (gloo's timeout: 30 minutes)
    opt.zero_grad()
    for step in (1, 2):
        loss_fn(model, batch(rank, step, 0)).backward()
        opt.step()
        opt.zero_grad()


def test_a_gradient_changed_on_one_rank_only_is_an_error_on_both():
    run_on_ranks(_changed_on_one_rank, 2)


def _cleared_where_a_rank_had_none(rank, world_size, then):
    """Rank 0 has gradients, rank 1 none (its backward skipped); both clip, and rank 0 clears every gradient: no
    rank holds one, as under DDP (where a clear-all on every rank leaves nothing), so the step changes nothing on
    either. Rank 1 had nothing to clear and cannot tell: a clip after it would reduce afresh on rank 0 only, whose
    collectives rank 1 does not join: an error on both, not a hang."""
    from tritonshard.comm import CollectiveMismatchError, PeerFailedError
    model, opt = _setup()
    if rank == 0:
        loss_fn(model, batch(rank, 0, 0)).backward()
    opt.clip_grad_norm_(MAX_NORM)
    model.zero_grad()
    before = _weights(model)
    if then == "step":
        opt.step()
        assert_bitwise_equal(_weights(model), before, "a step after every gradient was cleared")
        assert all(float(opt.state[p].get("step", 0)) == 0 for p in model.parameters() if p.requires_grad)
        return
    start = time.monotonic()
    with pytest.raises((CollectiveMismatchError, PeerFailedError)):
        opt.clip_grad_norm_(MAX_NORM)
        opt.step()
    assert time.monotonic() - start < 20, "the ranks waited for each other"


@pytest.mark.parametrize("then", ["step", "clip, step"])
def test_a_clear_all_on_the_ranks_that_had_gradients(then):
    run_on_ranks(_cleared_where_a_rank_had_none, 2, then)


def _cleared_on_some_ranks(rank, world_size, how, clearing):
    """Every rank has gradients and reduces them (a clip, a norm, unscale_), then the ranks in ``clearing`` clear
    them all (a loop that skips this step on some ranks only). Under DDP those would skip the step and the others
    take it: the replicas drift apart, and the reduction, which holds every rank's gradients, cannot give the others
    a step without the cleared ones. Until session 25 every rank stepped with the whole reduction, silently (the
    clearing ranks' gradients in it); now step() raises on every rank, at once, before anything changes, and the
    loop goes on after a zero_grad(). Where every rank cleared them, nothing is stepped, as under DDP."""
    model, opt = _setup()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    scaler.scale(loss_fn(model, batch(rank, 0, 0))).backward()
    _reduce(how, opt, model, scaler)
    if rank in clearing:
        model.zero_grad()
    before = _weights(model)
    start = time.monotonic()
    step = (lambda: scaler.step(opt)) if how == "GradScaler.unscale_" else opt.step
    if len(clearing) == world_size:
        step()
        assert_bitwise_equal(_weights(model), before, "a step after every rank cleared its gradients")
    else:
        with pytest.raises(RuntimeError, match=r"all cleared \(param.grad = None\) on some ranks and kept on others"):
            step()
        assert time.monotonic() - start < 20, "the ranks waited for each other"
        assert_bitwise_equal(_weights(model), before, "a refused step")
    assert all(float(opt.state[p].get("step", 0)) == 0 for p in model.parameters() if p.requires_grad)
    opt.zero_grad()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)  # (a refused GradScaler.step leaves it mid-step)
    for i in (1, 2):  # the loop goes on as if the step had not been tried: the same weights on every rank
        loss_fn(model, batch(rank, i, 0)).backward()
        opt.step()
        opt.zero_grad()
    weights = _weights(model)
    gathered = [torch.empty_like(weights) for _ in range(world_size)]
    torch.distributed.all_gather(gathered, weights)
    for other in gathered:
        assert_bitwise_equal(other, weights, "the ranks' weights after the refused step")


@pytest.mark.parametrize("how", REDUCTIONS)
def test_a_clear_all_after_the_reduction_on_some_ranks_only_is_an_error_on_every_rank(how):
    run_on_ranks(_cleared_on_some_ranks, 2, how, (1,))


@pytest.mark.parametrize("clearing", [(0,), (0, 2, 3), (0, 1, 2, 3)], ids=["one of four", "three of four", "all"])
def test_a_clear_all_after_the_clip_on_four_ranks(clearing):
    run_on_ranks(_cleared_on_some_ranks, 4, "opt.clip_grad_norm_", clearing)


def test_torchs_clip_looks_at_the_gradients_once_per_step_not_once_per_parameter(monkeypatch):
    """The look at every param.grad runs in step() (and the loop's own clip, norm, unscale_ calls), not in each
    placeholder op: torch's clip_grad_norm_ multiplies every gradient, and a look per multiply cost the square of
    the number of parameters (300 parameters: torch's clip 8 -> 25 ms on the 2-core VM, until the review of
    session 22)."""
    from tritonshard.optim.base import ShardedOptimizer
    looks = []
    real = ShardedOptimizer._check_grads_since_reduction
    monkeypatch.setattr(ShardedOptimizer, "_check_grads_since_reduction",
                        lambda self, mode: looks.append(mode) or real(self, mode))
    model = torch.nn.Sequential(*[torch.nn.Linear(3, 3) for _ in range(20)])  # 40 parameters
    opt = ShardedAdamW(model.parameters(), lr=LR)
    model(torch.randn(2, 3, dtype=torch.bfloat16)).float().sum().backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    assert looks == []
    opt.step()
    assert looks == ["step"]
