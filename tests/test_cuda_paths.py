"""CUDA-only code paths that a CPU run never executes, checked by reading them (issue 21, item 2).

The first GPU run (H200, torch 2.11, 2026-11-30) crashed on two mistakes of one class that no CPU test could see:
``init_process_group(device_id=torch.device("cuda"))`` ("Please use a device_id with index") and CUDA memory-stat
calls given a device ("Invalid device argument"). Every CUDA device the library, the benchmarks and the examples
build comes from :func:`tritonshard.comm.local_device` (indexed), and the memory-stat calls take no argument.
"""

import ast
import pathlib

import pytest
import torch

from tritonshard.comm import local_device

ROOT = pathlib.Path(__file__).resolve().parents[1]
SOURCES = sorted(p for d in ("tritonshard", "benchmarks", "examples") for p in (ROOT / d).rglob("*.py"))
MEMORY_STATS = {"max_memory_allocated", "reset_peak_memory_stats", "memory_allocated", "max_memory_reserved",
                "memory_reserved", "memory_stats"}


def _calls(path):
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            yield node


def _name(func) -> str:
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""


def _mentions_cuda(node) -> bool:
    return any(isinstance(n, ast.Constant) and n.value == "cuda" for n in ast.walk(node))


def _problems(path) -> list[str]:
    bad = []
    for call in _calls(path):
        name = _name(call.func)
        if name == "device" and len(call.args) == 1 and not call.keywords and _mentions_cuda(call.args[0]):
            bad.append(f"line {call.lineno}: torch.device(...'cuda'...) without an index: use comm.local_device()")
        if name in MEMORY_STATS and (call.args or call.keywords):
            bad.append(f"line {call.lineno}: torch.cuda.{name}(<device>): call it without arguments on the "
                       "current device (torch.cuda.set_device first)")
    return bad


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_index_less_cuda_device_and_no_device_argument_to_memory_stats(path):
    bad = _problems(path)
    assert not bad, f"{path.relative_to(ROOT)}:\n" + "\n".join(bad)


def test_the_checker_finds_both_mistakes(tmp_path):  # the test above can fail
    f = tmp_path / "bad.py"
    f.write_text('import torch\nd = torch.device("cuda" if torch.cuda.is_available() else "cpu")\n'
                 'torch.cuda.max_memory_allocated(d)\nok = torch.device("cuda", 0)\n')
    problems = _problems(f)
    assert [p.split(":")[0] for p in problems] == ["line 2", "line 3"], problems


def test_local_device_is_indexed_on_cuda_and_cpu_otherwise():
    device = local_device()
    if torch.cuda.is_available():
        assert device.type == "cuda" and device.index is not None
    else:
        assert device == torch.device("cpu")
