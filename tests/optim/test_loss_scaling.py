"""fp16 parameters with dynamic loss scaling: unscale folded into grad_scale, overflow skips and backs off, growth."""

import pytest
import torch

from tests.distributed import run_on_ranks
from tests.optim.training import LR, Reference, make_model, param_groups, schedule, train_step
from tritonshard import LossScaleConfig, ShardedAdamW


def _fp16_matches_reference(rank, world_size, grad_dtype):
    scale = 2.0 ** 10  # large enough to matter for fp16 gradients, small enough never to overflow here
    model = make_model(0)
    opt = ShardedAdamW(param_groups(model), lr=LR, param_dtype=torch.float16, grad_dtype=grad_dtype,
                       loss_scale=LossScaleConfig(init_scale=scale, growth_interval=10 ** 6))
    assert model.fc1.weight.dtype == torch.float16
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    ref = Reference(world_size, model_dtype=torch.float16, loss_scale=scale, grad_dtype=grad_dtype)
    for step in range(3):
        norm = train_step(model, opt, sched, rank, step)
        ref_norm = ref.step(step)
        # the returned norm is of the unscaled gradients; the scale is a power of two, so unscaling is exact
        assert abs(float(norm) - float(ref_norm)) <= 1e-6 * float(ref_norm)
    assert float(opt.loss_scale) == scale and int(opt.skipped_steps) == 0
    state = opt.state_dict()["state"]
    worst = max(float((state[i]["master"] - p.detach()).abs().max()) for i, p in enumerate(ref.master))
    scale_ref = max(float(p.detach().abs().max()) for p in ref.master)
    # 2 ranks: the reference's arithmetic exactly (grad sums in grad_dtype, power-of-two scales) up to fp32 op
    # order, 1e-6
    assert worst <= 1e-6 * scale_ref, f"fp16 + loss scaling vs reference: {worst / scale_ref:.2e}"
    for p, q in zip([p for g in param_groups(model) for p in g["params"]], ref.bf16_weights()):
        assert p.dtype == q.dtype == torch.float16
        assert bool(((p.float() - q.float()).abs() <= 1e-6 * scale_ref + 2 ** -10 * q.float().abs()).all())


@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float32])
def test_fp16_with_loss_scaling_matches_reference(grad_dtype):
    """fp16 weights flatten and reduce their gradients in ``grad_dtype``: bf16 by default (the scaled fp16
    gradients rounded to 8 bits, as a bf16 model's), fp32 to keep them whole (README's fp16 section)."""
    run_on_ranks(_fp16_matches_reference, 2, grad_dtype)


def _overflow_backoff_growth(rank, world_size):
    model = make_model(0)
    # 2^60: every fp16 gradient overflows; each overflow halves the scale until the gradients fit in fp16
    opt = ShardedAdamW(param_groups(model), lr=LR, param_dtype=torch.float16,
                       loss_scale=LossScaleConfig(init_scale=2.0 ** 60, backoff_factor=0.5, growth_interval=2))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    weights = [b.param_buffer.get_data().clone() for b in opt.buckets]
    step = 0
    while int(opt.skipped_steps) == step:  # skipped steps: nothing changes, the scale halves
        assert all(torch.equal(w.view(torch.int16), b.param_buffer.get_data().view(torch.int16))
                   for w, b in zip(weights, opt.buckets))
        assert float(opt.loss_scale) == 2.0 ** (60 - step)
        train_step(model, opt, sched, rank, step)
        step += 1
        assert step < 60
    skipped = int(opt.skipped_steps)
    assert skipped >= 30, f"2^60 should overflow fp16 gradients for many halvings, only {skipped} did"
    assert all(float(b.step) == 1 for b in opt.buckets), "one applied step"
    scale_after_first_good = float(opt.loss_scale)
    train_step(model, opt, sched, rank, step)  # second clean step in a row: growth_interval=2 -> doubles
    assert float(opt.loss_scale) == 2 * scale_after_first_good
    assert not any(torch.equal(w.view(torch.int16), b.param_buffer.get_data().view(torch.int16))
                   for w, b in zip(weights, opt.buckets))


def test_overflow_skips_and_backs_off_then_grows():
    run_on_ranks(_overflow_backoff_growth, 2)


