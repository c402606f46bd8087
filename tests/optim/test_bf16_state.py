"""state_dtype=torch.bfloat16: half the optimizer-state memory, a trajectory close to fp32 states."""

import pytest
import torch

from tests.distributed import run_on_ranks
from tests.optim.training import LR, make_model, param_groups, schedule, train_step
from tritonshard import ShardedAdamW


def _bf16_vs_fp32_states(rank, world_size, rounding):
    runs = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = make_model(0)
        opt = ShardedAdamW(param_groups(model), lr=LR, state_dtype=dtype, state_rounding=rounding,
                           bucket_cap_mb=200 * 2 / 2 ** 20)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
        for step in range(4):
            train_step(model, opt, sched, rank, step)
        runs[dtype] = opt
    fp32, bf16 = runs[torch.float32], runs[torch.bfloat16]
    assert bf16.memory_bytes()["state"] * 2 == fp32.memory_bytes()["state"]
    a, b = fp32.state_dict()["state"], bf16.state_dict()["state"]
    scale = max(float(e["master"].abs().max()) for e in a.values())
    worst = max(float((a[i]["master"] - b[i]["master"]).abs().max()) for i in a)
    # bf16 moments carry 2^-9 relative rounding error each step; Adam's update m/sqrt(v) inherits ~2^-8 of it,
    # i.e. ~4e-3 * lr = 8e-5 per step, 3e-4 over 4 steps, against max|master| ~ 0.5-1: 1e-3
    assert worst <= 1e-3 * scale, f"bf16 states ({rounding}) drift {worst / scale:.1e} from fp32 states"
    assert all(e["exp_avg"].dtype == torch.float32 for e in b.values()), "state_dict holds fp32 (torch.optim's)"
    if rounding == "stochastic":
        assert all(bk.sr_seed is not None for bk in bf16.buckets)


@pytest.mark.parametrize("rounding", ["stochastic", "nearest"])
def test_bf16_states_track_fp32_states(rounding):
    run_on_ranks(_bf16_vs_fp32_states, 2, rounding)


def test_bad_state_arguments():
    with pytest.raises(ValueError, match="state_dtype"):
        ShardedAdamW([torch.nn.Parameter(torch.ones(2))], state_dtype=torch.float16)
    with pytest.raises(ValueError, match="state_rounding"):
        ShardedAdamW([torch.nn.Parameter(torch.ones(2))], state_dtype=torch.bfloat16, state_rounding="down")
