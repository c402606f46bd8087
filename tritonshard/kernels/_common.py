"""What the fused optimizer-update launchers share: argument validation, scalar coefficients, found_inf."""

from __future__ import annotations

import contextlib
import math
import numbers
from typing import Sequence

import torch

from .rounding import combine_bf16_remainder, split_bf16_remainder, stochastic_cast_to_bf16_ref

__all__ = ["check_scalar", "check_no_tensor", "check_found_inf", "validate_update", "pack_coefficients",
           "fill_one_minus_product", "fill_negated", "keep_old_where_found_inf", "master_view", "check_rounding",
           "seed_tensor", "host_seed"]


def check_scalar(name, value, device, lo, lo_inclusive=True, hi=None) -> None:
    """``value``: a finite number in [lo, hi) (or (lo, hi)), or a 1-element tensor on ``device``."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"{name} must be a number or a 1-element tensor, got shape {tuple(value.shape)}")
        if value.device != device:
            raise ValueError(f"{name} is on {value.device} but param is on {device}")
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number or a 1-element tensor, got {type(value).__name__}")
    if not math.isfinite(value) or (value < lo if lo_inclusive else value <= lo) or (hi is not None and value >= hi):
        bound = f"{'>=' if lo_inclusive else '>'} {lo}" + (f" and < {hi}" if hi is not None else "")
        raise ValueError(f"{name} must be {bound}, got {value}")


def check_no_tensor(**values) -> None:
    for name, value in values.items():
        if isinstance(value, torch.Tensor):
            raise TypeError(f"{name} must be a Python number (it is passed by value to the kernel), got a tensor")


def validate_update(param: torch.Tensor, grad: torch.Tensor, states: Sequence[tuple[str, torch.Tensor]],
                    found_inf, param_out, grad_scale, remainders: bool = False) -> None:
    """The tensors of a flat-shard update: fp32 param (int16 remainders with ``remainders``) and states,
    bf16/fp16/fp32 grad, optional bf16/fp16 param_out (required bf16 with ``remainders``), all contiguous, same
    numel, same device; found_inf a 1-element tensor there."""
    named = [("param", param), ("grad", grad), *states]
    for name, t in named:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if remainders:
        if param.dtype != torch.int16:
            raise TypeError(f"with remainders=True, param holds the int16 remainders, got {param.dtype}")
        if not isinstance(param_out, torch.Tensor) or param_out.dtype != torch.bfloat16:
            raise TypeError("with remainders=True, param_out must be the bf16 weights (the master's high half)")
    if not remainders and param.dtype != torch.float32:
        raise TypeError(f"param must be float32, got {param.dtype}")
    for name, t in states:
        if t.dtype not in (torch.float32, torch.bfloat16):
            raise TypeError(f"{name} must be float32 or bfloat16, got {t.dtype}")
    if grad.dtype not in (torch.bfloat16, torch.float32, torch.float16):
        raise TypeError(f"grad must be bfloat16, float16 or float32, got {grad.dtype}")
    if param_out is not None:
        if not isinstance(param_out, torch.Tensor):
            raise TypeError(f"param_out must be a torch.Tensor or None, got {type(param_out).__name__}")
        if param_out.dtype not in (torch.bfloat16, torch.float16):
            raise TypeError(f"param_out must be bfloat16 or float16, got {param_out.dtype}")
        named.append(("param_out", param_out))
    for name, t in named:
        if t.numel() != param.numel():
            raise ValueError(f"{name} has {t.numel()} elements but param has {param.numel()}")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
        if t.device != param.device:
            raise ValueError(f"{name} is on {t.device} but param is on {param.device}")
    check_disjoint(named)
    check_found_inf(found_inf, param.device, "param")
    check_scalar("grad_scale", grad_scale, param.device, -math.inf)


def check_disjoint(named: Sequence[tuple[str, torch.Tensor]]) -> None:
    """The contiguous tensors of one update share no memory: the kernel reads each element of every input and
    writes the outputs in the same pass, so ``exp_avg`` given as ``param`` (or any two sharing bytes) would leave
    values that are no update's, silently (until session 49 nothing said so)."""
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), name) for name, t in named
                   if t.numel())
    for (s0, e0, a), (s1, e1, b) in zip(spans, spans[1:]):
        if s1 < e0:
            raise ValueError(f"{a} and {b} share memory: an update's tensors must be distinct")


def check_found_inf(found_inf, device, beside: str) -> None:
    """``found_inf``: None, or a 1-element tensor on ``device``, the device of the tensor named ``beside``."""
    if found_inf is not None:
        if not isinstance(found_inf, torch.Tensor) or found_inf.numel() != 1:
            raise ValueError("found_inf must be None or a 1-element tensor")
        if found_inf.device != device:
            raise ValueError(f"found_inf is on {found_inf.device} but {beside} is on {device}")


#: the smallest normal fp32 number: Triton gives a Python float argument below it (or above fp32's largest) an fp64
#: parameter, a specialization of its own in which the kernels' bf16 rounding (a bitcast of an fp32) does not hold
FP32_TINY = float(torch.finfo(torch.float32).tiny)  # (2^-126)


