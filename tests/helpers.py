"""Comparison helpers shared by the tests: say how many elements differ, where, and NaN/Inf mismatches."""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_compiled_record(module: str, timeout: int = 600):
    """``python -m module`` with TRITON_INTERPRET unset (the compiled path through the dry-run driver, which this
    suite's own process, interpreter on, cannot take); returns the JSON it prints."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", module], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def _where(mask: torch.Tensor, limit: int = 5) -> str:
    idx = mask.nonzero().flatten()[:limit].tolist()
    return f"first at flat index {idx}"


def assert_bitwise_equal(actual: torch.Tensor, expected: torch.Tensor, what: str = "tensor") -> None:
    """Exact equality of values; NaN must match NaN (payload bits are not compared), +0 != -0."""
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    a, e = actual.detach().flatten().cpu(), expected.detach().flatten().cpu()
    a_nan, e_nan = a.isnan(), e.isnan()
    nan_mismatch = a_nan != e_nan
    int_dtype = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    bits_differ = (a.view(int_dtype) != e.view(int_dtype)) & ~(a_nan & e_nan)
    bad = nan_mismatch | bits_differ
    n = int(bad.sum())
    if n:
        i = int(bad.nonzero()[0])
        raise AssertionError(
            f"{what}: {n} of {a.numel()} elements differ ({int(nan_mismatch.sum())} NaN mismatches), "
            f"{_where(bad)}; e.g. [{i}] actual={a[i].item()!r} expected={e[i].item()!r}")


def assert_close_rel(actual: torch.Tensor, expected: torch.Tensor, rel: float, what: str = "tensor") -> None:
    """max |actual - expected| <= rel * max |expected| (both in float64), with non-finite positions equal."""
    a, e = actual.detach().double().flatten().cpu(), expected.detach().double().flatten().cpu()
    assert a.shape == e.shape, f"{what}: shape {tuple(a.shape)} != {tuple(e.shape)}"
    fin_a, fin_e = a.isfinite(), e.isfinite()
    assert torch.equal(fin_a, fin_e), f"{what}: non-finite positions differ, {_where(fin_a != fin_e)}"
    if not bool(fin_e.any()):
        return
    diff = (a - e).abs()[fin_e]
    scale = e.abs()[fin_e].max().clamp_min(torch.finfo(torch.float64).tiny)
    err = float(diff.max() / scale)
    if err > rel:
        i = int(diff.argmax())
        raise AssertionError(f"{what}: max|diff|/max|ref| = {err:.3e} > {rel:.1e}; "
                             f"{int((diff > rel * scale).sum())} of {diff.numel()} elements over, worst at finite "
                             f"index {i}")


def launcher_counts(prof) -> collections.Counter:
    """How often each kernel launcher ran under the torch profiler ``prof`` (its ``tritonshard.kernel.*`` ranges,
    by kernel name)."""
    return collections.Counter(e.name.removeprefix("tritonshard.kernel.") for e in prof.events()
                               if e.name.startswith("tritonshard.kernel."))


def overlap_machinery(on: bool = True):
    """Optimizers built inside get overlap_comm's per-bucket machinery also on one rank, as on many
    (``tritonshard.optim.base.overlap_machinery_on_one_rank``): each bucket flushed and its reduction launched as
    backward completes it, the all-gathers left in flight for the next forward, which waits for them module by
    module. One process has nothing to overlap, so without this it runs the plain path's backward and leaves no
    gather in flight; the tests of that machinery run it in one process with this (on many ranks it is there
    anyway)."""
    from tritonshard.optim.base import overlap_machinery_on_one_rank
    return overlap_machinery_on_one_rank(on)
