"""store_param_remainders=True: the fp32 master kept as bf16 weight + int16 remainder, 2 bytes/param saved."""

import pytest
import torch

from tests.distributed import run_on_ranks
from tests.optim.training import LR, make_model, param_groups, schedule, train_step
from tritonshard import ShardedAdamW, ShardedLion, ShardedSGD

FACTORIES = {
    "adamw": lambda groups, **kw: ShardedAdamW(groups, lr=LR, **kw),
    "sgd": lambda groups, **kw: ShardedSGD(groups, lr=0.05, momentum=0.9, **kw),
    "lion": lambda groups, **kw: ShardedLion(groups, lr=1e-3, weight_decay=0.1, **kw),
}


def _same_trajectory(rank, world_size, name):
    runs = []
    for remainders in (False, True):
        model = make_model(0)
        opt = FACTORIES[name](param_groups(model), bucket_cap_mb=200 * 2 / 2 ** 20,
                              store_param_remainders=remainders)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
        for step in range(4):
            train_step(model, opt, sched, rank, step)
        runs.append(opt)
    plain, packed = runs
    for a, b in zip(plain.buckets, packed.buckets):
        assert torch.equal(a.param_buffer.get_data().view(torch.int16), b.param_buffer.get_data().view(torch.int16))
        # bit-identical masters, except where a master value fell exactly on a bf16 tie rounded down (2^-16 per
        # element per step): stored one fp32 ulp lower, after which later updates may differ by an ulp or two
        ulps = (a.master.view(torch.int32).long() - b.master_fp32().view(torch.int32).long()).abs()
        assert int(ulps.max()) <= 2, f"masters differ by {int(ulps.max())} ulps"
    mem_plain, mem_packed = plain.memory_bytes(), packed.memory_bytes()
    assert mem_packed["master"] * 2 == mem_plain["master"], "2 bytes instead of 4 per master element"
    # checkpoints hold the rebuilt fp32 master: interchangeable with the plain layout
    sd = packed.state_dict()
    other = FACTORIES[name](param_groups(make_model(1)), store_param_remainders=False)
    other.load_state_dict(sd)
    for i, entry in other.state_dict()["state"].items():
        assert torch.equal(entry["master"], sd["state"][i]["master"])


@pytest.mark.parametrize("name", ["adamw", "sgd", "lion"])
def test_same_trajectory_as_fp32_master_at_two_ranks(name):
    run_on_ranks(_same_trajectory, 2, name)


def test_remainders_need_bf16_params():
    with pytest.raises(ValueError, match="store_param_remainders"):
        ShardedAdamW([torch.nn.Parameter(torch.ones(3))], param_dtype=torch.float16, store_param_remainders=True)
