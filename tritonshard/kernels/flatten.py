"""Many-tensor gradient flatten: every tensor of a list written into one flat buffer, in one launch per dtype.

``flatten_into(out, tensors, offsets, *, accumulate=False, scale=1.0)`` computes, in fp32, for every i::

    out[offsets[i] : offsets[i] + n_i] = round(scale * tensors[i].flatten() + (out[...] if accumulate else 0))

``round`` is round-to-nearest-even to bf16 (bit-identical to torch) or nothing for an fp32 ``out``.

How one launch covers a list: an int64 table of source addresses, destination offsets and numels, and a block
schedule (for program p: which tensor, which element to start at). Every program copies one BLOCK of one tensor
(four, from an aligned 2-byte source: BLOCKS_PER_PROGRAM), so 1,000 tiny tensors cost one launch and one huge
tensor next to tiny ones still spreads over every SM. One launch
per source dtype, because the element type of a pointer is a compile-time property of the kernel, and per alignment
class: tensors whose source address and destination offset are multiples of 16 bytes (all of them, for a Buffer's
64-element layout and freshly allocated gradients) copy full blocks with 16-byte vector accesses; others, and the
last partial block of every tensor, go element by element. ``python -m benchmarks.compile_check`` shows the
difference in the generated PTX (``ld.global.v4.b32`` against ``ld.global.b16``).

Non-contiguous sources are made contiguous first (one extra copy of that tensor; ``t.flatten()``'s logical order is
what lands in ``out``); contiguous ones are read in place.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import numbers
import operator
from typing import Sequence

import torch
import triton
import triton.language as tl

from . import _launch
from ._dispatch import Backend, select_backend, traced
from .rounding import round_to_bf16, to_fp32

__all__ = ["flatten_into", "flatten_into_ref"]

_SRC_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
_OUT_DTYPES = (torch.bfloat16, torch.float32)
# 4096 elements per program: 8-16 KiB moved per program on a GPU, and few programs under the interpreter, whose
# cost is per program (about 0.5 ms per copy-cast block, PLATFORM.md).
BLOCK = 4096
#: blocks each program copies, by the source's bytes per element, for aligned tensors without accumulation (the
#: other launches: 1). The H200 measured the one-block kernel at 83 % of a device-to-device copy from bf16 (8 KB
#: read and 8 KB written per program; torch.cat 97 %) and at 100-102 % from fp32 (16 + 8 KB), 2026-11-30: four
#: blocks of a 2-byte source put 32 KB of loads in flight per program. Not yet measured on a GPU (benchmarks.run's
#: "flatten bf16->bf16" rows time both); the same bits either way. See _flatten_kernel.
BLOCKS_PER_PROGRAM = {2: 4, 4: 1}


@contextlib.contextmanager
def one_block_per_program():
    """Inside, every launch copies one block per program, the kernel measured before session 37: for benchmarks
    and compile_check, which time or compile it beside the default."""
    global BLOCKS_PER_PROGRAM
    default, BLOCKS_PER_PROGRAM = BLOCKS_PER_PROGRAM, {2: 1, 4: 1}
    try:
        yield
    finally:
        BLOCKS_PER_PROGRAM = default


@triton.jit
def _flatten_block(src, dst, offs, mask, scale, ACCUMULATE: tl.constexpr, OUT_IS_BF16: tl.constexpr):
    x = to_fp32(tl.load(src + offs, mask=mask)) * scale
    if ACCUMULATE:
        x = x + to_fp32(tl.load(dst + offs, mask=mask))
    if OUT_IS_BF16:
        tl.store(dst + offs, round_to_bf16(x), mask=mask)
    else:
        tl.store(dst + offs, x, mask=mask)


@triton.jit
def _flatten_kernel(src_ptrs, dst_offsets, numels, block_tensor, block_start, out_ptr, scale,
                    SRC_DTYPE: tl.constexpr, OUT_IS_BF16: tl.constexpr, ACCUMULATE: tl.constexpr,
                    ALIGNED: tl.constexpr, BLOCK: tl.constexpr, BLOCKS: tl.constexpr = 1):
    """Program p copies ``BLOCKS`` blocks of tensor ``block_tensor[p]`` from element ``block_start[p]`` on. With
    BLOCKS = 4 (aligned, no accumulation), a program of four full blocks issues the four loads before any store;
    the last program of a tensor goes block by block. Each element's arithmetic is the same either way."""
    pid = tl.program_id(0)
    t = tl.load(block_tensor + pid)
    start = tl.load(block_start + pid)
    n = tl.load(numels + t)
    src_addr = tl.load(src_ptrs + t)
    dst_off = tl.load(dst_offsets + t)
    if ALIGNED:
        # the host checked: every source address and destination byte offset is a multiple of 16 bytes, and
        # block starts are multiples of BLOCK. Addresses read from a table carry no alignment the compiler can
        # see; without these hints every access is scalar (2-byte stores for a bf16 out: compile_check's PTX).
        src_addr = tl.multiple_of(src_addr, 16)
        dst_off = tl.multiple_of(dst_off, 8 if OUT_IS_BF16 else 4)
        start = tl.multiple_of(start, BLOCK)
    # 64-bit arithmetic once per program for the block's base addresses, 32-bit offsets inside the block
    src = src_addr.to(tl.pointer_type(SRC_DTYPE)) + start
    dst = out_ptr + (dst_off + start)
    if ALIGNED:
        # the hint on the integer address does not survive the int-to-pointer cast: state it on the pointer too,
        # or every source load compiles to 2- or 4-byte accesses (only the stores were 16 bytes wide)
        src = tl.multiple_of(src, 16)
    offs = tl.arange(0, BLOCK)
    if BLOCKS == 1:
        if ALIGNED and start + BLOCK <= n:
            # a full block: no mask, so nothing limits the vector width (a mask built from a loaded n has
            # no known constancy and would force scalar accesses again)
            _flatten_block(src, dst, offs, None, scale, ACCUMULATE, OUT_IS_BF16)
        else:
            _flatten_block(src, dst, offs, offs < n - start, scale, ACCUMULATE, OUT_IS_BF16)
    elif ALIGNED and start + 4 * BLOCK <= n:  # BLOCKS == 4 (no accumulation): four full blocks, loads first
        x0 = tl.load(src + offs)
        x1 = tl.load(src + BLOCK + offs)
        x2 = tl.load(src + 2 * BLOCK + offs)
        x3 = tl.load(src + 3 * BLOCK + offs)
        _store_block(dst, offs, x0, scale, OUT_IS_BF16)
        _store_block(dst + BLOCK, offs, x1, scale, OUT_IS_BF16)
        _store_block(dst + 2 * BLOCK, offs, x2, scale, OUT_IS_BF16)
        _store_block(dst + 3 * BLOCK, offs, x3, scale, OUT_IS_BF16)
    else:  # a tensor's last program: block by block, a full one unmasked (vector accesses), none past the end
        for k in tl.static_range(BLOCKS):
            if start + (k + 1) * BLOCK <= n:
                _flatten_block(src + k * BLOCK, dst + k * BLOCK, offs, None, scale, ACCUMULATE, OUT_IS_BF16)
            elif start + k * BLOCK < n:
                _flatten_block(src + k * BLOCK, dst + k * BLOCK, offs, offs < n - (start + k * BLOCK), scale,
                               ACCUMULATE, OUT_IS_BF16)


