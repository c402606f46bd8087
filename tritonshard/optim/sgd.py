"""``ShardedSGD`` and ``ShardedLion``: the sharded pipeline with the fused SGD and Lion updates."""

from __future__ import annotations

import torch

from ._hparams import check_betas, check_lr, check_min, check_number, require
from .base import ShardedOptimizer, kernels
from .bucket import _Bucket

__all__ = ["ShardedSGD", "ShardedLion"]


class ShardedSGD(ShardedOptimizer):
    """SGD with momentum, dampening, Nesterov and (coupled, L2) weight decay, as ``torch.optim.SGD``, on sharded
    fp32 master weights with bf16 weights and gradients. State: ``momentum_buffer`` (only if some group has
    momentum), 4/d B per parameter. Keywords after ``maximize``: see :class:`ShardedOptimizer`."""

    def __init__(self, params, lr=1e-3, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False, *,
                 maximize=False, **pipeline):
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                        nesterov=bool(nesterov), maximize=bool(maximize))
        params = list(params)
        groups = params if params and isinstance(params[0], dict) else [{"params": params}]
        self._state_names = ("momentum_buffer",) if any(g.get("momentum", momentum) != 0 for g in groups) else ()
        super().__init__(params, defaults, **pipeline)

    def _check_group(self, g: dict, where: str) -> None:
        check_lr(g["lr"], where)
        check_min("momentum", g["momentum"], where)
        check_number("dampening", g["dampening"], where)
        check_min("weight_decay", g["weight_decay"], where)
        require(not g["nesterov"] or (g["momentum"] > 0 and g["dampening"] == 0),
                "nesterov=True requires momentum > 0 and dampening == 0", where)

    def _update(self, bucket: _Bucket, group: dict, grad_scale, found_inf: torch.Tensor) -> None:
        param, param_out, remainders = bucket.update_target()
        kernels().sgd_step_(param, bucket.grad_buffer.get_local_shard(), bucket.state.get("momentum_buffer"),
                  lr=group["lr"], momentum=group["momentum"], dampening=group["dampening"],
                  weight_decay=group["weight_decay"], nesterov=group["nesterov"], step=bucket.step,
                  grad_scale=grad_scale, found_inf=found_inf, param_out=param_out, maximize=group["maximize"],
                  remainders=remainders, **bucket.state_kwargs())


class ShardedLion(ShardedOptimizer):
    """Lion (sign of the interpolated momentum, decoupled weight decay; Chen et al. 2023) on sharded fp32 master
    weights with bf16 weights and gradients. State: ``exp_avg``, 4/d B per parameter. Keywords after
    ``maximize``: see :class:`ShardedOptimizer`."""

    _state_names = ("exp_avg",)

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0, *, maximize=False, **pipeline):
        defaults = dict(lr=lr, betas=tuple(betas) if isinstance(betas, (tuple, list)) else betas,
                        weight_decay=weight_decay, maximize=bool(maximize))
        super().__init__(params, defaults, **pipeline)

    def _check_group(self, g: dict, where: str) -> None:
        check_lr(g["lr"], where)
        check_betas(g["betas"], where)
        check_min("weight_decay", g["weight_decay"], where)

    def _update(self, bucket: _Bucket, group: dict, grad_scale, found_inf: torch.Tensor) -> None:
        beta1, beta2 = group["betas"]
        param, param_out, remainders = bucket.update_target()
        kernels().lion_step_(param, bucket.grad_buffer.get_local_shard(), bucket.state["exp_avg"], lr=group["lr"],
                   beta1=beta1, beta2=beta2, weight_decay=group["weight_decay"], grad_scale=grad_scale,
                   found_inf=found_inf, param_out=param_out, maximize=group["maximize"], remainders=remainders,
                   **bucket.state_kwargs())
