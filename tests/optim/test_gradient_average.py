"""The average over ranks is applied inside the update (grad_scale = 1/d in fp32), not written back to the bf16
gradient shard: at d = 3 (1/3 has no finite binary expansion) the update must see sum / 3 unrounded."""

import torch

from tests.distributed import run_on_ranks
from tests.helpers import launcher_counts
from tritonshard import ShardedSGD

N = 1000


def _grads(rank: int) -> torch.Tensor:
    # small integers: every partial sum over ranks is exact in bf16, whatever order gloo adds them in
    return torch.randint(-20, 21, (N,), generator=torch.Generator().manual_seed(rank)).to(torch.bfloat16)


def _average_at_3(rank, world_size):
    param = torch.nn.Parameter(torch.zeros(N))
    opt = ShardedSGD([param], lr=1.0)  # from zero with lr 1: the new master is exactly -(the gradient it used)
    param.grad = _grads(rank)
    total = sum(_grads(r).double() for r in range(world_size))  # exact
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        norm = opt.clip_grad_norm_(1e9)  # no clipping; the norm of the average
        opt.step()
    # the scalars between the launches in one launch each (kernels/scalars.py), also on many ranks, where the
    # all-reduced fp64 totals of the norm are rounded to fp32 by a launch of their own
    launched = launcher_counts(prof)
    assert all(launched[k] == 1 for k in ("round_totals_kernel", "clip_coefficient_kernel", "step_flags_kernel")), \
        launched
    want = (total / world_size).norm()
    assert abs(float(norm) - float(want)) <= 1e-6 * float(want), (float(norm), float(want))
    master = opt.state_dict()["state"][0]["master"]
    expected = -(total.float() * (1.0 / world_size))  # fp32 product, as the kernel computes it
    # one fp32 rounding of the product at most (the sum is exact); a bf16 rounding of the average would be up to
    # 2^-9 relative, 4 orders of magnitude above this bound
    err = ((master.double() - expected.double()).abs() / expected.double().abs().clamp_min(1e-30)).max()
    assert float(err) <= 2.0 ** -23, f"master differs from -(sum / 3) by {float(err):.2e} relative"


def test_the_average_over_three_ranks_is_not_rounded_to_bf16():
    run_on_ranks(_average_at_3, 3)
