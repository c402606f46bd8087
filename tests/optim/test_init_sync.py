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
    with pytest.raises(TypeError, match="init_sync must be True or False"):
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
        # in bf16 throughout, statistics included: with float32 ones beside bf16 weights BatchNorm cannot run
        # (attach() says so: test_a_batchnorm_with_float32_statistics_is_an_error_at_attach)
        self.to(torch.bfloat16)

    def forward(self, x):
        return self.norm(self.proj(x)) @ self.features


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


def _buffers(module) -> torch.Tensor:
    return torch.cat([b.detach().double().reshape(-1) for b in module.buffers()])


def _all_equal(rows: torch.Tensor) -> bool:
    return all(torch.equal(row, rows[0]) for row in rows)


def _buffers_every_forward(rank, world_size, hybrid):
    """attach(broadcast_buffers=True), DDP's default: every forward with grad enabled starts from rank 0's buffers,
    rank 0's own as its last forward left them; the ranks' batches differ, so without it BatchNorm's statistics
    drift apart. Forwards under no_grad (on one rank only) and inside no_sync() broadcast nothing, as in DDP. On a
    2x2 hybrid mesh, rank 0's reach the other shard group's ranks too (over the replica group)."""
    kw = {}
    if hybrid:
        from torch.distributed.device_mesh import init_device_mesh
        kw["device_mesh"] = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    for broadcast in (True, False):
        torch.manual_seed(0)
        model = _WithBuffers()
        opt = ShardedAdamW(model.parameters(), lr=LR, **kw)
        opt.attach(model, broadcast_buffers=broadcast)
        starts, ends = [], []
        model.register_forward_pre_hook(lambda module, args: starts.append(_buffers(module)))  # (runs after attach's)
        torch.manual_seed(100 + rank)  # each rank its own batches
        for _ in range(STEPS):
            model(torch.randn(8, 4)).float().square().mean().backward()
            ends.append(_buffers(model))
            opt.step()
            opt.zero_grad()
        rows = _on_every_rank(torch.stack(starts).reshape(-1)).view(world_size, STEPS, -1)
        mine_before = torch.stack([starts[0]] + ends[:-1])  # what this rank's model held before each forward
        assert torch.equal(starts[0], mine_before[0])
        if not broadcast:
            assert torch.equal(rows[rank], mine_before), "broadcast_buffers=False: a rank keeps its own buffers"
            assert not torch.equal(rows[0, 1:], rows[1, 1:]), "the control: the ranks' statistics drift apart"
            continue
        for r in range(world_size):
            assert torch.equal(rows[r], rows[0]), f"step starts: rank {r}'s buffers differ from rank 0's"
        if rank == 0:
            assert torch.equal(rows[0], mine_before), "rank 0's buffers changed by the broadcast"
        else:
            assert not torch.equal(rows[rank, 1:], mine_before[1:]), f"rank {rank}'s own statistics were not replaced"

        # a forward under no_grad on rank 0 alone (evaluation, generation): no collective, so no hang; its
        # statistics (train mode: BatchNorm updates them) reach the others with the next training forward
        if rank == 0:
            with torch.no_grad():
                model(torch.randn(8, 4))
        rank_0_now = _on_every_rank(_buffers(model))[0]
        with opt.no_sync():  # DDP broadcasts nothing there either
            model(torch.randn(8, 4)).float().square().mean().backward()
        inside = _on_every_rank(starts[-1])
        assert torch.equal(inside[rank], ends[-1] if rank else rank_0_now), "no_sync(): a rank keeps its own"
        model(torch.randn(8, 4)).float().square().mean().backward()
        after = _on_every_rank(starts[-1])
        assert _all_equal(after), "the forward after no_sync() starts from rank 0's buffers"
        opt.step()
        opt.zero_grad()
        model.norm.running_mean = torch.randn(6).to(torch.bfloat16)  # a new tensor, as .to() makes, on each rank
        model(torch.randn(8, 4)).float().square().mean().backward()
        replaced = _on_every_rank(starts[-1])
        assert _all_equal(replaced), "a replaced buffer is broadcast too"


@pytest.mark.parametrize("world_size,hybrid", [(2, False), (4, True)], ids=["2 ranks", "2x2 hybrid"])
def test_every_training_forward_starts_from_rank_0s_buffers(world_size, hybrid):
    run_on_ranks(_buffers_every_forward, world_size, hybrid)


def _extra_forward_on_one_rank(rank, world_size):
    """A forward with grad enabled on rank 0 alone (a loss for a log line, without torch.no_grad()) broadcasts
    there and nowhere else: DDP hangs on it. Here the ranks meet in different calls at the next handshake and
    raise CollectiveMismatchError on both, saying how to run it; with broadcast_buffers=False the loop runs."""
    from tritonshard.comm import CollectiveMismatchError
    for broadcast in (True, False):
        torch.manual_seed(0)
        model = _WithBuffers()
        opt = ShardedAdamW(model.parameters(), lr=LR)
        opt.attach(model, broadcast_buffers=broadcast)

        def one_step():
            model(torch.randn(8, 4)).float().square().mean().backward()
            opt.step()
            opt.zero_grad()

        one_step()
        if rank == 0:
            model(torch.randn(8, 4))
        if broadcast:
            with pytest.raises(CollectiveMismatchError, match=r"on some ranks only must run under torch.no_grad\(\), "
                                                             r"or attach with broadcast_buffers=False"):
                one_step()
        else:
            one_step()


