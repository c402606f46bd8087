"""adamw_coefficients_launch (one kernel for AdamW's per-step coefficients) against adamw_coefficients_into (the
float64 torch ops it replaces on the Triton path), bit for bit: compiled on a GPU, through the interpreter here."""

import random

import pytest
import torch
from triton.runtime.jit import mangle_type

from tests.helpers import assert_bitwise_equal
from tests.kernels.common import DEVICE
from tritonshard.kernels import _dispatch
from tritonshard.kernels.adamw import adamw_coefficients_into, adamw_coefficients_launch

pytestmark = pytest.mark.skipif(not (_dispatch.interpreter_enabled() or DEVICE.type == "cuda"),
                                reason="the kernel runs compiled on a GPU or through the interpreter (CI sets it)")


def _cases(seed: int, n: int):
    """Hyper-parameters and step counts: the usual values, the edges (lr 0, weight decay 0, beta 0, a beta near 1,
    step 1, which makes 1 - beta^t smallest) and fresh random ones."""
    rng = random.Random(seed)
    fixed = [(1e-3, 0.9, 0.999, 0.01, 1), (3e-4, 0.9, 0.95, 0.1, 2), (0.0, 0.9, 0.999, 0.0, 7),
             (6e-4, 0.0, 0.5, 1.0, 1), (1e-8, 0.99999, 0.999999, 1e-5, 1), (2.5e-3, 0.8, 0.99, 0.05, 123457),
             # lr * wd far from 0, where the decay's fp32 rounding sees the weight decay's last float64 bits
             # (an fp32 weight decay in the kernel fails here)
             (0.73, 0.9, 0.999, 0.91, 5), (0.37, 0.8, 0.9, 0.6543, 9), (0.1, 0.9, 0.999, 0.7071067811865476, 3),
             (0.9, 0.5, 0.5, 0.3, 2)]
    randoms = [(10 ** rng.uniform(-8, 0), rng.random(), rng.random(), rng.choice([0.0, 10 ** rng.uniform(-6, 0)]),
                rng.choice([1, 2, 3, rng.randrange(1, 10 ** 6)])) for _ in range(n)]
    randoms += [(rng.random(), rng.random(), rng.random(), rng.random(), rng.randrange(1, 50)) for _ in range(n)]
    return fixed + randoms


@pytest.mark.parametrize("lr_in_memory", [False, True])
@pytest.mark.parametrize("seed", [0, 1])
def test_the_kernel_gives_the_torch_ops_bits(seed, lr_in_memory):
    """The lr as a kernel argument (the usual step: a new value every step replays the bound launch with it), or
    read from its float64 tensor (a captured step's); compiled, the powers come from libdevice's pow."""
    step64 = torch.empty((), dtype=torch.float64, device=DEVICE)
    pows = torch.empty(2, dtype=torch.float64, device=DEVICE)
    scratch = (step64, pows, tuple(pows.unbind()))
    ref_scratch = tuple(torch.empty((), dtype=torch.float64, device=DEVICE) for _ in range(3))
    launches: dict = {}  # (kept across the cases, as the optimizer keeps it: later cases replay or rebind)
    out = torch.empty(3, dtype=torch.float32, device=DEVICE)
    for lr, beta1, beta2, weight_decay, step in _cases(seed, 12):
        step_t = torch.tensor(float(step), dtype=torch.float32, device=DEVICE)
        lr_t = torch.tensor(lr, dtype=torch.float64, device=DEVICE)
        want = torch.empty(3, dtype=torch.float32, device=DEVICE)
        adamw_coefficients_into(tuple(want.unbind()), ref_scratch, lr, step_t, beta1, beta2, weight_decay)
        out.fill_(float("nan"))
        adamw_coefficients_launch(out, scratch, lr_t if lr_in_memory else lr, step_t, beta1, beta2, weight_decay,
                                  launches)
        assert_bitwise_equal(out, want, f"coefficients at lr={lr!r} betas=({beta1!r}, {beta2!r}) wd={weight_decay!r} "
                                        f"step={step}")
    # the values themselves, from Python's float64 arithmetic (a check of the reference, with the last case's
    # values): the decay exactly, the other two within an fp32 rounding
    decay, step_size, bc2_sqrt = out.tolist()
    assert decay == float(torch.tensor(1.0 - lr * weight_decay, dtype=torch.float32))
    assert step_size == pytest.approx(lr / (1.0 - beta1 ** step), rel=1e-7)
    assert bc2_sqrt == pytest.approx((1.0 - beta2 ** step) ** 0.5, rel=1e-7)


