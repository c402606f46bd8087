"""Fused AdamW on a flat fp32 master shard, writing the bf16 weights in the same pass.

One pass reads grad (bf16/fp32), param, exp_avg, exp_avg_sq (fp32) and writes param, exp_avg, exp_avg_sq and,
optionally, ``param_out`` (bf16, round to nearest even): 28 bytes per element with a bf16 grad and bf16 output.

Semantics are ``torch.optim.AdamW`` (``foreach=False``), in its order of operations::

    g  = grad * grad_scale                        (then -g if maximize)
    p *= 1 - lr * weight_decay                    (decoupled weight decay)
    m  = lerp(m, g, 1 - beta1)
    v  = v * beta2 + (1 - beta2) * g * g
    p += (-lr / (1 - beta1^step)) * m / (sqrt(v) / sqrt(1 - beta2^step) + eps)

``step`` is the step number after its increment (1 on the first call). The scalar coefficients
(``1 - lr*wd``, ``lr / bc1``, ``sqrt(bc2)``) are computed once per call in float64, on the host for Python numbers
and with a few 0-d device ops when ``lr`` or ``step`` is a tensor, so a changing lr or step needs neither a
recompile nor a host sync; doing them in fp32 inside the kernel would lose ~1e-5 relative on ``1 - 0.999^1``.
ShardedAdamW computes them once per param group and step with :func:`adamw_coefficients_launch` (the two powers
in torch, the rest in one float64 program, the same bits) where the Triton kernels run.

FMA contraction is on, explicitly (Triton 3.10 turns its default off): on a GPU ``a + b * c`` rounds once, so the
kernel may differ from the reference by a few fp32 ulps per step (the tests' tolerance says how many); the same
holds for the SGD and Lion kernels.

``grad_scale`` folds 1/world_size, the clip coefficient and 1/loss_scale into the single multiply. When
``found_inf`` is non-zero the kernel masks every load and store: no tensor changes, bit for bit.
"""

from __future__ import annotations

import math
import struct

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from ._common import (check_no_tensor, check_rounding, check_scalar, fill_one_minus_product, host_seed,
                      keep_old_where_found_inf, master_view, pack_coefficients, seed_tensor, validate_update)
from . import _launch
from ._dispatch import Backend, interpreter_enabled, quiet_interpreter, select_backend, traced
from ._update_jit import (load_grad, load_param, load_state, program_block, scalar_arg, segment_numel, segment_ptr,
                          stochastic_bits, store_param, store_state, update_mask)

__all__ = ["adamw_step_", "adamw_step_ref", "adamw_coefficients", "adamw_coefficients_into",
           "adamw_coefficients_launch"]

BLOCK = 2048


@triton.jit
def _adamw_kernel(param_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr, param_out_ptr, n,
                  coef_ptr, decay, step_size, bc2_sqrt,
                  grad_scale_ptr, grad_scale_val, found_inf_ptr, seed_ptr,
                  beta1, one_minus_beta1, beta2, one_minus_beta2, eps, sched_ptr, segs_ptr,
                  COEF_IS_TENSOR: tl.constexpr, GRAD_SCALE_IS_TENSOR: tl.constexpr, HAS_FOUND_INF: tl.constexpr,
                  HAS_PARAM_OUT: tl.constexpr, MAXIMIZE: tl.constexpr, LERP_FROM_END: tl.constexpr,
                  REMAINDER: tl.constexpr, STOCHASTIC: tl.constexpr, MULTI: tl.constexpr, BLOCK: tl.constexpr):
    seg, start = program_block(sched_ptr, BLOCK, MULTI)  # (see _update_jit: segmented launches)
    param_ptr = segment_ptr(param_ptr, segs_ptr, seg, 0, MULTI)
    grad_ptr = segment_ptr(grad_ptr, segs_ptr, seg, 1, MULTI)
    exp_avg_ptr = segment_ptr(exp_avg_ptr, segs_ptr, seg, 2, MULTI)
    exp_avg_sq_ptr = segment_ptr(exp_avg_sq_ptr, segs_ptr, seg, 3, MULTI)
    param_out_ptr = segment_ptr(param_out_ptr, segs_ptr, seg, 4, MULTI)
    seed_ptr = segment_ptr(seed_ptr, segs_ptr, seg, 5, MULTI, False)
    n = segment_numel(segs_ptr, seg, n, MULTI)
    offs = start + tl.arange(0, BLOCK)
    mask = update_mask(offs, n, found_inf_ptr, HAS_FOUND_INF)
    if COEF_IS_TENSOR:
        decay = tl.load(coef_ptr)
        step_size = tl.load(coef_ptr + 1)
        bc2_sqrt = tl.load(coef_ptr + 2)
    g = load_grad(grad_ptr, offs, mask, scalar_arg(grad_scale_ptr, grad_scale_val, GRAD_SCALE_IS_TENSOR), MAXIMIZE)
    p = load_param(param_ptr, param_out_ptr, offs, mask, REMAINDER)
    m = load_state(exp_avg_ptr, offs, mask)
    v = load_state(exp_avg_sq_ptr, offs, mask)
    bits = stochastic_bits(seed_ptr, start, BLOCK, STOCHASTIC)

    p = p * decay
    if LERP_FROM_END:  # torch.lerp's formula for weight >= 0.5
        m = g - (g - m) * beta1
    else:
        m = m + one_minus_beta1 * (g - m)
    v = v * beta2 + one_minus_beta2 * g * g
    denom = tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps
    p = p + tl.div_rn(-step_size * m, denom)

    store_state(exp_avg_ptr, offs, mask, m, bits, 0, STOCHASTIC)
    store_state(exp_avg_sq_ptr, offs, mask, v, bits, 1, STOCHASTIC)
    store_param(param_ptr, param_out_ptr, offs, mask, p, HAS_PARAM_OUT, REMAINDER)


