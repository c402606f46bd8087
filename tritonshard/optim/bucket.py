"""The storage of one bucket: a param Buffer, a grad Buffer with the same layout, and this rank's fp32 shards
(master weights and optimizer state); and how parameters are cut into buckets.

What lives where (world size d, this rank r) is described in :mod:`tritonshard.optim.base`; this module only
allocates and names it. A bucket built with ``owners`` (ShardedMuon) has every parameter whole in one rank's
shard (see :class:`~tritonshard.layout.Layout`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from typing import Optional

import torch
import torch.distributed as dist
from torch.utils.weak import WeakIdKeyDictionary

from .. import comm
from ..buffer import Buffer
from ..kernels.rounding import combine_bf16_remainder, remainder_after_write, split_bf16_remainder

__all__ = ["split_into_buckets"]


def alone(view: torch.Tensor) -> torch.Tensor:
    """``view`` (a parameter's piece of its bucket's buffer) as a tensor with a storage of its own: the same memory
    (the buffer kept alive by it, through DLPack's deleter), so every write to the buffer is in the parameter, but
    each parameter looks like a tensor of its own to code that groups tensors by storage. A parameter that is a
    view of a shared buffer does not: accelerate's safetensors save (``save_state``, ``save_model``) kept one
    tensor per storage and silently dropped the rest (20 of 21 weights of a tiny Llama), and safetensors'
    ``load_model`` refuses views that do not cover their storage. What becomes a parameter's ``.data``."""
    return torch.from_dlpack(view)


_NO_TRACE = contextlib.nullcontext()


def trace(label: str, *args):
    """A profiler range while a profiler records (visible in traces); nothing otherwise, nor under torch.compile.
    (``record_function`` costs ~3 us of host time per range even with no profiler on: 6 ranges per bucket.) The
    name is ``label.format(*args)``, formatted only then (an f-string at every call site cost its formatting, per
    bucket, also without a profiler)."""
    if torch.compiler.is_compiling() or not torch.autograd.profiler._is_profiler_enabled:
        return _NO_TRACE
    return torch.profiler.record_function(label.format(*args) if args else label)


_TENSOR_DATA = torch._C.TensorBase.data  # (the getter and setter of Tensor.data)
_WHOLE = slice(None)  # (``p[:]``)
_OBJECT_SETATTR = object.__setattr__
#: ``set_grad(param, g)``: tritonshard's own ``param.grad = g``, past :meth:`WatchedParameter.__setattr__` (which
#: notes the loop's): its placeholders and spent markers, placed per parameter per step
set_grad = torch._C.TensorBase.grad.__set__
#: Reading or setting an attribute of a laid-out parameter (a WatchedParameter, a Parameter subclass) costs ~0.2-0.3
#: us more than of a plain one: torch looks for a __torch_function__ override on each. The optimizer's per-parameter
#: loops (the flush, the step, zero_grad, the frozen check) read ``param.grad``/``dtype``/``device``/
#: ``requires_grad`` and set ``param.grad`` (through set_grad) inside this context, which skips that lookup; they
#: run no torch op in it (an op on a placeholder needs its __torch_function__, ShardedGrad's). 148 parameters:
#: ~0.7 -> ~0.2 us per read/set on this repo's CPU machine.
plain_attrs = torch._C.DisableTorchFunctionSubclass

#: id of every laid-out parameter -> a weak reference to the bucket holding it (set by the bucket, so a parameter
#: taken over by another optimizer points to its new bucket): how :func:`landed` finds a parameter's in-flight
#: all-gather from the parameter alone. A stale id (a parameter gone) is never looked up: only parameters of
#: :class:`WatchedParameter`, all of them laid out, are.
OWNER: dict = {}

#: how many buckets have been collected (an optimizer gone, ``del opt``): its parameters are held by none now, so
#: what was found unheld before (a DDP wrapper's list of parameters to average, ``_ddp_unheld``) is looked for again
HOLDERS_GONE = [0]


def _holder_gone(_ref) -> None:
    HOLDERS_GONE[0] += 1


def owner_of(p: torch.Tensor) -> "Optional[_Bucket]":
    """The bucket holding the laid-out parameter ``p`` (:data:`OWNER`; retired or not), None where none does. (Two
    paths read OWNER inline instead, per parameter and step: :func:`landed`, on the forward's attribute reads, and
    :func:`_must_look`, on every ``param.grad`` assignment, ``model.zero_grad()``'s.)"""
    ref = OWNER.get(id(p))
    return ref() if ref is not None else None


def _must_look(p: torch.Tensor, written: bool = False) -> None:
    """The next step of ``p``'s optimizer must look at the parameters: run eagerly if compiled (see
    WatchedParameter). ``written``: ``p``'s values were replaced past its version counter (``p.data = t``): an fp32
    copy noted for its master (:meth:`_Bucket.note_precise`), and the in-place calls noted since
    (:meth:`_Bucket.note_call`), no longer hold. (A ``.data`` read leaves them to the look, which knows whether a
    write through it followed: :meth:`_Bucket.data_handed_out`.)"""
    ref = OWNER.get(id(p))
    b = ref() if ref is not None else None
    if b is not None:
        if b.step_flags is not None:
            b.step_flags.eager_step_needed = True
        if written:
            if b.precise:
                b.precise.pop(id(p), None)
            if b.calls:
                b.calls.pop(id(p), None)
    if written and UNHELD_PRECISE:
        _unheld_written(p)


def where_rounded(weight: torch.Tensor, value: torch.Tensor, otherwise: torch.Tensor) -> torch.Tensor:
    """``value`` (fp32) wherever the bf16 ``weight`` is still its rounding, ``otherwise`` elsewhere: the rule by
    which every look at the weights decides what a write left (a master, or fp32 values noted for the weights,
    kept where the weight still holds their rounding; elsewhere the weight was written)."""
    return torch.where(weight == value.to(weight.dtype), value, otherwise)


def landed(p: torch.Tensor) -> None:
    """Wait for the all-gather of ``p``'s bucket if it is in flight. With ``overlap_comm`` and ``attach``, step()
    leaves the gathers running into the next forward, whose pre-hooks wait for them module by module; the other
    paths to a parameter wait here: the model's attributes (``model.lm_head.weight``, a guarded module's
    ``__getattr__``), ``.data`` (:class:`WatchedParameter`) and the model's parameter listings, each for the
    parameter it hands out only. Without it a read right after step() saw the last step's weights in some
    elements, and a write (``model.embed.weight[pad].zero_()``) could be overwritten by the gather landing after
    it, silently."""
    ref = OWNER.get(id(p))
    b = ref() if ref is not None else None
    if b is not None and b.ag_work is not None:
        b.wait_gather()


def before_write(p: torch.Tensor) -> None:
    """:func:`landed`, before a write into ``p`` that :class:`WatchedParameter` sees coming (``copy_``, a setitem,
    ``zero_`` / ``normal_`` / ``uniform_``), and with stored remainders the first such write since the last look
    keeps the bucket's weights as they were (:meth:`_Bucket.keep_weights_before_write`)."""
    b = owner_of(p)
    if b is None:
        return
    if b.ag_work is not None:
        b.wait_gather()
    b.keep_weights_before_write()

#: a laid-out parameter given an fp32 copy (:meth:`WatchedParameter.copy_`), or an in-place call (:func:`_mirrored`),
#: while no live optimizer holds it laid out (frozen when the optimizer training the rest was built, which took it
#: over from the one that laid it out) -> (the values it stands for, whole, as fp32; its version then), for the
#: optimizer that lays it out next (:class:`_Bucket`): its master takes them, all of them where nothing wrote the
#: parameter since (its weights then their rounding), else where the weight is still their rounding, as a
#: construction takes the original values
UNHELD_PRECISE = WeakIdKeyDictionary()
#: the parameters some optimizer holds frozen since its construction, not laid out (ShardedOptimizer's
#: ``_frozen_at_build``): where a copy into one is kept in UNHELD_PRECISE (the others are laid out by nobody next)
HELD_FROZEN = WeakIdKeyDictionary()

#: ids of the parameters whose ``.data`` was handed out since their optimizer last looked (sync_from_model): a
#: write through it (``p.data.copy_(x)``, ``m.weight.data.normal_()``) does not move the parameter's version
#: counter, so only this says to look at their weights. A stale id (a parameter gone since) costs one look.
DATA_READS: set = set()

#: id of a parameter in :data:`DATA_READS` -> ``(a weak reference to it, [[weak reference to a .data handed out, a
#: tensor sharing its version counter, that counter when the parameter was last written whole]])``: whether a write
#: through one went through torch since (``p.data.copy_(x)``, ``p.data[0] = v``: its counter moved) or not (only
#: reads, an EMA's, a logger's; or a write past every counter: a collective, DLPack), which the look treats apart
#: (:meth:`_Bucket.data_handed_out`). An entry goes with its parameter (the tensors it keeps hold the parameter's
#: storage, its bucket's buffer: a loop that logs p.data and then lets the model and the optimizer go must free
#: them). Pruned at a parameter's 8th read since its last look: of the handouts gone (their views keep them alive),
#: one written through is kept, none other.
DATA_HANDED: dict = {}


def _written(entry: list) -> bool:
    return entry[1]._version != entry[2]


def _handed_entries(p: torch.Tensor) -> list:
    """The entries of the ``.data`` of ``p`` handed out since its optimizer's last look (:data:`DATA_HANDED`),
    the table's row made where there is none."""
    key = id(p)
    handed = DATA_HANDED.get(key)
    if handed is None:
        handed = DATA_HANDED[key] = (weakref.ref(p, lambda _, key=key, table=DATA_HANDED: table.pop(key, None)), [])
    return handed[1]


def _hand_out(p: torch.Tensor) -> torch.Tensor:
    """``p.data`` (torch's, as a :class:`WatchedData`), kept in :data:`DATA_HANDED` (~1 us for the subclass, ~1 us
    for a weak reference and a detach)."""
    data = torch.Tensor._make_subclass(WatchedData, _TENSOR_DATA.__get__(p), False)
    kept = _handed_entries(p)
    if len(kept) >= 8:
        gone = next((entry for entry in kept if entry[0]() is None and _written(entry)), None)
        kept[:] = [entry for entry in kept if entry[0]() is not None]
        if gone is not None:
            kept.insert(0, gone)
    entry = [weakref.ref(data), data.detach(), 0]  # (detach: the same version counter, from 0)
    kept.append(entry)
    data._watched = (weakref.ref(p), entry)
    return data


def written_through_data(key: int) -> bool:
    """Whether torch wrote through a ``.data`` of the parameter of id ``key`` handed out since its last look (and
    forget them: the look takes what they did)."""
    handed = DATA_HANDED.pop(key, None)
    return handed is not None and any(map(_written, handed[1]))

#: ids of the parameters whose post-accumulate-grad hooks a backward must look at (``ShardedOptimizer.
#: _user_post_hooks``): a laid-out parameter given one by the loop (:meth:`WatchedParameter.
#: register_post_accumulate_grad_hook`) or holding one when laid out, and every parameter of another class, whose
#: registrations are not seen. Nothing else pays for the look. A stale id (a parameter gone since) costs one look.
POST_HOOKED: set = set()


class WatchedParameter(torch.nn.Parameter):
    """A parameter a tritonshard optimizer holds (its class is switched to this one when it is laid out: torch's
    ``Parameter`` in every other way, and named so; a deep copy or a pickle is a plain one): reading ``.data``
    notes it in :data:`DATA_READS` (and waits for the parameter's in-flight all-gather, :func:`landed`). ``.data``
    is a new tensor
    over the same memory with a version counter of its own, so code that writes through it (an EMA swapped in,
    ``p.data.copy_(pretrained)``, an init written as ``m.weight.data.normal_()``) wrote the weights unseen: the next
    step() rewrote them from the masters, silently, where torch.optim trains from the written values. The step
    reconciles the buckets of the noted parameters elementwise, as for any write (a read changes nothing there),
    and keeps what was noted for their masters unless torch wrote through a ``.data`` (:data:`DATA_HANDED`).
    Cost: ~3 us per ``.data`` read (0.35 -> 3.3 us on this repo's CPU machine, 1.9 of them before session 44's
    :class:`WatchedData`); nothing per step when none was.
    Its elementwise in-place methods (``mul_``, ``clamp_``...), and those of the ``.data`` it hands out
    (:class:`WatchedData`), are noted for the fp32 master too (:func:`_mirrored`)."""

    @property
    def data(self):
        DATA_READS.add(id(self))
        landed(self)  # (what it hands out may be read or written at once)
        _must_look(self)  # (what was noted for the master stays until the look: data_handed_out)
        if torch.compiler.is_compiling():
            return _TENSOR_DATA.__get__(self)
        return _hand_out(self)

    @data.setter
    def data(self, value):
        """torch's, noted for the owning optimizer's next look (:func:`_must_look`) as a write past the version
        counter unless ``value`` is the parameter's own elements (:func:`_same_elements`), after retiring that
        optimizer where ``value`` has another shape (:meth:`~tritonshard.optim.base.ShardedOptimizer.
        _param_reshaped`). A ``value`` over the parameter's own memory in another layout (``p.data = p.t()`` of a
        square weight: the transposed values) is taken as a copy of those values: the look sees a parameter at the
        same address and would leave it there, its gradients flattened in its logical order onto elements the
        update reads in the buffer's (until session 46 the training silently paired them wrongly)."""
        if torch.compiler.is_compiling():
            _TENSOR_DATA.__set__(self, value)
            return
        written = not _same_elements(value, self)  # (before the assignment: after it, they are the same)
        if written and isinstance(value, torch.Tensor):
            b = owner_of(self)
            if b is not None and not b.retired:
                if value.shape != self.shape:
                    reshaped = b.reshaped() if b.reshaped is not None else None
                    if reshaped is not None:
                        reshaped(self, value.shape)
                elif _aliases_in_another_layout(value, self):
                    value = value.clone(memory_format=torch.contiguous_format)
        _TENSOR_DATA.__set__(self, value)
        _must_look(self, written=written)

    def copy_(self, src, non_blocking=False):
        """torch's ``copy_``, after this parameter's in-flight all-gather (which would land on the copy), and with a
        source of another floating dtype (an fp32 checkpoint into the bf16 weights: ``model.load_state_dict``
        copies each tensor with this, as does ``p.copy_(w)`` under ``no_grad``) noted for the owning optimizer's
        fp32 master (:meth:`_Bucket.note_precise`): the weights get its bf16 rounding, as in torch, and the next
        look at the weights (the step's) takes its fp32 value as the master where nothing wrote the weight since
        (an fp32 EMA swapped in to evaluate, then the weights put back: the masters stay as they were), as the
        optimizer built after the load takes the original values. Until session 40 the master took the rounded
        weight, so a fine-tune loaded after building the optimizer started from masters 2^-9 (relative) away from
        the checkpoint, and trained to other weights than one built after the load, silently."""
        if torch.compiler.is_compiling():
            return super().copy_(src, non_blocking)
        before_write(self)
        out = super().copy_(src, non_blocking)
        handed = DATA_HANDED.get(id(self))
        for entry in handed[1] if handed is not None else ():  # (writes through .data before it are replaced: the
            # look need not know of them, data_handed_out; those after it, it must)
            entry[2] = entry[1]._version
        b = owner_of(self)
        precise = isinstance(src, torch.Tensor) and src.dtype != self.dtype and src.is_floating_point()
        if b is not None and not b.retired:
            if b.calls:  # (the copy replaces every value: what was noted of the calls before it is void)
                b.calls.pop(id(self), None)
            if precise:
                b.note_precise(self, src, non_blocking)
            elif b.precise:
                b.precise.pop(id(self), None)
        elif precise and self in HELD_FROZEN:  # (held frozen by the optimizer training the rest: kept whole for
            # when it lays it out)
            UNHELD_PRECISE[self] = (src.detach().expand(self.shape).to(self.device, torch.float32, copy=True),
                                    _VERSION_OF(self))
        elif self in UNHELD_PRECISE and self in HELD_FROZEN:
            # (a copy of the weights' own dtype: the kept values hold where the weight is still their rounding, as a
            # master's do after a write; until session 47 they were dropped, so the model's weights loaded after the
            # optimizer's state, a rollback to a save made after an in-place call, left the bf16 weights as masters)
            _unheld_written(self)
        else:
            UNHELD_PRECISE.pop(self, None)
        return out

    def __setitem__(self, key, value):
        """torch's, and a write of the whole parameter (``p[:] = w``, ``p[...] = w``: a loader's, or weights put back
        from a backup) as :meth:`copy_` (a tensor) or ``fill_`` (a number), which it is in torch: an fp32 ``w``
        reaches the master unrounded, and a backup put back after an in-place call drops the call. Until session
        42 torch's ran, unnoted: the master took ``w``'s bf16 rounding, and a restore after a decay below half an
        ulp was taken, elementwise, for the decay's result (the master kept the decay). Any other key waits for the
        parameter's in-flight all-gather first (:func:`landed`: a padding row zeroed through a parameter held from
        before ``step()`` with ``overlap_comm``), as ``copy_`` and the mirrored methods do."""
        if torch.compiler.is_compiling():
            return super().__setitem__(key, value)
        if key is Ellipsis or (type(key) is slice and key == _WHOLE):
            if isinstance(value, torch.Tensor):
                self.copy_(value)
                return
            if isinstance(value, (int, float, bool)):
                self.fill_(value)
                return
        before_write(self)
        super().__setitem__(key, value)

    def module_load(self, other, assign=False):
        """torch's ``module.load_state_dict`` under ``torch.__future__.set_swap_module_params_on_conversion(True)``
        (torch calls this, then ``torch.utils.swap_tensors(param, result)``): a RuntimeError that names the flag and
        the ways that work, before anything is written. The swap would give the parameter object another tensor,
        no longer its piece of the optimizer's flat buffers and without the optimizer's gradient hooks, and
        ``swap_tensors`` refuses a tensor something holds a weak reference to, as the optimizer's hooks and
        placeholders do: torch's own error said only that, after the weights were already copied. The default
        flag (``False``) loads by ``copy_``, which the optimizer follows."""
        b = owner_of(self)
        if b is not None and not b.retired and not torch.compiler.is_compiling():
            raise RuntimeError(
                "tritonshard: model.load_state_dict() with torch.__future__.set_swap_module_params_on_conversion"
                "(True) swaps each parameter's tensor for another (torch.utils.swap_tensors), and a parameter of a "
                "tritonshard optimizer is a piece of the optimizer's flat buffers, held by its gradient hooks: it "
                "cannot be swapped. Load with the flag off (torch.__future__.set_swap_module_params_on_conversion"
                "(False) around the call, and assign=False, the default: torch then copies into the parameters, "
                "which the optimizer follows), or load before building the optimizer. No parameter was written")
        return super().module_load(other, assign=assign)

    def register_post_accumulate_grad_hook(self, hook):
        """torch's, noted in :data:`POST_HOOKED`: the hook reads ``param.grad`` as torch's autograd leaves it (the
        sum over the backwards so far), which the optimizer then keeps there (``ShardedOptimizer._hand_back_grad``).
        The optimizer's own hook goes past this (``overlap_comm``'s machinery: one per parameter)."""
        POST_HOOKED.add(id(self))
        return super().register_post_accumulate_grad_hook(hook)

    def __setattr__(self, name, value):
        """``param.grad = g`` (``model.zero_grad()``, a gradient set or cleared by hand) and ``param.data = t``
        tell the owning optimizer that its next step must look at the parameters (as a ``.data`` read does): a
        step compiled by torch.compile cannot, so it took the last backward's gradients (until session 24: a
        model.zero_grad() between the backward and a compiled step, which torch.optim then skips entirely, or a
        gradient set by hand, silently ignored). tritonshard's own assignments go through :data:`set_grad`, not
        here. (``param.data = t`` is noted by the ``data`` property's setter, which this calls.) Cost: ~0.2 us per
        assignment (a Python frame), nothing per read."""
        _OBJECT_SETATTR(self, name, value)
        if name == "grad" and not torch.compiler.is_compiling():
            _must_look(self)

    def __repr__(self, *, tensor_contents=None):
        return torch.nn.Parameter.__repr__(torch.nn.Parameter(_TENSOR_DATA.__get__(self), self.requires_grad))

    def __deepcopy__(self, memo):  # (torch's, with torch's class: a copy is no optimizer's)
        if id(self) not in memo:
            memo[id(self)] = torch.nn.Parameter(
                _TENSOR_DATA.__get__(self).clone(memory_format=torch.preserve_format), self.requires_grad)
        return memo[id(self)]


#: torch.Tensor's in-place methods that compute each element from the same element of the tensor and of each tensor
#: argument (broadcast): :class:`WatchedParameter` runs them on the bf16 weights, as torch does, and notes the call
#: for the fp32 master (:func:`_mirrored`)
MIRRORED_METHODS = ("mul_", "div_", "add_", "sub_", "clamp_", "clamp_min_", "clamp_max_", "lerp_", "addcmul_",
                    "addcdiv_", "fill_", "masked_fill_")
_VERSION_OF = torch._C.TensorBase._version.__get__


def _mirrored(name: str):
    """``WatchedParameter.<name>``: torch's in-place method on the bf16 weights, and the call noted by the bucket
    holding the parameter (:meth:`_Bucket.note_call`), whose next look at the weights runs it on the fp32 values
    they stand for: the master then holds what torch's fp32 weights would (a weight decay of the loop's own,
    ``p.mul_(1 - lr * wd)``, whose change is below half a bf16 ulp: until session 41 lost, every step, silently;
    weight clipping, ``p.clamp_``). Cost: ~3 us of host time per call more than torch's (a Python frame and a note:
    ~2 -> ~5 us per ``p.mul_`` on this repo's CPU machine), and at the next look a few small torch ops per bucket
    where every parameter in it had the same calls with numbers, per piece of this rank's shard otherwise."""
    method = getattr(torch.Tensor, name)

    def mirrored(self, *args, **kwargs):
        if torch.compiler.is_compiling():
            return method(self, *args, **kwargs)
        b = owner_of(self)
        if b is None or b.retired:
            if self in HELD_FROZEN:  # (its values, whole, kept for when it is laid out)
                return _mirror_unheld(self, method, name, args, kwargs)
            return method(self, *args, **kwargs)  # (no optimizer lays it out next: the weights are what it takes)
        return _call_noted(b, self, self, method, name, args, kwargs)

    mirrored.__name__ = mirrored.__qualname__ = name
    mirrored.__doc__ = f"torch.Tensor.{name}, and the call noted for the fp32 master (see :func:`_mirrored`)."
    return mirrored


def _call_noted(b: "_Bucket", p: torch.Tensor, target: torch.Tensor, method, name: str, args: tuple, kwargs: dict):
    """torch's in-place ``method`` on ``target`` (``p`` itself, or a ``.data`` of it), after ``p``'s in-flight
    all-gather (:func:`landed`: it would land on the result), noted for ``p``'s fp32 master by its bucket ``b``."""
    if b.ag_work is not None:
        b.wait_gather()
    before = b.before_call(p)
    out = method(target, *args, **kwargs)
    b.note_call(p, before, name, args, kwargs)
    return out


class WatchedData(torch.Tensor):
    """What ``.data`` of a :class:`WatchedParameter` hands out: torch's ``.data`` (a tensor over the parameter's
    memory with a version counter of its own; every torch function on it, and every result, plain), whose
    elementwise in-place methods (:data:`MIRRORED_METHODS`, and ``*=``, ``+=``, ``-=``, ``/=``) are the
    parameter's mirrored ones: the call runs on the bf16 weights and is noted for the fp32 master
    (:func:`_data_mirrored`). A loop's decoupled decay written as ``p.data.mul_(1 - lr * wd)`` (older code's way)
    lost its change below half a bf16 ulp, every step, silently, until session 44 (a stated limit then). Any
    other write through it (``copy_``, a view's, ``numpy()``) is seen by its version counter as before
    (:meth:`_Bucket.data_handed_out`). Pickled and deep-copied as a plain tensor (a copy is nobody's weights)."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __reduce_ex__(self, protocol):
        return torch.Tensor.__reduce_ex__(self.as_subclass(torch.Tensor), protocol)

    def __deepcopy__(self, memo):
        if id(self) not in memo:
            memo[id(self)] = self.as_subclass(torch.Tensor).clone(memory_format=torch.preserve_format)
        return memo[id(self)]

    def __repr__(self, *, tensor_contents=None):  # (torch's, as for the plain tensor it stands for)
        return torch.Tensor.__repr__(self.as_subclass(torch.Tensor), tensor_contents=tensor_contents)


def _data_mirrored(name: str):
    """``WatchedData.<name>``: the mirrored method (:func:`_mirrored`) of the parameter whose ``.data`` this is,
    run on this tensor, while nothing wrote through it unseen since it was handed out (its counter then, or after its
    last mirrored call) and it still is the parameter's memory; torch's method otherwise (the look follows what it
    wrote, as it did for every write through ``.data`` before session 44)."""
    method = getattr(torch.Tensor, name)

    def mirrored(self, *args, **kwargs):
        watched = self.__dict__.get("_watched")
        p = watched[0]() if watched is not None else None
        if p is None or torch.compiler.is_compiling():
            return method(self, *args, **kwargs)
        entry = watched[1]
        b = owner_of(p)
        if _written(entry) or self.data_ptr() != p.data_ptr() or self.shape != p.shape or self.dtype != p.dtype:
            return method(self, *args, **kwargs)
        if b is None or b.retired:
            if p not in HELD_FROZEN:
                return method(self, *args, **kwargs)
            # (held frozen: its kept values, as p.mul_ keeps them; until session 47 torch's call alone, so the
            # frozen head's master, once laid out, was the bf16 result: found by tests.optim.loop_fuzz_long)
            out = _mirror_unheld(p, method, name, args, kwargs, target=self)
            kept = _handed_entries(p)  # (the look at the kept values took the .data handed out: this one is live
            if not any(e is entry for e in kept):  # still, and a later write through it must be seen)
                kept.append(entry)
        else:
            out = _call_noted(b, p, self, method, name, args, kwargs)
        entry[2] = entry[1]._version  # (this write is the noted call's: no unseen write through this .data)
        return out

    mirrored.__name__ = mirrored.__qualname__ = name
    mirrored.__doc__ = f"torch.Tensor.{name}, and the call noted for the parameter's fp32 master (_data_mirrored)."
    return mirrored


def _same_elements(t, p: torch.Tensor) -> bool:
    """Whether ``p.data = t`` leaves ``p`` as it was: ``t`` is ``p``, or a tensor over the same elements of the same
    memory. ``Module._apply`` assigns ``param.data = fn(param)`` for every parameter, also where ``fn`` changed
    nothing and returned the parameter itself: ``model.to(device)`` on the device it is on (accelerate's
    ``prepare``; most scripts after loading the weights), ``model.to(torch.bfloat16)`` or ``model.bfloat16()`` of
    bf16 weights, ``model.cpu()`` on the CPU. Until session 46 that counted as a write past the version counter,
    which voids what was noted for the fp32 masters: an fp32 checkpoint loaded after building the optimizer, then
    ``model.to(device)``, started from the checkpoint's bf16 rounding (masters up to 2^-9 relative off, silently);
    in-place calls (a decay of the loop's) lost their fp32 results the same way."""
    if t is p:
        return True
    if not isinstance(t, torch.Tensor):
        return False
    with torch._C.DisableTorchFunctionSubclass():
        return (t.device == p.device and t.dtype == p.dtype and t.data_ptr() == p.data_ptr() and t.shape == p.shape
                and t.stride() == p.stride())


def _aliases_in_another_layout(t: torch.Tensor, p: torch.Tensor) -> bool:
    """Whether ``t`` starts at ``p``'s address with other strides (a transpose or permutation of ``p`` itself)."""
    with torch._C.DisableTorchFunctionSubclass():
        return t.data_ptr() == p.data_ptr() and t.stride() != p.stride() and t.device == p.device


def _unheld_written(p: torch.Tensor) -> None:
    """``p``, held frozen with values kept in :data:`UNHELD_PRECISE`, was written past its version counter (its
    ``.data`` swapped, or written through a ``.data`` handed out): the kept values hold only where its weight is
    still their rounding (as a version that moved says)."""
    noted = UNHELD_PRECISE.get(p)
    if noted is not None:
        UNHELD_PRECISE[p] = (noted[0], -1)


def unheld_whole(p: torch.Tensor, noted: tuple) -> bool:
    """Whether nothing wrote the held-frozen ``p`` since ``noted`` (its :data:`UNHELD_PRECISE` entry) was kept: its
    version then, and no write through a ``.data`` handed out since (:func:`written_through_data`: until session 43
    not asked, so ``p.mul_(c)`` or an fp32 load, then ``p.data.copy_(w)``, then the layout took the kept values
    whole, and the write was undone, silently)."""
    if noted[1] != _VERSION_OF(p):
        return False
    if id(p) in DATA_HANDED and written_through_data(id(p)):
        _unheld_written(p)
        return False
    return True


@torch.no_grad()
def _unheld_values(p: torch.Tensor) -> torch.Tensor:
    """The fp32 values a parameter held frozen (:data:`HELD_FROZEN`) stands for, flat: its kept values
    (:data:`UNHELD_PRECISE`) where they hold (all of them where nothing wrote it since: :func:`unheld_whole`; else
    where its weight is still their rounding), its weights elsewhere."""
    weights = p.detach().reshape(-1)
    noted = UNHELD_PRECISE.get(p)
    if noted is None:
        return weights.float()
    value = noted[0].reshape(-1)
    if unheld_whole(p, noted):
        return value.clone()
    return where_rounded(weights, value, weights.float())


@torch.no_grad()
def settle_unheld(params: list) -> None:
    """The step's look at parameters held frozen (``params``: the optimizer's ``_frozen_at_build``): one with fp32
    values kept (:data:`UNHELD_PRECISE`) and nothing written since (:func:`unheld_whole`) gets their rounding as its
    weights, as a laid-out parameter's weights become its master's rounding at every step
    (:meth:`_Bucket.take_precise`) and torch.optim's fp32 weight is what the next forward rounds. torch's in-place
    calls on the bf16 weights round at each call (two decays, or a decay after an fp32 load, leave some weights an
    ulp from the values' rounding; a decay below half an ulp never moves them), so until session 47 a frozen
    parameter's forward saw those weights, step after step. The kept values stay, for its layout."""
    for p in params:
        noted = UNHELD_PRECISE.get(p)
        if noted is None or not unheld_whole(p, noted):
            continue
        rounded = noted[0].to(p.dtype)
        weights = p.detach()
        if not torch.equal(weights, rounded):
            weights.copy_(rounded)
            UNHELD_PRECISE[p] = (noted[0], _VERSION_OF(p))  # (this write is the values' own)


def _mirror_unheld(p: torch.Tensor, method, name: str, args: tuple, kwargs: dict, target=None):
    """:func:`_mirrored` for a parameter held frozen (laid out by no live optimizer; rare): torch's call on the
    weights (``target``: a ``.data`` of ``p``, else ``p``) and, at once, on the fp32 values they stand for, kept whole
    in :data:`UNHELD_PRECISE` for its layout."""
    before = _unheld_values(p)
    out = method(p if target is None else target, *args, **kwargs)
    with torch.no_grad():
        if _run_call(before, p, _noted_call(p, name, args, kwargs), 0, before.numel()):
            UNHELD_PRECISE[p] = (before.view(p.shape), _VERSION_OF(p))
        else:
            UNHELD_PRECISE.pop(p, None)
    return out


def _run_call(values: torch.Tensor, p: torch.Tensor, call: tuple, start: int, end: int, cast: bool = True,
              shaped: bool = False) -> bool:
    """``values`` (fp32, elements ``start:end`` of ``p`` flattened) updated in place by the noted ``call`` (see
    :meth:`_Bucket.note_call`), each tensor argument cut to those elements (broadcast to ``p``'s shape first, a
    floating one as fp32, or as it is where not ``cast``; ``p`` itself as ``values``). False where an argument was
    written since the call (its version) or torch refuses the call on fp32 values (torch ran it on the bf16
    weights: never an error of ours): the master then follows the weights, as for any other write. ``shaped``:
    ``values`` of ``p``'s shape, the arguments as they are, not cut (torch's call again, on a tensor of the
    weights' shape: :meth:`_Bucket._verified`)."""
    name, args, kwargs, versions = call

    def cut(a):
        if a is p:
            return values
        if isinstance(a, torch.Tensor):
            a = a.detach().to(values.device, values.dtype if a.is_floating_point() and cast else a.dtype)
            return a if shaped or not a.dim() else torch.broadcast_to(a, p.shape).reshape(-1)[start:end]
        return a

    tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor) and a is not p]
    if [_VERSION_OF(a) for a in tensors] != versions:
        return False
    try:
        getattr(values, name)(*map(cut, args), **{k: cut(a) for k, a in kwargs.items()})
    except (RuntimeError, TypeError):
        return False
    return True


