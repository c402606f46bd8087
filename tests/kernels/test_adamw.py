"""adamw_step_ against torch.optim.AdamW(foreach=False), found_inf, param_out, scalar kinds, bad input."""

import pytest
import torch

from tests.helpers import assert_bitwise_equal, assert_close_rel
from tests.kernels.common import DEVICE, ODD_SIZES, randn
from tritonshard.kernels import Backend, adamw_step_, adamw_step_ref, last_backend

# Both sides do the same fp32 operations in the same order; differences come from torch's vectorized CPU/GPU
# kernels (FMA contraction, sqrt/div implementations): a few ulps (~2e-7 relative) per step of the update,
# accumulated over STEPS=5 steps, stays far below 1e-6 of max|param|.
REL = 1e-6
STEPS = 5


def _state(n, seed, grad_dtype):
    param = randn(n, seed, scale=1.0)
    grads = [randn(n, seed + 100 + k, grad_dtype, scale=0.1 * (k + 1)) for k in range(STEPS)]
    return param, grads


def _run_torch(param, grads, grad_scale, hp, maximize):
    p = torch.nn.Parameter(param.clone())
    opt = torch.optim.AdamW([p], lr=hp["lr"], betas=(hp["beta1"], hp["beta2"]), eps=hp["eps"],
                            weight_decay=hp["weight_decay"], foreach=False, maximize=maximize)
    for g in grads:
        p.grad = g.float() * grad_scale
        opt.step()
    st = opt.state[p]
    return p.detach(), st["exp_avg"], st["exp_avg_sq"]


def _run_ours(param, grads, grad_scale, hp, maximize, scalar_kind, backend=None, param_out=None):
    p = param.clone()
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    for k, g in enumerate(grads, start=1):
        if scalar_kind == "tensor":
            # float64 lr tensor: an fp32 one would hold a different number than the Python float 1e-3
            lr = torch.tensor(hp["lr"], dtype=torch.float64, device=DEVICE)
            step = torch.tensor(float(k), device=DEVICE)
            gs = torch.tensor(grad_scale, device=DEVICE)
        else:
            lr, step, gs = hp["lr"], k, grad_scale
        adamw_step_(p, g, m, v, lr=lr, beta1=hp["beta1"], beta2=hp["beta2"], eps=hp["eps"],
                    weight_decay=hp["weight_decay"], step=step, grad_scale=gs, maximize=maximize,
                    param_out=param_out, backend=backend)
    return p, m, v


HPARAMS = [
    dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=1e-2),
    dict(lr=3e-2, beta1=0.3, beta2=0.95, eps=1e-6, weight_decay=0.1),  # 1 - beta1 >= 0.5: torch.lerp's other branch
]


@pytest.mark.parametrize("n", [1, 199, 4099, 3 * 4096 + 5])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scalar_kind", ["number", "tensor"])
def test_matches_torch_adamw_over_several_steps(n, grad_dtype, scalar_kind):
    param, grads = _state(n, n, grad_dtype)
    hp = HPARAMS[0]
    want = _run_torch(param, grads, 1.0, hp, maximize=False)
    got = _run_ours(param, grads, 1.0, hp, False, scalar_kind)
    assert last_backend("adamw_step_") is not Backend.TORCH
    for name, a, b in zip(("param", "exp_avg", "exp_avg_sq"), got, want):
        assert_close_rel(a, b, REL, f"{name} n={n} grad={grad_dtype} {scalar_kind}")


@pytest.mark.parametrize("hp", HPARAMS)
@pytest.mark.parametrize("maximize", [False, True])
@pytest.mark.parametrize("backend", [None, "torch"])
def test_hyperparameters_grad_scale_and_maximize(hp, maximize, backend):
    param, grads = _state(1000, 7, torch.bfloat16)
    want = _run_torch(param, grads, 0.25, hp, maximize)
    got = _run_ours(param, grads, 0.25, hp, maximize, "number", backend=backend)
    for name, a, b in zip(("param", "exp_avg", "exp_avg_sq"), got, want):
        assert_close_rel(a, b, REL, f"{name} {hp} maximize={maximize} backend={backend}")


