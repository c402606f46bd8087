"""``ParamStepsMixin``: a step count per parameter, as torch.optim keeps one (``state[p]["step"]``).

Every parameter shares its bucket's counter (``b.step``, one device scalar, one increment per step), which all
buckets of a param group share (but parameters unfrozen after construction, laid out in buckets of their own with a
counter of their own from 0: ``_adopt_unfrozen``; and buckets whose parameters a checkpoint gives another count:
``_split_counters``; ``_step_units`` lists the buckets of each counter), until step()
skips it: frozen (``requires_grad=False`` after construction) or without a gradient on every rank. torch.optim
does not count a step it skipped, so from then on the parameter counts on a counter of its own, a copy of its
bucket's taken before the step's increment. The flat update still runs over the whole bucket with the bucket's
count (it has no per-element step); the pieces of a parameter whose own count differs are saved before it, put
back after it, and updated again by a launch of their own with their own count (the update's arithmetic, with the
coefficients of that count). Only update rules that read the count redo pieces (AdamW's bias corrections, SGD's
first-step momentum); the others only keep the count, for the state they save.

What that costs, only where a parameter has been skipped while others of its counter stepped (a task head not
used, a branch not taken, a parameter frozen and unfrozen after the optimizer's first steps): per step and such
parameter that trains, an increment, a copy of its pieces and one more update launch over them; a step with one
runs eagerly under ``cuda_graph=True``. A step that skips every parameter of a counter (``step()`` without a
backward, every parameter unfrozen together frozen again) leaves the counter as it is, launches no update for its
buckets and costs nothing after it. A step compiled by torch.compile finds no skipped parameters (in one process
a step that would skip some runs eagerly; on more ranks it updates them: README), but keeps and advances the counts
of their own that earlier eager steps or a load gave.
"""

from __future__ import annotations

import collections

import torch

__all__ = ["ParamStepsMixin"]


