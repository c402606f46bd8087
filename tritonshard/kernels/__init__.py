"""Fused Triton kernels for the memory-bound steps of a sharded mixed-precision optimizer step.

One family per module: private ``@triton.jit`` kernels, a validating launcher, and a ``*_ref`` PyTorch reference
that the tests import (and that runs on CPU without the interpreter). Backends: see :mod:`._dispatch`.
"""

from ._dispatch import Backend, interpreter_enabled, last_backend
from .adamw import adamw_coefficients, adamw_step_, adamw_step_ref
from .flatten import flatten_into, flatten_into_ref
from .lion import lion_step_, lion_step_ref
from .muon import (muon_momentum_, muon_momentum_ref, muon_update_, muon_update_ref, newton_schulz,
                   adjusted_lr_ratio)
from .rounding import cast_to_bf16, cast_to_bf16_ref, stochastic_cast_to_bf16_ref
from .scale import (finalize_sum_sq_, fold_rows_, fold_rows_ref, scale_, scale_ref, sum_sq_nonfinite,
                    sum_sq_nonfinite_ref, sum_sq_partials_, sum_sq_workspace)
from .sgd import sgd_step_, sgd_step_ref

__all__ = [
    "flatten_into", "flatten_into_ref",
    "scale_", "scale_ref", "sum_sq_nonfinite", "sum_sq_nonfinite_ref", "sum_sq_partials_", "finalize_sum_sq_",
    "sum_sq_workspace", "fold_rows_", "fold_rows_ref",
    "adamw_step_", "adamw_step_ref", "adamw_coefficients",
    "sgd_step_", "sgd_step_ref",
    "lion_step_", "lion_step_ref",
    "muon_momentum_", "muon_momentum_ref", "muon_update_", "muon_update_ref", "newton_schulz", "adjusted_lr_ratio",
    "cast_to_bf16", "cast_to_bf16_ref", "stochastic_cast_to_bf16_ref",
    "Backend", "last_backend", "interpreter_enabled",
]
