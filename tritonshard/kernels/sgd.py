"""Fused SGD (momentum, dampening, Nesterov, weight decay) on a flat fp32 master shard, writing bf16 weights.

Semantics are ``torch.optim.SGD`` (``foreach=False``), in its order of operations::

    g  = grad * grad_scale                      (then -g if maximize)
    d  = g + weight_decay * p                   (coupled L2, as torch.optim.SGD)
    b  = d                       if step == 1   (the first step initializes the momentum buffer)
    b  = b * momentum + (1 - dampening) * d     otherwise
    d  = d + momentum * b  if nesterov else b
    p += -lr * d

``step`` (number or device tensor, counted from 1 and not advanced by skipped steps) tells the first step on the
device, so a skipped first step leaves the buffer uninitialized, as torch would. ``found_inf`` masks every store.
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

__all__ = ["sgd_step_", "sgd_step_ref"]

BLOCK = 2048


@triton.jit
def _sgd_kernel(param_ptr, grad_ptr, buf_ptr, param_out_ptr, n, coef_ptr, neg_lr, step_ptr, step_val,
                grad_scale_ptr, grad_scale_val, found_inf_ptr, seed_ptr, momentum, one_minus_dampening,
                weight_decay, sched_ptr, segs_ptr, COEF_IS_TENSOR: tl.constexpr, STEP_IS_TENSOR: tl.constexpr,
                GRAD_SCALE_IS_TENSOR: tl.constexpr, HAS_FOUND_INF: tl.constexpr, HAS_PARAM_OUT: tl.constexpr,
                HAS_WEIGHT_DECAY: tl.constexpr, HAS_MOMENTUM: tl.constexpr, NESTEROV: tl.constexpr,
                MAXIMIZE: tl.constexpr, REMAINDER: tl.constexpr, STOCHASTIC: tl.constexpr, MULTI: tl.constexpr,
                BLOCK: tl.constexpr):
    seg, start = program_block(sched_ptr, BLOCK, MULTI)  # (see _update_jit: segmented launches)
    param_ptr = segment_ptr(param_ptr, segs_ptr, seg, 0, MULTI)
    grad_ptr = segment_ptr(grad_ptr, segs_ptr, seg, 1, MULTI)
    buf_ptr = segment_ptr(buf_ptr, segs_ptr, seg, 2, MULTI)
    param_out_ptr = segment_ptr(param_out_ptr, segs_ptr, seg, 3, MULTI)
    seed_ptr = segment_ptr(seed_ptr, segs_ptr, seg, 4, MULTI, False)
    n = segment_numel(segs_ptr, seg, n, MULTI)
    offs = start + tl.arange(0, BLOCK)
    mask = update_mask(offs, n, found_inf_ptr, HAS_FOUND_INF)
    neg_lr = scalar_arg(coef_ptr, neg_lr, COEF_IS_TENSOR)
    g = load_grad(grad_ptr, offs, mask, scalar_arg(grad_scale_ptr, grad_scale_val, GRAD_SCALE_IS_TENSOR), MAXIMIZE)
    p = load_param(param_ptr, param_out_ptr, offs, mask, REMAINDER)
    d = g
    if HAS_WEIGHT_DECAY:
        d = d + weight_decay * p
    if HAS_MOMENTUM:
        first = scalar_arg(step_ptr, step_val, STEP_IS_TENSOR) == 1.0
        bits = stochastic_bits(seed_ptr, start, BLOCK, STOCHASTIC)
        b = load_state(buf_ptr, offs, mask)
        b = tl.where(first, d, b * momentum + one_minus_dampening * d)
        store_state(buf_ptr, offs, mask, b, bits, 0, STOCHASTIC)
        if NESTEROV:
            d = d + momentum * b
        else:
            d = b
    store_param(param_ptr, param_out_ptr, offs, mask, p + neg_lr * d, HAS_PARAM_OUT, REMAINDER)


def sgd_step_ref(param, grad, momentum_buffer, *, lr, momentum=0.0, dampening=0.0, weight_decay=0.0,
                 nesterov=False, step=1, grad_scale=1.0, found_inf=None, param_out=None, maximize=False,
                 state_rounding="nearest", seed=None) -> None:
    """Pure-PyTorch reference (and the CPU fallback), torch.optim.SGD's single-tensor arithmetic, sync-free."""
    coef, values = pack_coefficients([-(lr.to(torch.float64) if isinstance(lr, torch.Tensor) else lr)], param.device)
    neg_lr = coef[0] if coef is not None else values[0]
    gs = grad_scale.float() if isinstance(grad_scale, torch.Tensor) else grad_scale
    d = grad.float() * gs
    if maximize:
        d = -d
    if weight_decay != 0:
        d = d + weight_decay * param
    pairs = []
    if momentum != 0:
        first = (step.reshape(()) == 1) if isinstance(step, torch.Tensor) else step == 1
        b = torch.where(torch.as_tensor(first, device=param.device), d, momentum_buffer.float() * momentum +
                        (1 - dampening) * d)
        pairs.append((momentum_buffer, b))
        d = d + momentum * b if nesterov else b
    p = param + neg_lr * d
    pairs.append((param, p))
    if param_out is not None:
        pairs.append((param_out, p))
    keep_old_where_found_inf(found_inf, pairs, host_seed(seed) if state_rounding == "stochastic" else None,
                             states=1 if momentum != 0 else 0)


