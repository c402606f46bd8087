"""torch.amp.GradScaler's recipe on a sharded optimizer (issue 22.2): ``scaler.scale(loss).backward();
scaler.unscale_(opt); clip; scaler.step(opt); scaler.update()`` works as on torch's fused optimizers
(``_step_supports_amp_scaling``), or raises an error that names the fix.

The reference is the same loop without the scaler. The scale is a power of two and bf16 has fp32's exponent range,
so scaled gradients, the unscale and the clip coefficient are exact: the two runs must agree bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_on_ranks
from tests.helpers import assert_bitwise_equal
from tests.optim.training import MAX_NORM, batch, loss_fn, make_model
from tritonshard import ShardedAdamW


def _weights(model) -> torch.Tensor:
    return torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])


def _train(rank: int, scaler, unscale: bool, clip: bool, steps: int = 3, poison_step: int = -1, **opt_kwargs):
    model = make_model(0)
    opt = ShardedAdamW(model.parameters(), lr=1e-2, weight_decay=0.1, **opt_kwargs)
    norms = []
    for step in range(steps):
        loss = loss_fn(model, batch(rank, step, 0, poison=step == poison_step and rank == 0))
        (scaler.scale(loss) if scaler is not None else loss).backward()
        if scaler is not None and unscale:
            scaler.unscale_(opt)
        if clip:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM))
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        opt.zero_grad()
    return model, opt, norms


def _recipe(rank, world_size, unscale, clip):
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12)
    model, opt, norms = _train(rank, scaler, unscale, clip)
    ref_model, _, ref_norms = _train(rank, None, unscale, clip)
    assert_bitwise_equal(_weights(model), _weights(ref_model), "weights, GradScaler recipe vs no scaling")
    for n, r in zip(norms, ref_norms):  # torch's clip after unscale_ sees the unscaled global norm
        assert_bitwise_equal(n, r, "clip_grad_norm_ after scaler.unscale_")
    assert scaler.get_scale() == 2.0 ** 12 and int(opt.skipped_steps) == 0


@pytest.mark.parametrize("unscale, clip", [(True, True), (False, False)], ids=["unscale+clip", "step only"])
def test_the_grad_scaler_recipe_trains_as_without_scaling(unscale, clip):
    """Before: with bf16 weights, scaler.unscale_(opt) raised from clip_grad_norm_'s placeholder ("use
    opt.clip_grad_norm_"), and scaler.step(opt) without unscale_ ran torch's inf check on placeholders."""
    run_on_ranks(_recipe, 2, unscale, clip)


def _inf_on_one_rank(rank, world_size):
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12)
    model, opt, _ = _train(rank, scaler, True, True, steps=1, poison_step=0)
    fresh = make_model(0)
    ShardedAdamW(fresh.parameters(), lr=1e-2)  # the weights as construction leaves them
    assert_bitwise_equal(_weights(model), _weights(fresh), "weights after a skipped step")
    assert int(opt.skipped_steps) == 1  # on every rank, though only rank 0 saw the inf
    assert scaler.get_scale() == 2.0 ** 11  # the scaler backed off: it got the global flag


def test_an_inf_on_one_rank_skips_the_step_everywhere_and_the_scaler_backs_off():
    run_on_ranks(_inf_on_one_rank, 2)


def _no_placeholder_on_one_rank(rank, world_size, case, how):
    """Rank 0's gradients never reach tritonshard's buffers before the step (no backward: all None; or all set by
    hand: plain tensors), rank 1 has a backward's. Torch code that multiplies param.grad runs over each rank's own
    gradients, so it folds a coefficient into rank 1's update only; the update applies it to that rank's shard of
    the sum over both ranks, and rank 0 would update its shard without it (GradScaler: rank 0's shard stepped with
    the scaled gradients; torch's clip after unscale_: without the clip). Until session 25 nothing said so (with
    ShardedSGD, 64x the trunk's step where the scale was 2**8; rank 0 got torch's "No inf checks were recorded" at
    scaler.update(), after the step). The step's handshake compares the ranks' counts: SettingsMismatchError on
    both, naming the cause, before anything changes. (torch's clip there: rank 1's per-parameter norms meet rank
    0's step, a CollectiveMismatchError, as before.)"""
    from tritonshard import ShardedSGD
    from tritonshard.comm import CollectiveMismatchError, SettingsMismatchError
    model = make_model(0)
    opt = ShardedSGD(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    scaler.scale(torch.ones(()))  # (rank 0's scaler has a scale without a backward)
    if rank == 1:
        scaler.scale(loss_fn(model, batch(rank, 0, 0))).backward()
    elif case == "set by hand":
        for i, p in enumerate(p for p in model.parameters() if p.requires_grad):
            p.grad = (torch.randn(p.shape, generator=torch.Generator().manual_seed(i)) * 256).to(p.dtype)
    before = _weights(model)
    expected = (pytest.raises(SettingsMismatchError, match=r"multiplied 1 time\(s\) by torch code.*reached "
                              r"tritonshard on some ranks only") if how == "GradScaler" else
                pytest.raises(CollectiveMismatchError, match="per-parameter gradient norms"))
    with expected:
        if how == "GradScaler":
            scaler.unscale_(opt)
            scaler.step(opt)
        else:  # (a clip of torch's over rank 1's placeholders, rank 0's plain ones or none)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
            opt.step()
    assert_bitwise_equal(_weights(model), before, "a refused step")


@pytest.mark.parametrize("case", ["no gradient", "set by hand"])
def test_a_rank_whose_gradients_never_reached_the_buffers_is_an_error_not_another_scale(case):
    run_on_ranks(_no_placeholder_on_one_rank, 2, case, "GradScaler")


def test_torchs_clip_where_one_rank_set_every_gradient_by_hand():
    run_on_ranks(_no_placeholder_on_one_rank, 2, "set by hand", "torch's clip")


@pytest.mark.parametrize("unscale, retry", [(False, True), (True, False)],
                         ids=["retried", "given up after unscale_"])
def test_a_step_that_raised_under_grad_scaler_leaves_no_scale_behind(unscale, retry):
    """GradScaler.step(opt) sets opt.grad_scale and opt.found_inf around opt.step() and deletes them only when it
    returns. A step that raised (a bad lr a loop then fixes) left them on the optimizer: the next scaler.step(opt)
    multiplied its scale by the stale one, and a step retried unscaled by the square of the scale (silently; AdamW
    hides most of it, SGD shows it); after unscale_ and a step given up (zero_grad, update), the next iteration's
    scaler.step without unscale_ raised torch's TypeError (None * a tensor). Until session 25 (found by the two-rank GradScaler fuzz
    machine). The loop must train as one that never erred, bit for bit."""
    from tritonshard import ShardedSGD

    def run(fail: bool):
        model = make_model(0)
        opt = ShardedSGD(model.parameters(), lr=1e-2)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=1000)
        for step in range(3):
            scaler.scale(loss_fn(model, batch(0, step, 0))).backward()
            if unscale and step == 1:
                scaler.unscale_(opt)
            if step == 1:
                if fail:
                    opt.param_groups[0]["lr"] = -1.0
                    with pytest.raises(ValueError, match="lr"):
                        scaler.step(opt)
                    opt.param_groups[0]["lr"] = 1e-2
                if not retry:  # (the loop gives this step up)
                    opt.zero_grad()
                    scaler.update()
                    continue
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        return _weights(model)

    assert_bitwise_equal(run(True), run(False), "a loop that went on after a step that raised under GradScaler")


