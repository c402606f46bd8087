"""Checkpoints that survive: atomic writes, world-size-independent content, sharded save with resharding on load.

Two ways to save a :class:`~tritonshard.ShardedOptimizer`:

* ``opt.state_dict()`` + :func:`atomic_save`: one file in ``torch.optim``'s format, gathered on every rank
  (12 B/param for AdamW, transiently). Simple, and loadable by any world size.
* :func:`save_sharded` / :func:`load_sharded`, through ``torch.distributed.checkpoint`` (DCP): every rank writes
  only the slices it owns, each a chunk of the flattened parameter at its global offset
  (``param.<i>.<state>``), plus a small ``meta.pt`` (parameter signature, groups, steps, loss scale, extra).
  Loading at any world size and bucket size reads, on each rank, only the stored chunks that overlap its new
  pieces (DCP's resharding read plan), so nothing is ever gathered on one rank.

DCP has no public tensor type for "this rank holds an arbitrary contiguous range of the flattened tensor" (the
flat buffer is cut into equal shards regardless of parameter boundaries): ``DTensor``'s ``Shard(0)`` fixes the
split points and ``ShardedTensor`` is deprecated (it warns on every use in torch 2.13). Two small planners
(``_PiecesSavePlanner``, ``_PiecesLoadPlanner`` in ``tritonshard/_dcp.py``) therefore emit the write and read items
for those ranges themselves; the storage format is plain DCP. DCP itself is imported on the first sharded save or
load (~2 s of CPU per process: a rank that never saves does not pay it).

Atomicity: a sharded checkpoint is written into ``<path>.partial`` and renamed to ``<path>`` by one rank only once
every rank has finished; :func:`save_checkpoint` then advances a ``latest`` pointer file (written to a temporary
name and renamed). A crash at any point leaves the previous checkpoint loadable and never a half-written one that
looks valid. Loading never runs code from the checkpoint's content: ``meta.pt`` and :func:`load_file` use
``torch.load(weights_only=True)``, DCP's ``.metadata`` (a pickle) goes through an unpickler that resolves only
DCP's metadata types, torch's dtypes and paths (anything else raises :class:`UnsafeCheckpointError` before it is
imported; until 2026-12 a crafted ``.metadata`` ran its code), and DCP reads tensor chunks as raw bytes. Load
failures are :class:`CheckpointError` s (Exceptions), not DCP's ``CheckpointException`` (a BaseException).

One rank failing: every step of a save or load that may fail on one rank only (a path only it cannot see or write,
a file in the lead's way, a corrupt copy) ends where the ranks meet (:func:`_together`), so its error is an error on
every rank (:class:`~tritonshard.comm.PeerFailedError` on the others) instead of a wait in the next collective; and
the ranks that write shards sign in with a file in the directory before writing, so a save whose ranks name
different directories (or each node's own disk) is an error, never a checkpoint without some ranks' shards.

Integrity: every file DCP writes is hashed (BLAKE2b) at save, the digests go into ``meta.pt``, and ``meta.pt``'s
own digest into ``meta.pt.blake2b``; a load checks them all before anything is read into the optimizer, and reads
into copies that replace the state only once everything succeeded: a load succeeds completely or changes nothing.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import operator
import os
import pickle
import warnings
import shutil
from typing import Any, Optional

import torch
import torch.distributed as dist

from . import comm

__all__ = ["atomic_save", "load_file", "save_sharded", "load_sharded", "save_checkpoint", "latest_checkpoint",
           "CheckpointError", "CheckpointMismatchError", "UnsafeCheckpointError"]

_FORMAT = 1


class CheckpointError(Exception):
    """A checkpoint that cannot be loaded: the base of tritonshard's checkpoint errors (an ``Exception``, which
    ``except Exception`` catches, unlike DCP's ``CheckpointException``)."""


