"""``StateDictMixin``: ShardedOptimizer's ``state_dict()`` / ``load_state_dict()`` in torch.optim's format.

World-size and bucket-size independent: every bucket's shards are all-gathered into full per-parameter tensors
(``master`` and the state names of the parameter's group), and a load cuts them back into this rank's pieces.
Sharded checkpoints, which write each rank's pieces only, are :mod:`tritonshard.checkpoint`.
"""

from __future__ import annotations

import copy
import math
import numbers

import torch

from .. import comm
from ._hparams import FP32_MAX
from .bucket import UNHELD_PRECISE, _Bucket
from .model_view import _names, _setting

__all__ = ["StateDictMixin"]

#: the key under which the first saved param group holds the optimizer-wide values too (``state_dict()
#: ["tritonshard"]``, as numbers: ``skipped_steps``, the loss scaler's ``loss_scale``, ``growth_tracker`` and
#: ``overflows_at_min_scale``, stochastic rounding's ``sr_steps``): torch.distributed.checkpoint's ``get_state_dict``
#: (torchtitan's and Lightning's ModelParallelStrategy's checkpoints) keeps only "state" and "param_groups" of an
#: optimizer's state dict, so until session 53 a resume through it restarted the loss scale at its initial value
#: (overflows, skipped steps), the skipped-step count at 0 and stochastic rounding at another random stream (a
#: resume not bit for bit), silently. A load takes the top-level dict where there is one; never a hyper-parameter
#: (torch.optim, given such a group, keeps the key unused).
CARRIED = "tritonshard"


