"""Backend selection for the kernel launchers: chosen by device and an explicit argument, and observable.

* CUDA tensors: the compiled Triton kernels (``Backend.TRITON``).
* CPU tensors with ``TRITON_INTERPRET=1`` set before triton was imported: the same Triton kernels through the
  interpreter (``Backend.INTERPRETER``): how the tests check the real kernels without a GPU.
* CPU tensors otherwise: the pure-PyTorch reference (``Backend.TORCH``), so a CPU user can train with gloo.

``backend="torch"`` forces the reference anywhere; ``backend="triton"`` refuses to fall back. Every launch records
what ran (:func:`last_backend`) and logs the first use of each (op, backend) pair on the ``tritonshard.kernels``
logger.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import logging
from typing import Iterator, Optional

import torch
import triton
from triton.runtime.interpreter import InterpretedFunction

__all__ = ["Backend", "select_backend", "last_backend", "interpreter_enabled", "compile_for_target"]

log = logging.getLogger("tritonshard.kernels")


class Backend(str, enum.Enum):
    TRITON = "triton"
    INTERPRETER = "triton-interpreter"
    TORCH = "torch"


@triton.jit
def _probe():
    pass


# triton.jit returns an InterpretedFunction when TRITON_INTERPRET=1 was set at decoration time. Every kernel in
# this package is decorated at import of the package, so this one probe says how all of them will run.
_INTERPRETED = isinstance(_probe, InterpretedFunction)
_FORCED_COMPILE = False  # set by compile_for_target(): launch the compiled kernels on CPU tensors (dry-run driver)
_LAST: dict[str, Backend] = {}
_LOGGED: set[tuple[str, Backend]] = set()


def interpreter_enabled() -> bool:
    """True when this process's Triton kernels run through the CPU interpreter."""
    return _INTERPRETED


def quiet_interpreter(*errors: str):
    """A context in which the interpreter's numpy ignores these floating-point ``errors`` ("divide", "invalid",
    "over"), which a GPU computes without a word, as torch's ops do (a warning would be an error in the tests);
    nothing where the kernels are compiled."""
    if not _INTERPRETED:
        return contextlib.nullcontext()
    import numpy  # (the interpreter's, imported only where it runs)
    return numpy.errstate(**dict.fromkeys(errors, "ignore"))


def select_backend(op: str, device: torch.device, backend: Optional[str] = None) -> Backend:
    """Pick the backend for ``op`` on ``device`` and record it. ``backend``: None/"auto", "triton" or "torch"."""
    if backend not in (None, "auto", "triton", "torch"):
        raise ValueError(f"backend must be None, 'auto', 'triton' or 'torch', got {backend!r}")
    if backend == "torch":
        chosen = Backend.TORCH
    elif _INTERPRETED:
        chosen = Backend.INTERPRETER
    elif device.type == "cuda" or _FORCED_COMPILE:
        chosen = Backend.TRITON
    elif backend == "triton":
        raise ValueError(f"backend='triton' for {op} on {device} needs a CUDA device, or TRITON_INTERPRET=1 set "
                         "before triton is imported")
    else:
        chosen = Backend.TORCH
    _LAST[op] = chosen
    if (op, chosen) not in _LOGGED:
        _LOGGED.add((op, chosen))
        log.info("tritonshard.kernels.%s runs on %s (%s)", op, device, chosen.value)
    return chosen


@contextlib.contextmanager
def compile_for_target() -> Iterator[None]:
    """Inside: CPU tensors take the compiled-Triton path. Only for ``benchmarks.compile_check``, which installs a
    driver that compiles each launch for a chosen GPU and launches nothing; with Triton's real driver on a machine
    without a GPU, a launch here fails."""
    global _FORCED_COMPILE
    if _INTERPRETED:
        raise RuntimeError("compile_for_target() needs TRITON_INTERPRET unset when triton is imported")
    previous, _FORCED_COMPILE = _FORCED_COMPILE, True
    try:
        yield
    finally:
        _FORCED_COMPILE = previous


def compiled_path(device: torch.device) -> bool:
    """Whether a launch on ``device`` would run the compiled Triton kernels (``Backend.TRITON``) by default: where
    the optimizer may bind its launches once (:mod:`._launch`). Records nothing."""
    return not _INTERPRETED and (device.type == "cuda" or _FORCED_COMPILE)


def triton_kernels_run(device: torch.device) -> bool:
    """Whether the optimizer's own launches on ``device`` run the Triton kernels, eagerly: compiled, or through the
    interpreter (where the CPU tests run them), and not while torch.compile traces (which records the custom ops,
    or the torch ops). What its merged and single-program launches (one flatten for every bucket, a segmented
    update per group, the step's scalars, AdamW's coefficients) are for."""
    return (compiled_path(device) or _INTERPRETED) and not torch.compiler.is_compiling()


def last_backend(op: str) -> Optional[Backend]:
    """The backend the last call of ``op`` ("flatten_into", "scale_", "adamw_step_", "cast_to_bf16") used."""
    return _LAST.get(op)


def traced(fn):
    """A launcher that runs inside the profiler range ``tritonshard.kernel.<name>`` while a profiler records (one
    flag read otherwise). Traces then show each launch; the op-count test (tests/optim/test_step_overhead.py) tells
    the kernels' own work (and, on a CPU, the interpreter's or the reference's ops) from the optimizer's."""
    label = f"tritonshard.kernel.{fn.__name__}"

    @functools.wraps(fn)
    def launcher(*args, **kwargs):
        if torch.autograd.profiler._is_profiler_enabled:
            with torch.profiler.record_function(label):
                return fn(*args, **kwargs)
        return fn(*args, **kwargs)
    return launcher