class CheckpointMismatchError(CheckpointError, ValueError):
    """The checkpoint does not fit the optimizer (parameters, shapes or groups differ)."""


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint file asks the unpickler for something a checkpoint never holds (code, most likely): refused
    before anything it names is imported, let alone called."""


#: what DCP's ``.metadata`` pickle may name (measured on what torch 2.11-2.13 write for tritonshard's checkpoints,
#: plus DCP's other metadata types): its dataclasses, torch.Size, dtypes, layouts and memory formats, paths.
#: Nothing here runs code when the unpickler constructs it.
_METADATA_GLOBALS = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "MetadataIndex", "ChunkStorageMetadata", "TensorStorageMetadata", "TensorProperties",
        "BytesStorageMetadata", "StorageMeta", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path"},
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    """An unpickler that resolves only :data:`_METADATA_GLOBALS` (and torch's dtypes, layouts, memory formats)."""

    def __init__(self, file, path: str):
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str):
        if name in _METADATA_GLOBALS.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout,
                                                                         torch.memory_format)):
            return getattr(torch, name)
        raise UnsafeCheckpointError(
            f"{self.path} asks to load {module}.{name}, which a checkpoint's metadata never holds: refused (a "
            "crafted or foreign file; tritonshard never runs code from a checkpoint)")


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


@contextlib.contextmanager
def _together(opt, entry: str, settings=None):
    """A step of a save or load that may fail on one rank only (a file that only it cannot see, read or write),
    ending where every rank meets: there an error on any rank is an error on every rank (the others raise
    :class:`~tritonshard.comm.PeerFailedError` naming it), where before the others went on into the next collective
    (DCP's, a barrier) and waited for that rank until the process group's timeout. The meeting is the call's
    handshake (:meth:`~tritonshard.comm.EntryCheck.together`, 40 bytes per rank on the gloo side group; with
    ``settings`` compared, as there); with ``check_collectives=False``, an all-reduce of a failure flag over the
    optimizer's groups (:func:`_agree`), which does not carry the error's text."""
    if opt._entry.active:
        with opt._entry.together(entry, settings):
            yield
        return
    try:
        yield
    except Exception:
        _agree(opt, failed=True)
        raise
    if _agree(opt, failed=False):
        raise comm.PeerFailedError(
            f"tritonshard: another rank raised in {comm.ENTRIES[entry]}, so this rank stops too instead of waiting "
            "for it (with check_collectives=False the ranks agree on a failure flag only: that rank's error says "
            "what it was)")


def _agree(opt, failed: bool) -> bool:
    """Whether any rank of the optimizer (its shard group, and with hybrid sharding its replica group) ``failed``:
    an all-reduce (MAX) of one number on the optimizer's device, which is also the barrier between the steps."""
    if not comm.is_initialized() or opt.world_size * opt.replica_size == 1:
        return failed
    flag = torch.tensor([float(failed)], device=opt.device)
    for group, size in ((opt.process_group, opt.world_size), (opt.replica_group, opt.replica_size)):
        if size > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return bool(flag.item())


def _is_lead(opt) -> bool:
    return opt.rank == 0 and opt.replica_rank == 0


def _param_signature(opt, laid_out: frozenset = frozenset()) -> list[dict]:
    """Each parameter's index, group, shape and whether it is in the buffers (or, ``laid_out``: ids of
    parameters about to be)."""
    return [{"index": i, "group": gi, "shape": list(p.shape), "trainable": p in opt._bucket_of or id(p) in laid_out}
            for i, gi, p in opt._indexed_params()]


def _frozen_with_saved_state(opt, meta) -> list:
    """The parameters frozen when ``opt`` was built that the saved run trained (it froze them after building its
    optimizer; the resume script freezes them before building): their state is in the checkpoint, and is loaded
    as torch.optim's load_state_dict keeps it (``_lay_out_frozen_with_state``)."""
    saved = {row["index"]: row["trainable"] for row in meta["params"]}
    return [p for i, _, p in opt._indexed_params() if saved.get(i) and p not in opt._bucket_of]


def _refuse_dict_hooks(opt, call: str, kinds: tuple[str, ...]) -> None:
    """torch.optim's state-dict hooks act on the full dict that ``state_dict()`` builds and ``load_state_dict()``
    reads. A sharded checkpoint never builds it: rather than a checkpoint without what a hook adds (or a load
    without what it adapts), an error."""
    for kind in kinds:
        hooks = getattr(opt, f"_optimizer_{kind}_hooks", None)
        if hooks:
            raise RuntimeError(
                f"{call}: the optimizer has {len(hooks)} hook(s) from register_{kind}_hook, which act "
                f"on the full dict of opt.{'load_' if kind.startswith('load') else ''}state_dict(); a sharded "
                f"checkpoint writes and reads each rank's pieces and never builds that dict, so the hooks would not "
                f"run. Save with torch.save(opt.state_dict(), ...) (load with opt.load_state_dict) instead, or "
                f"remove the hooks (handle.remove())")


