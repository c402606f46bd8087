"""kernels.scalars (the step's scalars in one launch each) against the torch ops they replace in
ShardedOptimizer.step, bit for bit: compiled on a GPU, through the interpreter here."""

import math
import random

import pytest
import torch

from tests.helpers import assert_bitwise_equal
from tests.kernels.common import DEVICE
from tritonshard.kernels import _dispatch, _launch
from tritonshard.kernels.scalars import (CLIP_NORM_ARG, clip_coefficient_, clip_coefficient_launch_spec,
                                         clip_coefficient_ref, counter_table, round_totals_, round_totals_launch_spec,
                                         round_totals_ref, step_flags_, step_flags_launch_spec, step_flags_ref)

pytestmark = pytest.mark.skipif(not (_dispatch.interpreter_enabled() or DEVICE.type == "cuda"),
                                reason="the kernels run compiled on a GPU or through the interpreter (CI sets it)")

INF, NAN = float("inf"), float("nan")


def test_the_rounded_totals_have_the_torch_ops_bits():
    """The all-reduced fp64 totals (sum of squares, non-finite count over the ranks) as the fp32 sum and flag: sums
    that round up, down and to even, beyond fp32's range (inf), below it (0, subnormals), inf and NaN; counts 0 to
    4."""
    rng = random.Random(7)
    sums = [0.0, 1.0, 1 + 2 ** -24, 1 + 3 * 2 ** -25, 1 + 2 ** -25, 3.4028235677973366e38, 1e39, 1e-46, 1e-40, INF,
            NAN] + [10 ** rng.uniform(-50, 40) * rng.random() for _ in range(40)]
    out = torch.empty(2, dtype=torch.float32, device=DEVICE)
    launches: dict = {}
    for i, total in enumerate(sums):
        totals = torch.tensor([total, float(i % 5)], dtype=torch.float64, device=DEVICE)
        want = torch.empty(2, dtype=torch.float32, device=DEVICE)
        round_totals_ref(totals, want)
        out.fill_(-7.0)
        round_totals_(totals, out)
        assert_bitwise_equal(out, want, f"totals ({total!r}, {i % 5})")
        out.fill_(-7.0)  # the launch the optimizer binds (the interpreter takes Triton's dispatch)
        _launch.launch(launches, "totals", round_totals_launch_spec(totals, out), lambda: round_totals_(totals, out))
        assert_bitwise_equal(out, want, f"bound: totals ({total!r}, {i % 5})")
    # (the reference's values: the flag is 1 from one rank that found a non-finite value on, the sum rounded once)
    round_totals_ref(torch.tensor([1 + 3 * 2 ** -25, 2.0], dtype=torch.float64), want := torch.empty(2))
    assert want.tolist() == [1 + 2 ** -23, 1.0]
    with pytest.raises(ValueError, match="totals must be a contiguous torch.float64 tensor of 2 elements"):
        round_totals_(torch.zeros(2, device=DEVICE), out)
    with pytest.raises(ValueError, match="out must be a contiguous torch.float32 tensor of 2 elements"):
        round_totals_(torch.zeros(2, dtype=torch.float64, device=DEVICE), torch.zeros(3, device=DEVICE))


def _norms(seed: int, n: int) -> list:
    """fp32 gradient norms: the edges (0, the smallest subnormal, around max_norm, where the clamp decides, huge,
    inf, NaN) and fresh random ones over 80 decades."""
    rng = random.Random(seed)
    fixed = [0.0, 1e-45, 1e-12, 0.999998, 0.999999, 1.0, 1.000002, 2.0, 3.4e38, INF, NAN]
    return fixed + [10 ** rng.uniform(-40, 38) for _ in range(n)] + [rng.random() * 4 for _ in range(n)]


@pytest.mark.parametrize("seed", [0, 1])
def test_the_clip_coefficient_has_the_torch_ops_bits(seed):
    rng = random.Random(100 + seed)
    out = torch.empty((), dtype=torch.float32, device=DEVICE)
    launches: dict = {}  # (kept across cases, as the optimizer keeps it: later cases replay or rebind)
    for value in _norms(seed, 15):
        for max_norm in (1.0, 0.5, 1, INF, rng.choice([1e-3, 2.0, 0.1 + rng.random(), 10 ** rng.uniform(-6, 6)])):
            norm = torch.tensor(value, dtype=torch.float32, device=DEVICE)
            want = clip_coefficient_ref(norm, torch.empty((), dtype=torch.float32, device=DEVICE), max_norm)
            out.fill_(-7.0)
            clip_coefficient_(norm, out, max_norm)
            assert_bitwise_equal(out, want, f"coefficient of norm={value!r} max_norm={max_norm!r}")
            out.fill_(-7.0)  # the launch the optimizer binds (the interpreter takes Triton's dispatch)
            _launch.launch(launches, "clip", clip_coefficient_launch_spec(norm, out, max_norm),
                           lambda: clip_coefficient_(norm, out, max_norm))
            assert_bitwise_equal(out, want, f"bound: norm={value!r} max_norm={max_norm!r}")
    # the values themselves (a check of the reference): max_norm / norm above max_norm, no clip under it
    assert clip_coefficient_(torch.tensor(4.0, device=DEVICE), out, 1.0).item() == pytest.approx(1 / 4, rel=1e-6)
    assert clip_coefficient_(torch.tensor(4.0, device=DEVICE), out, 100.0).item() == 1.0
    assert clip_coefficient_(torch.tensor(INF, device=DEVICE), out, 1.0).item() == 0.0


