"""Muon's memory-bound passes, fused, and its Newton-Schulz iteration (torch matmuls, tensor cores on a GPU).

``torch.optim.Muon`` (torch 2.13) per matrix, in its order of operations::

    g  = grad * grad_scale
    B  = lerp(B, g, 1 - momentum)                 (an EMA: B + (1 - mu) (g - B))
    U  = lerp(g, B, momentum) if nesterov else B
    O  = NS(bf16(U))                              (Newton-Schulz, in bf16, on the whole matrix)
    p *= 1 - lr * weight_decay
    p += -lr * ratio(shape) * O                   (ratio: the lr adjustment, "original" or "match_rms_adamw")

Two passes over the shard here, around the matrix multiplications:

* :func:`muon_momentum_`: reads the bf16 gradient and the momentum (fp32, or bf16 rounded as the other
  optimizers' states), writes the momentum and ``U`` in bf16 (the iteration's input dtype), 2 + 8 + 2 B/element
  with fp32 momentum;
* :func:`muon_update_`: reads ``O`` and the fp32 master, writes the master and the bf16 weights the all-gather
  sends (2 + 4 + 4 + 2 B/element). ShardedMuon launches it once per matrix (the lr adjustment depends on the
  matrix's shape), right after that matrix's Newton-Schulz.

``lerp`` is evaluated as torch's CPU and CUDA kernels do: ``a + w (b - a)`` for ``|w| < 0.5``, else
``b - (b - a) (1 - w)``. ``found_inf`` masks every store of both passes, so a skipped step leaves the momentum,
the master and the weights as they were.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ._common import (check_disjoint, check_found_inf, check_no_tensor, check_rounding, check_scalar, host_seed,
                      keep_old_where_found_inf, master_view, pack_coefficients, seed_tensor)
from ._launch import cdiv
from ._dispatch import Backend, select_backend, traced
from ._update_jit import (load_grad, load_param, load_state, scalar_arg, stochastic_bits, store_param, store_state,
                          update_mask)
from .rounding import round_to_bf16, to_fp32

__all__ = ["muon_momentum_", "muon_momentum_ref", "muon_update_", "muon_update_ref", "newton_schulz",
           "adjusted_lr_ratio"]

BLOCK = 2048


@triton.jit
def _lerp(a, b, w, one_minus_w):
    """torch.lerp's formula for a scalar weight (the two branches keep it exact at both ends)."""
    if w < 0.5:
        return a + w * (b - a)
    else:
        return b - (b - a) * one_minus_w


