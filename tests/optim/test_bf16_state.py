"""state_dtype=torch.bfloat16: half the optimizer-state memory, a trajectory close to fp32 states."""

import pytest
import torch

from tests.distributed import run_on_ranks
from tests.optim.training import LR, make_model, param_groups, schedule, train_step
from tritonshard import ShardedAdamW


def _bf16_vs_fp32_states(rank, world_size, rounding):
    runs = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = make_model(0)
        opt = ShardedAdamW(param_groups(model), lr=LR, state_dtype=dtype, state_rounding=rounding,
                           bucket_cap_mb=200 * 2 / 2 ** 20)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
        for step in range(4):
            train_step(model, opt, sched, rank, step)
        runs[dtype] = opt
    fp32, bf16 = runs[torch.float32], runs[torch.bfloat16]
    assert bf16.memory_bytes()["state"] * 2 == fp32.memory_bytes()["state"]
    a, b = fp32.state_dict()["state"], bf16.state_dict()["state"]
    scale = max(float(e["master"].abs().max()) for e in a.values())
    worst = max(float((a[i]["master"] - b[i]["master"]).abs().max()) for i in a)
    # bf16 moments carry 2^-9 relative rounding error each step; Adam's update m/sqrt(v) inherits ~2^-8 of it,
    # i.e. ~4e-3 * lr = 8e-5 per step, 3e-4 over 4 steps, against max|master| ~ 0.5-1: 1e-3
    assert worst <= 1e-3 * scale, f"bf16 states ({rounding}) drift {worst / scale:.1e} from fp32 states"
    assert all(e["exp_avg"].dtype == torch.float32 for e in b.values()), "state_dict holds fp32 (torch.optim's)"
    if rounding == "stochastic":
        assert all(bk.sr_seed is not None for bk in bf16.buckets)


@pytest.mark.parametrize("rounding", ["stochastic", "nearest"])
def test_bf16_states_track_fp32_states(rounding):
    run_on_ranks(_bf16_vs_fp32_states, 2, rounding)


def test_bad_state_arguments():
    with pytest.raises(ValueError, match="state_dtype"):
        ShardedAdamW([torch.nn.Parameter(torch.ones(2))], state_dtype=torch.float16)
    with pytest.raises(ValueError, match="state_rounding"):
        ShardedAdamW([torch.nn.Parameter(torch.ones(2))], state_dtype=torch.bfloat16, state_rounding="down")


def _rounded_up(stored: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    """Whether stochastic rounding carried into the bf16 bits: stored high half != the exact value's high half."""
    hi = (exact.view(torch.int32) >> 16) & 0xFFFF
    return (stored.view(torch.int16).to(torch.int32) & 0xFFFF) != hi


def test_stochastic_rounding_decisions_are_uncorrelated_across_states_and_steps():
    """Each (state tensor, step) must round with its own random bits. Rounding up happens when frac + r >= 1 for the
    element's fractional position frac and a uniform r; two decisions that share r are positively correlated
    (for independent uniform fracs the indicators' correlation is 1/3), independent ones are not (+-1/sqrt(n))."""
    n, beta1, beta2 = 1 << 14, 0.9, 0.999
    param = torch.nn.Parameter(torch.randn(n))
    opt = ShardedAdamW([param], lr=1e-3, betas=(beta1, beta2), weight_decay=0.0, state_dtype=torch.bfloat16)
    b = opt.buckets[0]
    gen = torch.Generator().manual_seed(0)
    decisions = []  # per step: (exp_avg rounded up, exp_avg_sq rounded up)
    for _ in range(3):
        m0, v0 = (t[:n].float() for t in (b.state["exp_avg"], b.state["exp_avg_sq"]))
        param.grad = torch.randn(n, generator=gen).to(torch.bfloat16)
        g = param.grad.float()
        opt.step()
        # the kernel's fp32 arithmetic (tritonshard/kernels/adamw.py), before the state's rounding
        m = m0 + (1 - beta1) * (g - m0)
        v = v0 * beta2 + (1 - beta2) * g * g
        decisions.append((_rounded_up(b.state["exp_avg"][:n], m), _rounded_up(b.state["exp_avg_sq"][:n], v)))

    def corr(x, y):
        return float(torch.corrcoef(torch.stack([x.float(), y.float()]))[0, 1])

    pairs = {"exp_avg vs exp_avg_sq, same step": (decisions[1][0], decisions[1][1]),
             "exp_avg_sq at t vs exp_avg at t+1": (decisions[1][1], decisions[2][0]),
             "exp_avg at t vs exp_avg at t+1": (decisions[1][0], decisions[2][0]),
             "exp_avg_sq at t vs exp_avg_sq at t+1": (decisions[1][1], decisions[2][1])}
    for what, (x, y) in pairs.items():
        assert 0.2 < float(x.float().mean()) < 0.8, f"{what}: the test needs both decisions to occur"
        # independent: |corr| ~ 1/sqrt(16384) = 0.008; shared random bits: ~0.33. 0.05 is 6 sigma of the former
        assert abs(corr(x, y)) < 0.05, f"{what}: rounding decisions correlated ({corr(x, y):.3f})"


@pytest.mark.parametrize("how", ["state_dict", "sharded"])
def test_stochastic_rounding_resumes_bit_exactly(tmp_path, how):
    # stop after 2 steps, resume into a fresh optimizer, 2 more: the same bits as 4 uninterrupted steps. The Philox
    # key position was not saved before issue 23: a resumed run drew other random bits (140 of 200 steps differed)
    from tests.helpers import assert_bitwise_equal
    from tritonshard.checkpoint import load_sharded, save_sharded

    def build():
        model = make_model(0)
        opt = ShardedAdamW(param_groups(model), lr=LR, state_dtype=torch.bfloat16, bucket_cap_mb=200 * 2 / 2 ** 20)
        return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)  # constant: nothing to restore

    model, opt, sched = build()
    for step in range(4):
        train_step(model, opt, sched, 0, step)
    straight = opt.state_dict()["state"]

    model, opt, sched = build()
    for step in range(2):
        train_step(model, opt, sched, 0, step)
    saved = opt.state_dict() if how == "state_dict" else save_sharded(opt, str(tmp_path / "ckpt"))
    model, opt, sched = build()
    if how == "state_dict":
        opt.load_state_dict(saved)
    else:
        load_sharded(opt, str(tmp_path / "ckpt"))
    for step in range(2, 4):
        train_step(model, opt, sched, 0, step)
    resumed = opt.state_dict()["state"]
    for i in straight:
        for name in ("master", "exp_avg", "exp_avg_sq"):
            assert_bitwise_equal(resumed[i][name], straight[i][name], f"state[{i}][{name!r}] after the resume")
