"""Post-reduce-scatter scale: ``x *= factor`` in place, with the sum of squares and a non-finite flag, in one pass.

``scale_(x, factor) -> (sum_sq, nonfinite)``: both are 0-d fp32 tensors on ``x``'s device, computed from the
values as stored (after rounding to ``x``'s dtype), so they describe exactly what the optimizer will read.
``nonfinite`` is 1.0 when any stored value is inf or NaN, else 0.0 (fp32, the convention of ``found_inf`` in
``torch.amp``). Nothing waits on the host.

``sum_sq_nonfinite(x, factor) -> (sum_sq, nonfinite)`` is the read-only pass the optimizer runs on a
reduce-scattered SUM shard: the same two numbers for ``factor * x`` computed in fp32, with nothing written. The
``1/d`` average is then applied inside the update's ``grad_scale``, so a gradient is rounded to bf16 once (by the
flatten) and the shard costs one read instead of a read and a write.

Deterministic: each program writes its partial sum and flag to its own slot; one single-program kernel then adds
the partials in a fixed order. No atomics, so the result is the same bits on every run.

Layout-independent: the squares are taken and summed in fp64 (the exact square of an fp32 value fits in fp64) and
rounded to fp32 once, at the end. Where the blocks fall (which depends on the bucket layout, and across ranks on
the shards) changes the fp64 sum by ~1e-16 relative, far below the fp32 result's rounding step (6e-8), so the
norm, and the clip coefficient made from it, come out the same bits whatever ``bucket_cap_mb`` is (tested in
tests/optim/test_bucket_invariance.py; measured before: fp32 partials moved the clip coefficient by an fp32 ulp
between bucket sizes, issue 21). fp64 costs nothing here: the pass is memory-bound (3 fp64 ops per element).

``fold_rows_`` is the ordered reduce-scatter's second half (``ordered_reduce=True`` in the optimizers): it adds
the ``d`` ranks' contributions to this rank's shard, which an all-to-all delivered as ``d`` rows, in rank order,
rounding to the grad dtype after every add (what the single-process reference and a 2-rank reduction compute),
writes the sum into the shard and takes the same statistics in the same pass.
"""

from __future__ import annotations

import numbers
from typing import Optional

import torch
import triton
import triton.language as tl

from ._launch import block_schedule, cdiv
from ._dispatch import Backend, select_backend, traced
from .rounding import round_to_bf16, to_fp32

__all__ = ["scale_", "scale_ref", "sum_sq_nonfinite", "sum_sq_nonfinite_ref", "sum_sq_workspace",
           "shared_sum_sq_workspace", "sum_sq_partials_", "finalize_sum_sq_", "fold_rows_", "fold_rows_ref",
           "segment_sums_"]

BLOCK = 4096
_FINALIZE_BLOCK = 1024
_FINALIZE_UNROLL = 4  # (1 or 4: see _finalize_kernel)
#: blocks of BLOCK elements each program of the optimizer's norm pass reads (1 or 4: see _partials_multi_kernel)
NORM_BLOCKS_PER_PROGRAM = 4
_X_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


@triton.jit
def _is_nonfinite64(s):
    # exponent all ones <=> inf or NaN; integer test, so no float op ever sees the inf (the interpreter's numpy
    # would warn on inf - inf)
    return (s.to(tl.uint64, bitcast=True) & 0x7FF0000000000000) == 0x7FF0000000000000