@triton.jit
def _store_block(dst, offs, x, scale, OUT_IS_BF16: tl.constexpr):
    """:func:`_flatten_block`'s arithmetic and store for a full block already loaded (no accumulation)."""
    y = to_fp32(x) * scale
    if OUT_IS_BF16:
        tl.store(dst + offs, round_to_bf16(y))
    else:
        tl.store(dst + offs, y)


def flatten_into_ref(out: torch.Tensor, tensors: Sequence[torch.Tensor], offsets: Sequence[int], *,
                     accumulate: bool = False, scale: float = 1.0) -> None:
    """Pure-PyTorch reference (and the CPU fallback): the same arithmetic, one tensor at a time."""
    for t, off in zip(tensors, offsets):
        n = t.numel()
        if n == 0:
            continue
        dst = out[off:off + n]
        x = t.reshape(-1).float() * scale
        if accumulate:
            x = x + dst.float()
        dst.copy_(x.to(out.dtype))


def _validate(out, tensors, offsets, accumulate, scale) -> None:
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out must be a torch.Tensor, got {type(out).__name__}")
    if out.dim() != 1 or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous 1-D tensor, got shape {tuple(out.shape)}"
                         f"{'' if out.is_contiguous() else ' (non-contiguous)'}")
    if out.dtype not in _OUT_DTYPES:
        raise TypeError(f"out must be bfloat16 or float32, got {out.dtype}")
    if isinstance(tensors, torch.Tensor) or not isinstance(tensors, Sequence):
        raise TypeError(f"tensors must be a list of tensors, got {type(tensors).__name__}")
    if isinstance(offsets, torch.Tensor) or not isinstance(offsets, Sequence):
        raise TypeError(f"offsets must be a list of ints, got {type(offsets).__name__}")
    if len(tensors) != len(offsets):
        raise ValueError(f"tensors and offsets must have the same length, got {len(tensors)} and {len(offsets)}")
    if not isinstance(accumulate, bool):
        raise TypeError(f"accumulate must be a bool, got {type(accumulate).__name__}")
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a real number, got {type(scale).__name__}")
    ranges = []
    for i, (t, off) in enumerate(zip(tensors, offsets)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"tensors[{i}] must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in _SRC_DTYPES:
            raise TypeError(f"tensors[{i}] must be float32, bfloat16 or float16, got {t.dtype}")
        if t.device != out.device:
            raise ValueError(f"tensors[{i}] is on {t.device} but out is on {out.device}")
        if isinstance(off, bool) or not isinstance(off, numbers.Integral):
            raise TypeError(f"offsets[{i}] must be an int, got {type(off).__name__}")
        if off < 0 or off + t.numel() > out.numel():
            raise ValueError(f"offsets[{i}]={off} puts tensors[{i}] ({t.numel()} elements) outside out "
                             f"({out.numel()} elements)")
        if t.numel():
            ranges.append((int(off), int(off) + t.numel(), i))
    ranges.sort()
    for (s0, e0, i0), (s1, e1, i1) in zip(ranges, ranges[1:]):
        if s1 < e0:
            raise ValueError(f"tensors[{i0}] at [{s0}, {e0}) and tensors[{i1}] at [{s1}, {e1}) overlap in out")


class _TableCache:
    """Device-resident int64 tables, bounded LRU: the launch tables built and copied to the device once, not every
    call. Two instances: block schedules keyed by (device, offsets, numels), which depend only on which tensors
    are flattened where, and source-address tables keyed by (device, addresses). Gradients usually come back at the
    same addresses every step (caching allocator), and when they do not, only the address table is rebuilt (one
    small host-to-device copy). Sized for one entry per bucket, source dtype and alignment class of large models: a
    1B-parameter model at 25 MiB buckets has about 100 buckets, and 64 entries (an earlier bound) thrashed there,
    rebuilding and uploading every table every backward.
    """

    def __init__(self, build, capacity: int = 4096):
        self.build, self.capacity = build, capacity
        self._entries: collections.OrderedDict = collections.OrderedDict()

    def get(self, device, *key):
        key = (device, *key)
        hit = self._entries.get(key)
        if hit is not None:
            self._entries.move_to_end(key)
            return hit
        host = self.build(*key[1:])
        tables = tuple(x.to(device, non_blocking=True) for x in host) if device.type != "cpu" else host
        self._entries[key] = tables
        if len(self._entries) > self.capacity:
            self._entries.popitem(last=False)
        return tables


_schedules = _TableCache(_launch.block_schedule)
_address_tables = _TableCache(lambda ptrs: (torch.tensor(ptrs, dtype=torch.int64),))


@traced
def flatten_into(out: torch.Tensor, tensors: Sequence[torch.Tensor], offsets: Sequence[int], *,
                 accumulate: bool = False, scale: float = 1.0, backend: str | None = None) -> None:
    """Write (or accumulate) every tensor, scaled and rounded, into the flat ``out`` at its offset.

    Args:
        out: contiguous 1-D bf16 or fp32 tensor.
        tensors: fp32, bf16 or fp16 tensors of any shape, on ``out``'s device; zero-numel ones are skipped.
        offsets: element offset of each tensor in ``out``; the ranges must not overlap nor leave ``out``.
        accumulate: add to what ``out`` holds instead of overwriting it.
        scale: multiplies every source element first (fp32).
        backend: None (by device), "triton" or "torch"; see :mod:`tritonshard.kernels._dispatch`.
    """
    _validate(out, tensors, offsets, accumulate, scale)
    chosen = select_backend("flatten_into", out.device, backend)
    if chosen is Backend.TORCH:
        flatten_into_ref(out, tensors, offsets, accumulate=accumulate, scale=scale)
        return
    launch_unchecked(out, tensors, offsets, accumulate, scale)


def launch_unchecked(out: torch.Tensor, tensors: Sequence[torch.Tensor], offsets: Sequence[int], accumulate: bool,
                     scale: float = 1.0, launches: dict | None = None) -> None:
    """:func:`flatten_into`'s compiled launches without its checks: for a caller whose arguments are right by
    construction (ShardedOptimizer: its own buffer and offsets, and gradients that autograd gave the parameters'
    dtype and device). With ``launches`` (a dict the caller keeps, e.g. per bucket), each launch is bound once and
    replayed while its pointer tables are the cached ones (:mod:`._launch`)."""
    if launches is not None:
        # The tensors repeat step after step at the same addresses (the caching allocator hands backward the same
        # blocks): then the whole plan (groups, pointer tables, bound launches) is the last one, found by the
        # addresses and the offsets, ~0.2 us per tensor instead of the loop's ~2 (issue 20.5). An offset names a
        # parameter, which fixes the gradient's numel and dtype (torch checks them when param.grad is set); the
        # address alone does not: when other parameters get gradients (an unused expert, a branch not taken), the
        # allocator hands one of them the block another one had. Contiguity is checked, as the loop does.
        #
        # Many gradients do not all come back at their last addresses (the H200 traces of 2026-12-04: the 292
        # gradients of a 302M GPT at the end of every backward, the ~194 of a no-decay bucket): then a plan of one
        # aligned group, the usual case, keeps its place and its launch, and only its own address table is
        # rewritten (_retarget), instead of grouping again, a new table and Triton's checked launch (0.6-1.1 ms of
        # host time per flush there).
        ptrs = tuple(map(_data_ptr, tensors))
        offsets = tuple(offsets)
        plan_key = ("plan", accumulate, float(scale))
        plan = launches.get(plan_key)
        if (plan is not None and plan[3] == offsets and plan[1] is out and all(map(_is_contiguous, tensors))
                and (plan[0] == ptrs or _retarget(plan[4], ptrs, out))):
            if plan[0] != ptrs:
                launches[plan_key] = (ptrs, *plan[1:])
            for key, spec, first in plan[2]:
                _launch.launch(launches, key, spec, first)
            return
        steps: list = []
        own_table = None  # (the plan's own address table, the stream it was last written on), see _retarget
    # one launch per (source dtype, aligned): aligned = source address and destination byte offset both multiples
    # of 16 bytes (what a Buffer's 64-element alignment and the caching allocator give), so the kernel may use
    # 16-byte vector accesses; anything else takes the element-wise path
    if launches is None:
        ptrs = tuple(map(_data_ptr, tensors))
    offsets = tuple(map(int, offsets))
    size = out.element_size()
    groups: dict[tuple[torch.dtype, bool], tuple[tuple, tuple, tuple]] = {}
    copied = False  # a non-contiguous tensor went through a copy: its table entry is not its own address
    dtypes = {t.dtype for t in tensors}
    # (an OR over all addresses has a low bit set iff one of them has; the same for offsets, as the element size
    # is a power of two: no Python-level loop)
    if (len(dtypes) == 1 and all(map(_is_contiguous, tensors))
            and not functools.reduce(operator.or_, ptrs, out.data_ptr()) % 16
            and not functools.reduce(operator.or_, offsets, 0) * size % 16):
        # the usual case (gradients of one dtype, fresh allocations, a Buffer's layout): one aligned group, found
        # with a few passes of C-level iteration instead of a Python loop over the tensors (~1 us per tensor)
        numels = tuple(map(_numel, tensors))
        group = (ptrs, offsets, numels)
        if 0 in numels:
            group = tuple(tuple(x[i] for i, n in enumerate(numels) if n) for x in group)
        if group[2]:
            groups[(dtypes.pop(), True)] = group
    else:
        base_misaligned = out.data_ptr() % 16
        items: dict[tuple[torch.dtype, bool], list[tuple[torch.Tensor, int]]] = {}  # (holds the copies until launched)
        for t, off in zip(tensors, offsets):
            if t.numel():
                if not t.is_contiguous():
                    t, copied = t.contiguous(), True
                aligned = not base_misaligned and t.data_ptr() % 16 == 0 and (off * size) % 16 == 0
                items.setdefault((t.dtype, aligned), []).append((t, off))
        groups = {key: (tuple(t.data_ptr() for t, _ in pairs), tuple(o for _, o in pairs),
                        tuple(t.numel() for t, _ in pairs)) for key, pairs in items.items()}
    for (dtype, aligned), (group_ptrs, offs, numels) in groups.items():
        blocks = BLOCKS_PER_PROGRAM.get(dtype.itemsize, 1) if aligned and not accumulate else 1
        off_tab, numel_tab, block_tensor, block_start = _schedules.get(out.device, offs, numels, BLOCK * blocks)
        if launches is not None and aligned and len(groups) == 1 and group_ptrs == ptrs:
            # one aligned group of every tensor, in order: a table of its own, which _retarget may rewrite
            ptr_tab = torch.tensor(group_ptrs, dtype=torch.int64).to(out.device, non_blocking=True)
            own_table = (ptr_tab, _stream_key(out.device))
        else:
            ptr_tab, = _address_tables.get(out.device, group_ptrs)
        # no FMA contraction: scale * x + acc must round like the reference's separate multiply and add
        grid = (block_tensor.numel(),)
        args = (ptr_tab, off_tab, numel_tab, block_tensor, block_start, out, float(scale))
        kwargs = dict(SRC_DTYPE=_SRC_DTYPES[dtype], OUT_IS_BF16=out.dtype == torch.bfloat16, ACCUMULATE=accumulate,
                      ALIGNED=aligned, BLOCK=BLOCK, BLOCKS=blocks, enable_fp_fusion=False)
        if launches is None:
            _flatten_kernel[grid](*args, **kwargs)
        else:
            spec = (_flatten_kernel, grid, args, kwargs)
            first = functools.partial(_launch_checked, grid, args, kwargs)
            _launch.launch(launches, (dtype, aligned, accumulate), spec, first)
            steps.append(((dtype, aligned, accumulate), spec, first))
    if launches is not None and not copied:
        launches[plan_key] = (ptrs, out, steps, offsets, own_table)


def _stream_key(device: torch.device):
    """The raw handle of ``device``'s current stream, read as ShardedOptimizer reads it (no Stream object made);
    None off CUDA: the kernels run in order there."""
    if device.type != "cuda":
        return None
    return torch._C._cuda_getCurrentRawStream(device.index if device.index is not None else torch.cuda.current_device())


def _retarget(own_table, ptrs: tuple, out: torch.Tensor) -> bool:
    """Point a plan's launch at the same tensors' new addresses: its own address table (``own_table``, see
    launch_unchecked; the bound launch reads it through a pointer that does not change) rewritten in place. False,
    having changed nothing, where that would not be right: no table of its own (several groups, empty tensors),
    an address that is no multiple of 16 bytes (the launch was compiled for aligned sources), a graph being
    captured (no host-to-device copy there), or another stream than the last write's (the copy is ordered after
    the last launch that read the table only on the stream they share)."""
    if own_table is None or functools.reduce(operator.or_, ptrs, out.data_ptr()) % 16:
        return False
    table, stream = own_table
    if table.device.type == "cuda" and (torch.cuda.is_current_stream_capturing()
                                        or _stream_key(table.device) != stream):
        return False
    # (pageable source: the copy has taken it when copy_ returns; on the device it runs in stream order, after the
    # launches that read the old addresses)
    table.copy_(torch.tensor(ptrs, dtype=torch.int64), non_blocking=True)
    return True


_data_ptr, _is_contiguous, _numel = torch.Tensor.data_ptr, torch.Tensor.is_contiguous, torch.Tensor.numel


def _launch_checked(grid, args, kwargs) -> None:
    _flatten_kernel[grid](*args, **kwargs)