class ParamStepsMixin:
    """Methods of :class:`~tritonshard.optim.base.ShardedOptimizer` that keep the per-parameter step counts."""

    #: parameter -> its own step count (0-d fp32 device tensor), for those whose count left their group's
    _own_steps: dict
    #: the same without the parameters, for step() (see _plan_own_steps)
    _own_plan: list

    def _reads_step(self, group: dict) -> bool:
        """Whether ``group``'s update reads the step count (then a parameter with its own count is updated
        again with it, by :meth:`_update_slice`)."""
        return True

    def _counts_step(self, group: dict) -> bool:
        """Whether a step advances the counts of ``group``'s parameters. torch.optim counts every step it takes
        (AdamW's ``state[p]["step"]``); SGD keeps no count, only whether a parameter has a momentum buffer yet,
        which its first step with momentum makes from the gradient: ShardedSGD counts the steps with momentum
        (then a group whose momentum is turned on after steps without starts its buffers as torch does)."""
        return True

    def _update_slice(self, bucket, group: dict, sl: slice, step: torch.Tensor, seed, grad_scale,
                      found_inf: torch.Tensor) -> None:
        """The update of elements ``sl`` of ``bucket``'s shards with step count ``step`` (the checked kernel
        launcher on slices; ``seed``: the Philox key tensor for stochastically rounded states, or None)."""
        raise NotImplementedError(f"{type(self).__name__} reads the step count in its update but cannot update a "
                                  "slice with another one (_update_slice)")

    def _counting_units(self) -> list:
        """The buckets of each counter of :attr:`_step_units` whose group counts this step (:meth:`_counts_step`)."""
        return [buckets for _, buckets in self._step_units
                if self._counts_step(self._group_of_bucket[buckets[0].index])]

    def _counts_now(self) -> dict:
        """Every bucketed parameter's step count as a number, one host read per counter (most parameters share
        their group's): for the state dict, a sharded save, an edit of ``opt.state``."""
        read: dict = {}
        counts = {}
        for p in self._bucket_of:
            counter = self._param_step(p)
            if id(counter) not in read:
                read[id(counter)] = float(counter)
            counts[p] = read[id(counter)]
        return counts

    def _param_step(self, p: torch.Tensor) -> torch.Tensor:
        """``p``'s step count: its own, or its bucket's."""
        own = self._own_steps.get(p)
        if own is not None:
            return own
        return self._bucket_of[p][0].step

    def _count_steps(self, skipped: list, not_skipped: torch.Tensor) -> tuple[dict, frozenset, list]:
        """Advance the step counts by ``not_skipped`` (1 - found_inf) for this step, where ``skipped`` are the
        parameters the update leaves unchanged. Returns (by bucket index, the pieces to update again with their
        own count after the flat update: ``[(slice, own count, [(shard view, saved copy), ...]), ...]``, saved
        now, before it; the indices of the buckets of the counters none of whose parameters trains this step
        (idle), which are not updated: their count stays, and an update at count 0 would write NaN into the
        padding, 0 / sqrt(1 - beta2^0); the skipped parameters of the other counters, whose pieces the flat update
        reaches and the caller must save and put back).

        Traceable by torch.compile (where step() finds no skipped parameters): what it reads then is the counters
        (through :attr:`_step_units`) and :attr:`_own_plan`, which holds no parameter (dynamo would inspect its
        placeholder grad)."""
        idle, kept = set(), []
        counting = {buckets[0].counter_index for buckets in self._counting_units()}
        if skipped:  # (eager only; the work is per skipped parameter and per bucket, not per parameter)
            by_unit: dict = {}
            for p in skipped:
                by_unit.setdefault(self._bucket_of[p][0].counter_index, []).append(p)
            added = False
            for _, buckets in self._step_units:
                left_out = by_unit.get(buckets[0].counter_index)
                if not left_out:
                    continue
                if len(left_out) == sum(len(b.params) for b in buckets):  # none trains: the counter stays
                    idle.update(b.index for b in buckets)
                    continue
                kept += left_out
                if buckets[0].counter_index not in counting:  # (the others do not count either: no count apart)
                    continue
                for p in left_out:
                    if p not in self._own_steps:
                        self._set_own_step(p, self._bucket_of[p][0].step.clone(), replan=False)
                        added = True
            if added:
                self._plan_own_steps()
        for _, buckets in self._step_units:  # skipped steps do not count
            if buckets[0].index not in idle and buckets[0].counter_index in counting:
                buckets[0].step.add_(not_skipped)
        redo: dict = {}
        if self._own_plan:
            left_ids = {id(p) for p in skipped}
            for param_id, b_index, sl, own in self._own_plan:
                group = self._group_of_bucket[b_index]
                if param_id in left_ids or not self._counts_step(group):
                    continue
                own.add_(not_skipped)
                if sl is not None and self._reads_step(group):  # (read now: the group's settings may change)
                    redo.setdefault(b_index, []).append((sl, own, self._piece_copies(self.buckets[b_index], sl)))
        return redo, frozenset(idle), kept

    def _update_again(self, b, redo: list, grad_scale, found_inf: torch.Tensor) -> None:
        """After bucket ``b``'s flat update: its pieces in ``redo`` (from :meth:`_count_steps`) put back and
        updated with their parameter's own count."""
        group = self._group_of_bucket[b.index]
        for sl, own, saved in redo:
            self._restore_pieces([saved])
            self._update_slice(b, group, sl, own, self._piece_seed(b, sl), grad_scale, found_inf)

    @staticmethod
    def _piece_seed(b, sl: slice):
        """The Philox key of a piece's own update: the bucket's key of this step with the top bit set (no bucket's
        key has it: ranks < 2^15) and the piece's start hashed into bits 32-62, so that its rounding bits are not
        those the flat launch drew for the bucket's first elements."""
        if b.sr_seed is None:
            return None
        mix = ((sl.start * 0x9E3779B1) & 0x7FFF_FFFF) << 32
        return torch.bitwise_xor(b.sr_seed, mix - (1 << 63))

    def _set_own_step(self, p: torch.Tensor, step: torch.Tensor, replan: bool = True) -> None:
        """Give ``p`` its own count ``step``; ``replan=False``: the caller rebuilds :attr:`_own_plan` once after
        setting several."""
        self._own_steps[p] = step
        self._show_step(p, step)  # opt.state[p]["step"] shows the live counter
        if replan:
            self._plan_own_steps()

    def _plan_own_steps(self) -> None:
        """:attr:`_own_plan`, what a step reads of the parameters with their own count: (id of the parameter,
        bucket index, the slice of this rank's piece of it or None, its count), in the order they got their count.
        (Whether the group's update reads the count, or counts the step, is asked at each step: _count_steps.)"""
        self._own_plan = []
        for p, own in self._own_steps.items():
            b = self._bucket_of[p][0]
            pieces = [piece for piece in b.param_buffer.shard_pieces()
                      if b.params[piece.tensor_index] is p and piece.numel]  # (at most one per rank and bucket)
            sl = slice(pieces[0].shard_start, pieces[0].shard_end) if pieces else None
            self._own_plan.append((id(p), b.index, sl, own))

    def _load_steps(self, steps: dict) -> None:
        """Every bucketed parameter's step count from a checkpoint (``steps``: parameter -> number): first the
        counters are split where whole buckets count differently (:meth:`_split_counters`); then per counter
        (:attr:`_step_units`), the most common count of its parameters becomes the counter's (the larger on a
        tie), the others own ones."""
        self._own_steps.clear()
        self._split_counters(steps)
        for _, buckets in self._step_units:
            params = [p for b in buckets for p in b.params]
            counts = collections.Counter(float(steps[p]) for p in params)
            common = max(counts.items(), key=lambda kv: (kv[1], kv[0]))[0]
            buckets[0].step.fill_(common)
            for p in params:
                if float(steps[p]) != common:
                    self._set_own_step(p, torch.full((), float(steps[p]), dtype=torch.float32, device=self.device),
                                       replan=False)
        self._plan_own_steps()
        for p in self._bucket_of:
            self._show_step(p, self._param_step(p))

    def _split_counters(self, steps: dict) -> None:
        """Give the buckets of a counter whose parameters all have one count, other than the count of the bucket
        whose index names the counter (its lead), a counter of their own (one per count): a run that unfroze
        parameters during training, resumed by an optimizer built with them trainable, lays them out in buckets with
        the others, and without this they would count on their own, their pieces updated a second time in every
        step (and those steps never captured under ``cuda_graph=True``) for the rest of the run. Only a bucket that holds
        parameters of several counts keeps counts of its own for some of them. Counters are split, never merged;
        the launch plans that covered a split counter's buckets are dropped (rebuilt at the next step)."""
        split = False
        for _, buckets in self._step_units:
            lead = next(b for b in buckets if b.index == b.counter_index)
            by_count: dict = {}
            for b in buckets:
                counts = {float(steps[p]) for p in b.params}
                key = counts.pop() if len(counts) == 1 else None  # None: a bucket of several counts
                by_count.setdefault(key, []).append(b)
            lead_key = next(k for k, bs in by_count.items() if lead in bs)
            for key, group in by_count.items():
                if key is None or key == lead_key:
                    continue
                split = True
                step = torch.zeros((), dtype=torch.float32, device=self.device)
                index = min(b.index for b in group)  # (not a counter's index: the counters' are their leads')
                for b in group:
                    b.step, b.counter_index = step, index
        if split:
            self._group_step_units()
            if self._graphs is not None:  # (first: a captured graph holds the merged launches' tables)
                self._graphs.forget()
            self._segmented.clear()  # merged launches over a counter's buckets: the split ones no longer go along
            self._step_cache.clear()