@traced
def sgd_step_(param: torch.Tensor, grad: torch.Tensor, momentum_buffer: torch.Tensor | None, *, lr,
              momentum: float = 0.0, dampening: float = 0.0, weight_decay: float = 0.0, nesterov: bool = False,
              step=1, grad_scale=1.0, found_inf: torch.Tensor | None = None, param_out: torch.Tensor | None = None,
              maximize: bool = False, remainders: bool = False, state_rounding: str = "nearest",
              seed=None, backend: str | None = None) -> None:
    """One SGD step over a flat shard, in place (see the module docstring). ``momentum_buffer`` (fp32 or bf16,
    see adamw_step_ for ``state_rounding``/``seed``) is required when ``momentum != 0`` and ignored otherwise."""
    states = [("momentum_buffer", momentum_buffer)] if momentum != 0 else []
    validate_update(param, grad, states, found_inf, param_out, grad_scale, remainders)
    check_no_tensor(momentum=momentum, dampening=dampening, weight_decay=weight_decay)
    check_scalar("lr", lr, param.device, 0.0)
    check_scalar("step", step, param.device, 1.0)
    check_scalar("momentum", momentum, param.device, 0.0)
    check_scalar("dampening", dampening, param.device, -float("inf"))
    check_scalar("weight_decay", weight_decay, param.device, 0.0)
    if nesterov and (momentum <= 0 or dampening != 0):
        raise ValueError("nesterov=True requires momentum > 0 and dampening == 0")
    check_rounding(state_rounding, seed, param.device)
    chosen = select_backend("sgd_step_", param.device, backend)
    if chosen is Backend.TORCH:
        with master_view(param, param_out, remainders) as (master, out):
            sgd_step_ref(master, grad, momentum_buffer, lr=lr, momentum=momentum, dampening=dampening,
                         weight_decay=weight_decay, nesterov=nesterov, step=step, grad_scale=grad_scale,
                         found_inf=found_inf, param_out=out, maximize=maximize, state_rounding=state_rounding,
                         seed=seed)
        return
    n = param.numel()
    if n == 0:
        return
    coef, values = sgd_coefficients(lr, param.device)
    kernel, grid, args, kwargs = launch_spec(
        param, grad, momentum_buffer, coef, values, step, grad_scale, found_inf, param_out,
        seed_tensor(seed, param.device) if state_rounding == "stochastic" else None, momentum, dampening,
        weight_decay, nesterov, maximize, remainders)
    kernel[grid](*args, **kwargs)


def sgd_coefficients(lr, device):
    """(fp32 device tensor [-lr], None) for a tensor lr, else (None, (-lr,)): see pack_coefficients."""
    return pack_coefficients([-(lr.to(torch.float64) if isinstance(lr, torch.Tensor) else lr)], device)


#: segmented launches (see adamw.SEGMENTS): param, grad, momentum_buffer, param_out; the Philox key
SEGMENTS = dict(vector=(0, 1, 2, 3), scalar=(12,), numel=4, tables=16)


def launch_spec(param, grad, momentum_buffer, coef, values, step, grad_scale, found_inf, param_out, seed, momentum,
                dampening, weight_decay, nesterov, maximize, remainders) -> tuple:
    """(kernel, grid, args, kwargs) of one :func:`sgd_step_` launch, unchecked (see adamw.launch_spec): ``coef``
    the [-lr] tensor of :func:`sgd_coefficients` or None (then ``values``), ``seed`` a tensor or None."""
    st, gs = isinstance(step, torch.Tensor), isinstance(grad_scale, torch.Tensor)
    args = (param, grad, momentum_buffer if momentum != 0 else param, param_out if param_out is not None else param,
            param.numel(), coef if coef is not None else param, values[0] if values else 0.0,
            step if st else param, 0.0 if st else float(step), grad_scale if gs else param,
            1.0 if gs else float(grad_scale), found_inf if found_inf is not None else param,
            seed if seed is not None else param, float(momentum), float(1 - dampening), float(weight_decay), param,
            param)
    kwargs = dict(COEF_IS_TENSOR=coef is not None, STEP_IS_TENSOR=st, GRAD_SCALE_IS_TENSOR=gs,
                  HAS_FOUND_INF=found_inf is not None, HAS_PARAM_OUT=param_out is not None,
                  HAS_WEIGHT_DECAY=weight_decay != 0, HAS_MOMENTUM=momentum != 0, NESTEROV=bool(nesterov),
                  MAXIMIZE=bool(maximize), REMAINDER=remainders, STOCHASTIC=seed is not None, MULTI=False,
                  BLOCK=BLOCK, enable_fp_fusion=True)
    return _sgd_kernel, (cdiv(param.numel(), BLOCK),), args, kwargs
