"""``ModelViewMixin``: the half of ShardedOptimizer that keeps the user's model and the master shards consistent.

* ``sync_from_model()``: outside writes to the parameters (``load_state_dict``, ``torch.nn.init``...) reach the
  fp32 master; parameters that stopped aliasing their buffer are re-adopted; what cannot be followed raises.
* gradients seen through ``param.grad`` (a :class:`~tritonshard.optim.model_sync.ShardedGrad` placeholder): the
  per-parameter global norms and the coefficients torch code multiplied them by (``clip_grad_norm_``);
* parameters frozen after construction, kept out of the flat update (``opt.state[p]``: :mod:`.state_view`).

The hooks and the placeholder themselves are in :mod:`tritonshard.optim.model_sync`; the communication pipeline
that these methods call into (``wait_for_params``, ``_reduce_grads``) is :class:`~tritonshard.optim.base.
ShardedOptimizer`.
"""

from __future__ import annotations

import itertools
import math
import operator
from typing import Optional

import torch
import torch.distributed as dist

from .. import comm
from ..kernels import _launch
from ..kernels._dispatch import triton_kernels_run
from ..kernels.scale import (partials_multi_launch_spec, segment_sums_, segment_sums_launch_spec,
                             shared_sum_sq_workspace, sum_sq_partials_)
from . import model_sync
from .bucket import DATA_HANDED, DATA_READS, UNHELD_PRECISE, _Bucket, alone, settle_unheld, watch, written_through_data
from .bucket import plain_attrs as _PLAIN_ATTRS

_DATA_PTR = torch.Tensor.data_ptr
_VERSION = operator.attrgetter("_version")
_REQUIRES_GRAD = operator.attrgetter("requires_grad")
_GRAD = operator.attrgetter("grad")

__all__ = ["ModelViewMixin"]


class _ParamList(list):
    """A group's ``params`` as the optimizer laid it out: a list that notes in-place changes (an element replaced,
    appended, removed, the order changed), so that the check at every step (``_check_group_lists``) reads a flag
    instead of comparing every parameter. Until session 20 an element replaced in place went unseen: the new
    parameter never trained, the old one trained on, silently."""

    __slots__ = ("changed",)

    def __reduce_ex__(self, protocol):  # (a copy or a pickle is a plain list: the flag belongs to this one)
        return list, (list(self),)


def _noting(name: str):
    method = getattr(list, name)

    def noting(self, *args, **kwargs):
        self.changed = True
        return method(self, *args, **kwargs)
    noting.__name__ = noting.__qualname__ = name
    return noting


for _name in ("__setitem__", "__delitem__", "__iadd__", "__imul__", "append", "extend", "insert", "pop", "remove",
              "clear", "sort", "reverse"):
    setattr(_ParamList, _name, _noting(_name))
del _name


class _Tensor:
    """How the settings compared across ranks show a hyper-parameter given as a GPU tensor (not read: that would
    wait for the device)."""

    def __repr__(self) -> str:
        return "a tensor"


_TENSOR = _Tensor()


def _tensor_setting(t: torch.Tensor):
    """A hyper-parameter given as a tensor, as the ranks compare it: a CPU scalar's value (free to read), else
    :data:`_TENSOR` (a GPU tensor is not read)."""
    if t.device.type == "cpu" and t.numel() == 1:
        return t.item()
    return _TENSOR


def _setting(value) -> str:
    """A hyper-parameter as the ranks compare it: floats to 12 significant digits, so that a schedule computed by
    another libm on another node (its last bit) is not a mismatch, while any change a schedule or a user makes is."""
    if isinstance(value, float):
        return f"{value:.12g}"
    if isinstance(value, (tuple, list)):
        return "(" + ", ".join(map(_setting, value)) + ")"
    return repr(value)


def _names(names: list) -> str:
    """Up to three parameter names, then how many more."""
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


