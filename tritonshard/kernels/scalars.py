"""The step's scalar bookkeeping in single-program launches, instead of chains of 0-d torch ops.

A ShardedOptimizer step is a few bandwidth-bound kernels (flatten, norm pass, update) surrounded by scalars: the
clip coefficient, the update's ``grad_scale``, the non-finite flag and what follows from it (the step counters,
``skipped_steps``, ``last_step_skipped``). Each 0-d torch op on a GPU costs a kernel launch (~5-10 us of host
time, and a few us of device time in a chain that the update waits for: issue 20.2; the H200 profile of 2026-12-04
shows ~20 small kernels per 125M step). These kernels do the same arithmetic in one program each, with the
roundings of the torch ops they replace (IEEE ``div_rn``, no FMA contraction), so the same bits:

* :func:`round_totals_`: with more than one rank, the all-reduced fp64 totals of the norm (sum of squares,
  non-finite count) as the fp32 sum and flag (3 ops: ``copy_``, ``gt``, ``copy_``; on one rank the finalize stores
  them itself);
* :func:`clip_coefficient_`: torch.nn.utils.clip_grad_norm_'s coefficient ``clamp(max_norm / (norm + 1e-6),
  max=1)`` from the norm (4 ops: ``add``, ``reciprocal_``, ``mul_``, ``clamp_``), and where the kernels run
  compiled the norm itself in the same launch, ``sqrt`` of the sum of squares into the tensor the clip returns.
  Under the interpreter the norm stays torch's ``sqrt``: on a CPU tensor it is not always the correctly rounded
  one that numpy and a GPU compute (torch 2.13: sqrt(319006.15625) comes out 1 ulp above), so a kernel's would
  differ from torch's clip on a CPU;
* :func:`step_flags_`: from the step's ``found_inf``, its copy that the update launches read, ``1 - found_inf``,
  every step counter advanced by it, ``skipped_steps += found_inf``, ``last_step_skipped = found_inf > 0``, and,
  when the loop clipped, ``grad_scale = clip_coef * average`` (8 ops, one more per counter).

Each has a ``*_ref`` in torch ops (what the optimizer runs under torch.compile, on the PyTorch backend and wherever
the step has more factors: a loss scale, GradScaler, parameters left out), a ``*_launch_spec`` of the launch the
optimizer binds (:mod:`._launch`), and a ``*_kernel`` that launches it, bound, in the kernel's profiler range.
Stores are from thread 0 only (Triton's scalar stores): a counter's read-modify-write runs once.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from . import _launch
from ._dispatch import Backend, quiet_interpreter, select_backend, traced

__all__ = ["round_totals_", "round_totals_ref", "round_totals_launch_spec", "round_totals_kernel",
           "clip_coefficient_", "clip_coefficient_ref", "clip_coefficient_launch_spec", "clip_coefficient_kernel",
           "step_flags_", "step_flags_ref", "step_flags_launch_spec", "step_flags_kernel", "counter_table"]


@triton.jit
def _round_totals_kernel(totals_ptr, out_ptr):
    # the fp64 sum rounded to fp32 once (cvt.rn, as torch's copy_), and the summed flag as 1.0 or 0.0
    tl.store(out_ptr, tl.load(totals_ptr).to(tl.float32))
    tl.store(out_ptr + 1, (tl.load(totals_ptr + 1) > 0).to(tl.float32))


@triton.jit
def _clip_coefficient_kernel(norm_ptr, coef_ptr, max_norm, sum_sq_ptr, SQRT: tl.constexpr):
    # with SQRT the norm first, the correctly rounded square root of the sum of squares (a GPU's torch.sqrt), stored
    # for the caller; then torch's ops, one rounding each: + 1e-6 (an fp32 constant, as torch casts the Python
    # number), 1 / x (IEEE division, as torch's reciprocal), * max_norm (the fp32 argument, as torch casts it), then
    # min(x, 1) keeping a NaN (torch's clamp)
    if SQRT:
        norm = tl.sqrt_rn(tl.load(sum_sq_ptr))
        tl.store(norm_ptr, norm)
    else:
        norm = tl.load(norm_ptr)
    shifted = norm + 1e-6
    coef = tl.div_rn(tl.full(shifted.shape, 1.0, tl.float32), shifted) * max_norm
    tl.store(coef_ptr, tl.where(coef > 1.0, 1.0, coef))


@triton.jit
def _step_flags_kernel(found_ptr, found_out, not_skipped_out, skipped_steps_ptr, last_skipped_ptr, counters_ptr,
                       num_counters, clip_coef_ptr, average, grad_scale_out, HAS_CLIP: tl.constexpr):
    found = tl.load(found_ptr)
    tl.store(found_out, found)
    not_skipped = -found + 1.0
    tl.store(not_skipped_out, not_skipped)
    for i in range(num_counters):  # (each counter's address, as the flatten's tables hold the gradients')
        counter = tl.load(counters_ptr + i).to(tl.pointer_type(tl.float32))
        tl.store(counter, tl.load(counter) + not_skipped)
    tl.store(skipped_steps_ptr, tl.load(skipped_steps_ptr) + found.to(tl.int64))  # (toward zero, as copy_)
    tl.store(last_skipped_ptr, found > 0)
    if HAS_CLIP:
        tl.store(grad_scale_out, tl.load(clip_coef_ptr) * average)


def _check_scalar_tensor(t, name: str, dtype: torch.dtype, device=None) -> None:
    if not isinstance(t, torch.Tensor) or t.dim() != 0 or t.dtype != dtype:
        got = f"{t.dtype} tensor of shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name} must be a 0-d {dtype} tensor, got {got}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} must be on {device} (where the other arguments are), got {t.device}")


def round_totals_ref(totals: torch.Tensor, out: torch.Tensor) -> None:
    """``out = (fp32(totals[0]), 1.0 if totals[1] > 0 else 0.0)``: the ops ShardedOptimizer ran after the all-reduce
    of the norm's fp64 totals (sum of squares, non-finite count over the ranks)."""
    out[0].copy_(totals[0])
    out[1].copy_(torch.gt(totals[1], 0))