class StateDictMixin:
    """Methods of :class:`~tritonshard.optim.base.ShardedOptimizer` that (de)serialize its state."""

    #: state that torch.optim makes at a parameter's first counted step, where "missing" and "zeros" differ:
    #: ShardedSGD's ``momentum_buffer`` (torch's first step with momentum sets it to the gradient, any later one
    #: to momentum * buffer + (1 - dampening) * gradient). Laid out here from construction, it is left out of
    #: state_dict() for a parameter whose count is 0, as torch.optim would have none yet, and a dict without it
    #: loads as such a count (torch.optim.SGD given a zero buffer would take it as made)
    _MADE_BY_FIRST_STEP: tuple = ()
    #: the hyper-parameters every group of this optimizer has, as the torch.optim optimizer it follows (whose step
    #: fails on a group without one): a loaded group without one is another optimizer's (:meth:`_load_state_dict`)
    _CORE_GROUP_KEYS: tuple = ()
    # hyper-parameters of other kinds that this kind's groups never have, where the core keys cannot tell the kinds
    # apart (ShardedLion's are a subset of AdamW's: an Adam-family dict holds them all, and eps)
    _OTHER_KINDS_GROUP_KEYS: tuple = ()

    def _core_group_keys(self, saved_group: dict, group: dict) -> tuple:
        """:attr:`_CORE_GROUP_KEYS` of a loaded group ``saved_group`` over this optimizer's ``group``."""
        return self._CORE_GROUP_KEYS

    def _check_same_kind(self, saved_groups: list, saved_state: dict) -> None:
        """A state dict of another kind of optimizer (an AdamW's loaded into a ShardedSGD, after a change of
        ``--optimizer`` in a resumed run) is a ValueError naming what does not fit, before anything is loaded. Until
        session 51 it loaded silently: the saved groups' hyper-parameters replaced this optimizer's (an SGD trained
        with AdamW's lr and its decay), and a state tensor both kinds name (AdamW's ``exp_avg`` in ShardedLion) was
        taken. torch.optim fails at the next step on such a group (KeyError 'momentum'); a state tensor this
        optimizer does not keep, which torch.optim would carry along unused, is refused here too, as a sign of the
        same mistake, and so is a group key that marks another kind (:attr:`_OTHER_KINDS_GROUP_KEYS`: a torch AdamW
        dict saved before any step, into ShardedLion, loaded AdamW's lr until session 52). Groups may hold keys of
        their own (a scheduler's ``initial_lr``, the user's)."""
        kind = type(self).__name__
        for gi, (sg, g) in enumerate(zip(saved_groups, self.param_groups)):
            core = self._core_group_keys(sg, g)
            missing = [k for k in core if k not in sg]
            if missing:
                raise ValueError(
                    f"param_groups[{gi}] of the state dict has no {', '.join(map(repr, missing))}, which every "
                    f"{kind} group has ({', '.join(core)}): the state dict of another kind of optimizer? Loaded, its "
                    "hyper-parameters would replace this optimizer's (torch.optim fails at the next step on such a "
                    "group)")
            # (unless this optimizer's group holds it too: a key of the user's own)
            other = [k for k in self._OTHER_KINDS_GROUP_KEYS if k in sg and k not in g]
            if other:
                raise ValueError(
                    f"param_groups[{gi}] of the state dict has {', '.join(map(repr, other))}, which no {kind} group "
                    "has: the state dict of another kind of optimizer? Loaded, its hyper-parameters would replace "
                    "this optimizer's")
        keeps = tuple(dict.fromkeys((*self._state_names, *self._MADE_BY_FIRST_STEP)))
        for key, entry in saved_state.items():
            foreign = sorted(str(k) for k, v in (entry.items() if isinstance(entry, dict) else ())
                             if k not in keeps and k not in ("step", "master") and isinstance(v, torch.Tensor))
            if foreign:
                raise ValueError(
                    f"state of parameter {key} in the state dict has {', '.join(map(repr, foreign))}, which {kind} "
                    f"does not keep (its state: {', '.join(keeps) or 'none'}, step, master): the state dict of "
                    "another kind of optimizer?")

    def _indexed_params(self) -> list[tuple[int, int, torch.Tensor]]:
        """(global index, group index, param) in torch.optim's numbering: param_groups order, frozen included."""
        out, i = [], 0
        for gi, g in enumerate(self.param_groups):
            for p in g["params"]:
                out.append((i, gi, p))
                i += 1
        return out

    def _gather_full(self, bucket: _Bucket, shard: torch.Tensor) -> torch.Tensor:
        full = torch.empty(bucket.param_buffer.padded_numel, dtype=shard.dtype, device=shard.device)
        if comm.is_initialized() and self.world_size > 1:
            comm.all_gather_single(full, shard, group=self.process_group)
        else:
            full.copy_(shard)
        return full

    def state_dict(self) -> dict:
        """The full optimizer state in torch.optim's format, identical on every rank and for any world size or
        bucket size.

        Per trainable parameter (torch.optim numbering): ``step`` (0-d fp32), the state tensors (for AdamW
        ``exp_avg``, ``exp_avg_sq``) and ``master``, the fp32 master weights, all of the parameter's shape.
        Cost: every bucket's fp32 shards are all-gathered, so every rank holds 4 B x (1 + number of state
        tensors) per parameter while the dict lives (12 B/param for AdamW). For models where that does not fit,
        use :func:`tritonshard.checkpoint.save_sharded`, which writes each rank's slices only.
        """
        try:
            for pre_hook in self._optimizer_state_dict_pre_hooks.values():  # torch.optim's hooks, as it runs them
                pre_hook(self)
        except Exception as exc:
            if not self._prepared_fits():  # (the others wait in the gather's handshake: tell them)
                self._entry.tell("state_dict", exc)
            raise
        prepared = self._prepared_state if self._prepared_fits() else None  # (prepare_state_dict() on every rank)
        self._prepared_state = None
        state_dict = self._with_groups(prepared[1] if prepared is not None else self._gather_state())
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            result = post_hook(self, state_dict)
            if result is not None:
                state_dict = result
        return state_dict

    def _with_groups(self, gathered: dict) -> dict:
        """torch.optim's ``param_groups`` (hyper-parameters as they are now, e.g. after a scheduler) around the
        gathered ``state``."""
        groups, indexed = [], self._indexed_params()
        for gi, g in enumerate(self.param_groups):
            ids = [i for i, gj, _ in indexed if gj == gi]
            groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": ids})
        extras = gathered["tritonshard"]
        groups[0][CARRIED] = {k: v.item() if isinstance(v, torch.Tensor) else v for k, v in extras.items()}
        return {"state": gathered["state"], "param_groups": groups, "tritonshard": extras}

    def _gather_state(self) -> dict:
        self._entry("state_dict")
        self.sync_from_model()
        self.wait_for_params()
        full: dict[torch.Tensor, dict] = {}
        counts = self._counts_now() if self._MADE_BY_FIRST_STEP else {}
        for b in self.buckets:
            gathered = {name: self._gather_full(b, t) for name, t in (("master", b.saved_master()), *b.state.items())}
            keeps_step = self._group_keeps_step(self.param_groups[b.group_index])
            for p, off, n in zip(b.params, b.param_buffer.offsets, b.param_buffer.numels):
                entry = {"step": self._param_step(p).detach().clone()} if keeps_step else {}
                for name in (*b.state, "master"):
                    entry[name] = gathered[name][off:off + n].view(p.shape).float()  # torch.optim's fp32 state
                if counts and counts[p] == 0:
                    for name in self._MADE_BY_FIRST_STEP:
                        entry.pop(name, None)
                full[p] = entry
        state = {i: full[p] for i, _, p in self._indexed_params() if p in full}
        return {"state": state,
                "tritonshard": {"format": 1, "skipped_steps": self.skipped_steps.detach().clone(),
                                **self._scaler_state(), **self._rounding_state()}}

    def prepare_state_dict(self, keep: bool = True) -> None:
        """Gather :meth:`state_dict` now, on every rank (a collective), so that one later call of ``state_dict()``
        on any single rank returns it without communicating, as long as nothing changed in between (no
        ``step()``, no load, no write to the parameters; otherwise that call is a collective again, and alone on
        one rank it raises :class:`~tritonshard.comm.CollectiveMismatchError` once the others reach their next
        tritonshard call).

        For frameworks that save the optimizer from the main process only, as the Hugging Face Trainer does
        (``tritonshard.integrations.hf.ShardedOptimizerCallback`` calls this on every rank before each save).
        ``keep=False`` takes part in the gather and drops the result (a rank that will not save). Memory: the
        full state (12 B/param for AdamW) is held until that call or the next ``step()``.
        """
        self._prepared_state = None
        gathered = self._gather_state()
        if keep:
            self._prepared_state = (self._param_version_key(), gathered)

    def consolidate_state_dict(self, to: int = 0) -> None:
        """``torch.distributed.optim.ZeroRedundancyOptimizer``'s way to save a sharded optimizer, for loops written
        for it: every rank calls this (a collective), then the process of global rank ``to`` calls
        ``state_dict()`` alone (``if rank == 0: torch.save(opt.state_dict(), path)``). It is
        :meth:`prepare_state_dict` with ``keep`` on rank ``to`` only. Unlike ZeroRedundancyOptimizer, a
        ``state_dict()`` on the other ranks is not an error: called on all of them, it is the usual collective."""
        if not isinstance(to, int) or isinstance(to, bool) or not 0 <= to < comm.group_size():
            raise ValueError(f"consolidate_state_dict(to={to!r}): to is the global rank of the process that will "
                             f"call state_dict(), an int in [0, {comm.group_size()})")
        self.prepare_state_dict(keep=comm.group_rank() == to)

    def _prepared_fits(self) -> bool:
        """Whether :meth:`prepare_state_dict` left a state that still holds (no step, load or weight write since):
        ``state_dict()`` then returns it without communicating."""
        prepared = self._prepared_state
        return prepared is not None and prepared[0] == self._param_version_key()

    def _param_version_key(self) -> tuple:
        """What tells that the weights are as they were (step() and loads drop the prepared state themselves)."""
        return tuple(p._version for p in self._param_list), tuple(p.data_ptr() for p in self._param_list)

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a dict from :meth:`state_dict` (any world size or bucket size) or from a plain
        ``torch.optim.AdamW`` (then the master weights stay what this optimizer took from the model's weights at
        construction, or the fp32 weights loaded into the model since, unrounded, see
        :meth:`~tritonshard.optim.bucket.WatchedParameter.copy_`; parameters that have no state there start from
        zero moments).

        The bf16 parameters are re-derived from the loaded master weights (round to nearest even), exactly as
        every step writes them, so a resumed run continues bit for bit.

        As in torch.optim, the hooks of ``register_load_state_dict_pre_hook`` see (and may replace) a shallow copy
        of ``state_dict`` first, those of ``register_load_state_dict_post_hook`` run after the load, and every
        hyper-parameter of the saved groups (a scheduler's ``initial_lr``, ``max_lr``..., keys of the user's own)
        replaces the group's, but for torch.optim's implementation switches (``foreach``, ``fused``...), which this
        optimizer does not have.

        Raises:
            ValueError: naming the mismatch (number of groups or parameters, a shape, a state dict of another
                kind of optimizer: a group without a hyper-parameter every group here has, a state tensor this
                optimizer does not keep (:meth:`_check_same_kind`), a state entry for an
                unknown parameter, or for one frozen at construction while a backward's gradients wait for their
                step: outside that, such a parameter is laid out to take its state, ``_lay_out_frozen_with_state``;
                a state entry that is not a dict of tensors, an AdamW's without its ``step``); a saved group's
                hyper-parameters that this optimizer would refuse at construction (a negative lr, amsgrad=True,
                a momentum where this ShardedSGD holds no buffers), checked as there, before anything is loaded.
            tritonshard.comm.SettingsMismatchError: (a ValueError) on every rank, naming each rank's, when the ranks
                were given different dicts (see :func:`_fingerprint`); nothing is loaded.
        """
        if isinstance(state_dict, dict):
            state_dict = state_dict.copy()  # as torch.optim: the hooks may change the copy, never the caller's dict
            try:
                for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
                    result = pre_hook(self, state_dict)
                    if result is not None:
                        state_dict = result
            except Exception as exc:  # (on this rank only, maybe: the others wait in the load's handshake)
                self._entry.tell("load_state_dict", exc)
                raise
        self._load_state_dict(state_dict)
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def _load_state_dict(self, state_dict) -> None:
        self._entry("load_state_dict", settings=lambda: _fingerprint(state_dict))
        self._prepared_state = None
        self.sync_from_model()
        self.wait_for_params()
        if not isinstance(state_dict, dict) or "state" not in state_dict or "param_groups" not in state_dict:
            raise ValueError("state_dict must be a dict with 'state' and 'param_groups' (torch.optim format)")
        saved_groups, saved_state = state_dict["param_groups"], state_dict["state"]
        # (the structure, before anything reads it: an AttributeError or a KeyError deep in the load until session 52)
        if not isinstance(saved_state, dict):
            raise ValueError(f"state_dict['state'] must be a dict of parameter index -> that parameter's state, got "
                             f"a {type(saved_state).__name__}")
        bad = next((gi for gi, sg in enumerate(saved_groups) if not isinstance(sg, dict)
                    or not isinstance(sg.get("params"), (list, tuple))), None) \
            if isinstance(saved_groups, (list, tuple)) else -1
        if bad is not None:
            what = (f"param_groups[{bad}] is {saved_groups[bad]!r:.80}" if bad >= 0
                    else f"it is a {type(saved_groups).__name__}")
            raise ValueError("state_dict['param_groups'] must be a list of dicts, each with 'params' (the indices of "
                             f"its parameters) and its hyper-parameters: {what}")
        # an empty entry is no state: torch.optim's state is a defaultdict, so a read of opt.state[p] (a logger's,
        # before p's first step) leaves one in its dict, and torch.optim starts p afresh at its step. Until session
        # 52 such a dict of torch.optim.AdamW's was refused here ("has no 'exp_avg'"). Nor is a buffer a first step
        # makes that is None (torch.optim.SGD before 2.0 kept momentum_buffer=None for a step without momentum,
        # which torch.optim.SGD takes as no buffer yet; an AttributeError here until session 52)
        # torch.distributed.checkpoint's set_state_dict with flatten_optimizer_state_dict=True (torchtitan's way)
        # rebuilds each entry from the keys opt.state[p] shows, and a key the checkpoint does not hold comes back as
        # an empty dict ("shard_range"; "step" where the state dict keeps none, as torch.optim.Muon's): no state.
        # Until session 53 such a "step" was refused ("must be a step count"): a ShardedMuon could not resume that way
        made = self._MADE_BY_FIRST_STEP
        rebuilt = any(isinstance(t, dict) and not t for v in saved_state.values() if isinstance(v, dict)
                      for t in v.values())
        saved_state = {k: {n: t for n, t in v.items() if not ((t is None and n in made) or (isinstance(t, dict)
                                                                                          and not t))}
                       if isinstance(v, dict) and (made or rebuilt) else v for k, v in saved_state.items()}
        extra = _checked_extras(state_dict, saved_groups)
        saved_state = {k: v for k, v in saved_state.items() if not (isinstance(v, dict) and not v)}
        if rebuilt:  # what opt.state[p] does not show, DCP's rebuilt dict does not hold
            lost = []
            if self.store_param_remainders and any("master" not in v for v in saved_state.values()
                                                   if isinstance(v, dict)):
                lost.append("the fp32 master weights (with store_param_remainders=True there is no fp32 master to "
                            "show in opt.state[p]: it is the bf16 weight plus an int16 remainder)")
            if self._scale is not None and "loss_scale" not in extra:
                lost.append("the loss scaler's scale and growth count (fp16 weights)")
            if lost:
                raise ValueError(
                    "this state dict was rebuilt by torch.distributed.checkpoint's set_state_dict with "
                    "flatten_optimizer_state_dict=True, which keeps of each parameter's state only the keys "
                    f"opt.state[p] shows, and it lost {' and '.join(lost)}; loaded, the run would go on from other "
                    "values than it saved. Save and load with flatten_optimizer_state_dict=False (the optimizer's own "
                    "state dict, which holds them), or with tritonshard.checkpoint.save_sharded / load_sharded")
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(f"the state dict has {len(saved_groups)} param groups, the optimizer "
                             f"{len(self.param_groups)}")
        self._check_same_kind(saved_groups, saved_state)  # (first: the checks below name ShardedAdamW's keys)
        for gi, (sg, g) in enumerate(zip(saved_groups, self.param_groups)):
            if len(sg["params"]) != len(g["params"]):
                raise ValueError(f"param_groups[{gi}] has {len(sg['params'])} parameters in the state dict but "
                                 f"{len(g['params'])} in the optimizer")
            # the hyper-parameters the load gives the group, checked as at construction and at step(), with the
            # saved implementation switches (torch.optim.AdamW's amsgrad, torch.optim.Adam's coupled decay), which it
            # does not keep: until session 52 a value the group cannot take (a momentum where this ShardedSGD holds
            # no buffers, a negative lr) loaded, and every later step() refused it
            self._check_group({**g, **{k: v for k, v in sg.items() if k != "params"}},
                              f" (param_groups[{gi}] of the state dict)")
        indexed = self._indexed_params()
        saved_ids = [i for sg in saved_groups for i in sg["params"]]
        id_map = dict(zip(saved_ids, (i for i, _, _ in indexed)))  # saved index -> our index
        by_index = {i: p for i, _, p in indexed}
        self._lay_out_frozen_with_state([by_index[id_map[k]] for k in saved_state if k in id_map])
        entries: dict[torch.Tensor, dict] = {}
        saved_counts: dict[torch.Tensor, float] = {}  # (each saved step read on the host once: checked, then loaded)
        group_of = {i: gi for i, gi, _ in indexed}
        for key, entry in saved_state.items():
            if key not in id_map:
                hint = (" (its keys are strings, the param groups' indices are ints: a round trip through JSON? "
                        "torch.optim numbers the parameters with ints)"
                        if isinstance(key, str) and key.isdigit() and int(key) in id_map else "")
                raise ValueError(f"the state dict has state for parameter {key!r}, which is in no param group{hint}")
            p = by_index[id_map[key]]
            if not isinstance(entry, dict):
                raise ValueError(f"the state of parameter {key!r} is a {type(entry).__name__}, not a dict")
            # (torch.optim.SGD keeps no step, nor does a Lion; an AdamW's update reads it: one missing used to load
            # as a count of 1, bias corrections and all, where torch.optim fails at the next step with a KeyError)
            if ("step" not in entry and not self._MADE_BY_FIRST_STEP
                    and self._reads_step(self.param_groups[group_of[id_map[key]]])):
                raise ValueError(f"state of parameter {key!r} has no 'step', which {type(self).__name__}'s update "
                                 "reads (its bias corrections)")
            if "step" in entry:  # (a corrupt count trained on silently: a NaN bias correction, NaN weights)
                step = entry["step"]
                value = _real(step)
                value = None if value is None else float(value)
                if value is None or not 0 <= value < math.inf:
                    raise ValueError(f"state 'step' of parameter {key!r} must be a step count >= 0 (a number or a "
                                     f"1-element tensor), got {step!r:.80}")
                saved_counts[p] = value
            for name in (*self._bucket_of[p][0].state, "master"):
                if (name == "master" or name in self._MADE_BY_FIRST_STEP) and name not in entry:
                    continue
                if name not in entry:
                    raise ValueError(f"state of parameter {key!r} has no '{name}'")
                if not isinstance(entry[name], torch.Tensor):
                    raise ValueError(f"state '{name}' of parameter {key!r} is a {type(entry[name]).__name__}, not a "
                                     f"tensor of the parameter's shape {tuple(p.shape)}")
                if tuple(entry[name].shape) != tuple(p.shape):
                    raise ValueError(f"state '{name}' of parameter {key} has shape {tuple(entry[name].shape)} but "
                                     f"the parameter has shape {tuple(p.shape)}")
            entries[p] = entry
        with torch.no_grad():
            # a step count per parameter (param_steps.py): torch.optim.SGD keeps no step, so a saved momentum
            # buffer means at least one step was taken; a parameter without state never took one (torch.optim
            # makes its state at its first step), nor one without the state its first step makes
            def count(p) -> float:
                entry = entries.get(p)
                if entry is None or any(name not in entry for name in self._MADE_BY_FIRST_STEP
                                        if name in self._bucket_of[p][0].state):
                    return 0.0
                return saved_counts.get(p, 1.0)
            steps = {p: count(p) for p in self._bucket_of}
            for b in self.buckets:
                master = b.master_fp32().clone()
                for piece in b.param_buffer.shard_pieces():
                    entry = entries.get(b.params[piece.tensor_index])
                    dst = slice(piece.shard_start, piece.shard_end)
                    for name, shard in (("master", master), *b.state.items()):
                        if entry is not None and name in entry:
                            src = entry[name].reshape(-1)[piece.tensor_start:piece.tensor_end]
                            shard[dst].copy_(src)
                        elif name != "master":
                            shard[dst].zero_()
                b.set_master(master)
            self._load_steps(steps)
            self._apply_hparams(saved_groups)
            self.skipped_steps.fill_(int(extra.get("skipped_steps", 0)))
            self._load_scaler_state(extra)
            self._load_rounding_state(extra)
            self._refresh_params_from_master()
            self._forget_unheld_values()
        self._expose_state()

    def _forget_unheld_values(self) -> None:
        """After a load: the fp32 values kept for the parameters this optimizer still holds frozen (an fp32 write or
        in-place calls while frozen, ``UNHELD_PRECISE``) are in no checkpoint (the dict holds state only for laid-out
        parameters, as torch.optim's holds none for a frozen one), so they go: such a parameter's master is its bf16
        weight when it is laid out, in this process as in a fresh one resuming from the same files. Until session 47
        they stayed, so a rollback kept the in-place calls made after the save (found by
        tests.optim.loop_fuzz_long's rollback)."""
        if UNHELD_PRECISE:
            for p in self._frozen_at_build:
                UNHELD_PRECISE.pop(p, None)

    def _lay_out_frozen_with_state(self, params: list) -> None:
        """Parameters frozen when this optimizer was built that the loaded dict has state for (a run that froze
        them after building it, resumed by a script that freezes them before building: torch.optim keeps their
        state, and uses it once they train again, or at a step that finds a gradient in them): laid out now, as
        parameters unfrozen later are (``_adopt_unfrozen``: new buckets of their groups, a counter of their own),
        so the load can put their state in; frozen still, a step skips them while they hold no gradient. Not
        between a backward and its step() (this step's reduction would miss them): a ValueError then."""
        frozen = [p for p in params if p not in self._bucket_of]
        if not frozen:
            return
        names = _names([self._param_names[p] for p in frozen])
        if self._mid_step():
            raise ValueError(f"the state dict has state for {names}, which were frozen (requires_grad=False) when "
                             "this optimizer was built, and this is between a backward and its step(): load it "
                             "after step() or zero_grad(), or build the optimizer with them trainable")
        self._lay_out_frozen(frozen, f"the state dict being loaded has state for it ({names})")

    def _rounding_state(self) -> dict:
        """Stochastic rounding's position: every bucket's Philox key advances by one per step() from its own base
        (see ShardedOptimizer._make_bucket), so one count restores them all and a resume draws the same random bits
        as the uninterrupted run (at the same world and bucket size; a reshard changes the keys, not the
        distribution). One host read, at save time."""
        for b in self.buckets:
            if b.sr_seed is not None:
                return {"sr_steps": int(b.sr_seed.reshape(-1)[0]) - b.sr_base}
        return {}

    def _load_rounding_state(self, extra: dict) -> None:
        if "sr_steps" in extra:
            for b in self.buckets:
                if b.sr_seed is not None:
                    b.sr_seed.fill_(b.sr_base + int(extra["sr_steps"]))

    def _scaler_state(self) -> dict:
        if self._scale is None:
            return {}
        return {"loss_scale": self._scale.detach().clone(), "growth_tracker": self._growth_tracker.detach().clone(),
                "overflows_at_min_scale": self._overflows_at_min.detach().clone()}

    def _load_scaler_state(self, extra: dict) -> None:
        if self._scale is not None and "loss_scale" in extra:
            self._scale.fill_(float(extra["loss_scale"]))
            self._growth_tracker.fill_(int(extra["growth_tracker"]))
            self._overflows_at_min.fill_(int(extra.get("overflows_at_min_scale", 0)))

    #: torch.optim's implementation switches, in the groups of its state dicts: not hyper-parameters of this
    #: optimizer, so a torch.optim dict's values are not copied into its groups
    _TORCH_ONLY_KEYS = frozenset({"foreach", "fused", "capturable", "differentiable", "amsgrad",
                                  "decoupled_weight_decay", CARRIED})

    def _apply_hparams(self, saved_groups) -> None:
        """Every saved key of each group replaces the group's, as torch.optim's ``load_state_dict`` does (the
        hyper-parameters, what LR schedulers keep there: ``initial_lr``, OneCycleLR's ``max_lr``..., keys of the
        user's own), but ``params`` and :attr:`_TORCH_ONLY_KEYS`."""
        for sg, g in zip(saved_groups, self.param_groups):
            for k, v in sg.items():
                if k != "params" and k not in self._TORCH_ONLY_KEYS:
                    v = copy.deepcopy(v)  # as torch.optim: an lr tensor a scheduler fills must not be the dict's
                    g[k] = tuple(v) if k == "betas" and isinstance(v, list) else v

    def _refresh_params_from_master(self) -> None:
        """All-gather the param shards, which set_master() rounded from the master (what every step ends with)."""
        for b in self.buckets:
            b.param_buffer.all_gather()


#: the optimizer-wide values a load reads (state_dict()["tritonshard"]), each a count but the loss scale
_EXTRA_COUNTS = ("skipped_steps", "growth_tracker", "overflows_at_min_scale", "sr_steps")


def _real(v):
    """``v``'s value where it is a number (not a bool) or a 1-element tensor, else None: how a saved count or scale
    may come."""
    if isinstance(v, torch.Tensor):
        return v.item() if v.numel() == 1 else None
    return v if isinstance(v, numbers.Real) and not isinstance(v, bool) else None


def _checked_extras(state_dict: dict, saved_groups: list) -> dict:
    """The optimizer-wide values of ``state_dict``: its ``tritonshard`` dict, else the first group's copy
    (:data:`CARRIED`), else none (a torch.optim dict), checked before anything is loaded: a value that is not a
    count (or a loss scale) raised from the middle of the load until session 53, the state already replaced."""
    where = "state_dict['tritonshard']"
    extra = state_dict.get("tritonshard")
    if extra is None and saved_groups:
        extra, where = saved_groups[0].get(CARRIED), f"state_dict['param_groups'][0][{CARRIED!r}]"
    if extra is None:
        return {}
    if not isinstance(extra, dict):
        raise ValueError(f"{where} must be a dict of the optimizer-wide values (skipped_steps, loss_scale...), got "
                         f"a {type(extra).__name__}")
    for key in (*_EXTRA_COUNTS, "loss_scale"):
        if key not in extra:
            continue
        v = extra[key]
        value = _real(v)
        if key == "loss_scale":
            if value is None or not 0 < value <= FP32_MAX:  # (the scale is an fp32 tensor)
                raise ValueError(f"{where}['loss_scale'] must be a number > 0 that fp32 holds, got {v!r:.80}")
            if "growth_tracker" not in extra:
                raise ValueError(f"{where} has a loss_scale but no growth_tracker")
        elif value is None or not 0 <= value < 2 ** 63 or value != int(value):  # (an int64 tensor)
            raise ValueError(f"{where}[{key!r}] must be a count (an integer >= 0), got {v!r:.80}")
    return extra


_SAMPLES = 8  # values per state tensor in a state dict's fingerprint


def _fingerprint(state_dict) -> tuple[int, str]:
    """(digest, description) of a state dict that the ranks load, compared by ``load_state_dict``'s handshake:
    every rank cuts its own shard out of its own dict, so ranks given different dicts (one read an older file)
    would stitch the model together from several checkpoints, silently. The digest covers the layout (keys, state
    names, shapes), every number, and up to :data:`_SAMPLES` evenly spaced values of every tensor (step counts
    whole): another step or another run differs there. One host read per device for the whole dict; dtypes and
    devices are not compared (the same file loaded to each rank's GPU is the same dict). A dict that cannot be read
    this way gets a digest of its own; the checks after the handshake then name what is wrong with it."""
    try:
        layout, samples, steps = [], {}, []  # samples: device -> [(position in the dict's order, values)]
        position = 0

        def visit(label, value):
            nonlocal position
            if isinstance(value, torch.Tensor):
                flat = value.detach().reshape(-1)
                samples.setdefault(value.device, []).append((position, flat[::max(1, flat.numel() // _SAMPLES)]
                                                             [:_SAMPLES].to(torch.float64)))
                layout.append(f"{label}:{tuple(value.shape)}")
                position += 1
            elif isinstance(value, (bool, int, float, str, type(None))):
                layout.append(f"{label}={_setting(value)}")
            else:  # (an object of the user's: its repr may hold an address, which differs between processes)
                layout.append(f"{label}:{type(value).__qualname__}")

        state = state_dict["state"]
        for key in sorted(state, key=repr):
            for name in sorted(state[key], key=repr):
                if name == "step" and isinstance(state[key][name], torch.Tensor):
                    steps.append(position)
                visit(f"{key!r}.{name}", state[key][name])
        for name, value in sorted(state_dict.get("tritonshard", {}).items()):
            visit(f"tritonshard.{name}", value)
        values = [None] * position
        for group in samples.values():
            host = torch.cat([v for _, v in group]).cpu().split([v.numel() for _, v in group])
            for (i, _), v in zip(group, host):
                values[i] = v
        flat = torch.cat(values) if values else torch.zeros(0, dtype=torch.float64)
        digest = comm.digest("\n".join(layout).encode() + flat.numpy().tobytes())
        counts = sorted({float(values[i][0]) for i in steps if values[i].numel()})
        at = (f"step {counts[0]:g}" if len(counts) == 1 else f"steps {counts[0]:g}-{counts[-1]:g}" if counts
              else "no step counts")
        return digest, f"state of {len(state)} parameters at {at}, fingerprint {digest & (2**48 - 1):012x}"
    except Exception as exc:  # noqa: BLE001 (every rank then raises the load's own error)
        return comm.digest(b"unreadable"), f"a state dict that cannot be read ({type(exc).__name__})"
