"""The parts of :mod:`tritonshard.checkpoint` that use torch.distributed.checkpoint (DCP), imported on the first
sharded save or load: importing DCP costs ~2 s of CPU per process (measured on the development machine: 3.9 s for
``import torch.distributed.checkpoint`` against 2.1 s for ``import torch``), which every rank of a run that never
saves, or has not saved yet, would otherwise pay at start-up."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch
import torch.distributed.checkpoint as dcp  # noqa: F401  (checkpoint.py calls dcp.save / dcp.load through here)
from torch.distributed.checkpoint.api import CheckpointException  # noqa: F401
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex, StorageMeta,
                                                   TensorProperties)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from .checkpoint import CheckpointError, CheckpointMismatchError, UnsafeCheckpointError, _MetadataUnpickler


class _SafeFileSystemReader(FileSystemReader):
    """DCP's file reader, its ``.metadata`` read through :class:`_MetadataUnpickler` instead of ``pickle.load``
    (which would run whatever code a crafted file names)."""

    #: the first refusal or read error (DCP turns it into an AssertionError message inside a CheckpointException;
    #: load_sharded raises this one instead)
    error: Optional[CheckpointError] = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        try:
            return self._read_metadata(kwargs.get("rank"))
        except CheckpointError as exc:
            if self.error is None:
                self.error = exc
            raise

    def _read_metadata(self, rank) -> Metadata:
        path = self._get_metadata_path(rank)
        with self.fs.create_stream(path, "rb") as f:
            try:
                metadata = _MetadataUnpickler(f, str(path)).load()
            except UnsafeCheckpointError:
                raise
            except Exception as exc:  # truncated or corrupt: say which file
                raise CheckpointError(f"{path} is not readable checkpoint metadata: {type(exc).__name__}: {exc}") \
                    from exc
        if not isinstance(metadata, Metadata):
            raise UnsafeCheckpointError(f"{path} holds a {type(metadata).__name__}, not DCP Metadata")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def _chunk(offset: int, numel: int) -> ChunkStorageMetadata:
    return ChunkStorageMetadata(offsets=torch.Size([offset]), sizes=torch.Size([numel]))


class _PiecesSavePlanner(DefaultSavePlanner):
    """Saves, under each key, this rank's piece of a flattened parameter as a chunk at its global offset.

    DCP stores chunks with offsets natively; what it has no public type for is a tensor split at arbitrary
    points (DTensor's Shard(0) fixes the split points, ShardedTensor is deprecated), so the write items are made
    here from ``pieces``: key -> (numel of the whole flattened parameter, offset of the piece, the piece).
    """

    def __init__(self, pieces: dict):
        super().__init__()
        self.pieces = pieces

    def create_local_plan(self):
        plan = super().create_local_plan()
        items = [WriteItem(index=MetadataIndex(key, torch.Size([offset])), type=WriteItemType.SHARD,
                           tensor_data=TensorWriteData(chunk=_chunk(offset, piece.numel()),
                                                       properties=TensorProperties.create_from_tensor(piece),
                                                       size=torch.Size([numel])))
                 for key, (numel, offset, piece) in self.pieces.items()]
        self.plan = dataclasses.replace(plan, items=list(plan.items) + items)
        return self.plan

    def resolve_data(self, write_item):
        if write_item.index.fqn in self.pieces:
            return self.pieces[write_item.index.fqn][2]
        return super().resolve_data(write_item)


class _PiecesLoadPlanner(DefaultLoadPlanner):
    """Reads into each of this rank's pieces (key -> (offset, destination)) the parts of the stored chunks that
    overlap it, whatever the world size and bucket layout that wrote them (DCP's resharding read plan)."""

    def __init__(self, targets: dict):
        super().__init__()
        self.targets = targets

    def create_local_plan(self):
        plan = super().create_local_plan()
        items = []
        for key, (offset, dest) in self.targets.items():
            stored = self.metadata.state_dict_metadata.get(key)
            if stored is None:
                raise CheckpointMismatchError(f"the checkpoint has no '{key}' (incomplete checkpoint)")
            items += create_read_items_for_chunk_list(key, stored, [_chunk(offset, dest.numel())])
        self.plan = dataclasses.replace(plan, items=list(plan.items) + items)
        return self.plan

    def resolve_tensor(self, read_item):
        key = read_item.dest_index.fqn
        if key not in self.targets:
            return super().resolve_tensor(read_item)
        (start,), (length,) = read_item.dest_offsets, read_item.lengths
        return self.targets[key][1].narrow(0, start, length)
