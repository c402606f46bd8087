"""After the first steps, an optimizer step allocates nothing on the device but the norm it hands the user, and
copies nothing from the host (issue 20.6): what capturing the step in a CUDA graph needs, and fewer small ops for
the host to issue. Every per-step value (the reduction's sum of squares and flag, the clip coefficient, grad_scale,
found_inf, 1 - found_inf, the skip counters, AdamW's float64 coefficients, the loss-scale bookkeeping) is written in
place into a tensor made once.

The GPU code path on a CPU (dry-run driver, in a subprocess: tests/optim/steady_state_record.py), every aten op of
two steady-state steps recorded by a TorchDispatchMode. Before this, a ShardedAdamW step allocated 23 tensors.
"""

import pytest

from tests.helpers import run_compiled_record

CONFIGS = ["adamw", "adamw, bf16 states", "adamw, overlap_comm", "sgd", "lion", "adamw, fp16 with loss scaling"]


@pytest.fixture(scope="module")
def record():
    return {r["name"]: r for r in run_compiled_record("tests.optim.steady_state_record")}


@pytest.mark.parametrize("name", CONFIGS)
def test_a_steady_step_allocates_only_the_returned_norm_and_copies_nothing_from_the_host(record, name):
    r = record[name]
    assert r["buckets"] == 3
    # two recorded steps: clip_grad_norm_'s return value, one per step: a new 0-d tensor where the clip
    # coefficient's bound launch writes sqrt(sum of squares) (session 36; a clone of a buffer's sqrt before); with
    # loss scaling the norm's sqrt divided by the scale (the norm of the true gradients), by torch ops. It must be a
    # tensor of its own: torch's clip_grad_norm_ returns a new one, and a loop that keeps the norms (to log them
    # later) must see each step's
    returned = {"aten.sqrt": 2, "aten.div": 2} if "loss scaling" in name else {"aten.empty": 2}
    assert r["allocations"] == returned, r["allocations"]
    assert r["from_host"] == {}, r["from_host"]
    assert r["distinct_norms"] == r["norms"]