def _noted_call(p: torch.Tensor, name: str, args: tuple, kwargs: dict) -> tuple:
    """``p.<name>(*args, **kwargs)`` as noted (:func:`_run_call` runs it): ``(name, args, kwargs, the versions of
    its tensor arguments but p)``, an argument viewing ``p``'s elements as ``p`` does (``p.detach()``) as ``p``
    itself (its fp32 values when run; torch refuses other overlaps of an argument with the tensor it writes)."""
    def own(a):
        return p if isinstance(a, torch.Tensor) and a is not p and _is_whole_view(a, p) else a

    args, kwargs = tuple(map(own, args)), {k: own(a) for k, a in kwargs.items()}
    tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor) and a is not p]
    return name, args, kwargs, [_VERSION_OF(a) for a in tensors]


def _is_whole_view(a: torch.Tensor, p: torch.Tensor) -> bool:
    """Whether ``a`` views exactly ``p``'s elements as ``p`` does (``p.detach()``, ``p.data``): ``p`` a laid-out
    parameter, whose storage is its own (:func:`alone`)."""
    with torch._C.DisableTorchFunctionSubclass():
        return (a.untyped_storage().data_ptr() == p.untyped_storage().data_ptr() and a.dtype == p.dtype
                and a.shape == p.shape and a.stride() == p.stride() and a.storage_offset() == p.storage_offset())