def _coefficients(lr, step, beta1, beta2, weight_decay, device):
    """(1 - lr*wd, lr / bc1, sqrt(bc2)) in float64: Python floats, or one fp32 device tensor if lr/step are tensors."""
    if isinstance(step, torch.Tensor):
        step64 = step.to(torch.float64).reshape(())
        bc1 = 1.0 - torch.pow(beta1, step64)
        bc2_sqrt = torch.sqrt(1.0 - torch.pow(beta2, step64))
    else:
        bc1 = 1.0 - beta1 ** step
        bc2_sqrt = math.sqrt(1.0 - beta2 ** step)
    lr64 = lr.to(torch.float64).reshape(()) if isinstance(lr, torch.Tensor) else lr
    return pack_coefficients([1.0 - lr64 * weight_decay, lr64 / bc1, bc2_sqrt], device)


def adamw_coefficients(lr, step: torch.Tensor, beta1: float, beta2: float, weight_decay: float) -> torch.Tensor:
    """The launch's coefficients (1 - lr*wd, lr / bc1, sqrt(bc2)) as one fp32 device tensor, from a device ``step``
    (float64 math, device ops only): compute once and pass as ``coefficients=`` to every launch that shares them
    (ShardedAdamW: once per param group and step, instead of ~10 small ops per bucket)."""
    if not isinstance(step, torch.Tensor):
        raise TypeError("adamw_coefficients needs step as a device tensor (with numbers, the launch computes them "
                        "on the host for free)")
    return _coefficients(lr, step, beta1, beta2, weight_decay, step.device)[0]


def adamw_coefficients_into(out: tuple, scratch: tuple, lr, step: torch.Tensor, beta1: float,
                            beta2: float, weight_decay: float) -> None:
    """:func:`adamw_coefficients` for a Python-number ``lr``, or a float64 0-d device tensor holding it, written into
    ``out`` (the three 0-d views of the fp32 coefficients tensor) through ``scratch`` (three float64 0-d tensors),
    allocating nothing: the same float64 ops in place (``1 - x`` as ``-x + 1``, exact alike; ``lr / bc1`` as torch
    computes a number over a tensor, ``bc1.reciprocal() * lr``), so the same bits either way. What a step captured
    in a CUDA graph needs (issue 20.6): with the tensor, no op takes the lr as a number, which the graph would
    freeze."""
    step64, bc1, bc2_sqrt = scratch
    step64.copy_(step)
    torch.pow(beta1, step64, out=bc1).neg_().add_(1.0)
    torch.pow(beta2, step64, out=bc2_sqrt).neg_().add_(1.0).sqrt_()
    fill_one_minus_product(out[0], lr, weight_decay, step64)  # (step64 is free again)
    out[1].copy_(bc1.reciprocal_().mul_(lr))
    out[2].copy_(bc2_sqrt)


