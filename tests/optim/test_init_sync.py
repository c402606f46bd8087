"""Ranks that initialize the model with their own seeds start from rank 0's weights (``init_sync``, as
DistributedDataParallel's construction broadcasts the module). nanoGPT seeds each rank differently *before*
building the model (``torch.manual_seed(1337 + seed_offset)``) and relies on DDP for this; before, each rank took
its shard's fp32 master from its own initialization, the first step's gradients were taken at a different point on
every rank, and the model came out stitched together from every rank's init, silently."""

import pytest
import torch
import torch.distributed as dist

from tests.distributed import run_on_ranks
from tests.helpers import assert_bitwise_equal
from tests.optim.training import LR, Net, train_step
from tritonshard import ShardedAdamW
from tritonshard.comm import all_gather_single

STEPS = 3


def _flat(model) -> torch.Tensor:
    return torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])


def _on_every_rank(t: torch.Tensor) -> torch.Tensor:
    """(world, numel): every rank's ``t``."""
    out = torch.empty(dist.get_world_size() * t.numel(), dtype=t.dtype)
    all_gather_single(out, t.contiguous())
    return out.view(dist.get_world_size(), -1)


def _run(rank, seed, hybrid, **options):
    torch.manual_seed(seed)
    model = Net()  # (its frozen parameter too: the optimizer is given model.parameters())
    kw = dict(options)  # (init_sync: the default unless given)
    if hybrid:
        from torch.distributed.device_mesh import init_device_mesh
        kw["device_mesh"] = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    opt = ShardedAdamW(model.parameters(), lr=LR, weight_decay=0.1, bucket_cap_mb=1e-4, **kw)
    built = _flat(model)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    for step in range(STEPS):
        train_step(model, opt, sched, rank, step)
    return built, _flat(model)


def _per_rank_seeds(rank, world_size, hybrid):
    torch.manual_seed(1337)
    # what every rank must start from: rank 0's initialization, the trained parameters in bf16, the frozen as they are
    rank0_init = torch.cat([(p.detach().bfloat16() if p.requires_grad else p.detach()).float().reshape(-1)
                            for p in Net().parameters()])
    built, trained = _run(rank, 1337 + rank, hybrid)
    assert_bitwise_equal(built, rank0_init, "the weights after building the optimizer vs rank 0's initialization")
    _, want = _run(rank, 1337, hybrid)  # every rank seeded alike: the run init_sync must reproduce
    assert_bitwise_equal(trained, want, "the weights after training from per-rank seeds vs from one seed")
    # the opt-out does what it says: each rank keeps its own (the test above fails without the broadcast)
    built, _ = _run(rank, 1337 + rank, hybrid, init_sync=False)
    rows = _on_every_rank(built)
    assert not torch.equal(rows[0], rows[1]), "init_sync=False: the ranks' own initializations were replaced"


@pytest.mark.parametrize("world_size,hybrid", [(2, False), (4, True)], ids=["2 ranks", "2x2 hybrid"])
def test_ranks_seeded_differently_start_from_rank_0s_weights(world_size, hybrid):
    run_on_ranks(_per_rank_seeds, world_size, hybrid)


def _added_group(rank, world_size):
    """add_param_group: a group re-initialized on each rank with its own seed is taken from rank 0 as well."""
    torch.manual_seed(0)
    model = Net()
    opt = ShardedAdamW([model.fc1.weight, model.fc1.bias], lr=LR)
    torch.manual_seed(100 + rank)
    torch.nn.init.normal_(model.fc2.weight)
    torch.manual_seed(100)
    want = torch.nn.init.normal_(torch.empty_like(model.fc2.weight)).bfloat16()
    opt.add_param_group({"params": [model.fc2.weight]})
    assert_bitwise_equal(model.fc2.weight.detach(), want, "an added group's weights vs rank 0's")
    with pytest.raises(TypeError, match="init_sync must be a bool"):
        ShardedAdamW(Net().parameters(), init_sync=1)


def test_an_added_group_starts_from_rank_0s_weights():
    run_on_ranks(_added_group, 2)


class _WithBuffers(torch.nn.Module):
    """A block with BatchNorm's statistics and a random, non-persistent buffer (random Fourier features)."""

    def __init__(self, extra: bool = False):
        super().__init__()
        self.proj = torch.nn.Linear(4, 6)
        self.norm = torch.nn.BatchNorm1d(6)
        self.register_buffer("features", torch.randn(6, 3), persistent=False)
        if extra:
            self.register_buffer("extra", torch.zeros(2))

    def forward(self, x):
        return self.norm(self.proj(x)) @ self.features.to(x.dtype)


def _buffers_at_attach(rank, world_size):
    """attach() broadcasts the model's buffers too (DDP's construction does): the forward of a model seeded per rank
    is then the same on every rank. A model with other buffers on some rank is an error on every rank."""
    for init_sync in (True, False):
        torch.manual_seed(1337 + rank)
        model = _WithBuffers()
        model.norm.running_mean.normal_()  # (as if trained: statistics that differ per rank)
        opt = ShardedAdamW(model.parameters(), lr=LR, init_sync=init_sync)
        opt.attach(model)
        rows = _on_every_rank(torch.cat([b.float().reshape(-1) for b in model.buffers()]))
        assert torch.equal(rows[0], rows[1]) == init_sync, f"init_sync={init_sync}: buffers after attach"
    model = _WithBuffers(extra=rank == 1)
    opt = ShardedAdamW(model.parameters(), lr=LR)
    with pytest.raises(ValueError, match=r"attached models to ShardedAdamW with different buffers .*extra"):
        opt.attach(model)


def test_attach_starts_every_rank_from_rank_0s_buffers():
    run_on_ranks(_buffers_at_attach, 2)
