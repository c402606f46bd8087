"""``ShardedSGD`` and ``ShardedLion``: the sharded pipeline with the fused SGD and Lion updates."""

from __future__ import annotations

import torch

from ..kernels import _launch
from ..kernels._common import fill_negated, fill_one_minus_product
from ..kernels.lion import SEGMENTS as LION_SEGMENTS
from ..kernels.lion import launch_spec as lion_launch_spec
from ..kernels.lion import lion_coefficients
from ..kernels.sgd import SEGMENTS as SGD_SEGMENTS
from ..kernels.sgd import launch_spec as sgd_launch_spec
from ..kernels.sgd import sgd_coefficients
from ._hparams import check_betas, check_flag, check_lr, check_min, check_number, require
from ._compiled import kernels
from .base import ShardedOptimizer, param_list
from .bucket import _Bucket

__all__ = ["ShardedSGD", "ShardedLion"]


class ShardedSGD(ShardedOptimizer):
    """SGD with momentum, dampening, Nesterov and (coupled, L2) weight decay, as ``torch.optim.SGD``, on sharded
    fp32 master weights with bf16 weights and gradients. State: ``momentum_buffer`` (only if some group has
    momentum), 4/d B per parameter. Keywords after ``maximize``: see :class:`ShardedOptimizer`."""

    _segments = (SGD_SEGMENTS, "sgd_step_")

    def __init__(self, params, lr=1e-3, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False, *,
                 maximize=False, **pipeline):
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                        nesterov=nesterov, maximize=maximize)
        params = param_list(params)
        groups = params if params and isinstance(params[0], dict) else [{"params": params}]
        self._state_names = ("momentum_buffer",) if any(g.get("momentum", momentum) != 0 for g in groups) else ()
        super().__init__(params, defaults, **pipeline)

    _MADE_BY_FIRST_STEP = ("momentum_buffer",)  # (state_io.py)
    _CORE_GROUP_KEYS = ("lr", "momentum", "dampening", "weight_decay", "nesterov")  # (state_io.py)

    def _check_group(self, g: dict, where: str) -> None:
        check_lr(g["lr"], where)
        check_min("momentum", g["momentum"], where)
        # (torch.optim.SGD makes a parameter's buffer at its first step with momentum; here the buffers are laid out
        # with the rest of the state at construction, for every group where any group had momentum then. Until
        # session 49 a momentum set later on an optimizer built without any, by hand or by a scheduler that cycles
        # it, failed inside step(): "momentum_buffer must be a torch.Tensor, got NoneType"; add_param_group checked)
        if g["momentum"] != 0 and not self._state_names:  # (the message formatted only on failure: every step;
            # at add_param_group too, which said so before)
            raise ValueError(
                f"momentum={g['momentum']!r}, but this ShardedSGD was built without momentum in any param group, so "
                "it holds no momentum buffers (they are laid out with the optimizer's state when it is built): build "
                "it with momentum > 0 in some group, which gives every group buffers (e.g. the momentum a scheduler "
                f"starts from){where}")
        check_number("dampening", g["dampening"], where)
        check_min("weight_decay", g["weight_decay"], where)
        check_flag("nesterov", g["nesterov"], where)
        check_flag("maximize", g["maximize"], where)
        require(not g["nesterov"] or (g["momentum"] > 0 and g["dampening"] == 0),
                "nesterov=True requires momentum > 0 and dampening == 0", where)

    def _update(self, bucket: _Bucket, group: dict, grad_scale, found_inf: torch.Tensor) -> None:
        _launch_one(bucket, *self._launch(bucket, group, grad_scale, found_inf))

    def _reads_step(self, group: dict) -> bool:
        return group["momentum"] != 0  # the first step sets the momentum buffer to the gradient (no dampening)

    def _counts_step(self, group: dict) -> bool:
        # torch.optim.SGD makes a parameter's buffer at its first step with momentum (buf = g) and leaves it alone
        # in steps without: the count is of the steps with momentum, so that a group whose momentum is turned on
        # later (by hand, a scheduler, a group built with momentum=0 beside others) starts as torch's does, not at
        # buf = (1 - dampening) * g; turned off and on again, the buffer goes on from where it was, as torch's
        return group["momentum"] != 0

    def _update_slice(self, bucket: _Bucket, group: dict, sl: slice, step: torch.Tensor, seed, grad_scale,
                      found_inf: torch.Tensor) -> None:
        """Elements ``sl`` with their own step count (optim/param_steps.py), through the checked launcher."""
        param, param_out, remainders = bucket.update_target()
        kwargs = bucket.state_kwargs()
        if seed is not None:
            kwargs["seed"] = seed
        kernels().sgd_step_(param[sl], bucket.grad_buffer.get_local_shard()[sl],
                            bucket.state["momentum_buffer"][sl], lr=group["lr"], momentum=group["momentum"],
                            dampening=group["dampening"], weight_decay=group["weight_decay"],
                            nesterov=group["nesterov"], step=step, grad_scale=grad_scale, found_inf=found_inf,
                            param_out=param_out[sl], maximize=group["maximize"], remainders=remainders, **kwargs)

    def _launch(self, bucket: _Bucket, group: dict, grad_scale, found_inf: torch.Tensor) -> tuple:
        """(launch spec or None, checked launch) of one bucket's update (see adamw.adamw_launch)."""
        param, param_out, remainders = bucket.update_target()
        grad, momentum_buffer, state_kwargs = bucket.grad_buffer.get_local_shard(), bucket.state.get(
            "momentum_buffer"), bucket.state_kwargs()
        persistent = self._persistent_args()

        def checked_launch():  # (the lr tensor is written here, when the checked launcher runs: not every step)
            lr = self._lr_tensor(group, bucket.group_index) if persistent else group["lr"]
            kernels().sgd_step_(param, grad, momentum_buffer, lr=lr,
                                momentum=group["momentum"], dampening=group["dampening"],
                                weight_decay=group["weight_decay"], nesterov=group["nesterov"], step=bucket.step,
                                grad_scale=grad_scale, found_inf=found_inf, param_out=param_out,
                                maximize=group["maximize"], remainders=remainders, **state_kwargs)
        if not persistent:
            return None, checked_launch
        lr = self._lr_source(group, bucket.group_index)
        if isinstance(lr, torch.Tensor):
            # a captured phase: the lr a scheduler sets reaches the kernel through one tensor per group that keeps
            # its storage ([-lr], fp32: the bits the checked launcher computes from the same lr)
            coef, values = self._once_per_step(("sgd", bucket.group_index), lambda: fill_negated(
                self._persistent_tensor(("sgd", bucket.group_index),
                                        lambda: torch.empty(1, dtype=torch.float32, device=self.device)), lr)), None
        else:  # -lr as the kernel's float argument, which a bound launch takes anew at each call (kernels/_launch)
            coef, values = sgd_coefficients(lr, self.device)
        spec = sgd_launch_spec(param, grad, momentum_buffer, coef, values, bucket.step, grad_scale, found_inf,
                               param_out, _seed(state_kwargs), group["momentum"], group["dampening"],
                               group["weight_decay"], group["nesterov"], group["maximize"], remainders)
        return spec, checked_launch


