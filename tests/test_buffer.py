"""Single-process Buffer behaviour: layout, aliasing, validation, world size 1 without torch.distributed."""

import pytest
import torch

from tests.seed_buffer import Buffer as SeedBuffer
from tritonshard import Buffer

SHAPES = [(5,), (3, 2), (), (0,), (7, 1, 3), (11,)]


def _tensors(shapes=SHAPES):
    return [torch.empty(s) for s in shapes]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_align_one_reproduces_the_seed_layout(world_size, dtype):
    for rank in range(world_size):
        seed = SeedBuffer(_tensors(), rank, world_size, dtype=dtype, device=torch.device("cpu"))
        ours = Buffer(_tensors(), rank, world_size, dtype=dtype, device="cpu", align=1)
        assert (ours.padded_numel, ours.shard_numel) == (seed.padded_numel, seed.shard_numel)
        for v_ours, v_seed in zip(ours.get_views(), seed.get_views()):
            assert v_ours.shape == v_seed.shape
            assert v_ours.storage_offset() == v_seed.storage_offset()
        assert ours.get_local_shard().storage_offset() == seed.get_local_shard().storage_offset()
        assert ours.get_local_shard().numel() == seed.get_local_shard().numel()


@pytest.mark.parametrize("align", [1, 4, 64])
def test_views_and_shard_alias_the_buffer(align):
    world_size = 3
    buf = Buffer(_tensors(), 1, world_size, dtype=torch.float32, device="cpu", align=align)
    data = buf.get_data()
    assert data.is_contiguous() and data.dim() == 1 and data.numel() == buf.padded_numel
    assert bool((data == 0).all()), "a new buffer is zero, padding included"
    for i, v in enumerate(buf.get_views()):
        assert v.shape == SHAPES[i]
        assert v.storage_offset() % align == 0
        v.fill_(i + 1.0)  # write through the view...
    for i, (off, n) in enumerate(zip(buf.offsets, buf.numels)):
        assert bool((data[off:off + n] == i + 1.0).all())  # ...shows in the buffer
    shard = buf.get_local_shard()
    assert shard.data_ptr() == data[buf.shard_numel:].data_ptr() and shard.numel() == buf.shard_numel
    shard.fill_(-2.0)
    assert bool((data[buf.shard_numel:2 * buf.shard_numel] == -2.0).all())
    assert buf.get_local_shard() is shard, "the local shard is permanent"


def test_padding_is_zero_and_belongs_to_no_view():
    buf = Buffer(_tensors(), 0, 4, dtype=torch.float32, device="cpu", align=8)
    for v in buf.get_views():
        v.fill_(1.0)
    data = buf.get_data()
    assert int((data != 0).sum()) == sum(buf.numels)
    assert buf.padded_numel % (4 * 8) == 0


def test_shard_pieces_match_the_shard_contents():
    buf = Buffer(_tensors(), 2, 3, dtype=torch.float32, device="cpu", align=1)
    for i, v in enumerate(buf.get_views()):
        v.copy_(torch.arange(v.numel(), dtype=torch.float32).view(v.shape) + 1000 * i)
    shard = buf.get_local_shard()
    pieces = buf.shard_pieces()
    assert pieces, "rank 2 of 3 owns part of the last tensors"
    for p in pieces:
        want = buf.get_views()[p.tensor_index].flatten()[p.tensor_start:p.tensor_end]
        assert torch.equal(shard[p.shard_start:p.shard_end], want)


def test_empty_list_and_zero_numel_tensors_are_legal():
    empty = Buffer([], 0, 2, device="cpu")
    assert empty.padded_numel == 0 and empty.get_local_shard().numel() == 0 and empty.get_views() == []
    zeros = Buffer([torch.empty(0), torch.empty(0, 3)], 1, 2, device="cpu")
    assert zeros.padded_numel == 0 and [v.shape for v in zeros.get_views()] == [(0,), (0, 3)]


def test_world_size_one_collectives_without_torch_distributed():
    buf = Buffer([torch.empty(10)], 0, 1, dtype=torch.float32, device="cpu")
    buf.get_views()[0].copy_(torch.arange(10.0))
    before = buf.get_data().clone()
    assert buf.reduce_scatter() is None
    buf.all_gather(async_op=True).wait()
    assert torch.equal(buf.get_data(), before)
    assert torch.equal(buf.get_local_shard()[:10], torch.arange(10.0))


def test_collective_needs_process_group_when_world_size_above_one():
    buf = Buffer([torch.empty(4)], 0, 2, device="cpu")
    with pytest.raises(RuntimeError, match="not initialized"):
        buf.reduce_scatter()


def test_default_device_is_cpu_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA; the default device is the local CUDA device there")
    assert Buffer([torch.empty(3)], 1, 2).device == torch.device("cpu")


@pytest.mark.parametrize("args, kwargs, exc, match", [
    (([torch.empty(2)], 2, 2), {}, ValueError, "rank"),
    (([torch.empty(2)], -1, 2), {}, ValueError, "rank"),
    (([torch.empty(2)], 0, 0), {}, ValueError, "world_size"),
    (([torch.empty(2)], 0, 2.0), {}, ValueError, "world_size"),
    (([torch.empty(2), [1, 2]], 0, 2), {}, TypeError, r"tensors\[1\]"),
    ((torch.empty(2), 0, 2), {}, TypeError, "list of tensors"),
    (([torch.empty(2)], 0, 2), {"dtype": "bf16"}, TypeError, "dtype"),
    (([torch.empty(2)], 0, 2), {"align": 0}, ValueError, "align"),
])
def test_bad_arguments(args, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        Buffer(*args, device="cpu", **kwargs)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_flatten_from_writes_every_view_and_no_padding(dtype):
    g = torch.Generator().manual_seed(0)
    srcs = [torch.randn(s, generator=g) for s in SHAPES]
    srcs[1] = srcs[1].t()  # non-contiguous source
    buf = Buffer([torch.empty(s.shape) for s in srcs], 1, 3, dtype=dtype, device="cpu", align=8)
    buf.flatten_from(srcs)
    buf.flatten_from(srcs, accumulate=True, scale=0.5)
    for v, s in zip(buf.get_views(), srcs):
        once = s.float().to(dtype).float()
        assert torch.equal(v, (0.5 * s.float() + once).to(dtype))
    owned = torch.zeros(buf.padded_numel, dtype=torch.bool)
    for off, n in zip(buf.offsets, buf.numels):
        owned[off:off + n] = True
    assert bool((buf.get_data()[~owned] == 0).all())
    with pytest.raises(ValueError, match=r"tensors\[0\] has 4 elements but view 0 has 5"):
        buf.flatten_from([torch.ones(4)] + srcs[1:])
    with pytest.raises(ValueError, match="5 entries"):
        buf.flatten_from(srcs[:5])