def _fp32_normal(value: float) -> float:
    """``value`` as the kernels take a coefficient: a magnitude below fp32's normal range is 0 (an lr decayed there,
    by ExponentialLR over a long run, moves no fp32 master of a normal magnitude: torch.optim's fp32 step leaves
    them too). Until session 52 ShardedSGD's launch failed on one ("Cannot bitcast data-type of size 64")."""
    return value if not 0.0 < abs(value) < FP32_TINY else 0.0 * value


def pack_coefficients(parts: list, device: torch.device):
    """Per-call scalar coefficients, computed by the caller in float64 (Python floats or 0-d tensors).

    Returns ``(None, floats)`` when all are Python numbers (passed by value to the kernel), else
    ``(fp32 device tensor, None)`` built with device ops only: no host sync, no H2D copy.
    """
    if not any(isinstance(p, torch.Tensor) for p in parts):
        return None, tuple(_fp32_normal(float(p)) for p in parts)
    parts = [p.to(torch.float64).reshape(()) if isinstance(p, torch.Tensor)
             else torch.full((), p, dtype=torch.float64, device=device) for p in parts]
    return torch.stack(parts).to(torch.float32), None


def fill_one_minus_product(out: torch.Tensor, lr, factor: float, scratch: torch.Tensor) -> torch.Tensor:
    """``out.fill_(1.0 - lr * factor)`` where ``lr`` is a number; where it is a float64 0-d tensor, the same float64
    product and difference on the device (through ``scratch``, a float64 0-d tensor), rounded to ``out``'s dtype
    once by the copy: the same bits, and no number for a CUDA graph to freeze."""
    if isinstance(lr, torch.Tensor):
        return out.copy_(torch.mul(lr, factor, out=scratch).neg_().add_(1.0))
    return out.fill_(1.0 - lr * factor)


def fill_negated(out: torch.Tensor, lr) -> torch.Tensor:
    """``out.fill_(-lr)`` where ``lr`` is a number; from a float64 0-d tensor, the same bits (negation is exact,
    and rounding to ``out``'s dtype commutes with it)."""
    if isinstance(lr, torch.Tensor):
        return out.copy_(lr).neg_()
    return out.fill_(-lr)

def keep_old_where_found_inf(found_inf, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]],
                             stochastic_seed: int | None = None, states: int = 0) -> None:
    """Reference helper: copy each ``new`` into its ``dst``, except where ``found_inf`` is set (sync-free).

    Casting to a bf16 ``dst`` rounds to nearest even; the first ``states`` pairs (the optimizer states) round
    stochastically instead when ``stochastic_seed`` is given, with torch's RNG seeded from it (same distribution as
    the kernels, different random bits). The weights (``param_out``) always round to nearest, as in the kernels:
    before issue 23 the reference rounded bf16 weights stochastically too (26,337 of 105,024 differed from the
    rounding of the master)."""
    keep = found_inf.reshape(()) != 0 if found_inf is not None else None
    for k, (dst, new) in enumerate(pairs):
        if stochastic_seed is not None and k < states and dst.dtype == torch.bfloat16:
            gen = torch.Generator(device=new.device).manual_seed(stochastic_seed + k)
            new = stochastic_cast_to_bf16_ref(new, gen)
        new = new.to(dst.dtype)
        dst.copy_(new if keep is None else torch.where(keep, dst, new))


def check_rounding(state_rounding: str, seed, device) -> None:
    if state_rounding not in ("nearest", "stochastic"):
        raise ValueError(f"state_rounding must be 'nearest' or 'stochastic', got {state_rounding!r}")
    if state_rounding == "stochastic":
        if isinstance(seed, torch.Tensor):
            if seed.numel() != 1 or seed.dtype != torch.int64 or seed.device != device:
                raise ValueError(f"seed must be an int or a 1-element int64 tensor on {device}")
        elif isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"state_rounding='stochastic' needs seed=int or a 1-element int64 tensor, got {seed!r}")


def seed_tensor(seed, device) -> torch.Tensor:
    """The stochastic-rounding seed as the 1-element int64 device tensor the kernels read."""
    if isinstance(seed, torch.Tensor):
        return seed
    return torch.full((1,), int(seed), dtype=torch.int64, device=device)


def host_seed(seed) -> int:
    """For the CPU references only: the seed as a Python int (reads a CPU tensor, no device sync)."""
    return int(seed.reshape(-1)[0]) if isinstance(seed, torch.Tensor) else int(seed)


@contextlib.contextmanager
def master_view(param: torch.Tensor, param_out, remainders: bool):
    """For the references: yield (fp32 master, param_out to write); with remainders, rebuild the master from the
    bf16 weights and int16 remainders, and split it back on exit (an exact round trip, see rounding.py)."""
    if not remainders:
        yield param, param_out
        return
    master = combine_bf16_remainder(param_out, param)
    yield master, None
    hi, rem = split_bf16_remainder(master)
    param_out.copy_(hi)
    param.copy_(rem)