class ModelViewMixin:
    """Methods of :class:`~tritonshard.optim.base.ShardedOptimizer` about the model's view of the weights."""

    def sync_from_model(self) -> None:
        """Bring the master shards up to date with what the user's code did to the parameters since the last step.

        Runs at the start of every step (and of ``state_dict()``, checkpoint saves and loads); a step compiled by
        torch.compile runs eagerly where the end of the last backward (:meth:`_model_changed`), a ``.data`` read or
        an edit of ``opt.state`` says it has something to do; call it yourself only after writing a weight in place
        (not through ``.data``) between the last backward and a compiled step. On the host, no device sync:

        * a parameter written in place (``model.load_state_dict``, ``torch.nn.init``, ``p.copy_``; its version
          counter moved): every element of this rank's shard whose bf16 value is no longer the rounding of the
          fp32 master takes the new value as its master (elementwise, on the device); the optimizer state stays,
          as with torch.optim;
        * a parameter that no longer aliases its buffer (a copying ``.to()`` on the same device and dtype, e.g.
          accelerate's ``model.to("cpu:0")``, or ``p.data = t``): its values are copied back into the buffer and it
          is made a view of it again, then as above;
        * an error, naming the parameter, the cause and the fix, for what cannot be followed: a parameter moved to
          another device or converted to another dtype, a parameter replaced in the model by another object
          (``load_state_dict(..., assign=True)``; needs ``attach``);
        * a parameter frozen when the optimizer was built and trainable now starts to train (``_adopt_unfrozen``).
        """
        if torch.compiler.is_compiling():
            return
        self._check_not_retired()  # (it would take the parameters back into its buffers)
        self._check_group_lists()
        if self._state_edited():  # (code wrote to opt.state: state_view.py)
            self._follow_state_edits()
        for module, name, p in self._model_params:
            if module._parameters.get(name) is not p and not self._follow_moved_parameter(module, name, p):
                raise RuntimeError(
                    f"parameter {self._param_names[p]} was replaced in the model by another tensor after the "
                    "optimizer was built (e.g. model.load_state_dict(..., assign=True) or setattr), so the optimizer "
                    "would keep updating the old one. Load with assign=False (the default: it copies into the "
                    "existing parameters, which tritonshard follows), or build the optimizer after loading.")
        if self._frozen_at_build:
            self._adopt_unfrozen()
            if self._final_look and UNHELD_PRECISE:  # (fp32 values kept for a parameter held frozen)
                settle_unheld(self._frozen_at_build)
        dirty = set()
        if self._flags.precise_notes:  # (fp32 values noted for the weights, calls to run on them: _Bucket.calls)
            if DATA_READS:  # (.data handed out: written through, unseen, perhaps after the calls or the copy)
                for i in DATA_READS.intersection(self._param_by_id):
                    self._bucket_of[self._param_by_id[i]][0].data_handed_out(i, written_through_data(i))
            for b in self.buckets:
                if b.calls:
                    b.run_calls(self._seen_version)
                if b.precise:
                    dirty.add(b.index)
        # (lists in _param_list's order, not dicts keyed by the parameters: Tensor.__hash__ is a Python method; and
        # read with map(), compared as lists, then looked at one by one only where they differ: this runs over
        # every parameter at every step, ~0.15 us per parameter, where a loop reading data_ptr, dtype, device and
        # _version of each took ~0.75. A .data of another dtype or device has another address: _readopt says so)
        plist, ptrs, versions = self._param_list, self._param_ptrs, self._param_versions
        now, now_versions = self._param_addresses_and_versions()
        if now != ptrs:
            for i, p in enumerate(plist):
                if now[i] != ptrs[i]:
                    self._readopt(p)  # (sets ptrs[i] and versions[i])
                    now_versions[i] = versions[i]
                    dirty.add(self._bucket_of[p][0].index)
        if now_versions != versions:
            for i, version in enumerate(now_versions):
                if version != versions[i]:
                    versions[i] = version
                    dirty.add(self._bucket_of[plist[i]][0].index)
        if DATA_READS:  # (p.data handed out: a write through it moves no version counter)
            mine = DATA_READS.intersection(self._param_by_id)  # (as many lookups as reads: others' ids stay)
            DATA_READS.difference_update(mine)
            for i in mine:
                DATA_HANDED.pop(i, None)
            dirty.update(self._bucket_of[self._param_by_id[i]][0].index for i in mine)
        if dirty:
            self.wait_for_params()
            for i in sorted(dirty):
                self._reconcile_master(self.buckets[i])

    def _follow_moved_parameter(self, module, name: str, p: torch.Tensor) -> bool:
        """Whether ``module.<name>``, no longer ``p``, holds it elsewhere because torch moved the same Parameter
        object, which torch.optim goes on training, and so does this optimizer, from its new place (an error
        calling it replaced until session 26, for pruning 27). Its values, which the move may have rewritten
        (``set_``, ``.data =``), are followed as any write is. Two moves are followed:

        * ``torch.nn.utils.parametrize`` (``spectral_norm``, ``orthogonal``, ``register_parametrization`` after
          ``attach``): ``module.parametrizations[name].original``;
        * ``torch.nn.utils.prune`` (``l1_unstructured`` and friends after ``attach``: ``module.<name>_orig``, with
          ``module.<name>`` a plain tensor its forward pre-hook recomputes), and ``prune.remove``, which puts it back
          under its first name: another name in the same module's own parameters.
        """
        lists = module._modules.get("parametrizations")
        holder = lists._modules.get(name) if lists is not None else None
        if holder is not None and holder._parameters.get("original") is p:
            to = (holder, "original", p)
            if self._overlap_machinery and self._attached is not None:
                # its reads wait for its gather, as its module's did (``module.weight`` outside a forward right after
                # step() reads holder.original; until session 27 without waiting)
                model_sync.guard_model(holder, self, [self._bucket_of[p][0].index], attributes=True)
        else:
            moved = next((n for n, q in module._parameters.items() if q is p), None)
            if moved is None:
                return False
            to = (module, moved, p)
        at = next(i for i, (m, n, q) in enumerate(self._model_params) if m is module and n == name and q is p)
        self._model_params[at] = to
        return True

    def _model_changed(self) -> bool:
        """Whether :meth:`sync_from_model` has something to follow (or to refuse) now, by its own looks, acting on
        none of them: the end of each backward asks (``_note_eager_step``), so that a step compiled by
        torch.compile, which skips sync_from_model (dynamo would wrap the parameters), runs eagerly after a write
        to the weights (a load after the optimizer was built, weight clipping after step(), an EMA swapped in),
        an edit of opt.state or of a group's list. Until session 24 such a step overwrote the written weights from
        the masters, silently. (A parameter replaced in the model gets no gradient in its bucket, which is enough
        for that step to run eagerly and raise.) Cost: ~0.13 us per parameter and backward (the versions and
        addresses; 40 us for 300 parameters on this repo's CPU machine)."""
        if self._state_edited() or (DATA_READS and not DATA_READS.isdisjoint(self._param_by_id)):
            return True
        if self._flags.precise_notes:
            return True
        if not self._group_lists_as_laid_out():
            return True
        now, now_versions = self._param_addresses_and_versions()
        return now_versions != self._param_versions or now != self._param_ptrs

    def _seen_version(self, p: torch.Tensor) -> Optional[int]:
        """``p``'s version counter as the last look at the model saw it (None: not looked at yet)."""
        i = self._param_index.get(p)
        return self._param_versions[i] if i is not None and i < len(self._param_versions) else None

    def _forget_precise_notes(self) -> None:
        """After the step's look: the fp32 notes are taken (or void: the update moves the masters on)."""
        self._flags.precise_notes = False
        for b in self.buckets:
            b.forget_notes()

    def _param_addresses_and_versions(self) -> tuple[list, list]:
        """(data_ptr, _version) of every parameter, as lists in ``_param_list``'s order (what sync_from_model and
        _model_changed compare with ``_param_ptrs`` and ``_param_versions``)."""
        plist = self._param_list
        with torch._C.DisableTorchFunctionSubclass():  # (WatchedParameter: ~90 ns less per attribute read)
            return list(map(_DATA_PTR, plist)), list(map(_VERSION, plist))

    def _group_lists_as_laid_out(self) -> bool:
        """Whether every group's ``params`` is still the list laid out, unchanged (a flag per group, no look at the
        parameters themselves): :meth:`_check_group_lists`' fast path."""
        groups, known = self.param_groups, self._group_lists
        return len(groups) == len(known) and all(g["params"] is ps and type(ps) is _ParamList and not ps.changed
                                                 for g, (ps, _) in zip(groups, known))

    def _note_group_lists(self, own: bool = False) -> None:
        """Remember each group's ``params`` list as laid out. ``own`` (construction, ``add_param_group``): the
        lists are torch.optim's own copies, which nobody else holds, and become :class:`_ParamList` s."""
        noted = []
        for g in self.param_groups:
            ps = g["params"]
            if own and type(ps) is list:
                ps = g["params"] = _ParamList(ps)
            if type(ps) is _ParamList:
                ps.changed = False
            noted.append((ps, tuple(ps)))
        self._group_lists = noted

    def _check_group_lists(self) -> None:
        """torch.optim reads ``param_groups`` afresh at every step, so code that appends a parameter to a group's
        list, replaces one in it (or a group to the list, or removes either) changes what it trains. Here the
        buffers were laid out from them: such a parameter would silently never train, or one removed train on. A
        RuntimeError naming the change instead (a list replaced by one with the same parameters is taken as it
        is; such a list of the user's is compared element by element at every step from then on)."""
        if self._group_lists_as_laid_out():
            return  # (every step)
        groups, known = self.param_groups, self._group_lists
        if len(groups) != len(known):
            raise RuntimeError(
                f"optimizer.param_groups has {len(groups)} groups, but {len(known)} were added through the optimizer: "
                "tritonshard lays a group's parameters out in its buffers when it is added, so add groups with "
                "opt.add_param_group({'params': [...]}) (and don't remove any)")
        for gi, (g, (_, was)) in enumerate(zip(groups, known)):
            now = g["params"]
            if len(now) != len(was) or any(a is not b for a, b in zip(now, was)):
                raise RuntimeError(
                    f"param_groups[{gi}]['params'] changed after it was added ({len(was)} parameters then, {len(now)} "
                    "now): tritonshard lays a group's parameters out in its buffers when the group is added, so a "
                    "parameter appended to the list would never train (and one removed would train on). Add "
                    "parameters with opt.add_param_group({'params': [...]}); freeze one with requires_grad_(False)")
        self._note_group_lists()  # (the same parameters, in new lists or written back in place)

    def _readopt(self, p: torch.Tensor) -> None:
        name = self._param_names[p]
        if p.device != self.device:
            raise RuntimeError(
                f"parameter {name} was moved to {p.device} after the optimizer was built on {self.device} (e.g. "
                "model.to(device) or accelerate's prepare()): tritonshard's buffers, master weights and state stay "
                "where they were built. Move the model first, then build the optimizer.")
        if p.dtype != self.param_dtype:
            raise RuntimeError(
                f"parameter {name} was converted to {p.dtype} after the optimizer was built (e.g. model.float() or "
                f"model.half()): tritonshard trains it as {self.param_dtype} views of its buffers (fp32 master "
                "weights kept sharded). Don't convert the model after building the optimizer; choose the weights' "
                "dtype with param_dtype=.")
        if p.device.type == "cpu" and p.is_shared():  # (CUDA storages always say they are shared)
            raise RuntimeError(
                f"parameter {name} was moved to shared memory after the optimizer was built (model.share_memory(), "
                "or the model sent to another process through torch.multiprocessing): that copies it, and the "
                "optimizer's step writes its own buffers, so the other processes would hold a copy that never "
                "changes. tritonshard's parameters are pieces of its buffers: sharing them with other processes is "
                "not supported; send them a copy of the weights instead (state_dict())")
        view = self._param_views[p]
        if tuple(p.shape) != tuple(view.shape):
            raise RuntimeError(f"parameter {name} changed shape from {tuple(view.shape)} to {tuple(p.shape)} "
                               "after the optimizer was built")
        self.wait_for_params()
        self._bucket_of[p][0].keep_weights_before_write()  # (the buffer holds the weights from before the swap still)
        with torch.no_grad():
            view.copy_(p.detach())
        p.data = alone(view)  # the same Parameter object, aliasing the buffer again
        watch(p)  # (a swap of the module's tensors, torch.utils.swap_tensors, takes the class along)
        i = self._param_index[p]
        self._param_versions[i] = p._version
        self._param_ptrs[i] = view.data_ptr()

    @torch.no_grad()
    def _reconcile_master(self, b: _Bucket) -> None:
        """Master := the parameter's value wherever the bf16 shard is not the rounding of the master (an outside
        write); elsewhere the master keeps its fp32 bits. With stored remainders the bf16 shard *is* the master's
        high half, so the written value is the master already, with its old remainder where the write was not seen
        coming (< 1/2 bf16 ulp) and none where it was, or where the weight is zero (:meth:`_Bucket.settle_remainders`).
        Then the fp32 values noted for the weights since (:meth:`_Bucket.take_precise`): whole in the step's look."""
        if b.master_remainder is not None:
            b.settle_remainders()
        elif not (b.precise and b.whole_take()):  # (which writes every master)
            b.master.copy_(b.followed(slice(None)))
        if b.precise:
            b.take_precise(self._final_look)

    def _frozen_since_build(self) -> list:
        """The parameters frozen since construction (``requires_grad=False``) that hold no gradient: torch.optim
        skips a parameter whose grad is None, whatever its requires_grad. One frozen after its backward, or given a
        gradient by hand, has one (its placeholder is placed) and is updated with it, as torch.optim does; one
        whose gradient the loop cleared after a reduction has none (``no_grad``, see _check_grads_since_reduction:
        until session 36 such a parameter, frozen before the step, was updated with the cleared gradient, found by
        tests.optim.loop_fuzz_long)."""
        if torch.compiler.is_compiling():  # dynamo would wrap the parameters, and so their placeholder grads
            return []
        with _PLAIN_ATTRS():
            if all(map(_REQUIRES_GRAD, self._param_list)):  # (the usual step: one C-level pass)
                return []
            return [p for p in self._param_list if not p.requires_grad
                    and (p not in (b := self._bucket_of[p][0]).placed or p in b.no_grad)]

    def _step_settings(self) -> tuple:
        """(digest, description) of the hyper-parameters this step updates with (every trained group's values of
        the optimizer's defaults' keys), which the step's handshake compares across ranks: each rank updates its own
        shard with its own, so a rank whose LR scheduler ran ahead (stepped on rank 0 only, or ReduceLROnPlateau fed
        each rank's own validation loss) would train its shard with another lr, silently (under DDP the replicas
        would drift apart, as silently). A hyper-parameter given as a CPU tensor (``lr=torch.tensor(0.01)``, as
        torch recommends for compiled optimizers) is compared by its value; one on a GPU is not (reading it would
        wait for the device). Floats are compared to 12 significant digits (:func:`_setting`). A few microseconds
        of host time per step, with more than one rank and the handshake on.

        Also compared: how many coefficients torch code multiplied ``param.grad`` by (:meth:`_common_multiplier`,
        which sets it before the handshake). The update applies them to this rank's shard of the sum over the
        ranks, so every rank must have folded the same ones. Torch code runs over its own rank's ``param.grad``,
        and on a rank where none is a placeholder (no gradient at all, or only plain tensors set by hand, which
        ``GradScaler.unscale_`` divides in place) nothing reaches tritonshard: until session 25 that rank updated
        its shard of the others' scaled gradients without the 1 / scale (64x the step, with SGD, in the probe)."""
        keys = tuple(self.defaults)
        values = tuple((gi, *map(g.get, keys)) for gi, g in self._trained_groups)
        if any(isinstance(v, torch.Tensor) for row in values for v in row):
            values = tuple(tuple(_tensor_setting(v) if isinstance(v, torch.Tensor) else v for v in row)
                           for row in values)
        folded = self._multipliers_folded
        cached = self._settings_cache
        if cached is not None and cached[0] == (values, folded):  # (the usual step: a few us, not ~20 for the text)
            return cached[1]
        text = "; ".join(f"param_groups[{row[0]}]: " + ", ".join(f"{k}={_setting(v)}" for k, v in zip(keys, row[1:]))
                         for row in values)
        if folded:
            text += (f"; param.grad multiplied {folded} time(s) by torch code (GradScaler.unscale_, "
                     "torch's clip_grad_norm_, p.grad.mul_ or div_)")
        settings = comm.digest(text.encode()), text
        self._settings_cache = ((values, folded), settings)
        return settings

    def _without_grad_everywhere(self) -> list:
        """The parameters that got no gradient since zero_grad() on every rank (a branch not taken, an expert no
        token chose, step() without a backward, ``model.zero_grad()`` before ``step()``): their ``param.grad`` would
        be None on every rank under DDP, and torch.optim skips them, so step() leaves them unchanged as it does the
        frozen ones. A parameter without a gradient on some ranks only contributes zeros there (DDP's average).

        Shakes hands for "step": the handshake carries a flag, raised by a rank that has such parameters; only then
        does every rank send one byte per parameter to find those without a gradient anywhere. Under torch.compile
        none are found (a step that has some runs eagerly, and on more ranks every step does: see step()), nor with
        ``check_collectives=False`` on more than one rank (no handshake to carry the flag: they are updated with zero
        gradients)."""
        if torch.compiler.is_compiling():  # (dynamo would wrap the parameters; the handshake is skipped)
            return []
        # (frozen ones are the caller's, known to every rank alike: no handshake flag for them)
        mine = [p for b in self.buckets if b.no_grad for p in b.no_grad if p.requires_grad]
        if not self._entry.active:  # one rank (mine are everyone's), or no handshake to agree through
            many = comm.is_initialized() and self.world_size * self.replica_size > 1
            return [] if many else mine
        self._step_entered = True
        if not self._entry("step", flag=bool(mine), settings=self._step_settings):
            return []
        n = len(self._param_list)
        mask = torch.zeros(n + 2, dtype=torch.bool)
        for p in mine:
            mask[self._param_index[p]] = True
        mask[n] = self._list_dependent  # (OR-ed: whether torch code on some rank clipped over its own list)
        mask[n + 1] = self._cleared_after_reduction  # (OR-ed: whether some rank cleared a reduction's gradients)
        everywhere, somewhere = self._entry.combine(mask)
        everywhere, somewhere = everywhere[:n].tolist(), somewhere.tolist()
        if somewhere[n + 1]:
            kept = [p for p, none in zip(self._param_list, everywhere) if not none and p.requires_grad]
            if kept:
                raise RuntimeError(
                    "tritonshard: the gradients reduced before step() (by a clip, a norm or GradScaler.unscale_(opt))"
                    " were all cleared (param.grad = None) on some ranks and kept on others: "
                    f"{_names([self._param_names[p] for p in kept])} still hold a gradient on some rank. Under DDP "
                    "the ranks that cleared them would skip this step and the others take it (the replicas would "
                    "drift apart), and the reduction holds every rank's gradients: it cannot take the cleared ones "
                    "back. Nothing was updated. Clear them on every rank (opt.zero_grad() everywhere, to skip a "
                    "step) or on none")
        # with a gradient on some ranks only: under DDP every rank's param.grad would hold the average, so torch
        # code over param.grad would see it on every rank, and torch.optim keeps it after the step
        partial = [p for p, none, some in zip(self._param_list, everywhere, somewhere) if some and not none]
        if partial and somewhere[n]:
            raise RuntimeError(
                f"tritonshard: torch code clipped or scaled param.grad in this step (torch.nn.utils.clip_grad_norm_, "
                f"clip_grad_value_, p.grad.mul_) while the ranks hold gradients of different parameters: "
                f"{_names([self._param_names[p] for p in partial])} got a gradient on some ranks only (param.grad "
                "None on the others). Each rank's torch code ran over its own list of gradients (its clip_grad_norm_ "
                "computed another norm), so the ranks would update with different clippings; under DDP every rank "
                "would hold the average of each. Nothing was updated. Use opt.clip_grad_norm_(max_norm) (the norm "
                "over every rank's gradients), or have every rank's backward reach the same parameters (a branch "
                "not taken on some ranks: add 0 * its output to the loss)")
        mine_here = set(mine)
        self._missing_here = [p for p in partial if p in mine_here]  # (their SpentGrad after the step: see there)
        return [p for p, none in zip(self._param_list, everywhere) if none]

    def _snapshot_pieces(self, params: list) -> dict:
        """Copies of this rank's master / state / bf16 pieces of ``params``, by bucket index, for
        ``_restore_pieces`` after the flat update (which would decay their weights and move their moments): a
        list per bucket of each piece's :meth:`_piece_copies`."""
        wanted, kept = set(params), {}
        for b in sorted({self._bucket_of[p][0] for p in params}, key=lambda b: b.index):  # (their buckets only)
            for piece in b.param_buffer.shard_pieces():
                if b.params[piece.tensor_index] in wanted and piece.numel:
                    sl = slice(piece.shard_start, piece.shard_end)
                    kept.setdefault(b.index, []).append(self._piece_copies(b, sl))
        return kept

    @staticmethod
    def _piece_copies(b, sl: slice) -> list:
        """[(shard view, saved copy)] of elements ``sl`` of bucket ``b``'s master (or remainders), bf16 shard and
        states (see _snapshot_pieces)."""
        targets = [b.master if b.master_remainder is None else b.master_remainder, b.param_buffer.get_local_shard(),
                   *b.state.values()]
        return [(t[sl], t[sl].clone()) for t in targets]

    @staticmethod
    def _restore_pieces(kept) -> None:
        for piece in kept:
            for dst, saved in piece:
                dst.copy_(saved)

    def _common_multiplier(self):
        """The product of the coefficients torch code multiplied ``param.grad`` by this step (None if none). Every
        parameter must have been scaled by the same ones: the update scales the whole gradient at once."""
        if self._all_multipliers:  # (every held gradient multiplied by each, in this order)
            return self._folded_product(self._all_multipliers)
        if not self._grad_multipliers:
            return self._folded_product(())
        same = self._same_multipliers_everywhere()
        if same is not None:
            return self._folded_product(same)
        # parameters without a gradient on this rank (param.grad None; zeros in the buffer) are skipped by torch's
        # clipping, and scaling their zeros changes nothing
        with_grad = [p for b in self.buckets for p in b.placed] + list(self._grad_multipliers)
        keys = {tuple(id(c) if torch.is_tensor(c) else float(c) for c in self._grad_multipliers.get(p, ()))
                for p in with_grad}
        if len(keys) != 1:
            scaled = sum(1 for p in self._param_list if p in self._grad_multipliers)
            raise RuntimeError(
                f"param.grad was multiplied (e.g. by torch.nn.utils.clip_grad_norm_) for {scaled} of the "
                f"{len(set(with_grad))} parameters of this optimizer that have a gradient, or by different "
                "coefficients: tritonshard folds one coefficient into the whole update. Clip all of the optimizer's "
                "parameters at once (model.parameters()), or use opt.clip_grad_norm_(max_norm); to scale or mask "
                "some parameters' gradients, do it in a hook on each, which runs before the optimizer takes the "
                "gradient (p.register_hook(lambda g: g * mask)). (A gradient set by "
                "hand is a plain tensor until the first multiply of a tritonshard gradient reduces them all, and a "
                "multiply before that is its own: set it after multiplying, or multiply it before setting.)")
        return self._folded_product(self._grad_multipliers[with_grad[-1]])

    def _folded_product(self, coefs) -> Optional[object]:
        """The product of ``coefs`` in order (None for none), which the update folds in: their number noted
        (compared across ranks by the step's handshake: _step_settings)."""
        total = None
        for c in coefs:
            total = c if total is None else total * c
        self._multipliers_folded = len(coefs)
        return total

    def _same_multipliers_everywhere(self) -> Optional[list]:
        """The coefficients of :meth:`_common_multiplier` where every parameter holding a gradient was multiplied
        by the same coefficients in the same order (torch's clip without foreach, a mul_ per gradient by its one
        coefficient tensor; ``p.grad /= n`` in a loop over the parameters), found in C-level passes over the lists
        (no Tensor.__hash__ per parameter, ~1 us each before, before the update's launch); None where that does not
        hold, for the look that names the difference."""
        lists = list(self._grad_multipliers.values())
        first = lists[0]
        if set(map(len, lists)) != {len(first)}:
            return None
        for j, c in enumerate(first):
            column = list(map(operator.itemgetter(j), lists))
            if all(map(operator.is_, column, itertools.repeat(c))):
                continue
            # (a number is compared by value, as the look below does: p.grad /= n makes 1 / n once per parameter)
            if torch.is_tensor(c) or set(map(type, column)) != {type(c)} or not all(
                    map(operator.eq, column, itertools.repeat(c))):
                return None
        held = set(map(id, itertools.chain.from_iterable(b.placed for b in self.buckets)))
        return first if held <= set(map(id, self._grad_multipliers)) else None

    def _reciprocal(self, divisor):
        """``1 / divisor`` for ``p.grad.div_(divisor)``: for a tensor, one reciprocal per divisor and step, since
        the multipliers of the parameters are compared by identity (:meth:`_common_multiplier`)."""
        if not torch.is_tensor(divisor):
            return 1.0 / divisor
        kept = self._reciprocals.get(id(divisor))
        if kept is None or kept[0] is not divisor:
            kept = self._reciprocals[id(divisor)] = (divisor, 1.0 / divisor)
        return kept[1]

    def _fold_grad_multiplier(self, p: torch.Tensor, coef) -> None:
        """``p.grad.mul_(coef)`` on a ShardedGrad: applied in the update (``grad_scale``), not as a pass."""
        self._fold_grad_multipliers([p], coef)

    def _fold_grad_multipliers(self, params: list, coef, placeholders: Optional[list] = None,
                               every_placed: bool = False) -> None:
        """:meth:`_fold_grad_multiplier` for each of ``params`` (``torch._foreach_mul_`` by one coefficient), the
        reduction looked at once. A parameter listed twice is multiplied twice, as torch's op would. ``placeholders``:
        the gradients torch's op got for them (in the same order), if it got them; ``every_placed``: GradScaler's
        unscale_, which multiplies every gradient the optimizer holds as well.

        Where the multiply is of every gradient the optimizer holds, each once (torch's foreach clip over
        ``model.parameters()``, ``unscale_``), and none was multiplied on its own before, the coefficient is noted
        once for all (``_all_multipliers``) instead of once per parameter: ~0.5 us per parameter here, and at the
        step :meth:`_common_multiplier` compared every parameter's list (~1 us each, ~0.4 ms per step at 292
        parameters, on the host before the update's launch). The same coefficients in the same order, so the same
        product: the same bits."""
        if not every_placed:  # (GradScaler's unscale_ reduced already, and is over the optimizer's own list)
            self._reduce_grads()  # the multiply applies to everything accumulated so far, and nothing may follow
            self._list_dependent = True
        # (the norm cache stays: it holds the norms before any multiplier, which _param_grad_norm applies, so a norm
        # read after torch's clip on every rank, a log line on rank 0 only, needs no collective of its own)
        if not self._grad_multipliers and placeholders is not None and self._every_placed_once(
                params, placeholders, covers=not every_placed):
            self._all_multipliers.append(coef)
            return
        multipliers = self._spread_all_multipliers()
        if every_placed:
            params = dict.fromkeys([*params, *(p for b in self.buckets for p in b.placed)])
        for p in params:
            multipliers.setdefault(p, []).append(coef)

    def _every_placed_once(self, params: list, placeholders: list, covers: bool) -> bool:
        """Whether each of ``params`` holds a gradient in the buffers (its ``param.grad`` is its placeholder, the
        one in ``placeholders``), each listed once, and (``covers``) every parameter holding one is listed. C-level
        passes, no look-up per parameter."""
        if covers and len(params) != sum(map(len, (b.placed for b in self.buckets))):
            return False
        with _PLAIN_ATTRS():
            grads = list(map(_GRAD, params))
        return all(map(operator.is_, grads, placeholders)) and len(set(map(id, params))) == len(params)

    def _spread_all_multipliers(self) -> dict:
        """``_grad_multipliers`` with the coefficients noted for every held gradient (``_all_multipliers``) moved
        into each such parameter's list, first (a multiply of some parameters only follows them)."""
        multipliers = self._grad_multipliers
        if self._all_multipliers:
            for p in [p for b in self.buckets for p in b.placed]:
                multipliers[p] = list(self._all_multipliers)
            self._all_multipliers.clear()
        return multipliers

    def _multipliers_of(self, p: torch.Tensor):
        """The coefficients torch code multiplied ``p.grad`` by this step, in order."""
        return self._all_multipliers or self._grad_multipliers.get(p, ())

    @torch.no_grad()
    def _clamp_grads(self, params: list, low, high) -> None:
        """``p.grad.clamp_(low, high)`` for each of ``params`` (``torch.nn.utils.clip_grad_value_``): on the reduced
        gradient, in the buffers. What torch code sees as ``p.grad`` is the shard times the factors the update
        applies so far (the average over ranks, 1 / the loss scale, the multipliers torch code folded in,
        ``opt.clip_grad_norm_``'s coefficient), so the shard is clamped to the bounds divided by them (one rounding
        of each bound to the gradient dtype: within one bf16 ulp of torch's clamp of bf16 gradients). A whole bucket
        at once where every parameter of it is clamped (the padding is zeros, which stay zeros when low <= 0 <=
        high), else piece by piece. Norms computed before are dropped: the next ones see the clamped values."""
        self._reduce_grads()
        self._list_dependent = True
        if low is None and high is None:
            raise ValueError("clamp: at least one of min and max must be given")
        factor = self._grad_average
        if self._scale is not None:
            factor = factor / self._scale
        if self._clip_coef is not None:
            factor = self._clip_coef * factor
        factors = {}  # the multipliers differ by parameter only in an error case (_common_multiplier says so)
        by_bucket: dict = {}
        for p in params:
            by_bucket.setdefault(self._bucket_of[p][0].index, []).append(p)
        for index, ps in by_bucket.items():
            b = self.buckets[index]
            shard = b.grad_buffer.get_local_shard()
            for p in ps:
                f = factor
                for c in self._multipliers_of(p):
                    f = f * c
                factors[p] = f
            f = factors[ps[0]]
            whole = (len(ps) == len(b.params) and all(factors[p] is f for p in ps)
                     and (low is None or _le(low, 0)) and (high is None or _le(0, high)))
            targets = [(shard, f)] if whole else [
                (shard[piece.shard_start:piece.shard_end], factors[b.params[piece.tensor_index]])
                for piece in b.param_buffer.shard_pieces() if b.params[piece.tensor_index] in factors and piece.numel]
            for t, f in targets:
                lo, hi = _bounds(low, high, f, t)
                t.clamp_(min=lo, max=hi)
        self._clamped = True
        self._norm_cache.clear()

    def _recheck_finite(self) -> None:
        """The step's non-finite flag from the gradients as they are now, after a clamp (step() calls this once
        where ``_clamped``, however many clamps the loop made): an inf clamped to a bound is finite, and
        torch.optim steps with it (a NaN stays NaN, and any non-finite value left still skips the step). Not with
        the optimizer's own loss scale, whose inf is an overflow that must skip and back off (as GradScaler's
        flag, taken at ``unscale_``, before any clamp). One read of the shards and one all-reduce."""
        shards = [s for s in (b.grad_buffer.get_local_shard() for b in self.buckets) if s.numel()]
        peaks = torch._foreach_norm(shards, math.inf) if shards else []  # (NaN or inf where any element is)
        flag = torch.zeros((), dtype=torch.float32, device=self.device)
        if peaks:
            flag = torch.logical_not(torch.isfinite(torch.stack(peaks).float()).all()).float()
        if comm.is_initialized() and self.world_size > 1:
            self._entry("clamp")  # (a rank that did not clamp is in another call: an error, not a hang)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.process_group)
        self._reduced_bufs[1].copy_(flag)

    def _param_grad_norm(self, p: torch.Tensor, norm_type: float) -> torch.Tensor:
        """``p``'s gradient norm over all ranks (averaged over ranks, unscaled, times any torch-side multiplier and
        ``opt.clip_grad_norm_``'s coefficient): what ``torch.linalg.vector_norm(p.grad)`` is with torch.optim. All
        parameters' norms are computed at once (one pass over the pieces, one all-reduce) and cached for the step,
        before any multiplier: a clip or an unscale_ since leaves the cache as it is."""
        cached = self._norm_cache.get(norm_type)  # (the hit inline: torch's clip asks once per parameter)
        norm = (cached or self._cached_param_norms(norm_type))[self._param_index[p]]
        for c in self._multipliers_of(p):
            norm = norm * (c.abs() if torch.is_tensor(c) else abs(c))
        if self._clip_coef is not None:  # (until session 26 left out: the unclipped norm after opt.clip_grad_norm_)
            norm = norm * self._clip_coef
        return norm

    def _param_grad_norms_of(self, params: list, norm_type: float) -> list:
        """:meth:`_param_grad_norm` of each of ``params`` (``torch._foreach_norm`` over placeholders), the cache
        looked up once, each parameter's multipliers only where there are any."""
        cache = self._cached_param_norms(norm_type)
        if self._grad_multipliers:
            return [self._param_grad_norm(p, norm_type) for p in params]
        if self._all_multipliers or self._clip_coef is not None:
            # every parameter's norm times the same factors, in :meth:`_param_grad_norm`'s order: one multiply of
            # the vector per factor (the same bits per element), not one per parameter and factor (torch's clip
            # after GradScaler's unscale_ was ~300 of them at 292 parameters, each a launch on a GPU)
            # (cached for these factors: the list only grows within a step, a new clip makes a new coefficient)
            key, coef = ("scaled", norm_type, len(self._all_multipliers)), self._clip_coef
            scaled = self._norm_cache.get(key)
            if scaled is None or scaled[0] is not coef:
                vector = self._norm_cache[("vector", norm_type)]
                for c in self._all_multipliers:
                    vector = vector * (c.abs() if torch.is_tensor(c) else abs(c))
                if coef is not None:
                    vector = vector * coef
                scaled = self._norm_cache[key] = (coef, vector.unbind())
            cache = scaled[1]
        return list(map(cache.__getitem__, map(self._index_by_id.__getitem__, map(id, params))))

    def _cached_param_norms(self, norm_type: float) -> tuple:
        """Every parameter's gradient norm before any multiplier, one 0-d tensor each (in ``_param_list``'s
        order), computed at the first ask of the step (reducing the gradients first) and cached for it."""
        cached = self._norm_cache.get(norm_type)
        if cached is None:
            self._reduce_grads()
            # (one unbind for every parameter's view of the vector: torch's clip asks for each, and an indexing
            # op per parameter was half of its ~6 torch ops per parameter before session 30)
            vector = self._norm_cache[("vector", norm_type)] = self._param_grad_norms(norm_type)
            cached = self._norm_cache[norm_type] = vector.unbind()
        return cached

    def _make_norm_pieces(self) -> tuple:
        """(a view of every non-empty piece of the grad shards, each piece's parameter index as a device tensor or
        None): the pieces never change, nor the shards (a Buffer's local shard is permanent), so they are made
        once, without a slice op and a layout walk per piece and norm (kept from the first eager call; a traced one
        makes its own)."""
        views, index = [], []
        for b in self.buckets:
            shard = b.grad_buffer.get_local_shard()
            first = self._param_index[b.params[0]]
            for piece in b.param_buffer.shard_pieces():
                if piece.numel:
                    views.append(shard[piece.shard_start:piece.shard_end])
                    index.append(first + piece.tensor_index)
        made = (views, torch.tensor(index, dtype=torch.int64, device=self.device) if index else None)
        if not torch.compiler.is_compiling():
            self._norm_pieces = made
        return made

    def _piece_plan(self) -> Optional["_PiecePlan"]:
        """The launches over every piece of the grad shards (views of :meth:`_make_norm_pieces`), made once per set
        of pieces: their workspace, per-piece slices of it, the segment sums and their output. None where the
        Triton kernels do not run here, under torch.compile, or without a piece."""
        if not triton_kernels_run(self.device) or torch.compiler.is_compiling():
            return None
        views, _ = self._norm_pieces if self._norm_pieces is not None else self._make_norm_pieces()
        plan = self._piece_norm_plan
        if plan is None or plan.views is not views:
            if not views:
                return None
            workspace, slices = shared_sum_sq_workspace([v.numel() for v in views], self.device)
            counts = [s.numel() for s, _ in slices]
            starts = [0] + list(itertools.accumulate(counts))[:-1]
            tables = [torch.tensor(t, dtype=torch.int64).to(self.device, non_blocking=True) for t in (starts, counts)]
            out = torch.empty(len(views), dtype=torch.float64, device=self.device)
            plan = self._piece_norm_plan = _PiecePlan(views, workspace, slices,
                                                      segment_sums_launch_spec(workspace[0], *tables, out), out)
        return plan

    def _piece_sums_of_squares(self, views: list, factor: float):
        """Each piece's sum of squares of the gradient times ``factor`` (1, or the 1/d average where it is a power of
        two: :meth:`_param_grad_norms`), fp64, one per view of :meth:`_make_norm_pieces`. Where this step's
        reduction ran the norm pass over the pieces (``_consume_all_reduced``: its partials, of the gradient times
        1/d, are in the pieces' workspace), ``factor`` is that 1/d and nothing changed the shards since (a clamp),
        one launch adding each piece's partials (:func:`~tritonshard.kernels.scale.segment_sums_`): the gradients
        are read once per step for the step's norm and torch's per-parameter norms alike (HF Trainer's and
        accelerate's clip; session 38, before which the pieces were read again here). Else two launches: the norm
        pass's kernel over the pieces (times ``factor``) into that workspace, then the segment sums (session 37;
        before it a ``torch.linalg.vector_norm`` per piece). None where this path does not run (the caller takes
        the torch ops)."""
        plan = self._piece_plan()
        if plan is None or plan.views is not views:
            return None
        if not (self._partials_of_pieces and not self._clamped and self._reduced is not None
                and factor == self._grad_average):
            spec = plan.spec(factor)
            if spec is None:  # (pieces of two dtypes or devices: the torch ops)
                return None

            def checked_pieces():
                for v, part in zip(views, plan.slices):
                    sum_sq_partials_(v, factor, part)
            _launch.launch(plan.launches, ("pieces", factor), spec, checked_pieces)
        segments = plan.segments
        _launch.launch(plan.launches, "segments", segments,
                       lambda: segment_sums_(segments[2][0], *segments[2][1:3], plan.out))
        return plan.out

    @torch.no_grad()
    def _param_grad_norms(self, norm_type: float) -> torch.Tensor:
        if not norm_type > 0:
            raise ValueError(f"norm_type must be > 0 or inf, got {norm_type}")
        is_inf = norm_type == math.inf
        views, idx = self._norm_pieces if self._norm_pieces is not None else self._make_norm_pieces()
        acc = torch.zeros(len(self._param_list), dtype=torch.float64, device=self.device)
        # the 2-norm's sums are of the gradient times the 1/d average where that is a power of two (the norm pass's
        # partials are: one read of the gradients for both, _piece_sums_of_squares), on every rank whichever way
        # it took them (the sums are added over the ranks below: until it was one factor for all, a rank holding
        # no piece, or reading its pieces again, scaled its norms by 1/d once more, found by a 4-rank probe the
        # day it was written); sqrt(sum((g/d)^2)) = sqrt(sum(g^2)) / d exactly in fp64: the bits of before
        factor = self._grad_average if norm_type == 2.0 and _power_of_two(self._grad_average) else 1.0
        sums = self._piece_sums_of_squares(views, factor) if norm_type == 2.0 and views else None
        if sums is not None:  # (the 2-norm where the Triton kernels run: one or two launches for every piece)
            acc.index_add_(0, idx, sums)
        elif views:
            # each piece's norm in one pass accumulating in fp64 (torch's reduction upcasts as it reads: no fp64
            # copy of the piece, as the abs / square / sum ops before session 30 made, ~4 passes of fp64
            # temporaries and 5 torch ops per piece), raised to the power once for all pieces below. The fp64
            # sums: how a parameter is cut into pieces (by the layout, so by bucket_cap_mb) and summed over ranks
            # moves them by ~1e-16 relative, below the fp32 rounding of the norm (bucket invariance)
            stacked = torch.stack([torch.linalg.vector_norm(v, norm_type, dtype=torch.float64) for v in views])
            if is_inf:
                acc.scatter_reduce_(0, idx, stacked, reduce="amax")
            elif norm_type == 2.0:
                acc.index_add_(0, idx, stacked.square_() if factor == 1.0 else stacked.square_().mul_(factor ** 2))
            else:
                acc.index_add_(0, idx, stacked.pow_(norm_type))
        if comm.is_initialized() and self.world_size > 1:
            self._entry("param_norms")
            dist.all_reduce(acc, op=dist.ReduceOp.MAX if is_inf else dist.ReduceOp.SUM, group=self.process_group)
        norms = acc if is_inf else (acc.sqrt() if norm_type == 2.0 else acc.pow(1.0 / norm_type))
        # the shards hold the SUM over ranks: times the 1/d average, unless the sums took it (above)
        norms = (norms if factor != 1.0 else norms * self._grad_average).float()
        return norms / self._scale if self._scale is not None else norms


