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


#: the files whose tests take longest (whole training runs under torchrun, the GPU check's script: tens of seconds
#: each), collected first: pytest-xdist hands tests out in collection order, and these came last, so a worker could
#: end the suite running one of them alone while the other sat idle
_LONG_FIRST = ("tests/test_example.py", "tests/test_benchmarks.py")


def pytest_collection_modifyitems(items):
    items.sort(key=lambda item: not item.nodeid.startswith(_LONG_FIRST))  # (a stable sort: each part keeps its order)