class ShardedLion(ShardedOptimizer):
    """Lion (sign of the interpolated momentum, decoupled weight decay; Chen et al. 2023) on sharded fp32 master
    weights with bf16 weights and gradients. State: ``exp_avg``, 4/d B per parameter. Keywords after
    ``maximize``: see :class:`ShardedOptimizer`."""

    _state_names = ("exp_avg",)
    _CORE_GROUP_KEYS = ("lr", "betas", "weight_decay")  # (state_io.py)
    _OTHER_KINDS_GROUP_KEYS = ("eps",)  # (every torch Adam-family group has it; Lion has no epsilon)
    _segments = (LION_SEGMENTS, "lion_step_")

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0, *, maximize=False, **pipeline):
        defaults = dict(lr=lr, betas=tuple(betas) if isinstance(betas, (tuple, list)) else betas,
                        weight_decay=weight_decay, maximize=maximize)
        super().__init__(params, defaults, **pipeline)

    def _check_group(self, g: dict, where: str) -> None:
        check_lr(g["lr"], where)
        check_betas(g["betas"], where)
        check_min("weight_decay", g["weight_decay"], where)
        check_flag("maximize", g["maximize"], where)

    def _reads_step(self, group: dict) -> bool:
        return False  # (Lion's update has no step count in it)

    def _update(self, bucket: _Bucket, group: dict, grad_scale, found_inf: torch.Tensor) -> None:
        _launch_one(bucket, *self._launch(bucket, group, grad_scale, found_inf))

    def _launch(self, bucket: _Bucket, group: dict, grad_scale, found_inf: torch.Tensor) -> tuple:
        """(launch spec or None, checked launch) of one bucket's update (see adamw.adamw_launch)."""
        beta1, beta2 = group["betas"]
        param, param_out, remainders = bucket.update_target()
        grad, exp_avg, state_kwargs = bucket.grad_buffer.get_local_shard(), bucket.state["exp_avg"], \
            bucket.state_kwargs()
        persistent = self._persistent_args()

        def checked_launch():  # (the lr tensor is written here, when the checked launcher runs: not every step)
            lr = self._lr_tensor(group, bucket.group_index) if persistent else group["lr"]
            kernels().lion_step_(param, grad, exp_avg, lr=lr,
                                 beta1=beta1, beta2=beta2, weight_decay=group["weight_decay"], grad_scale=grad_scale,
                                 found_inf=found_inf, param_out=param_out, maximize=group["maximize"],
                                 remainders=remainders, **state_kwargs)
        if not persistent:
            return None, checked_launch
        gi = bucket.group_index
        lr = self._lr_source(group, gi)

        def coefficients():  # [1 - lr*wd, -lr]: float64 math, rounded to fp32 once, as the checked launcher does
            coef, scratch = self._persistent_tensor(("lion", gi), lambda: (
                torch.empty(2, dtype=torch.float32, device=self.device),
                torch.empty((), dtype=torch.float64, device=self.device)))
            fill_one_minus_product(coef[0], lr, float(group["weight_decay"]), scratch)
            fill_negated(coef[1], lr)
            return coef
        if isinstance(lr, torch.Tensor):  # (a captured phase reads them from a tensor that keeps its storage)
            coef, values = self._once_per_step(("lion", bucket.group_index), coefficients), None
        else:  # the kernel's float arguments, which a bound launch takes anew at each call (kernels/_launch.py)
            coef, values = lion_coefficients(lr, float(group["weight_decay"]), self.device)
        spec = lion_launch_spec(param, grad, exp_avg, coef, values, grad_scale, found_inf, param_out,
                                _seed(state_kwargs), beta1, beta2, group["maximize"], remainders)
        return spec, checked_launch


def _launch_one(bucket: _Bucket, spec, checked_launch) -> None:
    """One bucket's update: bound (replayed from the second launch on) where there is a spec, else checked.

    A binding per kind of grad_scale (a number: no clip; a tensor: a clip or another multiplier), so a loop that
    clips some steps and not others replays both. With ``cuda_graph=True`` that is also what keeps an eager step
    the ops of its key's capture: the checked launcher computes the coefficients from the lr tensor with torch ops
    of its own (the same values as the bound launch's, which reads them from the tensor the step wrote), so a step
    that rebound after a step of the other kind ran other ops than the capture it shares a key with (found in
    session 38 by the loop fuzzer's graph emulation with ShardedSGD and ShardedLion: harmless on a GPU, whose
    replay runs the captured ops, but it left the emulation unable to check those replays)."""
    if spec is None:
        checked_launch()
    else:
        _launch.launch(bucket.launches, ("update", spec[3]["GRAD_SCALE_IS_TENSOR"]), spec, checked_launch)


def _seed(state_kwargs: dict):
    return state_kwargs.get("seed") if state_kwargs.get("state_rounding") == "stochastic" else None
