"""``Buffer``: one flat, padded, sharded storage for a list of tensors, and its collectives."""

from __future__ import annotations

import ast
from typing import List, Optional, Sequence

import torch
import torch.distributed as dist

from . import comm
from .layout import Layout, ShardPiece

__all__ = ["Buffer", "LayoutMismatchError", "DEFAULT_ALIGN"]

#: Default view alignment in elements. 64 elements is 128 B in bf16 (one GPU cache line / L2 sector group) and
#: 256 B in fp32, so every view, and (because padded_numel is a multiple of world_size * align) every shard, starts
#: on a boundary where the kernels' vector loads are never split. The cost is < 64 elements of padding per tensor.
DEFAULT_ALIGN = 64


class LayoutMismatchError(RuntimeError):
    """Raised by :meth:`Buffer.check_layout` when ranks built different layouts."""


def _default_device() -> torch.device:
    """The device a rank should use when none is given: :func:`tritonshard.comm.local_device` (indexed on CUDA,
    by ``LOCAL_RANK``; the CPU without CUDA)."""
    return comm.local_device()


class Buffer:
    """Contiguous storage with sharding and collective communication.

    Flattens a list of tensors into a single contiguous 1-D buffer, padded to be evenly divisible by
    ``world_size``. Keeps one view per tensor and a permanent local shard for reduce-scatter / all-gather.
    The class is agnostic to what the tensors represent (parameters, gradients, ...); higher layers decide.

    Layout of three tensors of 5, 3 and 6 elements over ``world_size=2``::

        align=1 (the seed layout)       offsets 0, 5, 8    padded_numel 14, shard_numel 7
          buffer  | a a a a a b b | b c c c c c c |
          shard      rank 0           rank 1

        align=4                          offsets 0, 8, 12   padded_numel 24, shard_numel 12
          buffer  | a a a a a . . . b b b . | c c c c c c . . . . . . |
          ('.' is padding: always zero, part of no tensor)

    ``layout.shard_pieces(rank)`` lists, per rank, which part of which tensor falls into its shard; above with
    ``align=1``, rank 0 owns ``a[0:5]`` and ``b[0:2]``, rank 1 owns ``b[2:3]`` and ``c[0:6]``.

    Aliasing invariants:

    * every view returned by :meth:`get_views` aliases the buffer (a write through a view is a write to the buffer);
    * the local shard is a view of ``get_data()[rank * shard_numel:(rank + 1) * shard_numel]``; it is created once
      and never reallocated, so kernels and optimizer state may hold on to it;
    * padding is zeroed at construction and no method of this class writes non-zero values into it; callers that
      write the whole buffer (reduce-scatter / all-gather of zero-padded data) keep it zero.

    Args:
        tensors: tensors whose shapes define the layout. Only shapes are read; data is not copied.
        rank: this process's rank in the group the collectives run on, in ``[0, world_size)``.
        world_size: number of ranks sharing the buffer, >= 1.
        dtype: element type of the buffer.
        device: where the buffer lives. Default: the current CUDA device (``LOCAL_RANK``), else the CPU.
        align: every view starts at a multiple of this many elements (see :data:`DEFAULT_ALIGN`);
            ``align=1`` reproduces the seed's layout exactly.
        group: default process group of the collectives (None: the default group). Its size and this process's
            rank in it must match ``world_size`` and ``rank`` (checked here when given, and at every collective).
        check_layout: run :meth:`check_layout` at construction (a collective: every rank must pass True).
        owners: optional owner rank of each tensor: each tensor then lies whole inside its owner's shard (see
            :class:`~tritonshard.layout.Layout`), so a reduce-scatter delivers whole tensors to their owners.
    """

    def __init__(
        self,
        tensors: List[torch.Tensor],
        rank: int,
        world_size: int,
        dtype: torch.dtype = torch.bfloat16,
        device: Optional[torch.device] = None,
        *,
        align: int = DEFAULT_ALIGN,
        group: Optional[dist.ProcessGroup] = None,
        check_layout: bool = False,
        owners: Optional[Sequence[int]] = None,
    ):
        if isinstance(tensors, torch.Tensor) or not isinstance(tensors, Sequence):
            raise TypeError(f"tensors must be a list of tensors, got {type(tensors).__name__}")
        for i, t in enumerate(tensors):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"tensors[{i}] must be a torch.Tensor, got {type(t).__name__}")
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
            raise ValueError(f"rank must be an int in [0, world_size={world_size}), got {rank!r}")
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype, got {dtype!r}")

        self.rank = rank
        self.world_size = world_size
        self.dtype = dtype
        self.device = torch.device(device) if device is not None else _default_device()
        self.group = group
        if group is not None:  # an explicit group must fit now; the default group is checked at the collective,
            self._check_group(group)  # so a Buffer can be built for another rank's layout (planning, references)

        self._shapes = [tuple(t.shape) for t in tensors]
        self.layout = Layout([t.numel() for t in tensors], world_size, align, owners=owners)
        self.padded_numel = self.layout.padded_numel
        self.shard_numel = self.layout.shard_numel
        self._padding = self.padded_numel - self.layout.total_numel

        self._data = torch.zeros(self.padded_numel, dtype=dtype, device=self.device)
        shard_start, shard_end = self.layout.shard_range(rank)
        self._local_shard = self._data[shard_start:shard_end]
        self._views: List[torch.Tensor] = [
            self._data[off:off + n].view(shape)
            for off, n, shape in zip(self.layout.offsets, self.layout.numels, self._shapes)
        ]
        if check_layout:
            self.check_layout()

    # ------------------------------------------------------------------ seed API
    def get_views(self) -> List[torch.Tensor]:
        """Return the pre-created views into the full buffer, one per input tensor, in input order."""
        return self._views

    def get_local_shard(self) -> torch.Tensor:
        """Return the permanent local shard tensor (``shard_numel`` elements, aliases the buffer)."""
        return self._local_shard

    def get_data(self) -> torch.Tensor:
        """Return the full contiguous 1-D buffer (``padded_numel`` elements)."""
        return self._data

    def reduce_scatter(self, group: Optional[dist.ProcessGroup] = None, *, op=dist.ReduceOp.SUM,
                       async_op: bool = False):
        """Reduce the full buffer over the group (``op``: SUM or AVG) into the local shard.

        The rest of the buffer is left as it was (it still holds this rank's un-reduced values).

        Returns:
            the work handle when ``async_op`` (call ``.wait()`` before reading the shard), else None.
        """
        group = self._resolve_group(group)
        if not comm.is_initialized() or self.world_size == 1:  # (one rank: the shard is the buffer)
            return _local_identity(async_op)
        return comm.reduce_scatter_single(self._local_shard, self._data, op=op, group=group, async_op=async_op)

    def all_gather(self, group: Optional[dist.ProcessGroup] = None, *, async_op: bool = False):
        """Gather every rank's local shard into the full buffer.

        Returns:
            the work handle when ``async_op`` (call ``.wait()`` before reading the buffer), else None.
        """
        group = self._resolve_group(group)
        if not comm.is_initialized() or self.world_size == 1:
            return _local_identity(async_op)
        return comm.all_gather_single(self._data, self._local_shard, group=group, async_op=async_op)

    # ------------------------------------------------------------------ additions
    @property
    def offsets(self) -> tuple[int, ...]:
        """Start of each tensor's view in the buffer, in elements."""
        return self.layout.offsets

    @property
    def numels(self) -> tuple[int, ...]:
        """Element count of each tensor."""
        return self.layout.numels

    @property
    def shapes(self) -> list[tuple[int, ...]]:
        return list(self._shapes)

    @property
    def align(self) -> int:
        return self.layout.align

    def shard_pieces(self, rank: Optional[int] = None) -> list[ShardPiece]:
        """Pieces of each tensor inside ``rank``'s shard (default: this rank). See :meth:`Layout.shard_pieces`."""
        return self.layout.shard_pieces(self.rank if rank is None else rank)

    def flatten_from(self, tensors: Sequence[torch.Tensor], *, accumulate: bool = False, scale: float = 1.0,
                     backend: Optional[str] = None) -> None:
        """Write ``tensors`` (one per view, same numels; fp32/bf16/fp16, any strides) into their views in one
        kernel launch per source dtype: ``view = round(scale * t + (view if accumulate else 0))``.

        See :func:`tritonshard.kernels.flatten_into`. Padding is never written.
        """
        from .kernels import flatten_into  # deferred: the Buffer's layout and collectives need no Triton

        if isinstance(tensors, torch.Tensor) or not isinstance(tensors, Sequence):
            raise TypeError(f"tensors must be a list of tensors, got {type(tensors).__name__}")
        if len(tensors) != len(self._views):
            raise ValueError(f"tensors has {len(tensors)} entries but the Buffer has {len(self._views)} views")
        for i, (t, n) in enumerate(zip(tensors, self.layout.numels)):
            if isinstance(t, torch.Tensor) and t.numel() != n:
                raise ValueError(f"tensors[{i}] has {t.numel()} elements but view {i} has {n}")
        flatten_into(self._data, tensors, self.layout.offsets, accumulate=accumulate, scale=scale, backend=backend)

    def zero_(self) -> "Buffer":
        """Zero the whole buffer, padding included."""
        self._data.zero_()
        return self

    def check_layout(self, group: Optional[dist.ProcessGroup] = None) -> None:
        """Verify that every rank of ``group`` built the same layout (a collective: all ranks must call it).

        One all-gather of a small int64 fingerprint; only on a mismatch, a second (object) all-gather fetches the
        descriptions so the error can name the difference.

        Raises:
            LayoutMismatchError: on every rank, naming the first field that differs and the ranks involved.
        """
        group = self._resolve_group(group)
        if not comm.is_initialized():
            return  # a single process agrees with itself
        mine = self._fingerprint()
        everyone = torch.empty(self.world_size * mine.numel(), dtype=mine.dtype, device=mine.device)
        comm.all_gather_single(everyone, mine, group=group)
        everyone = everyone.view(self.world_size, -1).cpu()
        if bool((everyone == everyone[0]).all()):
            return
        texts = comm.all_gather_text(repr(self._description()), group, self.world_size, self.device)
        descriptions = [ast.literal_eval(text) for text in texts]
        raise LayoutMismatchError(_describe_mismatch(descriptions))

    def __repr__(self) -> str:
        return (f"Buffer(tensors={len(self._views)}, dtype={self.dtype}, device={self.device}, rank={self.rank}, "
                f"world_size={self.world_size}, padded_numel={self.padded_numel}, shard_numel={self.shard_numel}, "
                f"align={self.align})")

    # ------------------------------------------------------------------ internals
    def _description(self) -> dict:
        return {"world_size": self.world_size, "dtype": str(self.dtype), "align": self.align,
                "num_tensors": len(self._shapes), "shapes": self._shapes, "padded_numel": self.padded_numel,
                "offsets": list(self.layout.offsets)}

    def _fingerprint(self) -> torch.Tensor:
        h = comm.digest(repr(self._description()).encode())
        values = [self.world_size, self.padded_numel, self.align, len(self._shapes), h]
        return torch.tensor(values, dtype=torch.int64, device=self.device)

    def _resolve_group(self, group):
        if group is None:
            group = self.group
        self._check_group(group)
        if not comm.is_initialized() and self.world_size != 1:
            raise RuntimeError(f"torch.distributed is not initialized; a collective over world_size="
                               f"{self.world_size} ranks needs dist.init_process_group() first")
        return group

    def _check_group(self, group) -> None:
        if not comm.is_initialized():
            if group is not None:
                raise ValueError("group was given but torch.distributed is not initialized")
            return
        size, rank = comm.group_size(group), comm.group_rank(group)
        if size != self.world_size:
            raise ValueError(f"group has {size} ranks but the Buffer was built with world_size={self.world_size}")
        if rank != self.rank:
            raise ValueError(f"this process is rank {rank} in group but the Buffer was built with rank={self.rank}")


