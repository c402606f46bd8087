"""Muon's kernels against torch.optim.Muon's arithmetic, and newton_schulz against torch's own iteration.

The momentum and update kernels run on the device under test (the interpreter on CPU) and are compared with
torch.optim.Muon stepping an fp32 parameter with the same gradients, Newton-Schulz included (ours in between).
"""

import pytest
import torch

from tests.helpers import assert_bitwise_equal, assert_close_rel
from tests.kernels.common import DEVICE, ODD_SIZES, randn
from tritonshard.kernels import (Backend, adjusted_lr_ratio, last_backend, muon_momentum_, muon_momentum_ref,
                                 muon_update_, muon_update_ref, newton_schulz)

# torch's Muon module (torch >= 2.9; private name): the reference for the iteration and the lr adjustment
torch_muon = pytest.importorskip("torch.optim._muon", reason="torch.optim.Muon appeared in torch 2.9")

COEFS = (3.4445, -4.775, 2.0315)


@pytest.mark.parametrize("shape", [(1, 1), (5, 11), (19, 7), (64, 64), (3, 130)])
def test_newton_schulz_is_torch_muons_iteration(shape):
    # the same bf16 operations in the same order on the same device: bit for bit
    x = randn(shape[0] * shape[1], 3, torch.bfloat16).view(shape)
    # (torch's function divides a bf16 input in place: it gets a copy)
    expected = torch_muon._zeropower_via_newtonschulz(x.clone(), COEFS, 5, 1e-7)
    got = newton_schulz(x, COEFS, 5, 1e-7)
    assert got.shape == x.shape and got.dtype == torch.bfloat16
    assert_bitwise_equal(got, expected, f"NS {shape}")
    assert torch.equal(x, randn(shape[0] * shape[1], 3, torch.bfloat16).view(shape)), "the input is left alone"


def test_newton_schulz_orthogonalizes():
    # the property Muon relies on: singular values pushed into roughly [0.5, 1.5] (Keller Jordan's quintic)
    x = randn(32 * 48, 4).view(32, 48) * torch.linspace(0.01, 3.0, 48, device=DEVICE)
    s = torch.linalg.svdvals(newton_schulz(x, COEFS, 5, 1e-7).float())
    assert float(s.min()) > 0.3 and float(s.max()) < 1.6, s


@pytest.mark.parametrize("shape, fn, expected", [
    ((30, 10), None, 3 ** 0.5), ((10, 30), "original", 1.0), ((30, 10), "match_rms_adamw", 0.2 * 30 ** 0.5)])
def test_adjusted_lr_ratio_is_torchs(shape, fn, expected):
    assert adjusted_lr_ratio(fn, shape) == pytest.approx(expected, rel=1e-15)
    assert adjusted_lr_ratio(fn, shape) * 0.02 == torch_muon._adjust_lr(0.02, fn, torch.Size(shape))


@pytest.mark.parametrize("n", ODD_SIZES)
@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("scalars", ["number", "tensor"])
def test_momentum_kernel_matches_reference(n, nesterov, scalars):
    g, b0 = randn(n, 1, torch.bfloat16), randn(n, 2, scale=0.1)
    runs = []
    for fn in (muon_momentum_, muon_momentum_ref):
        b, u = b0.clone(), torch.full((n,), 7.0, dtype=torch.bfloat16, device=DEVICE)
        gs = torch.tensor(0.25, device=DEVICE) if scalars == "tensor" else 0.25
        fn(g, b, u, momentum=0.95, nesterov=nesterov, grad_scale=gs)
        if fn is muon_momentum_ and n:
            assert last_backend("muon_momentum_") is not Backend.TORCH
        runs.append((b, u))
    (bk, uk), (br, ur) = runs
    # the same fp32 formula (torch's lerp); FMA contraction moves a result by an ulp at most
    assert_close_rel(bk, br, 1e-6, "momentum")
    assert_close_rel(uk.float(), ur.float(), 2 ** -8, "bf16 NS input")


@pytest.mark.parametrize("n", ODD_SIZES)
@pytest.mark.parametrize("remainders", [False, True])
def test_update_kernel_matches_reference(n, remainders):
    from tritonshard.kernels.rounding import split_bf16_remainder
    p0, u = randn(n, 1), randn(n, 2, torch.bfloat16, scale=0.05)
    lr = torch.tensor(0.02, dtype=torch.float64, device=DEVICE)
    p_ref, out_ref = p0.clone(), torch.empty(n, dtype=torch.bfloat16, device=DEVICE)
    muon_update_ref(p_ref, u, lr=lr, weight_decay=0.1, lr_ratio=1.7, param_out=out_ref)
    out = torch.empty(n, dtype=torch.bfloat16, device=DEVICE)
    if remainders:
        out, rem = split_bf16_remainder(p0)
        muon_update_(rem, u, lr=lr, weight_decay=0.1, lr_ratio=1.7, param_out=out, remainders=True)
        from tritonshard.kernels.rounding import combine_bf16_remainder
        p = combine_bf16_remainder(out, rem)
    else:
        p = p0.clone()
        muon_update_(p, u, lr=lr, weight_decay=0.1, lr_ratio=1.7, param_out=out)
    assert_close_rel(p, p_ref, 1e-6, "master")
    if not remainders:
        assert_bitwise_equal(out, p.to(torch.bfloat16), "param_out is the master rounded to nearest even")


