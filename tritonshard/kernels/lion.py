"""Fused Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms") on a flat fp32 master shard.

The paper's update, with decoupled weight decay::

    g  = grad * grad_scale                      (then -g if maximize)
    p *= 1 - lr * weight_decay
    p += -lr * sign(beta1 * m + (1 - beta1) * g)
    m  = beta2 * m + (1 - beta2) * g

One state tensor (``exp_avg``); ``found_inf`` masks every store.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import (check_no_tensor, check_rounding, check_scalar, host_seed, keep_old_where_found_inf,
                      master_view, pack_coefficients, seed_tensor, validate_update)
from ._launch import cdiv
from ._dispatch import Backend, select_backend, traced
from ._update_jit import (load_grad, load_param, load_state, program_block, scalar_arg, segment_numel, segment_ptr,
                          stochastic_bits, store_param, store_state, update_mask)

__all__ = ["lion_step_", "lion_step_ref"]

BLOCK = 2048


@triton.jit
def _lion_kernel(param_ptr, grad_ptr, exp_avg_ptr, param_out_ptr, n, coef_ptr, decay, neg_lr,
                 grad_scale_ptr, grad_scale_val, found_inf_ptr, seed_ptr, beta1, one_minus_beta1, beta2,
                 one_minus_beta2, sched_ptr, segs_ptr, COEF_IS_TENSOR: tl.constexpr,
                 GRAD_SCALE_IS_TENSOR: tl.constexpr, HAS_FOUND_INF: tl.constexpr, HAS_PARAM_OUT: tl.constexpr,
                 MAXIMIZE: tl.constexpr, REMAINDER: tl.constexpr, STOCHASTIC: tl.constexpr, MULTI: tl.constexpr,
                 BLOCK: tl.constexpr):
    seg, start = program_block(sched_ptr, BLOCK, MULTI)  # (see _update_jit: segmented launches)
    param_ptr = segment_ptr(param_ptr, segs_ptr, seg, 0, MULTI)
    grad_ptr = segment_ptr(grad_ptr, segs_ptr, seg, 1, MULTI)
    exp_avg_ptr = segment_ptr(exp_avg_ptr, segs_ptr, seg, 2, MULTI)
    param_out_ptr = segment_ptr(param_out_ptr, segs_ptr, seg, 3, MULTI)
    seed_ptr = segment_ptr(seed_ptr, segs_ptr, seg, 4, MULTI, False)
    n = segment_numel(segs_ptr, seg, n, MULTI)
    offs = start + tl.arange(0, BLOCK)
    mask = update_mask(offs, n, found_inf_ptr, HAS_FOUND_INF)
    if COEF_IS_TENSOR:
        decay = tl.load(coef_ptr)
        neg_lr = tl.load(coef_ptr + 1)
    g = load_grad(grad_ptr, offs, mask, scalar_arg(grad_scale_ptr, grad_scale_val, GRAD_SCALE_IS_TENSOR), MAXIMIZE)
    p = load_param(param_ptr, param_out_ptr, offs, mask, REMAINDER)
    m = load_state(exp_avg_ptr, offs, mask)
    bits = stochastic_bits(seed_ptr, start, BLOCK, STOCHASTIC)
    c = m * beta1 + one_minus_beta1 * g
    update = tl.where(c > 0, 1.0, tl.where(c < 0, -1.0, 0.0))
    p = p * decay + neg_lr * update
    store_state(exp_avg_ptr, offs, mask, m * beta2 + one_minus_beta2 * g, bits, 0, STOCHASTIC)
    store_param(param_ptr, param_out_ptr, offs, mask, p, HAS_PARAM_OUT, REMAINDER)


def _coefficients(lr, weight_decay, device):
    lr64 = lr.to(torch.float64).reshape(()) if isinstance(lr, torch.Tensor) else lr
    return pack_coefficients([1.0 - lr64 * weight_decay, -lr64], device)


def lion_step_ref(param, grad, exp_avg, *, lr, beta1=0.9, beta2=0.99, weight_decay=0.0, grad_scale=1.0,
                  found_inf=None, param_out=None, maximize=False, state_rounding="nearest", seed=None) -> None:
    """Pure-PyTorch reference (and the CPU fallback), sync-free."""
    coef, values = _coefficients(lr, weight_decay, param.device)
    decay, neg_lr = (coef[0], coef[1]) if coef is not None else values
    gs = grad_scale.float() if isinstance(grad_scale, torch.Tensor) else grad_scale
    g = grad.float() * gs
    if maximize:
        g = -g
    m = exp_avg.float()
    update = (m * beta1 + (1 - beta1) * g).sign()
    p = param * decay + neg_lr * update
    pairs = [(exp_avg, m * beta2 + (1 - beta2) * g), (param, p)]
    if param_out is not None:
        pairs.append((param_out, p))
    keep_old_where_found_inf(found_inf, pairs, host_seed(seed) if state_rounding == "stochastic" else None, states=1)


@traced
def lion_step_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, *, lr, beta1: float = 0.9,
               beta2: float = 0.99, weight_decay: float = 0.0, grad_scale=1.0, found_inf: torch.Tensor | None = None,
               param_out: torch.Tensor | None = None, maximize: bool = False, remainders: bool = False,
               state_rounding: str = "nearest", seed=None, backend: str | None = None) -> None:
    """One Lion step over a flat shard, in place (see the module docstring)."""
    validate_update(param, grad, [("exp_avg", exp_avg)], found_inf, param_out, grad_scale, remainders)
    check_no_tensor(beta1=beta1, beta2=beta2, weight_decay=weight_decay)
    check_scalar("lr", lr, param.device, 0.0)
    check_scalar("beta1", beta1, param.device, 0.0, hi=1.0)
    check_scalar("beta2", beta2, param.device, 0.0, hi=1.0)
    check_scalar("weight_decay", weight_decay, param.device, 0.0)
    check_rounding(state_rounding, seed, param.device)
    chosen = select_backend("lion_step_", param.device, backend)
    if chosen is Backend.TORCH:
        with master_view(param, param_out, remainders) as (master, out):
            lion_step_ref(master, grad, exp_avg, lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay,
                          grad_scale=grad_scale, found_inf=found_inf, param_out=out, maximize=maximize,
                          state_rounding=state_rounding, seed=seed)
        return
    n = param.numel()
    if n == 0:
        return
    coef, values = _coefficients(lr, weight_decay, param.device)
    kernel, grid, args, kwargs = launch_spec(
        param, grad, exp_avg, coef, values, grad_scale, found_inf, param_out,
        seed_tensor(seed, param.device) if state_rounding == "stochastic" else None, beta1, beta2, maximize,
        remainders)
    kernel[grid](*args, **kwargs)


def lion_coefficients(lr, weight_decay, device):
    """[1 - lr*wd, -lr] (float64 math, fp32), as a device tensor when lr is one (see pack_coefficients)."""
    return _coefficients(lr, weight_decay, device)


#: segmented launches (see adamw.SEGMENTS): param, grad, exp_avg, param_out; the Philox key
SEGMENTS = dict(vector=(0, 1, 2, 3), scalar=(11,), numel=4, tables=16)


def launch_spec(param, grad, exp_avg, coef, values, grad_scale, found_inf, param_out, seed, beta1, beta2, maximize,
                remainders) -> tuple:
    """(kernel, grid, args, kwargs) of one :func:`lion_step_` launch, unchecked (see adamw.launch_spec)."""
    decay, neg_lr = values if values is not None else (1.0, 0.0)
    gs = isinstance(grad_scale, torch.Tensor)
    args = (param, grad, exp_avg, param_out if param_out is not None else param, param.numel(),
            coef if coef is not None else param, float(decay), float(neg_lr),
            grad_scale if gs else param, 1.0 if gs else float(grad_scale), found_inf if found_inf is not None else param,
            seed if seed is not None else param, float(beta1), float(1 - beta1), float(beta2), float(1 - beta2),
            param, param)
    kwargs = dict(COEF_IS_TENSOR=coef is not None, GRAD_SCALE_IS_TENSOR=gs, HAS_FOUND_INF=found_inf is not None,
                  HAS_PARAM_OUT=param_out is not None, MAXIMIZE=bool(maximize), REMAINDER=remainders,
                  STOCHASTIC=seed is not None, MULTI=False, BLOCK=BLOCK, enable_fp_fusion=True)
    return _lion_kernel, (cdiv(param.numel(), BLOCK),), args, kwargs