@triton.jit(do_not_specialize=["lr_bits", "beta1_bits", "beta2_bits", "weight_decay_bits"])
def _coefficients_kernel(out_ptr, lr_ptr, lr_bits, pows_ptr, step_ptr, beta1_bits, beta2_bits, weight_decay_bits,
                         LR_IN_MEMORY: tl.constexpr, POW_IN_KERNEL: tl.constexpr):
    """``out`` (fp32) = (1 - lr*wd, (1 / (1 - beta1^t)) * lr, sqrt(1 - beta2^t)): :func:`adamw_coefficients_into`'s
    float64 ops, each rounded once (compiled for sm_90 with fp fusion off: mul.rn, sub.rn, div.rn, sqrt.rn .f64,
    then cvt.rn.f32.f64), so the same bits. Doubles come as the int64 bit patterns of their values (a float argument
    would be fp32): the weight decay, the betas, and the lr unless ``LR_IN_MEMORY`` (a captured step reads it from
    the group's float64 tensor at ``lr_ptr``, which the host rewrites before each replay).

    The powers ``beta^t``: with ``POW_IN_KERNEL`` (compiled) libdevice's ``pow`` of the float64 betas and of the
    fp32 step count at ``step_ptr`` widened to float64, the function torch's CUDA ``pow`` calls for the same
    float64 arguments (``__nv_pow``); without it (the interpreter, which has no libdevice) read at ``pows_ptr``,
    where the caller's torch ops wrote them."""
    if LR_IN_MEMORY:
        lr = tl.load(lr_ptr)
    else:
        lr = lr_bits.to(tl.int64).to(tl.float64, bitcast=True)
    weight_decay = weight_decay_bits.to(tl.int64).to(tl.float64, bitcast=True)
    if POW_IN_KERNEL:
        step = tl.load(step_ptr).to(tl.float64)
        beta1_pow = libdevice.pow(beta1_bits.to(tl.int64).to(tl.float64, bitcast=True), step)
        beta2_pow = libdevice.pow(beta2_bits.to(tl.int64).to(tl.float64, bitcast=True), step)
    else:
        beta1_pow = tl.load(pows_ptr)
        beta2_pow = tl.load(pows_ptr + 1)
    decay = 1.0 - lr * weight_decay
    step_size = (1.0 / (1.0 - beta1_pow)) * lr
    bc2_sqrt = tl.sqrt(1.0 - beta2_pow)
    tl.store(out_ptr, decay.to(tl.float32))
    tl.store(out_ptr + 1, step_size.to(tl.float32))
    tl.store(out_ptr + 2, bc2_sqrt.to(tl.float32))


def _double_bits(x: float) -> int:
    """The IEEE-754 bit pattern of the double ``x`` as a signed 64-bit integer."""
    return _DOUBLE_BITS.unpack(_DOUBLE.pack(float(x)))[0]


_DOUBLE, _DOUBLE_BITS = struct.Struct("<d"), struct.Struct("<q")
#: the arguments of _coefficients_kernel a bound launch takes afresh at each call: the bits of the lr (a scheduler
#: changes it every step), of the betas (torch's OneCycleLR cycles beta1) and of the weight decay
_LIVE_BITS = (2, 5, 6, 7)


def adamw_coefficients_launch(out: torch.Tensor, scratch: tuple, lr, step: torch.Tensor, beta1: float,
                              beta2: float, weight_decay: float, launches: dict,
                              pow_in_kernel: bool | None = None) -> None:
    """:func:`adamw_coefficients_into` where the Triton kernels run, in one single-program launch
    (:func:`_coefficients_kernel`), bound in ``launches`` (:mod:`._launch`): no torch op, where 13 float64 ops did
    it once. ``out`` is the fp32 coefficients tensor (3 elements); ``lr`` the Python number (a kernel argument,
    which the bound launch takes afresh at each call: a scheduler's new lr every step rebinds nothing) or the
    float64 0-d device tensor holding it (what a captured step reads); ``scratch`` = (a float64 0-d tensor for the
    step, a float64 tensor of 2 elements for the powers, and its two 0-d views), made once by the caller, used
    where the powers are torch ops. ``pow_in_kernel``: the powers in the kernel (default: where it runs compiled;
    the interpreter has no libdevice ``pow``, and there the step's copy and two torch ``pow`` s write them). The
    same bits as :func:`adamw_coefficients_into` (tests/kernels/test_adamw_coefficients.py; compiled in the GPU
    check's stage 1)."""
    step64, pows, (beta1_pow, beta2_pow) = scratch
    if pow_in_kernel is None:
        pow_in_kernel = not interpreter_enabled()
    if not pow_in_kernel:
        step64.copy_(step)
        torch.pow(beta1, step64, out=beta1_pow)
        torch.pow(beta2, step64, out=beta2_pow)
    in_memory = isinstance(lr, torch.Tensor)
    args = (out, lr if in_memory else out, 0 if in_memory else _double_bits(lr), pows, step, _double_bits(beta1),
            _double_bits(beta2), _double_bits(weight_decay))
    adamw_coefficients_kernel((_coefficients_kernel, (1,), args, dict(LR_IN_MEMORY=in_memory,
                                                                      POW_IN_KERNEL=pow_in_kernel,
                                                                      enable_fp_fusion=False)), launches)