class _PiecePlan:
    """:meth:`ModelViewMixin._piece_plan`: the pieces, their workspace and per-piece slices of it, the segment sums'
    launch and output, the norm pass's launch over them per factor (:meth:`spec`), the bound launches."""

    def __init__(self, views: list, workspace: tuple, slices: list, segments: tuple, out: torch.Tensor):
        self.views, self.workspace, self.slices, self.segments, self.out = views, workspace, slices, segments, out
        self.launches: dict = {}
        self._specs: dict = {}

    def spec(self, factor: float) -> Optional[tuple]:
        """The norm pass over every piece, each element times ``factor`` (None: pieces of two dtypes or devices)."""
        if factor not in self._specs:
            self._specs[factor] = partials_multi_launch_spec(self.views, factor, self.slices)
        return self._specs[factor]


def _power_of_two(x: float) -> bool:
    m, _ = math.frexp(x)
    return x > 0 and m == 0.5


def _le(a, b) -> bool:
    """a <= b for numbers or 0-d tensors (a host read for a tensor bound: value clipping takes numbers)."""
    return bool(a <= b)


def _bounds(low, high, factor, t: torch.Tensor) -> tuple:
    """The clamp bounds of gradient values ``t`` that the update multiplies by ``factor``: ``low / factor`` and
    ``high / factor`` (swapped for a negative number), as numbers or as 0-d tensors of ``t``'s dtype."""
    if not torch.is_tensor(factor) and not torch.is_tensor(low) and not torch.is_tensor(high):
        lo = None if low is None else low / factor
        hi = None if high is None else high / factor
        if factor < 0:
            lo, hi = hi, lo
        return lo, hi
    # (a tensor factor: clip coefficients, GradScaler's inverse scale, the loss scale: all positive)
    factor = torch.as_tensor(factor, dtype=torch.float32, device=t.device)
    lo = None if low is None else (torch.as_tensor(low, dtype=torch.float32, device=t.device) / factor).to(t.dtype)
    hi = None if high is None else (torch.as_tensor(high, dtype=torch.float32, device=t.device) / factor).to(t.dtype)
    return lo, hi