_SAVE_HOOKS = ("state_dict_pre", "state_dict_post")
_LOAD_HOOKS = ("load_state_dict_pre", "load_state_dict_post")


def _check_optimizer(opt, call: str) -> None:
    """``opt`` is a tritonshard optimizer (until session 49 a model or a torch.optim optimizer passed here failed
    on a private attribute: "'Linear' object has no attribute '_entry'")."""
    from .optim.base import ShardedOptimizer
    if not isinstance(opt, ShardedOptimizer):
        raise TypeError(f"{call}() takes a tritonshard optimizer (ShardedAdamW, ShardedSGD, ...) as its first "
                        f"argument, got {type(opt).__name__}" + (
                            ": save a torch.optim optimizer with torch.save(opt.state_dict(), path)"
                            if isinstance(opt, torch.optim.Optimizer) else ""))


def _check_path(path, call: str, name: str) -> None:
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"{call}(): {name} must be a str or an os.PathLike, got {type(path).__name__}")


def _check_step(step) -> int:
    """``save_checkpoint``'s step as an int >= 0 (an int, numpy's, a 0-d integer tensor; not a bool or a float,
    whose directory name would not sort or would fail half-way)."""
    try:
        if isinstance(step, bool):
            raise TypeError
        value = operator.index(step)
    except TypeError:
        raise TypeError(f"save_checkpoint(): step must be an int, got {type(step).__name__}") from None
    if value < 0:
        raise ValueError(f"save_checkpoint(): step must be >= 0, got {value}")
    return value


def save_sharded(opt, path: str, *, extra: Optional[dict] = None) -> None:
    """Write ``opt``'s state as a sharded checkpoint directory ``path`` (a collective: every rank calls it).

    ``extra``: small data (tensors, numbers, strings, bools, None, and lists, tuples, dicts and sets of them) stored
    in the metadata by rank 0, e.g. the training step and RNG states (``torch.get_rng_state()``,
    ``random.getstate()``; numpy's as a tensor): what :func:`load_sharded` could not read back (a numpy scalar, a
    Path) is a TypeError naming it, before anything is written. An optimizer with torch.optim state-dict hooks
    (``register_state_dict_pre_hook``/``post_hook``) is an error: they act on the full dict, which a sharded save
    never builds. Every rank must name the same directory, on a filesystem they all share (a CheckpointError
    otherwise, before any shard is written). An error on one rank only (a file it cannot write) is an error on
    every rank (:class:`~tritonshard.comm.PeerFailedError` on the others), never a hang.
    """
    _check_optimizer(opt, "save_sharded")
    with _together(opt, "save"):  # (the call's first handshake: every rank's checks travel in it)
        _check_path(path, "save_sharded", "path")
        _refuse_dict_hooks(opt, "save_sharded", _SAVE_HOOKS)
        _check_extra(extra)
    with _together(opt, "save"):
        opt.sync_from_model()
        opt.wait_for_params()
        index_of = {p: i for i, _, p in opt._indexed_params()}
        partial = f"{path}.partial"
        if _is_lead(opt):
            if os.path.exists(partial):
                shutil.rmtree(partial)  # left by a save that died
            os.makedirs(partial)
    with _together(opt, "save"):
        _sign_in(opt, partial)
    with _together(opt, "save"):
        if _is_lead(opt):
            _check_signed_in(opt, partial)
        pieces = {}  # DCP key -> (numel of the flattened parameter, offset of this rank's piece, the piece)
        for b in opt.buckets:
            master = b.saved_master()
            for piece in b.param_buffer.shard_pieces():
                p = b.params[piece.tensor_index]
                sl = slice(piece.shard_start, piece.shard_end)
                for name, t in (("master", master), *b.state.items()):
                    pieces[_key(index_of[p], name)] = (p.numel(), piece.tensor_start, t[sl].detach())
    if opt.replica_rank == 0:  # hybrid sharding: replicas hold the same shards, the first one writes them
        from . import _dcp
        with _single_process_ok():
            _dcp.dcp.save({}, checkpoint_id=partial, planner=_dcp._PiecesSavePlanner(pieces),
                          process_group=_dcp_group(opt), no_dist=not comm.is_initialized())
    # (DCP raises on every rank when a rank fails in it: its coordinator gathers every rank's result)
    with _together(opt, "save"):
        if _is_lead(opt):
            # every file DCP wrote, hashed once it is complete (DCP's coordinator returns after every rank's
            # write); meta.pt carries these, and meta.pt's own digest sits beside it (checked on load before
            # anything is used)
            checksums = {name: _digest(os.path.join(partial, name)) for name in sorted(os.listdir(partial))}
            counts = opt._counts_now()
            steps = {index_of[p]: counts[p] for b in opt.buckets for p in b.params}
            groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
            meta = {"format": _FORMAT, "world_size": opt.world_size, "params": _param_signature(opt),
                    "param_groups": groups, "steps": steps, "skipped_steps": int(opt.skipped_steps),
                    "state_names": list(opt._state_names), "extra": extra or {},
                    "scaler": opt._scaler_state(), "rounding": opt._rounding_state(), "checksums": checksums}
            atomic_save(meta, os.path.join(partial, "meta.pt"))
            with open(os.path.join(partial, _META_DIGEST), "w") as f:
                f.write(_digest(os.path.join(partial, "meta.pt")) + "\n")
                f.flush()
                os.fsync(f.fileno())
    with _together(opt, "save"):
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


