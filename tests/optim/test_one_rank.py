"""A shard group of one rank (one GPU under ``torchrun --nproc-per-node 1``): its reduce-scatter and all-gather
are the identity on the buffers, whose local shard is all of them, so none is issued (session 32). Until then a
1-rank NCCL group got every call: on the H200 ~50 us of host time each, with ``overlap_comm`` a reduce-scatter and
an all-gather per bucket and step (the 302M example's end-to-end run with overlap sat at 1.01x torch AMP's speed
where the same run without overlap reached 1.38x). The training must be the single-process one, bit for bit."""

from __future__ import annotations

import contextlib
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.distributed import run_on_ranks
from tests.helpers import launcher_counts, overlap_machinery
from tritonshard import Buffer, ShardedAdamW
from tritonshard.buffer import COMPLETED
from tritonshard.optim import model_sync


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



def _overlapped_run(overlap_comm: bool, machinery: bool) -> tuple[list, dict]:
    """Three steps of two micro-batches (the first in no_sync()) of a model with a norm, attached, a bucket per
    parameter; ``machinery``: overlap_comm's per-bucket machinery of many ranks in this one process. Returns the
    weights after them and what the last iteration showed."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 5))
    with overlap_machinery(machinery):
        opt = ShardedAdamW(model.parameters(), lr=1e-2, weight_decay=0.1, bucket_cap_mb=1e-9,
                           overlap_comm=overlap_comm)
    opt.attach(model)
    assert len(opt.buckets) == 6
    gen = torch.Generator().manual_seed(1)
    seen: dict = {}
    for step in range(3):
        flattens = []
        for micro in range(2):
            with (opt.no_sync() if micro == 0 else contextlib.nullcontext(),
                  torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof):
                model(torch.randn(4, 8, generator=gen)).square().mean().backward()
            flattens.append(launcher_counts(prof)["flatten_into"])
        opt.clip_grad_norm_(0.5)
        opt.step()
        seen["in flight after step()"] = sum(b.ag_work is not None for b in opt.buckets)
        opt.zero_grad()
        seen["flatten launches per backward"] = flattens
    seen["waiting modules"] = sum(isinstance(h, model_sync.WaitForParamsHook)
                                  for m in model.modules() for h in m._forward_pre_hooks.values())
    seen["guarded attributes"] = sum(isinstance(m, model_sync._GuardedAttributes) for m in model.modules())
    seen["post-accumulate hooks"] = sum(len(p._post_accumulate_grad_hooks or {}) for p in model.parameters())
    if overlap_comm:  # overlap_comm's rule, on one rank too: a second backward after the one that launched
        x = torch.randn(4, 8, generator=gen)
        model(x).square().mean().backward()
        with pytest.raises(RuntimeError, match=r"arrived after its reduce-scatter was launched.*no_sync"):
            model(x).square().mean().backward()
        opt.zero_grad()  # (recovers: the launched reduction dropped, as the gradients)
    opt.wait_for_params()
    return [p.detach().clone() for p in model.parameters()], seen


def test_overlap_comm_on_one_rank_leaves_out_the_machinery_and_trains_as_with_it():
    """On one rank overlap_comm has nothing to overlap (the reduce-scatter and the all-gather are the identity), yet
    its machinery cost host time per module and forward (a wait per module holding parameters, guarded attribute
    reads) and per parameter and backward (a second hook, a flush every four buckets): on the H200 (session 32) the
    302M example ran at 1.01-1.08x torch AMP's speed with it, 1.38-1.44x without overlap_comm. Now one rank runs
    the plain path's backward (one flatten launch, one hook per parameter) and leaves no gather in flight, under
    overlap_comm's rules (the error above); the weights are those of the plain path and of the machinery, bit for
    bit. Fails before session 33 (waits on 3 modules, 6 post-accumulate hooks, 2 launches per backward)."""
    plain, seen_plain = _overlapped_run(False, False)
    one_rank, seen = _overlapped_run(True, False)
    machinery, seen_machinery = _overlapped_run(True, True)
    assert seen == seen_plain == {"in flight after step()": 0, "flatten launches per backward": [1, 1],
                                  "waiting modules": 0, "guarded attributes": 0, "post-accumulate hooks": 0}, seen
    # the control: the machinery of many ranks (a bucket per parameter: inside no_sync() six completed buckets
    # flushed four at a time, two launches; the last backward a flush per bucket, each starting its reduce-scatter
    # on many ranks; six gathers left in flight). Before session 33 one rank ran it, its last backward flushing
    # four at a time too (until session 40 so did this control, unlike many ranks)
    assert seen_machinery == {"in flight after step()": 6, "flatten launches per backward": [2, 6],
                              "waiting modules": 3, "guarded attributes": 3, "post-accumulate hooks": 6}, \
        seen_machinery
    for i, (a, b, c) in enumerate(zip(one_rank, plain, machinery)):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16)), f"parameter {i}: against overlap_comm=False"
        assert torch.equal(a.view(torch.int16), c.view(torch.int16)), f"parameter {i}: against the machinery"