@traced
def adamw_coefficients_kernel(spec: tuple, launches: dict) -> None:
    """The launch of :func:`adamw_coefficients_launch`, bound (in a kernel's profiler range, as every launcher);
    the hyper-parameters' bits may change between calls (:func:`._launch.launch`'s ``live``)."""
    kernel, grid, args, kwargs = spec
    # a step count of 0 (every step so far skipped for an inf) divides by 1 - beta1^0 = 0: inf, as torch's
    # reciprocal gives and a GPU computes without a word (the update is masked then); the interpreter's numpy would
    # warn
    with quiet_interpreter("divide", "invalid"):
        _launch.launch(launches, "coefficients", spec, lambda: kernel[grid](*args, **kwargs), live=_LIVE_BITS)


def _check_coefficients(coefficients, device) -> None:
    if coefficients is None:
        return
    if (not isinstance(coefficients, torch.Tensor) or coefficients.dtype != torch.float32
            or tuple(coefficients.shape) != (3,) or coefficients.device != device):
        raise ValueError(f"coefficients must be adamw_coefficients()'s fp32 tensor of 3 elements on {device}")


def adamw_step_ref(param, grad, exp_avg, exp_avg_sq, *, lr, beta1, beta2, eps, weight_decay, step,
                   grad_scale=1.0, found_inf=None, param_out=None, maximize=False, state_rounding="nearest",
                   seed=None, coefficients=None) -> None:
    """Pure-PyTorch reference (and the CPU fallback), torch.optim.AdamW's single-tensor arithmetic.

    Sync-free like the kernel: a set ``found_inf`` selects the old values with ``torch.where``.
    """
    coef, values = ((coefficients, None) if coefficients is not None
                    else _coefficients(lr, step, beta1, beta2, weight_decay, param.device))
    decay, step_size, bc2_sqrt = (coef[0], coef[1], coef[2]) if coef is not None else values
    gs = grad_scale.float() if isinstance(grad_scale, torch.Tensor) else grad_scale
    g = grad.float() * gs
    if maximize:
        g = -g
    p = param * decay
    m = exp_avg.float().lerp(g, 1 - beta1)
    v = exp_avg_sq.float() * beta2 + (1 - beta2) * g * g
    denom = v.sqrt() / bc2_sqrt + eps
    p = p + (-step_size * m) / denom
    pairs = [(exp_avg, m), (exp_avg_sq, v), (param, p)] + ([(param_out, p)] if param_out is not None else [])
    keep_old_where_found_inf(found_inf, pairs, host_seed(seed) if state_rounding == "stochastic" else None, states=2)