def round_totals_launch_spec(totals: torch.Tensor, out: torch.Tensor) -> tuple:
    """(kernel, grid, args, kwargs) of one :func:`round_totals_` launch, unchecked (see :mod:`._launch`)."""
    return _round_totals_kernel, (1,), (totals, out), dict(enable_fp_fusion=False)


@traced
def round_totals_(totals: torch.Tensor, out: torch.Tensor, *, backend: str | None = None) -> None:
    """The norm's fp64 ``totals`` (2 elements: the sum of squares, the number of ranks that found a non-finite value)
    as the fp32 ``out`` (2 elements: the sum rounded once, the flag 1.0 or 0.0): the bits of
    :func:`round_totals_ref` (3 small ops)."""
    for t, name, dtype in ((totals, "totals", torch.float64), (out, "out", torch.float32)):
        if not isinstance(t, torch.Tensor) or t.shape != (2,) or t.dtype != dtype or not t.is_contiguous():
            got = f"{t.dtype} tensor of shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} must be a contiguous {dtype} tensor of 2 elements, got {got}")
    if out.device != totals.device:
        raise ValueError(f"out must be on {totals.device} (where totals is), got {out.device}")
    if select_backend("round_totals_", out.device, backend) is Backend.TORCH:
        round_totals_ref(totals, out)
        return
    kernel, grid, args, kwargs = round_totals_launch_spec(totals, out)
    with quiet_interpreter("over"):  # (an fp64 sum beyond fp32's range rounds to inf)
        kernel[grid](*args, **kwargs)


@traced
def round_totals_kernel(spec: tuple, launches: dict, first) -> None:
    """``spec`` (from :func:`round_totals_launch_spec`) through the BoundLaunch in ``launches``, ``first()`` (the
    checked :func:`round_totals_`) where there is none yet or an argument changed (:func:`._launch.launch`)."""
    with quiet_interpreter("over"):
        _launch.launch(launches, "totals", spec, first)


def clip_coefficient_ref(norm: torch.Tensor, out: torch.Tensor, max_norm: float) -> torch.Tensor:
    """``out = clamp(max_norm / (norm + 1e-6), max=1)`` with torch.nn.utils.clip_grad_norm_'s ops (a Python number
    over a tensor is the tensor's reciprocal times the number)."""
    return torch.add(norm, 1e-6, out=out).reciprocal_().mul_(max_norm).clamp_(max=1.0)


