"""``ShardedMuon``: torch.optim.Muon on the hidden matrices and torch.optim.AdamW on the rest, both sharded.

Newton-Schulz needs whole matrices; a ZeRO shard cuts them. The choice here is **whole-matrix ownership by
layout**: a Muon bucket is a :class:`~tritonshard.Buffer` built with ``owners=``, so every matrix lies entirely
inside one rank's shard. The reduce-scatter that every tritonshard optimizer runs then delivers each matrix's whole
summed gradient to its owner, the owner keeps its fp32 master and momentum (the shard *is* those matrices), runs
the momentum pass, Newton-Schulz and the master update, and the usual all-gather sends the bf16 weights back.

Costs, against ShardedAdamW on the same parameters:

* network: nothing more crosses it, beyond the padding that evens out the ranks' shares of a bucket (each rank's
  shard is as long as the largest share). The owners are balanced largest-first (:func:`balance_owners`), and a
  Muon bucket holds ``world_size x bucket_cap_mb`` so that every rank owns several matrices of it: GPT-2 small at
  d = 8 is one bucket with no padding beyond alignment (``ShardedMuon.plan`` reports it for any shapes);
* Newton-Schulz runs once per matrix over all ranks (no redundant FLOPs), balanced: max/mean NS FLOPs per rank is
  1.02 for GPT-2 small at d = 8 (``plan``);
* overlap: a bigger bucket starts its reduce-scatter later in backward. With hybrid sharding the NS of a matrix
  runs once per replica group (the replicas hold the same shard).

The alternative, gather-to-owner and scatter on the standard layout, sends the momentum to the owner and the
orthogonalized update back: two extra bf16 copies per step, plus an all-to-all with uneven splits.
"""

from __future__ import annotations

import math
import numbers
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from ..buffer import DEFAULT_ALIGN
from ..kernels.muon import adjusted_lr_ratio, newton_schulz
from ..layout import Layout, balance_owners, newton_schulz_flops
from ._hparams import FP32_MAX, check_flag, check_lr, check_min, require
from .adamw import ShardedAdamW, adamw_update, adamw_update_slice, check_adamw_group
from ._compiled import kernels
from .base import ShardedOptimizer, group_param_list, param_list, param_name
from .bucket import _Bucket, split_into_buckets

__all__ = ["ShardedMuon"]

#: torch.optim.AdamW's defaults: what a ``use_muon=False`` group gets for a key it does not set
ADAMW_DEFAULTS = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 1e-2}
MUON_STATE = ("momentum_buffer",)
ADAMW_STATE = ("exp_avg", "exp_avg_sq")


def _muon_owners(params: list, world_size: int, ns_steps: int, loads: list) -> list[int]:
    """The owner of each matrix of one Muon bucket: elements balanced in the bucket, Newton-Schulz FLOPs over
    all buckets (``loads``, per rank, updated). The optimizer and :meth:`ShardedMuon.plan` both lay out this way."""
    return balance_owners([p.numel() for p in params], [newton_schulz_flops(p.shape, ns_steps) for p in params],
                          world_size, loads)


def _with_adamw_defaults(group: dict) -> dict:
    """A copy of ``group``; an AdamW group (``use_muon=False``) gets torch.optim.AdamW's defaults for the keys it does
    not set, before the Muon defaults fill the gaps."""
    group = dict(group)
    if not group.get("use_muon", True):
        for k, v in ADAMW_DEFAULTS.items():
            group.setdefault(k, v)
    return group


def _check_matrices(group: dict, gi: int) -> None:
    """A Muon group holds matrices only (its ``params`` a list)."""
    if group.get("use_muon", True):
        for j, p in enumerate(group["params"]):
            if isinstance(p, torch.Tensor) and p.ndim != 2:
                raise ValueError(
                    f"Muon only supports 2-D parameters, but {param_name(group, gi, j, p)} in param_groups[{gi}] is "
                    f"{p.ndim}-D: put norms, biases and other non-matrix parameters (and the embeddings and head, "
                    "which Muon is not meant for) in a group with use_muon=False (AdamW)")


