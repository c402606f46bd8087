"""Thin shims over ``torch.distributed`` collectives whose names changed across torch versions.

torch 2.13 renamed ``reduce_scatter_tensor`` -> ``reduce_scatter_single`` and ``all_gather_into_tensor`` ->
``all_gather_single``; the old names still exist there but emit a ``FutureWarning`` on every call. torch 2.11 and
2.12 have only the old names. We resolve the name once, at import, preferring the new one, so neither version
warns.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import hashlib
import logging
import os
import sys
import types
import weakref
from typing import Optional

import torch
import torch.distributed as dist

__all__ = ["reduce_scatter_single", "all_gather_single", "all_to_all_single", "reduce_scatter_coalesced",
           "all_gather_coalesced", "reduce_scatter_async", "all_gather_async", "group_object", "broadcast_coalesced",
           "SharedWork", "digest",
           "all_gather_text", "local_device", "group_size", "group_rank", "is_initialized", "CollectiveMismatchError",
           "SettingsMismatchError", "PeerFailedError", "EntryCheck", "destroy_process_group"]

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


# The coalesced forms, one call for a list of (output, input) pairs: ProcessGroup methods (no Python wrapper, no
# per-call checks; NCCL runs the list inside one ncclGroupStart/End), renamed like the single ones in torch 2.13,
# whose old names are still there, without a warning (checked on 2.13); torch 2.11 has only the old ones
_PG = dist.ProcessGroup if dist.is_available() else None
_RS_COALESCED = next((n for n in ("reduce_scatter_single_coalesced", "reduce_scatter_tensor_coalesced")
                      if _PG is not None and hasattr(_PG, n)), None)
_AG_COALESCED = next((n for n in ("all_gather_single_coalesced", "allgather_into_tensor_coalesced")
                      if _PG is not None and hasattr(_PG, n)), None)


# The single forms as ProcessGroup methods, for the optimizer's per-bucket calls (with overlap_comm): torch's Python
# wrapper around them checks the tensors, looks for a coalescing manager and a torch-function override, and logs,
# ~8-15 us of host time per call (issue 20: two calls per bucket per step). 2.13's names first, as above
_RS_SINGLE = next((n for n in ("reduce_scatter_single", "_reduce_scatter_base")
                   if _PG is not None and hasattr(_PG, n)), None)
_AG_SINGLE = next((n for n in ("all_gather_single", "_allgather_base") if _PG is not None and hasattr(_PG, n)), None)


def reduce_scatter_async(output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup):
    """``reduce_scatter_single(output, input, SUM, group, async_op=True)`` straight through the ProcessGroup method
    (``group``: the group object itself, e.g. from :func:`group_object`); returns its work handle. No checks: for a
    caller whose tensors are right by construction (a Buffer's data and local shard)."""
    opts = dist.distributed_c10d.ReduceScatterOptions()
    opts.reduceOp = dist.ReduceOp.SUM
    _set_async(opts)
    return getattr(group, _RS_SINGLE)(output, input, opts)


def all_gather_async(output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup):
    """``all_gather_single(output, input, group, async_op=True)`` straight through the ProcessGroup method (see
    :func:`reduce_scatter_async`)."""
    opts = dist.distributed_c10d.AllgatherOptions()
    _set_async(opts)
    return getattr(group, _AG_SINGLE)(output, input, opts)


def coalesced_available() -> bool:
    return _RS_COALESCED is not None and _AG_COALESCED is not None


def group_object(group: Optional[dist.ProcessGroup]) -> dist.ProcessGroup:
    """The ProcessGroup a collective on ``group`` runs on (None: the default group)."""
    return group if group is not None else dist.distributed_c10d._get_default_group()


def _set_async(opts) -> None:
    if hasattr(opts, "asyncOp"):  # (torch >= 2.7; before it every call was asynchronous)
        opts.asyncOp = True


def reduce_scatter_coalesced(outputs: list, inputs: list, group: Optional[dist.ProcessGroup] = None):
    """``reduce_scatter_single(outputs[i], inputs[i], SUM)`` for every i, as one asynchronous collective call;
    returns its work handle. The tensors must be right already: one dtype and device, ``inputs[i]`` of
    ``world_size * outputs[i].numel()`` contiguous elements (no check here: the caller's Buffers are)."""
    opts = dist.distributed_c10d.ReduceScatterOptions()
    opts.reduceOp = dist.ReduceOp.SUM
    _set_async(opts)
    return getattr(group_object(group), _RS_COALESCED)(outputs, inputs, opts)


def all_gather_coalesced(outputs: list, inputs: list, group: Optional[dist.ProcessGroup] = None):
    """``all_gather_single(outputs[i], inputs[i])`` for every i, as one asynchronous collective call (see
    :func:`reduce_scatter_coalesced`)."""
    opts = dist.distributed_c10d.AllgatherOptions()
    _set_async(opts)
    return getattr(group_object(group), _AG_COALESCED)(outputs, inputs, opts)


#: bytes per broadcast call of :func:`broadcast_coalesced` (DistributedDataParallel's broadcast_bucket_size)
BROADCAST_BUCKET_BYTES = 250 * 1024 * 1024


def broadcast_coalesced(tensors: list, group: Optional[dist.ProcessGroup] = None) -> None:
    """Overwrite ``tensors`` (one device, any dtypes and shapes) in place with the group's rank 0's, packed into
    a few large broadcasts, as DistributedDataParallel's construction syncs the module (the same c10d helper)."""
    if tensors:
        dist._broadcast_coalesced(group_object(group), tensors, BROADCAST_BUCKET_BYTES, 0)


class SharedWork:
    """One work handle shared by several buckets (a coalesced call): the first ``wait()`` waits, later ones are
    free. Every bucket keeps its own reference and waits through it, as it would on its own handle."""

    __slots__ = ("_work",)

    def __init__(self, work):
        self._work = work

    def wait(self) -> bool:
        if self._work is not None:
            self._work.wait()
            self._work = None
        return True


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


def destroy_process_group(group: Optional[dist.ProcessGroup] = None) -> None:
    """``torch.distributed.destroy_process_group(group)``, made to free the group now rather than at interpreter
    shutdown, where freeing a gloo group joins its worker threads at a point where they abort the process
    ("terminate called without an active exception": the step benchmark's 1-rank run, tests' ranks, a README
    block) or hang. torch's destroy only drops torch's own references (gloo has no ``shutdown()``: the threads go
    with the last reference), so two other holders are dealt with here:

    - a ShardedOptimizer lives in reference cycles (its hooks, its gradient placeholders) and holds its group: a
      garbage collection first;
    - ``torch.distributed.nn.functional`` binds ``group=group.WORLD`` as a default argument when it is imported,
      and it is imported with ``torch._dynamo``, which the first ``torch.optim.Optimizer.add_param_group`` imports
      (any optimizer, built after ``init_process_group``): from then on its functions hold the default group for
      the life of the process (torch 2.11-2.13). Their defaults that are a group being destroyed become ``None``,
      which those functions read as the default group, what ``group.WORLD`` meant."""
    world = dist.group.WORLD if dist.is_initialized() else None
    doomed = world if group is None else group
    gc.collect()
    dist.destroy_process_group(group)
    _release_default_arguments(doomed)


def _release_default_arguments(group) -> None:
    """Replace ``group`` by ``None`` where a function of ``torch.distributed.nn.functional`` holds it as a default
    argument (see :func:`destroy_process_group`)."""
    module = sys.modules.get("torch.distributed.nn.functional")
    if group is None or module is None:
        return
    for fn in vars(module).values():
        defaults = getattr(fn, "__defaults__", None)
        if isinstance(fn, types.FunctionType) and defaults and any(d is group for d in defaults):
            fn.__defaults__ = tuple(None if d is group else d for d in defaults)


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


# ---------------------------------------------------------------------------------------------- entry handshakes
class SettingsMismatchError(ValueError):
    """The ranks entered the same tritonshard call with settings that must agree but do not (step()'s
    hyper-parameters: one rank's LR scheduler ahead of the others'; a load of different checkpoints). Raised on every
    rank, naming each rank's."""


class CollectiveMismatchError(RuntimeError):
    """The ranks entered different tritonshard collectives (e.g. ``state_dict()`` on rank 0 only while the others
    went on training). Raised on every rank involved, as soon as they meet, instead of a hang or a foreign error."""


class PeerFailedError(RuntimeError):
    """Another rank raised in a tritonshard call where the others would go on into collectives without it (a check
    that found something wrong on that rank only: a gradient that step() already used, a checkpoint file only that
    rank cannot read or write) and told them through the call's next handshake: raised on every other rank, naming
    that rank and its error, instead of leaving them waiting in the collectives that rank will not join."""


#: the entry points that run collectives, as the handshake names them to the user
ENTRIES = {
    "reduce": "the gradient reduction (the last backward with overlap_comm, clip_grad_norm_, grad_norm, a norm of "
              "param.grad as in torch's clip_grad_norm_, GradScaler's unscale_, or step())",
    "param_norms": "the per-parameter gradient norms (torch's clip_grad_norm_ on param.grad, or clip_grad_norm_ "
                   "with norm_type != 2)",
    "step": "step()'s updates and parameter all-gathers",
    "clamp": "step()'s non-finite check of gradients clamped by clip_grad_value_ (every rank must clamp)",
    "state_dict": "state_dict()",
    "load_state_dict": "load_state_dict()",
    "save": "a checkpoint save (save_sharded / save_checkpoint)",
    "load": "a checkpoint load (load_sharded)",
    "add_param_group": "add_param_group() after construction",
    "unfreeze": "laying out parameters frozen at construction and trainable now (at the end of a backward, or at "
                "step())",
    "buffers": "a forward with grad enabled of a model attached with buffers (it starts from rank 0's buffers, "
               "attach(broadcast_buffers=True), as DDP's forward: a forward on some ranks only must run under "
               "torch.no_grad(), or attach with broadcast_buffers=False)",
}


def _code(key: str) -> int:
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=7).digest(), "little")


