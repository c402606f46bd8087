"""scale_: in-place scale bit-exact against scale_ref; sum of squares against float64; non-finite flag. The
read-only sum_sq_nonfinite: x untouched, statistics of factor * x unrounded."""

import pytest
import torch

from tests.helpers import assert_bitwise_equal
from tests.kernels.common import DEVICE, ODD_SIZES, randn
from tritonshard.kernels import Backend, last_backend, scale_, scale_ref, sum_sq_nonfinite, sum_sq_nonfinite_ref

# fp64 squares and sums (error ~n * 2^-53, < 1e-10 here), rounded to fp32 once (2^-24 = 6e-8); where the kernel
# squares factor * x, that product was rounded to fp32 first (2^-24, so 2^-23 once squared): 3 * 2^-24 < 2e-7.
# (The fp32 partials before issue 21 needed 1e-5.)
SUMSQ_REL = 2e-7


@pytest.mark.parametrize("n", ODD_SIZES + [100_003])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("factor_kind", ["float", "tensor"])
def test_matches_reference_and_float64(n, dtype, factor_kind):
    x = randn(n, n, dtype, scale=2.0)
    factor = 1 / 3 if factor_kind == "float" else torch.tensor(1 / 3, device=DEVICE)
    ref = x.clone()
    sumsq, nonfinite = scale_(x, factor)
    assert last_backend("scale_") is not Backend.TORCH
    ref_sumsq, ref_nonfinite = scale_ref(ref, factor)
    assert_bitwise_equal(x, ref, f"scaled x ({n}, {dtype})")
    assert sumsq.shape == () and sumsq.dtype == torch.float32 and sumsq.device == x.device
    exact = float(x.double().square().sum())
    assert abs(float(sumsq) - exact) <= SUMSQ_REL * exact, f"sumsq {float(sumsq)} vs float64 {exact}"
    assert abs(float(ref_sumsq) - exact) <= SUMSQ_REL * exact
    assert float(nonfinite) == 0.0 and float(ref_nonfinite) == 0.0


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # inf * inf in the sum of squares
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("special, where", [(float("inf"), 0), (float("-inf"), 4098), (float("nan"), 9000)])
def test_non_finite_flag(dtype, special, where):
    x = randn(10_000, 3, dtype)
    x[where] = special
    _, nonfinite = scale_(x, 0.5)
    assert float(nonfinite) == 1.0


# numpy (the interpreter's arithmetic) warns on the overflow this test provokes on purpose
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_overflow_by_the_factor_is_flagged(dtype):
    x = torch.full((5000,), 3e38, dtype=dtype, device=DEVICE)
    _, nonfinite = scale_(x, 4.0)
    assert float(nonfinite) == 1.0 and bool(x.isinf().all())


def test_deterministic_sum():
    x = randn(50_000, 9)
    results = {scale_(x.clone(), 0.75)[0].view(torch.int32).item() for _ in range(3)}
    assert len(results) == 1, "per-block partials summed in a fixed order give the same bits every run"


def test_empty():
    sumsq, nonfinite = scale_(torch.empty(0, device=DEVICE), 2.0)
    assert float(sumsq) == 0.0 and float(nonfinite) == 0.0


@pytest.mark.parametrize("x, factor, exc, match", [
    (torch.ones(3, dtype=torch.float16), 1.0, TypeError, "x must be bfloat16 or float32"),
    (torch.ones(4, 4).t(), 1.0, ValueError, "contiguous"),
    (torch.ones(3), "2", TypeError, "factor"),
    (torch.ones(3), torch.ones(2), ValueError, "1-element"),
    (torch.ones(3), torch.ones(1, device="meta"), ValueError, "factor is on meta"),
])
def test_bad_input(x, factor, exc, match):
    with pytest.raises(exc, match=match):
        scale_(x.to(DEVICE), factor)


