"""A shard group of one rank (one GPU under ``torchrun --nproc-per-node 1``): its reduce-scatter and all-gather
are the identity on the buffers, whose local shard is all of them, so none is issued (session 32). Until then a
1-rank NCCL group got every call: on the H200 ~50 us of host time each, with ``overlap_comm`` a reduce-scatter and
an all-gather per bucket and step (the 302M example's end-to-end run with overlap sat at 1.01x torch AMP's speed
where the same run without overlap reached 1.38x). The training must be the single-process one, bit for bit."""

from __future__ import annotations

import contextlib
import os
import tempfile

import torch
import torch.distributed as dist
from torch import nn

from tests.distributed import run_on_ranks
from tritonshard import Buffer, ShardedAdamW
from tritonshard.buffer import COMPLETED


def _collectives(prof) -> list:
    return [e.name for e in prof.events() if e.name.startswith("c10d::")]


def _train(overlap_comm: bool, steps: int = 3) -> tuple[list, list]:
    """Three steps of two micro-batches (the first in no_sync()), attached, clipped, on a model split into one
    bucket per parameter: (the c10d ops the steps issued, the parameters after them)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 5))
    opt = ShardedAdamW(model.parameters(), lr=1e-2, weight_decay=0.1, bucket_cap_mb=1e-9, overlap_comm=overlap_comm)
    opt.attach(model)
    assert len(opt.buckets) == 4
    gen = torch.Generator().manual_seed(1)
    issued = []
    for _ in range(steps):
        with torch.profiler.profile() as prof:
            for micro in range(2):
                with opt.no_sync() if micro == 0 else contextlib.nullcontext():
                    model(torch.randn(4, 8, generator=gen)).square().mean().backward()
            opt.clip_grad_norm_(0.5)
            opt.step()
            opt.zero_grad()
        issued += _collectives(prof)
    opt.wait_for_params()
    return issued, [p.detach().clone() for p in model.parameters()]


def _on_one_rank(rank, world_size, out_dir):
    assert dist.is_initialized() and dist.get_world_size() == 1
    # the Buffer's own collectives: the identity, a completed handle, no call
    data = torch.randn(37)
    buf = Buffer([torch.randn(37)], rank=0, world_size=1, dtype=torch.float32)
    buf.get_data()[:37].copy_(data)
    with torch.profiler.profile() as prof:
        works = [buf.reduce_scatter(async_op=True), buf.all_gather(async_op=True)]
        assert buf.reduce_scatter() is None and buf.all_gather() is None
    assert works == [COMPLETED, COMPLETED]
    assert _collectives(prof) == []
    assert torch.equal(buf.get_data()[:37], data) and buf.get_local_shard().data_ptr() == buf.get_data().data_ptr()
    for overlap_comm in (False, True):
        issued, params = _train(overlap_comm)
        assert issued == [], f"overlap_comm={overlap_comm}: {sorted(set(issued))}"
        torch.save(params, os.path.join(out_dir, f"overlap={overlap_comm}.pt"))


def test_a_one_rank_group_issues_no_collective_and_trains_as_one_process():
    with tempfile.TemporaryDirectory() as tmp:
        run_on_ranks(_on_one_rank, 1, tmp)
        on_rank = {mode: torch.load(os.path.join(tmp, f"overlap={mode}.pt")) for mode in (False, True)}
    for overlap_comm in (False, True):
        issued, alone = _train(overlap_comm)  # (this process has no process group)
        assert issued == []
        for a, b in zip(on_rank[overlap_comm], alone):
            assert torch.equal(a.view(torch.int16), b.view(torch.int16)), f"overlap_comm={overlap_comm}"
