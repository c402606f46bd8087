"""``ReductionMixin``: the gradients' reduction, once per step: the reduce-scatters, the norm pass, clipping and
loss scaling.

* the reduce-scatters, in bucket order on every rank (one coalesced call without ``overlap_comm``), and
  ``no_sync()``;
* :meth:`_reduce_grads`: the checks and handshakes before the collectives, then the device work
  (:meth:`_reduce_phase`, captured under ``cuda_graph=True``): the waits, the norm pass into one workspace and its
  finalize, the all-reduce of [sum of squares, non-finite flag];
* what the loop calls on the reduced gradients: ``clip_grad_norm_``, ``grad_norm``, the loss scale and
  ``torch.amp.GradScaler``'s unscale;
* :meth:`_reset_step_state`: what a step or ``zero_grad()`` forgets of the step's gradients.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import operator
from typing import Optional

import torch
import torch.distributed as dist

from .. import comm
from ..buffer import COMPLETED
from ..kernels import _launch
from ..kernels import scalars as _scalars
from ..kernels._dispatch import compiled_path
from ..kernels.scale import (finalize_launch_spec, fold_rows_launch_spec, partials_launch_spec,
                             partials_multi_launch_spec)
from ._compiled import _EAGERLY, kernels
from .bucket import _Bucket, set_grad, trace as _trace
from .bucket import plain_attrs as _PLAIN_ATTRS
from .model_view import _GRAD

__all__ = ["ReductionMixin"]


class ReductionMixin:
    """Methods of :class:`~tritonshard.optim.base.ShardedOptimizer` that reduce the gradients."""

    # ------------------------------------------------------------------ reduce-scatter launches
    def _launch_all(self) -> None:
        """Every bucket may be reduced now; launch all that are not yet in flight, in launch order."""
        for b in self.buckets:
            b.launch_wanted = True
        if self._coalesce and self._next_launch == 0 and not torch.compiler.is_compiling():
            self._launch_coalesced()
        else:
            self._launch_in_order()

    def _launch_coalesced(self) -> None:
        """Every bucket's reduce-scatter in one collective call (``_coalesce``), sharing one work handle."""
        self._enter_reduce()
        for b in self.buckets:
            self._zero_if_no_grads(b)
        order = [self.buckets[i] for i in self._launch_order]
        with _trace("tritonshard.reduce_scatter[coalesced]"):
            work = comm.SharedWork(comm.reduce_scatter_coalesced(
                [b.grad_buffer.get_local_shard() for b in order], [b.grad_buffer.get_data() for b in order],
                group=self._pg))
        for b in order:
            b.rs_work, b.rs_launched = work, True
        self.reduce_scatters_launched += len(order)
        self._next_launch = len(order)

    def _zero_if_no_grads(self, b: _Bucket) -> None:
        """Before ``b``'s reduction: no gradient since zero_grad() means the buffer still holds the previous
        step's, so it contributes zeros instead."""
        if not b.has_grads:
            self._after_last_step_readers()
            b.grad_buffer.zero_()
            b.has_grads = True
            b.no_grad = dict.fromkeys(b.params, True)
            self._flags.eager_step_needed = True

    def _launch_in_order(self) -> None:
        """Launch the wanted reduce-scatters, strictly in bucket order (the same order on every rank)."""
        direct = None  # (decided once per call, when there is something to launch)
        while (self._next_launch < len(self.buckets)
               and self.buckets[self._launch_order[self._next_launch]].launch_wanted):
            b = self.buckets[self._launch_order[self._next_launch]]
            if self._next_launch == 0:
                self._enter_reduce()
            if direct is None:
                direct = self._direct_collectives and not self._ordered and self._hot_path()
            self._zero_if_no_grads(b)
            with _trace("tritonshard.reduce_scatter[bucket {}]", b.index):
                if self._solo:
                    b.rs_work = COMPLETED
                elif direct:
                    # the hot path: the group was checked when the Buffer was built (layout check included)
                    b.rs_work = comm.reduce_scatter_async(b.grad_buffer.get_local_shard(), b.grad_buffer.get_data(),
                                                          self._pg)
                elif self._ordered:
                    slot = self._next_launch % 2
                    if self._scratch_user[slot] is not None:
                        self._consume_reduced(self._scratch_user[slot])
                    b.rs_slot, self._scratch_user[slot] = slot, b
                    data = b.grad_buffer.get_data()
                    b.rs_work = comm.all_to_all_single(self._scratch[slot][:data.numel()], data,
                                                       group=self.process_group, async_op=True)
                else:
                    b.rs_work = b.grad_buffer.reduce_scatter(op=dist.ReduceOp.SUM, async_op=True)
            b.rs_launched = True
            self.reduce_scatters_launched += 1
            self._next_launch += 1

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate the backward passes inside into the grad buffers without communicating (as in DDP).

        With ``overlap_comm=True`` the reduce-scatters start during the first backward outside ``no_sync()``, so
        every backward of an accumulation but the last must be inside it (a late gradient raises). Without
        overlap, communication happens only in ``clip_grad_norm_()`` / ``step()``; reducing or stepping inside
        ``no_sync()`` raises instead of silently reducing a partial accumulation.
        """
        self._no_sync_depth += 1
        try:
            yield
        finally:
            self._no_sync_depth -= 1

    # ------------------------------------------------------------------ reduction, norm, clipping
    def _reduce_grads(self, for_step: bool = False, recheck: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Reduce-scatter + 1/d scale + global sum of squares and non-finite flag; once per step. An error before
        its collectives (a check of the gradients) is told to the other ranks (:meth:`_tell_peers`).

        ``for_step`` (step()) and ``recheck`` (the loop's own entry points: opt.clip_grad_norm_, grad_norm,
        GradScaler.unscale_) look again at the gradients of a reduction made earlier in the step
        (:meth:`_check_grads_since_reduction`); the placeholders' ops (torch's clip: a norm, then a multiply per
        parameter) do not: that look reads every param.grad, and per parameter it would cost the square of their
        number, while step() looks in any case."""
        self._check_not_retired()  # (also where a step() that raised it took part in the others' reduction first)
        if self._flags.compiled_unfinished and not torch.compiler.is_compiling():
            self._finish_compiled_step()
        if self._flags.traced_reduction and self._reduced is None:
            self._adopt_traced_reduction()
        if self._reduced_early and (for_step or recheck):
            self._recheck_reduction("step" if for_step else "norm")
        if self._reduced is not None and self._frozen_at_build and not torch.compiler.is_compiling():
            # (unfrozen since the reduction: an error if it would miss a gradient; on one rank a reduction that
            # holds no gradient any more is forgotten there first, and this step's is made below, with the new
            # buckets: until session 47 the forgotten one was returned, None, and step() failed unpacking it)
            self._adopt_unfrozen()
        if self._reduced is not None:
            return self._reduced
        shaken = self._entry.position()
        try:
            reduced = self._reduce_now()
        except Exception as exc:
            self._tell_peers(exc, shaken)
            raise
        if not for_step and not torch.compiler.is_compiling():
            self._reduced_early = self._flags.eager_step_needed = True
        elif not for_step:  # (step() in the same graph clears these: _reset_step_state)
            self._flags.traced_reduction = True
            self._flags.traced_state = (reduced, self._next_launch, self._reduce_entered, self._reduction_started)
            self._flags.traced_clip_coef = None
        return reduced

    def _recheck_reduction(self, mode: str) -> None:
        """:meth:`_check_grads_since_reduction`, its error told to the other ranks (:meth:`_tell_peers`)."""
        shaken = self._entry.position()
        try:
            self._check_grads_since_reduction(mode)
        except Exception as exc:
            self._tell_peers(exc, shaken)
            raise

    def _check_grads_since_reduction(self, mode: str) -> bool:
        """Whether ``param.grad`` is still what a reduction made before ``step()`` (by a clip, a norm,
        ``GradScaler.unscale_``) took. torch.optim steps with whatever ``param.grad`` holds at its step, and a
        reduction cannot take a gradient back. ``mode`` says who asks: ``"step"``, ``"norm"`` (a clip or a norm
        after the reduction), ``"forget"`` (a backward's flush, or another optimizer or ``add_param_group`` asking
        whether this one is mid-step). True where the reduction stands (or was forgotten):

        * nothing changed: it stands (``"forget"``: unless it holds no gradient, below);
        * none of its gradients is held any more (the loop cleared them all, ``model.zero_grad()``, or replaced
          each by hand): at ``"forget"``, or where gradients were set by hand since, it is forgotten, as
          ``opt.zero_grad()`` forgets it, and what ``param.grad`` holds now (the next backward's, the hand-set
          ones) is reduced afresh, as torch.optim would step with it; a clip or a norm reduces afresh too (torch's
          finds no gradient). Where they were only cleared, ``"step"`` keeps the reduction and skips its
          parameters, which have no gradient now (on every rank: the step's handshake agrees, as for any parameter
          without one; where another rank kept gradients, the step would apply the reduction, which holds this
          rank's cleared ones: an error on every rank, see ``_without_grad_everywhere``; a rank that had no
          gradient to clear could not tell a reduction afresh from none, and its collectives would not pair: for a
          clip after such a clear, a CollectiveMismatchError there);
        * some are held and some changed (replaced, cleared or set by hand: torch.optim would step with a mix the
          reduction cannot give): a RuntimeError naming the first such parameter (``"forget"``: False).

        One look at each ``param.grad``, only in steps reduced before ``step()`` (gradients zeroed since the
        reduction are an error of their own, at the zeroing)."""
        # After the reduction each parameter's param.grad was its placeholder (it had a gradient: placed) or None
        # (gradients set by hand were flushed; a spent marker is an error before any reduction): read with map(),
        # compared with the placeholders in _param_list's order (~0.1 us per parameter, once per step)
        params = self._param_list
        with torch._C.DisableTorchFunctionSubclass():
            now = list(map(_GRAD, params))
        own = list(map(operator.is_, now, self._placeholder_list))
        held = own.count(True)  # (not now.count(None): list.count compares with ==, which a placeholder refuses)
        placed = sum(len(b.placed) for b in self.buckets)
        if held == placed == len(now) and mode != "forget":  # (the usual step: every one its placeholder still)
            return True
        empty = list(map(operator.is_, now, itertools.repeat(None))).count(True)
        set_since = len(now) - empty - held  # (gradients that are neither None nor the parameter's placeholder)
        unchanged = held == placed and set_since == 0
        if unchanged and mode != "forget":
            return True
        # (a backward adding onto a reduced gradient took its placeholder out of param.grad: still held, an error)
        if not held and not self._taken_after_launch:
            if mode != "step" or set_since:
                self._reset_step_state()  # none of the reduction's gradients is left: as after opt.zero_grad()
                self._stale = {}
                return True
            for b in self.buckets:  # ("step": no gradient left to step with, as for torch.optim)
                for p in b.placed:
                    b.no_grad[p] = True
            self._flags.eager_step_needed = True
            self._cleared_after_reduction = placed > 0  # (for the step's handshake: another rank may have kept its)
            return True
        if unchanged:
            return True
        if mode == "forget":
            return False
        placed_set = {id(p) for b in self.buckets for p in b.placed}
        changed = [(p, placeholder if id(p) in placed_set else None, new)
                   for p, placeholder, new, mine in zip(params, self._placeholder_list, now, own)
                   if not mine and (id(p) in placed_set or new is not None)]
        p, old, new = next((c for c in changed if c[2] is not None), changed[0])
        how = "cleared (param.grad = None; others were not)" if new is None else "replaced" if old is not None else "set"
        raise RuntimeError(
            f"the gradient of {self._param_names[p]} was {how} after the gradients were reduced (by a clip, a norm "
            f"or GradScaler.unscale_(opt)) and before step(): torch.optim would step with param.grad as it is now "
            f"({len(changed)} parameters changed), and the reduction cannot take it back. Set, replace or clear "
            "gradients before clipping or unscaling, or clear them all (opt.zero_grad()) and run the backward again")

    def _reduce_now(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._no_sync_depth:
            raise RuntimeError("clip_grad_norm_()/step() inside no_sync(): leave the context first" + (
                " (here: the DistributedDataParallel's require_backward_grad_sync was set False; set it True before "
                "the last micro-batch's forward, as DDP needs)" if self._in_ddp_no_sync else ""))
        if self._spent_unlisted or self._spent or self._stale:
            self._check_no_spent_grads()
        self.sync_from_model()
        if not torch.compiler.is_compiling():  # (a compiled step takes the gradients its backward flushed)
            self._flush_buckets(self.buckets, model_checked=True)  # gradients set by hand, without a backward
        return self._run_reduction()

    def _run_reduction(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The reduction itself, after :meth:`_reduce_now`'s checks (its collectives come first: the "reduce"
        handshake, unless ``overlap_comm`` shook hands at the end of backward)."""
        self._reduction_started = True
        if self._graphs is not None and not torch.compiler.is_compiling():
            # cuda_graph=True: what runs on the host stays out of the graph (the handshake, a buffer that got no
            # gradient zeroed), the rest is captured once and replayed (graphs.py)
            self._enter_reduce()
            for b in self.buckets:
                self._zero_if_no_grads(b)
            self._graphs.run("reduce", True, self._reduce_phase, self._after_reduce_replay)
        else:
            self._reduce_phase()
        self._reduced = self._reduced_bufs
        return self._reduced

    def _reduce_phase(self) -> None:
        """The device work of :meth:`_reduce_grads`: every bucket's reduce-scatter, the norm pass, its finalize, the
        all-reduce of the totals, and the fp32 ``(sum_sq, found_inf)`` in ``_reduced_bufs``."""
        self._launch_all()
        self._adopt_observed_order()
        self._partials_of_pieces = False
        if not self._consume_all_reduced():
            for i in self._launch_order:
                self._consume_reduced(self.buckets[i])
        # rounded to fp32 once, after the fp64 sums over blocks, buckets and ranks: the same bits for any layout
        # (also blocks cut at the pieces instead of the shards). On one rank the finalize's store rounds (into
        # _reduced_pair, the fp32 (sum_sq, found_inf)); with more, after the all-reduce of the fp64 totals, in one
        # launch (kernels/scalars.py)
        many = comm.is_initialized() and self.world_size > 1
        totals = self._norm_totals if many else self._reduced_pair
        if self._partials_of_pieces:
            workspace, key = self._piece_norm_plan.workspace, "finalize pieces"
        else:
            workspace, key = self._norm_workspace, "finalize"
        if self._hot_path():  # one launch for every bucket, bound (the same tensors every step)
            spec = self._finalize_specs.get(key)
            if spec is None:
                spec = self._finalize_specs[key] = finalize_launch_spec(workspace, totals)
            _launch.launch(self._norm_launches, key, spec, lambda: kernels().finalize_sum_sq_(workspace, totals))
        else:
            kernels().finalize_sum_sq_(workspace, totals)
        if many:
            dist.all_reduce(totals, op=dist.ReduceOp.SUM, group=self.process_group)
            if self._scalar_kernels_run():  # (one bound launch instead of three ops, kernels/scalars.py)
                args = (totals, self._reduced_pair)
                _scalars.round_totals_kernel(_scalars.round_totals_launch_spec(*args), self._scalar_launches,
                                             lambda: _scalars.round_totals_(*args))
            else:
                sum_sq, found_inf = self._reduced_bufs
                sum_sq.copy_(totals[0])
                found_inf.copy_(torch.gt(totals[1], 0, out=self._nonfinite_buf))

    def _after_reduce_replay(self) -> None:
        """The host state :meth:`_reduce_phase` leaves, set after a replay of its graph: every bucket launched and
        waited for (the checks of a late or cleared gradient read it). With ``overlap_comm`` on one rank the end of
        the backward launched them already (each the identity there, its bookkeeping on the host): counted once."""
        self.reduce_scatters_launched += sum(not b.rs_launched for b in self.buckets)
        for b in self.buckets:
            b.launch_wanted = b.rs_launched = True
        self._next_launch = len(self.buckets)

    def _enter_reduce(self) -> None:
        """The "reduce" handshake (comm.EntryCheck), once per step: at the first reduce-scatter launch, or before a
        captured reduction, whose replay runs no Python."""
        if not self._reduce_entered:
            self._reduce_entered = True
            self._entry("reduce")

    def _consume_all_reduced(self) -> bool:
        """:meth:`_consume_reduced` for every bucket, the norm passes in one launch, where the kernels allow (see
        :meth:`_flatten_together`). Its blocks are cut at the pieces of the shards (each parameter's part of this
        rank's shard, :meth:`_make_norm_pieces`), their partials in the pieces' workspace, which the finalize
        sums (``_partials_of_pieces``), so torch's per-parameter norms later in the step add those partials up
        instead of reading the gradients again (:meth:`_piece_sums_of_squares`); else (no piece plan, a cuda_graph
        capture, whose replays run no Python) each grad shard's partials into its slice of the workspace, the same
        values as per bucket. False, having done nothing, where each bucket takes its own steps: with
        ``ordered_reduce`` (a fold per bucket) or a replica group (an all-reduce per bucket), or one bucket."""
        if self._ordered or self.replica_size > 1 or len(self.buckets) < 2 or not self._flatten_together():
            return False
        plan = self._piece_plan() if self._graphs is None else None
        spec = plan.spec(self._grad_average) if plan is not None else None
        if spec is not None:
            for i in self._launch_order:
                self._wait_reduced(self.buckets[i])

            def checked_pieces():
                for v, part in zip(plan.views, plan.slices):
                    kernels().sum_sq_partials_(v, self._grad_average, part)
            with _trace("tritonshard.kernel.sum_sq_partials_"):
                _launch.launch(self._norm_launches, "norm pieces", spec, checked_pieces)
            self._partials_of_pieces = True
            return True
        shards = [b.grad_buffer.get_local_shard() for b in self.buckets]
        if self._norm_spec is None:  # built once: the shards and the workspace never move, the factor is 1/d
            self._norm_spec = partials_multi_launch_spec(
                shards, self._grad_average, [b.norm_partials for b in self.buckets]) or False
        if self._norm_spec is False:
            return False
        for i in self._launch_order:
            self._wait_reduced(self.buckets[i])

        def checked_launches():
            for b, shard in zip(self.buckets, shards):
                kernels().sum_sq_partials_(shard, self._grad_average, b.norm_partials)
        with _trace("tritonshard.kernel.sum_sq_partials_"):
            _launch.launch(self._norm_launches, "norm", self._norm_spec, checked_launches)
        return True

    def _wait_reduced(self, b: _Bucket) -> bool:
        """Wait for ``b``'s reduction (on the device: the current stream waits); False when none was in flight."""
        if b.rs_work is None:
            return False
        with _trace("tritonshard.wait_reduce_scatter[bucket {}]", b.index):
            b.rs_work.wait()
        b.rs_work = None
        return True

    def _consume_reduced(self, b: _Bucket) -> None:
        """Wait for ``b``'s reduction and run its norm pass (partials into its slice of the shared workspace);
        with ``ordered_reduce``, that pass also adds the all-to-all's rows into the shard and frees the scratch."""
        if not self._wait_reduced(b):
            return
        shard = b.grad_buffer.get_local_shard()
        bound = self._hot_path()
        if self._ordered:
            rows = self._scratch[b.rs_slot][:b.grad_buffer.padded_numel].view(self.world_size, -1)
            if bound:
                rows = b.scratch_rows.setdefault(b.rs_slot, rows)  # the same view object every step: bindable
                _launch.launch(b.launches, ("fold", b.rs_slot),
                               fold_rows_launch_spec(rows, shard, self._grad_average, b.norm_partials),
                               lambda: kernels().fold_rows_(rows, shard, self._grad_average, b.norm_partials))
            else:
                kernels().fold_rows_(rows, shard, self._grad_average, b.norm_partials)
            self._scratch_user[b.rs_slot] = None
            if self.replica_size == 1:
                return  # the fold took the norm pass's statistics
            # hybrid: the replicas' sum (at most 2 replicas, checked at construction: one exact add), then the
            # statistics of that sum below, replacing the fold's
        if self.replica_size > 1:  # hybrid: the same shard on every replica, summed over them
            dist.all_reduce(shard, op=dist.ReduceOp.SUM, group=self.replica_group)
        # read-only: the shard keeps the SUM; the 1/d average is applied in the update's grad_scale
        # the bucket's per-program partials into its slice of one workspace, allocating nothing
        if bound:
            _launch.launch(b.launches, "norm", partials_launch_spec(shard, self._grad_average, b.norm_partials),
                           lambda: kernels().sum_sq_partials_(shard, self._grad_average, b.norm_partials))
        else:
            kernels().sum_sq_partials_(shard, self._grad_average, b.norm_partials)

    def _adopt_observed_order(self) -> None:
        """Once, after the first backward: launch later steps' reduce-scatters in the order buckets completed
        (rank 0's observation, broadcast, so every rank agrees); buckets that never completed go last. The one
        host read of the whole optimizer (``tolist()``), in the first step only."""
        if self._observed_order is None:
            return
        # every rank takes part in the broadcast, also one whose backward produced no gradient (nothing observed),
        # so the collectives stay matched; rank 0's observation decides
        seen = self._observed_order
        order = seen + [i for i in range(len(self.buckets)) if i not in seen]
        self._observed_order = None
        if comm.is_initialized() and self.world_size > 1:
            t = torch.tensor(order, dtype=torch.int64, device=self.device)
            src = 0 if self.process_group is None else dist.get_global_rank(self.process_group, 0)
            dist.broadcast(t, src=src, group=self.process_group)
            order = t.tolist()
        self._launch_order = order

    def _reset_step_state(self, spent: bool = False) -> None:
        """Forget this step's gradients: ``param.grad`` None (``zero_grad()``), or with ``spent=True`` (``step()``)
        each placeholder replaced by the parameter's :class:`~.model_sync.SpentGrad` marker."""
        compiling = torch.compiler.is_compiling()
        if self._flush_queued and not compiling:
            self._forget_dead_backward()
        if (self._many_ranks and self._reduce_entered and self._reduced is None and not self._reduction_started
                and not compiling and any(b.rs_work is not None for b in self.buckets)):
            # overlap_comm: the end of a backward launched this step's reduction, and this rank drops it unused
            # (zero_grad(), or every gradient cleared: _forget_discarded_launches). Another rank that keeps its
            # own runs the rest of the reduction's collectives in its step(), so this one takes part in them too:
            # until session 25 it went on into its next call's collectives instead, and the ranks waited for each
            # other for good (a hang). Now that rank's step meets this one's next call at the handshake: a
            # CollectiveMismatchError on both; where every rank drops it, they all take part, as before in effect.
            self._run_reduction()  # (its result goes with the rest below)
        for b in self.buckets:
            if b.rs_work is not None:  # launched but never consumed (zero_grad() after backward): finish it
                b.rs_work.wait()
            b.rs_work, b.rs_launched, b.launch_wanted, b.has_grads = None, False, False, False
        self._scratch_user = [None, None]
        placeholders, markers = self._placeholders, (self._spent_grads if spent else None)
        if self._missing_here:
            if spent and not compiling:  # (DDP would have put the average in their param.grad: used, so spent)
                for p in self._missing_here:
                    if p.grad is None:
                        set_grad(p, markers[p])
                        self._spent_unlisted = True
            self._missing_here = []
        self._list_dependent = self._cleared_after_reduction = False
        # (inside a backward, the gradients it has given so far are still this backward's: a reset from its flush,
        # which forgets a reduction the loop cleared since, keeps them, or a bucket half-ready then would wait for
        # the end of the backward to launch)
        in_backward = not compiling and torch._C._current_graph_task_id() != -1
        if not in_backward:  # (the sums shown to the loop's hooks go with the gradients; inside a backward, its flush
            self._sums_to_show.clear()  # settles them next)
            self._sums_shown.clear()
        if compiling:  # (the markers need the parameters: the next eager call places them)
            self._flags.compiled_unfinished = self._flags.compiled_unfinished or spent
        else:
            self._flags.compiled_unfinished = False  # (placed below)
        for b in self.buckets:
            if not in_backward:
                b.ready.clear()
            if not compiling:  # step() and zero_grad() consume the gradients (see SpentGrad for step()'s markers)
                if spent and b.placed:
                    self._spent_unlisted = True
                with _PLAIN_ATTRS():
                    if len(b.placed) == len(b.params):  # (every one: walk the lists made for that, no look-ups)
                        for p, placeholder, marker in zip(b.params, b.grad_placeholders,
                                                          b.spent_markers if spent else itertools.repeat(None)):
                            if p.grad is placeholder:
                                set_grad(p, marker)
                    else:
                        for p in b.placed:
                            if p.grad is placeholders[p]:
                                set_grad(p, markers[p] if markers is not None else None)
                b.placed.clear()
            if b.no_grad:
                b.no_grad = {}
        self._next_launch = 0
        self._flags.eager_step_needed = True  # (nothing has a gradient now)
        self._flags.traced_reduction = False
        self._flags.traced_state = self._flags.traced_clip_coef = None
        self._reduce_entered = self._step_entered = self._lr_filled = self._reduction_started = False
        self._launched_by_backward = self._taken_after_launch = False
        if not compiling:  # (keyed by the parameters, which dynamo would wrap, and their param.grad, which it
            # cannot: the eager rerun after a compiled step clears it, _finish_compiled_step)
            self._zeroed.clear()
            self._zeroed_plain.clear()
        self._reduced, self._clip_coef, self._reduced_early = None, None, False
        self._clamped = self._partials_of_pieces = False
        self._step_cache.clear()
        self._grad_multipliers.clear()
        self._all_multipliers.clear()
        self._reciprocals.clear()
        self._norm_cache.clear()

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Global gradient norm over all ranks (padding excluded), as a device tensor; clip to ``max_norm``.

        The clipping itself is folded into the update's ``grad_scale`` (no extra pass over the gradients). With
        ``norm_type=2`` the norm comes from the sums of squares the scale kernel produced; other norms take one
        extra read of the gradient shards. A non-finite norm means the step will be skipped.
        """
        if torch.compiler.is_compiling() and (why := self._eager_when_compiled()) is not None:
            return _EAGERLY["clip", why](self, max_norm, norm_type)
        return self._clip_grad_norm(max_norm, norm_type)

    def _clip_grad_norm(self, max_norm, norm_type):
        if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or not max_norm > 0:
            raise ValueError(f"max_norm must be a number > 0, got {max_norm!r}")
        norm_type = float(norm_type)
        sum_sq, _ = self._reduce_grads(recheck=True)
        if (norm_type == 2.0 and not self._clamped and self._scale is None and self._clip_coef is None
                and not self._grad_multipliers and not self._all_multipliers and self._scalar_kernels_run()):
            # the usual clip: the norm, a new tensor at every call as torch's (which the bound launch takes afresh),
            # and its coefficient in one launch (kernels/scalars.py), the same bits as torch's ops: compiled, the
            # norm's sqrt is in it too (no torch op; until session 36 a sqrt and a clone), under the interpreter it
            # is torch's (on a CPU tensor not always correctly rounded: see there)
            self._common_multiplier()  # (None, as no torch code multiplied the gradients; it notes that)
            compiled = compiled_path(self.device)
            norm = torch.empty((), dtype=torch.float32, device=self.device) if compiled else torch.sqrt(sum_sq)
            args, options = (norm, self._clip_buf, max_norm), (dict(sum_sq=sum_sq) if compiled else {})
            _scalars.clip_coefficient_kernel(_scalars.clip_coefficient_launch_spec(*args, **options),
                                             self._scalar_launches,
                                             lambda: _scalars.clip_coefficient_(*args, **options))
            self._clip_coef = self._clip_buf
            if self._flags.traced_reduction:  # (under torch.compile: see _adopt_traced_reduction)
                self._flags.traced_clip_coef = self._clip_coef
            return norm
        if norm_type == 2.0 and not self._clamped:
            total = sum_sq.sqrt()
            if self._scale is not None:
                total = total / self._scale  # the norm of the true (unscaled) gradients
        else:  # from the per-parameter norms (averaged, unscaled; validates norm_type)
            per_param = self._param_grad_norms(norm_type)
            if not per_param.numel():
                total = torch.zeros((), dtype=torch.float32, device=self.device)
            elif norm_type == math.inf:
                total = per_param.amax()
            else:
                total = per_param.pow(norm_type).sum().pow(1.0 / norm_type)
        multiplier = self._common_multiplier()
        if multiplier is not None:  # torch code already scaled the gradients (e.g. torch's clip_grad_norm_)
            total = total * multiplier
        earlier = self._clip_coef
        if earlier is not None:  # a second clip this step: of the gradients the first one clipped, as torch's
            total = total * earlier  # (until session 26 it saw them unclipped, and returned their norm)
        # torch.nn.utils.clip_grad_norm_'s coefficient, kept on the device: clamp(max_norm / (total + 1e-6), max=1),
        # with the same ops (Python's max_norm / t is t.reciprocal() * max_norm), in place
        coef = torch.add(total, 1e-6, out=self._clip_buf if earlier is None else None)
        coef = coef.reciprocal_().mul_(max_norm).clamp_(max=1.0)
        self._clip_coef = coef if earlier is None else earlier.mul_(coef)  # (earlier is _clip_buf)
        if self._flags.traced_reduction:  # (under torch.compile: see _adopt_traced_reduction)
            self._flags.traced_clip_coef = self._clip_coef
        return total

    def grad_norm(self) -> torch.Tensor:
        """Global 2-norm of the gradients as ``param.grad`` holds them now (averaged over ranks, unscaled; after
        this step's clips, ``GradScaler.unscale_`` and other multiplies of ``param.grad``): what
        ``torch.nn.utils.get_total_norm`` returns with torch.optim. It clips nothing; reduces the gradients if not
        yet done."""
        if torch.compiler.is_compiling() and (why := self._eager_when_compiled()) is not None:
            return _EAGERLY["norm", why](self)
        return self._grad_norm()

    def _grad_norm(self) -> torch.Tensor:
        norm = self._reduce_grads(recheck=True)[0].sqrt()
        if self._clamped:  # (clip_grad_value_ changed them since the reduction's sums of squares)
            norm = self._param_grad_norms(2.0).square().sum().sqrt()
        elif self._scale is not None:
            norm = norm / self._scale
        # what torch code and opt.clip_grad_norm_ multiplied param.grad by since (until session 26 left out: after
        # GradScaler.unscale_ this was the scaled gradients' norm, after a clip the unclipped one)
        multiplier = self._common_multiplier()
        if multiplier is not None:
            norm = norm * (multiplier.abs() if torch.is_tensor(multiplier) else abs(multiplier))
        return norm * self._clip_coef if self._clip_coef is not None else norm

    @property
    def loss_scale(self) -> Optional[torch.Tensor]:
        """The current loss scale (a 0-d device tensor), or None without loss scaling."""
        return self._scale

    def _check_no_own_loss_scale(self, by: str) -> None:
        if self._scale is not None:
            raise RuntimeError(
                f"{by} on a {type(self).__name__} that scales the loss itself (loss_scale="
                f"{self.loss_scale_config}; on by default with param_dtype=torch.float16): the gradients would be "
                "unscaled twice. Either drop torch's GradScaler and backward opt.scale_loss(loss) (clipping and "
                "the skip on inf/NaN work the same; opt.clip_grad_norm_ and torch's clip_grad_norm_ see unscaled "
                "norms), or build the optimizer with loss_scale=False to let GradScaler do it")

    def _amp_unscale(self, params: list, found_inf: torch.Tensor, inv_scale: torch.Tensor,
                     placeholders: Optional[list] = None) -> None:
        """``torch._amp_foreach_non_finite_check_and_unscale_`` (GradScaler's inf check and ``unscale_``) on the
        placeholders of ``params``: reduce the gradients (once per step), OR the global non-finite flag into the
        scaler's ``found_inf``, and fold ``inv_scale`` into the update like any multiplier of ``param.grad`` (so
        torch's ``clip_grad_norm_`` after ``unscale_`` sees unscaled norms). All on the device."""
        self._check_no_own_loss_scale("torch.amp.GradScaler")
        _, ours = self._reduce_grads(recheck=True)
        found_inf.copy_(torch.maximum(found_inf, ours.to(found_inf.dtype)))
        # _fold_grad_multiplier's work, once for the list (it was ~1 us per parameter per step, each call
        # re-entering the cached reduction and clearing the norm cache). Gradients set by hand (plain tensors in
        # GradScaler's list) were flushed by the reduction: they are unscaled with the others here, by the update
        # (model_sync._amp_unscale calls this before torch's op unscales the plain tensors, no longer in param.grad)
        self._fold_grad_multipliers(params, inv_scale, placeholders, every_placed=True)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * loss_scale`` (``loss`` itself without loss scaling): call ``.backward()`` on this."""
        return loss * self._scale if self._scale is not None else loss
