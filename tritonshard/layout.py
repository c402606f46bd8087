"""Pure layout arithmetic for flat, sharded buffers.

Nothing here touches ``torch.distributed`` or allocates memory: given the element counts of a list of
tensors, a world size and an alignment, :class:`Layout` says where every tensor lives in the flat buffer and
which piece of it each rank owns.

Invariants (property-tested in ``tests/test_layout.py``):

* views are laid out in input order; view ``i`` starts at ``offsets[i]``, a multiple of ``align``;
* views never overlap; the gaps between them (alignment padding) and the tail padding belong to no tensor;
* ``padded_numel`` is a multiple of ``world_size * align`` (so every shard also starts aligned) and is the
  smallest such number that holds every view; with ``align == 1`` this is exactly
  ``ceil(sum(numels) / world_size) * world_size``, the seed ``Buffer``'s layout;
* rank ``r`` owns ``[r * shard_numel, (r + 1) * shard_numel)``; the :class:`ShardPiece` s of a rank cover every
  tensor element inside that range exactly once and never cross the shard's end.

Whole-tensor ownership (``owners=``, used for Muon, whose Newton-Schulz iteration needs whole matrices): tensor
``i`` is placed entirely inside rank ``owners[i]``'s shard (the tensors of one rank in input order, each aligned),
and ``shard_numel`` is the largest rank's share rounded up to ``align``. A reduce-scatter then hands every rank
the whole gradients of the tensors it owns, and the all-gather sends them back, at the price of the padding that
evens out the ranks' shares (``padding_numel``; balancing it is the caller's job, see ``balance_owners``).
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

__all__ = ["Layout", "ShardPiece", "align_up", "balance_owners", "newton_schulz_flops"]


def align_up(n: int, align: int) -> int:
    """Smallest multiple of ``align`` that is >= ``n``."""
    return -(-n // align) * align


@dataclasses.dataclass(frozen=True)
class ShardPiece:
    """The part of one tensor that falls inside one rank's shard.

    Attributes:
        tensor_index: index of the tensor in the list the layout was built from.
        tensor_start: first element of the piece, counted in the flattened tensor.
        tensor_end: one past the last element, counted in the flattened tensor.
        shard_start: where the piece starts inside the shard (0 is the shard's first element).
        shard_end: one past where the piece ends inside the shard.
    """

    tensor_index: int
    tensor_start: int
    tensor_end: int
    shard_start: int
    shard_end: int

    @property
    def numel(self) -> int:
        return self.tensor_end - self.tensor_start


class Layout:
    """Offsets of ``len(numels)`` tensors in one flat buffer split evenly over ``world_size`` ranks.

    Args:
        numels: element count of each tensor (zero allowed).
        world_size: number of shards, >= 1.
        align: every view starts at a multiple of this many elements, >= 1.
        owners: optional rank of each tensor: the whole tensor goes into that rank's shard (see the module
            docstring). None: the tensors are laid out back to back and the buffer is cut into equal shards.
    """

    def __init__(self, numels: Sequence[int], world_size: int, align: int = 1,
                 owners: Optional[Sequence[int]] = None):
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
        if isinstance(align, bool) or not isinstance(align, int) or align < 1:
            raise ValueError(f"align must be an int >= 1 (elements), got {align!r}")
        numels = tuple(int(n) for n in numels)
        for i, n in enumerate(numels):
            if n < 0:
                raise ValueError(f"numels[{i}] must be >= 0, got {n}")
        self.numels: tuple[int, ...] = numels
        self.world_size = world_size
        self.align = align

        self.owners: Optional[tuple[int, ...]] = None
        if owners is None:
            offsets = []
            end = 0
            for n in numels:
                start = align_up(end, align)
                offsets.append(start)
                end = start + n
            self.offsets: tuple[int, ...] = tuple(offsets)
            #: one past the last element of the last view (0 for no tensors)
            self.used_numel = end
            self.padded_numel = align_up(end, world_size * align)
            self.shard_numel = self.padded_numel // world_size
            return
        owners = tuple(owners)
        if len(owners) != len(numels):
            raise ValueError(f"owners has {len(owners)} entries but there are {len(numels)} tensors")
        for i, r in enumerate(owners):
            if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < world_size:
                raise ValueError(f"owners[{i}] must be a rank in [0, {world_size}), got {r!r}")
        self.owners = owners
        used = [0] * world_size  # elements of each rank's shard taken so far (views aligned inside the shard)
        local = []
        for n, r in zip(numels, owners):
            start = align_up(used[r], align)
            local.append(start)
            used[r] = start + n
        self.shard_numel = align_up(max(used, default=0), align)
        self.padded_numel = self.shard_numel * world_size
        self.offsets = tuple(r * self.shard_numel + start for r, start in zip(owners, local))
        self.used_numel = max((o + n for o, n in zip(self.offsets, numels)), default=0)

    def __len__(self) -> int:
        return len(self.numels)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Layout):
            return NotImplemented
        return ((self.numels, self.world_size, self.align, self.owners)
                == (other.numels, other.world_size, other.align, other.owners))

    def __hash__(self) -> int:
        return hash((self.numels, self.world_size, self.align, self.owners))

    def __repr__(self) -> str:
        return (f"Layout(tensors={len(self.numels)}, used_numel={self.used_numel}, padded_numel={self.padded_numel}, "
                f"world_size={self.world_size}, shard_numel={self.shard_numel}, align={self.align})")

    @property
    def padding_numel(self) -> int:
        """Elements of the buffer that belong to no tensor (alignment gaps and the shards' tails)."""
        return self.padded_numel - self.total_numel

    @property
    def total_numel(self) -> int:
        """Elements that belong to some tensor (excludes all padding)."""
        return sum(self.numels)

    def tensor_range(self, index: int) -> tuple[int, int]:
        """``[start, end)`` of tensor ``index`` in the flat buffer."""
        return self.offsets[index], self.offsets[index] + self.numels[index]

    def shard_range(self, rank: int) -> tuple[int, int]:
        """``[start, end)`` of ``rank``'s shard in the flat buffer."""
        self._check_rank(rank)
        return rank * self.shard_numel, (rank + 1) * self.shard_numel

    def shard_pieces(self, rank: int) -> list[ShardPiece]:
        """The pieces of every tensor that fall inside ``rank``'s shard, in buffer order.

        Zero-numel tensors and tensors that miss the shard contribute no piece.
        """
        lo, hi = self.shard_range(rank)
        pieces = []
        for i, (off, n) in enumerate(zip(self.offsets, self.numels)):
            start, end = max(off, lo), min(off + n, hi)
            if start < end:
                pieces.append(ShardPiece(i, start - off, end - off, start - lo, end - lo))
        return pieces

    def owner_ranks(self, index: int) -> range:
        """Ranks whose shard holds at least one element of tensor ``index`` (empty for zero-numel tensors)."""
        start, end = self.tensor_range(index)
        if start == end:
            return range(0)
        return range(start // self.shard_numel, (end - 1) // self.shard_numel + 1)

    def _check_rank(self, rank: int) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be an int in [0, {self.world_size}), got {rank!r}")


def newton_schulz_flops(shape: Sequence[int], steps: int = 5) -> int:
    """FLOPs of ``steps`` quintic Newton-Schulz iterations on a matrix of ``shape`` (as torch.optim.Muon runs them,
    on the wide orientation m <= n): per step X X^T (2 m^2 n), A A (2 m^3) and B X (2 m^2 n)."""
    m, n = sorted(int(x) for x in shape[:2])
    return steps * (4 * m * m * n + 2 * m ** 3)


def balance_owners(numels: Sequence[int], costs: Sequence[float], world_size: int,
                   loads: Optional[list] = None) -> list[int]:
    """An owner rank for each tensor of one buffer, for :class:`Layout` ``owners=``: largest first (by element
    count, then cost), each to the rank with the fewest elements of this buffer so far (the padding that evens out
    the shards is what the collectives pay for), ties going to the rank with the least total ``costs`` so far.

    ``loads``: per-rank cost carried over from earlier buffers (updated in place), so that several buffers balance
    the cost (Newton-Schulz FLOPs) over ranks together. Deterministic: every rank computes the same owners.
    """
    if loads is None:
        loads = [0.0] * world_size
    if len(loads) != world_size:
        raise ValueError(f"loads has {len(loads)} entries, expected world_size={world_size}")
    elems = [0] * world_size
    owners = [0] * len(numels)
    for i in sorted(range(len(numels)), key=lambda i: (-numels[i], -costs[i], i)):
        r = min(range(world_size), key=lambda r: (elems[r], loads[r], r))
        owners[i] = r
        elems[r] += numels[i]
        loads[r] += costs[i]
    return owners