def test_tensor_and_number_scalars_give_identical_bits():
    # the coefficients are computed in float64 either way, then rounded once to fp32
    param, grads = _state(4099, 3, torch.bfloat16)
    a = _run_ours(param, grads, 0.5, HPARAMS[0], False, "number")
    b = _run_ours(param, grads, 0.5, HPARAMS[0], False, "tensor")
    for x, y in zip(a, b):
        assert_bitwise_equal(x, y, "number vs tensor lr/step/grad_scale")


@pytest.mark.parametrize("n", ODD_SIZES)
def test_param_out_is_the_rounded_param(n):
    param, grads = _state(n, 5, torch.bfloat16)
    out = torch.empty(n, dtype=torch.bfloat16, device=DEVICE)
    p, _, _ = _run_ours(param, grads[:2], 1.0, HPARAMS[0], False, "number", param_out=out)
    assert_bitwise_equal(out, p.to(torch.bfloat16), "param_out")


@pytest.mark.parametrize("backend", [None, "torch"])
def test_found_inf_writes_nothing(backend):
    n = 4099
    param, grads = _state(n, 9, torch.bfloat16)
    p, m, v = param.clone(), randn(n, 1).abs(), randn(n, 2).abs()
    out = randn(n, 3, torch.bfloat16)
    before = [t.clone() for t in (p, m, v, out)]
    grad = grads[0].clone()
    grad[17] = float("inf")
    for found in (torch.ones(1, device=DEVICE), torch.tensor(2.0, device=DEVICE)):
        adamw_step_(p, grad, m, v, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, step=3,
                    found_inf=found, param_out=out, backend=backend)
        for name, a, b in zip(("param", "exp_avg", "exp_avg_sq", "param_out"), (p, m, v, out), before):
            assert_bitwise_equal(a, b, f"{name} with found_inf={float(found)}")
    # a zero flag is the same as no flag
    q, m2, v2 = param.clone(), before[1].clone(), before[2].clone()
    adamw_step_(p, grads[0], m, v, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, step=3,
                found_inf=torch.zeros(1, device=DEVICE), backend=backend)
    adamw_step_(q, grads[0], m2, v2, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, step=3,
                backend=backend)
    assert_bitwise_equal(p, q, "found_inf=0 vs None")


def test_empty_shard():
    e = torch.empty(0, device=DEVICE)
    adamw_step_(e, e, e.clone(), e.clone(), lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, step=1)


def _call(**overrides):
    n = 8
    args = dict(param=torch.zeros(n), grad=torch.zeros(n, dtype=torch.bfloat16), exp_avg=torch.zeros(n),
                exp_avg_sq=torch.zeros(n))
    kw = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, step=1)
    for k, v in overrides.items():
        (args if k in args else kw)[k] = v
    # a strided case is built on the device (a callable): moving a strided CPU tensor to a GPU gives a contiguous
    # copy, so the check would see nothing there (the GPU run of 2026-11-30 caught that)
    args = {k: (v(DEVICE) if callable(v) else v.to(DEVICE) if isinstance(v, torch.Tensor) and v.device.type != "meta"
                else v) for k, v in args.items()}
    adamw_step_(args["param"], args["grad"], args["exp_avg"], args["exp_avg_sq"], **kw)


@pytest.mark.parametrize("overrides, exc, match", [
    (dict(param=torch.zeros(8, dtype=torch.bfloat16)), TypeError, "param must be float32"),
    (dict(exp_avg=torch.zeros(8, dtype=torch.float64)), TypeError, "exp_avg must be float32"),
    (dict(grad=torch.zeros(8, dtype=torch.int32)), TypeError, "grad must be"),
    (dict(exp_avg_sq=torch.zeros(9)), ValueError, "exp_avg_sq has 9 elements"),
    (dict(grad=lambda device: torch.zeros(16, device=device)[::2]), ValueError, "grad must be contiguous"),
    (dict(exp_avg=torch.zeros(8, device="meta")), ValueError, "exp_avg is on meta"),
    (dict(param_out=torch.zeros(8)), TypeError, "param_out must be bfloat16"),
    (dict(lr=-1.0), ValueError, "lr must be >= 0"),
    (dict(beta1=1.0), ValueError, "beta1 must be >= 0.0 and < 1.0"),
    (dict(beta2=-0.1), ValueError, "beta2"),
    (dict(eps=-1e-8), ValueError, "eps"),
    (dict(weight_decay=-0.1), ValueError, "weight_decay"),
    (dict(step=0), ValueError, "step must be >= 1"),
    (dict(lr=torch.ones(2)), ValueError, "lr must be a number or a 1-element tensor"),
    (dict(beta1=torch.tensor(0.9)), TypeError, "beta1 must be a Python number"),
    (dict(found_inf=torch.zeros(2)), ValueError, "found_inf"),
    (dict(lr="0.1"), TypeError, "lr must be a number"),
])
def test_bad_input(overrides, exc, match):
    with pytest.raises(exc, match=match):
        _call(**overrides)


