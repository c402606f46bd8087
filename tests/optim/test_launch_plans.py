"""Bound launches (issue 20): the optimizer's hot path hands Triton's compiled launcher exactly what Triton's own
dispatch would, and rebinds when an argument changes.

A ShardedAdamW step runs through the compiled path on a CPU (benchmarks.compile_check's dry-run driver: every
specialization compiled for sm_90, nothing launched; in a subprocess, as the suite's own process has the Triton
interpreter on), and every launch's arguments are recorded: grid, stream, the kernel's arguments (tensors by
address, dtype and shape; floats by their bits). The replayed steps must equal the steps through Triton's
dispatch, launch by launch, and must really be replays.
"""

import pytest

from tests.helpers import run_compiled_record
from tritonshard.kernels.adamw import _double_bits
# 1 flatten of every bucket's gradients + 1 norm pass over every bucket's shard + 2 param groups' updates (group
# 1's two buckets in one segmented launch) + 1 finalize (issue 20.3) + 2 param groups' AdamW coefficients (session 31)
# + 1 launch of the step's scalars and 1 of the clip's coefficient (kernels/scalars.py, session 34)
LAUNCHES_PER_STEP = 9
BOUND_PER_STEP = 9       # every one, the finalize, the coefficients and the scalars too
BOUND_WITHOUT_CLIP = 8   # (a step the loop did not clip: no clip coefficient)
BETA1_ARG = 9 + 14       # the launcher's 9 leading arguments, then _adamw_kernel's beta1
LR_ARG = 9 + 2           # ... _coefficients_kernel's lr (its double's bits)
NORM_ARG = 9 + 0         # ... _clip_coefficient_kernel's norm (the tensor the clip returns)
BETA_BITS_ARGS = (9 + 5, 9 + 6)  # ... _coefficients_kernel's betas (their doubles' bits)
#: ... SGD's and Lion's floats that follow the lr (their kernels' coefficient arguments, taken as floats outside
#: a captured step)
LR_FLOATS = {"_sgd_kernel": {9 + 6: "-lr"}, "_lion_kernel": {9 + 6: "1 - lr * weight_decay", 9 + 7: "-lr"}}


def _per_step_values_checked(step: dict) -> list:
    """``step``'s launches with the arguments that change at every step checked and then blanked, so that steps
    compare argument by argument: each AdamW coefficients launch's lr, against its group's lr at that step (the
    groups in order; the scheduler changes it every step), SGD's and Lion's lr-derived floats (-lr; Lion's
    1 - lr * weight_decay, float64 math), and the clip's norm, the tensor the clip returned (a new one per call).
    A bound launch takes them afresh at each call (kernels/_launch.py: floats, and ``live`` arguments)."""
    lrs = iter(step["lrs"])
    out = []
    for name, args in step["launches"]:
        if name == "_coefficients_kernel":
            lr = next(lrs)
            assert args[LR_ARG] == _double_bits(lr), f"the coefficients launch's lr is not {lr!r}, this step's"
            args = args[:LR_ARG] + ["this step's lr"] + args[LR_ARG + 1:]
        elif name in LR_FLOATS:  # (one group in these records)
            (lr,), (decay,) = step["lrs"], step["decays"]
            want = {"-lr": -lr, "1 - lr * weight_decay": 1.0 - lr * decay}
            args = list(args)
            for i, what in LR_FLOATS[name].items():
                assert args[i] == ["float", want[what].hex()], f"{name}'s {what} is not this step's"
                args[i] = f"this step's {what}"
        elif name == "_clip_coefficient_kernel":
            assert args[NORM_ARG] == step["norm"], "the clip's launch did not write the norm the clip returned"
            args = args[:NORM_ARG] + ["this clip's norm"] + args[NORM_ARG + 1:]
        out.append([name, args])
    if any(name == "_coefficients_kernel" for name, _ in out):  # (AdamW's: SGD and Lion have none)
        assert next(lrs, None) is None, "a group without its coefficients launch"
    return out