_SELF = object()  # (the parameter itself among a call's arguments, in a signature)


def _signature(p: torch.Tensor, name: str, args: tuple, kwargs: dict) -> Optional[tuple]:
    """A call's arguments as a comparable key, where they are numbers (or ``p`` itself): the same call on every
    parameter of a bucket runs once over its shard (:meth:`_Bucket.run_calls`). None for a tensor argument."""
    key = [name]
    for a in (*args, *kwargs.items()):
        v = a[1] if isinstance(a, tuple) else a
        if v is p:
            v = _SELF
        elif not (v is None or isinstance(v, (bool, int, float))):
            return None
        key.append(v if not isinstance(a, tuple) else (a[0], v))
    return tuple(key)


#: the in-place operators (``p *= 1 - lr * wd``, ``p -= lr * wd * p``, ``p += noise``, ``p /= norm``) and the method
#: each is in torch (the same C function, which gives NotImplemented for an argument it refuses)
MIRRORED_OPERATORS = {"__iadd__": "add_", "__isub__": "sub_", "__imul__": "mul_", "__itruediv__": "div_"}


def _mirrored_operator(name: str, method: str):
    """``WatchedParameter.<name>``: the mirrored ``method`` (:func:`_mirrored`), as torch's operator is its method:
    ``p *= c`` under no_grad is ``p.mul_(c)`` (until session 42 torch's own operator ran, unnoted, and a decay
    written as ``p *= 1 - lr * wd`` was lost every step, silently, where ``p.mul_`` was kept)."""
    def operator(self, other):
        try:
            return getattr(self, method)(other)
        except TypeError:  # (torch's operators give NotImplemented: Python then tries the other operand's)
            return NotImplemented

    operator.__name__ = operator.__qualname__ = name
    operator.__doc__ = f"torch.Tensor.{name}, as {method} (see :func:`_mirrored_operator`)."
    return operator