def test_a_step_count_of_zero_gives_torchs_infinity_without_a_warning():
    """Every step so far skipped (an inf found, the count not advanced): 1 - beta1^0 = 0, and torch's reciprocal
    gives inf (the masked update never uses it). The kernel gives the same bits; under the interpreter numpy would
    warn about the division where a GPU divides silently, and the launcher keeps it quiet."""
    import warnings
    step_t = torch.tensor(0.0, device=DEVICE)
    pows = torch.empty(2, dtype=torch.float64, device=DEVICE)
    out = torch.empty(3, device=DEVICE)
    want = torch.empty(3, device=DEVICE)
    ref_scratch = tuple(torch.empty((), dtype=torch.float64, device=DEVICE) for _ in range(3))
    for lr in (1e-3, 0.0):  # (inf * lr: inf, or nan for an lr of 0)
        adamw_coefficients_into(tuple(want.unbind()), ref_scratch, lr, step_t, 0.9, 0.999, 0.1)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            adamw_coefficients_launch(out, (torch.empty((), dtype=torch.float64, device=DEVICE), pows, pows.unbind()),
                                      torch.tensor(lr, dtype=torch.float64, device=DEVICE), step_t, 0.9, 0.999, 0.1,
                                      {})
        assert want[2] == 0 and not torch.isfinite(want[1]), want  # (the case described above)
        assert_bitwise_equal(out, want, f"coefficients at step 0, lr {lr}")


def test_a_new_lr_at_every_call_replays_the_bound_launch_with_it():
    """A scheduler's lr, new at every step, with the betas and the weight decay fixed: each call after the first
    replays the bound launch with this call's lr (kernels/_launch.py's ``live``; under the interpreter, Triton's
    path with this call's arguments), which must give this lr's bits, not the first call's. An lr of 0 is another
    Triton type for its bits (i32, not i64): bound anew, and the same bits."""
    from tritonshard.kernels import _launch
    pows = torch.empty(2, dtype=torch.float64, device=DEVICE)
    scratch = (torch.empty((), dtype=torch.float64, device=DEVICE), pows, tuple(pows.unbind()))
    ref_scratch = tuple(torch.empty((), dtype=torch.float64, device=DEVICE) for _ in range(3))
    launches: dict = {}
    out, want = torch.empty(3, device=DEVICE), torch.empty(3, device=DEVICE)
    lrs = [1e-3 * (1 + step) ** -0.5 for step in range(5)] + [0.0, 2e-4]
    bound = []
    step_t = torch.zeros((), device=DEVICE)  # (the optimizer's counter: one tensor, advanced in place)
    for step, lr in enumerate(lrs, start=1):
        step_t.fill_(step)
        adamw_coefficients_into(tuple(want.unbind()), ref_scratch, lr, step_t, 0.9, 0.95, 0.1)
        out.fill_(float("nan"))
        adamw_coefficients_launch(out, scratch, lr, step_t, 0.9, 0.95, 0.1, launches)
        assert_bitwise_equal(out, want, f"coefficients at step {step}, lr {lr!r}")
        bound.append(launches["coefficients"])
    assert all(b is bound[0] for b in bound[:5]), "a new lr bound the launch anew"
    assert bound[5] is not bound[4] and bound[6] is not bound[5], "an lr whose bits change Triton's type must rebind"
    assert all(_launch._int_type(v) == mangle_type(v) for v in (0, 1, -1, 2 ** 31 - 1, 2 ** 31, -2 ** 31,
                                                                -2 ** 31 - 1, 2 ** 63 - 1, 2 ** 63, 2 ** 64 - 1))