_DESCRIBE = {_code(k): v for k, v in ENTRIES.items()}


def digest(data: bytes) -> int:
    """A handshake's settings digest: 64 bits of BLAKE2b, as a signed int64."""
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little", signed=True)


#: for the entries that compare something across ranks (the handshake's digest): what differs, and why it must not
_DISAGREE = {
    "step": ("settings", "Every rank updates its own shard of the parameters with its own, so they must agree: an "
             "LR scheduler stepped on some ranks only, or fed a rank's own metric (ReduceLROnPlateau with each rank's "
             "validation loss: all-reduce the metric first), or a group changed on one rank; or torch code that "
             "multiplied param.grad (GradScaler.unscale_, torch's clip_grad_norm_, p.grad.mul_) reached tritonshard "
             "on some ranks only: it runs over each rank's own param.grad, so a rank whose gradients are all None, "
             "or all plain tensors set by hand, multiplied none (give every rank a backward)"),
    "load": ("checkpoints", "Every rank loads its own shard of the state, so the model would be stitched together "
             "from several checkpoints: give every rank the same one (resolve latest_checkpoint() on one rank and "
             "broadcast the path, or wait until every rank sees the last save)"),
    "load_state_dict": ("state dicts", "Every rank takes its own shard of the state from its own dict, so the model "
                        "would be stitched together from several checkpoints: load the same file on every rank"),
}
_COLD = frozenset({"state_dict", "load_state_dict", "save", "load", "add_param_group"})  # off the training loop's path
#: a rank waiting this long in a handshake of a cold entry (state_dict, loads, saves) logs what it waits for
WARN_AFTER_S = 10.0
_log = logging.getLogger("tritonshard")


