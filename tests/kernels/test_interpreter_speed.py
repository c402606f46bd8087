"""The interpreter shortcut the suite runs with (tests/interpreter_speed.py) changes no kernel's result."""

import pytest
import torch

from tests import interpreter_speed
from tests.helpers import assert_bitwise_equal
from tests.kernels.common import DEVICE, randn
from tritonshard import kernels

pytestmark = pytest.mark.skipif(
    not kernels.interpreter_enabled() or not interpreter_speed.install(),
    reason="the shortcut applies to the Triton interpreter only (compiled kernels here, or another Triton)")


def _run_kernels() -> dict[str, torch.Tensor]:
    """Every kernel family with its nested @triton.jit helpers (rounding, seeds, coefficients) on fresh random
    data of odd sizes; returns every tensor they wrote."""
    out: dict[str, torch.Tensor] = {}
    n = 4099  # a prime above every BLOCK: several programs, a masked tail
    g = randn(n, 1, torch.bfloat16)
    seed = torch.full((1,), 7, dtype=torch.int64, device=DEVICE)
    p, m, v = randn(n, 2), randn(n, 3, torch.bfloat16), randn(n, 4, torch.bfloat16).abs()
    p_out = torch.empty(n, dtype=torch.bfloat16, device=DEVICE)
    kernels.adamw_step_(p, g, m, v, lr=torch.tensor(1e-3, dtype=torch.float64, device=DEVICE), beta1=0.9,
                        beta2=0.999, eps=1e-8, weight_decay=0.01, step=torch.tensor(3.0, device=DEVICE),
                        grad_scale=torch.tensor(0.5, device=DEVICE), param_out=p_out, state_rounding="stochastic",
                        seed=seed)
    out.update(adamw_p=p, adamw_m=m, adamw_v=v, adamw_out=p_out)
    p, buf = randn(n, 5), randn(n, 6, torch.bfloat16)
    kernels.sgd_step_(p, g, buf, lr=1e-2, momentum=0.9, nesterov=True, weight_decay=0.1, step=2,
                      state_rounding="stochastic", seed=seed)
    out.update(sgd_p=p, sgd_buf=buf)
    p, m = randn(n, 8), randn(n, 9, torch.bfloat16)
    kernels.lion_step_(p, g, m, lr=1e-3, weight_decay=0.1, state_rounding="stochastic", seed=seed)
    out.update(lion_p=p, lion_m=m)
    flat = randn(199 + 1 + 4099, 10, torch.bfloat16)
    srcs = [randn(199, 11), randn(1, 12, torch.float16), randn(4099, 13, torch.bfloat16)]
    kernels.flatten_into(flat, srcs, [0, 199, 200], accumulate=True, scale=0.37)
    out["flatten"] = flat
    x = randn(3 * 4096 + 5, 14, torch.bfloat16)
    out["scale_x"] = x
    out["scale_sum_sq"], out["scale_nonfinite"] = kernels.scale_(x, 0.3)
    return out


def test_kernels_give_the_same_bits_with_and_without_the_shortcut():
    from triton.runtime import interpreter

    import triton.language as tl
    from triton.language.semantic import TritonSemantic

    counted = {"with": 0, "without": 0}
    asserts = {"with": 0, "without": 0}  # the overflow checks' device_assert calls (no kernel of ours calls one)
    inits = {}  # whose block_type.__init__ runs
    patch_builtin, device_assert = interpreter._patch_builtin, TritonSemantic.device_assert
    mode = "with"

    def counting(*args, **kwargs):
        counted[mode] += 1
        return patch_builtin(*args, **kwargs)

    def counting_asserts(*args, **kwargs):
        asserts[mode] += 1
        return device_assert(*args, **kwargs)

    interpreter._patch_builtin, TritonSemantic.device_assert = counting, counting_asserts
    try:
        inits[mode] = {tl.core.block_type.__init__.__module__, tl.core.tensor.__init__.__module__}
        fast = _run_kernels()
        mode = "without"
        with interpreter_speed.disabled():
            inits[mode] = {tl.core.block_type.__init__.__module__, tl.core.tensor.__init__.__module__}
            slow = _run_kernels()
    finally:
        interpreter._patch_builtin, TritonSemantic.device_assert = patch_builtin, device_assert
    assert fast.keys() == slow.keys()
    for name in fast:
        assert_bitwise_equal(fast[name], slow[name], name)
    # and the shortcuts are on: no patching at all once installed, where Triton patches at every launch and helper
    # call; no overflow check computed for an assert that drops it; block types and blocks' shapes described
    # once. And off inside
    # disabled(): the other side is Triton's interpreter as it comes.
    assert counted["with"] == 0 and counted["without"] > 0, counted
    assert asserts["with"] == 0 and asserts["without"] > 0, asserts
    assert inits == {"with": {"tests.interpreter_speed"}, "without": {"triton.language.core"}}, inits
