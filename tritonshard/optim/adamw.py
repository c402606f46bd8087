"""``ShardedAdamW``: torch.optim.AdamW semantics on sharded fp32 master weights, bf16 weights and gradients."""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from ..kernels import _launch
from ..kernels._dispatch import triton_kernels_run
from ..kernels.adamw import adamw_coefficients, adamw_coefficients_into, adamw_coefficients_launch
from ..kernels.adamw import SEGMENTS as ADAMW_SEGMENTS
from ..kernels.adamw import launch_spec as adamw_launch_spec
from ._hparams import check_betas, check_flag, check_lr, check_min, require
from ._compiled import kernels
from .base import ShardedOptimizer
from .bucket import _Bucket

__all__ = ["ShardedAdamW", "adamw_update", "adamw_update_slice", "check_adamw_group"]


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
        params, lr, betas, eps, weight_decay, maximize: as ``torch.optim.AdamW`` (``eps`` must be > 0); its
            ``amsgrad`` in its place, which only ``False`` passes.
        process_group, param_dtype, grad_dtype, bucket_cap_mb, and every other keyword (``overlap_comm``,
            ``replica_group``/``device_mesh``, ``loss_scale``, ``store_param_remainders``, ``state_dtype``...):
            see :class:`ShardedOptimizer`.
    """

    _state_names = ("exp_avg", "exp_avg_sq")
    _CORE_GROUP_KEYS = ("lr", "betas", "eps", "weight_decay")  # (state_io.py)

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False, *,
                 maximize=False, process_group: Optional[dist.ProcessGroup] = None, param_dtype=torch.bfloat16,
                 grad_dtype=torch.bfloat16, bucket_cap_mb: float = 25.0, **pipeline):
        if amsgrad:
            raise ValueError("amsgrad=True: ShardedAdamW implements AdamW without the AMSGrad variant (the running "
                             "maximum of exp_avg_sq that torch.optim.AdamW(amsgrad=True) keeps)")
        defaults = dict(lr=lr, betas=tuple(betas) if isinstance(betas, (tuple, list)) else betas, eps=eps,
                        weight_decay=weight_decay, maximize=maximize)
        super().__init__(params, defaults, process_group=process_group, param_dtype=param_dtype,
                         grad_dtype=grad_dtype, bucket_cap_mb=bucket_cap_mb, **pipeline)

    def _check_group(self, g: dict, where: str) -> None:
        check_adamw_group(g, where)

    def _update(self, bucket: _Bucket, group: dict, grad_scale, found_inf: torch.Tensor) -> None:
        adamw_update(self, bucket, group, grad_scale, found_inf, maximize=group["maximize"])

    _segments = (ADAMW_SEGMENTS, "adamw_step_")

    def _update_slice(self, bucket: _Bucket, group: dict, sl: slice, step: torch.Tensor, seed, grad_scale,
                      found_inf: torch.Tensor) -> None:
        adamw_update_slice(bucket, group, sl, step, seed, grad_scale, found_inf, maximize=group["maximize"])

    def _launch(self, bucket: _Bucket, group: dict, grad_scale, found_inf: torch.Tensor) -> tuple:
        return adamw_launch(self, bucket, group, grad_scale, found_inf, maximize=group["maximize"])


def check_adamw_group(g: dict, where: str) -> None:
    """An AdamW group's hyper-parameters (ShardedAdamW's groups, and ShardedMuon's ``use_muon=False`` ones)."""
    check_lr(g["lr"], where)
    check_betas(g["betas"], where)
    check_min("eps", g["eps"], where, strict=True)
    check_min("weight_decay", g["weight_decay"], where)
    check_flag("maximize", g.get("maximize", False), where)
    # (refused at construction; a group given it, or a loop setting it later, would train without it, silently)
    require(not g.get("amsgrad", False), "amsgrad=True: ShardedAdamW implements AdamW without the AMSGrad variant (the "
            "running maximum of exp_avg_sq that torch.optim.AdamW(amsgrad=True) keeps)", where)
    # (torch.optim.Adam's groups hold decoupled_weight_decay=False: its state dict loads, and trains the same, where
    # it has no weight decay)
    require(g.get("decoupled_weight_decay", True) is not False or g["weight_decay"] == 0,
            "weight_decay with decoupled_weight_decay=False (torch.optim.Adam's L2 penalty in the gradient): "
            "ShardedAdamW decays the weights as AdamW; set decoupled_weight_decay=True or weight_decay=0", where)


def adamw_update(opt: ShardedOptimizer, bucket: _Bucket, group: dict, grad_scale, found_inf: torch.Tensor,
                 maximize: bool = False) -> None:
    """One bucket's fused AdamW update. The coefficients (float64 device math from lr and the group's step) are
    computed once per param group and step and shared by the group's buckets."""
    spec, checked_launch = adamw_launch(opt, bucket, group, grad_scale, found_inf, maximize)
    if spec is None:
        checked_launch()
        return
    # the first launch with these arguments (and any change of them: new betas, a grad_scale that became a tensor)
    # goes through the checked launcher; then the bound launch replays it
    _launch.launch(bucket.launches, "update", spec, checked_launch)


