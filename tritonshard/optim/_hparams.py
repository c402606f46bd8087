"""Hyper-parameter checks shared by the optimizer front ends: ValueError/TypeError naming the value and group."""

from __future__ import annotations

import math
import numbers

import torch


def _is_number(x) -> bool:
    return type(x) is float or (isinstance(x, numbers.Real) and not isinstance(x, bool))  # (float: no ABC check)


# (lr and the checked minimums: finiteness as comparisons with inf, not math.isfinite, and the message formatted only
# on failure: a value that changes between compiled steps, a scheduler's lr, reaches dynamo as a symbolic float, on
# which math.isfinite and f-strings break the graph, and comparisons become guards. NaN fails every comparison.)


#: the largest fp32 number: a hyper-parameter the kernels take in fp32 stays below it
FP32_MAX = float(torch.finfo(torch.float32).max)


def require(ok: bool, msg: str, where: str) -> None:
    if not ok:
        raise ValueError(msg + where)


def check_lr(lr, where: str) -> None:
    """A number >= 0, or a 1-element tensor (read on the device, so a changing lr needs no recompile), as
    torch.optim takes: its value is checked where that costs no device sync (a CPU tensor, not under
    torch.compile). Until session 46 any tensor passed: a 2-element one failed inside step() with "shape '[]' is
    invalid for input of size 2", and a negative one, which torch.optim refuses, trained uphill, silently."""
    if isinstance(lr, torch.Tensor):
        if lr.numel() != 1:
            raise ValueError(f"lr must be a number or a 1-element tensor, got a tensor of shape {tuple(lr.shape)}"
                             f"{where}")
        if lr.device.type == "cpu" and not torch.compiler.is_compiling() and not 0 <= float(lr) < math.inf:
            raise ValueError(f"lr must be >= 0 and finite, got {float(lr)} (a tensor){where}")
        return
    if not _is_number(lr):
        raise TypeError(f"lr must be a number or a 1-element tensor, got {type(lr).__name__}{where}")
    if not 0 <= lr < FP32_MAX:  # (the kernels take it in fp32: a larger one failed in ShardedSGD's launch)
        raise ValueError(f"lr must be >= 0 and finite, got {lr}"
                         f"{' (the kernels take it in fp32, whose largest number is 3.4e38)' if lr >= FP32_MAX else ''}"
                         f"{where}")


def _no_tensor(name: str, value, where: str) -> None:
    """Only lr may be a tensor (read on the device at every step); the other hyper-parameters are numbers the
    launches are built from, as torch.optim's (whose fused and capturable paths take tensor betas: named here,
    where "must be in [0, 1), got tensor(0.9000)" said nothing of why)."""
    if isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a Python number, got a tensor ({value!r}): only lr may be a tensor here; "
                        f"pass float(...){where}")


def check_betas(betas, where: str) -> None:
    # (each step checks every group: the messages are formatted only for a value that fails)
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
        raise ValueError(f"betas must be a pair (beta1, beta2), got {betas!r}{where}")
    for i, b in enumerate(betas):
        if not (_is_number(b) and 0.0 <= b < 1.0):
            _no_tensor(f"betas[{i}]", b, where)
            raise ValueError(f"betas[{i}] must be in [0, 1), got {b!r}{where}")


def check_min(name: str, value, where: str, lo: float = 0.0, strict: bool = False) -> None:
    if not (_is_number(value) and (value > lo if strict else value >= lo) and value < math.inf):
        _no_tensor(name, value, where)
        raise ValueError(f"{name} must be {'>' if strict else '>='} {lo:g} and finite, got {value!r}{where}")


def check_flag(name: str, value, where: str) -> None:
    """True or False, as ShardedMuon's ``nesterov`` (until session 50 ``maximize`` and SGD's ``nesterov`` took any
    value's truth, as torch.optim does: ``maximize="False"`` from a config file trained uphill, silently)."""
    if type(value) is not bool:
        raise TypeError(f"{name} must be True or False, got {value!r}{where}")


def check_number(name: str, value, where: str) -> None:
    """A finite number, of any sign (SGD's dampening: torch.optim takes any; a NaN one made NaN buffers there, and
    here failed in the kernel's launcher after the gradients were reduced, until session 52)."""
    if not (_is_number(value) and -math.inf < value < math.inf):
        _no_tensor(name, value, where)
        raise ValueError(f"{name} must be a finite number, got {value!r}{where}")