@pytest.fixture(scope="module")
def record():
    return run_compiled_record("tests.optim.launch_record")


def _assert_same_launches(want: list, step: dict) -> None:
    """``step``'s launches, their per-step values checked and blanked (:func:`_per_step_values_checked`), equal
    ``want`` (already checked), argument by argument."""
    got = _per_step_values_checked(step)
    assert got == want, _diff(want, got)


def _diff(a, b) -> str:
    for i, ((n1, x), (n2, y)) in enumerate(zip(a, b)):
        if n1 != n2 or x != y:
            where = [(j, p, q) for j, (p, q) in enumerate(zip(x, y)) if p != q][:3]
            return f"launch {i} ({n1} vs {n2}): argument (index, dispatch, bound) {where}"
    return f"{len(a)} vs {len(b)} launches"


def test_replayed_launches_equal_tritons_dispatch(record):
    assert record["buckets"] == 3
    dispatch = _per_step_values_checked(record["triton_dispatch"][1])
    assert len(dispatch) == LAUNCHES_PER_STEP
    assert record["triton_dispatch"][1]["replays"] == 0
    for step in record["bound"]:
        assert step["replays"] == BOUND_PER_STEP, "the bound steps must replay, not dispatch"
        _assert_same_launches(dispatch, step)
    # the launches were bound (checked once) while dispatching; the first step with replays on records them while
    # launching through Triton's dispatch, the next replays
    assert [s["replays"] for s in record["binding"]] == [0, BOUND_PER_STEP]
    for step in record["binding"]:
        _assert_same_launches(dispatch, step)
    assert len({lr for s in record["bound"] + record["binding"] for lr in s["lrs"]}) >= 4, "the lr must change"


def test_a_changed_hyperparameter_replays_with_its_new_value(record):
    """New betas (torch's OneCycleLR cycles beta1 every step, SGD's momentum likewise): every launch still replays
    (the updates' floats and the coefficients' bits are taken afresh at each call: kernels/_launch.py), handing the
    launcher what Triton's dispatch does at the new betas. Until session 36 each change went through every bucket's
    checked launcher and built the segmented launch's tables anew: ~15 ms per step at the 125M layout when the
    betas changed every step."""
    steps = record["new_betas"]
    (dispatch,) = record["new_betas_triton_dispatch"]
    assert dispatch["replays"] == 0
    for step in steps:
        assert step["replays"] == BOUND_PER_STEP, "a new beta must replay, not bind anew"
        updates = [args for name, args in step["launches"] if name == "_adamw_kernel"]
        assert len(updates) == 2 and all(args[BETA1_ARG] == ["float", (0.8).hex()] for args in updates)
        coefficients = [args for name, args in step["launches"] if name == "_coefficients_kernel"]
        assert all(args[BETA_BITS_ARGS[0]] == _double_bits(0.8) and args[BETA_BITS_ARGS[1]] == _double_bits(0.99)
                   for args in coefficients) and len(coefficients) == 2
        _assert_same_launches(_per_step_values_checked(dispatch), step)
    # and the steps before, at the old betas, handed the old ones
    before = [args for name, args in record["bound"][-1]["launches"] if name == "_adamw_kernel"]
    assert all(args[BETA1_ARG] == ["float", (0.9).hex()] for args in before)


def test_grad_scale_turning_into_a_number_rebinds_to_the_same_launch_as_dispatch(record):
    *_, last_bound = record["no_clip"]
    (dispatch,) = record["no_clip_triton_dispatch"]
    assert last_bound["replays"] == BOUND_WITHOUT_CLIP
    _assert_same_launches(_per_step_values_checked(dispatch), last_bound)