def clip_coefficient_launch_spec(norm: torch.Tensor, out: torch.Tensor, max_norm: float,
                                 sum_sq: torch.Tensor | None = None) -> tuple:
    """(kernel, grid, args, kwargs) of one :func:`clip_coefficient_` launch, unchecked (see :mod:`._launch`)."""
    # (without sum_sq, the kernel reads none: ``out`` stands there, the same tensor at every call of a bound launch)
    return (_clip_coefficient_kernel, (1,), (norm, out, float(max_norm), out if sum_sq is None else sum_sq),
            dict(SQRT=sum_sq is not None, enable_fp_fusion=False))


#: the argument of a clip_coefficient_launch_spec a bound launch takes afresh at each call: the norm (a new tensor
#: per clip, handed to the loop, where the kernel writes the square root of ``sum_sq``)
CLIP_NORM_ARG = 0


def _correctly_rounded_sqrt(sum_sq: torch.Tensor) -> torch.Tensor:
    """sqrt of an fp32 tensor, rounded once (in float64, then to fp32: exact for a square root, whose float64
    result rounds to the same fp32 as the exact one): a GPU's ``torch.sqrt``; a CPU's is not always (see above)."""
    return sum_sq.double().sqrt().float()


@traced
def clip_coefficient_(norm: torch.Tensor, out: torch.Tensor, max_norm: float, *, sum_sq: torch.Tensor | None = None,
                      backend: str | None = None) -> torch.Tensor:
    """Write torch.nn.utils.clip_grad_norm_'s coefficient for the gradient norm ``norm`` into ``out`` (both 0-d fp32
    tensors on one device): the bits of :func:`clip_coefficient_ref`. With ``sum_sq`` (0-d fp32, the sum of the
    squares), ``norm`` is written first, its correctly rounded square root (what torch.sqrt gives on a GPU), in the
    same launch. Returns ``out``."""
    _check_scalar_tensor(norm, "norm", torch.float32)
    _check_scalar_tensor(out, "out", torch.float32, norm.device)
    if sum_sq is not None:
        _check_scalar_tensor(sum_sq, "sum_sq", torch.float32, norm.device)
    if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or not max_norm > 0:
        raise ValueError(f"max_norm must be a number > 0, got {max_norm!r}")  # (inf: torch's clip takes it too)
    if select_backend("clip_coefficient_", out.device, backend) is Backend.TORCH:
        if sum_sq is not None:
            norm.copy_(_correctly_rounded_sqrt(sum_sq))
        return clip_coefficient_ref(norm, out, max_norm)
    kernel, grid, args, kwargs = clip_coefficient_launch_spec(norm, out, max_norm, sum_sq)
    # (a max_norm of inf, which torch's clip takes, times the 0 coefficient of an infinite norm: NaN, as torch's)
    with quiet_interpreter("invalid"):
        kernel[grid](*args, **kwargs)
    return out


@traced
def clip_coefficient_kernel(spec: tuple, launches: dict, first) -> None:
    """``spec`` (from :func:`clip_coefficient_launch_spec`) through the BoundLaunch in ``launches``, ``first()``
    (the checked :func:`clip_coefficient_`) where there is none yet or an argument changed
    (:func:`._launch.launch`; the norm, a new tensor at each clip, is taken afresh)."""
    with quiet_interpreter("invalid"):
        _launch.launch(launches, "clip", spec, first, live=(CLIP_NORM_ARG,))


def counter_table(counters: list, device) -> torch.Tensor:
    """The int64 device table of the addresses of ``counters`` (0-d fp32 tensors) that :func:`step_flags_` advances:
    built once by the caller, which keeps the counters alive as long as the table. (non_blocking: no host sync, as
    the flatten's tables; the host tensor is staged before the call returns.)"""
    return torch.tensor([c.data_ptr() for c in counters], dtype=torch.int64).to(device, non_blocking=True)


def step_flags_ref(found_inf, found_out, not_skipped_out, skipped_steps, last_step_skipped, counters,
                   clip_coef=None, average: float = 1.0, grad_scale_out=None) -> None:
    """What :func:`step_flags_` writes, with the torch ops ShardedOptimizer.step ran for it (``counters``: the 0-d
    fp32 step counters themselves)."""
    found_out.copy_(found_inf)
    not_skipped = torch.neg(found_out, out=not_skipped_out).add_(1.0)
    for counter in counters:
        counter.add_(not_skipped)
    skipped_steps.add_(found_out.to(torch.int64))
    torch.gt(found_out, 0, out=last_step_skipped)
    if clip_coef is not None:
        torch.mul(clip_coef, average, out=grad_scale_out)