def test_fp16_weights_with_the_built_in_scaler_and_grad_scaler_is_a_clear_error():
    """fp16 weights turn tritonshard's own loss scaling on; GradScaler would unscale a second time."""
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12)
    with pytest.raises(RuntimeError, match=r"opt\.scale_loss\(loss\).*loss_scale=False"):
        _train(0, scaler, unscale=False, clip=False, steps=1, param_dtype=torch.float16)


def test_fp16_weights_with_loss_scale_false_train_under_grad_scaler():
    """loss_scale=False hands the scaling to GradScaler; scaler.step(opt) without unscale_ (torch's unscale_ refuses
    fp16 gradients for every optimizer: "Attempting to unscale FP16 gradients")."""
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12)
    model, opt, _ = _train(0, scaler, unscale=False, clip=False, param_dtype=torch.float16, loss_scale=False)
    ref_model, _, _ = _train(0, None, unscale=False, clip=False, param_dtype=torch.float16, loss_scale=False)
    assert opt.loss_scale is None
    # fp16's range is narrow: 2^12 times the gradients stays exact unless one underflows unscaled (then the scaled
    # run is the more accurate one); the weights of this model agree to the last fp16 bit
    assert_bitwise_equal(_weights(model), _weights(ref_model), "fp16 weights, GradScaler vs no scaling")


@pytest.mark.parametrize("unscale", [True, False], ids=["unscale_, then step", "step only"])
def test_a_gradient_set_by_hand_beside_the_backwards_is_unscaled_with_them(unscale):
    """A parameter the backward did not reach, given a gradient by hand (in the loss's scaled units, as the loop's
    own code would compute it), beside the backward's placeholders. Before: step() raised "param.grad was
    multiplied (...) for N of the M parameters" (torch's op had unscaled the plain tensor and the update was to
    unscale the others; GradScaler.step's inf check without unscale_ multiplies by 1.0, the same error)."""
    scale = 2.0 ** 8
    hand = torch.randn(3, generator=torch.Generator().manual_seed(5))
    runs = []
    for scaler in (torch.amp.GradScaler("cpu", init_scale=scale), None):
        model = make_model(0)
        opt = ShardedAdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        for step in range(2):
            loss = loss_fn(model, batch(0, step, 0))
            (scaler.scale(loss) if scaler is not None else loss).backward()
            model.unused.grad = (hand * (scale if scaler is not None else 1.0)).to(torch.bfloat16)
            if scaler is None:
                opt.step()
            else:
                if unscale:
                    scaler.unscale_(opt)
                scaler.step(opt)
                scaler.update()
            opt.zero_grad()
        runs.append(_weights(model))
    assert_bitwise_equal(runs[0], runs[1], "weights, a hand-set gradient under GradScaler vs no scaling")


def test_grad_scaler_step_without_any_gradient_changes_nothing():
    """GradScaler.step(opt) where no parameter has a gradient hands the optimizer found_inf as the number 0 (its
    sum over no devices): the step takes it as torch's fused optimizers do, and changes nothing. (Before: an
    AttributeError, 'bool' object has no attribute 'to'. torch's own scaler.update() then raises, "No inf checks
    were recorded prior to update", as for every optimizer.)"""
    model = make_model(0)
    opt = ShardedAdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    before = _weights(model)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    scaler.scale(torch.ones(()))
    scaler.step(opt)
    assert_bitwise_equal(_weights(model), before, "a step without gradients")
    assert int(opt.skipped_steps) == 0