class _SideGroup:
    """A gloo group over the ranks of a process group, for the handshakes: CPU tensors (no device sync with NCCL)
    and no collision with the data collectives in flight on the main group. One per main group and process."""

    def __init__(self, group, size: int):
        ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
        self.group = dist.new_group(ranks, backend="gloo", use_local_synchronization=True)
        self.size = size
        self.seq = 0  # handshakes on this group so far: the same on every rank while the ranks agree


_SIDE_GROUPS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _side_group(group, size: int) -> _SideGroup:
    key = group if group is not None else dist.group.WORLD
    side = _SIDE_GROUPS.get(key)
    if side is None:
        side = _SIDE_GROUPS[key] = _SideGroup(group, size)
    return side


class EntryCheck:
    """The handshake at the start of every tritonshard entry point that runs collectives.

    A collective called on some ranks only (the Hugging Face Trainer calls ``optimizer.state_dict()`` on the main
    process only) pairs its first collective with whatever the other ranks do next: gloo aborts with "Received
    data size doesn't match expected size", NCCL hangs. So every entry (the gradient reduction, the per-parameter
    norms, step()'s update and all-gathers, state_dict, load_state_dict, checkpoint saves and loads) first
    all-gathers (what it is, a sequence number) over a gloo side group of the same ranks: the first call of every
    entry is this one, so entries always meet entries, and when the ranks are in different ones every rank
    raises :class:`CollectiveMismatchError` naming each rank's call, as soon as the others reach any entry.

    Cost: one all-gather of 40 bytes per rank on CPU per entry (two per training step: the reduction and the
    step), no device sync; nothing at world size 1. The third number is a flag any entry may raise (step() raises
    it when a parameter got no gradient on this rank: :meth:`combine` then finds those that got none anywhere);
    the fourth a digest of settings that must agree (step()'s hyper-parameters, the checkpoint a load reads), 0 for
    the other entries; the fifth says that this rank failed where the others would go on into collectives without
    it (``failure``: the others raise :class:`PeerFailedError`; :meth:`tell`, :meth:`together`).
    """

    def __init__(self, groups: list):
        """``groups``: (process group, size) pairs; those of size 1 need no handshake."""
        self._groups = [_side_group(g, n) for g, n in groups if n > 1] if is_initialized() else []
        #: whether there is anyone to shake hands with (more than one rank, checks on)
        self.active = bool(self._groups)

    def __call__(self, entry: str, flag: bool = False, settings=None,
                 failure: Optional[BaseException] = None) -> bool:
        """Handshake for ``entry`` (a key of :data:`ENTRIES`). ``flag`` travels with it: returns whether any rank
        raised it (``flag`` itself where there is no handshake: one rank, or inside torch.compile). ``settings``:
        a callable giving ``(digest, description)`` of what must be the same on every rank for this call (step()'s
        hyper-parameters, the checkpoint a load reads: the entries of :data:`_DISAGREE`; :func:`digest` makes the
        number); a :class:`SettingsMismatchError` on every rank, naming each rank's, where the digests differ.
        ``failure``: the error this rank found where the others would go on into collectives without it (it then
        shakes hands only to say so, and raises it itself): every other rank raises :class:`PeerFailedError` naming
        it, whichever handshake it is in (the others may be in another call already: the failure is the news)."""
        if not self._groups or torch.compiler.is_compiling():
            return flag
        code = _code(entry)
        digest, described = (0, None) if settings is None else settings()
        failed = None if failure is None else (f"rank {dist.get_rank()}: {type(failure).__name__}: {failure}")
        for side in self._groups:  # (the flag of the first group's ranks travels on in the second: every rank ends
            side.seq += 1           # with the OR over the whole grid; a failure's text travels on too)
            mine = torch.tensor([code, side.seq, int(flag), digest, int(failed is not None)], dtype=torch.int64)
            everyone = torch.empty(5 * side.size, dtype=torch.int64)
            work = all_gather_single(everyone, mine, group=side.group, async_op=True)
            if entry in _COLD and WARN_AFTER_S > 0:
                try:
                    work.wait(timeout=datetime.timedelta(seconds=WARN_AFTER_S))
                except RuntimeError:  # timed out: say what this rank waits for, then wait on (gloo re-waits fine)
                    _log.warning(
                        "tritonshard: rank %d has waited %g s in %s for the other ranks. It is a collective: if "
                        "they are not calling it (the Hugging Face Trainer saves the optimizer on the main process "
                        "only; use tritonshard.integrations.hf.ShardedOptimizerCallback, or prepare_state_dict() on "
                        "every rank), this waits until the process group's timeout", dist.get_rank(), WARN_AFTER_S,
                        ENTRIES[entry])
            work.wait()
            rows = everyone.view(side.size, 5).tolist()
            if any(r[4] for r in rows):  # a rank failed: that is the news, whatever call the others are in (they
                side.seq = max(r[1] for r in rows)  # may be in the next one already), and before the settings
                texts = all_gather_text(failed or "", side.group, side.size, torch.device("cpu"))
                failed = failed or next(t for t in texts if t)
                continue
            if all(r[:2] == rows[0][:2] for r in rows):
                if any(r[3] != rows[0][3] for r in rows):  # the same call, not the same settings: every rank sees it
                    texts = all_gather_text(described, side.group, side.size, torch.device("cpu"))
                    listing = "; ".join(f"rank {r}: {t}" for r, t in enumerate(texts))
                    what, why = _DISAGREE[entry]
                    raise SettingsMismatchError(
                        f"tritonshard: the ranks called {ENTRIES[entry]} with different {what} ({listing}). {why}")
                flag = any(r[2] for r in rows)
                continue
            side.seq = max(r[1] for r in rows)  # (the group is unusable for training anyway; keep it consistent)
            calls = "; ".join(f"rank {r}: {_DESCRIBE.get(c, 'another tritonshard version')} (its entry {n})"
                              for r, (c, n, *_) in enumerate(rows))
            raise CollectiveMismatchError(
                f"tritonshard: the ranks are in different collective calls ({calls}). Every rank must make the same "
                "tritonshard calls in the same order: the gradient reduction (backward with overlap_comm, "
                "clip_grad_norm_, grad_norm, torch's clip_grad_norm_ on param.grad, GradScaler.unscale_), step(), "
                "state_dict(), load_state_dict(), checkpoint saves and loads, and a forward with grad enabled of an "
                "attached model with buffers are collectives; with overlap_comm a step's gradients dropped between "
                "its backward and step() (zero_grad(), every param.grad cleared) must be dropped on every rank. A "
                "framework that "
                "saves the optimizer on one rank only (the Hugging Face Trainer) must have every rank call "
                "opt.prepare_state_dict() first (tritonshard.integrations.hf.ShardedOptimizerCallback does it)")
        if failed is not None and failure is None:
            raise PeerFailedError(
                f"tritonshard: another rank raised in a call where the ranks would go on into collectives without "
                f"it, so this rank stops in {ENTRIES[entry]} instead of waiting for it ({failed})")
        return flag

    def tell(self, entry: str, failure: BaseException) -> None:
        """The handshake for ``entry`` carrying this rank's ``failure`` (the others raise :class:`PeerFailedError`),
        whatever they do: an error of the handshake itself (ranks in other calls) is dropped, ``failure`` being the
        one this rank raises."""
        try:
            self(entry, failure=failure)
        except Exception:  # noqa: BLE001
            pass

    @contextlib.contextmanager
    def together(self, entry: str, settings=None):
        """Run the block, then shake hands for ``entry`` (with ``settings``, as in ``__call__``): an error in the
        block on any rank is an error on every rank once they reach the block's end (the others raise
        :class:`PeerFailedError` naming it), where otherwise they would go on into the collectives after the block
        and wait there for the rank that left. For work that may fail on one rank only (a file only it cannot see
        or write) before the ranks' next collective."""
        try:
            yield
        except Exception as exc:
            self.tell(entry, exc)
            raise
        self(entry, settings=settings)

    def position(self) -> tuple:
        """How many handshakes this process made in each group (changes with every handshake)."""
        return tuple(side.seq for side in self._groups)

    def combine(self, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``mask`` (a 1-D bool CPU tensor, the same length on every rank) AND-ed and OR-ed over every rank: over
        the first group, then that over the second, so over the whole grid (one all-gather per group). Only after
        a handshake whose flag was raised (every rank then calls it)."""
        both = torch.cat([mask, mask])
        n = mask.numel()
        for side in self._groups:
            mine = both.to(torch.uint8)
            everyone = torch.empty(side.size * mine.numel(), dtype=torch.uint8).view(side.size, -1)
            all_gather_single(everyone.view(-1), mine, group=side.group)
            both = torch.cat([everyone[:, :n].all(dim=0), everyone[:, n:].any(dim=0)])
        return both[:n], both[n:]
