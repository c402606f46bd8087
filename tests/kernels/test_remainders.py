"""fp32 master = bf16 weight + int16 remainder: exact round trip, and the same trajectory as an fp32 master."""

import pytest
import torch

from tests.helpers import assert_bitwise_equal
from tests.kernels.common import DEVICE, random_fp32_bits, randn
from tritonshard.kernels import Backend, adamw_step_, last_backend, lion_step_, sgd_step_
from tritonshard.kernels.rounding import combine_bf16_remainder, split_bf16_remainder


def _tie_down(x: torch.Tensor) -> torch.Tensor:
    """Elements that are an exact tie rounded down to an even bf16: the one case 16 bits cannot hold."""
    bits = x.view(torch.int32)
    return ((bits & 0xFFFF) == 0x8000) & (((bits >> 16) & 1) == 0)


def test_split_combine_round_trip_on_random_bit_patterns():
    x = random_fp32_bits(200_000, 1)
    x = x[x.isfinite()]
    x = torch.cat([x, torch.tensor([1 + 2 ** -8, -(1 + 2 ** -8), 1 + 3 * 2 ** -8, 3.3895313892515355e38],
                                   device=x.device)])  # ties (down to even, both signs, up) and the bf16 max
    hi, rem = split_bf16_remainder(x)
    assert_bitwise_equal(hi, x.to(torch.bfloat16), "the high half is the round-to-nearest-even bf16")
    back = combine_bf16_remainder(hi, rem)
    ties = _tie_down(x)
    assert int(ties.sum()) >= 2
    assert_bitwise_equal(back[~ties], x[~ties], "exact everywhere else")
    # the tie case: one fp32 ulp toward zero, still rounding to the same bf16
    assert torch.equal(back[ties].view(torch.int32), x[ties].view(torch.int32) - 1)
    assert_bitwise_equal(back[ties].to(torch.bfloat16), hi[ties], "tie case rounds to the same bf16")


def _step(kind, param, grad, state, param_out, step, remainders, backend):
    if kind == "adamw":
        adamw_step_(param, grad, state[0], state[1], lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                    weight_decay=0.01, step=step, param_out=param_out, remainders=remainders, backend=backend)
    elif kind == "sgd":
        sgd_step_(param, grad, state[0], lr=1e-2, momentum=0.9, step=step, param_out=param_out,
                  remainders=remainders, backend=backend)
    else:
        lion_step_(param, grad, state[0], lr=1e-3, weight_decay=0.1, param_out=param_out, remainders=remainders,
                   backend=backend)


@pytest.mark.parametrize("kind", ["adamw", "sgd", "lion"])
# backend "torch": the reference path (a CPU user without the interpreter) keeps the same contract; asked for by
# the launchers' own argument, so on a GPU the reference is tested too (not only the compiled kernels)
@pytest.mark.parametrize("backend", [None, "torch"])
def test_same_trajectory_as_the_fp32_master(kind, backend):
    n = 4099
    master0 = randn(n, 7)
    hi, rem = split_bf16_remainder(master0)
    fp32 = combine_bf16_remainder(hi, rem).clone()  # both paths start from the same master
    out_fp32 = torch.empty(n, dtype=torch.bfloat16, device=DEVICE)
    nstate = 2 if kind == "adamw" else 1
    s_fp32 = [torch.zeros(n, device=DEVICE) for _ in range(nstate)]
    s_rem = [torch.zeros(n, device=DEVICE) for _ in range(nstate)]
    for step in range(1, 6):
        g = randn(n, 100 + step, torch.bfloat16)
        _step(kind, fp32, g, s_fp32, out_fp32, step, False, backend)
        _step(kind, rem, g, s_rem, hi, step, True, backend)
        assert_bitwise_equal(hi, out_fp32, f"{kind} step {step}: bf16 weights")
        for a, b in zip(s_rem, s_fp32):
            assert_bitwise_equal(a, b, f"{kind} step {step}: optimizer state")
        rebuilt = combine_bf16_remainder(hi, rem)
        ties = _tie_down(fp32)
        assert_bitwise_equal(rebuilt[~ties], fp32[~ties], f"{kind} step {step}: master")
        assert torch.equal(rebuilt[ties].view(torch.int32), fp32[ties].view(torch.int32) - 1)
        fp32.copy_(rebuilt)  # keep the two paths step-local: a tie moves the master by one ulp, by design
    ran = last_backend(f"{kind}_step_")
    assert (ran is Backend.TORCH) == (backend == "torch"), f"{kind}: ran on {ran}"


def test_remainder_arguments_are_checked():
    p = torch.zeros(8, dtype=torch.int16, device=DEVICE)
    g, m, v = torch.zeros(8, device=DEVICE), torch.zeros(8, device=DEVICE), torch.zeros(8, device=DEVICE)
    with pytest.raises(TypeError, match="param_out must be the bf16 weights"):
        adamw_step_(p, g, m, v, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, step=1,
                    remainders=True)
    with pytest.raises(TypeError, match="int16 remainders"):
        adamw_step_(g, g, m, v, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, step=1,
                    param_out=torch.zeros(8, dtype=torch.bfloat16, device=DEVICE), remainders=True)