def test_the_flatten_plan_is_not_reused_for_a_non_contiguous_gradient_at_the_same_address(record):
    """The flatten finds its last plan by the gradients' addresses (issue 20.5: ~0.2 us per tensor instead of ~2).
    g.t() has g's address but not its layout: its launch must read a contiguous copy, not g in g's order."""
    rec = record["transposed"]
    g = rec["grad_address"]
    contiguous = [[[g]]] * 3 + [None, [[g]]]
    for i, (tables, want) in enumerate(zip(rec["tables"], contiguous)):
        assert len(tables) == 1, f"step {i}: one flatten launch"
        if want is None:
            assert tables[0] != [g], "the transposed gradient was flattened from its own address, in g's order"
        else:
            assert tables == want, f"step {i}: {tables}"


def test_gradients_at_new_addresses_replay_the_flatten_through_its_rewritten_table(record):
    """Every step's gradients at new addresses (the H200's end-of-backward flushes: 0.6-1.1 ms of host time per
    flush went to rebuilding the plan and Triton's checked launch, 2026-12-04): from the third step on, every launch
    replays, the flatten's too, and the table it reads holds this step's addresses."""
    steps = record["new_addresses"]["steps"]
    for i, s in enumerate(steps):
        assert s["table"] == [s["addresses"]], f"step {i}: the flatten read {s['table']}, not {s['addresses']}"
    assert len({tuple(s["addresses"]) for s in steps}) == len(steps), "the gradients' addresses must differ"
    for i, s in enumerate(steps[2:], start=2):
        assert s["replays"] == s["launches"], f"step {i}: {s['replays']} of {s['launches']} launches replayed"


@pytest.mark.parametrize("name, kernel", [("sgd", "_sgd_kernel"), ("lion", "_lion_kernel"),
                                          ("adamw_overlap", "_adamw_kernel")])
def test_sgd_and_lion_updates_are_bound_too(record, name, kernel):
    """ShardedSGD's and ShardedLion's updates replay like AdamW's (they went through the checked launcher every
    step), with the lr a scheduler changes every step taken as the kernels' float arguments (-lr, and Lion's
    1 - lr * weight_decay): the replayed steps hand the launcher what Triton's dispatch does at each step's lr, and
    every launch of a step replays. So does ShardedAdamW's with
    overlap_comm, whose updates are one segmented launch too (its collectives are per bucket, its launches not)."""
    rec = record[name]
    dispatch = rec["dispatch"][-1]["launches"]
    # for both buckets: one flatten, one norm pass, one update (a segmented launch), one finalize, one of the
    # clip's coefficient, one of the step's scalars; AdamW's coefficients one more
    assert rec["buckets"] == 2
    per_step = 7 if name.startswith("adamw") else 6
    assert len(dispatch) == per_step and sum(n == kernel for n, _ in dispatch) == 1
    *_, replayed = rec["bound"]
    assert replayed["replays"] == per_step, "every launch must replay"
    _assert_same_launches(_per_step_values_checked(rec["dispatch"][-1]), replayed)


def test_torchs_clip_reads_the_gradients_once(record):
    """torch's clip_grad_norm_ over param.grad (HF Trainer's): the step's norm pass cuts its blocks at each
    parameter's piece of the shards, so the per-parameter norms torch asks for add up its partials (one
    _segment_sums_kernel) instead of a second norm pass over every gradient (session 38). After a clamp
    (clip_grad_value_, which writes the shards after the reduction) they are read again."""
    rec = record["torch_clip"]
    assert rec["buckets"] == 4
    steps = rec["steps"]
    for step in steps[1:3] + steps[4:6]:  # (the first of each kind binds: its checked launchers, one per piece)
        kernels = step["kernels"]
        reads = kernels.count("_partials_multi_kernel")
        assert reads == (2 if step["clamp"] else 1), kernels
        assert kernels.count("_segment_sums_kernel") == 1 and kernels.count("_finalize_kernel") == 1, kernels
        assert "_scale_kernel" not in kernels, kernels