#: torch.Tensor's in-place methods that write every element from no element of the tensor (torch.nn.init's zeros_,
#: normal_, uniform_, and so kaiming_uniform_, xavier_normal_, trunc_normal_...): :class:`WatchedParameter` waits for
#: the parameter's in-flight all-gather first (:func:`landed`), as for its other writes; the look follows them as any
#: write (their values are the weights')
LANDING_METHODS = ("zero_", "normal_", "uniform_")


def _landing(name: str):
    """``WatchedParameter.<name>``: torch's, after the parameter's in-flight all-gather (``overlap_comm``: a layer
    re-initialized right after ``step()`` through a parameter held from before it; until session 42 the gather
    landing after the write undid it)."""
    method = getattr(torch.Tensor, name)

    def landing(self, *args, **kwargs):
        if not torch.compiler.is_compiling():
            before_write(self)
        return method(self, *args, **kwargs)

    landing.__name__ = landing.__qualname__ = name
    landing.__doc__ = f"torch.Tensor.{name}, after the parameter's in-flight all-gather (see :func:`_landing`)."
    return landing


for _name in LANDING_METHODS:
    setattr(WatchedParameter, _name, _landing(_name))
for _name in MIRRORED_METHODS:
    setattr(WatchedParameter, _name, _mirrored(_name))