def _validate(param, grad, exp_avg, exp_avg_sq, lr, beta1, beta2, eps, weight_decay, step, grad_scale,
              found_inf, param_out, remainders):
    validate_update(param, grad, [("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)], found_inf, param_out,
                    grad_scale, remainders)
    check_no_tensor(beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay)
    check_scalar("lr", lr, param.device, 0.0)
    check_scalar("step", step, param.device, 1.0)
    check_scalar("beta1", beta1, param.device, 0.0, hi=1.0)
    check_scalar("beta2", beta2, param.device, 0.0, hi=1.0)
    check_scalar("eps", eps, param.device, 0.0)
    check_scalar("weight_decay", weight_decay, param.device, 0.0)


@traced
def adamw_step_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
                lr, beta1: float, beta2: float, eps: float, weight_decay: float, step, grad_scale=1.0,
                found_inf: torch.Tensor | None = None, param_out: torch.Tensor | None = None,
                maximize: bool = False, remainders: bool = False, state_rounding: str = "nearest", seed=None,
                coefficients: torch.Tensor | None = None, backend: str | None = None) -> None:
    """One AdamW step over a flat shard, in place. See the module docstring for the exact arithmetic.

    Args:
        param, exp_avg, exp_avg_sq: fp32, contiguous, same numel (the master shard and its moments).
        grad: bf16, fp16 or fp32, same numel.
        lr, step: Python numbers or 1-element device tensors (``step`` counts from 1).
        grad_scale: number or 1-element device tensor multiplying the gradient first.
        found_inf: optional 1-element device tensor; when non-zero, nothing is written.
        param_out: optional bf16/fp16 tensor receiving the rounded new param in the same pass.
        state_rounding, seed: bf16 ``exp_avg``/``exp_avg_sq`` are stored rounded to nearest even, or with
            ``"stochastic"`` from Philox(seed, element // 4) (exp_avg and exp_avg_sq from the two 16-bit halves of
            each element's word); ``seed`` an int or a 1-element int64 device tensor
            (advance it every step).
        remainders: ``param`` is the int16 remainder of the master and ``param_out`` (bf16, required) its high
            half: the fp32 master is rebuilt, updated and split again in the same pass (see
            :func:`tritonshard.kernels.rounding.split_bf16_remainder`), 2 bytes per element instead of 4.
        coefficients: :func:`adamw_coefficients` of the same lr, step, betas and weight_decay, computed once for
            several launches (then lr and step are only validated here).
        backend: None (by device), "triton" or "torch".
    """
    _validate(param, grad, exp_avg, exp_avg_sq, lr, beta1, beta2, eps, weight_decay, step, grad_scale,
              found_inf, param_out, remainders)
    _check_coefficients(coefficients, param.device)
    check_rounding(state_rounding, seed, param.device)
    chosen = select_backend("adamw_step_", param.device, backend)
    if chosen is Backend.TORCH:
        with master_view(param, param_out, remainders) as (master, out):
            adamw_step_ref(master, grad, exp_avg, exp_avg_sq, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                           weight_decay=weight_decay, step=step, grad_scale=grad_scale, found_inf=found_inf,
                           param_out=out, maximize=maximize, state_rounding=state_rounding, seed=seed,
                           coefficients=coefficients)
        return
    if param.numel() == 0:
        return
    coef, values = ((coefficients, None) if coefficients is not None
                    else _coefficients(lr, step, beta1, beta2, weight_decay, param.device))
    kernel, grid, args, kwargs = launch_spec(
        param, grad, exp_avg, exp_avg_sq, coef, values, grad_scale, found_inf, param_out,
        seed_tensor(seed, param.device) if state_rounding == "stochastic" else None, beta1, beta2, eps, maximize,
        remainders)
    kernel[grid](*args, **kwargs)


#: how a segmented launch (_launch.segmented_spec) finds each bucket's tensors among launch_spec's arguments:
#: the vectorized roles (param, grad, exp_avg, exp_avg_sq, param_out), the Philox key, the numel, the two tables
SEGMENTS = dict(vector=(0, 1, 2, 3, 4), scalar=(13,), numel=5, tables=19)


def launch_spec(param, grad, exp_avg, exp_avg_sq, coef, values, grad_scale, found_inf, param_out, seed,
                beta1, beta2, eps, maximize, remainders) -> tuple:
    """(kernel, grid, args, kwargs) of one :func:`adamw_step_` launch, unchecked: for :func:`adamw_step_` after its
    checks, and for an optimizer that checked the same arguments once (see :mod:`._launch`). ``coef`` is the
    coefficients tensor or None (then ``values`` are the host coefficients); ``seed`` a tensor or None (nearest)."""
    decay, step_size, bc2_sqrt = values if values is not None else (1.0, 1.0, 1.0)
    gs_is_tensor = isinstance(grad_scale, torch.Tensor)
    args = (param, grad, exp_avg, exp_avg_sq, param_out if param_out is not None else param, param.numel(),
            coef if coef is not None else param, float(decay), float(step_size), float(bc2_sqrt),
            grad_scale if gs_is_tensor else param, 1.0 if gs_is_tensor else float(grad_scale),
            found_inf if found_inf is not None else param, seed if seed is not None else param,
            float(beta1), float(1 - beta1), float(beta2), float(1 - beta2), float(eps), param, param)
    kwargs = dict(COEF_IS_TENSOR=coef is not None, GRAD_SCALE_IS_TENSOR=gs_is_tensor,
                  HAS_FOUND_INF=found_inf is not None, HAS_PARAM_OUT=param_out is not None, MAXIMIZE=bool(maximize),
                  LERP_FROM_END=(1 - beta1) >= 0.5, REMAINDER=remainders, STOCHASTIC=seed is not None,
                  MULTI=False, BLOCK=BLOCK, enable_fp_fusion=True)
    return _adamw_kernel, (-(-param.numel() // BLOCK),), args, kwargs