def adamw_update_slice(bucket: _Bucket, group: dict, sl: slice, step: torch.Tensor, seed, grad_scale,
                       found_inf: torch.Tensor, maximize: bool = False) -> None:
    """The AdamW update of elements ``sl`` of ``bucket``'s shards with their own step count (a parameter whose
    count left its group's: optim/param_steps.py), through the checked launcher, which computes the coefficients
    from ``step`` with the float64 ops of :func:`adamw_coefficients`."""
    param, param_out, remainders = bucket.update_target()
    kwargs = bucket.state_kwargs()
    if seed is not None:
        kwargs["seed"] = seed
    kernels().adamw_step_(param[sl], bucket.grad_buffer.get_local_shard()[sl], bucket.state["exp_avg"][sl],
                          bucket.state["exp_avg_sq"][sl], lr=group["lr"], beta1=group["betas"][0],
                          beta2=group["betas"][1], eps=group["eps"], weight_decay=group["weight_decay"], step=step,
                          grad_scale=grad_scale, found_inf=found_inf, param_out=param_out[sl], maximize=maximize,
                          remainders=remainders, **kwargs)


def _coefficients_kernel_runs(device: torch.device) -> bool:
    """Whether a bound update's coefficients come from one kernel launch (kernels.adamw.adamw_coefficients_launch:
    one launch per param group and step where the kernels run compiled, with 3 small ops before it under the
    interpreter, instead of 13 float64 ops): where the Triton kernels run
    (compiled, or the interpreter, where the CPU tests run them), outside torch.compile (which records the torch
    ops). The same bits either way."""
    return triton_kernels_run(device)


def _kernel_scratch(device: torch.device) -> tuple:
    """adamw_coefficients_launch's float64 scratch: the step, the two powers and their 0-d views."""
    pows = torch.empty(2, dtype=torch.float64, device=device)
    return torch.empty((), dtype=torch.float64, device=device), pows, tuple(pows.unbind())


def adamw_launch(opt: ShardedOptimizer, bucket: _Bucket, group: dict, grad_scale, found_inf: torch.Tensor,
                 maximize: bool = False) -> tuple:
    """(launch spec or None, checked launch) of one bucket's AdamW update: the spec (kernel, grid, args, kwargs)
    where launches are bound or segmented (``opt._persistent_args()``), the checked launcher always."""
    beta1, beta2 = group["betas"]
    persistent = opt._persistent_args()
    gi = bucket.group_index
    counter = (gi, bucket.counter_index)  # the coefficients depend on the step count: one set per counter

    def coefficients_now():
        lr = group["lr"]
        if not persistent or isinstance(lr, torch.Tensor):
            coef = adamw_coefficients(lr, bucket.step, beta1, beta2, group["weight_decay"])
            if not persistent:
                return coef
        # a bound launch reads the group's coefficients from one tensor that keeps its storage, computed in place
        out = opt._persistent_tensor(("adamw", counter),
                                     lambda: torch.empty(3, dtype=torch.float32, device=opt.device))
        if isinstance(lr, torch.Tensor):
            return out.copy_(coef)
        if _coefficients_kernel_runs(opt.device):  # (the lr a kernel argument, or its float64 device tensor where
            # a captured phase reads it: no torch op where the kernel runs compiled; see there)
            scratch, launches = opt._persistent_tensor(("adamw kernel scratch", counter), lambda: (
                _kernel_scratch(opt.device), {}))
            adamw_coefficients_launch(out, scratch, opt._lr_source(group, gi), bucket.step, beta1, beta2,
                                      group["weight_decay"], launches)
            return out
        views, scratch = opt._persistent_tensor(("adamw views", counter), lambda: (
            tuple(out.unbind()), tuple(torch.empty((), dtype=torch.float64, device=opt.device) for _ in range(3))))
        adamw_coefficients_into(views, scratch, opt._lr_source(group, gi), bucket.step, beta1, beta2,
                                group["weight_decay"])
        return out
    coefficients = opt._once_per_step(("adamw", counter), coefficients_now)
    param, param_out, remainders = bucket.update_target()
    grad, state_kwargs = bucket.grad_buffer.get_local_shard(), bucket.state_kwargs()

    def checked_launch():
        kernels().adamw_step_(param, grad, bucket.state["exp_avg"], bucket.state["exp_avg_sq"], lr=group["lr"],
                              beta1=beta1, beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"],
                              step=bucket.step, grad_scale=grad_scale, found_inf=found_inf, param_out=param_out,
                              maximize=maximize, remainders=remainders, coefficients=coefficients, **state_kwargs)
    if not persistent:
        return None, checked_launch
    spec = adamw_launch_spec(param, grad, bucket.state["exp_avg"], bucket.state["exp_avg_sq"], coefficients, None,
                             grad_scale, found_inf, param_out,
                             state_kwargs.get("seed") if state_kwargs.get("state_rounding") == "stochastic" else None,
                             beta1, beta2, group["eps"], maximize, remainders)
    return spec, checked_launch