class ShardedMuon(ShardedOptimizer):
    """Muon (momentum orthogonalized by Newton-Schulz) for the groups with ``use_muon=True`` (the default), AdamW
    for the groups with ``use_muon=False``, with bf16 weights and gradients and fp32 master weights and states
    sharded over the data-parallel ranks.

    Muon groups follow ``torch.optim.Muon`` (torch 2.13): the same hyper-parameters, defaults, lr adjustments and
    Newton-Schulz in bf16; every parameter of a Muon group must be 2-D (ValueError naming it). AdamW groups
    follow ``torch.optim.AdamW``: keys ``lr``, ``betas``, ``eps``, ``weight_decay``; a key the group does not set
    takes torch.optim.AdamW's default (lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight_decay 1e-2), not the Muon
    value given to the constructor.

    State per parameter (``state_dict()``): ``momentum_buffer`` for Muon (torch.optim.Muon's format, no ``step``),
    ``step``/``exp_avg``/``exp_avg_sq`` for AdamW, plus the fp32 ``master``. Per rank and Muon parameter: 2 B
    (bf16 param) + 2 B (bf16 grad) + 8/d B (fp32 master, momentum) + 2/d B (bf16 Newton-Schulz workspace).

    Layout and its costs: see :mod:`tritonshard.optim.muon`; :meth:`plan` reports them for given shapes.

    Args:
        params: parameters or param groups; a group may set ``use_muon``.
        lr, weight_decay, momentum, nesterov, ns_coefficients, eps, ns_steps, adjust_lr_fn: as ``torch.optim.Muon``
            (``momentum`` in [0, 1)), the defaults of the Muon groups.
        process_group, and every other keyword (``overlap_comm``, ``replica_group``/``device_mesh``,
            ``loss_scale``, ``store_param_remainders``, ``state_dtype``, ``bucket_cap_mb``...): see
            :class:`ShardedOptimizer`. A Muon bucket holds up to ``world_size x bucket_cap_mb`` (each rank's shard
            about ``bucket_cap_mb``).
    """

    #: every state name a ShardedMuon can hold (checkpoint signatures); per bucket see _group_state_names
    _state_names = MUON_STATE + ADAMW_STATE

    def __init__(self, params, lr=1e-3, weight_decay=0.1, momentum=0.95, nesterov=True,
                 ns_coefficients=(3.4445, -4.775, 2.0315), eps=1e-7, ns_steps=5, adjust_lr_fn=None, *,
                 process_group: Optional[dist.ProcessGroup] = None, **pipeline):
        params = param_list(params)
        groups = params if params and isinstance(params[0], dict) else [{"params": params}]
        if groups is params:
            params = groups = [_with_adamw_defaults(g) for g in groups]
        # before any buffer exists: a failed construction must leave the model untouched
        for gi, g in enumerate(groups):
            g["params"] = group_param_list(g["params"], gi)
            _check_matrices(g, gi)
        self._ns_loads: Optional[list] = None  # NS FLOPs per rank so far, while the buckets are laid out
        self._laid_out_use_muon: dict = {}  # group index -> its use_muon when its buckets were laid out
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                        ns_coefficients=tuple(ns_coefficients) if isinstance(ns_coefficients, (tuple, list))
                        else ns_coefficients, eps=eps, ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn, use_muon=True)
        super().__init__(params, defaults, process_group=process_group, **pipeline)
        self._new_buckets_added(self.buckets)

    def add_param_group(self, param_group: dict) -> None:
        """As ``torch.optim.Optimizer.add_param_group`` (after construction: see
        :meth:`ShardedOptimizer.add_param_group`); a group with ``use_muon=False`` takes torch.optim.AdamW's
        defaults for the keys it does not set, as at construction."""
        if hasattr(self, "buckets") and isinstance(param_group, dict):
            param_group = _with_adamw_defaults(param_group)
        super().add_param_group(param_group)

    def _check_new_group(self, group: dict, where: str) -> None:
        _check_matrices(group, len(self.param_groups) - 1)

    # ------------------------------------------------------------------ hyper-parameters
    def _check_group_at_step(self, gi: int, group: dict) -> None:
        """A group's buckets hold Muon's state or AdamW's, laid out when it was built: a use_muon switched since
        failed in the update with a KeyError 'momentum_buffer', after the gradients were reduced, until session 52.
        Checked before the kind's own checks (a Muon group switched to AdamW has no betas to check). Keyed by the
        group's index, not ``id(group)``: torch 2.11's dynamo cannot trace ``id()`` of a dict, and the compiled
        step (fullgraph) broke on it."""
        where = f" (param_groups[{gi}], at step())"
        check_flag("use_muon", group.get("use_muon"), where)
        laid_out = self._laid_out_use_muon.get(gi)  # (None: not laid out yet)
        if laid_out is not None and group["use_muon"] is not laid_out:
            raise ValueError(f"use_muon={group['use_muon']}, but this group was built with use_muon={laid_out}: its "
                             "buckets hold that kind's state (Muon's momentum or AdamW's moments), laid out then; put "
                             f"the parameters in a group of the other kind when building the optimizer{where}")
        self._check_group(group, where)

    def _check_group(self, g: dict, where: str) -> None:
        check_flag("use_muon", g.get("use_muon"), where)
        if not g["use_muon"]:
            check_flag("maximize", g.get("maximize", False), where)  # ("False" is no maximize=True)
            for key in ("amsgrad", "maximize"):  # (first: check_adamw_group would name ShardedAdamW's reasons)
                require(not g.get(key, False), f"{key}=True is not supported in the AdamW groups of ShardedMuon",
                        where)
            check_adamw_group(g, where)
            return
        check_lr(g["lr"], where)
        check_min("weight_decay", g["weight_decay"], where)
        m = g["momentum"]
        require(isinstance(m, numbers.Real) and not isinstance(m, bool) and 0.0 <= m < 1.0,
                f"momentum must be in [0, 1), got {m!r}", where)
        check_flag("nesterov", g["nesterov"], where)
        c = g["ns_coefficients"]
        require(isinstance(c, (tuple, list)) and len(c) == 3
                and all(isinstance(x, numbers.Real) and not isinstance(x, bool) and -math.inf < x < math.inf
                        for x in c),  # (a NaN one orthogonalized every update to NaN, silently, until session 52)
                f"ns_coefficients must be three finite numbers (a, b, c), got {c!r}", where)
        check_min("eps", g["eps"], where)
        require(g["eps"] < FP32_MAX, f"eps must be below fp32's largest number, got {g['eps']!r}", where)
        s = g["ns_steps"]
        require(isinstance(s, int) and not isinstance(s, bool) and 0 <= s < 100,
                f"ns_steps must be an int in [0, 100), got {s!r}", where)
        require(g["adjust_lr_fn"] in (None, "original", "match_rms_adamw"),
                f"adjust_lr_fn must be None, 'original' or 'match_rms_adamw', got {g['adjust_lr_fn']!r}", where)

    # ------------------------------------------------------------------ layout (hooks of ShardedOptimizer)
    def _group_state_names(self, group: dict) -> tuple[str, ...]:
        return MUON_STATE if group["use_muon"] else ADAMW_STATE

    def _core_group_keys(self, saved_group: dict, group: dict) -> tuple:  # (state_io.py)
        use_muon = saved_group.get("use_muon", group["use_muon"])
        if use_muon if type(use_muon) is bool else group["use_muon"]:  # (not a bool: _check_group names it next)
            return ("lr", "weight_decay", "momentum", "nesterov", "ns_coefficients", "eps", "ns_steps")
        return ShardedAdamW._CORE_GROUP_KEYS

    def _group_bucket_cap(self, group: dict, cap_elems: int) -> int:
        return cap_elems * self.world_size if group["use_muon"] else cap_elems

    def _group_owners(self, group: dict, params: list) -> Optional[list[int]]:
        if not group["use_muon"]:
            return None
        if self._ns_loads is None:
            self._ns_loads = [0.0] * self.world_size
        return _muon_owners(params, self.world_size, group["ns_steps"], self._ns_loads)

    def _new_buckets_added(self, new: list) -> None:
        """The matrices of the Muon buckets ``new`` (all of them at construction, a group's added after it), once
        the layout is done (a group's matrices are balanced over the ranks among themselves)."""
        self._ns_loads = None
        for b in new:
            group = self._group_of_bucket[b.index]
            self._laid_out_use_muon[b.group_index] = group["use_muon"]
            if group["use_muon"]:
                self._plan_matrices(b)

    def _group_keeps_step(self, group: dict) -> bool:
        return not group["use_muon"]  # torch.optim.Muon keeps no step

    def _reads_step(self, group: dict) -> bool:
        return not group["use_muon"]  # (Muon's momentum starts from zeros: no step count in it)

    def _update_slice(self, bucket: _Bucket, group: dict, sl: slice, step: torch.Tensor, seed, grad_scale,
                      found_inf: torch.Tensor) -> None:
        adamw_update_slice(bucket, group, sl, step, seed, grad_scale, found_inf)

    def _plan_matrices(self, b: _Bucket) -> None:
        """The matrices this rank owns in bucket ``b`` (shard range and shape), and the bf16 workspace the momentum
        pass writes the Newton-Schulz input into and Newton-Schulz writes its output back into."""
        b.workspace = torch.zeros(b.param_buffer.shard_numel, dtype=torch.bfloat16, device=self.device)
        b.matrices = []
        for piece in b.param_buffer.shard_pieces():
            p = b.params[piece.tensor_index]
            assert piece.numel == p.numel(), "a Muon matrix must lie whole in its owner's shard"
            b.matrices.append((piece.shard_start, piece.shard_end, tuple(p.shape)))

    # ------------------------------------------------------------------ the update
    def _update(self, bucket: _Bucket, group: dict, grad_scale, found_inf: torch.Tensor) -> None:
        if not group["use_muon"]:
            adamw_update(self, bucket, group, grad_scale, found_inf)
            return
        param, param_out, remainders = bucket.update_target()
        grad = bucket.grad_buffer.get_local_shard()
        k = kernels()
        work = bucket.workspace
        k.muon_momentum_(grad, bucket.state["momentum_buffer"], work, momentum=group["momentum"],
                         nesterov=group["nesterov"], grad_scale=grad_scale, found_inf=found_inf,
                         **bucket.state_kwargs())
        for start, end, shape in bucket.matrices:
            u = work[start:end].view(shape)
            u.copy_(newton_schulz(u, group["ns_coefficients"], group["ns_steps"], group["eps"]))
            k.muon_update_(param[start:end], work[start:end], lr=group["lr"], weight_decay=group["weight_decay"],
                           lr_ratio=adjusted_lr_ratio(group["adjust_lr_fn"], shape), found_inf=found_inf,
                           param_out=param_out[start:end], remainders=remainders)

    def _apply_hparams(self, saved_groups) -> None:
        for gi, (sg, g) in enumerate(zip(saved_groups, self.param_groups)):
            if sg.get("use_muon", True) != g["use_muon"]:
                raise ValueError(f"param_groups[{gi}] was saved with use_muon={sg.get('use_muon', True)} but has "
                                 f"use_muon={g['use_muon']} here: Muon and AdamW keep different states")
        super()._apply_hparams(saved_groups)

    # ------------------------------------------------------------------ planning report
    @staticmethod
    def plan(shapes: Sequence[Sequence[int]], world_size: int, *, bucket_cap_mb: float = 25.0,
             align: int = DEFAULT_ALIGN, ns_steps: int = 5, param_dtype: torch.dtype = torch.bfloat16) -> dict:
        """What the Muon layout costs for matrices of ``shapes`` (in the model's order) at ``world_size``, computed
        the way the optimizer lays them out, without building anything:

        * ``ns_flops_per_rank``, ``ns_flops_max_over_mean``, ``ns_flops_total`` (over ranks) and
          ``ns_flops_single_process`` (the same matrices on one process: equal, no redundant work);
        * ``buckets``, ``padding_elements`` (beyond what the standard ZeRO layout of the same buckets pads) and
          ``extra_bytes_per_step``: the bytes per rank that padding adds to the bf16 reduce-scatter and
          all-gather, compared with ShardedAdamW on the same parameters (ring algorithms: (d-1)/d of each buffer).
        """
        metas = [torch.empty(tuple(s), device="meta") for s in shapes]
        elem = torch.empty((), dtype=param_dtype).element_size()
        cap_elems = max(1, int(bucket_cap_mb * 2 ** 20) // elem) * world_size
        loads = [0.0] * world_size
        extra_pad, n_buckets = 0, 0
        for params in split_into_buckets(metas, cap_elems):
            numels = [p.numel() for p in params]
            owners = _muon_owners(params, world_size, ns_steps, loads)
            extra_pad += (Layout(numels, world_size, align, owners=owners).padded_numel
                          - Layout(numels, world_size, align).padded_numel)
            n_buckets += 1
        total = sum(loads)
        ring = (world_size - 1) / world_size
        return {"world_size": world_size, "buckets": n_buckets, "ns_flops_per_rank": loads,
                "ns_flops_total": total,
                "ns_flops_single_process": float(sum(newton_schulz_flops(s, ns_steps) for s in shapes)),
                "ns_flops_max_over_mean": max(loads) / (total / world_size) if total else 1.0,
                "padding_elements": extra_pad,
                "extra_bytes_per_step": int(2 * extra_pad * elem * ring)}
