"""Buffer collectives on real gloo process groups (1-4 processes), checked against single-process references.

Each rank's data is a pure function of (seed, rank), so every rank can rebuild every other rank's input and the
expected result locally. Values are small integers times 1/4: every partial sum of up to 4 of them is exactly
representable in bf16 and fp32, so SUM results are compared bit for bit whatever order gloo adds in.
"""

import pytest
import torch
import torch.distributed as dist

from tests.distributed import run_on_ranks
from tests.helpers import assert_bitwise_equal
from tritonshard import Buffer, LayoutMismatchError

# Straddles shard boundaries at every world size here, includes a tensor smaller than a shard, a scalar and an
# empty tensor, and a total (1 + 13 + 6 + 1 + 0 + 29 = 50) that 3 and 4 do not divide.
SHAPES = [(1,), (13,), (2, 3), (), (0,), (29,)]


def _rank_values(seed: int, rank: int, n: int, dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    return (torch.randint(-64, 64, (n,), generator=g).to(torch.float32) / 4).to(dtype)


def _filled_buffer(rank, world_size, dtype, align, seed, group=None):
    buf = Buffer([torch.empty(s) for s in SHAPES], rank, world_size, dtype=dtype, device="cpu", align=align,
                 group=group)
    for i, v in enumerate(buf.get_views()):
        v.copy_(_rank_values(seed + i, rank, v.numel(), dtype).view(v.shape))
    return buf


def _expected_full(world_size, dtype, align, seed, reduce):
    """Single-process reference: the buffer every rank would hold, reduced over ranks in float64."""
    per_rank = [_filled_buffer(r, world_size, dtype, align, seed).get_data().double() for r in range(world_size)]
    total = torch.stack(per_rank).sum(0)
    return (total / world_size if reduce == "avg" else total)


def _check_reduce_scatter_and_all_gather(rank, world_size, dtype, align, async_op, seed=7):
    for reduce, op in (("sum", dist.ReduceOp.SUM), ("avg", dist.ReduceOp.AVG)):
        buf = _filled_buffer(rank, world_size, dtype, align, seed)
        work = buf.reduce_scatter(op=op, async_op=async_op)
        if async_op:
            work.wait()
        lo, hi = rank * buf.shard_numel, (rank + 1) * buf.shard_numel
        want = _expected_full(world_size, dtype, align, seed, reduce)[lo:hi]
        if reduce == "sum":  # exact: see module docstring
            assert_bitwise_equal(buf.get_local_shard(), want.to(dtype), f"reduce-scatter SUM ({dtype}, align={align})")
        else:
            # AVG = exact sum, then one division rounded to dtype: at most half an ulp, i.e. 2^-8 (bf16) or
            # 2^-24 (fp32) relative, plus the division's own rounding: allow 2^-7 / 2^-22.
            rel = 2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -22
            err = (buf.get_local_shard().double() - want).abs()
            assert bool((err <= rel * want.abs()).all()), f"reduce-scatter AVG off by {float(err.max())}"

    # all-gather reassembles every rank's shard; padding written by nobody stays zero
    buf = _filled_buffer(rank, world_size, dtype, align, seed)
    expected = torch.cat([_filled_buffer(r, world_size, dtype, align, seed).get_local_shard()
                          for r in range(world_size)])
    work = buf.all_gather(async_op=async_op)
    if async_op:
        work.wait()
    assert_bitwise_equal(buf.get_data(), expected, "all-gather")
    owned = torch.zeros(buf.padded_numel, dtype=torch.bool)
    for off, n in zip(buf.offsets, buf.numels):
        owned[off:off + n] = True
    assert bool((buf.get_data()[~owned] == 0).all()), "padding must stay zero"
    # views see the gathered values
    for v, (off, n) in zip(buf.get_views(), zip(buf.offsets, buf.numels)):
        assert torch.equal(v.flatten(), buf.get_data()[off:off + n])


def _battery(rank, world_size):
    for dtype in (torch.bfloat16, torch.float32):
        for align in (1, 64):
            for async_op in (False, True):
                _check_reduce_scatter_and_all_gather(rank, world_size, dtype, align, async_op)

    # the layout check passes when ranks agree...
    Buffer([torch.empty(s) for s in SHAPES], rank, world_size, device="cpu", check_layout=True)
    # ...and names the difference when they do not (every rank raises, nobody hangs)
    if world_size > 1:
        shapes = list(SHAPES)
        shapes[1] = (13 + (rank == world_size - 1),)
        with pytest.raises(LayoutMismatchError, match=r"tensor 1 has shape \(13,\) on rank 0 but \(14,\)"):
            Buffer([torch.empty(s) for s in shapes], rank, world_size, device="cpu", check_layout=True)
        with pytest.raises(ValueError, match=f"group has {world_size} ranks"):
            Buffer([torch.empty(3)], 0, world_size + 1, device="cpu").all_gather()
        with pytest.raises(ValueError, match=f"this process is rank {rank}"):
            Buffer([torch.empty(3)], (rank + 1) % world_size, world_size, device="cpu").reduce_scatter()
        with pytest.raises(ValueError, match=f"group has {world_size} ranks"):
            Buffer([torch.empty(3)], 0, world_size + 1, device="cpu", group=dist.group.WORLD)


def _subgroups(rank, world_size):
    # two subgroups {0, 2} and {1, 3}; a Buffer on each, with the rank inside its subgroup
    groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    group = groups[rank % 2]
    sub_rank, sub_size = rank // 2, 2
    for dtype in (torch.bfloat16, torch.float32):
        seed = 100 + rank % 2  # the two subgroups reduce different data
        buf = _filled_buffer(sub_rank, sub_size, dtype, 1, seed, group=group)
        buf.reduce_scatter()  # the Buffer's own group is the default for its collectives
        lo, hi = sub_rank * buf.shard_numel, (sub_rank + 1) * buf.shard_numel
        reduced = _expected_full(sub_size, dtype, 1, seed, "sum").to(dtype)
        assert_bitwise_equal(buf.get_local_shard(), reduced[lo:hi], "subgroup reduce-scatter")
        buf.all_gather(group=group, async_op=True).wait()  # every rank's shard is reduced now
        assert_bitwise_equal(buf.get_data(), reduced, "subgroup all-gather")
    with pytest.raises(ValueError, match="group has 2 ranks"):
        Buffer([torch.empty(3)], rank, world_size, device="cpu").reduce_scatter(group=group)
    # the optimizer's per-bucket calls straight through the ProcessGroup methods (comm.*_async): the same results as
    # torch's wrappers, on a subgroup and on the default group
    from tritonshard import comm
    for g, g_rank, g_size, seed in ((group, sub_rank, sub_size, 200 + rank % 2), (None, rank, world_size, 300)):
        for dtype in (torch.bfloat16, torch.float32):
            buf = _filled_buffer(g_rank, g_size, dtype, 64, seed, group=g)
            comm.reduce_scatter_async(buf.get_local_shard(), buf.get_data(), comm.group_object(g)).wait()
            lo, hi = g_rank * buf.shard_numel, (g_rank + 1) * buf.shard_numel
            reduced = _expected_full(g_size, dtype, 64, seed, "sum").to(dtype)
            assert_bitwise_equal(buf.get_local_shard(), reduced[lo:hi], "reduce_scatter_async")
            buf.get_data().zero_()[lo:hi] = reduced[lo:hi]
            comm.all_gather_async(buf.get_data(), buf.get_local_shard(), comm.group_object(g)).wait()
            assert_bitwise_equal(buf.get_data(), reduced, "all_gather_async")


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_collectives_match_single_process_reference(world_size):
    # FutureWarning raised as an error inside every rank: the torch 2.13 deprecated names must not be used
    run_on_ranks(_battery, world_size, warnings_as_errors=FutureWarning)


def test_subgroups_of_four_ranks():
    run_on_ranks(_subgroups, 4, warnings_as_errors=FutureWarning)