for _name, _method in MIRRORED_OPERATORS.items():
    setattr(WatchedParameter, _name, _mirrored_operator(_name, _method))
for _name in MIRRORED_METHODS:
    setattr(WatchedData, _name, _data_mirrored(_name))
for _name, _method in MIRRORED_OPERATORS.items():
    setattr(WatchedData, _name, _mirrored_operator(_name, _method))
del _name, _method

WatchedParameter.__name__ = WatchedParameter.__qualname__ = torch.nn.Parameter.__qualname__
WatchedParameter.__module__ = torch.nn.Parameter.__module__


def watch(p: torch.Tensor) -> None:
    """Switch ``p``'s class to :class:`WatchedParameter` (a plain ``torch.nn.Parameter`` only: another subclass
    keeps its class, and its ``.data`` is not watched). Its values are the optimizer's from here (laid out, or
    taken back by a step's look): a read of ``.data`` noted under its id before is another parameter's, gone,
    whose id it reuses (or its own, which that look follows already). Until session 40 such a note made the
    first step of a compiled one look at the weights eagerly: under ``fullgraph=True`` an error, now and then
    (the test suite under xdist met one)."""
    DATA_READS.discard(id(p))
    DATA_HANDED.pop(id(p), None)
    if type(p) is torch.nn.Parameter:
        p.__class__ = WatchedParameter
        if p._post_accumulate_grad_hooks:  # (registered before the optimizer was built)
            POST_HOOKED.add(id(p))
        else:  # (an id noted for a parameter gone since, which this one reuses)
            POST_HOOKED.discard(id(p))
    elif type(p) is not WatchedParameter:  # (its later registrations are not seen: always looked at)
        POST_HOOKED.add(id(p))


def split_into_buckets(params: list, cap_elems: int) -> list[list]:
    """``params`` cut into buckets in reverse order (the order backward produces gradients), each at most
    ``cap_elems`` elements unless one parameter alone is larger; each bucket lists its parameters in forward
    order. Pure: only ``numel()`` is read (shapes on the meta device do for planning)."""
    buckets, current, size = [], [], 0
    for p in reversed(params):
        if current and size + p.numel() > cap_elems:
            buckets.append(current[::-1])
            current, size = [], 0
        current.append(p)
        size += p.numel()
    if current:
        buckets.append(current[::-1])
    return buckets


@dataclasses.dataclass(slots=True)
class _Chain:
    """The in-place calls on one parameter since its optimizer's last look (:meth:`_Bucket.note_call`), for the
    next (:meth:`_Bucket.run_calls`)."""
    index: int  # (the parameter's in the bucket's ``params``)
    first: int  # (its version before the first call)
    last: int  # (its version after the last call: another value means a write since)
    calls: list  # (each as noted: _noted_call)
    base: Optional[list]  # (``[(shard slice, fp32 values)]`` the first call started from; None: fp32_pieces(first))
    signatures: Optional[list]  # (the calls' _signature, for one run over the shard; None: a tensor argument)
    verify: bool = False  # (checked against the weights: ``.data`` handed out, or a write since: _Bucket._verified)
    start: Optional[list] = None  # (the bf16 weights the first call started from, where ``base`` need not round to
    #                                them; None: its rounding)