# ---------------------------------------------------------------------------------------------- read-only pass
@pytest.mark.parametrize("n", ODD_SIZES + [100_003])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("factor_kind", ["float", "tensor"])
def test_sum_sq_nonfinite_reads_only_and_matches_float64(n, dtype, factor_kind):
    x = randn(n, n + 7, dtype, scale=2.0)
    before = x.clone()
    factor = 1 / 3 if factor_kind == "float" else torch.tensor(1 / 3, device=DEVICE)
    sumsq, nonfinite = sum_sq_nonfinite(x, factor)
    assert last_backend("sum_sq_nonfinite") is not Backend.TORCH
    assert_bitwise_equal(x, before, f"x after the read-only pass ({n}, {dtype})")
    # the statistics are those of factor * x in fp32, unrounded (1/3 is not a power of two: a bf16 rounding of
    # the product would show at 2^-9 relative, far above SUMSQ_REL)
    exact = float((x.double() * (1 / 3)).square().sum())
    assert abs(float(sumsq) - exact) <= SUMSQ_REL * exact, f"sumsq {float(sumsq)} vs float64 {exact}"
    ref_sumsq, ref_nonfinite = sum_sq_nonfinite_ref(x, factor)
    assert abs(float(ref_sumsq) - exact) <= SUMSQ_REL * exact
    assert float(nonfinite) == 0.0 and float(ref_nonfinite) == 0.0


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # inf * inf in the sum of squares
@pytest.mark.parametrize("special, where", [(float("inf"), 0), (float("nan"), 4098)])
def test_sum_sq_nonfinite_flags_without_writing(special, where):
    x = randn(10_000, 5, torch.bfloat16)
    x[where] = special
    before = x.clone()
    _, nonfinite = sum_sq_nonfinite(x, 0.5)
    assert float(nonfinite) == 1.0
    assert_bitwise_equal(x, before, "x after the read-only pass")


