"""Property tests of the pure layout arithmetic (no torch.distributed, no allocation)."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tritonshard.layout import Layout, align_up

numels_st = st.lists(st.integers(min_value=0, max_value=300), min_size=0, max_size=12)
world_st = st.integers(min_value=1, max_value=8)
align_st = st.sampled_from([1, 2, 3, 4, 8, 64])


@settings(max_examples=300, deadline=None)
@given(numels=numels_st, world_size=world_st, align=align_st)
def test_pieces_cover_every_element_exactly_once(numels, world_size, align):
    layout = Layout(numels, world_size, align)
    covered = [[0] * n for n in numels]
    for rank in range(world_size):
        lo, hi = layout.shard_range(rank)
        for p in layout.shard_pieces(rank):
            assert 0 <= p.shard_start < p.shard_end <= layout.shard_numel, "piece crosses its shard"
            assert p.shard_end - p.shard_start == p.tensor_end - p.tensor_start
            # the piece's buffer position agrees with the tensor's offset
            assert lo + p.shard_start == layout.offsets[p.tensor_index] + p.tensor_start
            for k in range(p.tensor_start, p.tensor_end):
                covered[p.tensor_index][k] += 1
    assert all(c == 1 for cs in covered for c in cs)


@settings(max_examples=300, deadline=None)
@given(numels=numels_st, world_size=world_st, align=align_st)
def test_offsets_aligned_disjoint_and_padding_owned_by_nobody(numels, world_size, align):
    layout = Layout(numels, world_size, align)
    owner = [None] * layout.padded_numel
    for i, (off, n) in enumerate(zip(layout.offsets, numels)):
        assert off % align == 0
        for k in range(off, off + n):
            assert owner[k] is None, f"tensors {owner[k]} and {i} overlap at {k}"
            owner[k] = i
    assert layout.padded_numel % (world_size * align) == 0
    # padding is the minimum that holds every view
    assert layout.padded_numel - layout.used_numel < world_size * align
    assert layout.padded_numel == layout.shard_numel * world_size
    padding = sum(o is None for o in owner)
    assert padding == layout.padded_numel - sum(numels)
    # no piece ever lands on a padding slot
    for rank in range(world_size):
        lo, _ = layout.shard_range(rank)
        for p in layout.shard_pieces(rank):
            assert all(owner[lo + s] == p.tensor_index for s in range(p.shard_start, p.shard_end))


@settings(max_examples=200, deadline=None)
@given(numels=numels_st, world_size=world_st)
def test_align_one_is_the_seed_layout(numels, world_size):
    layout = Layout(numels, world_size, 1)
    total = sum(numels)
    assert layout.padded_numel == -(-total // world_size) * world_size
    running = 0
    for off, n in zip(layout.offsets, numels):
        assert off == running
        running += n


@settings(max_examples=200, deadline=None)
@given(numels=numels_st, world_size=world_st, align=align_st)
def test_owner_ranks_match_pieces(numels, world_size, align):
    layout = Layout(numels, world_size, align)
    for i in range(len(numels)):
        from_pieces = sorted(r for r in range(world_size) if any(p.tensor_index == i for p in layout.shard_pieces(r)))
        assert list(layout.owner_ranks(i)) == from_pieces


def test_worked_example_from_the_docstring():
    layout = Layout([5, 3, 6], world_size=2, align=1)
    assert layout.offsets == (0, 5, 8) and layout.padded_numel == 14 and layout.shard_numel == 7
    assert [(p.tensor_index, p.tensor_start, p.tensor_end) for p in layout.shard_pieces(0)] == [(0, 0, 5), (1, 0, 2)]
    assert [(p.tensor_index, p.tensor_start, p.tensor_end) for p in layout.shard_pieces(1)] == [(1, 2, 3), (2, 0, 6)]
    layout4 = Layout([5, 3, 6], world_size=2, align=4)
    assert layout4.offsets == (0, 8, 12) and layout4.padded_numel == 24


def test_empty_and_zero_numel():
    assert Layout([], 3).padded_numel == 0
    layout = Layout([0, 0, 7, 0], world_size=4, align=1)
    assert layout.padded_numel == 8 and layout.offsets == (0, 0, 0, 7)
    assert list(layout.owner_ranks(0)) == []


@pytest.mark.parametrize("kwargs, match", [
    (dict(numels=[1], world_size=0), "world_size"),
    (dict(numels=[1], world_size=2, align=0), "align"),
    (dict(numels=[1, -1], world_size=2), r"numels\[1\]"),
])
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Layout(**kwargs)


def test_bad_rank():
    with pytest.raises(ValueError, match="rank"):
        Layout([4], 2).shard_pieces(2)


def test_align_up():
    assert [align_up(n, 4) for n in range(9)] == [0, 4, 4, 4, 4, 8, 8, 8, 8]


@settings(max_examples=300, deadline=None)
@given(numels=numels_st, world_size=world_st, align=align_st, data=st.data())
def test_owners_put_each_tensor_whole_in_its_owners_shard(numels, world_size, align, data):
    owners = data.draw(st.lists(st.integers(0, world_size - 1), min_size=len(numels), max_size=len(numels)))
    layout = Layout(numels, world_size, align, owners=owners)
    assert layout.padded_numel == layout.shard_numel * world_size and layout.shard_numel % align == 0
    ends = {}
    for i, (off, n) in enumerate(zip(layout.offsets, numels)):
        assert off % align == 0
        if n:
            assert list(layout.owner_ranks(i)) == [owners[i]], "the whole tensor in its owner's shard"
            ends.setdefault(owners[i], []).append((off, off + n))
    for spans in ends.values():  # disjoint inside a shard
        spans.sort()
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
    # the shard is as long as the largest share needs, no longer
    needed = max((Layout([n for n, r in zip(numels, owners) if r == rank], 1, align).used_numel
                  for rank in range(world_size)), default=0)
    assert layout.shard_numel == align_up(needed, align)


@settings(max_examples=200, deadline=None)
@given(numels=st.lists(st.integers(1, 10_000), min_size=1, max_size=40), world_size=world_st)
def test_balance_owners_is_the_greedy_bound(numels, world_size):
    from tritonshard.layout import balance_owners
    owners = balance_owners(numels, [float(n) for n in numels], world_size)
    share = [sum(n for n, r in zip(numels, owners) if r == rank) for rank in range(world_size)]
    # largest-first greedy: no rank exceeds the mean by more than the largest tensor (Graham's bound)
    assert max(share) <= sum(numels) / world_size + max(numels)
    assert owners == balance_owners(numels, [float(n) for n in numels], world_size), "deterministic on every rank"


def test_owners_bad_arguments():
    with pytest.raises(ValueError, match="owners has 1 entries"):
        Layout([3, 4], 2, owners=[0])
    with pytest.raises(ValueError, match=r"owners\[1\] must be a rank in \[0, 2\)"):
        Layout([3, 4], 2, owners=[0, 2])