class _Bucket:
    """One param Buffer, its grad Buffer, and this rank's fp32 shards (master + optimizer state)."""

    def __init__(self, group_index: int, params: list[torch.nn.Parameter], rank: int, world_size: int,
                 param_dtype: torch.dtype, grad_dtype: torch.dtype, device: torch.device, align: int,
                 group: Optional[dist.ProcessGroup], state_names: tuple[str, ...], remainders: bool = False,
                 state_dtype: torch.dtype = torch.float32, state_rounding: str = "stochastic", seed: int = 0,
                 owners: Optional[list[int]] = None):
        self.group_index = group_index
        self.params = params
        #: the owning optimizer's _StepFlags (set by it): a parameter's .grad assigned by the loop sets
        #: ``eager_step_needed`` (WatchedParameter.__setattr__)
        self.step_flags = None
        #: a weak reference to the owning optimizer's ``_seen_version`` (set by it): a parameter's version counter
        #: as its last look at the model saw it (:meth:`before_call`)
        self.seen_version = None
        #: a weak reference to the owning optimizer's ``_param_reshaped`` (set by it): ``p.data = t`` of another shape
        self.reshaped = None
        self.param_buffer = Buffer(params, rank, world_size, dtype=param_dtype, device=device, align=align,
                                   group=group, check_layout=comm.is_initialized(), owners=owners)
        self.grad_buffer = Buffer(params, rank, world_size, dtype=grad_dtype, device=device, align=align,
                                  group=group, owners=owners)
        n = self.param_buffer.shard_numel
        # the master shard comes from the ORIGINAL values (fp32 or whatever the model had), not the rounded copy
        self.master = torch.zeros(n, dtype=torch.float32, device=device)
        noted = [UNHELD_PRECISE.get(p) for p in params] if UNHELD_PRECISE else None
        # (kept while it was held frozen, UNHELD_PRECISE: taken whole where nothing wrote the parameter since, its
        # weights then rounded from them below, the same on every rank; else where the weight is their rounding)
        whole = [n is not None and unheld_whole(p, n) for n, p in zip(noted, params)] if noted else None
        if noted:
            for p in params:
                UNHELD_PRECISE.pop(p, None)
        if HELD_FROZEN:  # (laid out now)
            for p in params:
                HELD_FROZEN.pop(p, None)
        for piece in self.param_buffer.shard_pieces():
            src = params[piece.tensor_index].detach().reshape(-1)[piece.tensor_start:piece.tensor_end]
            self.master[piece.shard_start:piece.shard_end].copy_(src)
            kept = noted[piece.tensor_index] if noted is not None else None
            if kept is not None:
                value = kept[0].reshape(-1)[piece.tensor_start:piece.tensor_end]
                master = self.master[piece.shard_start:piece.shard_end]
                master.copy_(value if whole[piece.tensor_index] else
                             where_rounded(src, value, master))
        self.state = {name: torch.zeros(n, dtype=state_dtype, device=device) for name in state_names}
        # bf16 states: rounding mode, and a per-bucket, per-rank seed advanced on the device every step
        self.state_rounding = state_rounding
        self.sr_seed = (torch.full((1,), seed, dtype=torch.int64, device=device)
                        if state_dtype == torch.bfloat16 and state_rounding == "stochastic" else None)
        self.sr_base = seed  # sr_seed - sr_base = the steps taken so far (saved, so a resume draws the same bits)
        self.step = torch.zeros((), dtype=torch.float32, device=device)  # steps taken (skipped ones excluded)
        #: the optimizer shares one ``step`` among buckets (a param group's, or parameters unfrozen together) and
        #: sets this to the index of the first bucket that shares it (ShardedOptimizer._index_buckets)
        self.counter_index = -1
        owner = weakref.ref(self, _holder_gone)
        for i, (p, view) in enumerate(zip(params, self.param_buffer.get_views())):
            view.copy_(p.detach() if not (whole and whole[i]) else noted[i][0])  # (round to nearest even, as
            # Tensor.to does)
            p.data = alone(view)  # the Parameter object stays (module and optimizer references keep working)
            watch(p)
            OWNER[id(p)] = owner
            set_grad(p, None)
        #: store_param_remainders: the master is the bf16 param shard (high half) + these int16 low halves
        self.master_remainder = None
        #: with them: this rank's bf16 shard as it was before the first write into the bucket's parameters that
        #: WatchedParameter saw coming since the last look (:func:`before_write`), None otherwise: where a weight is
        #: no longer that, the look takes it as the master whole (:func:`~tritonshard.kernels.rounding.
        #: remainder_after_write`)
        self.weights_before_write = None
        if remainders:
            self.master_remainder = split_bf16_remainder(self.master)[1]
            self.master = None
        #: id of a parameter -> (its index in ``params``, its version then, its pieces' fp32 values: ``[(shard slice,
        #: values)]``): a copy of another floating dtype into it (:meth:`note_precise`), or the in-place calls on it
        #: run on its fp32 values (:meth:`run_calls`), for the looks at the weights until the step's
        #: (:meth:`take_precise`)
        self.precise: dict = {}
        #: id of a parameter -> the in-place calls on it since the last look (:class:`_Chain`), for the next one
        self.calls: dict = {}
        self.whole = None  # (shard values, the notes viewing them) from run_calls' one run over the shard
        #: id of a parameter -> its bf16 weights (this rank's pieces) as a look that kept its note left them (a clip
        #: before the step: torch's bf16 calls' results, which need not be the note's rounding), for the later looks
        #: that take the note only where the weight still holds (:meth:`take_precise`, :meth:`written_pieces`)
        self.kept_weights: dict = {}
        self._mask = None  # (_param_mask)
        self._pieces = None  # (_pieces_of)
        self.index_of = {id(p): i for i, p in enumerate(params)}
        self.retired = False  # (its optimizer was taken over by a later one: ShardedOptimizer._take_over)
        self.index = -1  # position in ShardedOptimizer.buckets (the collective launch order)
        self.workspace: Optional[torch.Tensor] = None  # scratch an update rule keeps per bucket (ShardedMuon)
        # per-step communication state, reset by step() / zero_grad()
        self.has_grads = False      # the grad buffer holds gradients flattened since zero_grad()
        self.ready: set = set()     # id() of the parameters whose gradient arrived in the current backward
        self.placed: dict = {}     # parameters whose param.grad is our ShardedGrad placeholder (a dict: dynamo
        #                             traces no sets of tensors)
        #: each parameter's ShardedGrad placeholder and SpentGrad marker, in ``params``' order (set by the optimizer
        #: when it indexes the bucket): the flush and the step's per-parameter loops walk them beside ``params``
        #: instead of looking each up by the parameter (Tensor.__hash__ is a Python method: ~0.15 us a lookup)
        self.grad_placeholders: list = []
        self.spent_markers: list = []
        self.all_placed: dict = {}  # ``placed`` when every parameter is: each parameter -> True
        self.no_grad: dict = {}    # parameters without a gradient on this rank since zero_grad() (zeros in the
        #                             buffer); step() leaves those without one on every rank unchanged
        self.launch_wanted = False  # the bucket may be reduced (its last gradient of the last micro-batch is in)
        self.rs_work = None         # handle of its in-flight reduce-scatter; None once waited for
        self.rs_launched = False
        self.rs_slot = 0            # ordered_reduce: which scratch its all-to-all writes
        self.scratch_rows: dict = {}  # ordered_reduce: the (d, shard) view of each scratch, made once
        #: bound kernel launches of this bucket (kernels/_launch.py), keyed by role ("norm", "update", flatten's)
        self.launches: dict = {}
        self.ag_work = None         # handle of its in-flight param all-gather

    def __del__(self) -> None:
        """An optimizer let go of right after ``step()`` with ``overlap_comm`` (``del opt`` at the end of a phase, a
        torch.optim optimizer training the model from there): its all-gathers were left to the next forward, whose
        hooks went with it, while the parameters outlive it. Their gathers are waited for here, before anything
        else can read them (until session 28 a read after the ``del`` saw the last step's weights in some
        elements, silently)."""
        try:
            self.wait_gather()
        except Exception:  # (its group destroyed, a peer gone: nothing will land; a bucket built part way; and a
            pass           # finalizer cannot raise)

    def wait_gather(self) -> None:
        """Wait for this bucket's in-flight param all-gather (launched by step()), if any."""
        work = self.ag_work
        if work is not None:
            with trace("tritonshard.wait_all_gather[bucket {}]", self.index):
                work.wait()
            self.ag_work = None

    def master_fp32(self) -> torch.Tensor:
        """The fp32 master shard (rebuilt from the bf16 shard and the remainders when those are stored)."""
        if self.master_remainder is None:
            return self.master
        return combine_bf16_remainder(self.param_buffer.get_local_shard(), self.master_remainder)

    def saved_master(self) -> torch.Tensor:
        """The fp32 master shard as a save records it (``state_dict()``, checkpoint saves, after their look): the
        master, and with stored remainders the fp32 values noted for the weights (:meth:`take_precise`) where the
        parameter was not written since. There the weights stay as torch's bf16 calls left them until the step,
        and the master is the weight and a remainder: where that weight is not the rounding of the fp32 result (a
        decay that crossed a rounding midpoint), it cannot hold the result, which the step then takes; until
        session 42 a save there recorded the weight and the old remainder, a master the run never had."""
        master = self.master_fp32()
        if self.master_remainder is None or not self.precise:
            return master
        shard = self.param_buffer.get_local_shard()
        for key, (index, version, pieces) in self.precise.items():
            kept = self.kept_weights.get(key)
            if _VERSION_OF(self.params[index]) == version:
                for dst, value in pieces:
                    master[dst] = value
            elif kept is not None:  # (where the weight is still as the look that kept the note left it)
                for (dst, value), weight in zip(pieces, kept):
                    master[dst] = torch.where(shard[dst] == weight, value, master[dst])
        return master

    def _pieces_of(self, index: int) -> list:
        """``(shard slice, tensor start, tensor end)`` of parameter ``index``'s pieces of this rank's shard (the
        layout's, listed once per bucket)."""
        if self._pieces is None:
            pieces = [[] for _ in self.params]
            for piece in self.param_buffer.shard_pieces():
                pieces[piece.tensor_index].append(
                    (slice(piece.shard_start, piece.shard_end), piece.tensor_start, piece.tensor_end))
            self._pieces = pieces
        return self._pieces[index]

    def _note(self, p: torch.Tensor, index: int, pieces: list) -> None:
        self.precise[id(p)] = (index, _VERSION_OF(p), pieces)
        self.kept_weights.pop(id(p), None)
        if self.step_flags is not None:
            self.step_flags.precise_notes = self.step_flags.eager_step_needed = True

    @torch.no_grad()
    def note_precise(self, p: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> None:
        """``src`` (of ``p``'s shape, or broadcast to it; any floating dtype and device), just copied into ``p``
        (:meth:`WatchedParameter.copy_`), kept as fp32 for ``p``'s pieces of this rank's shard, for
        :meth:`take_precise`. Memory: 4 bytes per element of those pieces until then (the next step)."""
        index = self.index_of[id(p)]
        flat = src.detach().expand(p.shape).reshape(-1)  # (a view where it has p's shape already)
        device = self.param_buffer.get_data().device
        self._note(p, index, [(dst, flat[start:end].to(device, torch.float32, non_blocking=non_blocking, copy=True))
                              for dst, start, end in self._pieces_of(index)])

    def before_call(self, p: torch.Tensor) -> tuple:
        """What :meth:`note_call` needs from before ``p``'s in-place call runs: ``(p's version, the fp32 values the
        weights stand for where the call starts a chain and they are not what the last look left: with stored
        remainders (the bf16 weights are their high half, which the call rewrites), or where ``p`` was written
        since that look, unseen (a load, then a decay; the look would follow the write, so the chain starts from
        what it would make of it: :meth:`written_pieces`), or where the write came after calls (``p.mul_(c)``,
        ``p[0].zero_()``, then this call: the calls so far are run and checked against the weights, which they
        follow where written, :meth:`_run_chain`))``, and the bf16 weights themselves where those fp32 values need
        not round to them (a chain from a note a look kept, or after a write: torch's bf16 calls left the weights,
        which are where a check of the chain against the weights starts, :meth:`_verified`). Until session 42
        such a write broke the chain, and the master followed the weights everywhere: the decay lost in every
        element the write left."""
        version = _VERSION_OF(p)
        key = id(p)
        chain = self.calls.get(key)
        if chain is not None:
            if chain.last == version:  # (the chain goes on)
                return version, None, None
            del self.calls[key]  # (written since its last call)
            chain.verify = True
            base = self._run_chain(chain)
            if base is not None:
                return version, base, self._weights_of(chain.index)
        index = self.index_of[key]
        noted = self.precise.get(key)
        from_note = noted is not None and noted[1] == version
        start = self._weights_of(index) if from_note else None
        if self.master_remainder is not None:
            return version, self.fp32_pieces(index, version), start
        seen = self.seen_version() if self.seen_version is not None else None
        if not from_note and (seen is None or version != seen(p)):
            # (written since the last look, unseen yet: the chain starts from what the look would make of the
            # weights, and from the weights as they are, which need not be its rounding where the last look kept
            # a note torch's calls had left other weights for, kept_weights: until session 45 the check of the
            # chain started from that rounding, took the call's results there for writes, and the master followed
            # the weights, a few ulps off torch's fp32 result after two 1 % decays; found with fp16 weights, whose
            # fp32 masters from an fp32 model are no fp16 values, by tests.optim.loop_fuzz_long's
            # FP16ScaledTrainingLoop)
            return version, self.written_pieces(index), self._weights_of(index)
        return version, None, start

    def _weights_of(self, index: int) -> list:
        """Parameter ``index``'s pieces of this rank's bf16 shard, copied."""
        shard = self.param_buffer.get_local_shard()
        return [shard[dst].clone() for dst, _, _ in self._pieces_of(index)]

    def note_call(self, p: torch.Tensor, before: tuple, name: str, args: tuple, kwargs: dict) -> None:
        """``p.<name>(*args, **kwargs)``, an elementwise in-place method (:data:`MIRRORED_METHODS`), just ran on the
        bf16 weights (``before``: :meth:`before_call`): noted for the next look at the weights (:meth:`run_calls`),
        with the versions of its tensor arguments (written since, they no longer hold the values it saw). The calls
        on one parameter form a chain from the weights as the optimizer last saw them (its version then, or an fp32
        copy's note): a write between two calls that is not one of them (``p[0] = 1``) ends it, and the next call
        starts another from what the first made of the weights, following them where written (:meth:`before_call`).
        An argument viewing ``p``'s elements as ``p`` does
        (``p.detach()``, ``p.data``) stands for ``p``, as its fp32 values (torch refuses other overlaps of an
        argument with the tensor it writes)."""
        version, base, start = before
        key = id(p)
        chain = self.calls.get(key)
        after = _VERSION_OF(p)
        call = _noted_call(p, name, args, kwargs)
        signature = _signature(p, name, call[1], call[2])
        if chain is None:  # (a write since the last call started a new chain: before_call)
            self.calls[key] = _Chain(self.index_of[key], version, after, [call], base,
                                     None if signature is None else [signature], start=start)
        else:
            chain.last = after
            chain.calls.append(call)
            if chain.signatures is not None:
                if signature is None:
                    chain.signatures = None
                else:
                    chain.signatures.append(signature)
        if self.step_flags is not None:
            self.step_flags.precise_notes = self.step_flags.eager_step_needed = True

    @torch.no_grad()
    def written_pieces(self, index: int) -> list:
        """``[(shard slice, fp32 values)]`` of parameter ``index``'s pieces of this rank's shard, written since the
        last look: what that look would make of the weights now (the reconcile, then an fp32 copy's note where the
        weight is still its rounding: :meth:`take_precise`)."""
        shard = self.param_buffer.get_local_shard()
        key = id(self.params[index])
        noted = self.precise.get(key)
        noted = dict((dst.start, value) for dst, value in noted[2]) if noted is not None else {}
        kept = dict(zip(noted, self.kept_weights[key])) if key in self.kept_weights else {}
        out = []
        for dst, _, _ in self._pieces_of(index):
            weight, values = shard[dst], self.followed(dst)
            value = noted.get(dst.start)
            if value is not None:
                held = kept.get(dst.start)
                values = (where_rounded(weight, value, values) if held is None
                          else torch.where(weight == held, value, values))
            out.append((dst, values))
        return out

    def data_handed_out(self, key: int, written: bool) -> None:
        """The parameter of id ``key`` had its ``.data`` read since the last look: a write through it moves no
        version counter of the parameter's. ``written``: torch wrote through one (its own counter moved:
        :func:`written_through_data`): its in-place calls and fp32 copy's note are dropped (the weights followed,
        as for any write: a call after the write started from the master, and a write after a call or a copy may
        put back values the note would take for its own, an EMA swapped in and the weights restored through
        ``.data``). Else only read (an EMA of the loop's own, a logger), or written past every counter (a
        collective): the calls are checked against the weights (:meth:`run_calls`: the master takes their fp32
        result where the weight is what torch's calls left, the weight elsewhere), and a note with no calls is
        taken where the weight is still its rounding. Until session 42 a read dropped them too: a loop reading
        ``p.data`` every step lost its weight decay (``p.mul_(1 - lr * wd)``), every step, silently, and an fp32
        checkpoint loaded after building the optimizer and read before the step was taken as bf16."""
        if written:
            self.calls.pop(key, None)
            self.precise.pop(key, None)
            self.kept_weights.pop(key, None)
            return
        chain = self.calls.get(key)
        if chain is not None:
            chain.verify = True
            return
        noted = self.precise.get(key)
        if noted is not None:
            self.precise[key] = (noted[0], -1, noted[2])

    @torch.no_grad()
    def fp32_pieces(self, index: int, version: int) -> list:
        """``[(shard slice, fp32 values)]`` of parameter ``index``'s pieces of this rank's shard: what its weights,
        at ``version``, stand for as the look would make the master (an fp32 copy's note where it holds there,
        else the master)."""
        noted = self.precise.get(id(self.params[index]))
        if noted is not None and noted[1] == version:
            return [(dst, value.clone()) for dst, value in noted[2]]
        if self.master_remainder is None:
            return [(dst, self.master[dst].clone()) for dst, _, _ in self._pieces_of(index)]
        # (the weights as a look would follow them: written since, unseen, they are not the master's high half any
        # more; until session 43 their old remainders made a NaN beside a written zero, p[0].zero_() then p.mul_(c))
        return [(dst, self.followed(dst)) for dst, _, _ in self._pieces_of(index)]

    @torch.no_grad()
    def run_calls(self, seen_version) -> None:
        """The in-place calls noted since the last look (:meth:`note_call`), run on the fp32 values the weights
        stood for before the first (:meth:`fp32_pieces`), each parameter's result noted as an fp32 copy's is
        (:meth:`take_precise`). ``seen_version(p)``: ``p``'s version at the optimizer's last look. A chain is
        dropped (the master follows the weights, as for any write) where the parameter was written before its
        first call unseen, or where a call cannot be run on fp32 values; one written since its last call (its
        version) is checked against the weights, whose written elements the master follows. The same calls with
        numbers on every parameter of the bucket (a weight decay of the loop's own, a clip), from their masters, run
        once over the master shard (:meth:`_run_whole`)."""
        calls, self.calls = self.calls, {}
        runnable = {}
        for key, chain in calls.items():
            p = self.params[chain.index]
            noted = self.precise.get(key)
            if chain.base is None and chain.first != seen_version(p) and (noted is None or noted[1] != chain.first):
                continue  # (written before the first call, unseen, and not taken then: not known)
            if _VERSION_OF(p) != chain.last:  # (written after its last call: checked against the weights)
                chain.verify = True
            runnable[key] = chain
        if len(runnable) == len(self.params) and self._run_whole(runnable):
            return
        for key, chain in runnable.items():
            values = self._run_chain(chain)
            if values is None:
                self.precise.pop(key, None)
            else:
                self._note(self.params[chain.index], chain.index, values)

    def _run_chain(self, chain: _Chain) -> Optional[list]:
        """A parameter's noted calls run on the fp32 values its weights stood for before the first: ``[(shard
        slice, fp32 values)]`` of its pieces of this rank's shard, checked against the weights where the chain says
        so (:meth:`_verified`: ``.data`` handed out, a write since the last call); None where a call cannot be run
        on them (the master then follows the weights)."""
        p = self.params[chain.index]
        base = chain.base if chain.base is not None else self.fp32_pieces(chain.index, chain.first)
        pieces = self._pieces_of(chain.index)
        weights = chain.start
        if chain.verify and weights is None:  # (the weights the chain started from: the rounding of its fp32 start)
            weights = [values.to(self.param_buffer.dtype) for _, values in base]
        if not all(_run_call(values, p, call, start, end)
                   for (_, start, end), (_, values) in zip(pieces, base) for call in chain.calls):
            return None
        if chain.verify and not self._verified(p, chain.calls, pieces, base, weights):
            return None
        return base

    def _verified(self, p: torch.Tensor, calls: list, pieces: list, base: list, weights: list,
                  shaped: bool = True) -> bool:
        """``base`` (this rank's pieces of ``p``: ``[(shard slice, fp32 values)]``, ``calls`` run on them) kept
        where the weight is what torch's calls gave on the bf16 ``weights`` the chain started from (run again
        here, on bf16 values: the same ops as torch's), and elsewhere what the look makes of a write (the
        weight, where it is not its master's rounding: :meth:`followed`): a write after the calls (``p.mul_(c)``,
        then ``p[0].zero_()``), or ``.data`` handed out, through which a write may have followed them unseen
        (:meth:`data_handed_out`). False where the calls cannot be run so. ``shaped``: each piece run again on a
        tensor of ``p``'s shape with the calls' arguments uncut, as torch ran them (torch's kernels take other
        paths for a broadcast argument than for a cut one, a fused multiply-add or not: a bf16 result one ulp off
        torch's was taken for a write, and the master followed the weight there, 1 element of 91 after a ``.data``
        read and ``p.add_(row, alpha=1e-3)``, until session 44); not shaped: ``pieces`` cut from the shard, for
        calls with numbers only (one op per element, the same bits on any path: :meth:`_run_whole`)."""
        shard = self.param_buffer.get_local_shard()
        for (dst, start, end), (_, values), bf16 in zip(pieces, base, weights):
            if shaped:
                whole = torch.zeros(p.shape, dtype=bf16.dtype, device=bf16.device)
                whole.view(-1)[start:end] = bf16
                if not all(_run_call(whole, p, call, 0, p.numel(), cast=False, shaped=True) for call in calls):
                    return False
                bf16 = whole.view(-1)[start:end]
            elif not all(_run_call(bf16, p, call, start, end, cast=False) for call in calls):
                return False
            weight = shard[dst]
            values.copy_(torch.where(weight == bf16, values, self.followed(dst)))
        return True

    def followed(self, dst: slice) -> torch.Tensor:
        """The fp32 values the look makes of the weights of this rank's shard elements ``dst`` after a write (the
        reconcile: ModelViewMixin._reconcile_master): the master where the weight is still its rounding, the
        weight elsewhere; with stored remainders, the weight and its remainder, none where the weight was written
        (as far as :attr:`weights_before_write` tells) or is zero or not finite
        (:func:`~tritonshard.kernels.rounding.remainder_after_write`)."""
        weight = self.param_buffer.get_local_shard()[dst]
        if self.master_remainder is not None:
            before = self.weights_before_write
            return combine_bf16_remainder(weight, remainder_after_write(
                weight, self.master_remainder[dst], None if before is None else before[dst]))
        return where_rounded(weight, self.master[dst], weight.float())

    def _run_whole(self, runnable: dict) -> bool:
        """:meth:`run_calls` for a bucket whose every parameter has the same calls with numbers, started from its
        master (no stored remainders, no fp32 copy's note to start from): the calls run once over a copy of the
        master shard (its padding too, left out when taken: :meth:`take_precise`), each parameter's note a view
        of it. False where that does not hold (each parameter on its own then)."""
        signatures = None
        for chain in runnable.values():
            noted = self.precise.get(id(self.params[chain.index]))
            if chain.base is not None or chain.signatures is None or (noted is not None and noted[1] == chain.first):
                return False
            if signatures is None:
                signatures = chain.signatures
            elif chain.signatures != signatures:
                return False
        first = next(iter(runnable.values()))
        p, values = self.params[first.index], self.master.clone()
        # (p itself as the whole shard: _SELF in the signature, the same for every parameter)
        if not all(_run_call(values, p, call, 0, values.numel()) for call in first.calls):
            return False
        if any(chain.verify for chain in runnable.values()):  # (.data handed out, a write after the calls:
            # _verified, over the shard; the weights at the start are the masters' rounding: the last look left them
            # so, and no note since)
            whole = slice(0, values.numel())
            if not self._verified(p, first.calls, [(whole, 0, values.numel())], [(whole, values)],
                                  [self.master.to(self.param_buffer.dtype)], shaped=False):
                return False
        notes = []
        for index, p in enumerate(self.params):
            self._note(p, index, [(dst, values[dst]) for dst, _, _ in self._pieces_of(index)])
            notes.append(self.precise[id(p)])
        self.whole = (values, notes)
        return True

    def whole_notes(self) -> Optional[tuple]:
        """``(shard values, notes)`` of :meth:`_run_whole` while they are every parameter's notes, else None."""
        whole = self.whole
        if whole is None:
            return None
        precise, notes = self.precise, whole[1]
        if len(precise) == len(notes) and all(precise.get(id(p)) is n for p, n in zip(self.params, notes)):
            return whole
        return None

    def whole_take(self) -> bool:
        """Whether a look takes every parameter's note whole, over the shard (:meth:`take_precise`), which writes
        every master anew (and in the step's look every weight): the reconcile before it has nothing to do."""
        whole = self.whole_notes()
        return whole is not None and all(_VERSION_OF(p) == n[1] for p, n in zip(self.params, whole[1]))

    def _param_mask(self) -> torch.Tensor:
        """Which elements of this rank's shard are parameters' (the rest is padding): made once."""
        if self._mask is None:
            mask = torch.zeros(self.param_buffer.shard_numel, dtype=torch.bool, device=self.master_fp32().device)
            for piece in self.param_buffer.shard_pieces():
                mask[piece.shard_start:piece.shard_end] = True
            self._mask = mask
        return self._mask

    @torch.no_grad()
    def take_precise(self, final: bool) -> None:
        """The fp32 values noted for the weights (:meth:`note_precise`, :meth:`run_calls`) into the master, after the
        reconcile. For a parameter not written since its note (its version): all of them, and in the step's look
        (``final``) this rank's bf16 weights rounded from them too (a call whose bf16 result differs from that
        rounding, a decay below half an ulp that left a weight unchanged, moves it there; the step's all-gather
        rewrites every weight anyway), and the notes are done; before that (a clip, a norm, a save) the notes are
        kept, and the weights stay as torch's bf16 call left them, the same on every rank (as :attr:`kept_weights`
        holds them). For a parameter written since (a row zeroed after a load), or whose ``.data`` was handed out
        (:meth:`data_handed_out`): where the weight still holds, is their rounding or as a look that kept the note
        left it (the reconcile follows the weight elsewhere). A copy of the parameter's own dtype since (the weights
        put back after an EMA swapped in), or a write through ``.data``, dropped the note already
        (:meth:`WatchedParameter.copy_`, :meth:`data_handed_out`). With
        stored remainders the master is the weight and a remainder: the remainder of the split, whose high half is
        that rounding, and outside the step's look only where the weight is that rounding. Notes of every
        parameter from one run over the shard (:meth:`_run_whole`), none written since: a few ops over the shard
        instead of a few per piece."""
        shard = self.param_buffer.get_local_shard()
        whole, self.whole = self.whole_notes(), None
        if whole is not None:
            values, notes = whole
            if all(_VERSION_OF(p) == n[1] for p, n in zip(self.params, notes)):
                mask = self._param_mask()
                self.master.copy_(torch.where(mask, values, self.master))
                if not final:
                    self.whole = whole
                    if len(self.kept_weights) < len(self.params):  # (the weights as this look leaves them)
                        weights = shard.clone()
                        for p in self.params:
                            self.kept_weights.setdefault(
                                id(p), [weights[dst] for dst, _, _ in self._pieces_of(self.index_of[id(p)])])
                    return
                shard.copy_(torch.where(mask, values.to(shard.dtype), shard))
                self.precise.clear()
                self.kept_weights.clear()
                return
        remainders = self.master_remainder is not None
        for key, (index, version, pieces) in self.precise.items():
            unwritten = _VERSION_OF(self.params[index]) == version
            kept = self.kept_weights.get(key)
            for i, (dst, value) in enumerate(pieces):
                hi, weight = value.to(shard.dtype), shard[dst]
                master = self.master[dst] if not remainders else self.master_remainder[dst]
                if remainders:
                    value = split_bf16_remainder(value)[1]
                if unwritten and (final or not remainders):
                    master.copy_(value)
                    if final:
                        weight.copy_(hi)
                elif kept is None or (remainders and not final):  # (where the weight still holds: where it is
                    # their rounding; with remainders before the step's look, only there can the master hold them)
                    master.copy_(torch.where(weight == hi, value, master))
                else:  # (... or as an earlier look kept it, torch's bf16 calls' result: in the step's look, their
                    # rounding there, as above, where a parameter without a gradient keeps it)
                    held = weight == kept[i]
                    master.copy_(torch.where(held, value, master))
                    if final:
                        weight.copy_(torch.where(held, hi, weight))
            if unwritten and not final and kept is None:  # (the weights as this look leaves them)
                self.kept_weights[key] = [shard[dst].clone() for dst, _ in pieces]
        if final:
            self.precise.clear()
            self.kept_weights.clear()

    def forget_notes(self) -> None:
        """Drop every fp32 value and call noted for the weights (taken by the step's look, or void after a load)."""
        self.precise.clear()
        self.calls.clear()
        self.kept_weights.clear()
        self.whole = None
        self.weights_before_write = None

    def keep_weights_before_write(self) -> None:
        """Before a write into this bucket's weights that :class:`WatchedParameter` (or the re-adoption of a swapped
        ``.data``) sees coming: with stored remainders, at the first such write since the last look, this rank's
        bf16 shard as it is, the weights the remainders belong to (:meth:`settle_remainders`); nothing otherwise, nor
        in a retired bucket, which no look reads again. Memory: 2 bytes per element of the shard until the look."""
        if self.master_remainder is None or self.weights_before_write is not None or self.retired:
            return
        self.weights_before_write = self.param_buffer.get_local_shard().clone()

    def settle_remainders(self) -> None:
        """After an outside write into this bucket's weights, with stored remainders: no remainder where the weight
        is no longer what it was before a write seen coming (:meth:`keep_weights_before_write`: a bf16 checkpoint
        loaded, ``p.copy_(w)``, ``p[i] = w``, ``nn.init``), or is zero or not finite
        (:func:`~tritonshard.kernels.rounding.remainder_after_write`). There the master is the written weight, as
        torch.optim's fp32 one. Until session 43 such a write kept the old remainders: masters within 1/2 ulp of
        the written values, not them (a stated limit, which stays for writes not seen coming: through ``.data`` or
        a view), and beside a written zero a NaN master, and after the next update a NaN weight, silently."""
        rem = self.master_remainder
        rem.copy_(remainder_after_write(self.param_buffer.get_local_shard(), rem, self.weights_before_write))
        self.weights_before_write = None

    def set_master(self, master: torch.Tensor) -> None:
        """Store ``master`` (fp32, shard-sized) and write its bf16 rounding into the param shard (a load: what was
        noted for the weights before it is void)."""
        self.forget_notes()
        if self.master_remainder is None:
            if master is not self.master:
                self.master.copy_(master)
            self.param_buffer.get_local_shard().copy_(self.master)
        else:
            hi, rem = split_bf16_remainder(master)
            self.param_buffer.get_local_shard().copy_(hi)
            self.master_remainder.copy_(rem)

    def state_kwargs(self) -> dict:
        """Rounding arguments of the update kernels for this bucket's states ({} for fp32 states)."""
        if not self.state or next(iter(self.state.values())).dtype == torch.float32:
            return {}
        if self.sr_seed is None:
            return {"state_rounding": "nearest"}
        return {"state_rounding": "stochastic", "seed": self.sr_seed}

    def update_target(self) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """(param argument, param_out, remainders) for the fused update kernels."""
        if self.master_remainder is None:
            return self.master, self.param_buffer.get_local_shard(), False
        return self.master_remainder, self.param_buffer.get_local_shard(), True