def test_kernels_follow_torch_muon_over_steps():
    # three steps of torch.optim.Muon on an fp32 matrix vs the two kernels with our NS in between
    rows, cols = 19, 7
    ref = torch.nn.Parameter(randn(rows * cols, 1).view(rows, cols).clone())
    opt = torch.optim.Muon([ref], lr=0.02, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    p, buf = ref.detach().clone().reshape(-1), torch.zeros(rows * cols, device=DEVICE)
    work = torch.empty(rows * cols, dtype=torch.bfloat16, device=DEVICE)
    for k in range(3):
        g = randn(rows * cols, 10 + k, torch.bfloat16)
        ref.grad = g.float().view(rows, cols)
        opt.step()
        muon_momentum_(g, buf, work, momentum=0.95, nesterov=True)
        work.view(rows, cols).copy_(newton_schulz(work.view(rows, cols), COEFS, 5, 1e-7))
        muon_update_(p, work, lr=0.02, weight_decay=0.1, lr_ratio=adjusted_lr_ratio("match_rms_adamw", (rows, cols)))
    assert_close_rel(buf, opt.state[ref]["momentum_buffer"].reshape(-1), 1e-6, "momentum")
    # a one-ulp difference in a bf16 NS input moves that step's update by 2^-8 of lr * ratio * |O| at most
    assert_close_rel(p, ref.detach().reshape(-1), 1e-5, "master")


def test_found_inf_leaves_everything():
    n = 199
    g, b, u, p = randn(n, 1, torch.bfloat16), randn(n, 2), randn(n, 3, torch.bfloat16), randn(n, 4)
    out = randn(n, 5, torch.bfloat16)
    before = [t.clone() for t in (b, u, p, out)]
    flag = torch.ones(1, device=DEVICE)
    muon_momentum_(g, b, u, momentum=0.9, found_inf=flag)
    muon_update_(p, u, lr=0.1, weight_decay=0.1, found_inf=flag, param_out=out)
    for t, t0, what in zip((b, u, p, out), before, ("momentum", "update", "master", "param_out")):
        assert_bitwise_equal(t, t0, what)


def test_bf16_momentum_rounds_like_the_other_states():
    n = 4099
    g, b0 = randn(n, 1, torch.bfloat16), randn(n, 2, torch.bfloat16, scale=0.1)
    bk, br = b0.clone(), b0.clone()
    uk, ur = (torch.empty(n, dtype=torch.bfloat16, device=DEVICE) for _ in range(2))
    muon_momentum_(g, bk, uk, momentum=0.9, state_rounding="nearest")
    muon_momentum_ref(g, br, ur, momentum=0.9)
    assert_close_rel(bk.float(), br.float(), 2 ** -8, "bf16 momentum, nearest")
    seed = torch.full((1,), 1234, dtype=torch.int64, device=DEVICE)
    bs = b0.clone()
    muon_momentum_(g, bs, uk, momentum=0.9, state_rounding="stochastic", seed=seed)
    exact = b0.float() + 0.1 * (g.float() - b0.float())
    # Stochastic rounding lands on one of the two bf16 neighbours of the kernel's fp32 value v, so within one bf16
    # ulp (<= 2^-7 |v|) of v. v itself is `exact` computed in another fp32 op order (fused on a GPU): a few fp32
    # roundings of the operands' size, |v - exact| <= e = 2^-21 (|b0| + 0.1 |g| + |exact|). Bounding by |exact|
    # alone failed on the H200 (2026-11-30), where an exact 0.0 came out as -9.3e-10. Landing two bf16 ulps away
    # (a wrong rounding) exceeds the bound.
    e = 2 ** -21 * (b0.float().abs() + 0.1 * g.float().abs() + exact.abs())
    assert bool(((bs.float() - exact).abs() <= 2 ** -7 * (exact.abs() + e) + e).all())
    assert not torch.equal(bs, bk), "stochastic rounding differs from nearest somewhere in 4099 elements"


@pytest.mark.parametrize("call, match", [
    (lambda g, b, u: muon_momentum_(g, b, u, momentum=1.0), "momentum must be"),
    (lambda g, b, u: muon_momentum_(g, b, u.float(), momentum=0.9), "update_out must be torch.bfloat16"),
    (lambda g, b, u: muon_momentum_(g, b[:-1], u, momentum=0.9), "momentum_buffer has 6 elements"),
    (lambda g, b, u: muon_update_(b, u, lr=-1.0), "lr must be"),
    (lambda g, b, u: muon_update_(b, u, lr=0.1, lr_ratio=torch.ones(())), "lr_ratio must be a Python number"),
    (lambda g, b, u: muon_update_(b.bfloat16(), u, lr=0.1), "param must be torch.float32"),
    # one tensor in two roles (until session 49 the pass wrote over what it read)
    (lambda g, b, u: muon_momentum_(g, b, g, momentum=0.9), "grad and update_out share memory|update_out and grad"),
    (lambda g, b, u: muon_update_(b, u, lr=0.1, param_out=u), "update and param_out share memory|param_out and up"),
])
def test_bad_arguments(call, match):
    g, b, u = randn(7, 1, torch.bfloat16), randn(7, 2), torch.empty(7, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises((ValueError, TypeError), match=match):
        call(g, b, u)
