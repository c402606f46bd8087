"""``ShardedAdamW``: torch.optim.AdamW semantics on sharded fp32 master weights, bf16 weights and gradients."""

from __future__ import annotations

import math
import numbers
from typing import Optional

import torch
import torch.distributed as dist

from ..buffer import DEFAULT_ALIGN
from ..kernels import adamw_step_
from .base import ShardedOptimizer, _Bucket

__all__ = ["ShardedAdamW"]


def _check_hparams(lr, betas, eps, weight_decay, where: str = "") -> None:
    def bad(msg):
        raise ValueError(f"{msg}{where}")
    if not isinstance(lr, torch.Tensor) and (isinstance(lr, bool) or not isinstance(lr, numbers.Real)):
        raise TypeError(f"lr must be a number or a 0-d tensor, got {type(lr).__name__}{where}")
    if not isinstance(lr, torch.Tensor) and not lr >= 0:
        bad(f"lr must be >= 0, got {lr}")
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        bad(f"betas must be a pair (beta1, beta2), got {betas!r}")
    for i, b in enumerate(betas):
        if isinstance(b, bool) or not isinstance(b, numbers.Real) or not 0.0 <= b < 1.0:
            bad(f"betas[{i}] must be in [0, 1), got {b!r}")
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not eps > 0:
        bad(f"eps must be > 0, got {eps!r}")
    if isinstance(weight_decay, bool) or not isinstance(weight_decay, numbers.Real) or not weight_decay >= 0:
        bad(f"weight_decay must be >= 0, got {weight_decay!r}")


class ShardedAdamW(ShardedOptimizer):
    """AdamW (decoupled weight decay, as ``torch.optim.AdamW``) with bf16 weights and gradients and fp32 master
    weights and moments sharded over the data-parallel ranks.

    A drop-in ``torch.optim.Optimizer``: param groups (per-group ``lr``, ``betas``, ``eps``, ``weight_decay``),
    LR schedulers and ``zero_grad(set_to_none=...)`` work as usual. Construction turns every trainable parameter
    into a bf16 view of a flat buffer (the model trains in bf16 from then on); see
    :mod:`tritonshard.optim.base` for the data flow and memory layout.

    Per rank and parameter: 2 B (bf16 param) + 2 B (bf16 grad) + 12/d B (fp32 master, exp_avg, exp_avg_sq), plus
    padding; ``memory_bytes()`` reports it.

    Args:
        params, lr, betas, eps, weight_decay, maximize: as ``torch.optim.AdamW`` (``eps`` must be > 0).
        process_group, param_dtype, grad_dtype, bucket_cap_mb, align, overlap_comm: see :class:`ShardedOptimizer`.
    """

    _state_names = ("exp_avg", "exp_avg_sq")

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, *, maximize=False,
                 process_group: Optional[dist.ProcessGroup] = None,
                 replica_group: Optional[dist.ProcessGroup] = None, device_mesh=None, param_dtype=torch.bfloat16,
                 grad_dtype=torch.bfloat16, bucket_cap_mb: float = 25.0, align: int = DEFAULT_ALIGN,
                 overlap_comm: bool = False, loss_scale=None, store_param_remainders: bool = False,
                 state_dtype=torch.float32, state_rounding: str = "stochastic"):
        _check_hparams(lr, betas, eps, weight_decay)
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, maximize=bool(maximize))
        super().__init__(params, defaults, process_group=process_group, replica_group=replica_group,
                         device_mesh=device_mesh, param_dtype=param_dtype,
                         grad_dtype=grad_dtype, bucket_cap_mb=bucket_cap_mb, align=align, overlap_comm=overlap_comm,
                         loss_scale=loss_scale, store_param_remainders=store_param_remainders,
                         state_dtype=state_dtype, state_rounding=state_rounding)

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        g = self.param_groups[-1]
        _check_hparams(g["lr"], g["betas"], g["eps"], g["weight_decay"],
                       where=f" (param_groups[{len(self.param_groups) - 1}])")

    def _update(self, bucket: _Bucket, group: dict, grad_scale, found_inf: torch.Tensor) -> None:
        beta1, beta2 = group["betas"]
        param, param_out, remainders = bucket.update_target()
        adamw_step_(param, bucket.grad_buffer.get_local_shard(), bucket.state["exp_avg"],
                    bucket.state["exp_avg_sq"], lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
                    weight_decay=group["weight_decay"], step=bucket.step, grad_scale=grad_scale,
                    found_inf=found_inf, param_out=param_out, maximize=group["maximize"], remainders=remainders,
                    **bucket.state_kwargs())