@triton.jit
def _muon_momentum_kernel(grad_ptr, buf_ptr, out_ptr, n, grad_scale_ptr, grad_scale_val, found_inf_ptr, seed_ptr,
                          w_buf, one_minus_w_buf, w_nesterov, one_minus_w_nesterov,
                          GRAD_SCALE_IS_TENSOR: tl.constexpr, HAS_FOUND_INF: tl.constexpr, NESTEROV: tl.constexpr,
                          STOCHASTIC: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = update_mask(offs, n, found_inf_ptr, HAS_FOUND_INF)
    g = load_grad(grad_ptr, offs, mask, scalar_arg(grad_scale_ptr, grad_scale_val, GRAD_SCALE_IS_TENSOR), False)
    b = _lerp(load_state(buf_ptr, offs, mask), g, w_buf, one_minus_w_buf)
    store_state(buf_ptr, offs, mask, b, stochastic_bits(seed_ptr, tl.program_id(0).to(tl.int64) * BLOCK, BLOCK,
                                                        STOCHASTIC), 0, STOCHASTIC)
    if NESTEROV:
        u = _lerp(g, b, w_nesterov, one_minus_w_nesterov)
    else:
        u = b
    tl.store(out_ptr + offs, round_to_bf16(u), mask=mask)


@triton.jit
def _muon_update_kernel(param_ptr, update_ptr, param_out_ptr, n, coef_ptr, decay, neg_lr, found_inf_ptr,
                        COEF_IS_TENSOR: tl.constexpr, HAS_FOUND_INF: tl.constexpr, HAS_PARAM_OUT: tl.constexpr,
                        REMAINDER: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = update_mask(offs, n, found_inf_ptr, HAS_FOUND_INF)
    if COEF_IS_TENSOR:
        decay = tl.load(coef_ptr)
        neg_lr = tl.load(coef_ptr + 1)
    p = load_param(param_ptr, param_out_ptr, offs, mask, REMAINDER)
    u = to_fp32(tl.load(update_ptr + offs, mask=mask))
    p = p * decay  # torch: param.mul_(1 - lr * wd), then param.add_(O, alpha=-adjusted_lr): two roundings
    store_param(param_ptr, param_out_ptr, offs, mask, p + neg_lr * u, HAS_PARAM_OUT, REMAINDER)


def _weights(w: float) -> tuple[float, float]:
    """(w, 1 - w) as torch's lerp forms them: the weight cast to fp32 first, 1 - w in fp32."""
    w32 = torch.tensor(w, dtype=torch.float32)
    return float(w32), float(torch.tensor(1.0, dtype=torch.float32) - w32)


def _torch_lerp(a: torch.Tensor, b: torch.Tensor, w: float) -> torch.Tensor:
    w, one_minus_w = _weights(w)
    return a + w * (b - a) if abs(w) < 0.5 else b - (b - a) * one_minus_w


def _check_flat(named, device_of: torch.Tensor) -> None:
    n = device_of.numel()
    for name, t, dtypes in named:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in dtypes:
            raise TypeError(f"{name} must be {' or '.join(str(d) for d in dtypes)}, got {t.dtype}")
        if t.numel() != n:
            raise ValueError(f"{name} has {t.numel()} elements but {named[0][0]} has {n}")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
        if t.device != device_of.device:
            raise ValueError(f"{name} is on {t.device} but {named[0][0]} is on {device_of.device}")
    check_disjoint([(name, t) for name, t, _ in named])


# ---------------------------------------------------------------------------------------------- momentum pass
def muon_momentum_ref(grad, momentum_buffer, update_out, *, momentum, nesterov=True, grad_scale=1.0,
                      found_inf=None, state_rounding="nearest", seed=None) -> None:
    """Pure-PyTorch reference (and the CPU fallback): torch.optim.Muon's momentum arithmetic, sync-free."""
    gs = grad_scale.float() if isinstance(grad_scale, torch.Tensor) else grad_scale
    g = grad.float() * gs
    b = _torch_lerp(momentum_buffer.float(), g, 1.0 - momentum)
    u = _torch_lerp(g, b, momentum) if nesterov else b
    keep_old_where_found_inf(found_inf, [(momentum_buffer, b)],
                             host_seed(seed) if state_rounding == "stochastic" else None, states=1)
    keep_old_where_found_inf(found_inf, [(update_out, u)])


@traced
def muon_momentum_(grad: torch.Tensor, momentum_buffer: torch.Tensor, update_out: torch.Tensor, *,
                   momentum: float, nesterov: bool = True, grad_scale=1.0, found_inf: torch.Tensor | None = None,
                   state_rounding: str = "nearest", seed=None, backend: str | None = None) -> None:
    """Muon's momentum over a flat shard, in place: ``momentum_buffer`` advances, ``update_out`` (bf16) receives
    the Newton-Schulz input (see the module docstring). ``momentum_buffer`` is fp32, or bf16 rounded by
    ``state_rounding`` (``seed``: the Philox key, as for :func:`~tritonshard.kernels.adamw_step_`)."""
    _check_flat([("grad", grad, (torch.bfloat16, torch.float16, torch.float32)),
                 ("momentum_buffer", momentum_buffer, (torch.float32, torch.bfloat16)),
                 ("update_out", update_out, (torch.bfloat16,))], grad)
    check_found_inf(found_inf, grad.device, "grad")
    check_no_tensor(momentum=momentum)
    check_scalar("momentum", momentum, grad.device, 0.0, hi=1.0)
    check_scalar("grad_scale", grad_scale, grad.device, -float("inf"))
    check_rounding(state_rounding, seed, grad.device)
    stochastic = state_rounding == "stochastic" and momentum_buffer.dtype == torch.bfloat16
    chosen = select_backend("muon_momentum_", grad.device, backend)
    if chosen is Backend.TORCH:
        muon_momentum_ref(grad, momentum_buffer, update_out, momentum=momentum, nesterov=nesterov,
                          grad_scale=grad_scale, found_inf=found_inf,
                          state_rounding="stochastic" if stochastic else "nearest", seed=seed)
        return
    n = grad.numel()
    if n == 0:
        return
    gs = isinstance(grad_scale, torch.Tensor)
    w_buf, w_nesterov = _weights(1.0 - momentum), _weights(momentum)
    _muon_momentum_kernel[(cdiv(n, BLOCK),)](
        grad, momentum_buffer, update_out, n, grad_scale if gs else grad, 1.0 if gs else float(grad_scale),
        found_inf if found_inf is not None else grad, seed_tensor(seed, grad.device) if stochastic else grad,
        *w_buf, *w_nesterov, GRAD_SCALE_IS_TENSOR=gs, HAS_FOUND_INF=found_inf is not None,
        NESTEROV=bool(nesterov), STOCHASTIC=stochastic, BLOCK=BLOCK, enable_fp_fusion=True)


# ---------------------------------------------------------------------------------------------- master update
def _update_coefficients(lr, weight_decay, lr_ratio, device):
    lr64 = lr.to(torch.float64).reshape(()) if isinstance(lr, torch.Tensor) else lr
    return pack_coefficients([1.0 - lr64 * weight_decay, -(lr64 * lr_ratio)], device)


def muon_update_ref(param, update, *, lr, weight_decay=0.0, lr_ratio=1.0, found_inf=None, param_out=None) -> None:
    """Pure-PyTorch reference (and the CPU fallback), sync-free."""
    coef, values = _update_coefficients(lr, weight_decay, lr_ratio, param.device)
    decay, neg_lr = (coef[0], coef[1]) if coef is not None else values
    p = param * decay + neg_lr * update.float()
    pairs = [(param, p)] + ([(param_out, p)] if param_out is not None else [])
    keep_old_where_found_inf(found_inf, pairs)


@traced
def muon_update_(param: torch.Tensor, update: torch.Tensor, *, lr, weight_decay: float = 0.0,
                 lr_ratio: float = 1.0, found_inf: torch.Tensor | None = None,
                 param_out: torch.Tensor | None = None, remainders: bool = False,
                 backend: str | None = None) -> None:
    """``param = param * (1 - lr * weight_decay) - lr * lr_ratio * update`` over a flat shard, writing the
    bf16/fp16 weights into ``param_out``. ``param`` is the fp32 master (or, with ``remainders``, its int16 low
    halves, ``param_out`` the bf16 high halves); ``update`` the orthogonalized momentum (bf16 or fp32)."""
    _check_flat([("param", param, (torch.int16,) if remainders else (torch.float32,)),
                 ("update", update, (torch.bfloat16, torch.float32))], param)
    if param_out is not None or remainders:
        _check_flat([("param", param, (param.dtype,)),
                     ("param_out", param_out, (torch.bfloat16,) if remainders else (torch.bfloat16, torch.float16))],
                    param)
        check_disjoint([("update", update), ("param_out", param_out)])
    check_found_inf(found_inf, param.device, "param")
    check_no_tensor(weight_decay=weight_decay, lr_ratio=lr_ratio)
    check_scalar("lr", lr, param.device, 0.0)
    check_scalar("weight_decay", weight_decay, param.device, 0.0)
    check_scalar("lr_ratio", lr_ratio, param.device, 0.0)
    chosen = select_backend("muon_update_", param.device, backend)
    if chosen is Backend.TORCH:
        with master_view(param, param_out, remainders) as (master, out):
            muon_update_ref(master, update, lr=lr, weight_decay=weight_decay, lr_ratio=lr_ratio,
                            found_inf=found_inf, param_out=out)
        return
    n = param.numel()
    if n == 0:
        return
    coef, values = _update_coefficients(lr, weight_decay, lr_ratio, param.device)
    _muon_update_kernel[(cdiv(n, BLOCK),)](
        param, update, param_out if param_out is not None else param, n, coef if coef is not None else param,
        *(values if values else (0.0, 0.0)), found_inf if found_inf is not None else param,
        COEF_IS_TENSOR=coef is not None, HAS_FOUND_INF=found_inf is not None, HAS_PARAM_OUT=param_out is not None,
        REMAINDER=remainders, BLOCK=BLOCK, enable_fp_fusion=True)


# ---------------------------------------------------------------------------------------------- Newton-Schulz
def newton_schulz(x: torch.Tensor, coefficients=(3.4445, -4.775, 2.0315), steps: int = 5,
                  eps: float = 1e-7) -> torch.Tensor:
    """The quintic Newton-Schulz orthogonalization of a 2-D matrix, torch.optim.Muon's sequence of operations:
    in bf16, on the wide orientation (rows <= columns), after dividing by max(Frobenius norm, eps). Returns a
    new bf16 tensor of ``x``'s shape."""
    if x.ndim != 2:
        raise ValueError(f"newton_schulz needs a 2-D matrix, got shape {tuple(x.shape)}")
    a, b, c = coefficients
    tall = x.size(0) > x.size(1)
    y = x.bfloat16()
    if y is x:
        y = x.clone()
    if tall:
        y = y.T
    y.div_(y.norm().clamp(min=eps))
    for _ in range(steps):
        gram = y @ y.T
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        y = torch.addmm(y, poly, y, beta=a)
    return y.T if tall else y


def adjusted_lr_ratio(adjust_lr_fn, shape) -> float:
    """The factor torch.optim.Muon multiplies lr by for a matrix of ``shape`` (rows A, columns B): "original"
    (or None) sqrt(max(1, A / B)), "match_rms_adamw" 0.2 sqrt(max(A, B))."""
    rows, cols = int(shape[0]), int(shape[1])
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return math.sqrt(max(1.0, rows / cols))
    if adjust_lr_fn == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    raise ValueError(f"adjust_lr_fn must be None, 'original' or 'match_rms_adamw', got {adjust_lr_fn!r}")
