"""``BackwardMixin``: ShardedOptimizer's side of a backward: the gradients into the grad buffers.

* the hooks' work (the hook objects are :mod:`.model_sync`'s): without ``overlap_comm`` every bucket is flushed at
  the end of the backward; with it, a bucket is flushed as its last gradient arrives and its reduce-scatter
  launched (:mod:`.reduction`), or completed buckets are flushed together where nothing is launched;
* a flush: the pending ``param.grad`` s flattened into the grad buffers (one launch for many buckets), then a
  placeholder (:class:`~.model_sync.ShardedGrad`) in each ``param.grad``, under the streams rules 3 and 4 of
  :mod:`.base`;
* what a loop does to ``param.grad`` between backwards and steps, as torch.optim sees it: a backward adding onto
  a gradient an earlier one left (handed back, or the sum shown to the loop's hooks), a gradient cleared, zeroed
  or replaced (taken back, discarded, held as zeros), and the marker a step leaves (a spent gradient).
"""

from __future__ import annotations

from typing import Optional

import torch

from ..kernels._dispatch import triton_kernels_run
from ..kernels.flatten import launch_unchecked as _flatten_unchecked
from ._compiled import kernels
from . import model_sync
from .bucket import POST_HOOKED, _Bucket, set_grad, trace as _trace
from .bucket import plain_attrs as _PLAIN_ATTRS
from .model_view import _names

__all__ = ["BackwardMixin"]

#: overlap_comm: completed buckets flushed together where none is launched at its completion (_flush_completed)
FLUSH_TOGETHER = 4

_FLAT_SOURCES = (torch.bfloat16, torch.float16, torch.float32)  # what kernels.flatten_into reads

#: torch.is_grad_enabled without the module attribute look-up (~30 ns less; read per parameter in a backward's
#: pre-hooks: a backward with create_graph=True runs them in grad mode)
_grad_enabled = torch._C.is_grad_enabled


