"""Test-wide setup.

Without a GPU the kernels are tested through the Triton interpreter, which must be switched on before triton is
first imported (triton.jit decides at decoration time). With a GPU, the compiled kernels are tested instead.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tests import interpreter_speed  # noqa: E402  (after the switch: it imports triton)

interpreter_speed.install()  # the interpreter without its repeated patching (see there); the same results


@pytest.fixture
def with_overlap_machinery():
    """overlap_comm's per-bucket machinery for the optimizers the test builds in this process, as on many ranks
    (tests.helpers.overlap_machinery): for the tests of that machinery."""
    from tests.helpers import overlap_machinery
    with overlap_machinery():
        yield