def test_tensors_that_share_memory_are_refused():
    """Each element of every input is read and the outputs written in one pass: an update over tensors that share
    bytes leaves values that are no update's (until session 49 nothing said so). Each pair that can be mixed up,
    also partly overlapping views of one buffer, and param_out; distinct views of one buffer are fine."""
    n = 8
    kw = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, step=1)
    flat = torch.zeros(4 * n, device=DEVICE)
    grad = torch.randn(n, device=DEVICE).to(torch.bfloat16)
    with pytest.raises(ValueError, match="exp_avg and param share memory"):
        adamw_step_(flat[:n], grad, flat[:n], flat[n:2 * n], **kw)
    with pytest.raises(ValueError, match="exp_avg and exp_avg_sq share memory|exp_avg_sq and exp_avg share memory"):
        adamw_step_(flat[:n], grad, flat[n:2 * n], flat[n + 1:2 * n + 1], **kw)
    with pytest.raises(ValueError, match="grad and param_out share memory|param_out and grad share memory"):
        adamw_step_(flat[:n], grad, flat[n:2 * n], flat[2 * n:3 * n], param_out=grad, **kw)
    adamw_step_(flat[:n], grad, flat[n:2 * n], flat[2 * n:3 * n], **kw)  # (adjacent, not shared)
    assert bool(flat[:n].ne(0).any())


def test_reference_matches_torch_too():
    param, grads = _state(500, 21, torch.float32)
    want = _run_torch(param, grads, 1.0, HPARAMS[1], False)
    p, m, v = param.clone(), torch.zeros(500, device=DEVICE), torch.zeros(500, device=DEVICE)
    for k, g in enumerate(grads, 1):
        adamw_step_ref(p, g, m, v, step=k, **HPARAMS[1])
    for name, a, b in zip(("param", "exp_avg", "exp_avg_sq"), (p, m, v), want):
        assert_close_rel(a, b, REL, f"reference {name}")


@pytest.mark.parametrize("n", [1, 4099])
def test_fp16_param_out_is_the_rounded_param(n):
    param, grads = _state(n, 8, torch.float16)
    out = torch.empty(n, dtype=torch.float16, device=DEVICE)
    p, _, _ = _run_ours(param * 300, grads[:2], 1.0, HPARAMS[0], False, "number", param_out=out)
    assert_bitwise_equal(out, p.to(torch.float16), "fp16 param_out")


@pytest.mark.parametrize("backend", [None, "torch"])
def test_precomputed_coefficients_give_identical_bits(backend):
    # what ShardedAdamW does: adamw_coefficients once per param group and step, passed to every bucket's launch
    from tritonshard.kernels import adamw_coefficients
    n = 4099
    runs = []
    for shared in (False, True):
        p, m, v = randn(n, 1), torch.zeros(n, device=DEVICE), torch.zeros(n, device=DEVICE)
        for k in range(1, 4):
            step = torch.tensor(float(k), device=DEVICE)
            lr = torch.tensor(1e-2 / k, dtype=torch.float64, device=DEVICE)
            coef = adamw_coefficients(lr, step, 0.9, 0.95, 0.1) if shared else None
            adamw_step_(p, randn(n, 10 + k, torch.bfloat16), m, v, lr=lr, beta1=0.9, beta2=0.95, eps=1e-8,
                        weight_decay=0.1, step=step, coefficients=coef, backend=backend)
        runs.append((p, m, v))
    for x, y in zip(*runs):
        assert_bitwise_equal(x, y, "shared coefficients vs computed per launch")
    with pytest.raises(ValueError, match="coefficients must be adamw_coefficients"):
        adamw_step_(p, p.bfloat16(), m, v, lr=0.1, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, step=1,
                    coefficients=torch.zeros(2, device=DEVICE))
