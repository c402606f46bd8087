"""``StepMixin``: ``step()``: the checks before it changes anything, the updates and the parameters' all-gathers.

* ``step()`` eagerly and under ``torch.compile`` (traced, or run eagerly where it must look at the parameters:
  :mod:`._compiled`), and what a traced step leaves for the next eager call;
* :meth:`_before_update`: the checks and handshakes (an error on one rank is told to the others before any
  collective), and the reduction (:mod:`.reduction`) unless a clip or a norm ran it;
* :meth:`_update_phase` (captured under ``cuda_graph=True``): the step's scalars in one launch, the updates (one
  segmented launch per param group, or a bound launch per bucket) and the all-gathers;
* the per-step values those launches read from tensors made once (the lrs, the rounding seeds), so that a steady
  step allocates nothing and copies nothing from the host.
"""

from __future__ import annotations

import collections.abc
import functools
import itertools
import operator
import sys
from typing import Optional

import torch
import torch.optim.optimizer as _optim_hooks  # (the global step hooks: profile_hook_step)

from .. import comm
from ..buffer import COMPLETED
from ..kernels import _launch
from ..kernels import scalars as _scalars
from ..kernels._dispatch import compiled_path, triton_kernels_run
from ._compiled import _EAGERLY
from .bucket import _Bucket, trace as _trace

__all__ = ["StepMixin"]


def _nothing() -> None:
    """What a replay of step()'s update phase leaves to set on the host: nothing (its all-gathers are waited for
    inside it)."""


def _same_spec_but_floats(a: tuple, b: tuple) -> bool:
    """Two launch specs (kernel, grid, args, kwargs) launch the same kernel on the same tensors with the same other
    scalars: tensors by identity, the rest by value, but floats, which may differ (a bound launch takes them anew:
    kernels/_launch.py)."""
    return a[0] is b[0] and a[1] == b[1] and a[3] == b[3] and _launch._same_but_live(a[2], b[2])


def _scale_in_place(grad_scale, factor, buf: torch.Tensor, op):
    """``grad_scale * factor`` or ``grad_scale / factor`` (``op``: torch.mul or torch.div) with the ops Python's
    operators run, into ``buf`` when the result is a tensor: ``grad_scale`` is ``buf`` already, or a number and
    ``factor`` a tensor (``number / t`` is ``t.reciprocal() * number`` in torch, ``number * t`` is
    ``t.mul(number)``), or both numbers (Python arithmetic, as before)."""
    if isinstance(grad_scale, torch.Tensor):
        return op(grad_scale, factor, out=buf)
    if isinstance(factor, torch.Tensor):
        if op is torch.div:
            return torch.reciprocal(factor, out=buf).mul_(grad_scale)
        return torch.mul(factor, grad_scale, out=buf)
    return grad_scale / factor if op is torch.div else grad_scale * factor


