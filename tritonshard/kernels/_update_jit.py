"""Triton helpers shared by the fused optimizer-update kernels (adamw, sgd, lion)."""

import triton
import triton.language as tl

from .rounding import round_to_bf16, to_fp32


@triton.jit
def update_mask(offs, n, found_inf_ptr, HAS_FOUND_INF: tl.constexpr):
    """In-bounds lanes, or none at all when found_inf != 0 (then nothing is loaded or stored).

    The interpreter rejects a mask built from a loaded flag ("mask has unsupported dtype"), so the flag moves
    the bound instead."""
    if HAS_FOUND_INF:
        return offs < tl.where(tl.load(found_inf_ptr) == 0, n, 0)
    else:
        return offs < n


@triton.jit
def scalar_arg(ptr, value, IS_TENSOR: tl.constexpr):
    """A scalar that arrives either by value or as a 1-element device tensor (lr, step, grad_scale...)."""
    if IS_TENSOR:
        return to_fp32(tl.load(ptr))
    else:
        return value


@triton.jit
def load_grad(grad_ptr, offs, mask, grad_scale, MAXIMIZE: tl.constexpr):
    g = to_fp32(tl.load(grad_ptr + offs, mask=mask)) * grad_scale
    if MAXIMIZE:
        g = -g
    return g


@triton.jit
def store_param(param_ptr, param_out_ptr, offs, mask, p, HAS_PARAM_OUT: tl.constexpr):
    """The fp32 master, and its copy in the model's dtype: bf16 rounded on the bits (see rounding.py), fp16
    by the cast, which rounds to nearest even under the interpreter (numpy) and on GPUs alike."""
    tl.store(param_ptr + offs, p, mask=mask)
    if HAS_PARAM_OUT:
        if param_out_ptr.dtype.element_ty == tl.bfloat16:
            tl.store(param_out_ptr + offs, round_to_bf16(p), mask=mask)
        else:
            tl.store(param_out_ptr + offs, p.to(param_out_ptr.dtype.element_ty), mask=mask)