def test_bf16_has_no_loss_scale_by_default_and_state_dict_round_trips_the_scale():
    assert ShardedAdamW([torch.nn.Parameter(torch.ones(3))]).loss_scale is None
    model = make_model(0)
    opt = ShardedAdamW(param_groups(model), lr=LR, param_dtype=torch.float16)
    assert float(opt.loss_scale) == 2.0 ** 16
    opt._scale.fill_(1024.0)
    opt._growth_tracker.fill_(7)
    sd = opt.state_dict()
    other = ShardedAdamW(param_groups(make_model(0)), lr=LR, param_dtype=torch.float16)
    other.load_state_dict(sd)
    assert float(other.loss_scale) == 1024.0 and int(other._growth_tracker) == 7


def _poisoned_steps(min_scale: float, patience: int, poisoned: int, clean: int, **config):
    """fp16 training where the first ``poisoned`` steps overflow (an inf in the data), then ``clean`` ones."""
    model = make_model(0)
    opt = ShardedAdamW(param_groups(model), lr=LR, param_dtype=torch.float16,
                       loss_scale=LossScaleConfig(**{"init_scale": 2.0 ** 16, **config}, min_scale=min_scale,
                                                  max_overflows_at_min_scale=patience))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    scales, norms = [], []
    for step in range(poisoned + clean):
        norms.append(float(train_step(model, opt, sched, 0, step, poison=step < poisoned)))
        scales.append(float(opt.loss_scale))
    return opt, scales, norms


def test_the_loss_scale_stops_at_its_floor_and_training_goes_on():
    # without a floor, 12 overflowing steps halve 2^16 to 2^4 (and 50 took it to 3.6e-12, as measured before,
    # after which the clean steps' fp16 gradients underflowed to zero); with the floor the scale stops at
    # min_scale=2^10 after 6 of them and the clean steps train
    opt, scales, norms = _poisoned_steps(2.0 ** 10, patience=100, poisoned=12, clean=3)
    assert min(scales) == 2.0 ** 10 and scales[5] == 2.0 ** 10
    assert int(opt.skipped_steps) == 12 and all(float(b.step) == 3 for b in opt.buckets)
    assert all(n > 1e-3 for n in norms[12:]), f"the clean steps' gradients must not underflow: {norms[12:]}"


def test_overflowing_at_the_floor_stops_the_run_loudly():
    # the scale reaches 2^10 after 6 halvings from 2^16; 3 more overflows there: the next step() raises, before
    # it changes anything
    model_steps = 6 + 3
    with pytest.raises(FloatingPointError, match=r"last 3 steps .* loss scale at its floor .*min_scale=1024"):
        _poisoned_steps(2.0 ** 10, patience=3, poisoned=model_steps + 5, clean=0)


@pytest.mark.parametrize("kwargs, match", [
    (dict(min_scale=0.0), "min_scale must be a finite number > 0"),
    (dict(min_scale=2.0 ** 20), r"min_scale \(1048576.0\) must be <= init_scale"),
    (dict(max_overflows_at_min_scale=0), "max_overflows_at_min_scale must be an int >= 1"),
    (dict(backoff_factor=float("nan")), "backoff_factor must be a finite number > 0"),
    # inverted factors, as GradScaler refuses them: until session 49 backoff_factor=2 grew the scale at every
    # overflow, so every step was skipped while the floor's check never fired
    (dict(backoff_factor=2.0), r"backoff_factor must be <= 1 \(the scale backs off after an overflow\), got 2.0"),
    (dict(growth_factor=0.5), r"growth_factor must be >= 1 \(the scale grows after clean steps\), got 0.5"),
])
def test_bad_loss_scale_config(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LossScaleConfig(**kwargs)


def test_a_static_loss_scale_skips_overflowing_steps_and_stays():
    """growth_factor = backoff_factor = 1, which the bounds above leave in: a constant scale (Megatron's static loss
    scale). Overflowing steps are skipped and the scale stays, after clean steps too (growth_interval 1)."""
    opt, scales, norms = _poisoned_steps(1.0, patience=100, poisoned=3, clean=3, init_scale=2.0 ** 10,
                                         growth_factor=1.0, backoff_factor=1.0, growth_interval=1)
    assert scales == [2.0 ** 10] * 6, scales
    assert int(opt.skipped_steps) == 3 and all(float(b.step) == 3 for b in opt.buckets)
    assert all(n > 1e-3 for n in norms[3:]), norms
