"""Without overlap_comm, a step reduces every bucket in one coalesced reduce-scatter call and gathers them in one
coalesced all-gather call (issue 20.3), with the same bits as one call per bucket.

Real gloo processes (4 ranks: with 2 a reduction is one exact add, so the order of the adds could not show); the
calls are counted from the CPU profiler's record of the c10d ops, not by wrapping anything.
"""

import collections

import torch

import tritonshard
from tests.distributed import run_on_ranks

SIZES = (7, 130, 1, 4099, 64, 33)  # odd sizes, none a multiple of the world size


def _collective_calls(prof) -> collections.Counter:
    """c10d ops of the main group's data collectives (the handshakes' all-gathers are ``_allgather_base_``, on
    their own side group, and the norm's ``allreduce_``: left out)."""
    names = collections.Counter(e.name for e in prof.events() if e.name.startswith("c10d::"))
    return collections.Counter({n: c for n, c in names.items() if "scatter" in n or "coalesced" in n})


def _train(rank, world_size):
    def build(coalesce: bool):
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(n)) for n in SIZES]
        groups = [{"params": params[:3], "weight_decay": 0.1}, {"params": params[3:], "lr": 3e-3}]
        opt = tritonshard.ShardedAdamW(groups, lr=1e-3, bucket_cap_mb=1e-9)  # a bucket per parameter
        assert opt._coalesce, "two or more buckets without overlap_comm coalesce"
        opt._coalesce = coalesce
        return params, opt

    runs = {flag: build(flag) for flag in (True, False)}
    calls = {}
    for step in range(3):
        gen = torch.Generator().manual_seed(100 * step + rank)  # every rank its own gradients
        grads = [torch.randn(n, generator=gen).bfloat16() for n in SIZES]
        for flag, (params, opt) in runs.items():
            for p, g in zip(params, grads):
                p.grad = g.clone()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                opt.clip_grad_norm_(0.5)
                opt.step()
                opt.zero_grad()
            calls[flag] = _collective_calls(prof)
    buckets = len(runs[True][1].buckets)
    assert buckets == len(SIZES)
    assert sum(calls[True].values()) == 2, calls[True]  # one reduce-scatter call and one all-gather call
    assert sum(c for n, c in calls[True].items() if "scatter" in n) == 1, calls[True]
    assert sum(calls[False].values()) == buckets, calls[False]  # one reduce-scatter per bucket (the gathers:
    # _allgather_base_, not counted, like the handshakes')
    (p_on, opt_on), (p_off, opt_off) = runs[True], runs[False]
    for a, b in zip(p_on, p_off):
        assert torch.equal(a, b)
    for a, b in zip(opt_on.buckets, opt_off.buckets):
        assert torch.equal(a.master, b.master)
        for name in a.state:
            assert torch.equal(a.state[name], b.state[name]), name


def test_coalesced_step_matches_one_call_per_bucket():
    run_on_ranks(_train, 4)