def step_flags_launch_spec(found_inf, found_out, not_skipped_out, skipped_steps, last_step_skipped, table,
                           clip_coef=None, average: float = 1.0, grad_scale_out=None) -> tuple:
    """(kernel, grid, args, kwargs) of one :func:`step_flags_` launch, unchecked (``table`` from
    :func:`counter_table`; see :mod:`._launch`)."""
    has_clip = clip_coef is not None
    return (_step_flags_kernel, (1,), (found_inf, found_out, not_skipped_out, skipped_steps, last_step_skipped, table,
                                       table.numel(), clip_coef if has_clip else found_inf, float(average),
                                       grad_scale_out if has_clip else found_out),
            dict(HAS_CLIP=has_clip, enable_fp_fusion=False))


@traced
def step_flags_(found_inf, found_out, not_skipped_out, skipped_steps, last_step_skipped, counters: list,
                clip_coef=None, average: float = 1.0, grad_scale_out=None, *, table: torch.Tensor | None = None,
                backend: str | None = None) -> None:
    """The step's scalars from its non-finite flag ``found_inf`` (0-d fp32, 0 or 1), in one launch:
    ``found_out = found_inf``, ``not_skipped_out = 1 - found_inf``, each of ``counters`` (0-d fp32 step counts)
    ``+= not_skipped_out``, ``skipped_steps`` (0-d int64) ``+= found_inf``, ``last_step_skipped`` (0-d bool)
    ``= found_inf > 0``, and with ``clip_coef`` (0-d fp32) ``grad_scale_out = clip_coef * average``. The bits of
    :func:`step_flags_ref`. ``table``: the counters' :func:`counter_table`, where the caller keeps one (else one is
    built for this call, a host-to-device copy); its length is checked, not its addresses."""
    device = found_inf.device if isinstance(found_inf, torch.Tensor) else None
    for t, name, dtype in ((found_inf, "found_inf", torch.float32), (found_out, "found_out", torch.float32),
                           (not_skipped_out, "not_skipped_out", torch.float32),
                           (skipped_steps, "skipped_steps", torch.int64),
                           (last_step_skipped, "last_step_skipped", torch.bool)):
        _check_scalar_tensor(t, name, dtype, device)
    for i, counter in enumerate(counters):
        _check_scalar_tensor(counter, f"counters[{i}]", torch.float32, device)
    if (clip_coef is None) != (grad_scale_out is None):
        raise ValueError("clip_coef and grad_scale_out go together: both tensors or both None")
    if clip_coef is not None:
        _check_scalar_tensor(clip_coef, "clip_coef", torch.float32, device)
        _check_scalar_tensor(grad_scale_out, "grad_scale_out", torch.float32, device)
    if isinstance(average, bool) or not isinstance(average, (int, float)) or not math.isfinite(average):
        raise ValueError(f"average must be a finite number, got {average!r}")
    if select_backend("step_flags_", device, backend) is Backend.TORCH:
        step_flags_ref(found_inf, found_out, not_skipped_out, skipped_steps, last_step_skipped, counters, clip_coef,
                       average, grad_scale_out)
        return
    if table is None:
        table = counter_table(counters, device)
    elif (not isinstance(table, torch.Tensor) or table.dtype != torch.int64 or table.device != device
          or table.shape != (len(counters),)):  # (its addresses are not read back: that would wait on the device)
        raise ValueError("table must be counter_table(counters) (the int64 addresses of the counters, on their device)")
    kernel, grid, args, kwargs = step_flags_launch_spec(found_inf, found_out, not_skipped_out, skipped_steps,
                                                        last_step_skipped, table, clip_coef, average, grad_scale_out)
    kernel[grid](*args, **kwargs)


@traced
def step_flags_kernel(spec: tuple, launches: dict, first) -> None:
    """``spec`` (from :func:`step_flags_launch_spec`) launched through the BoundLaunch in ``launches`` (``first()``,
    the checked :func:`step_flags_`, where there is none yet or an argument changed: :func:`._launch.launch`), in
    the kernel's profiler range, as every launcher."""
    _launch.launch(launches, "flags", spec, first)