class StepMixin:
    """Methods of :class:`~tritonshard.optim.base.ShardedOptimizer` that run ``step()``."""

    # ------------------------------------------------------------------ step
    @staticmethod
    def profile_hook_step(func):
        """torch.optim's wrapper of ``step`` (torch.optim.Optimizer's __init__ wraps each optimizer class's ``step``
        with it once), with its ``Optimizer.step#<class>.step`` profiler range entered only while a profiler records
        (torch's own wrapper then, and under torch.compile, which traces it): torch enters the range at every call,
        with no profiler too (issue 20: a host-bound step on the H200). On this repo's CPU machine that was ~8 us
        alone and 376 -> 328 us of ShardedAdamW's step on the GPU path (dry-run driver, the 125M layout, the two
        wrappers taking turns in one process, minima; 2026-12-05), the range's entry (~20 us) before the update's
        launch. Otherwise the same: the global and the optimizer's step pre-hooks (one may return new ``(args,
        kwargs)``), the step, torch's ``_optimizer_step_code`` (the profiler's entry point), the post-hooks."""
        traced = torch.optim.Optimizer.profile_hook_step(func)

        @functools.wraps(func)
        def wrapper(*args, **kwargs):
            if torch.compiler.is_compiling() or torch.autograd.profiler._is_profiler_enabled:
                return traced(*args, **kwargs)
            self = args[0]
            for pre_hook in itertools.chain(_optim_hooks._global_optimizer_pre_hooks.values(),
                                            self._optimizer_step_pre_hooks.values()):
                result = pre_hook(self, args, kwargs)
                if result is not None:
                    if not (isinstance(result, tuple) and len(result) == 2):
                        raise RuntimeError(f"{func} must return None or a tuple of (new_args, new_kwargs), but got "
                                           f"{result}.")
                    args, kwargs = result
            out = func(*args, **kwargs)
            self._optimizer_step_code()
            for post_hook in itertools.chain(self._optimizer_step_post_hooks.values(),
                                             _optim_hooks._global_optimizer_post_hooks.values()):
                post_hook(self, args, kwargs)
            return out
        return wrapper

    @torch.no_grad()
    def step(self, closure=None):
        """Reduce (unless ``clip_grad_norm_`` did), update every shard, all-gather the parameters.

        Never waits on the device: the non-finite flag gates the update inside the kernel.

        Under ``torch.compile`` a step runs eagerly where it must look at the parameters or shake hands with the
        other ranks (:meth:`_eager_when_compiled`): a graph break, or dynamo's error under ``fullgraph=True``.
        """
        if torch.compiler.is_compiling():
            why = self._eager_when_compiled()
            if why is not None:
                return _EAGERLY["step", why](self, closure)
        return self._run_step(closure)

    def _eager_when_compiled(self) -> Optional[str]:
        """Under torch.compile: why step() (and a clip or a norm before it, which must reach that step) runs eagerly,
        a key of :data:`_EAGER_REASONS`, or None (a traced step; dynamo guards on what this reads).

        "ranks": on more than one rank, always. The step's handshakes (the parameters without a gradient on every
        rank, the ranks' hyper-parameters, the order of the collectives) are host code, and dynamo cannot trace
        the ProcessGroup's collectives (torch 2.13: an InternalTorchDynamoError, UnsafeScriptObjectError; until
        session 24 a compiled step on two ranks raised it, even with fullgraph=False: untested till then).
        "here": in one process, where the step must look at the parameters (:meth:`_note_eager_step`)."""
        if self._many_ranks:
            return "ranks"
        # (opt.state edited as a dict since the last look: sync_from_model follows it, state_view.py)
        return "here" if self._flags.eager_step_needed or self._state_edits.seen else None

    def _adopt_traced_reduction(self) -> None:
        """After a reduction traced by torch.compile in a graph without the step (``torch.compile(opt
        .clip_grad_norm_)`` or ``grad_norm`` on their own; a clip and a step that dynamo compiled as separate graphs,
        which it does where an LR scheduler wraps step() or where the compiled function also ran the backward):
        dynamo dropped what the reduction set on the optimizer, but replayed its copy in :class:`_StepFlags`, which
        is taken back here, so the step (eager or traced) uses that reduction and the clip's coefficient, as in one
        graph. Until session 23 such a step reduced again and did not clip, silently; in session 23 it raised, also
        in the common loop of a compiled clip + step with an LR scheduler. Eagerly, the step then looks at the
        gradients again as after an eager clip (``_reduced_early``)."""
        flags = self._flags
        self._reduced, self._next_launch, self._reduce_entered, self._reduction_started = flags.traced_state
        if flags.traced_clip_coef is not None:
            self._clip_coef = flags.traced_clip_coef
        if not torch.compiler.is_compiling():
            # (and so the next compiled clip, norm or step runs eagerly: its look at the gradients again reads
            # param.grad, which dynamo cannot trace; until session 35 a compiled clip after an eager per-parameter
            # norm read traced it and failed, found by tests.optim.loop_fuzz_long's TracedTrainingLoop)
            self._reduced_early = self._flags.eager_step_needed = True

    def _finish_compiled_step(self) -> None:
        """What a step traced by torch.compile left undone, since it needs the parameters (dynamo would wrap them),
        and what dynamo dropped of it (its writes to the optimizer's attributes, see :class:`_StepFlags`): the
        step's reset, run again eagerly, so that each gradient it consumed gets its :class:`~.model_sync.SpentGrad`
        marker in ``param.grad``, as after an eager step (unless the loop cleared or replaced it since), and the
        optimizer's state is that of after a step; and opt.state shows the state. Called by the
        first eager look at the gradients after it: a backward's hooks and flush, a reduction (a clip; the next
        step's, before anything reads a gradient), a new optimizer or group asking whether this one is mid-step, a
        zero_() on a placeholder, ``zero_grad()`` (which then clears the markers), an access of ``opt.state``.
        Until session 23 nothing did: the placeholders stayed, so a second step without zero_grad() skipped every
        parameter where torch.optim applies the gradients again (eager steps raise the spent-gradient error), a
        clip did not raise it, and a new optimizer refused to be built (found by the loop fuzzer's compiled
        machine)."""
        self._reset_step_state(spent=True)  # (again, eagerly: it clears the flag)
        if not self._state_exposed:
            self._expose_state()

    def _note_eager_step(self) -> None:
        """:attr:`_flags`.eager_step_needed, at the end of a backward: whether a step now could skip a parameter, as
        torch.optim skips one whose grad is None: one without a gradient since zero_grad() (a bucket without any, or
        parameters in a bucket's ``no_grad``; a parameter frozen since construction is one of them unless it got a
        gradient, which step() applies), or whose weights or opt.state the loop wrote (:meth:`_model_changed`).
        Every other change that gives a parameter no gradient sets the flag (a reset, a clear, a new bucket, the
        loop's ``param.grad = ...`` or ``.data``: WatchedParameter), and so do the last step's gradients where
        nothing cleared them (the step must raise the spent-gradient error), and an eager reduction before step()
        (torch's clip_grad_norm_ over the placeholders, opt.clip_grad_norm_, GradScaler.unscale_: step() then looks
        at every param.grad again, and folds in what torch code multiplied them by), so False means: every
        parameter holds a gradient of the last backward, not reduced yet, and the model is as the last step left it.

        Why: a step compiled by torch.compile cannot look at the parameters (dynamo would wrap them, and their
        placeholder gradients), so it cannot leave out the pieces of those it must skip. Until session 23 it updated
        them with zero gradients (their weight decay and momentum applied, their step counted), silently. Now a
        compiled step reads this flag (dynamo guards on it) and, where it is set, runs the step eagerly
        (:func:`_step_eagerly`); with more ranks every compiled step does (:meth:`_eager_when_compiled`), so
        nothing is looked at there. Cost, in one process: one look per bucket and ~0.13 us per parameter
        (:meth:`_model_changed`) per backward."""
        if self._many_ranks:
            return
        self._flags.eager_step_needed = bool(self._spent_unlisted or self._spent or self._stale) or any(
            b.no_grad or not b.has_grads for b in self.buckets) or self._model_changed()

    def _run_step(self, closure=None):
        """:meth:`step`'s work (eager, or traced by torch.compile). Where it raises, the arguments
        ``torch.amp.GradScaler.step(opt)`` set on the optimizer for this call go with it: GradScaler deletes them
        only when the step returns, and the next ``scaler.step(opt)`` multiplies its scale by what it finds (until
        session 25 a step retried after an error unscaled by the square of the scale, silently)."""
        try:
            return self._step_work(closure)
        except BaseException:
            self.__dict__.pop("grad_scale", None)
            self.__dict__.pop("found_inf", None)
            raise

    def _step_work(self, closure=None):
        loss = None
        if closure is not None and self._retired_by is None:
            with torch.enable_grad():
                loss = closure()
        shaken = self._entry.position()
        self._final_look = True
        try:
            self._check_not_retired()  # (the other ranks are told: a retirement on some ranks only)
            found_inf, amp_scale, amp_found_inf, multiplier, frozen = self._before_update()
        except Exception as exc:
            self._tell_peers(exc, shaken)
            raise
        finally:
            self._final_look = False
        if self._flags.precise_notes and not torch.compiler.is_compiling():  # (taken by this step's look)
            self._forget_precise_notes()
        self._prepared_state = None
        compiling = torch.compiler.is_compiling()
        if self._graphs is not None and not compiling:
            # cuda_graph=True: the phase's key names what a capture freezes (None: this step runs eagerly); the
            # values the host sets are written first, into the tensors the captured ops read
            key = self._update_graph_key(amp_scale, amp_found_inf, multiplier, frozen)
            if key is not None:
                self._write_lrs()
                if multiplier is not None:
                    multiplier = self._persistent_tensor(
                        ("multiplier", multiplier.dtype), lambda: torch.empty((), dtype=multiplier.dtype,
                                                                              device=self.device)).copy_(multiplier)
            self._graphs.run("update", key, functools.partial(
                self._update_phase, found_inf, amp_scale, amp_found_inf, multiplier, frozen), _nothing)
        else:
            self._update_phase(found_inf, amp_scale, amp_found_inf, multiplier, frozen)
        if self.device.type == "cuda" and not compiling:  # streams, rule 3 (after the last reader of the shards)
            self._grads_consumed_event = self._step_event("grads consumed")
        if self._scale is not None and self._overflows_at_min_host is not None and not compiling:
            # to the host without a sync: the next step() reads it if the copy has landed by then
            self._overflows_at_min_host.copy_(self._overflows_at_min, non_blocking=True)
            self._overflows_at_min_event = self._step_event("overflows at min copied")
        self._reset_step_state(spent=True)  # the next flatten overwrites: no zero-fill pass
        if not self._state_exposed and not torch.compiler.is_compiling():
            self._expose_state()
        return loss

    def _look_for_trainer_once(self, last: bool) -> None:
        """With more than one rank and transformers imported: a ``transformers.Trainer`` up the stack (building this
        optimizer, or at its first step) gets :class:`~tritonshard.integrations.hf.ShardedOptimizerCallback`
        (:func:`~tritonshard.integrations.hf.adopt_trainer`). Looked for until one is found, or the ``last`` time."""
        if not self._look_for_trainer:
            return
        found = False
        if "transformers" in sys.modules and not torch.compiler.is_compiling():
            from ..integrations import hf
            found = hf.adopt_trainer(self, skip_frames=2)
        self._look_for_trainer = not (found or last)

    def _before_update(self) -> tuple:
        """What :meth:`step` checks and reduces before it changes anything (an error here is told to the other
        ranks: :meth:`_tell_peers`): ``(found_inf, amp_scale, amp_found_inf, multiplier, frozen)``."""
        self._check_loss_scale_floor()
        self._look_for_trainer_once(last=True)  # a transformers.Trainer saves the optimizer on one rank only
        # every group's hyper-parameters (a scheduler or the user may have changed them) before anything changes:
        # a bad value in group 1 must not leave group 0 updated and the step counters advanced
        for gi, group in self._trained_groups:
            self._check_group_at_step(gi, group)
        # (by a clip, a norm: sync_from_model ran then; or traced by torch.compile in a graph without this step,
        # which could not look at the model, and which _reduce_grads takes back: until session 36 that step did not
        # look either, so a weight written since was overwritten from the masters and an opt.state edit followed
        # only after the update, found by tests.optim.loop_fuzz_long's CompiledTrainingLoop)
        reduced_before = self._reduced is not None or self._flags.traced_reduction
        _, found_inf = self._reduce_grads(for_step=True)
        if reduced_before:
            # the model as it is now: weights written since the clip (until session 21 the update overwrote them
            # from the masters, silently), parameters replaced or appended, opt.state edited
            self.sync_from_model()
        if self._clamped and self._scale is None:  # clip_grad_value_ may have made an inf finite
            self._recheck_finite()
        # torch.amp.GradScaler.step(opt) sets these two around this call (see _step_supports_amp_scaling): the scale
        # the loss was multiplied by, unless unscale_() folded its inverse in already, and its inf flag
        amp_scale, amp_found_inf = self.__dict__.get("grad_scale"), self.__dict__.get("found_inf")
        if amp_found_inf is not None and not isinstance(amp_found_inf, torch.Tensor):
            # GradScaler's sum over the devices it found gradients on: the number 0 where it found none
            amp_found_inf = torch.tensor(float(amp_found_inf), device=self.device)
        if amp_scale is not None or amp_found_inf is not None:
            self._check_no_own_loss_scale("torch.amp.GradScaler.step(opt)")
        self.wait_for_params()  # the update rewrites the param shards the last all-gather reads
        multiplier = self._common_multiplier()
        # parameters frozen since construction (requires_grad=False now), and those without a gradient on every
        # rank: torch.optim skips them (no grad), so their weights and state must come out of the flat update
        # unchanged
        # (two disjoint lists: the second holds parameters that require grad; the "step" handshake is in it)
        frozen = self._frozen_since_build() + self._without_grad_everywhere()
        return found_inf, amp_scale, amp_found_inf, multiplier, frozen

    def _step_event(self, key: str):
        """A CUDA event of this optimizer's (one per ``key``, made once: not an event object and a CUDA event per
        step), recorded now on the current stream. Recording it again later is safe: a stream's wait_event, and a
        query, concern the record made last before them."""
        event = self._events.get(key)
        if event is None:
            event = self._events[key] = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def _tell_peers(self, exc: BaseException, shaken: tuple) -> None:
        """``exc`` was raised on this rank before the step's collectives: tell the other ranks through the
        handshake they will meet next (the "reduce" one, or the "step" one after a reduction), so that they raise
        too (:class:`~tritonshard.comm.PeerFailedError`, naming this rank's error) instead of waiting in collectives
        this rank will not join. With ``overlap_comm`` the reduce handshake ran at the end of backward: this rank
        first takes part in the reduction the others are in, then tells them at the "step" one. Nothing where it
        is past both, or where its reduction had started (an error in it: a bug, not a check), nor where it shook
        hands since the call began (``shaken``, the handshake counts then: the ranks met, so the error came after,
        from that handshake or on every rank)."""
        if not self._entry.active or torch.compiler.is_compiling() or self._entry.position() != shaken:
            return
        if not self._reduce_entered:
            entry, self._reduce_entered = "reduce", True
        elif self._reduced is None and not self._reduction_started:
            # overlap_comm: the end of backward shook hands and launched the reduce-scatters, so the others are
            # (or will be) in the reduction's collectives, and the handshake they meet next is the "step" one:
            # this rank takes part in the reduction (its result is never used) and then tells them there
            try:
                self._run_reduction()
            except Exception:  # noqa: BLE001 -- (this rank's own error is the one to raise)
                return
            entry, self._step_entered = "step", True
        elif self._reduced is not None and not self._step_entered:
            entry, self._step_entered = "step", True
        else:
            return
        self._entry.tell(entry, exc)

    def _update_phase(self, found_inf: torch.Tensor, amp_scale, amp_found_inf, multiplier, frozen: list) -> None:
        """The device work of :meth:`step` after the reduction: ``grad_scale``, the step counters, the updates, the
        all-gathers (waited for here unless the next forward waits), the skip bookkeeping and the loss scale."""
        if amp_found_inf is not None:  # (the flag of the step, not the reduction's: _found_inf_buf, below)
            found_inf = torch.maximum(found_inf, (amp_found_inf > 0).to(found_inf.dtype))
        bound = self._hot_path()
        # The updates (one segmented launch per param group where the rule has one), then the all-gathers. With
        # overlap_comm, one gather per bucket in the order the next forward needs the buckets (the first module's
        # first): on NCCL one group's collectives run in issue order, so the gather of the embedding's bucket must
        # not queue behind every other bucket's; a bucket updated on its own is gathered right after its update.
        # Without it, every gather is launched at once (one coalesced call) and waited for before step() returns.
        flags_fused = (amp_found_inf is None and amp_scale is None and self._scale is None and multiplier is None
                       and not frozen and not self._own_plan and self._scalar_kernels_run()
                       and bool(self._step_units))  # (no counter: no table, whose address would be 0)
        if flags_fused:  # the usual step: its scalars in one launch (kernels/scalars.py), the same bits as below
            grad_scale, found_inf = self._launch_step_flags(found_inf)
            redo, idle, keep = {}, frozenset(), []
        else:
            # the reduce-scatter SUMmed; the average is one more factor of the update's grad_scale (no pass, no
            # rounding) (each factor a tensor op into _grad_scale_buf, in place, in the order and with the ops of
            # coef * average / scale * multiplier / amp_scale; a plain number while there is no tensor factor)
            grad_scale = self._grad_average
            if self._clip_coef is not None:
                grad_scale = torch.mul(self._clip_coef, grad_scale, out=self._grad_scale_buf)
            if self._scale is not None:  # unscale folded into the same multiply as the clip coefficient
                grad_scale = _scale_in_place(grad_scale, self._scale, self._grad_scale_buf, torch.div)
            if multiplier is not None:  # torch.nn.utils.clip_grad_norm_ on param.grad: its coefficient, folded in
                grad_scale = _scale_in_place(grad_scale, multiplier, self._grad_scale_buf, torch.mul)
            if amp_scale is not None:  # GradScaler.step without unscale_(): the gradients are still scaled
                grad_scale = _scale_in_place(grad_scale, amp_scale, self._grad_scale_buf, torch.div)
            # the bound (or segmented) update launches read found_inf and grad_scale from these tensors (__init__)
            found_inf = self._found_inf_buf.copy_(found_inf)
            not_skipped = torch.neg(found_inf, out=self._not_skipped_buf).add_(1.0)  # 1 - found_inf
            # the step counts (skipped steps do not count), and the pieces of parameters whose own count differs
            # from their bucket's, saved now and updated again after the flat update with their count
            # (param_steps.py); the buckets of a counter none of whose parameters trains this step (idle) are not
            # updated at all; the pieces of the other skipped parameters are saved before the update and put back
            # after it
            redo, idle, keep = self._count_steps(frozen, not_skipped)
        kept = self._snapshot_pieces(keep) if keep else {}
        compiling = torch.compiler.is_compiling()
        together = self._update_together and not compiling  # every update first, then the gathers
        coalesce = self._coalesce and not compiling  # ... in one call
        if together:  # each param group's buckets in one call (ShardedAdamW, SGD, Lion: one segmented launch)
            self._next_rounding_seeds()
            for gi, buckets in self._step_units:
                if buckets[0].index in idle:
                    continue
                with _trace("tritonshard.update[group {}]", gi):
                    self._update_buckets(buckets, self.param_groups[gi], grad_scale, found_inf)
            for pieces in kept.values():
                self._restore_pieces(pieces)
            for i, pieces in redo.items():
                self._update_again(self.buckets[i], pieces, grad_scale, found_inf)
            order = [self.buckets[i] for i in self._gather_order]
            if coalesce:
                with _trace("tritonshard.all_gather[coalesced]"):
                    work = comm.SharedWork(comm.all_gather_coalesced(
                        [b.param_buffer.get_data() for b in order], [b.param_buffer.get_local_shard() for b in order],
                        group=self._pg))
                for b in order:
                    b.ag_work = work
            else:
                direct = self._direct_collectives and bound
                for b in order:
                    with _trace("tritonshard.all_gather[bucket {}]", b.index):
                        b.ag_work = self._all_gather(b, direct)
        else:  # with overlap_comm (or one bucket, or torch.compile): the gathers one by one (see above)
            self._next_rounding_seeds()
            merged = set()  # buckets whose param group went in one segmented launch
            for gi, buckets in self._step_units if self._segments is not None and self._segmented_path() else ():
                if buckets[0].index in idle:
                    continue
                with _trace("tritonshard.update[group {}]", gi):
                    if self._update_merged(buckets, self.param_groups[gi], grad_scale, found_inf):
                        merged.update(b.index for b in buckets)
            direct = self._direct_collectives and bound
            for i in self._gather_order:
                b = self.buckets[i]
                # (ShardedMuon, a group of one bucket): its own update, then its gather
                if i not in merged and i not in idle:
                    with _trace("tritonshard.update[bucket {}]", b.index):
                        self._update(b, self._group_of_bucket[b.index], grad_scale, found_inf)
                self._restore_pieces(kept.get(i, ()))
                if i in redo:
                    self._update_again(b, redo[i], grad_scale, found_inf)
                with _trace("tritonshard.all_gather[bucket {}]", b.index):
                    b.ag_work = self._all_gather(b, direct)
        if not flags_fused:  # (the fused launch counted them)
            self.skipped_steps.add_(self._found_long_buf.copy_(found_inf))
            torch.gt(found_inf, 0, out=self.last_step_skipped)
        if self._scale is not None:  # back off on overflow, grow after growth_interval clean steps; on device
            cfg = self.loss_scale_config
            # overflowed although at the floor: (found_inf > 0) & (scale <= min_scale)
            pinned = torch.le(self._scale, cfg.min_scale, out=self._pinned_buf).logical_and_(self.last_step_skipped)
            torch._amp_update_scale_(self._scale, self._growth_tracker, found_inf, cfg.growth_factor,
                                     cfg.backoff_factor, cfg.growth_interval)
            self._scale.clamp_(min=cfg.min_scale)
            # where(pinned, count + 1, 0) = (count + 1) * pinned
            self._overflows_at_min.add_(1).mul_(pinned)
        if not self._defer_gathers:
            self.wait_for_params()  # nobody would wait before the next forward

    #: param-group entries a captured update does not freeze: the lr is read from its device tensor
    _NOT_FROZEN = frozenset(("params", "lr", "param_names"))

    def _scalar_kernels_run(self) -> bool:
        """Whether a step's scalars (:func:`~tritonshard.kernels.scalars.step_flags_`), a clip's coefficient
        (:func:`~tritonshard.kernels.scalars.clip_coefficient_`) and, with more ranks, the rounding of the norm's
        all-reduced totals (:func:`~tritonshard.kernels.scalars.round_totals_`) go in one launch each: where the
        Triton kernels run (compiled, or the interpreter, where the CPU tests run them), outside torch.compile
        (which records the torch ops)."""
        return triton_kernels_run(self.device)

    def _launch_step_flags(self, found_inf: torch.Tensor) -> tuple:
        """The usual step's scalars in one launch, bound (kernels/scalars.py): ``_found_inf_buf`` = ``found_inf``,
        ``_not_skipped_buf`` = 1 - it, every counter of :attr:`_step_units` that counts the step
        (:meth:`_counts_step`) advanced by that, ``skipped_steps`` and ``last_step_skipped``, and after a clip
        ``_grad_scale_buf`` = coef * average: 8 small torch ops before (the counters one each). Returns
        ``(grad_scale, found_inf)`` for the updates: the buffer, or the average as a number where the loop did not
        clip."""
        # (ShardedSGD: the groups with momentum)
        counters = tuple(buckets[0].step for buckets in self._counting_units()) or (self._idle_counter,)
        cached = self._counter_table
        if cached is None or len(cached[0]) != len(counters) or not all(map(operator.is_, cached[0], counters)):
            # (kept with the counters it points to, so their storage lives as long as the table)
            cached = self._counter_table = (counters, _scalars.counter_table(counters, self.device))
        coef = self._clip_coef
        grad_scale = self._grad_average if coef is None else self._grad_scale_buf
        args = (found_inf, self._found_inf_buf, self._not_skipped_buf, self.skipped_steps, self.last_step_skipped)
        rest = (coef, self._grad_average, None if coef is None else grad_scale)
        _scalars.step_flags_kernel(_scalars.step_flags_launch_spec(*args, cached[1], *rest), self._scalar_launches,
                                  lambda: _scalars.step_flags_(*args, list(counters), *rest, table=cached[1]))
        return grad_scale, self._found_inf_buf

    def _update_graph_key(self, amp_scale, amp_found_inf, multiplier, frozen: list):
        """What a capture of :meth:`_update_phase` freezes, hashable: whether the loop clipped, the dtype of the
        multiplier torch code folded in, every trained group's hyper-parameters but the lr. None where this step
        must run eagerly: GradScaler's values (new tensors every step), parameters left out of this step (their
        pieces are saved and restored around the update) or counting steps of their own (param_steps.py), a
        multiplier that is not a 0-d tensor on our device, an lr given as a tensor, or a hyper-parameter that is a
        tensor or unhashable (a list, e.g. ``betas=[0.9, 0.95]``, counts as the tuple of its items)."""
        if amp_scale is not None or amp_found_inf is not None or frozen or self._own_plan:
            return None
        if multiplier is not None and not (isinstance(multiplier, torch.Tensor) and multiplier.dim() == 0
                                           and multiplier.device == self.device):
            return None
        groups = []
        for gi, group in self._trained_groups:
            items = []
            for name, value in group.items():
                if name in self._NOT_FROZEN:
                    continue
                if isinstance(value, list):
                    value = tuple(value)
                if (isinstance(value, torch.Tensor) or not isinstance(value, collections.abc.Hashable)
                        or (isinstance(value, tuple) and any(isinstance(v, torch.Tensor) for v in value))):
                    return None
                items.append((name, value))
            if isinstance(group["lr"], torch.Tensor):
                return None
            groups.append((gi, tuple(sorted(items, key=lambda item: item[0]))))
        return (self._clip_coef is not None, None if multiplier is None else multiplier.dtype, tuple(groups))

    def _write_lrs(self) -> None:
        """Every trained group's lr into its float64 device tensor (:meth:`_lr_tensor`), before a captured phase
        that reads them: the one value of a step the host sets (a scheduler changes it every step)."""
        for gi, group in self._trained_groups:
            self._lr_tensor(group, gi)
        self._lr_filled = True

    def _lr_source(self, group: dict, group_index: int):
        """The lr an update's coefficients are computed from: the number, or where :meth:`_write_lrs` wrote them for
        this step (cuda_graph), the group's float64 device tensor, so a captured phase reads this step's value."""
        if self._lr_filled:
            return self._lr_tensor(group, group_index)
        return float(group["lr"])

    def _next_rounding_seeds(self) -> None:
        """A fresh Philox key per step for every bucket with stochastically rounded state (see _make_bucket): one op
        for all of them, not one per bucket."""
        seeds = self._rounding_seeds
        if seeds:
            torch._foreach_add_(seeds, 1)

    def _all_gather(self, b: _Bucket, direct: bool):
        """Launch ``b``'s param all-gather; returns its work handle. ``direct``: on the hot path, straight through
        the ProcessGroup method (the Buffer checked the group and the layout when it was built)."""
        if self._solo:
            return COMPLETED
        if direct:
            return comm.all_gather_async(b.param_buffer.get_data(), b.param_buffer.get_local_shard(), self._pg)
        return b.param_buffer.all_gather(async_op=True)

    def _update(self, bucket: _Bucket, group: dict, grad_scale, found_inf: torch.Tensor) -> None:
        raise NotImplementedError

    #: an update rule whose kernel has a segmented (MULTI) mode: (its kernel module's SEGMENTS, its launcher's
    #: name), with ``_launch(bucket, group, grad_scale, found_inf) -> (spec or None, checked launch)``
    _segments: Optional[tuple[dict, str]] = None

    def _update_buckets(self, buckets: list, group: dict, grad_scale, found_inf: torch.Tensor) -> None:
        """The updates of ``buckets``, all of one param group (without overlap_comm, where nothing waits for a
        single bucket's): one segmented launch where the update rule has one (``_segments``), else one by one."""
        if not self._update_merged(buckets, group, grad_scale, found_inf):
            for b in buckets:
                self._update(b, group, grad_scale, found_inf)

    def _update_merged(self, buckets: list, group: dict, grad_scale, found_inf: torch.Tensor) -> bool:
        """The updates of ``buckets`` (one param group) in one segmented launch; False, having launched nothing,
        where the update rule has no segmented mode (``_segments``) or they cannot go together."""
        if self._segments is None:
            return False
        launch = functools.partial(self._launch, group=group, grad_scale=grad_scale, found_inf=found_inf)
        return self._launch_segmented(buckets, launch, *self._segments)

    def _launch_segmented(self, buckets: list, launch, segments: dict, op: str) -> bool:
        """One segmented launch (kernels/_launch.segmented_spec) for the updates of ``buckets`` (one param group),
        where ``launch(bucket)`` gives a bucket's (spec, checked launch). False when they cannot go together (the
        caller then updates bucket by bucket): one bucket, no segmented path here, or launches that do not merge.

        The merged launch is built once per variant of the first bucket's spec and kept (the other buckets' tensors
        never change, and everything else their launches take is the first one's: the group's scalars and
        coefficients, grad_scale, found_inf), so a step builds one spec and compares it, whatever the number of
        buckets. A new variant (new betas, a grad_scale that became a tensor) first goes through every bucket's
        checked launcher, which validates and launches, as a new bound launch does. The last
        ``_SEGMENTED_VARIANTS`` variants are kept, each with its tables and its bound launch: a loop that clips
        every other step switches between two, and a CUDA graph captured with one replays that one's tables
        (:meth:`_graph_references` keeps them alive while the graph lives). ``op``: the kernel's launcher, whose
        name the launch's profiler range carries (``tritonshard.kernel.<op>``, as the launcher's)."""
        if len(buckets) < 2 or not self._segmented_path():
            return False
        first, _ = launch(buckets[0])
        variants = self._segmented.setdefault(buckets[0].index, [])  # [(first spec, merged spec, its launches)]
        # (a variant differs in more than floats: a float, e.g. a beta OneCycleLR cycles, is this step's in the
        # merged launch, which replays with it: _launch.launch)
        kept = next((v for v in variants if _same_spec_but_floats(v[0], first)), None)
        if kept is None:
            specs = [first] + [launch(b)[0] for b in buckets[1:]]
            kept = (first, _launch.segmented_spec(specs, block=first[3]["BLOCK"], **segments), {})
            variants.insert(0, kept)
            del variants[self._SEGMENTED_VARIANTS:]
        merged = kept[1]
        if merged is None:
            return False
        if first is not kept[0]:  # (the group's floats of this step: every bucket's spec has the first's)
            kernel, grid, args, kwargs = merged
            merged = (kernel, grid, tuple(a if type(a) is not float else b for a, b in zip(args, first[2])), kwargs)

        def checked_launches():
            for b in buckets:
                launch(b)[1]()
        with _trace("tritonshard.kernel.{}", op):
            _launch.launch(kept[2], "merged", merged, checked_launches)
        return True

    #: merged launches kept per param group (see _launch_segmented)
    _SEGMENTED_VARIANTS = 4

    def _graph_references(self) -> list:
        """What a captured phase's kernels read through pointers the host made for them, beyond the buffers and
        per-step tensors this optimizer keeps for its lifetime: the merged launches' tables (a variant evicted
        from ``_segmented`` would free its tables under a graph that replays them). StepGraphs holds these with the
        graph."""
        return [variant for variants in self._segmented.values() for variant in variants]

    def _check_loss_scale_floor(self) -> None:
        """Raise when the last steps all overflowed with the loss scale at its floor (LossScaleConfig). On a GPU the
        count is read from its asynchronous copy once that has landed (at most a step late), never with a sync."""
        if self._scale is None or torch.compiler.is_compiling():
            return
        if self._overflows_at_min_host is not None:
            event = self._overflows_at_min_event
            if event is None or not event.query():
                return
            count = int(self._overflows_at_min_host)
        else:
            count = int(self._overflows_at_min)
        cfg = self.loss_scale_config
        if count >= cfg.max_overflows_at_min_scale:
            raise FloatingPointError(
                f"the last {count} steps all had inf/NaN gradients with the loss scale at its floor "
                f"(LossScaleConfig.min_scale={cfg.min_scale:g}); every one was skipped, and lowering the scale "
                "cannot help any more: the model diverged or the inputs hold inf/NaN. Lower the lr, check the data, "
                "or resume from an earlier checkpoint (max_overflows_at_min_scale sets how many to allow)")

    def _hot_path(self) -> bool:
        """The compiled kernels, eagerly: launches are bound once per bucket and replayed (kernels/_launch.py;
        ``_launch.set_bound_launches(False)`` sends the same launches through Triton's dispatch instead), the
        per-step scalars live in persistent tensors, and collectives and the flatten skip the per-call checks."""
        return compiled_path(self.device) and not torch.compiler.is_compiling()

    def _segmented_path(self) -> bool:
        """Whether each param group's updates go in one segmented launch (``_merge_updates``: more than one bucket),
        on the Triton kernels (compiled, or the interpreter, where the CPU tests run them), outside torch.compile."""
        return self._merge_updates and triton_kernels_run(self.device)

    def _persistent_args(self) -> bool:
        """Whether the update launches take their per-step values from tensors that keep their storage (found_inf,
        grad_scale, coefficients, the lr): so that a bound or segmented launch, or a captured phase, stays valid
        from step to step."""
        return self._hot_path() or self._segmented_path() or self._graphs is not None

    def _persistent_tensor(self, key, make):
        """A tensor made once and kept (a bound launch's per-step input, rewritten in place every step)."""
        t = self._persistent.get(key)
        if t is None:
            t = self._persistent[key] = make()
        return t

    def _lr_tensor(self, group: dict, group_index: int) -> torch.Tensor:
        """``group["lr"]`` in a float64 device tensor (one per group, kept): what the checked launchers of a bound
        update get, so that they compile the same specialization as the bound launch (lr read from memory). Kept
        by the group's index (a load_state_dict that replaced the group dicts would leave a tensor behind if it
        were kept by the dict's id)."""
        t = self._persistent_tensor(("lr", group_index),
                                    lambda: torch.empty((), dtype=torch.float64, device=self.device))
        if self._lr_filled:  # written for this step already, outside a captured phase (_write_lrs)
            return t
        return t.fill_(float(group["lr"]))

    def _once_per_step(self, key, compute):
        """``compute()`` the first time ``key`` is asked for in this step, the cached value after that: what the
        buckets of one param group share (e.g. AdamW's bias-corrected coefficients, small float64 device ops)."""
        if key not in self._step_cache:
            self._step_cache[key] = compute()
        return self._step_cache[key]