@pytest.mark.parametrize("seed", [0, 1])
def test_the_norm_and_its_clip_coefficient_in_one_launch(seed):
    """With ``sum_sq`` (as ShardedOptimizer.clip_grad_norm_ launches it compiled): the norm, written into a new
    tensor per call (the bound launch takes it afresh), is the correctly rounded sqrt of the sum of squares (a
    GPU's torch.sqrt; sqrt in float64 rounded to fp32 is that) and the coefficient is the torch ops' of that norm.
    Sums: exact squares, the value where torch's CPU sqrt is 1 ulp off, subnormals, inf, NaN, fresh random ones."""
    rng = random.Random(200 + seed)
    sums = [0.0, 1e-45, 4.0, 319006.15625, 0.999998, 1.0, 3.4e38, INF, NAN] + [
        10 ** rng.uniform(-40, 38) for _ in range(20)]
    coef = torch.empty((), dtype=torch.float32, device=DEVICE)
    launches: dict = {}
    norms = []
    for value in sums:
        sum_sq = torch.tensor(value, dtype=torch.float32, device=DEVICE)
        want_norm = torch.tensor(_f64_sqrt(value), dtype=torch.float64).float().to(DEVICE)
        want = clip_coefficient_ref(want_norm, torch.empty((), dtype=torch.float32, device=DEVICE), 1.0)
        norm = torch.full((), -7.0, device=DEVICE)
        coef.fill_(-7.0)
        _launch.launch(launches, "clip", clip_coefficient_launch_spec(norm, coef, 1.0, sum_sq),
                       lambda: clip_coefficient_(norm, coef, 1.0, sum_sq=sum_sq), live=(CLIP_NORM_ARG,))
        assert_bitwise_equal(norm, want_norm, f"norm of sum_sq={value!r}")
        assert_bitwise_equal(coef, want, f"coefficient of sum_sq={value!r}")
        norms.append(norm)  # (kept: each call's norm is its own tensor, as the loop may keep it)
    assert norms[2].item() == 2.0 and len({n.data_ptr() for n in norms}) == len(sums)  # (each written where asked)
    # the reference backend: the same bits
    norm = torch.empty((), device=DEVICE)
    clip_coefficient_(norm, coef, 0.5, sum_sq=torch.tensor(319006.15625, device=DEVICE), backend="torch")
    assert_bitwise_equal(norm, torch.tensor(_f64_sqrt(319006.15625), dtype=torch.float64).float().to(DEVICE),
                         "the reference backend's norm")


def _f64_sqrt(value: float) -> float:
    """math.sqrt of ``value`` as an fp32 holds it (a NaN stays one): rounded to fp32 afterwards, the correctly
    rounded fp32 square root (float64's 53 bits are more than twice fp32's 24 + 2)."""
    x = float(torch.tensor(value, dtype=torch.float32))
    return math.sqrt(x) if x == x else NAN


@pytest.mark.parametrize("bad, match", [
    (dict(norm=torch.zeros(2)), "norm must be a 0-d torch.float32 tensor"),
    (dict(norm=torch.zeros((), dtype=torch.float64)), "norm must be a 0-d torch.float32 tensor"),
    (dict(out=torch.zeros((), dtype=torch.bfloat16)), "out must be a 0-d torch.float32 tensor"),
    (dict(max_norm=0.0), "max_norm must be a number > 0"),
    (dict(max_norm=NAN), "max_norm must be a number > 0"),
    (dict(max_norm=True), "max_norm must be a number > 0"),
])
def test_the_clip_coefficient_names_a_bad_argument(bad, match):
    args = dict(norm=torch.ones((), device=DEVICE), out=torch.zeros((), device=DEVICE), max_norm=1.0)
    args.update({k: (v.to(DEVICE) if isinstance(v, torch.Tensor) else v) for k, v in bad.items()})
    with pytest.raises(ValueError, match=match):
        clip_coefficient_(**args)


def _flag_tensors(skipped_before: int, last: bool):
    scalar = torch.zeros((), dtype=torch.float32, device=DEVICE)
    return dict(found_out=scalar.clone().fill_(0.25), not_skipped_out=scalar.clone().fill_(-3.0),
                skipped_steps=torch.tensor(skipped_before, dtype=torch.int64, device=DEVICE),
                last_step_skipped=torch.tensor(last, device=DEVICE))


