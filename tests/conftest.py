"""Test-wide setup.

Without a GPU the kernels are tested through the Triton interpreter, which must be switched on before triton is
first imported (triton.jit decides at decoration time). With a GPU, the compiled kernels are tested instead.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tests import interpreter_speed  # noqa: E402  (after the switch: it imports triton)

interpreter_speed.install()  # the interpreter without its repeated patching (see there); the same results
