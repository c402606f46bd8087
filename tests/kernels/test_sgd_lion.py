"""sgd_step_ against torch.optim.SGD(foreach=False); lion_step_ against the paper's update written out here."""

import pytest
import torch

from tests.helpers import assert_bitwise_equal, assert_close_rel
from tests.kernels.common import DEVICE, ODD_SIZES, randn
from tritonshard.kernels import Backend, last_backend, lion_step_, lion_step_ref, sgd_step_

# Same fp32 operations in the same order as the references; differences are a few ulps from torch's vectorized
# kernels (FMA contraction), accumulated over STEPS steps: far below 1e-6 of max|param|.
REL = 1e-6
STEPS = 4

SGD_CASES = [
    dict(momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False),
    dict(momentum=0.9, dampening=0.0, weight_decay=1e-2, nesterov=False),
    dict(momentum=0.9, dampening=0.0, weight_decay=1e-2, nesterov=True),
    dict(momentum=0.5, dampening=0.3, weight_decay=0.0, nesterov=False),
]


def _grads(n, seed, dtype):
    return [randn(n, seed + k, dtype, scale=0.1 * (k + 1)) for k in range(STEPS)]


@pytest.mark.parametrize("case", SGD_CASES)
@pytest.mark.parametrize("n", [1, 199, 4099])
@pytest.mark.parametrize("scalars", ["number", "tensor"])
@pytest.mark.parametrize("maximize", [False, True])
def test_sgd_matches_torch(case, n, scalars, maximize):
    param, grads = randn(n, 1), _grads(n, 10, torch.bfloat16)
    ref = torch.nn.Parameter(param.clone())
    opt = torch.optim.SGD([ref], lr=0.05, foreach=False, maximize=maximize, **case)
    p, buf = param.clone(), torch.zeros_like(param)
    out = torch.empty(n, dtype=torch.bfloat16, device=DEVICE)
    for k, g in enumerate(grads, start=1):
        ref.grad = g.float() * 0.5
        opt.step()
        lr = torch.tensor(0.05, dtype=torch.float64, device=DEVICE) if scalars == "tensor" else 0.05
        step = torch.tensor(float(k), device=DEVICE) if scalars == "tensor" else k
        sgd_step_(p, g, buf, lr=lr, step=step, grad_scale=0.5, param_out=out, maximize=maximize, **case)
        assert last_backend("sgd_step_") is not Backend.TORCH
    assert_close_rel(p, ref.detach(), REL, f"sgd {case}")
    if case["momentum"]:
        assert_close_rel(buf, opt.state[ref]["momentum_buffer"], REL, "momentum buffer")
    assert_bitwise_equal(out, p.to(torch.bfloat16), "param_out")


def _paper_lion(p, g, m, lr, beta1, beta2, wd):
    """Algorithm 2 of the Lion paper (decoupled weight decay), written out independently of tritonshard."""
    c = beta1 * m + (1 - beta1) * g
    p_new = p - lr * (torch.sign(c) + wd * p)
    return p_new, beta2 * m + (1 - beta2) * g


@pytest.mark.parametrize("n", ODD_SIZES)
@pytest.mark.parametrize("backend", [None, "torch"])
def test_lion_matches_the_paper(n, backend):
    param, grads = randn(n, 2), _grads(n, 20, torch.bfloat16)
    p, m = param.clone(), torch.zeros_like(param)
    want_p, want_m = param.clone().double(), torch.zeros_like(param).double()
    for g in grads:
        lion_step_(p, g, m, lr=1e-3, beta1=0.9, beta2=0.99, weight_decay=0.1, backend=backend)
        want_p, want_m = _paper_lion(want_p, g.double(), want_m, 1e-3, 0.9, 0.99, 0.1)
    # the paper in float64 vs our fp32: 1 - lr*wd and the update differ by fp32 rounding only (sign() is exact
    # unless the interpolated momentum is within rounding of 0, which random data makes vanishingly rare)
    assert_close_rel(p, want_p, REL, "lion param")
    assert_close_rel(m, want_m, 1e-6, "lion exp_avg")


def test_lion_tensor_scalars_and_found_inf():
    n = 4099
    param, grads = randn(n, 3), _grads(n, 30, torch.float32)
    a, ma = param.clone(), torch.zeros_like(param)
    b, mb = param.clone(), torch.zeros_like(param)
    for g in grads:
        lion_step_(a, g, ma, lr=3e-3, weight_decay=0.05, grad_scale=0.25)
        lion_step_(b, g, mb, lr=torch.tensor(3e-3, dtype=torch.float64, device=DEVICE), weight_decay=0.05,
                   grad_scale=torch.tensor(0.25, device=DEVICE))
    assert_bitwise_equal(a, b, "number vs tensor lr/grad_scale")
    before = (a.clone(), ma.clone())
    lion_step_(a, grads[0], ma, lr=3e-3, found_inf=torch.ones(1, device=DEVICE))
    assert_bitwise_equal(a, before[0], "param under found_inf")
    assert_bitwise_equal(ma, before[1], "exp_avg under found_inf")
    ref_p, ref_m = param.clone(), torch.zeros_like(param)
    lion_step_ref(ref_p, grads[0], ref_m, lr=3e-3, found_inf=torch.ones(1, device=DEVICE))
    assert_bitwise_equal(ref_p, param, "reference under found_inf")


def test_sgd_first_step_is_read_on_the_device_and_found_inf_keeps_everything():
    n = 199
    param, g = randn(n, 4), randn(n, 5)
    p, buf = param.clone(), randn(n, 6)  # garbage in the buffer: step 1 must overwrite it
    sgd_step_(p, g, buf, lr=0.1, momentum=0.9, step=torch.ones((), device=DEVICE))
    assert_bitwise_equal(buf, g, "step 1 initializes the buffer with the gradient")
    before = (p.clone(), buf.clone())
    sgd_step_(p, g, buf, lr=0.1, momentum=0.9, step=2, found_inf=torch.ones(1, device=DEVICE))
    assert_bitwise_equal(p, before[0], "param")
    assert_bitwise_equal(buf, before[1], "momentum buffer")


@pytest.mark.parametrize("fn, kwargs, exc, match", [
    (sgd_step_, dict(lr=-0.1), ValueError, "lr must be >= 0"),
    (sgd_step_, dict(lr=0.1, momentum=0.9, nesterov=True, dampening=0.1), ValueError, "nesterov"),
    (sgd_step_, dict(lr=0.1, momentum=0.9, buf=None), TypeError, "momentum_buffer must be a torch.Tensor"),
    (lion_step_, dict(lr=0.1, beta1=1.5), ValueError, "beta1"),
    (lion_step_, dict(lr=0.1, weight_decay=torch.tensor(0.1)), TypeError, "weight_decay must be a Python number"),
])
def test_bad_input(fn, kwargs, exc, match):
    p, g, s = torch.zeros(8, device=DEVICE), torch.zeros(8, device=DEVICE), torch.zeros(8, device=DEVICE)
    if "buf" in kwargs:
        s = kwargs.pop("buf")
    with pytest.raises(exc, match=match):
        fn(p, g, s, **kwargs)
