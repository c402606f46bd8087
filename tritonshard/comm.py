"""Thin shims over ``torch.distributed`` collectives whose names changed across torch versions.

torch 2.13 renamed ``reduce_scatter_tensor`` -> ``reduce_scatter_single`` and ``all_gather_into_tensor`` ->
``all_gather_single``; the old names still exist there but emit a ``FutureWarning`` on every call. torch 2.11 and
2.12 have only the old names. We resolve the name once, at import, preferring the new one, so neither version
warns.
"""

from __future__ import annotations

import os
from typing import Optional

import torch
import torch.distributed as dist

__all__ = ["reduce_scatter_single", "all_gather_single", "all_to_all_single", "all_gather_text", "local_device",
           "group_size", "group_rank", "is_initialized"]

_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or getattr(dist, "reduce_scatter_tensor")
_all_gather = getattr(dist, "all_gather_single", None) or getattr(dist, "all_gather_into_tensor")


def reduce_scatter_single(output: torch.Tensor, input: torch.Tensor, op=dist.ReduceOp.SUM,
                          group: Optional[dist.ProcessGroup] = None, async_op: bool = False):
    """Reduce ``input`` (``world_size * output.numel()`` elements) over ``group``; rank r receives chunk r."""
    return _reduce_scatter(output, input, op=op, group=group, async_op=async_op)


def all_gather_single(output: torch.Tensor, input: torch.Tensor,
                      group: Optional[dist.ProcessGroup] = None, async_op: bool = False):
    """Concatenate every rank's ``input`` into ``output`` (``world_size * input.numel()`` elements)."""
    return _all_gather(output, input, group=group, async_op=async_op)


def all_to_all_single(output: torch.Tensor, input: torch.Tensor, group: Optional[dist.ProcessGroup] = None,
                      async_op: bool = False):
    """Equal splits: chunk j of ``input`` goes to rank j, and rank i's chunk lands in chunk i of ``output``."""
    return dist.all_to_all_single(output, input, group=group, async_op=async_op)


def local_device() -> torch.device:
    """The device this process should use: always with an index on CUDA.

    CUDA: ``LOCAL_RANK`` (set by torchrun) modulo the visible device count, else ``torch.cuda.current_device()``;
    never ``cuda:<global rank>``, which is wrong on every node but the first. Without CUDA: the CPU (gloo).
    Why the index: torch 2.11 rejects ``init_process_group(device_id=torch.device("cuda"))`` ("Please use a
    device_id with index"), and CUDA memory-stat calls given an index-less device raised "Invalid device argument"
    on the H200 (2026-11-30).
    """
    if torch.cuda.is_available():
        local_rank = os.environ.get("LOCAL_RANK")
        index = int(local_rank) % torch.cuda.device_count() if local_rank is not None else torch.cuda.current_device()
        return torch.device("cuda", index)
    return torch.device("cpu")


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def group_size(group: Optional[dist.ProcessGroup] = None) -> int:
    """World size of ``group`` (the default group for None); 1 when torch.distributed is not initialized."""
    return dist.get_world_size(group) if is_initialized() else 1


def group_rank(group: Optional[dist.ProcessGroup] = None) -> int:
    """This process's rank inside ``group``; 0 when torch.distributed is not initialized."""
    return dist.get_rank(group) if is_initialized() else 0


def all_gather_text(text: str, group, world_size: int, device: torch.device) -> list[str]:
    """All-gather one string per rank as bytes in tensors (no pickle, and no numpy, unlike all_gather_object)."""
    mine = torch.tensor(list(text.encode()), dtype=torch.uint8, device=device)
    lengths = torch.empty(world_size, dtype=torch.int64, device=device)
    all_gather_single(lengths, torch.tensor([mine.numel()], dtype=torch.int64, device=device), group=group)
    lengths = lengths.tolist()
    padded = torch.zeros(max(lengths), dtype=torch.uint8, device=device)
    padded[:mine.numel()] = mine
    everyone = torch.empty(world_size * padded.numel(), dtype=torch.uint8, device=device)
    all_gather_single(everyone, padded, group=group)
    rows = everyone.view(world_size, -1).cpu()
    return [bytes(row[:n].tolist()).decode() for row, n in zip(rows, lengths)]