class BackwardMixin:
    """Methods of :class:`~tritonshard.optim.base.ShardedOptimizer` that take the gradients a backward makes."""

    # ------------------------------------------------------------------ gradients into the buffers
    def _queue_end_of_backward(self) -> None:
        """Flush every bucket once autograd has finished this backward. Queued by the first gradient hook, or
        earlier by a hook on the attached model's outputs, which runs in the outermost backward (a reentrant
        activation checkpoint runs an inner backward whose callbacks run when the inner one ends)."""
        if not self._flush_queued:
            self._flush_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _forget_dead_backward(self) -> None:
        """Outside any backward, a queued end-of-backward that never ran belonged to a backward that raised (an
        error in a hook, an out-of-memory the loop caught): autograd drops its callbacks. Forget it, or no later
        backward would queue its own (no flush and, with ``overlap_comm``, no launch at its end; stale ``ready``
        sets flushing a bucket before its gradients are in)."""
        if torch._C._current_graph_task_id() == -1:
            self._flush_queued = self._grads_this_backward = False
            self._completed = []
            for b in self.buckets:
                b.ready.clear()

    def _grad_arriving(self, param: torch.Tensor, index: int) -> None:
        """Without ``overlap_comm``: a gradient is about to be accumulated into ``param.grad`` (the AccumulateGrad
        pre-hook, the optimizer's only hook on the parameter then): the placeholder out, the arrival noted."""
        self._take_placeholder(param, index)
        self._on_grad_ready(param)

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        self._queue_end_of_backward()
        self._grads_this_backward = True
        if self._raw_stream is not None and not torch.compiler.is_compiling():  # streams, rule 4
            stream = self._raw_stream()
            if stream not in self._grad_streams:
                self._grad_streams[stream] = torch.cuda.current_stream(self.device)
        if self._overlap_machinery:  # (keyed by id: Tensor.__hash__ is a Python method; this runs per parameter)
            key = id(param)
            bucket = self._bucket_by_id[key]
            bucket.ready.add(key)
            if len(bucket.ready) == len(bucket.params):  # the bucket's last gradient of this backward
                if self._observed_order is not None and bucket.index not in self._observed_order:
                    self._observed_order.append(bucket.index)
                # param.grad stays: backward(create_graph=True) (_end_of_backward), or a hook of the loop's after
                # this one reads it (_hand_back_grad)
                if _grad_enabled() or (id(param) in POST_HOOKED and self._user_post_hooks(param)):
                    return
                if self._no_sync_depth:  # (one rank runs this machinery in tests and benchmarks only: there as on
                    # many, a flush and a launch per bucket outside no_sync(), each launch the identity)
                    self._flush_completed(bucket)
                    return
                self._flush_bucket(bucket)
                if not self._no_sync_depth:
                    bucket.launch_wanted = True
                    self._launch_in_order()

    def _flush_completed(self, bucket: _Bucket) -> None:
        """overlap_comm, a bucket completed where nothing is launched for it now (inside ``no_sync()``): flushed with
        the next completed ones, FLUSH_TOGETHER buckets in one flush (one flatten launch, one pass of the Python
        around it), the rest at the end of the backward. A flush of its own per bucket cost ~45 us of host time on
        the GPU path (session 32: with the 302M example's 26 buckets, four at a time saved ~1.3 ms per backward on
        this repo's CPU machine, flushing all at the end ~3 ms); waiting for FLUSH_TOGETHER keeps at most
        FLUSH_TOGETHER - 1 more buckets' gradients alive than a flush per bucket (75 MB at the default
        ``bucket_cap_mb``), where flushing only at the end would keep the whole model's."""
        done = self._completed
        done.append(bucket)
        if len(done) < FLUSH_TOGETHER:
            return
        self._completed = []
        key = tuple(b.index for b in done)
        launches = self._group_launches.get(key)
        if launches is None:  # a new group: the oldest is forgotten once there are as many as buckets (a static
            # model brings back the same few groups every backward; one whose buckets complete in changing orders,
            # e.g. experts routed anew each step, would otherwise keep a plan per order it ever saw)
            groups = self._group_launches
            if len(groups) >= max(8, len(self.buckets)):
                del groups[next(iter(groups))]
            launches = groups[key] = {}
        self._flush_buckets(done, launches)

    def _end_of_backward(self) -> None:
        self._flush_queued = False
        self._completed = []  # (flushed below with every other bucket)
        got_grads, self._grads_this_backward = self._grads_this_backward, False
        if got_grads and _grad_enabled():
            # backward(create_graph=True) (autograd runs its callbacks in the backward's grad mode): torch leaves each
            # gradient in param.grad with its graph, for code that differentiates it again (a gradient penalty on
            # the parameters' gradients, a Hessian-vector product) and for a later backward to add onto. So does
            # this optimizer: the gradients stay there as gradients set by hand do, for the next flush (the next
            # backward's end, or the reduction's), and so do those of earlier backwards that this one did not reach
            # (the pre-hooks handed back those it reached), which torch's param.grad holds too and a penalty over
            # every param.grad reads. Until session 39 they were taken into the buffers, and reading them was an
            # error
            got_grads = False
            if self._reduced is None:
                for b in self.buckets:
                    if b.placed and not b.rs_launched:
                        for p, placeholder in zip(b.params, b.grad_placeholders):
                            if p.grad is placeholder:
                                self._hand_back_grad(p)
        if self._frozen_at_build:  # (parameters unfrozen since: their buckets are flushed and launched below)
            self._adopt_unfrozen()
        if got_grads:  # buckets some of whose parameters got no gradient in this backward
            self._flush_buckets(self.buckets)
        # (none of ours got one, e.g. torch.autograd.grad through the model: gradients set by hand stay in param.grad
        # as torch.optim leaves them, for the next flush or the reduction's; until session 35 this flush took them,
        # and a hand-set gradient zeroed by zero_grad(set_to_none=False) became a placeholder that refused a new
        # optimizer over the parameters "between a backward and its step()", found by tests.optim.loop_fuzz_long)
        unwaited = None
        for b in self.buckets:
            if b.ready:  # (overlap_comm: gradients of this backward)
                if b.ag_work is not None:  # ... of parameters whose all-gather no forward waited for
                    unwaited = (unwaited or []) + [p for p in b.params if id(p) in b.ready]
                b.ready.clear()
        if self._grad_streams:  # every gradient they were noted for is in a buffer now
            self._grad_streams.clear()
        # a backward that reached none of our parameters (torch.autograd.grad through the model's outputs, or a
        # rank whose loss did not use them) launches nothing here; step() launches what is left on every rank
        if self.overlap_comm and not self._no_sync_depth and got_grads:
            # every bucket is reduced after the last micro-batch, including one that got no gradient at all, so
            # every rank issues the same collectives in the same order
            self._launch_all()
        if self._reduce_entered and self._reduced is None:
            self._launched_by_backward = True
        if self._ddp_pending is not None:
            self._average_for_ddp()
        self._note_eager_step()
        if unwaited:
            self._raise_unwaited(unwaited)

    def _raise_unwaited(self, params: list) -> None:
        """The end of a backward (``overlap_comm``) found gradients of ``params``, whose all-gather, launched by the
        last step(), no forward waited for: the forward read them without the wait that a hooked module's pre-hook,
        a guarded attribute read or the model's listings make, so it may have seen the last step's values in some
        elements (the gather writes them in the background). Until session 27 that trained on, silently. Seen on
        every rank alike (the same model and code); the gathers are waited for now, so the loop can go on after a
        fix. Costs nothing where every gather was waited for (one look per bucket given gradients)."""
        self.wait_for_params()
        raise RuntimeError(
            f"tritonshard: {_names([self._param_names[p] for p in params])} got gradients from a forward that read "
            "them before their all-gather (launched by the last step(), overlap_comm=True) was waited for, so it may "
            "have used the last step's values in some elements. Nothing that used them waited: a module made or "
            "swapped in after attach() (SyncBatchNorm.convert_sync_batchnorm, quantization-aware training's "
            "prepare, a submodule replaced by another holding the same parameters), or a tensor taken from the "
            "model before step() (a list of parameters kept for a regularizer). Change the model before building "
            "the optimizer, read parameters through the model (model.fc.weight, model.parameters()), or call "
            "opt.wait_for_params() before such a forward.")

    def _flush_bucket(self, b: _Bucket) -> None:
        """Move the bucket's pending ``param.grad`` s into its grad buffer; the first flush since zero_grad()
        overwrites (parameters without a gradient get zeros), later ones accumulate."""
        if self._launched_by_backward:
            self._forget_discarded_launches()
        pending = self._take_pending(b)
        if pending is not None:
            self._flatten_one(b, pending)

    def _flatten_one(self, b: _Bucket, pending: list) -> None:
        """The flatten of ``b``'s ``pending`` gradients by a launch of its own, then their placeholders."""
        grads, offsets = [g for _, g, _ in pending], [off for _, _, off in pending]
        others = self._wait_for_grad_streams()
        # the unchecked flatten only for gradients of the buffer's device and a source dtype the kernel reads (a
        # model moved or converted after construction goes through the checked launcher, which names the problem)
        if self._hot_path() and self._flattenable(grads):
            _flatten_unchecked(b.grad_buffer.get_data(), grads, offsets, b.has_grads, launches=b.launches)
        else:
            kernels().flatten_into(b.grad_buffer.get_data(), grads, offsets, accumulate=b.has_grads)
        self._release_to_grad_streams(others)
        self._place_all_placeholders([(b, pending)])

    def _flush_buckets(self, buckets, launches: Optional[dict] = None, model_checked: bool = False) -> None:
        """:meth:`_flush_bucket` for each of ``buckets``, with one flatten launch for all of them (per accumulate
        mode) instead of one per bucket where the Triton kernels run, outside torch.compile (issue 20.3: the end of
        backward without overlap_comm flushes every bucket at once; ~4 us of host time per launch saved per bucket).

        The kernel writes through a destination offset per tensor from its ``out``: bucket 0's grad buffer, and
        every other bucket's tensors at their buffer's distance from it (in elements; the buffers share the grad
        dtype and the allocator's alignment, so the distance is exact and keeps the 16-byte classes). Each element
        gets the same arithmetic as in a per-bucket launch, so the buffers hold the same bits. ``launches``: the
        launch plans' dict for this set of buckets (default: the one for the end of a backward). ``model_checked``:
        sync_from_model() has just passed (a reduction's flush), so every parameter is on the buffers' device in
        their dtype, and so is every gradient (torch's ``param.grad`` setter and autograd give a dense gradient
        its parameter's dtype and device): the per-gradient look at them is skipped (~0.25 us per gradient)."""
        if not buckets:
            return
        if self._launched_by_backward:
            self._forget_discarded_launches()
        if not self._flatten_together():
            for b in buckets:
                self._flush_bucket(b)
            return
        out = self.buckets[0].grad_buffer.get_data()
        base, size = out.data_ptr(), out.element_size()
        jobs: dict[bool, tuple[list, list]] = {}
        flushed = []
        for b in buckets:
            pending = self._take_pending(b)
            if pending is None:
                continue
            grads = [g for _, g, _ in pending]
            distance, rest = divmod(b.grad_buffer.get_data().data_ptr() - base, size)
            if rest or not (model_checked or self._flattenable(grads)):  # (a moved or converted model: the checked
                # launcher names it)
                self._flatten_one(b, pending)
                continue
            all_grads, all_offsets = jobs.setdefault(b.has_grads, ([], []))
            all_grads += grads
            all_offsets += [off + distance for _, _, off in pending]
            flushed.append((b, pending))
        others = self._wait_for_grad_streams() if jobs else ()
        for accumulate, (grads, offsets) in jobs.items():
            with _trace("tritonshard.kernel.flatten_into"):  # (the launcher's range name, as a profile shows it)
                _flatten_unchecked(out, grads, offsets, accumulate,
                                   launches=self._flush_launches if launches is None else launches)
        self._release_to_grad_streams(others)
        self._place_all_placeholders(flushed)

    def _place_all_placeholders(self, flushed: list) -> None:
        """The second half of every flush: :meth:`_place_placeholders` for each ``(bucket, pending)``, the usual
        buckets (each of their parameters in ``pending``) in one loop under one context (~3 us of host time less
        per bucket than a call each); any other, or one where torch's setter refuses a placeholder, through it."""
        if torch.compiler.is_compiling():
            for b, pending in flushed:
                self._place_placeholders(b, pending)
            return
        rest = []
        with _PLAIN_ATTRS():
            for b, pending in flushed:
                if len(pending) != len(b.params):
                    rest.append((b, pending))
                    continue
                try:
                    for p, placeholder in zip(b.params, b.grad_placeholders):
                        set_grad(p, placeholder)
                except RuntimeError:  # (converted, moved or resized since construction: the call sorts it out,
                    rest.append((b, pending))  # setting again what was set)
                    continue
                b.placed.update(b.all_placed)  # (from a dict: no Tensor.__hash__ per parameter)
                b.has_grads = True
        for b, pending in rest:
            self._place_placeholders(b, pending)
        if self._zeroed or self._zeroed_plain:  # (as in _place_placeholders)
            self._forget_zeroed([x for _, pending in flushed for x in pending])

    def _flatten_together(self) -> bool:
        """Whether :meth:`_flush_buckets` flattens several buckets in one launch: on the Triton kernels (compiled,
        or the interpreter, where the CPU tests run them), outside torch.compile (whose step records each bucket's
        flatten as a custom op)."""
        return triton_kernels_run(self.device)

    def _flattenable(self, grads: list) -> bool:
        """Gradients the unchecked flatten takes: on the buffers' device, of a source dtype the kernel reads."""
        device = self.device
        return all(g.device == device and g.dtype in _FLAT_SOURCES for g in grads)

    def _take_pending(self, b: _Bucket) -> Optional[list]:
        """The first half of a flush: ``b``'s pending gradients as (parameter, gradient, offset in the grad buffer)
        (None when there are none), checked, with the buffer made ready for them (zeros for parameters without a
        gradient on the first flush since zero_grad(), the streams ordered). :meth:`_place_placeholders` is the
        second half, after the flatten."""
        if self._flags.compiled_unfinished:
            self._finish_compiled_step()
        if self._reduced_early:  # (a reduction whose gradients the loop all cleared since: gone)
            self._check_grads_since_reduction("forget")
        if self._sums_shown:
            self._settle_shown(b)
        placed = b.placed
        if self._spent_unlisted:  # (a reduction lists them again first: _check_no_spent_grads)
            self._list_spent()
        # markers: where some param.grad may still hold its spent marker (SpentGrad), which stands for no gradient
        # of this backward (by identity: the listing may be older than the loop's last clear or assignment)
        markers = self._spent_grads if self._spent else None
        if placed:
            self._take_back_cleared(b)
            if len(placed) == len(b.params):  # (each param.grad is its placeholder, checked just now: every
                return None  # gradient is in the buffer already)
        with _PLAIN_ATTRS():
            if placed or markers is not None:
                pending = [(p, g, off) for p, off in zip(b.params, b.grad_buffer.offsets)
                           if (g := p.grad) is not None and p not in placed
                           and (markers is None or g is not markers[p])]
            else:
                pending = [(p, g, off) for p, off in zip(b.params, b.grad_buffer.offsets)
                           if (g := p.grad) is not None]
        if not pending:
            return None
        sparse = next((p for p, g, _ in pending if g.layout != torch.strided), None)
        if sparse is not None:
            raise RuntimeError(
                f"the gradient of {self._param_names[sparse]} is {sparse.grad.layout}: tritonshard flattens dense "
                "gradients only (e.g. build nn.Embedding with sparse=False)")
        if self._reduced is not None:  # (first: without overlap_comm, the reduce-scatters ran in clip_grad_norm_)
            raise RuntimeError("gradients arrived after clip_grad_norm_() reduced them and before step(); "
                               "call step() (or zero_grad()) first")
        if b.rs_launched:
            raise RuntimeError(
                f"gradients for bucket {b.index} arrived after its reduce-scatter was launched: with "
                "overlap_comm=True, run every backward of an accumulation but the last inside opt.no_sync(), also "
                "where one step has several backward() calls (losses backpropagated one by one, retain_graph=True) "
                "(with a reentrant activation checkpoint, also call opt.attach(model))")
        self._after_last_step_readers()
        if not b.has_grads and len(pending) < len(b.params):
            for p, view in zip(b.params, b.grad_buffer.get_views()):  # (a marker's part of the buffer still holds
                if p.grad is None or (markers is not None and p.grad is markers[p]):  # the gradient its step used)
                    view.zero_()  # no gradient this time: contributes zeros
                    b.no_grad[p] = True
                    self._flags.eager_step_needed = True
        elif b.no_grad:  # a later micro-batch's gradients, for some that had none
            for p, _, _ in pending:
                b.no_grad.pop(p, None)
        return pending

    def _wait_for_grad_streams(self) -> tuple:
        """Streams, rule 4, before a flatten: the noted streams other than the current one, which the current
        stream now waits for (their gradients are complete on them); () where there are none (the usual case: one
        stream for the forward, the backward and the flush)."""
        streams = self._grad_streams
        if not streams:
            return ()
        current = self._raw_stream()
        others = tuple(stream for raw, stream in streams.items() if raw != current)
        if others:
            flush_stream = torch.cuda.current_stream(self.device)
            for stream in others:
                flush_stream.wait_stream(stream)
        return others

    def _release_to_grad_streams(self, others: tuple) -> None:
        """Streams, rule 4, after a flatten and before ``param.grad`` lets the gradients go: the streams they belong
        to wait for the flatten, so the caching allocator's reuse of their memory there comes after it."""
        if others:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
            for stream in others:
                stream.wait_event(event)

    def _place_placeholders(self, b: _Bucket, pending: list) -> None:
        """The second half of a flush, once ``pending`` (from :meth:`_take_pending`) is in the buffer:
        ``param.grad`` lets the gradients go. The general case (under torch.compile, some of the bucket's
        parameters only, a placeholder torch's setter refuses), reached through :meth:`_place_all_placeholders`."""
        if torch.compiler.is_compiling():
            for p in b.params:
                p.grad = None
        else:  # param.grad says "there is a gradient, in tritonshard's buffer" (see ShardedGrad)
            placed, every = b.placed, len(pending) == len(b.params)
            param_dtype, device = self.param_dtype, self.device
            if every:  # every parameter of the bucket, in its order (the usual flush)
                pairs = zip(b.params, b.grad_placeholders)
            else:
                placeholders = self._placeholders
                pairs = ((p, placeholders[p]) for p, _, _ in pending)
            refused = []
            with _PLAIN_ATTRS():
                for p, placeholder in pairs:
                    try:  # (torch's setter checks the dtype, device and shape against the parameter's)
                        set_grad(p, placeholder)
                    except RuntimeError:
                        if p.dtype == param_dtype and p.device == device and p.shape == placeholder.shape:
                            raise  # (not one of the three: torch's error is the one to see)
                        set_grad(p, None)  # converted, moved or resized since construction: step() raises, naming
                        refused.append(p)  # it (sync_from_model)
                    else:
                        if not every:
                            placed[p] = True
            if every:  # (a dict's update from a dict copies its keys' hashes: no Tensor.__hash__ per parameter)
                placed.update(b.all_placed)
                for p in refused:
                    del placed[p]
        b.has_grads = True
        if self._zeroed or self._zeroed_plain:
            self._forget_zeroed(pending)

    def _forget_zeroed(self, flushed: list) -> None:
        """``flushed`` (a flush's ``(param, gradient, offset)``) hold a backward's (or a hand-set) gradient now, not
        the zeros of a ``zero_grad(set_to_none=False)``; the other zeroed parameters still hold zeros, which are in
        nobody's way (:meth:`_mid_step`). Until session 43 every flush forgot them all: a loop that then cleared the
        flushed gradients (``p.grad = None``) could not build another optimizer over the parameters, refused as if
        a gradient waited (found by tests.optim.loop_fuzz_long). A gradient set by hand and zeroed in place by
        ``zero_grad(set_to_none=False)`` is flushed as one, but holds those zeros where the flush takes it unchanged
        (the same tensor, its version as zeroed: ``_zeroed_plain``): zeroed too (until session 46 a backward that
        did not reach it counted it as its gradient, and the same refusal followed; found the same way)."""
        zeroed, plain = self._zeroed, self._zeroed_plain
        if len(flushed) == len(self._param_list):  # (the usual flush: every parameter)
            zeroed.clear()
        else:
            for p, _, _ in flushed:
                zeroed.pop(p, None)
        if plain:  # (looked up, not taken: a bucket's flush may pass here twice, _flush_buckets)
            for p, g, _ in flushed:
                kept = plain.get(p)
                if kept is not None and kept[0] is g and g._version == kept[1]:
                    zeroed[p] = True

    def _after_last_step_readers(self) -> None:
        """Streams, rule 3: before the first write into a grad buffer after ``step()``, the current stream waits for
        the last step's kernels that read the grad shards (a no-op on CPU and on the step's own stream)."""
        if self._grads_consumed_event is not None and not torch.compiler.is_compiling():
            torch.cuda.current_stream(self.device).wait_event(self._grads_consumed_event)
            self._grads_consumed_event = None

    def _take_placeholder(self, param: torch.Tensor, index: int) -> None:
        """A new gradient for ``param`` (``_param_list[index]``) is about to be accumulated: remove the placeholder,
        so autograd stores it (the earlier gradients are in the grad buffer, which the next flush accumulates
        onto). Per parameter and backward: its placeholder and bucket by index, not looked up by the tensor."""
        if self._flags.compiled_unfinished:
            self._finish_compiled_step()
        grad = param.grad
        if grad is None:  # (the first backward after zero_grad())
            return
        if grad is self._placeholder_list[index]:
            b = self._param_buckets[index]
            if ((_grad_enabled() or (POST_HOOKED and id(param) in POST_HOOKED and self._user_post_hooks(param)))
                    and not b.rs_launched and self._reduced is None):
                if self.grad_dtype != self.param_dtype and not _grad_enabled():
                    self._show_after_accumulation(param, b)  # (the hand-back would round the sum to the weights'
                    return  # dtype, and the next backward's add would too)
                self._hand_back_grad(param)  # backward(create_graph=True), or a post-accumulate hook of the loop's,
                return  # onto an earlier backward's gradient
            set_grad(param, None)
            b.placed.pop(param, None)
            if b.rs_launched:  # accumulating onto a launched reduction: an error at the flush (_take_pending)
                self._taken_after_launch = True
        elif (self._spent_unlisted or self._spent) and grad is self._spent_grads.get(param):
            set_grad(param, None)  # torch.optim would add this gradient to the spent one: an error if the sum is used
            self._spent.pop(param, None)
            self._stale[param] = True

    def _user_post_hooks(self, param: torch.Tensor) -> bool:
        """Whether ``param`` has post-accumulate-grad hooks other than this optimizer's (``overlap_comm``'s machinery
        has one per parameter): the loop's own (``p.register_post_accumulate_grad_hook``: gradient statistics, a
        per-parameter clamp), which read ``param.grad`` as torch's autograd leaves it, the sum over the backwards so
        far. Asked only for the parameters in :data:`~tritonshard.optim.bucket.POST_HOOKED`."""
        hooks = param._post_accumulate_grad_hooks
        return hooks is not None and len(hooks) - (param in self._show_hooks) > self._overlap_machinery

    def _hand_back_grad(self, param: torch.Tensor) -> None:
        """A backward is about to add onto ``param``'s gradient, which an earlier backward (a micro-batch's) left in
        the grad buffer, and code will read the sum in ``param.grad``, as torch's autograd leaves it there: a backward
        with ``create_graph=True`` (the sum, with the new gradient's graph, is what code differentiating
        ``param.grad`` reads, a penalty on it), or a post-accumulate-grad hook of the loop's (:meth:`_user_post_hooks`;
        until session 39 it read this backward's gradient alone, and a hook writing it, a clamp, changed that part
        only, silently). So it goes back into ``param.grad``, a plain tensor in the parameter's dtype, its part of
        the buffer zeroed; the next flush takes the sum, as it takes a gradient set by hand (onto the zeros: the
        bits of an accumulation in the buffer where the grad buffer has the parameter's dtype). Before a reduction
        only (after one the buffer holds shards of the sum over the ranks: the pre-hook takes the placeholder out as
        for any backward, and the flush's error follows)."""
        b, i = self._bucket_of[param]
        self._after_last_step_readers()
        view = b.grad_buffer.get_views()[i]
        grad = view.to(param.dtype, copy=True)
        view.zero_()
        b.placed.pop(param, None)
        set_grad(param, grad)

    def _show_after_accumulation(self, param: torch.Tensor, b: _Bucket) -> None:
        """:meth:`_hand_back_grad` where the grad buffer's dtype is wider than the parameter's (``grad_dtype=
        torch.float32`` beside bf16 weights): a backward is about to add onto ``param``'s gradient, and a hook of the
        loop's reads the sum. Handed back, the fp32 sum would be rounded to bf16 in ``param.grad`` and the new
        gradient added to it in bf16 (two roundings of the sum per micro-batch the loop chose fp32 to avoid:
        ~2.8e-5 on the masters after three steps of four micro-batches at lr 1e-3 with a hook only reading the
        gradient's norm, against 7e-9 without the hook, before session 44). Instead autograd stores this backward's
        gradient alone, and a hook of ours ahead of the loop's (:class:`~.model_sync.ShowSumHook`, moved to the
        front of the parameter's post-accumulate-grad hooks) adds it into the buffer in fp32 and shows the loop's
        hooks the sum's rounding (:meth:`_show_sum`); the flush keeps the fp32 sum where they left that rounding
        and takes their value where they wrote one (:meth:`_settle_shown`)."""
        hooks = param._post_accumulate_grad_hooks
        key = self._show_hooks.get(param)
        if key is None or key not in hooks:
            key = self._show_hooks[param] = param.register_post_accumulate_grad_hook(model_sync.ShowSumHook(self)).id
        if next(iter(hooks)) != key:  # (torch runs them in the order of the dict under the OrderedDict, which
            # move_to_end leaves as it was: the same dict, its entries inserted again, ours first)
            entries, ours = list(hooks.items()), hooks[key]
            hooks.clear()
            hooks[key] = ours
            hooks.update((k, hook) for k, hook in entries if k != key)
        set_grad(param, None)
        b.placed.pop(param, None)
        self._sums_to_show.add(param)

    def _show_sum(self, param: torch.Tensor) -> None:
        """:class:`~.model_sync.ShowSumHook`'s work: ``param``'s new gradient (``param.grad`` now, autograd's) added
        into its grad buffer view, and ``param.grad`` made the sum in the parameter's dtype for the loop's hooks."""
        if param not in self._sums_to_show:
            return
        self._sums_to_show.discard(param)
        grad = param.grad
        if grad is None or grad.layout != torch.strided:  # (a sparse one: the flush names it)
            return
        b, i = self._bucket_of[param]
        self._after_last_step_readers()
        view = b.grad_buffer.get_views()[i]
        view.add_(grad)
        shown = view.to(param.dtype, copy=True)
        set_grad(param, shown)
        self._sums_shown[param] = shown.clone()

    def _settle_shown(self, b: _Bucket) -> None:
        """At the flush of ``b``: each of its parameters whose sum :meth:`_show_sum` showed the loop's hooks. Where
        ``param.grad`` is still what they were shown, the buffer's fp32 sum stays; where a hook wrote (a clamp), its
        value is taken, as torch's autograd leaves the hook's write in ``param.grad``; cleared (``p.grad = None``):
        the gradient is gone. Then ``param.grad`` is its placeholder again."""
        for p in [p for p in self._sums_shown if self._bucket_of[p][0] is b]:
            shown = self._sums_shown.pop(p)
            view = b.grad_buffer.get_views()[self._bucket_of[p][1]]
            g = p.grad
            if g is None or type(g) is not torch.Tensor or g.shape != shown.shape or g.dtype != shown.dtype:
                view.zero_()  # (cleared, or replaced by a gradient of the loop's own: the flush takes it whole, as a
                continue  # gradient set by hand)
            view.copy_(torch.where(g != shown, g, view))
            set_grad(p, self._placeholders[p])
            b.placed[p] = True

    def _take_back_cleared(self, b: _Bucket) -> None:
        """torch semantics for code that cleared or replaced ``param.grad`` after we took the gradient
        (``model.zero_grad()``, ``p.grad = None``, ``p.grad = t``): the gradient in the buffer is discarded."""
        placed = b.placed
        with _PLAIN_ATTRS():
            if len(placed) == len(b.params):  # (every one: the lists made for that, no look-ups)
                cleared = [p for p, placeholder in zip(b.params, b.grad_placeholders) if p.grad is not placeholder]
            else:
                placeholders = self._placeholders
                cleared = [p for p in placed if p.grad is not placeholders[p]]
        for p in cleared:
            placed.pop(p)
            self._discard_grad(p, keep_placeholder=False)

    def _discard_grad(self, param: torch.Tensor, keep_placeholder: bool = True) -> None:
        """Zero ``param``'s gradient in the grad buffer (``param.grad.zero_()``, or a cleared ``param.grad``)."""
        if self._flags.compiled_unfinished:  # (a compiled step's gradient: spent, see SpentGrad.zero_())
            self._finish_compiled_step()
            if param.grad is self._spent_grads[param]:
                self._zero_spent(param)
                return
        b, i = self._bucket_of[param]
        if b.rs_launched or self._reduced is not None:
            raise RuntimeError(
                f"the gradient of {self._param_names[param]} was zeroed, cleared or replaced after it was reduced "
                "(by clip_grad_norm_, or by overlap_comm=True at the end of backward); change gradients before "
                "clipping, and with overlap_comm=True before the last backward of the step")
        if self._stale:
            self._stale.pop(param, None)  # (the sum torch.optim would hold is cleared or zeroed: nothing stale)
        if b.has_grads:
            self._after_last_step_readers()
            b.grad_buffer.get_views()[i].zero_()
            if keep_placeholder and param in b.placed:
                self._zeroed[param] = True
            if not keep_placeholder and param.grad is None:  # cleared (not zeroed, not replaced): no gradient,
                b.no_grad[param] = True                       # as for torch.optim
                self._flags.eager_step_needed = True
        if not keep_placeholder and param.grad is self._placeholders[param]:
            set_grad(param, None)

    def _forget_discarded_launches(self, at_flush: bool = True) -> None:
        """The first flush after a backward whose end launched reduce-scatters (``overlap_comm``), before anything
        used them: if the loop cleared every gradient since (``model.zero_grad()``, ``p.grad = None``; the
        discriminator's ``netD.zero_grad()`` in a GAN loop, whose generator's backward ran through it), the launched
        reductions hold nothing torch.optim would use, and they are finished and forgotten as ``opt.zero_grad()``
        forgets them. Otherwise nothing changes: gradients cleared in part, or one accumulated onto a launched
        bucket, stay the flush's errors (a reduction cannot take a gradient back). ``at_flush=False``: a look
        from outside a flush (another optimizer asking whether this one is mid-step), which leaves the question
        open for a later look (the loop may still clear them) unless it forgot them."""
        if self._taken_after_launch or self._reduced is not None or self._holds_placed_gradients():
            if at_flush:
                self._launched_by_backward = False
            return
        self._launched_by_backward = False
        self._reset_step_state()
        self._stale = {}  # (their sums were cleared with the rest)

    def _list_spent(self) -> None:
        """``_spent`` = the parameters whose ``param.grad`` still holds the marker step() left there: not cleared or
        replaced since (``model.zero_grad()``, ``p.grad = None`` or ``= t``). One look per parameter, in the first
        flush or reduction after a step() that no ``opt.zero_grad()`` followed."""
        markers = self._spent_grads
        self._spent = {p: True for p in self._param_list if p.grad is markers[p]}
        self._spent_unlisted = False

    def _check_no_spent_grads(self) -> None:
        """Before a reduction (``step()``, a clip, a norm): a RuntimeError where torch.optim would use a gradient
        that the last step consumed: a marker still in ``param.grad`` (torch.optim would apply it again), or a
        backward's gradient added to one (torch.optim would use the sum)."""
        if self._spent_unlisted or self._spent:
            self._list_spent()
        if self._spent:
            p = next(iter(self._spent))
            raise model_sync.spent_error(
                self._param_names[p], f"step(), a clip or a norm while the param.grad of {len(self._spent)} "
                "parameters still holds the last step()'s gradient")
        placeholders = self._placeholders
        for p in [p for p in self._stale if p.grad is not placeholders[p]]:
            del self._stale[p]  # cleared, zeroed or replaced after that backward: no sum with the spent gradient
        if self._stale:
            p = next(iter(self._stale))
            raise model_sync.spent_error(
                self._param_names[p], f"step(), a clip or a norm after a backward that added to the last step()'s "
                f"gradients ({len(self._stale)} parameters; no zero_grad() in between)")

    def _zero_spent(self, param: torch.Tensor) -> None:
        """``param.grad.zero_()`` on a :class:`~.model_sync.SpentGrad` (``model.zero_grad(set_to_none=False)``):
        as in torch.optim, ``param`` has a gradient of zeros from now on, which a backward adds to and a step
        applies (weight decay, momentum); ``param.grad`` becomes its placeholder again."""
        self._check_not_retired()
        self._spent.pop(param, None)
        self._hold_zeros(self._bucket_of[param][0], [param])

    def _hold_zeros(self, b: _Bucket, params: list, buffer_zeroed: bool = False) -> None:
        """``params`` (of bucket ``b``) hold a gradient of zeros from now on, as torch's zeroed ``param.grad``:
        their part of the grad buffer zeroed and their placeholder in ``param.grad`` (a backward adds to it, step()
        applies it). The bucket's first gradient since the last reset zero-fills the buffer and marks the others as
        without one (a later flush gives them one). ``buffer_zeroed``: the caller zero-filled the buffers without
        gradients already (zero_grad(set_to_none=False): all of them in one launch)."""
        self._after_last_step_readers()
        filled = not b.has_grads
        if filled:
            if not buffer_zeroed:
                b.grad_buffer.get_data().zero_()
            b.no_grad = {p: True for p in b.params if p not in b.placed}
            b.has_grads = True
            self._flags.eager_step_needed = True
        views, placeholders, zeroed = b.grad_buffer.get_views(), self._placeholders, self._zeroed
        for p in params:
            if not filled:
                views[self._bucket_of[p][1]].zero_()
            b.no_grad.pop(p, None)
            set_grad(p, placeholders[p])
            b.placed[p] = zeroed[p] = True
