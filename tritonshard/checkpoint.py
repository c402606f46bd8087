"""Checkpoints that survive: atomic writes, world-size-independent content, sharded save with resharding on load.

Two ways to save a :class:`~tritonshard.ShardedOptimizer`:

* ``opt.state_dict()`` + :func:`atomic_save`: one file in ``torch.optim``'s format, gathered on every rank
  (12 B/param for AdamW, transiently). Simple, and loadable by any world size.
* :func:`save_sharded` / :func:`load_sharded`: every rank writes only the slices it owns (its shard pieces, each with
  its global offset inside the flattened parameter), plus one small metadata file. Loading at any world size and
  bucket size reads, on each rank, only the byte ranges of the old files that overlap its new pieces
  (``torch.load(mmap=True)``), so nothing is ever gathered on one rank.

Why not ``torch.distributed.checkpoint``: a rank's piece of a parameter is an arbitrary contiguous range of the
flattened tensor (the flat buffer is cut into equal shards regardless of parameter boundaries). DCP expresses such
ranges only through ``ShardedTensor``, deprecated since torch 2.13 (it warns on every use), or ``DTensor``, whose
``Shard(0)`` placement fixes the split points; using it would need an all-to-all exchange per save and load. The
format here is the same idea (per-rank files with global offsets, a metadata file), 100 lines, and no deprecated
API.

Atomicity: every file is written to a temporary name, fsynced and renamed into place; a sharded checkpoint is
written into ``<path>.partial`` and renamed to ``<path>`` by rank 0 only once every rank has finished, and
:func:`save_checkpoint` advances a ``latest`` pointer file (written atomically) only after that. A crash at any
point leaves the previous checkpoint loadable and never a half-written one that looks valid. Loading never
unpickles code: ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import ast
import os
import shutil
from typing import Any, Optional

import torch
import torch.distributed as dist

from . import comm

__all__ = ["atomic_save", "load_file", "save_sharded", "load_sharded", "save_checkpoint", "latest_checkpoint",
           "CheckpointMismatchError"]

_FORMAT = 1


class CheckpointMismatchError(ValueError):
    """The checkpoint does not fit the optimizer (parameters, shapes or groups differ)."""


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_save(obj: Any, path: str) -> None:
    """``torch.save`` to ``path`` atomically: a reader sees the old file or the complete new one, never a part."""
    directory = os.path.dirname(os.path.abspath(path))
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(directory)


def load_file(path: str, map_location=None, mmap: bool = False) -> Any:
    """``torch.load`` with ``weights_only=True``: tensors and plain containers only, never pickled code."""
    return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)


def _barrier(opt) -> None:
    """Every rank of the optimizer: its shard group, and with hybrid sharding its replica group too."""
    if comm.is_initialized() and opt.world_size > 1:
        dist.barrier(group=opt.process_group)
    if comm.is_initialized() and opt.replica_size > 1:
        dist.barrier(group=opt.replica_group)


def _is_lead(opt) -> bool:
    return opt.rank == 0 and opt.replica_rank == 0


def _param_signature(opt) -> list[dict]:
    return [{"index": i, "group": gi, "shape": list(p.shape), "trainable": p in opt._bucket_of}
            for i, gi, p in opt._indexed_params()]


def save_sharded(opt, path: str, *, extra: Optional[dict] = None) -> None:
    """Write ``opt``'s state as a sharded checkpoint directory ``path`` (a collective: every rank calls it).

    ``extra``: small picklable-free data (numbers, strings, tensors, lists, dicts) stored in the metadata by rank 0,
    e.g. the training step and RNG states.
    """
    opt.wait_for_params()
    index_of = {p: i for i, _, p in opt._indexed_params()}
    partial = f"{path}.partial"
    if _is_lead(opt) and os.path.exists(partial):
        shutil.rmtree(partial)  # left by a save that died
    _barrier(opt)
    os.makedirs(partial, exist_ok=True)
    pieces = {}
    for b in opt.buckets:
        for piece in b.param_buffer.shard_pieces():
            i = index_of[b.params[piece.tensor_index]]
            sl = slice(piece.shard_start, piece.shard_end)
            pieces[i] = {"start": piece.tensor_start,
                         **{name: t[sl].detach().cpu().clone()
                            for name, t in (("master", b.master_fp32()), *b.state.items())}}
    if opt.replica_rank == 0:  # hybrid sharding: replicas hold the same shards, the first one writes them
        atomic_save({"format": _FORMAT, "rank": opt.rank, "pieces": pieces},
                    os.path.join(partial, f"rank{opt.rank:05d}.pt"))
    # which rank holds which range of which parameter: lets a loader open only the files it needs
    ranges = {index_of[b.params[pc.tensor_index]]: (pc.tensor_start, pc.tensor_end)
              for b in opt.buckets for pc in b.param_buffer.shard_pieces()}
    everyone = _all_gather_objects(opt, ranges)
    if _is_lead(opt):
        steps = {index_of[p]: float(b.step) for b in opt.buckets for p in b.params}
        groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
        meta = {"format": _FORMAT, "world_size": opt.world_size, "params": _param_signature(opt),
                "param_groups": groups, "steps": steps, "skipped_steps": int(opt.skipped_steps),
                "state_names": list(opt._state_names), "ranges": everyone, "extra": extra or {},
                "scaler": opt._scaler_state()}
        atomic_save(meta, os.path.join(partial, "meta.pt"))
    _barrier(opt)
    if _is_lead(opt):
        if os.path.exists(path):
            old = f"{path}.old"
            if os.path.exists(old):
                shutil.rmtree(old)
            os.replace(path, old)
            os.replace(partial, path)
            shutil.rmtree(old)
        else:
            os.replace(partial, path)
        _fsync_dir(os.path.dirname(os.path.abspath(path)))
    _barrier(opt)


def _all_gather_objects(opt, obj) -> list:
    """All-gather a literal (dict of ints and tuples) through its repr: no pickle, no numpy."""
    if not (comm.is_initialized() and opt.world_size > 1):
        return [obj]
    texts = comm.all_gather_text(repr(obj), opt.process_group, opt.world_size, opt.device)
    return [ast.literal_eval(t) for t in texts]


def _check_signature(opt, meta) -> None:
    ours, theirs = _param_signature(opt), meta["params"]
    if len(ours) != len(theirs):
        raise CheckpointMismatchError(f"the checkpoint has {len(theirs)} parameters, the optimizer {len(ours)}")
    n_groups = len(opt.param_groups)
    if len(meta["param_groups"]) != n_groups:
        raise CheckpointMismatchError(f"the checkpoint has {len(meta['param_groups'])} param groups, the "
                                      f"optimizer {n_groups}")
    for a, b in zip(ours, theirs):
        for key, what in (("shape", "shape"), ("group", "param group"), ("trainable", "trainable flag")):
            if a[key] != b[key]:
                raise CheckpointMismatchError(f"parameter {a['index']}: {what} is {b[key]} in the checkpoint but "
                                              f"{a[key]} in the optimizer")
    if list(meta["state_names"]) != list(opt._state_names):
        raise CheckpointMismatchError(f"the checkpoint holds state {meta['state_names']}, this optimizer needs "
                                      f"{list(opt._state_names)}")


def load_sharded(opt, path: str) -> dict:
    """Load a :func:`save_sharded` checkpoint into ``opt`` at any world size / bucket size (a collective).

    Returns the ``extra`` dict saved with it. Raises :class:`CheckpointMismatchError` naming the difference when
    the checkpoint does not fit the optimizer, and ``FileNotFoundError`` when ``path`` is not a checkpoint.
    """
    meta_path = os.path.join(path, "meta.pt")
    if not os.path.isfile(meta_path):
        raise FileNotFoundError(f"{path} is not a tritonshard sharded checkpoint (no meta.pt)")
    meta = load_file(meta_path)
    if meta.get("format") != _FORMAT:
        raise CheckpointMismatchError(f"unknown checkpoint format {meta.get('format')!r}")
    _check_signature(opt, meta)
    opt.wait_for_params()
    index_of = {p: i for i, _, p in opt._indexed_params()}
    files: dict[int, dict] = {}

    def pieces_of(rank: int) -> dict:
        if rank not in files:
            files[rank] = load_file(os.path.join(path, f"rank{rank:05d}.pt"), mmap=True)["pieces"]
        return files[rank]

    with torch.no_grad():
        for b in opt.buckets:
            master = b.master_fp32().clone()
            for piece in b.param_buffer.shard_pieces():
                i = index_of[b.params[piece.tensor_index]]
                lo, hi = piece.tensor_start, piece.tensor_end
                covered = 0
                for old_rank, ranges in enumerate(meta["ranges"]):
                    if i not in ranges:
                        continue
                    s, e = ranges[i]
                    a, z = max(lo, s), min(hi, e)
                    if a >= z:
                        continue
                    saved = pieces_of(old_rank)[i]
                    dst = slice(piece.shard_start + a - lo, piece.shard_start + z - lo)
                    src = slice(a - saved["start"], z - saved["start"])
                    for name, shard in (("master", master), *b.state.items()):
                        shard[dst].copy_(saved[name][src])
                    covered += z - a
                if covered != hi - lo:
                    raise CheckpointMismatchError(f"parameter {i}: the checkpoint covers {covered} of the "
                                                  f"{hi - lo} elements this rank needs (incomplete checkpoint)")
            b.set_master(master)
            steps = {meta["steps"][index_of[p]] for p in b.params}
            if len(steps) > 1:
                raise CheckpointMismatchError(f"parameters sharing a bucket have different steps {sorted(steps)}")
            b.step.fill_(steps.pop())
        opt._apply_hparams(meta["param_groups"])
        opt.skipped_steps.fill_(meta["skipped_steps"])
        opt._load_scaler_state(meta.get("scaler", {}))
        opt._refresh_params_from_master()
    return meta["extra"]


def save_checkpoint(opt, directory: str, step: int, *, extra: Optional[dict] = None, keep: int = 2) -> str:
    """Save ``directory/step_<step>`` (sharded) and then point ``directory/latest`` at it.

    Keeps this checkpoint and the ``keep - 1`` newest earlier ones (``keep <= 0``: keep all); checkpoints of later
    steps are deleted, since saving step k means the run continued from before them (they are an abandoned
    timeline that ``latest`` must never point back to). Returns the checkpoint's path. The pointer moves only
    after the checkpoint is complete on every rank.
    """
    if _is_lead(opt):
        os.makedirs(directory, exist_ok=True)
    _barrier(opt)
    path = os.path.join(directory, f"step_{step:08d}")
    save_sharded(opt, path, extra=extra)
    if _is_lead(opt):
        tmp = os.path.join(directory, f"latest.tmp-{os.getpid()}")
        with open(tmp, "w") as f:
            f.write(os.path.basename(path) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(directory, "latest"))
        _fsync_dir(directory)
        # prune: never the one just written; later steps belong to an abandoned timeline (a run restarted from
        # an earlier checkpoint); of the earlier ones keep the newest keep - 1
        current = os.path.basename(path)
        others = sorted(d for d in os.listdir(directory)
                        if d.startswith("step_") and d != current and not d.endswith((".partial", ".old")))
        older = [d for d in others if d < current]
        stale = [d for d in others if d > current] + (older[:len(older) - (keep - 1)] if keep > 0 else [])
        for d in stale:
            shutil.rmtree(os.path.join(directory, d), ignore_errors=True)
    _barrier(opt)
    return path


def latest_checkpoint(directory: str) -> Optional[str]:
    """The path ``directory/latest`` points at, or None when there is no complete checkpoint yet."""
    pointer = os.path.join(directory, "latest")
    if not os.path.isfile(pointer):
        return None
    with open(pointer) as f:
        name = f.read().strip()
    path = os.path.join(directory, name)
    return path if os.path.isfile(os.path.join(path, "meta.pt")) else None