class _CompletedWork:
    """Handle returned by async collectives that had nothing to communicate (one process, no process group)."""

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


#: the handle of a collective over one rank, which had nothing to do (shared: it holds no state)
COMPLETED = _CompletedWork()


def _local_identity(async_op: bool):
    # A group of this process alone (no torch.distributed, or a group of one rank; _resolve_group checked that it
    # is the Buffer's): reduce-scatter and all-gather over one rank are the identity on the buffer, whose local
    # shard is all of it. No call: a 1-rank NCCL group still launches a kernel and costs ~50 us of host time.
    return COMPLETED if async_op else None


def _describe_mismatch(descriptions: list) -> str:
    ref = descriptions[0]
    for r, d in enumerate(descriptions[1:], start=1):
        for key in ("world_size", "dtype", "align", "num_tensors", "padded_numel"):
            if d[key] != ref[key]:
                return f"Buffer layout differs across ranks: {key} is {ref[key]!r} on rank 0 but {d[key]!r} on rank {r}"
        for i, (a, b) in enumerate(zip(ref["shapes"], d["shapes"])):
            if a != b:
                return (f"Buffer layout differs across ranks: tensor {i} has shape {a} on rank 0 "
                        f"but {b} on rank {r}")
        for i, (a, b) in enumerate(zip(ref["offsets"], d["offsets"])):
            if a != b:
                return (f"Buffer layout differs across ranks: tensor {i} starts at element {a} on rank 0 "
                        f"but {b} on rank {r} (different owners)")
    return "Buffer layout differs across ranks (fingerprints differ)"