_SIGNED_IN = ".signed-in-rank-"


def _sign_in(opt, partial: str) -> None:
    """A file named after this rank in ``partial`` as this rank sees it, for :func:`_check_signed_in` (the ranks
    that write shards: the first replica's, with hybrid sharding; the others neither write nor make anything)."""
    if opt.replica_rank == 0:
        os.makedirs(partial, exist_ok=True)
        with open(os.path.join(partial, f"{_SIGNED_IN}{opt.rank}"), "w"):
            pass


def _check_signed_in(opt, partial: str) -> None:
    """On the lead, which writes meta.pt and renames the directory: every writing rank's :func:`_sign_in` file is
    in its ``partial``, which it made empty, so they all write into this one directory. Ranks given another path
    (a step number off by one on one rank), or a directory on each node's own disk, used to write their shards
    elsewhere while the lead completed a checkpoint without them that looked whole (its checksums list the files it
    sees) and failed only when loaded."""
    here = {name for name in os.listdir(partial) if name.startswith(_SIGNED_IN)}
    missing = [r for r in range(opt.world_size) if f"{_SIGNED_IN}{r}" not in here]
    if missing:
        raise CheckpointError(
            f"save_sharded: rank(s) {missing} of the shard group did not write into {partial} as rank 0 sees it: "
            "every rank must write into the same directory (the same path on every rank, on a filesystem every "
            "rank shares), or the checkpoint would lack their shards")
    for name in here:
        os.remove(os.path.join(partial, name))


def _check_extra(extra) -> None:
    """``extra`` goes into meta.pt, which :func:`load_sharded` reads with ``torch.load(weights_only=True)`` (no
    pickled code): what that cannot read back is refused here, before anything is written. A numpy scalar (a
    ``np.mean`` of losses), a numpy RNG state or a ``pathlib.Path`` used to save fine and make the checkpoint
    unloadable."""
    if extra is None:
        return
    if not isinstance(extra, dict):
        raise TypeError(f"extra must be a dict (or None), got {type(extra).__name__}")

    def refused(value) -> bool:
        buffer = io.BytesIO()
        try:
            torch.save(value, buffer)
            buffer.seek(0)
            torch.load(buffer, weights_only=True)
        except Exception:  # noqa: BLE001 -- (UnpicklingError; torch.save's own for what pickle cannot write)
            return True
        return False

    if not refused(extra):
        return
    where, value = "extra", extra  # down to the first value that is refused on its own
    while True:
        items = value.items() if isinstance(value, dict) else enumerate(value) \
            if isinstance(value, (list, tuple)) else ()
        inner = next(((k, v) for k, v in items if refused(v)), None)
        if inner is None:
            break
        where, value = f"{where}[{inner[0]!r}]", inner[1]
    raise TypeError(
        f"{where} is a {type(value).__module__}.{type(value).__qualname__}, which load_sharded cannot read back: "
        "meta.pt is loaded with torch.load(weights_only=True), which never runs pickled code, so it holds only "
        "tensors, numbers, strings, bools, None, and lists, tuples, dicts and sets of them. Convert it first "
        "(float(x) or x.item() for a numpy scalar, torch.from_numpy(a) for an array, str(path))")


_META_DIGEST = "meta.pt.blake2b"


