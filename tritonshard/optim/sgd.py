"""``ShardedSGD`` and ``ShardedLion``: the sharded pipeline with the fused SGD and Lion updates."""

from __future__ import annotations

import numbers
from typing import Optional

import torch
import torch.distributed as dist

from ..buffer import DEFAULT_ALIGN
from ..kernels import lion_step_, sgd_step_
from .base import ShardedOptimizer, _Bucket

__all__ = ["ShardedSGD", "ShardedLion"]


def _require(ok: bool, msg: str, where: str) -> None:
    if not ok:
        raise ValueError(msg + where)


def _is_number(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


class ShardedSGD(ShardedOptimizer):
    """SGD with momentum, dampening, Nesterov and (coupled, L2) weight decay, as ``torch.optim.SGD``, on sharded
    fp32 master weights with bf16 weights and gradients. State: ``momentum_buffer`` (only if some group has
    momentum), 4/d B per parameter. Keyword arguments after ``maximize`` as :class:`ShardedOptimizer`."""

    def __init__(self, params, lr=1e-3, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False, *,
                 maximize=False, process_group: Optional[dist.ProcessGroup] = None,
                 replica_group: Optional[dist.ProcessGroup] = None, device_mesh=None, param_dtype=torch.bfloat16,
                 grad_dtype=torch.bfloat16, bucket_cap_mb: float = 25.0, align: int = DEFAULT_ALIGN,
                 overlap_comm: bool = False, loss_scale=None, store_param_remainders: bool = False,
                 state_dtype=torch.float32, state_rounding: str = "stochastic"):
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                        nesterov=bool(nesterov), maximize=bool(maximize))
        self._check(defaults, "")
        params = list(params)
        groups = params if params and isinstance(params[0], dict) else [{"params": params}]
        uses_momentum = any(g.get("momentum", momentum) != 0 for g in groups)
        self._state_names = ("momentum_buffer",) if uses_momentum else ()
        super().__init__(params, defaults, process_group=process_group, replica_group=replica_group,
                         device_mesh=device_mesh, param_dtype=param_dtype,
                         grad_dtype=grad_dtype, bucket_cap_mb=bucket_cap_mb, align=align, overlap_comm=overlap_comm,
                         loss_scale=loss_scale, store_param_remainders=store_param_remainders,
                         state_dtype=state_dtype, state_rounding=state_rounding)

    @staticmethod
    def _check(g: dict, where: str) -> None:
        _require(isinstance(g["lr"], torch.Tensor) or (_is_number(g["lr"]) and g["lr"] >= 0),
                 f"lr must be >= 0, got {g['lr']!r}", where)
        _require(_is_number(g["momentum"]) and g["momentum"] >= 0, f"momentum must be >= 0, got {g['momentum']!r}",
                 where)
        _require(_is_number(g["dampening"]), f"dampening must be a number, got {g['dampening']!r}", where)
        _require(_is_number(g["weight_decay"]) and g["weight_decay"] >= 0,
                 f"weight_decay must be >= 0, got {g['weight_decay']!r}", where)
        _require(not g["nesterov"] or (g["momentum"] > 0 and g["dampening"] == 0),
                 "nesterov=True requires momentum > 0 and dampening == 0", where)

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        self._check(self.param_groups[-1], f" (param_groups[{len(self.param_groups) - 1}])")

    def _update(self, bucket: _Bucket, group: dict, grad_scale, found_inf: torch.Tensor) -> None:
        param, param_out, remainders = bucket.update_target()
        sgd_step_(param, bucket.grad_buffer.get_local_shard(), bucket.state.get("momentum_buffer"),
                  lr=group["lr"], momentum=group["momentum"], dampening=group["dampening"],
                  weight_decay=group["weight_decay"], nesterov=group["nesterov"], step=bucket.step,
                  grad_scale=grad_scale, found_inf=found_inf, param_out=param_out, maximize=group["maximize"],
                  remainders=remainders, **bucket.state_kwargs())


class ShardedLion(ShardedOptimizer):
    """Lion (sign of the interpolated momentum, decoupled weight decay; Chen et al. 2023) on sharded fp32 master
    weights with bf16 weights and gradients. State: ``exp_avg``, 4/d B per parameter. Keyword arguments after
    ``maximize`` as :class:`ShardedOptimizer`."""

    _state_names = ("exp_avg",)

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0, *, maximize=False,
                 process_group: Optional[dist.ProcessGroup] = None,
                 replica_group: Optional[dist.ProcessGroup] = None, device_mesh=None, param_dtype=torch.bfloat16,
                 grad_dtype=torch.bfloat16, bucket_cap_mb: float = 25.0, align: int = DEFAULT_ALIGN,
                 overlap_comm: bool = False, loss_scale=None, store_param_remainders: bool = False,
                 state_dtype=torch.float32, state_rounding: str = "stochastic"):
        defaults = dict(lr=lr, betas=tuple(betas) if isinstance(betas, (tuple, list)) else betas,
                        weight_decay=weight_decay, maximize=bool(maximize))
        self._check(defaults, "")
        super().__init__(params, defaults, process_group=process_group, replica_group=replica_group,
                         device_mesh=device_mesh, param_dtype=param_dtype,
                         grad_dtype=grad_dtype, bucket_cap_mb=bucket_cap_mb, align=align, overlap_comm=overlap_comm,
                         loss_scale=loss_scale, store_param_remainders=store_param_remainders,
                         state_dtype=state_dtype, state_rounding=state_rounding)

    @staticmethod
    def _check(g: dict, where: str) -> None:
        _require(isinstance(g["lr"], torch.Tensor) or (_is_number(g["lr"]) and g["lr"] >= 0),
                 f"lr must be >= 0, got {g['lr']!r}", where)
        betas = g["betas"]
        _require(isinstance(betas, (tuple, list)) and len(betas) == 2, f"betas must be a pair, got {betas!r}", where)
        for i, b in enumerate(betas):
            _require(_is_number(b) and 0.0 <= b < 1.0, f"betas[{i}] must be in [0, 1), got {b!r}", where)
        _require(_is_number(g["weight_decay"]) and g["weight_decay"] >= 0,
                 f"weight_decay must be >= 0, got {g['weight_decay']!r}", where)

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        self._check(self.param_groups[-1], f" (param_groups[{len(self.param_groups) - 1}])")

    def _update(self, bucket: _Bucket, group: dict, grad_scale, found_inf: torch.Tensor) -> None:
        beta1, beta2 = group["betas"]
        param, param_out, remainders = bucket.update_target()
        lion_step_(param, bucket.grad_buffer.get_local_shard(), bucket.state["exp_avg"], lr=group["lr"],
                   beta1=beta1, beta2=beta2, weight_decay=group["weight_decay"], grad_scale=grad_scale,
                   found_inf=found_inf, param_out=param_out, maximize=group["maximize"], remainders=remainders,
                   **bucket.state_kwargs())
