"""The kernels as ``torch.library.custom_op`` s, so a ``torch.compile`` d function calls them without graph breaks.

``torch.ops.tritonshard.{flatten_into, scale_, sum_sq_nonfinite, adamw_step_, ...}`` have a schema (no unions), so a scalar that may be
a number or a tensor travels as two arguments: ``x`` (float, used when ``x_tensor`` is None) and ``x_tensor``.
The wrappers below keep the launchers' signatures and route through the ops. Fake implementations say what
is mutated and allocate the outputs' metadata only.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor

from .adamw import adamw_step_ as _adamw_step
from .flatten import flatten_into as _flatten_into
from .lion import lion_step_ as _lion_step
from .muon import muon_momentum_ as _muon_momentum
from .muon import muon_update_ as _muon_update
from .muon import adjusted_lr_ratio, newton_schulz  # noqa: F401  (torch ops: dynamo traces them)
from .scale import scale_ as _scale
from .scale import finalize_sum_sq_ as _finalize_sum_sq
from .scale import fold_rows_ as _fold_rows
from .scale import sum_sq_nonfinite as _sum_sq_nonfinite
from .scale import sum_sq_partials_ as _sum_sq_partials
from .sgd import sgd_step_ as _sgd_step

__all__ = ["flatten_into", "scale_", "sum_sq_nonfinite", "sum_sq_partials_", "finalize_sum_sq_", "fold_rows_",
           "adamw_step_",
           "sgd_step_", "lion_step_", "muon_momentum_", "muon_update_", "newton_schulz", "adjusted_lr_ratio"]


@torch.library.custom_op("tritonshard::flatten_into", mutates_args=("out",))
def _flatten_into_op(out: Tensor, tensors: list[Tensor], offsets: list[int], accumulate: bool,
                     scale: float) -> None:
    _flatten_into(out, tensors, offsets, accumulate=accumulate, scale=scale)


@_flatten_into_op.register_fake
def _(out, tensors, offsets, accumulate, scale):
    return None


@torch.library.custom_op("tritonshard::scale_", mutates_args=("x",))
def _scale_op(x: Tensor, factor: float, factor_tensor: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    return _scale(x, factor_tensor if factor_tensor is not None else factor)


@_scale_op.register_fake
def _(x, factor, factor_tensor):
    return x.new_empty((), dtype=torch.float32), x.new_empty((), dtype=torch.float32)


@torch.library.custom_op("tritonshard::sum_sq_nonfinite", mutates_args=())
def _sum_sq_nonfinite_op(x: Tensor, factor: float, factor_tensor: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    return _sum_sq_nonfinite(x, factor_tensor if factor_tensor is not None else factor)


@_sum_sq_nonfinite_op.register_fake
def _(x, factor, factor_tensor):
    return x.new_empty((), dtype=torch.float32), x.new_empty((), dtype=torch.float32)


@torch.library.custom_op("tritonshard::sum_sq_partials_", mutates_args=("partial_sumsq", "partial_nonfinite"))
def _sum_sq_partials_op(x: Tensor, factor: float, factor_tensor: Optional[Tensor], partial_sumsq: Tensor,
                        partial_nonfinite: Tensor) -> None:
    _sum_sq_partials(x, factor_tensor if factor_tensor is not None else factor, (partial_sumsq, partial_nonfinite))


@_sum_sq_partials_op.register_fake
def _(*args):
    return None


@torch.library.custom_op("tritonshard::finalize_sum_sq_", mutates_args=("out",))
def _finalize_sum_sq_op(partial_sumsq: Tensor, partial_nonfinite: Tensor, out: Tensor) -> None:
    _finalize_sum_sq((partial_sumsq, partial_nonfinite), out)


@_finalize_sum_sq_op.register_fake
def _(*args):
    return None


@torch.library.custom_op("tritonshard::fold_rows_", mutates_args=("out", "partial_sumsq", "partial_nonfinite"))
def _fold_rows_op(rows: Tensor, out: Tensor, factor: float, partial_sumsq: Tensor, partial_nonfinite: Tensor) -> None:
    _fold_rows(rows, out, factor, (partial_sumsq, partial_nonfinite))


@_fold_rows_op.register_fake
def _(*args):
    return None


def _value(x: float, x_tensor: Optional[Tensor]):
    return x_tensor if x_tensor is not None else x


@torch.library.custom_op("tritonshard::adamw_step_",
                         mutates_args=("param", "exp_avg", "exp_avg_sq", "param_out"))
def _adamw_op(param: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, param_out: Optional[Tensor],
              lr: float, lr_tensor: Optional[Tensor], step: float, step_tensor: Optional[Tensor],
              grad_scale: float, grad_scale_tensor: Optional[Tensor], found_inf: Optional[Tensor],
              beta1: float, beta2: float, eps: float, weight_decay: float, maximize: bool, remainders: bool,
              state_rounding: str, seed: Optional[Tensor], coefficients: Optional[Tensor]) -> None:
    _adamw_step(param, grad, exp_avg, exp_avg_sq, lr=_value(lr, lr_tensor), step=_value(step, step_tensor),
                grad_scale=_value(grad_scale, grad_scale_tensor), found_inf=found_inf, param_out=param_out,
                beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, maximize=maximize,
                remainders=remainders, state_rounding=state_rounding, seed=seed, coefficients=coefficients)


@_adamw_op.register_fake
def _(*args):
    return None


@torch.library.custom_op("tritonshard::sgd_step_", mutates_args=("param", "momentum_buffer", "param_out"))
def _sgd_op(param: Tensor, grad: Tensor, momentum_buffer: Optional[Tensor], param_out: Optional[Tensor],
            lr: float, lr_tensor: Optional[Tensor], step: float, step_tensor: Optional[Tensor],
            grad_scale: float, grad_scale_tensor: Optional[Tensor], found_inf: Optional[Tensor],
            momentum: float, dampening: float, weight_decay: float, nesterov: bool, maximize: bool,
            remainders: bool, state_rounding: str, seed: Optional[Tensor]) -> None:
    _sgd_step(param, grad, momentum_buffer, lr=_value(lr, lr_tensor), step=_value(step, step_tensor),
              grad_scale=_value(grad_scale, grad_scale_tensor), found_inf=found_inf, param_out=param_out,
              momentum=momentum, dampening=dampening, weight_decay=weight_decay, nesterov=nesterov,
              maximize=maximize, remainders=remainders, state_rounding=state_rounding, seed=seed)


@_sgd_op.register_fake
def _(*args):
    return None


@torch.library.custom_op("tritonshard::lion_step_", mutates_args=("param", "exp_avg", "param_out"))
def _lion_op(param: Tensor, grad: Tensor, exp_avg: Tensor, param_out: Optional[Tensor], lr: float,
             lr_tensor: Optional[Tensor], grad_scale: float, grad_scale_tensor: Optional[Tensor],
             found_inf: Optional[Tensor], beta1: float, beta2: float, weight_decay: float, maximize: bool,
             remainders: bool, state_rounding: str, seed: Optional[Tensor]) -> None:
    _lion_step(param, grad, exp_avg, lr=_value(lr, lr_tensor), grad_scale=_value(grad_scale, grad_scale_tensor),
               found_inf=found_inf, param_out=param_out, beta1=beta1, beta2=beta2, weight_decay=weight_decay,
               maximize=maximize, remainders=remainders, state_rounding=state_rounding, seed=seed)


@_lion_op.register_fake
def _(*args):
    return None


@torch.library.custom_op("tritonshard::muon_momentum_", mutates_args=("momentum_buffer", "update_out"))
def _muon_momentum_op(grad: Tensor, momentum_buffer: Tensor, update_out: Tensor, momentum: float, nesterov: bool,
                      grad_scale: float, grad_scale_tensor: Optional[Tensor], found_inf: Optional[Tensor],
                      state_rounding: str, seed: Optional[Tensor]) -> None:
    _muon_momentum(grad, momentum_buffer, update_out, momentum=momentum, nesterov=nesterov,
                   grad_scale=_value(grad_scale, grad_scale_tensor), found_inf=found_inf,
                   state_rounding=state_rounding, seed=seed)


@_muon_momentum_op.register_fake
def _(*args):
    return None


@torch.library.custom_op("tritonshard::muon_update_", mutates_args=("param", "param_out"))
def _muon_update_op(param: Tensor, update: Tensor, param_out: Optional[Tensor], lr: float,
                    lr_tensor: Optional[Tensor], weight_decay: float, lr_ratio: float, found_inf: Optional[Tensor],
                    remainders: bool) -> None:
    _muon_update(param, update, lr=_value(lr, lr_tensor), weight_decay=weight_decay, lr_ratio=lr_ratio,
                 found_inf=found_inf, param_out=param_out, remainders=remainders)


@_muon_update_op.register_fake
def _(*args):
    return None


def _split(value) -> tuple[float, Optional[Tensor]]:
    return (0.0, value) if isinstance(value, Tensor) else (float(value), None)


def flatten_into(out: Tensor, tensors: Sequence[Tensor], offsets: Sequence[int], *, accumulate: bool = False,
                 scale: float = 1.0) -> None:
    """:func:`tritonshard.kernels.flatten_into` through ``torch.ops.tritonshard.flatten_into``."""
    torch.ops.tritonshard.flatten_into(out, list(tensors), [int(o) for o in offsets], accumulate, float(scale))


def scale_(x: Tensor, factor) -> tuple[Tensor, Tensor]:
    """:func:`tritonshard.kernels.scale_` through ``torch.ops.tritonshard.scale_``."""
    return torch.ops.tritonshard.scale_(x, *_split(factor))


def sum_sq_nonfinite(x: Tensor, factor=1.0) -> tuple[Tensor, Tensor]:
    """:func:`tritonshard.kernels.sum_sq_nonfinite` through ``torch.ops.tritonshard.sum_sq_nonfinite``."""
    return torch.ops.tritonshard.sum_sq_nonfinite(x, *_split(factor))


def sum_sq_partials_(x: Tensor, factor, partials) -> None:
    """:func:`tritonshard.kernels.sum_sq_partials_` through ``torch.ops.tritonshard.sum_sq_partials_``."""
    torch.ops.tritonshard.sum_sq_partials_(x, *_split(factor), partials[0], partials[1])


def fold_rows_(rows: Tensor, out: Tensor, factor: float, partials) -> None:
    """:func:`tritonshard.kernels.fold_rows_` through ``torch.ops.tritonshard.fold_rows_``."""
    torch.ops.tritonshard.fold_rows_(rows, out, float(factor), partials[0], partials[1])


def finalize_sum_sq_(partials, out: Tensor) -> None:
    """:func:`tritonshard.kernels.finalize_sum_sq_` through ``torch.ops.tritonshard.finalize_sum_sq_``."""
    torch.ops.tritonshard.finalize_sum_sq_(partials[0], partials[1], out)


def _seed(seed, device) -> Optional[Tensor]:
    if seed is None or isinstance(seed, Tensor):
        return seed
    return torch.full((1,), int(seed), dtype=torch.int64, device=device)


def adamw_step_(param, grad, exp_avg, exp_avg_sq, *, lr, beta1, beta2, eps, weight_decay, step, grad_scale=1.0,
                found_inf=None, param_out=None, maximize=False, remainders=False, state_rounding="nearest",
                seed=None, coefficients=None) -> None:
    """:func:`tritonshard.kernels.adamw_step_` through ``torch.ops.tritonshard.adamw_step_``."""
    torch.ops.tritonshard.adamw_step_(param, grad, exp_avg, exp_avg_sq, param_out, *_split(lr), *_split(step),
                                      *_split(grad_scale), found_inf, float(beta1), float(beta2), float(eps),
                                      float(weight_decay), bool(maximize), bool(remainders), state_rounding,
                                      _seed(seed, param.device), coefficients)


def sgd_step_(param, grad, momentum_buffer, *, lr, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False,
              step=1, grad_scale=1.0, found_inf=None, param_out=None, maximize=False, remainders=False,
              state_rounding="nearest", seed=None) -> None:
    """:func:`tritonshard.kernels.sgd_step_` through ``torch.ops.tritonshard.sgd_step_``."""
    torch.ops.tritonshard.sgd_step_(param, grad, momentum_buffer, param_out, *_split(lr), *_split(step),
                                    *_split(grad_scale), found_inf, float(momentum), float(dampening),
                                    float(weight_decay), bool(nesterov), bool(maximize), bool(remainders),
                                    state_rounding, _seed(seed, param.device))


def lion_step_(param, grad, exp_avg, *, lr, beta1=0.9, beta2=0.99, weight_decay=0.0, grad_scale=1.0,
               found_inf=None, param_out=None, maximize=False, remainders=False, state_rounding="nearest",
               seed=None) -> None:
    """:func:`tritonshard.kernels.lion_step_` through ``torch.ops.tritonshard.lion_step_``."""
    torch.ops.tritonshard.lion_step_(param, grad, exp_avg, param_out, *_split(lr), *_split(grad_scale), found_inf,
                                     float(beta1), float(beta2), float(weight_decay), bool(maximize),
                                     bool(remainders), state_rounding, _seed(seed, param.device))


def muon_momentum_(grad, momentum_buffer, update_out, *, momentum, nesterov=True, grad_scale=1.0, found_inf=None,
                   state_rounding="nearest", seed=None) -> None:
    """:func:`tritonshard.kernels.muon_momentum_` through ``torch.ops.tritonshard.muon_momentum_``."""
    torch.ops.tritonshard.muon_momentum_(grad, momentum_buffer, update_out, float(momentum), bool(nesterov),
                                         *_split(grad_scale), found_inf, state_rounding, _seed(seed, grad.device))


def muon_update_(param, update, *, lr, weight_decay=0.0, lr_ratio=1.0, found_inf=None, param_out=None,
                 remainders=False) -> None:
    """:func:`tritonshard.kernels.muon_update_` through ``torch.ops.tritonshard.muon_update_``."""
    torch.ops.tritonshard.muon_update_(param, update, param_out, *_split(lr), float(weight_decay), float(lr_ratio),
                                       found_inf, bool(remainders))