def _digest(path: str) -> str:
    """BLAKE2b-128 of a file, streamed (~1 GB/s on one core): what save_sharded records and load_sharded checks."""
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 23), b""):
            h.update(chunk)
    return h.hexdigest()


def _verify_files(opt, path: str, checksums: Optional[dict]) -> None:
    """Every file the checkpoint was saved with is there, unchanged: checked by rank 0 of the shard group (one
    read of the checkpoint) and agreed on by every rank before anything is loaded; a CheckpointError naming the
    first bad file on every rank otherwise."""
    if checksums is None:
        return
    error = ""
    if opt.rank == 0:
        for name, want in checksums.items():
            file = os.path.join(path, name)
            if not os.path.isfile(file):
                error = f"{file} is missing (the checkpoint was saved with it)"
            elif _digest(file) != want:
                error = f"{file} is corrupt: its checksum does not match the one saved in meta.pt"
            if error:
                break
    if comm.is_initialized() and opt.world_size > 1:
        error = comm.all_gather_text(error, opt.process_group, opt.world_size, opt.device)[0]
    if error:
        raise CheckpointError(error)


def _key(index: int, name: str) -> str:
    """The DCP key of one state of one parameter (torch.optim numbering): the flattened parameter's values."""
    return f"param.{index}.{name}"


def _dcp_group(opt):
    return opt.process_group if comm.is_initialized() else None