@pytest.mark.parametrize("num_counters", [0, 1, 2, 5])
@pytest.mark.parametrize("clip", [False, True])
def test_the_step_flags_have_the_torch_ops_bits(num_counters, clip):
    rng = random.Random(num_counters * 2 + clip)
    for found in (0.0, 1.0, 0.0, 1.0):
        counts = [float(rng.choice([0, 1, 7, rng.randrange(1, 10 ** 7)])) for _ in range(num_counters)]
        coef = rng.choice([1.0, rng.random(), 1e-30, 0.999999]) if clip else None
        average = rng.choice([1.0, 0.5, 1 / 3, 1 / 7, 0.25])
        skipped_before, last = rng.randrange(0, 1000), rng.random() < 0.5
        runs = []
        for fn in (step_flags_ref, step_flags_):
            counters = [torch.tensor(c, dtype=torch.float32, device=DEVICE) for c in counts]
            coef_t = None if coef is None else torch.tensor(coef, dtype=torch.float32, device=DEVICE)
            grad_scale = None if coef is None else torch.full((), -1.0, device=DEVICE)
            flags = _flag_tensors(skipped_before, last)
            fn(torch.tensor(found, device=DEVICE), flags["found_out"], flags["not_skipped_out"],
               flags["skipped_steps"], flags["last_step_skipped"], counters, coef_t, average, grad_scale)
            runs.append((flags, counters, grad_scale))
        (want, want_counters, want_scale), (got, got_counters, got_scale) = runs
        where = f"found_inf={found} counts={counts} coef={coef!r} average={average!r}"
        for name in want:
            assert_bitwise_equal(got[name], want[name], f"{name} at {where}")
        for i, (g, w) in enumerate(zip(got_counters, want_counters)):
            assert_bitwise_equal(g, w, f"counter {i} at {where}")
        if clip:
            assert_bitwise_equal(got_scale, want_scale, f"grad_scale at {where}")
        # (the reference's values: a skipped step counts nothing and is counted)
        assert [c.item() for c in want_counters] == [c + (found == 0.0) for c in counts]
        assert want["skipped_steps"].item() == skipped_before + int(found)
        assert want["last_step_skipped"].item() is (found > 0)


def test_a_bound_step_flags_launch_replays_on_the_same_tensors():
    """The optimizer's use: the table built once, the launch bound and replayed every step; each replay advances the
    counters again (the kernel reads what the last one wrote)."""
    counters = [torch.tensor(3.0, device=DEVICE), torch.tensor(10.0, device=DEVICE)]
    table = counter_table(counters, DEVICE)
    flags = _flag_tensors(0, False)
    found = torch.zeros((), device=DEVICE)
    launches: dict = {}
    for i, f in enumerate([0.0, 1.0, 0.0, 0.0]):
        found.fill_(f)
        spec = step_flags_launch_spec(found, flags["found_out"], flags["not_skipped_out"], flags["skipped_steps"],
                                      flags["last_step_skipped"], table)
        _launch.launch(launches, "flags", spec, lambda: step_flags_(
            found, flags["found_out"], flags["not_skipped_out"], flags["skipped_steps"],
            flags["last_step_skipped"], counters))
    assert [c.item() for c in counters] == [6.0, 13.0]
    assert flags["skipped_steps"].item() == 1 and flags["last_step_skipped"].item() is False


def test_the_step_flags_name_a_bad_argument():
    flags = _flag_tensors(0, False)
    found = torch.zeros((), device=DEVICE)
    with pytest.raises(ValueError, match="skipped_steps must be a 0-d torch.int64 tensor"):
        step_flags_(found, flags["found_out"], flags["not_skipped_out"], torch.zeros((), device=DEVICE),
                    flags["last_step_skipped"], [])
    with pytest.raises(ValueError, match=r"counters\[1\] must be a 0-d torch.float32 tensor"):
        step_flags_(found, flags["found_out"], flags["not_skipped_out"], flags["skipped_steps"],
                    flags["last_step_skipped"], [torch.zeros((), device=DEVICE), torch.zeros(3, device=DEVICE)])
    with pytest.raises(ValueError, match="clip_coef and grad_scale_out go together"):
        step_flags_(found, flags["found_out"], flags["not_skipped_out"], flags["skipped_steps"],
                    flags["last_step_skipped"], [], clip_coef=torch.ones((), device=DEVICE))
    with pytest.raises(ValueError, match="table must be counter_table"):
        step_flags_(found, flags["found_out"], flags["not_skipped_out"], flags["skipped_steps"],
                    flags["last_step_skipped"], [torch.zeros((), device=DEVICE)],
                    table=counter_table([torch.zeros((), device=DEVICE)] * 2, DEVICE))
    with pytest.raises(ValueError, match="average must be a finite number"):
        step_flags_(found, flags["found_out"], flags["not_skipped_out"], flags["skipped_steps"],
                    flags["last_step_skipped"], [], torch.ones((), device=DEVICE), NAN, torch.ones((), device=DEVICE))