@triton.jit
def _scale_kernel(x_ptr, n, factor_ptr, factor_val, partial_sumsq, partial_nonfinite,
                  FACTOR_IS_TENSOR: tl.constexpr, X_IS_BF16: tl.constexpr, WRITE: tl.constexpr,
                  BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    if FACTOR_IS_TENSOR:
        factor = to_fp32(tl.load(factor_ptr))
    else:
        factor = factor_val
    y = to_fp32(tl.load(x_ptr + offs, mask=mask)) * factor
    if WRITE:  # scale_: the statistics describe the values as stored (rounded to x's dtype)
        if X_IS_BF16:
            stored = round_to_bf16(y)
            tl.store(x_ptr + offs, stored, mask=mask)
            y = to_fp32(stored)
        else:
            tl.store(x_ptr + offs, y, mask=mask)
    _store_stats(tl.where(mask, y, 0.0), partial_sumsq, partial_nonfinite, pid)


@triton.jit
def _store_stats(y, partial_sumsq, partial_nonfinite, pid):
    """This program's partial sum of squares (fp64: exact squares, layout-independent sums) and non-finite flag,
    of the fp32 values ``y`` (a block's; lanes past the data already 0).

    The flag is read off the sum: an fp64 sum of fp32 squares is inf or NaN exactly when one of the values is (the
    largest fp32 square is ~1.2e77 and a block holds 4096 of them, far below fp64's 1.8e308; a square is never
    negative, so no inf - inf). One test per block instead of an exponent test and a max-reduction over the block's
    elements (~3 of the ~8 instructions per element of the norm pass, which the H200 measured at ~48 % of the copy
    bandwidth at 1B, 2026-12-04): the same flags, bit for bit."""
    y64 = y.to(tl.float64)
    total = tl.sum(y64 * y64, axis=0)
    tl.store(partial_sumsq + pid, total)
    tl.store(partial_nonfinite + pid, _is_nonfinite64(total).to(tl.int32))


@triton.jit
def _partials_multi_kernel(x_ptrs, numels, slots, block_tensor, block_start, factor, partial_sumsq,
                           partial_nonfinite, X_DTYPE: tl.constexpr, ALIGNED: tl.constexpr, BLOCK: tl.constexpr,
                           BLOCKS: tl.constexpr):
    """:func:`_scale_kernel`'s read-only pass (WRITE=False, a number factor) over several tensors in one launch:
    program p reads ``BLOCKS`` blocks of tensor ``block_tensor[p]`` (at address ``x_ptrs[t]``, ``numels[t]``
    elements) from element ``block_start[p]`` on, and writes each block's statistics to slot ``slots[t] + block``,
    the slot that tensor's own launch gives that block. The same arithmetic per block (each block its own 1-D
    ``tl.sum`` with the same layout), so the same partials, bit for bit, for either ``BLOCKS``.

    BLOCKS = 4: the four blocks' loads are issued before any block is summed (32 KB of bf16 in flight per program
    instead of 8 KB, and the table reads, two dependent round trips to memory before the first data load, paid
    once per four blocks). BLOCKS = 1 is the kernel the H200 measured at ~48 % of the copy bandwidth in the 1B
    step (2026-12-04), where the single-tensor pass over 256M elements reached 61 %, in a time close to the
    memory time plus the fp64 conversions' (as if a program read its 8 KB, then summed it with nothing in
    flight). Which is faster is for a GPU to say (benchmarks.run's "norm pass" job times both); they differ in
    speed only."""
    pid = tl.program_id(0)
    t = tl.load(block_tensor + pid)
    start = tl.load(block_start + pid)
    n = tl.load(numels + t)
    addr = tl.load(x_ptrs + t)
    slot = tl.load(slots + t) + start // BLOCK
    if ALIGNED:  # the host checked: every address a multiple of 16 bytes (see flatten's kernel for the hints)
        addr = tl.multiple_of(addr, 16)
        start = tl.multiple_of(start, BLOCK)
    x = addr.to(tl.pointer_type(X_DTYPE)) + start
    if ALIGNED:
        x = tl.multiple_of(x, 16)
    offs = tl.arange(0, BLOCK)
    if BLOCKS == 1:  # (as measured on the H200: one block, the mask computed up front)
        mask = offs < n - start
        if ALIGNED and start + BLOCK <= n:
            y = to_fp32(tl.load(x + offs)) * factor  # a full block: unmasked, 16-byte loads, no select per element
        else:
            y = tl.where(mask, to_fp32(tl.load(x + offs, mask=mask)) * factor, 0.0)
        _store_stats(y, partial_sumsq, partial_nonfinite, slot)
    elif ALIGNED and start + 4 * BLOCK <= n:  # BLOCKS == 4, four full blocks: every load first, then the sums
        x0 = tl.load(x + offs)
        x1 = tl.load(x + BLOCK + offs)
        x2 = tl.load(x + 2 * BLOCK + offs)
        x3 = tl.load(x + 3 * BLOCK + offs)
        _store_stats(to_fp32(x0) * factor, partial_sumsq, partial_nonfinite, slot)
        _store_stats(to_fp32(x1) * factor, partial_sumsq, partial_nonfinite, slot + 1)
        _store_stats(to_fp32(x2) * factor, partial_sumsq, partial_nonfinite, slot + 2)
        _store_stats(to_fp32(x3) * factor, partial_sumsq, partial_nonfinite, slot + 3)
    else:  # a tensor's last program, or a misaligned tensor: block by block (a full one of an aligned tensor
        # unmasked: vector loads), none past the tensor's end
        for k in tl.static_range(BLOCKS):
            if ALIGNED and start + (k + 1) * BLOCK <= n:
                _store_stats(to_fp32(tl.load(x + k * BLOCK + offs)) * factor, partial_sumsq, partial_nonfinite,
                             slot + k)
            elif start + k * BLOCK < n:
                mask = offs < n - (start + k * BLOCK)
                y = tl.where(mask, to_fp32(tl.load(x + k * BLOCK + offs, mask=mask)) * factor, 0.0)
                _store_stats(y, partial_sumsq, partial_nonfinite, slot + k)


@triton.jit
def _fold_rows_kernel(rows_ptr, out_ptr, n, factor, partial_sumsq, partial_nonfinite, ROWS: tl.constexpr,
                      IS_BF16: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    row = rows_ptr + offs  # row r of the (ROWS, n) input: advanced by n per row (pointer arithmetic, no overflow)
    acc = to_fp32(tl.load(row, mask=mask, other=0.0))
    for _ in tl.static_range(1, ROWS):  # rank order, rounded to the grad dtype after every add
        row += n
        acc = acc + to_fp32(tl.load(row, mask=mask, other=0.0))
        if IS_BF16:
            acc = to_fp32(round_to_bf16(acc))
    if IS_BF16:
        tl.store(out_ptr + offs, round_to_bf16(acc), mask=mask)  # exact: acc holds a bf16 value
    else:
        tl.store(out_ptr + offs, acc, mask=mask)
    _store_stats(tl.where(mask, acc * factor, 0.0), partial_sumsq, partial_nonfinite, pid)


@triton.jit
def _finalize_kernel(partial_sumsq, partial_nonfinite, num_partials, sumsq_out, nonfinite_out, BLOCK: tl.constexpr,
                     UNROLL: tl.constexpr):
    """One program: lane l adds partials l, l + BLOCK, l + 2 BLOCK, ... in that order (fp64), then the lanes are
    summed. UNROLL = 4: four chunks' loads in flight per round trip to memory, added in the same order, so the
    same bits as one chunk per iteration (UNROLL = 1), which waited a memory latency per chunk: 0.41 ms of a 1B
    step on the H200 (320K partials, 2026-12-04), where the norm pass before it took 1.3."""
    acc = tl.zeros([BLOCK], dtype=tl.float64)
    flag = tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(0, num_partials, BLOCK * UNROLL):
        offs = start + tl.arange(0, BLOCK)
        if UNROLL == 1:
            mask = offs < num_partials
            acc += tl.load(partial_sumsq + offs, mask=mask, other=0.0)
            flag = tl.maximum(flag, tl.load(partial_nonfinite + offs, mask=mask, other=0))
        else:  # UNROLL == 4 (the loads first, then the adds in chunk order; masked lanes add +0.0, which changes
            # no sum of squares)
            o1, o2, o3 = offs + BLOCK, offs + 2 * BLOCK, offs + 3 * BLOCK
            s0 = tl.load(partial_sumsq + offs, mask=offs < num_partials, other=0.0)
            s1 = tl.load(partial_sumsq + o1, mask=o1 < num_partials, other=0.0)
            s2 = tl.load(partial_sumsq + o2, mask=o2 < num_partials, other=0.0)
            s3 = tl.load(partial_sumsq + o3, mask=o3 < num_partials, other=0.0)
            f0 = tl.load(partial_nonfinite + offs, mask=offs < num_partials, other=0)
            f1 = tl.load(partial_nonfinite + o1, mask=o1 < num_partials, other=0)
            f2 = tl.load(partial_nonfinite + o2, mask=o2 < num_partials, other=0)
            f3 = tl.load(partial_nonfinite + o3, mask=o3 < num_partials, other=0)
            acc += s0
            acc += s1
            acc += s2
            acc += s3
            flag = tl.maximum(tl.maximum(flag, tl.maximum(f0, f1)), tl.maximum(f2, f3))
    total = tl.sum(acc, axis=0)  # fp64; the store converts to out's dtype (fp32 or fp64)
    tl.store(sumsq_out, total.to(sumsq_out.dtype.element_ty))
    tl.store(nonfinite_out, (tl.max(flag, axis=0) > 0).to(nonfinite_out.dtype.element_ty))


@triton.jit
def _segment_sums_kernel(partial_sumsq, starts, counts, out, BLOCK: tl.constexpr):
    """Program i: ``out[i]`` = the sum of ``partial_sumsq[starts[i] : starts[i] + counts[i]]`` in fp64, lane l
    adding the segment's partials l, l + BLOCK, ... in that order, then the lanes summed (the order of
    :func:`_finalize_kernel` with one chunk per iteration, within each segment): deterministic."""
    i = tl.program_id(0)
    start = tl.load(starts + i)
    count = tl.load(counts + i)
    acc = tl.zeros([BLOCK], dtype=tl.float64)
    for k in range(0, count, BLOCK):
        offs = k + tl.arange(0, BLOCK)
        acc += tl.load(partial_sumsq + start + offs, mask=offs < count, other=0.0)
    tl.store(out + i, tl.sum(acc, axis=0))


def scale_ref(x: torch.Tensor, factor) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-PyTorch reference (and the CPU fallback): same rounding; the sum is taken by torch, in fp32."""
    f = factor.float() if isinstance(factor, torch.Tensor) else float(factor)
    x.copy_((x.float() * f).to(x.dtype))
    stored = x.float()
    sumsq = stored.double().square().sum().float()
    nonfinite = (~stored.isfinite()).any().float()
    return sumsq, nonfinite


def sum_sq_nonfinite_ref(x: torch.Tensor, factor=1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-PyTorch reference of the read-only pass: statistics of ``factor * x`` in fp32, ``x`` untouched."""
    f = factor.float() if isinstance(factor, torch.Tensor) else float(factor)
    y = x.float() * f
    return y.double().square().sum().float(), (~y.isfinite()).any().float()


def _validate(x, factor):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"x must be bfloat16 or float32, got {x.dtype}")
    if not x.is_contiguous():
        raise ValueError("x must be contiguous (it is scaled in place as a flat array)")
    if isinstance(factor, torch.Tensor):
        if factor.numel() != 1 or not factor.is_floating_point():
            raise ValueError(f"factor must be a float or a 1-element floating tensor, got shape "
                             f"{tuple(factor.shape)} {factor.dtype}")
        if factor.device != x.device:
            raise ValueError(f"factor is on {factor.device} but x is on {x.device}")
    elif isinstance(factor, bool) or not isinstance(factor, numbers.Real):
        raise TypeError(f"factor must be a float or a 0-d tensor, got {type(factor).__name__}")


@traced
def scale_(x: torch.Tensor, factor, *, backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``x *= factor`` in place; returns ``(sum of squares of the new x, non-finite flag)`` as 0-d fp32 tensors.

    Args:
        x: contiguous bf16 or fp32 tensor.
        factor: a Python number or a 1-element floating tensor on ``x``'s device (read on the device, no sync).
        backend: None (by device), "triton" or "torch".
    """
    _validate(x, factor)
    chosen = select_backend("scale_", x.device, backend)
    if chosen is Backend.TORCH:
        return scale_ref(x, factor)
    return _launch(x, factor, write=True)


def sum_sq_workspace(n: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-program partials a :func:`sum_sq_nonfinite` of ``n`` elements needs, to allocate once and pass as
    ``partials=`` (then a launch allocates nothing)."""
    blocks = cdiv(n, BLOCK)
    return (torch.empty(blocks, dtype=torch.float64, device=device),
            torch.empty(blocks, dtype=torch.int32, device=device))


def shared_sum_sq_workspace(numels, device) -> tuple[tuple[torch.Tensor, torch.Tensor], list]:
    """One workspace for several tensors of ``numels`` elements that share one :func:`finalize_sum_sq_`: returns it
    and, per tensor, the slices of it to pass to :func:`sum_sq_partials_`."""
    blocks = [cdiv(n, BLOCK) for n in numels]
    workspace = sum_sq_workspace(sum(blocks) * BLOCK, device)
    slices, start = [], 0
    for b in blocks:
        slices.append(tuple(t[start:start + b] for t in workspace))
        start += b
    return workspace, slices


def _check_stats_out(out, device, dtypes=(torch.float32,)) -> None:
    """``out`` receives [sum of squares, non-finite flag]."""
    if (not isinstance(out, torch.Tensor) or out.dtype not in dtypes or tuple(out.shape) != (2,)
            or out.device != device or not out.is_contiguous()):
        names = " or ".join(str(d).replace("torch.", "") for d in dtypes)
        raise ValueError(f"out must be a {names} tensor of shape (2,) on {device}, contiguous")


@traced
def sum_sq_nonfinite(x: torch.Tensor, factor=1.0, *, out: torch.Tensor | None = None, partials=None,
                     backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Read-only: ``(sum of squares of factor * x, non-finite flag)`` as 0-d fp32 tensors, ``factor * x`` in fp32
    and never stored. Same arguments as :func:`scale_`, and, to run without allocating (the optimizer's steady
    state): ``out``, a 2-element fp32 tensor that receives [sum_sq, flag] (the returned tensors are its two
    elements), and ``partials`` from :func:`sum_sq_workspace`."""
    _validate(x, factor)
    if out is not None:
        _check_stats_out(out, x.device)
    if partials is not None:
        _check_partials(partials, x.numel(), x.device)
    chosen = select_backend("sum_sq_nonfinite", x.device, backend)
    if chosen is Backend.TORCH:
        result = sum_sq_nonfinite_ref(x, factor)
        if out is None:
            return result
        torch.stack(result, out=out)
        return out[0], out[1]
    return _launch(x, factor, write=False, out=out, partials=partials)


def _check_partials(partials, n: int, device) -> None:
    want = cdiv(n, BLOCK)
    if (not isinstance(partials, (tuple, list)) or len(partials) != 2
            or not all(isinstance(t, torch.Tensor) for t in partials)
            or partials[0].dtype != torch.float64 or partials[1].dtype != torch.int32
            or partials[0].numel() != want or partials[1].numel() != want
            or partials[0].device != device or partials[1].device != device):
        raise ValueError(f"partials must be sum_sq_workspace({n}) (or slices of that size of a larger one): float64 "
                         f"and int32, {want} elements each, on {device}")


@traced
def sum_sq_partials_(x: torch.Tensor, factor, partials, *, backend: str | None = None) -> None:
    """The first half of :func:`sum_sq_nonfinite`, for several tensors that share one finalize: writes one
    partial sum of squares and one non-finite flag per program of ``BLOCK`` elements into ``partials`` (from
    :func:`sum_sq_workspace`, or same-sized slices of one larger workspace). ShardedOptimizer runs it per bucket
    into its slice of one workspace, then :func:`finalize_sum_sq_` once per step."""
    _validate(x, factor)
    _check_partials(partials, x.numel(), x.device)
    chosen = select_backend("sum_sq_partials_", x.device, backend)
    n = x.numel()
    if n == 0:
        return
    if chosen is Backend.TORCH:
        _partials_ref(x.float() * (factor.float() if isinstance(factor, torch.Tensor) else float(factor)), partials)
        return
    kernel, grid, args, kwargs = partials_launch_spec(x, factor, partials)
    kernel[grid](*args, **kwargs)


def partials_launch_spec(x: torch.Tensor, factor, partials) -> tuple:
    """(kernel, grid, args, kwargs) of one :func:`sum_sq_partials_` launch, unchecked (see :mod:`._launch`)."""
    is_tensor = isinstance(factor, torch.Tensor)
    return (_scale_kernel, (partials[0].numel(),),
            (x, x.numel(), factor if is_tensor else x, 0.0 if is_tensor else float(factor), partials[0], partials[1]),
            dict(FACTOR_IS_TENSOR=is_tensor, X_IS_BF16=x.dtype == torch.bfloat16, WRITE=False, BLOCK=BLOCK,
                 enable_fp_fusion=False))


def partials_multi_launch_spec(xs: list, factor: float, partials: list, *,
                               blocks_per_program: int = NORM_BLOCKS_PER_PROGRAM) -> Optional[tuple]:
    """(kernel, grid, args, kwargs) of one launch that writes what :func:`sum_sq_partials_` writes for every
    ``(xs[i], factor, partials[i])``, unchecked, the tables built now (on the host, copied without a sync): for a
    caller that launches it every step on the same tensors (ShardedOptimizer: every bucket's grad shard into its
    slice of one workspace). ``partials`` must be slices of one workspace; ``factor`` a Python number;
    ``blocks_per_program`` 1 or 4 (the same partials; benchmarks compare their speed). None when the tensors
    differ in dtype or device, or there is nothing to read."""
    if blocks_per_program not in (1, 4):
        raise ValueError(f"blocks_per_program must be 1 or 4, got {blocks_per_program!r}")
    if not xs or len({(x.dtype, x.device) for x in xs}) != 1 or xs[0].dtype not in _X_DTYPES:
        return None
    sums, flags = partials[0]
    base_sums, base_flags = sums.data_ptr(), flags.data_ptr()
    ptrs, numels, slots = [], [], []
    for x, (p_sums, p_flags) in zip(xs, partials):
        if p_sums.numel() != cdiv(x.numel(), BLOCK) or p_flags.numel() != p_sums.numel():
            return None
        if not x.numel():  # (no slot: an empty slice's data_ptr() is 0)
            continue
        slot, rest = divmod(p_sums.data_ptr() - base_sums, 8)
        if rest or (p_flags.data_ptr() - base_flags) != 4 * slot:
            return None  # (not slices of one workspace at matching places)
        ptrs.append(x.data_ptr())
        numels.append(x.numel())
        slots.append(slot)
    if not ptrs:
        return None
    device = xs[0].device
    # a program per blocks_per_program blocks of a tensor (its last program may hold fewer)
    slot_tab, numel_tab, block_tensor, block_start = block_schedule(slots, numels, BLOCK * blocks_per_program)
    tables = [t.to(device, non_blocking=True)
              for t in (torch.tensor(ptrs, dtype=torch.int64), numel_tab, slot_tab, block_tensor, block_start)]
    aligned = not any(p % 16 for p in ptrs)
    return (_partials_multi_kernel, (block_tensor.numel(),), (*tables, float(factor), sums, flags),
            dict(X_DTYPE=_X_DTYPES[xs[0].dtype], ALIGNED=aligned, BLOCK=BLOCK, BLOCKS=blocks_per_program,
                 enable_fp_fusion=False))


def _partials_ref(y: torch.Tensor, partials) -> None:
    """The kernels' per-block statistics of the fp32 values ``y``, in PyTorch (fp64 squares and sums)."""
    y = torch.nn.functional.pad(y, (0, partials[0].numel() * BLOCK - y.numel())).view(-1, BLOCK)
    partials[0].copy_(y.double().square().sum(1))
    partials[1].copy_((~y.isfinite()).any(1))


def fold_rows_ref(rows: torch.Tensor) -> torch.Tensor:
    """Reference: the rows of ``rows`` (d, n) added in row order, rounded to ``rows.dtype`` after every add."""
    acc = rows[0].clone()
    for r in range(1, rows.shape[0]):
        acc = (acc.float() + rows[r].float()).to(rows.dtype)
    return acc


@traced
def fold_rows_(rows: torch.Tensor, out: torch.Tensor, factor: float, partials, *,
               backend: str | None = None) -> None:
    """``out = rows[0] + rows[1] + ... + rows[d-1]``, added in that order and rounded to ``out.dtype`` after every
    add (:func:`fold_rows_ref`), and, in the same pass, the per-block statistics of ``factor * out`` into
    ``partials`` as :func:`sum_sq_partials_` writes them.

    Args:
        rows: (d, n) contiguous, bf16 or fp32: row r is rank r's contribution (an all-to-all's output).
        out: n elements, ``rows.dtype``, contiguous; may not overlap ``rows``.
        factor: a Python number (the optimizer's 1/d).
        partials: from :func:`sum_sq_workspace` (n), or same-sized slices of a larger one.
    """
    if not isinstance(rows, torch.Tensor) or rows.dim() != 2 or not rows.is_contiguous():
        raise ValueError(f"rows must be a contiguous 2-D tensor (ranks, n), got "
                         f"{tuple(rows.shape) if isinstance(rows, torch.Tensor) else type(rows).__name__}")
    _validate(out, factor)
    if isinstance(factor, torch.Tensor):
        raise TypeError("factor must be a Python number here")
    if rows.dtype != out.dtype or rows.shape[1] != out.numel() or rows.device != out.device:
        raise ValueError(f"out must have rows.shape[1] = {rows.shape[1]} elements of {rows.dtype} on {rows.device}, "
                         f"got {out.numel()} of {out.dtype} on {out.device}")
    if rows.shape[0] < 1:
        raise ValueError("rows must have at least one row")
    _check_partials(partials, out.numel(), out.device)
    chosen = select_backend("fold_rows_", out.device, backend)
    n = out.numel()
    if n == 0:
        return
    if chosen is Backend.TORCH:
        out.copy_(fold_rows_ref(rows))
        _partials_ref(out.float() * float(factor), partials)
        return
    kernel, grid, args, kwargs = fold_rows_launch_spec(rows, out, factor, partials)
    kernel[grid](*args, **kwargs)


def fold_rows_launch_spec(rows: torch.Tensor, out: torch.Tensor, factor: float, partials) -> tuple:
    """(kernel, grid, args, kwargs) of one :func:`fold_rows_` launch, unchecked (see :mod:`._launch`)."""
    return (_fold_rows_kernel, (partials[0].numel(),),
            (rows, out, out.numel(), float(factor), partials[0], partials[1]),
            dict(ROWS=rows.shape[0], IS_BF16=out.dtype == torch.bfloat16, BLOCK=BLOCK, enable_fp_fusion=False))


@traced
def finalize_sum_sq_(partials, out: torch.Tensor, *, backend: str | None = None) -> None:
    """``out = [sum of partials[0], 1.0 if any partials[1] else 0.0]``: one single-program launch that adds the
    partials in a fixed order (deterministic), in fp64; ``out`` is float32 (the sum rounded once) or float64."""
    if (len(partials) != 2 or partials[0].dtype != torch.float64 or partials[1].dtype != torch.int32
            or partials[0].numel() != partials[1].numel()):
        raise ValueError("partials must be (float64, int32) tensors of one length (sum_sq_workspace)")
    _check_stats_out(out, partials[0].device, (torch.float32, torch.float64))
    chosen = select_backend("finalize_sum_sq_", out.device, backend)
    if chosen is Backend.TORCH:
        out[0].copy_(partials[0].sum())
        out[1].copy_((partials[1] > 0).any())
        return
    kernel, grid, args, kwargs = finalize_launch_spec(partials, out)
    kernel[grid](*args, **kwargs)


def finalize_launch_spec(partials, out: torch.Tensor) -> tuple:
    """(kernel, grid, args, kwargs) of one :func:`finalize_sum_sq_` launch, unchecked (see :mod:`._launch`).
    ``out[1:]`` is a new view at every call: a caller that replays the launch passes the same ``out`` and keeps
    the spec it got."""
    return (_finalize_kernel, (1,), (partials[0], partials[1], partials[0].numel(), out, out[1:]),
            dict(BLOCK=_FINALIZE_BLOCK, UNROLL=_FINALIZE_UNROLL, enable_fp_fusion=False))


def _check_segments(sums: torch.Tensor, starts: torch.Tensor, counts: torch.Tensor, out: torch.Tensor) -> None:
    if not isinstance(sums, torch.Tensor) or sums.dtype != torch.float64 or sums.dim() != 1:
        raise ValueError("sums must be a 1-D float64 tensor (the partial sums of squares of sum_sq_workspace)")
    n = out.numel() if isinstance(out, torch.Tensor) else -1
    for name, t in (("starts", starts), ("counts", counts)):
        if (not isinstance(t, torch.Tensor) or t.dtype != torch.int64 or t.dim() != 1 or t.numel() != n
                or t.device != sums.device):
            raise ValueError(f"{name} must be a 1-D int64 tensor on {sums.device} with one element per segment "
                             f"(out's {n})")
    if (not isinstance(out, torch.Tensor) or out.dtype != torch.float64 or out.dim() != 1 or out.device != sums.device
            or not out.is_contiguous()):
        raise ValueError(f"out must be a contiguous 1-D float64 tensor on {sums.device}")


@traced
def segment_sums_(sums: torch.Tensor, starts: torch.Tensor, counts: torch.Tensor, out: torch.Tensor, *,
                  backend: str | None = None) -> None:
    """``out[i] = sums[starts[i] : starts[i] + counts[i]].sum()`` in fp64, one program per segment, in a fixed
    order (deterministic): the per-tensor totals of a :func:`sum_sq_partials_` launch over several tensors (each
    tensor's partials one segment of the workspace). ShardedOptimizer's per-parameter gradient norms (torch's
    ``clip_grad_norm_`` over ``model.parameters()``, what HF Trainer and accelerate call) take them in one launch
    over every piece of the grad shards, instead of a norm op per piece. The segments must lie within ``sums``
    (read on the device: not checked here)."""
    _check_segments(sums, starts, counts, out)
    chosen = select_backend("segment_sums_", out.device, backend)
    if out.numel() == 0:
        return
    if chosen is Backend.TORCH:
        for i, (a, c) in enumerate(zip(starts.tolist(), counts.tolist())):
            out[i] = sums[a:a + c].sum()
        return
    kernel, grid, args, kwargs = segment_sums_launch_spec(sums, starts, counts, out)
    kernel[grid](*args, **kwargs)


def segment_sums_launch_spec(sums: torch.Tensor, starts: torch.Tensor, counts: torch.Tensor,
                             out: torch.Tensor) -> tuple:
    """(kernel, grid, args, kwargs) of one :func:`segment_sums_` launch, unchecked (see :mod:`._launch`)."""
    return (_segment_sums_kernel, (out.numel(),), (sums, starts, counts, out),
            dict(BLOCK=_FINALIZE_BLOCK, enable_fp_fusion=False))


def _launch(x: torch.Tensor, factor, write: bool, out=None, partials=None) -> tuple[torch.Tensor, torch.Tensor]:
    n = x.numel()
    num_blocks = cdiv(n, BLOCK)
    partial_sumsq, partial_nonfinite = partials if partials is not None else sum_sq_workspace(n, x.device)
    if out is not None:  # two 0-d views of the caller's table
        sumsq, nonfinite = out[0], out[1]
    else:  # two tensors, not views of one: a custom op's outputs may not alias each other
        sumsq = torch.empty((), dtype=torch.float32, device=x.device)
        nonfinite = torch.empty((), dtype=torch.float32, device=x.device)
    is_tensor = isinstance(factor, torch.Tensor)
    if num_blocks:
        _scale_kernel[(num_blocks,)](
            x, n, factor if is_tensor else x, 0.0 if is_tensor else float(factor), partial_sumsq, partial_nonfinite,
            FACTOR_IS_TENSOR=is_tensor, X_IS_BF16=x.dtype == torch.bfloat16, WRITE=write, BLOCK=BLOCK,
            enable_fp_fusion=False)
    _finalize_kernel[(1,)](partial_sumsq, partial_nonfinite, num_blocks, sumsq, nonfinite, BLOCK=_FINALIZE_BLOCK,
                           UNROLL=_FINALIZE_UNROLL, enable_fp_fusion=False)
    return sumsq, nonfinite