@pytest.mark.parametrize("n", ODD_SIZES)
@pytest.mark.parametrize("backend", [None, "torch"])
def test_sum_sq_nonfinite_into_preallocated_out_and_partials(n, backend):
    from tritonshard.kernels.scale import sum_sq_workspace
    x = randn(n, 7, torch.bfloat16)
    x[n // 2:n // 2 + 1] = float("inf")
    table = torch.full((3, 2), -1.0, device=DEVICE)  # the optimizer's per-bucket rows
    got = sum_sq_nonfinite(x, 0.5, out=table[1], partials=sum_sq_workspace(n, DEVICE), backend=backend)
    expected = sum_sq_nonfinite(x, 0.5, backend=backend)  # the allocating call: the same bits
    assert_bitwise_equal(table[1], torch.stack(expected), "out row")
    assert got[0].data_ptr() == table[1].data_ptr(), "the returned values are the row's elements"
    assert bool((table[0] == -1).all() and (table[2] == -1).all()), "the other rows untouched"


def test_sum_sq_nonfinite_rejects_wrong_out_and_partials():
    from tritonshard.kernels.scale import sum_sq_workspace
    x = randn(5000, 1)
    with pytest.raises(ValueError, match=r"out must be a float32 tensor of shape \(2,\)"):
        sum_sq_nonfinite(x, out=torch.zeros(3, device=DEVICE))
    with pytest.raises(ValueError, match=r"partials must be sum_sq_workspace\(5000\)"):
        sum_sq_nonfinite(x, partials=sum_sq_workspace(10, DEVICE))


@pytest.mark.parametrize("backend", [None, "torch"])
def test_partials_of_several_tensors_share_one_finalize(backend):
    # what ShardedOptimizer does per step: each bucket's partials into its slice of one workspace, one finalize
    from tritonshard.kernels import finalize_sum_sq_, sum_sq_partials_, sum_sq_workspace
    from tritonshard.kernels.scale import BLOCK
    sizes = [0, 1, 4099, 199, 3 * 4096 + 5]
    xs = [randn(n, 20 + i, torch.bfloat16) for i, n in enumerate(sizes)]
    blocks = [-(-n // BLOCK) for n in sizes]
    ws = sum_sq_workspace(sum(blocks) * BLOCK, DEVICE)
    start = 0
    for x, b in zip(xs, blocks):
        sum_sq_partials_(x, 0.25, tuple(t[start:start + b] for t in ws), backend=backend)
        start += b
    out = torch.full((2,), -1.0, device=DEVICE)
    finalize_sum_sq_(ws, out, backend=backend)
    expected = sum(float((x.double() * 0.25).square().sum()) for x in xs)
    # fp64 squares and sums, rounded to fp32 once: within one fp32 rounding (2^-24) of the float64 sum
    assert float(out[0]) == pytest.approx(expected, rel=2 ** -24)
    assert float(out[1]) == 0.0
    xs[3][100] = float("nan")
    sum_sq_partials_(xs[3], 0.25, tuple(t[blocks[0] + blocks[1] + blocks[2]:][:blocks[3]] for t in ws),
                     backend=backend)
    finalize_sum_sq_(ws, out, backend=backend)
    assert float(out[1]) == 1.0, "one NaN in one tensor flags the whole step"


@pytest.mark.parametrize("blocks_per_program", [1, 4])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("aligned", [True, False])
def test_one_launch_writes_every_tensors_partials(dtype, aligned, blocks_per_program):
    # ShardedOptimizer's norm pass over every bucket's shard in one launch (issue 20.3): the workspace must hold
    # what one sum_sq_partials_ per tensor writes, bit for bit (the same slots, the same per-block arithmetic),
    # whether a program reads one block or four. Sizes for four: 9 blocks + 7 (two programs of four full blocks,
    # then a tail program of one full block and a partial one), 8 blocks (two full programs, no tail), 4 blocks
    # less one element (one program, its last block partial), 5 blocks exactly (a tail program of one full block
    # and three past the end, whose slots belong to the next tensor)
    from tritonshard.kernels import sum_sq_partials_
    from tritonshard.kernels.scale import partials_multi_launch_spec, shared_sum_sq_workspace
    sizes = [4099, 0, 1, 9 * 4096 + 7, 8 * 4096, 4 * 4096 - 1, 5 * 4096, 199]
    # misaligned: every tensor starts one element into its storage (2 or 4 bytes: the element-wise path)
    xs = [randn(n + 1, 40 + i, dtype, scale=1e3)[0 if aligned else 1:][:n] for i, n in enumerate(sizes)]
    xs[3][5000] = float("nan")  # in a full program's second block
    xs[3][8 * 4096 + 4095] = float("-inf")  # in the tail program's full block
    xs[0][4098] = float("inf")  # in the last, partial block
    xs[6][4 * 4096] = float("nan")  # the tail program's only block
    blocks = [-(-n // 4096) for n in sizes]
    want_flags = [0] * sum(blocks)
    for tensor, block in ((0, 1), (3, 1), (3, 8), (6, 4)):
        want_flags[sum(blocks[:tensor]) + block] = 1
    for factor, order in ((0.25, 1), (1 / 3, -1)):  # (reversed: no program writes the slot of its own index)
        per_tensor, slices = shared_sum_sq_workspace(sizes, DEVICE)
        for x, part in zip(xs, slices):
            sum_sq_partials_(x, factor, part)
        together, slices = shared_sum_sq_workspace(sizes, DEVICE)
        for t in together:
            t.fill_(-7)  # (a slot the launch leaves alone would show)
        kernel, grid, args, kwargs = partials_multi_launch_spec(xs[::order], factor, slices[::order],
                                                                blocks_per_program=blocks_per_program)
        assert kwargs["ALIGNED"] is aligned and kwargs["BLOCKS"] == blocks_per_program
        kernel[grid](*args, **kwargs)
        assert_bitwise_equal(together[0], per_tensor[0], "partial sums of squares")
        assert_bitwise_equal(together[1], per_tensor[1], "non-finite flags")
        assert together[1].tolist() == want_flags


def test_one_launch_takes_one_or_four_blocks_per_program():
    from tritonshard.kernels.scale import partials_multi_launch_spec, shared_sum_sq_workspace
    xs = [randn(9 * 4096 + 7, 1, torch.bfloat16), randn(5, 2, torch.bfloat16)]
    _, slices = shared_sum_sq_workspace([x.numel() for x in xs], DEVICE)
    assert partials_multi_launch_spec(xs, 1.0, slices, blocks_per_program=1)[1] == (11,)  # 10 + 1 blocks
    assert partials_multi_launch_spec(xs, 1.0, slices)[1] == (4,)  # (the default: four) 3 + 1 programs
    with pytest.raises(ValueError, match="blocks_per_program must be 1 or 4, got 2"):
        partials_multi_launch_spec(xs, 1.0, slices, blocks_per_program=2)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # inf * inf in the sum of squares
@pytest.mark.parametrize("blocks_per_program", [1, 4])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("aligned", [True, False])
def test_the_flag_read_off_the_sum_is_the_elementwise_test(dtype, aligned, blocks_per_program):
    # The kernels flag a block from its fp64 sum of squares (non-finite exactly when a value is), not element by
    # element: a block of the largest finite values must stay unflagged (its sum, ~4096 * 1.2e77, is finite in
    # fp64), and every kind of non-finite value must flag its block, in full blocks (the unmasked path) and tails
    # (four blocks per program: blocks 0-3 in one full program, 4-5 in the tail program).
    from tritonshard.kernels.scale import _partials_ref, partials_multi_launch_spec, shared_sum_sq_workspace
    big = torch.finfo(dtype).max
    sizes = [5 * 4096 + 3, 4096 + 17]
    xs = [randn(n + 1, 90 + i, dtype)[0 if aligned else 1:][:n] for i, n in enumerate(sizes)]
    xs[0][:4096] = big  # block 0: every value the largest finite one, signs mixed
    xs[0][:4096:3] = -big
    xs[0][4096 + 7] = float("-inf")  # block 1
    xs[0][2 * 4096 + 4095] = float("nan")  # block 2, its last element
    xs[0][3 * 4096] = float("inf")  # block 3: inf and NaN together
    xs[0][3 * 4096 + 1] = float("nan")
    xs[0][4 * 4096 + 100] = torch.finfo(dtype).tiny / 4  # block 4: a subnormal, finite
    xs[1][4096 + 16] = float("inf")  # the second tensor's tail block
    for factor in (1.0, 0.25):
        together, slices = shared_sum_sq_workspace(sizes, DEVICE)
        kernel, grid, args, kwargs = partials_multi_launch_spec(xs, factor, slices,
                                                                blocks_per_program=blocks_per_program)
        kernel[grid](*args, **kwargs)
        expected, ref_slices = shared_sum_sq_workspace(sizes, DEVICE)
        for x, part in zip(xs, ref_slices):
            _partials_ref(x.float() * factor, part)
        assert together[1].tolist() == expected[1].tolist() == [0, 1, 1, 1, 0, 0, 0, 1]
        sums, ref = together[0], expected[0]
        assert bool(sums[0].isfinite()) and abs(float(sums[0]) / float(ref[0]) - 1) < 1e-12
        assert [bool(v) for v in sums.isnan()] == [bool(v) for v in ref.isnan()]
        assert [bool(v) for v in sums.isinf()] == [bool(v) for v in ref.isinf()]
        _, nonfinite = sum_sq_nonfinite(xs[0][:4096], factor)  # (the single-tensor kernel: the same test)
        assert float(nonfinite) == 0.0


def test_one_launch_over_several_tensors_declines_what_it_cannot_take():
    from tritonshard.kernels.scale import partials_multi_launch_spec, shared_sum_sq_workspace
    xs = [randn(10, 1, torch.bfloat16), randn(10, 2, torch.float32)]
    _, slices = shared_sum_sq_workspace([10, 10], DEVICE)
    assert partials_multi_launch_spec(xs, 1.0, slices) is None  # two dtypes
    assert partials_multi_launch_spec([xs[0], xs[0]], 1.0, slices[::-1]) is not None
    assert partials_multi_launch_spec([randn(0, 1)], 1.0, shared_sum_sq_workspace([0], DEVICE)[1]) is None
    _, other = shared_sum_sq_workspace([10, 10], DEVICE)
    assert partials_multi_launch_spec([xs[0], xs[0]], 1.0, [slices[0], other[1]]) is None  # two workspaces


def test_partials_reject_a_wrong_workspace():
    from tritonshard.kernels import sum_sq_partials_, sum_sq_workspace
    with pytest.raises(ValueError, match=r"partials must be sum_sq_workspace\(5000\)"):
        sum_sq_partials_(randn(5000, 1), 1.0, sum_sq_workspace(100, DEVICE))


@pytest.mark.parametrize("backend", [None, "torch"])
def test_the_total_does_not_depend_on_how_the_data_is_cut(backend):
    # what bucket_cap_mb changes: which elements share a block and a bucket. The fp32 total must not move.
    from tritonshard.kernels import finalize_sum_sq_, sum_sq_partials_, sum_sq_workspace
    from tritonshard.kernels.scale import BLOCK
    x = randn(3 * 4096 + 1234, 31, torch.bfloat16, scale=3.0)
    totals = []
    for cuts in ([], [5000], [1, 4097, 6000, 9001], [2047, 2048, 8191]):
        bounds = [0, *cuts, x.numel()]
        pieces = [x[a:b] for a, b in zip(bounds, bounds[1:])]
        blocks = [-(-p.numel() // BLOCK) for p in pieces]
        ws = sum_sq_workspace(sum(blocks) * BLOCK, DEVICE)
        start = 0
        for piece, b in zip(pieces, blocks):
            sum_sq_partials_(piece, 1 / 3, tuple(t[start:start + b] for t in ws), backend=backend)
            start += b
        out = torch.zeros(2, dtype=torch.float32, device=DEVICE)
        finalize_sum_sq_(ws, out, backend=backend)
        totals.append(out)
    for cuts_total in totals[1:]:
        assert_bitwise_equal(cuts_total, totals[0], "sum of squares of the same data cut differently")


@pytest.mark.parametrize("n", ODD_SIZES)
@pytest.mark.parametrize("ranks", [1, 3, 4])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fold_rows_adds_in_rank_order(n, ranks, dtype):
    from tritonshard.kernels import fold_rows_, fold_rows_ref, sum_sq_workspace
    # magnitudes 1e-2..1e2 across rows, so the order of the bf16 adds changes the result
    rows = torch.stack([randn(n, 40 + r, torch.float32, scale=10.0 ** (r - 2)) for r in range(ranks)]).to(dtype)
    out = torch.full((n,), 7.0, dtype=dtype, device=DEVICE)
    ws = sum_sq_workspace(n, DEVICE)
    fold_rows_(rows, out, 1 / 3, ws)
    if n:
        assert last_backend("fold_rows_") is not Backend.TORCH
    expected = fold_rows_ref(rows)
    assert_bitwise_equal(out, expected, f"fold of {ranks} rows ({n}, {dtype})")
    # the statistics are those of factor * out, as sum_sq_partials_ would write them
    ref_ws = sum_sq_workspace(n, DEVICE)
    from tritonshard.kernels import sum_sq_partials_
    sum_sq_partials_(expected, 1 / 3, ref_ws)
    assert_bitwise_equal(ws[0], ref_ws[0], "partial sums of squares")
    assert_bitwise_equal(ws[1], ref_ws[1], "partial non-finite flags")
    if ranks == 4 and dtype == torch.bfloat16 and n > 100:  # the order is the rank order, not another one
        reversed_sum = fold_rows_ref(rows.flip(0))
        assert not torch.equal(expected, reversed_sum), "test data too tame: the add order does not show"


def test_fold_rows_flags_non_finite_and_rejects_bad_input():
    from tritonshard.kernels import fold_rows_, sum_sq_workspace
    rows = randn(3 * 5000, 50, torch.bfloat16).view(3, 5000)
    rows[1, 4321] = float("inf")
    out = torch.empty(5000, dtype=torch.bfloat16, device=DEVICE)
    ws = sum_sq_workspace(5000, DEVICE)
    fold_rows_(rows, out, 0.5, ws)
    assert int(ws[1].max()) == 1 and out[4321].isinf()
    with pytest.raises(ValueError, match="rows must be a contiguous 2-D tensor"):
        fold_rows_(rows.view(-1), out, 0.5, ws)
    with pytest.raises(ValueError, match=r"out must have rows.shape\[1\] = 5000 elements of torch.bfloat16"):
        fold_rows_(rows, out.float(), 0.5, ws)
    with pytest.raises(ValueError, match=r"partials must be sum_sq_workspace\(5000\)"):
        fold_rows_(rows, out, 0.5, sum_sq_workspace(10, DEVICE))


@pytest.mark.parametrize("n", [0, 1, 1023, 1025, 4095, 4096, 4097, 3 * 4096 + 5, 9001, 5 * 4096 + 777, 8 * 4096 + 3])
def test_the_unrolled_finalize_adds_each_lane_in_the_same_order(n):
    # The finalize reads four chunks of partials per round trip to memory (0.41 ms of a 1B step on the H200 with
    # one chunk per iteration): each lane must still add its partials in chunk order, so that the total keeps its
    # bits. Lane 0's partials only (the others zero, so that the total is that lane's sum, low bits included),
    # with full 53-bit mantissas over 4 binades: two of them swapped changes the sum in ~1 of 4 draws of 21, so
    # 16 draws (of the sizes with more than one round) catch a wrong order; flags anywhere.
    from tritonshard.kernels import scale as scale_mod
    for draw in range(16 if n > 2 * 4096 else 1):
        gen = torch.Generator().manual_seed(1000 * n + draw)
        sumsq = torch.zeros(n, dtype=torch.float64)
        lane0 = sumsq[::scale_mod._FINALIZE_BLOCK]
        lane0.copy_(torch.rand(lane0.numel(), generator=gen, dtype=torch.float64)
                    * 2.0 ** torch.randint(0, 4, (lane0.numel(),), generator=gen).double())
        sumsq = sumsq.to(DEVICE)
        flags = (torch.rand(n, generator=gen) < 0.001).to(torch.int32).to(DEVICE)
        if n:
            flags[-1] = 1 if n % 2 else 0  # (the last partial of a masked last chunk)
        outs = {}
        for unroll in (1, 4):
            out = torch.full((2,), -1.0, dtype=torch.float64, device=DEVICE)
            scale_mod._finalize_kernel[(1,)](sumsq, flags, n, out, out[1:], BLOCK=scale_mod._FINALIZE_BLOCK,
                                             UNROLL=unroll, enable_fp_fusion=False)
            outs[unroll] = out
        assert_bitwise_equal(outs[4], outs[1], f"finalize of {n} partials (draw {draw}), 4 chunks per round against 1")
        assert float(outs[4][1]) == float(bool(flags.any()))
        assert float(outs[4][0]) == pytest.approx(float(sumsq.sum()))
    assert scale_mod._FINALIZE_UNROLL == 4  # (what the launchers use)


@pytest.mark.parametrize("backend", [None, "torch"])
def test_segment_sums_add_each_segment_of_the_partials(backend):
    # the per-piece totals of ShardedOptimizer's per-parameter norms (torch's clip over param.grad): one program per
    # segment. Counts 1, primes, a multiple of the kernel's 1024 lanes and past it, a segment at the very end;
    # integer values (exact in any order: the sums are compared bit for bit), then random ones (fp64 order: 1e-13)
    from tritonshard.kernels.scale import segment_sums_
    counts = [1, 7, 1024, 1031, 3, 2049, 13]
    starts = [0] + torch.tensor(counts).cumsum(0).tolist()[:-1]
    n = sum(counts) + 5  # (5 partials after the last segment, in no segment)
    ints = torch.randint(-1000, 1000, (n,), generator=torch.Generator().manual_seed(3)).double().to(DEVICE)
    out = torch.full((len(counts),), -7.0, dtype=torch.float64, device=DEVICE)
    tables = [torch.tensor(t, dtype=torch.int64, device=DEVICE) for t in (starts, counts)]
    segment_sums_(ints, *tables, out, backend=backend)
    assert (last_backend("segment_sums_") is Backend.TORCH) == (backend == "torch")
    want = torch.stack([ints[a:a + c].sum() for a, c in zip(starts, counts)])
    assert_bitwise_equal(out, want, "segment sums of integers")
    values = randn(n, 5, torch.float32).double().square() * 1e3
    segment_sums_(values, *tables, out, backend=backend)
    torch.testing.assert_close(out, torch.stack([values[a:a + c].sum() for a, c in zip(starts, counts)]),
                               rtol=1e-13, atol=0)
    reversed_ = [torch.tensor(t[::-1], dtype=torch.int64, device=DEVICE) for t in (starts, counts)]
    segment_sums_(values, *reversed_, out, backend=backend)  # (segments in any order, as the tables list them)
    torch.testing.assert_close(out, torch.stack([values[a:a + c].sum() for a, c in zip(starts[::-1], counts[::-1])]),
                               rtol=1e-13, atol=0)


def test_segment_sums_reject_bad_tables():
    from tritonshard.kernels.scale import segment_sums_
    sums, out = torch.zeros(10, dtype=torch.float64), torch.empty(2, dtype=torch.float64)
    starts, counts = torch.tensor([0, 5]), torch.tensor([5, 5])
    with pytest.raises(ValueError, match="sums must be a 1-D float64 tensor"):
        segment_sums_(sums.float(), starts, counts, out)
    with pytest.raises(ValueError, match="counts must be a 1-D int64 tensor .* one element per segment"):
        segment_sums_(sums, starts, counts[:1], out)
    with pytest.raises(ValueError, match="starts must be a 1-D int64 tensor"):
        segment_sums_(sums, starts.int(), counts, out)
    with pytest.raises(ValueError, match="out must be a contiguous 1-D float64 tensor"):
        segment_sums_(sums, starts, counts, out.float())