@contextlib.contextmanager
def _single_process_ok():
    """DCP warns on every save/load without a process group even when asked for exactly that (no_dist=True);
    one process is a supported case here, so that one message is silenced, nothing else."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def _check_signature(opt, meta, laid_out: frozenset = frozenset()) -> None:
    ours, theirs = _param_signature(opt, laid_out), meta["params"]
    if len(ours) != len(theirs):
        raise CheckpointMismatchError(f"the checkpoint has {len(theirs)} parameters, the optimizer {len(ours)}")
    n_groups = len(opt.param_groups)
    if len(meta["param_groups"]) != n_groups:
        raise CheckpointMismatchError(f"the checkpoint has {len(meta['param_groups'])} param groups, the "
                                      f"optimizer {n_groups}")
    for a, b in zip(ours, theirs):
        for key, what in (("shape", "shape"), ("group", "param group"), ("trainable", "trainable flag")):
            if a[key] != b[key]:
                hint = (" (unfrozen in the saved run: set its requires_grad=True before loading)"
                        if key == "trainable" and b[key] else "")
                raise CheckpointMismatchError(f"parameter {a['index']}: {what} is {b[key]} in the checkpoint but "
                                              f"{a[key]} in the optimizer{hint}")
    saved, ours = list(meta["state_names"]), list(opt._state_names)
    if saved != ours and not _starts_at_first_step(opt, saved, ours, meta["steps"]):
        hint = (" (a ShardedSGD holds momentum buffers only when built with momentum in some group: build it with "
                "the saved run's momentum)" if "momentum_buffer" in saved and "momentum_buffer" not in ours else "")
        raise CheckpointMismatchError(f"the checkpoint holds state {saved}, this optimizer needs {ours}{hint}")


def _starts_at_first_step(opt, saved: list, ours: list, steps: dict) -> bool:
    """The checkpoint lacks only state that a parameter's first counted step makes (ShardedSGD's momentum buffers:
    a run built without momentum, loaded into one built with it), and no parameter has such a step yet: the
    missing state starts where that first step starts it, as ``load_state_dict`` of the same run's dict does and
    torch.optim.SGD would (buf = g at its first step with momentum). Until session 52 this was a
    CheckpointMismatchError, where ``load_state_dict`` loaded."""
    missing = [name for name in ours if name not in saved]
    return ([name for name in ours if name in saved] == saved and set(missing) <= set(opt._MADE_BY_FIRST_STEP)
            and not any(steps.values()))


def _identity(path: str, meta: dict, meta_digest: str) -> tuple[int, str]:
    """What the ranks compare before a load reads shards: meta.pt's checksum (it holds every file's), and for the
    error, where it is and the step it was saved at."""
    step = max(meta["steps"].values(), default=0)
    return comm.digest(meta_digest.encode()), f"{os.path.abspath(path)} (step {step:g}, meta.pt {meta_digest[:12]})"


def load_sharded(opt, path: str) -> dict:
    """Load a :func:`save_sharded` checkpoint into ``opt`` at any world size / bucket size (a collective).

    Returns the ``extra`` dict saved with it. Raises :class:`CheckpointMismatchError` naming the difference when
    the checkpoint does not fit the optimizer, ``FileNotFoundError`` when ``path`` is not a checkpoint, and
    :class:`~tritonshard.comm.SettingsMismatchError` on every rank, naming each rank's, when the ranks name different
    checkpoints (meta.pt's checksums differ: another step, another run; a copy elsewhere is the same). An
    optimizer with torch.optim load-state-dict hooks is an error, as in :func:`save_sharded`.
    """
    _check_optimizer(opt, "load_sharded")
    with _together(opt, "load"):  # (the call's first handshake: every rank's checks travel in it)
        _check_path(path, "load_sharded", "path")
        _refuse_dict_hooks(opt, "load_sharded", _LOAD_HOOKS)
    opt._prepared_state = None
    with _together(opt, "load"):  # (a path only some ranks see: on every rank, before the collective below)
        meta_path = os.path.join(path, "meta.pt")
        if not os.path.isfile(meta_path):
            raise FileNotFoundError(f"{path} is not a tritonshard sharded checkpoint (no meta.pt)")
        digest_path = os.path.join(path, _META_DIGEST)
        meta_digest = _digest(meta_path)  # (meta.pt holds every other file's checksum: this names the checkpoint)
        if os.path.isfile(digest_path):
            with open(digest_path) as f:
                want = f.read().strip()
            if meta_digest != want:
                raise CheckpointError(f"{meta_path} is corrupt: its checksum does not match {digest_path}")
        else:
            warnings.warn(f"{path} has no checksums (written before 2026-12-01): its files are not verified",
                          RuntimeWarning, stacklevel=2)
        meta = load_file(meta_path)
        if meta.get("format") != _FORMAT:
            raise CheckpointMismatchError(f"unknown checkpoint format {meta.get('format')!r}")
    _verify_files(opt, path, meta.get("checksums"))  # (rank 0 of the shard group reads them: an error on every rank)
    # again: every rank got through the checks above before DCP's collectives, and reads the same checkpoint (a
    # rank that resolved "the latest" before the last save reached its filesystem would load older shards)
    with _together(opt, "load", settings=lambda: _identity(path, meta, meta_digest)):
        opt.sync_from_model()  # (first: parameters unfrozen before the load are laid out, as in the saved run)
        frozen = _frozen_with_saved_state(opt, meta)
        _check_signature(opt, meta, frozenset(id(p) for p in frozen))
    opt._lay_out_frozen_with_state(frozen)  # (a collective: after the ranks agreed on the checkpoint)
    opt.wait_for_params()
    index_of = {p: i for i, _, p in opt._indexed_params()}
    with torch.no_grad():
        # all or nothing: DCP reads into copies, which replace the live state only once every read succeeded (a
        # truncated .distcp used to fail after the moments had been overwritten, leaving them half loaded)
        masters = [b.master_fp32().clone() for b in opt.buckets]
        saved = set(meta["state_names"])  # (state it lacks starts at its first step, as zeros: _starts_at_first_step)
        states = [{name: t.clone() if name in saved else torch.zeros_like(t) for name, t in b.state.items()}
                  for b in opt.buckets]
        targets = {}  # DCP key -> (offset of this rank's piece in the flattened parameter, where it goes)
        for b, master, state in zip(opt.buckets, masters, states):
            for piece in b.param_buffer.shard_pieces():
                i = index_of[b.params[piece.tensor_index]]
                sl = slice(piece.shard_start, piece.shard_end)
                for name, shard in (("master", master), *state.items()):
                    if name == "master" or name in saved:
                        targets[_key(i, name)] = (piece.tensor_start, shard[sl])
        # each rank reads only the stored chunks that overlap its own pieces (DCP's resharding read plan)
        from . import _dcp
        with _single_process_ok():
            # the metadata through a restricted unpickler: a crafted .metadata cannot run code (issue 23)
            reader = _dcp._SafeFileSystemReader(path)
            try:
                _dcp.dcp.load({}, checkpoint_id=path, storage_reader=reader,
                              planner=_dcp._PiecesLoadPlanner(targets), process_group=_dcp_group(opt),
                              no_dist=not comm.is_initialized())
            except _dcp.CheckpointException as exc:  # a BaseException: `except Exception` in a loop misses it
                raise (reader.error or _checkpoint_error(path, exc)) from None
        for b, master, state in zip(opt.buckets, masters, states):
            b.set_master(master)
            for name, t in state.items():
                b.state[name].copy_(t)
        opt._load_steps({p: meta["steps"][index_of[p]] for b in opt.buckets for p in b.params})
        opt._apply_hparams(meta["param_groups"])
        opt.skipped_steps.fill_(meta["skipped_steps"])
        opt._load_scaler_state(meta.get("scaler", {}))
        opt._load_rounding_state(meta.get("rounding", {}))
        opt._refresh_params_from_master()
        opt._forget_unheld_values()
    opt._expose_state()
    return meta["extra"]


def _checkpoint_error(path: str, exc) -> CheckpointError:
    """DCP's CheckpointException (a BaseException holding every rank's failure) as tritonshard's own error: ours
    as it was raised (e.g. UnsafeCheckpointError), anything else named with its rank and the checkpoint."""
    failures = exc.failures
    for rank in sorted(failures):
        inner = failures[rank][0]
        if isinstance(inner, CheckpointError):
            return inner
    rank = min(failures) if failures else "?"
    inner = failures[rank][0] if failures else exc
    return CheckpointError(f"loading {path} failed on rank {rank}: {type(inner).__name__}: {inner}")


def save_checkpoint(opt, directory: str, step: int, *, extra: Optional[dict] = None, keep: int = 2) -> str:
    """Save ``directory/step_<step>`` (sharded) and then point ``directory/latest`` at it.

    Keeps this checkpoint and the ``keep - 1`` newest earlier ones (``keep <= 0``: keep all); checkpoints of later
    steps are deleted, since saving step k means the run continued from before them (they are an abandoned
    timeline that ``latest`` must never point back to). Returns the checkpoint's path. The pointer moves only
    after the checkpoint is complete on every rank.
    """
    _check_optimizer(opt, "save_checkpoint")
    with _together(opt, "save"):  # (the call's first handshake: every rank's checks travel in it)
        _check_path(directory, "save_checkpoint", "directory")
        step = _check_step(step)
        _refuse_dict_hooks(opt, "save_checkpoint", _SAVE_HOOKS)
    with _together(opt, "save"):
        if _is_lead(opt):
            os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"step_{step:08d}")
    save_sharded(opt, path, extra=extra)
    with _together(opt, "save"):
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
            # and what a crash left: ".old" copies of re-saved steps (the new one is complete now), other ".partial"s
            stale += [d for d in os.listdir(directory) if d.startswith("step_") and d.endswith((".old", ".partial"))]
            for d in stale:
                shutil.rmtree(os.path.join(directory, d), ignore_errors=True)
    return path


def _is_complete(path: str) -> bool:
    """A finished sharded checkpoint: DCP's metadata and ours (written last, after every rank's data)."""
    return os.path.isfile(os.path.join(path, "meta.pt")) and os.path.isfile(os.path.join(path, ".metadata"))


def latest_checkpoint(directory: str) -> Optional[str]:
    """The checkpoint ``directory/latest`` points at; when the pointer is missing or names something incomplete
    or gone, the newest complete ``step_*`` checkpoint instead, with a warning naming both; None when there is no
    complete checkpoint at all.

    What the fallback covers (issue 23): a crash between the two renames that re-save an existing step (the
    pointer names a directory that is gone for a moment, its previous version is ``step_<n>.old``), a checkpoint
    that lost its ``meta.pt``, a crash before the first pointer was written.
    """
    if not os.path.isdir(directory):
        return None
    pointer = os.path.join(directory, "latest")
    named = None
    if os.path.isfile(pointer):
        with open(pointer) as f:
            named = f.read().strip()
        path = os.path.join(directory, named)
        if named and _is_complete(path):
            return path
    # newest first; for one step, the checkpoint itself before its ".old" predecessor
    candidates = sorted((d for d in os.listdir(directory)
                         if d.startswith("step_") and not d.endswith(".partial")
                         and _is_complete(os.path.join(directory, d))),
                        key=lambda d: (d.removesuffix(".old"), not d.endswith(".old")), reverse=True)
    if not candidates:
        return None
    chosen = os.path.join(directory, candidates[0])
    why = (f"'latest' names {named!r}, which is missing or incomplete" if named is not None
           else "there is no 'latest' pointer")
    warnings.warn(f"{directory}: {why}; using the newest complete checkpoint, {chosen}", RuntimeWarning,
                  stacklevel=2)
    return chosen