def test_a_training_forward_on_one_rank_is_an_error_on_every_rank_not_a_hang():
    run_on_ranks(_extra_forward_on_one_rank, 2)


def _unchanged_buffers(rank, world_size):
    """Buffers no rank changed since the last broadcast (a rotary embedding's inv_freq; here BatchNorm in eval
    mode) are not broadcast again: the handshake's flag says whether any rank's changed. One rank's edit is enough.
    Without the handshake, every forward broadcasts."""
    import tritonshard.comm as comm
    calls = []
    broadcast = comm.broadcast_coalesced
    comm.broadcast_coalesced = lambda tensors, group=None: (calls.append(len(tensors)), broadcast(tensors, group))
    try:
        torch.manual_seed(0)
        model = _WithBuffers().eval()  # (eval: BatchNorm reads its statistics, writes none)
        opt = ShardedAdamW(model.parameters(), lr=LR)
        opt.attach(model)
        calls.clear()  # (attach's own broadcast)
        for _ in range(STEPS):
            model(torch.randn(8, 4)).float().square().mean().backward()
            opt.step()
            opt.zero_grad()
        assert calls == [4], f"broadcasts of the buffers: {calls} (the first forward's only, of all 4)"
        if rank == 1:
            model.features.mul_(2)  # in place, on one rank
        model(torch.randn(8, 4)).float().square().mean().backward()
        assert calls == [4, 4], "a buffer changed on rank 1 alone: every rank broadcasts"
        rows = _on_every_rank(_buffers(model))
        assert torch.equal(rows[1], rows[0]), "rank 1's edit was not replaced by rank 0's buffer"

        # without the handshake (check_collectives=False) the ranks cannot agree to skip: every forward, as DDP
        model = _WithBuffers().eval()
        opt = ShardedAdamW(model.parameters(), lr=LR, check_collectives=False)
        opt.attach(model)
        calls.clear()
        for _ in range(2):
            model(torch.randn(8, 4)).float().square().mean().backward()
        assert calls == [4, 4], f"check_collectives=False: broadcasts {calls}"
    finally:
        comm.broadcast_coalesced = broadcast


def test_buffers_no_rank_changed_are_not_broadcast_again():
    run_on_ranks(_unchanged_buffers, 2)


def _buffers_under_compile(rank, world_size):
    """torch.compile(model) around an attached model: the broadcast (a collective) runs eagerly, a graph break at
    the start of the compiled forward, as DDP's runs outside it. Rank 1 edits a buffer the forward only reads
    before every step; each compiled forward must bring back rank 0's."""
    torch.manual_seed(0)
    model = _WithBuffers()
    opt = ShardedAdamW(model.parameters(), lr=LR)
    opt.attach(model)
    compiled = torch.compile(model, backend="eager")  # (the eager backend: the tracing is what matters here)
    torch.manual_seed(100 + rank)
    for _ in range(STEPS):
        if rank == 1:
            model.features.add_(1.0)
        features = _on_every_rank(model.features.double().reshape(-1))
        assert not torch.equal(features[1], features[0]), "the control: rank 1's edit"
        compiled(torch.randn(8, 4)).float().square().mean().backward()
        features = _on_every_rank(model.features.double().reshape(-1))
        assert torch.equal(features[1], features[0]), "a compiled forward did not start from rank 0's buffers"
        opt.step()
        opt.zero_grad()


def test_a_compiled_model_starts_from_rank_0s_buffers_too():
    run_on_ranks(_buffers_under_compile, 2)


def test_a_batchnorm_with_float32_statistics_is_an_error_at_attach():
    """Construction makes a BatchNorm's weight bf16; float32 running statistics beside it fail torch's batch_norm at
    the first forward ("expected scalar type BFloat16 but found Float", in train and eval mode, as on CUDA).
    attach() names the module and the ways out; both work."""
    def build():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.BatchNorm1d(6), torch.nn.Linear(6, 2))

    model = build()
    opt = ShardedAdamW(model.parameters(), lr=LR)
    with pytest.raises(RuntimeError, match="expected scalar type"):  # the failure the check stands in for
        model(torch.randn(8, 4).to(torch.bfloat16))
    with pytest.raises(ValueError, match=r"BatchNorm1d '1' has its weight in torch.bfloat16 .* running statistics "
                                         r"in torch.float32.*model.to\(torch.bfloat16\)"):
        opt.attach(model)

    for way_out in ("cast first", "leave it out"):
        model = build()
        if way_out == "cast first":
            model.to(torch.bfloat16)
            opt = ShardedAdamW(model.parameters(), lr=LR)
        else:  # the normalization's parameters in float32, with a torch optimizer of their own
            norm = list(model[1].parameters())
            opt = ShardedAdamW([p for p in model.parameters() if all(p is not q for q in norm)], lr=LR)
            torch.optim.AdamW(norm, lr=LR)
        opt.attach(model)
        model(torch.randn(8, 4)).float().square().mean().backward()  # (attach casts the input to bf16)
        opt.step()
