"""Test-wide setup.

Without a GPU the kernels are tested through the Triton interpreter, which must be switched on before triton is
first imported (triton.jit decides at decoration time). With a GPU, the compiled kernels are tested instead.
"""

import atexit
import gc
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tests import interpreter_speed  # noqa: E402  (after the switch: it imports triton)

interpreter_speed.install()  # the interpreter without its repeated patching (see there); the same results

# What is imported by now (torch, Triton, tritonshard, pytest: ~200,000 objects) is left out of the collector's
# full collections from here on: each one took ~0.12 s, ~1.4 s of a 7 s loop-fuzz run (gc.callbacks, session 51;
# 10-12 % of the wall time of the loop-fuzz and distributed tests measured before and after). The objects tests
# make are collected as before; unfrozen at exit, so that shutdown frees everything as usual (nanobind reports
# Triton's objects as leaked otherwise). The rank processes do the same (tests/distributed.py).
gc.freeze()
atexit.register(gc.unfreeze)


@pytest.fixture
def with_overlap_machinery():
    """overlap_comm's per-bucket machinery for the optimizers the test builds in this process, as on many ranks
    (tests.helpers.overlap_machinery): for the tests of that machinery."""
    from tests.helpers import overlap_machinery
    with overlap_machinery():
        yield
