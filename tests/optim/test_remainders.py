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


def _zeroed(model, how: str) -> None:
    """The loop writes zeros into weights between two steps (``how``), as a padding row, a pruning, a re-initialized
    bias or a sparse checkpoint does."""
    import torch.nn.utils.prune as prune
    with torch.no_grad():
        if how == "row zeroed":  # (a padding row kept at zero: a view's zero_, which no method of ours sees)
            model.fc1.weight[2].zero_()
        elif how == "negative zeros":  # (-0: the sign bit alone)
            model.fc1.weight[0].zero_().neg_()
        elif how == "nn.init.zeros_":
            torch.nn.init.zeros_(model.fc2.bias)
        elif how == "load_state_dict":  # (bf16 values of the model's own dtype: no fp32 value to take)
            sd = {k: v.clone() for k, v in model.state_dict().items()}
            sd["fc1.weight"][:, ::3] = 0
            model.load_state_dict(sd)
        elif how == "through .data":
            model.fc2.weight.data.copy_(torch.zeros_like(model.fc2.weight))
    if how == "prune.remove":  # (the pruned weights written into the parameter: its .data swapped)
        prune.l1_unstructured(model.fc1, "weight", amount=0.5)
        prune.remove(model.fc1, "weight")


ZEROINGS = ("row zeroed", "negative zeros", "nn.init.zeros_", "load_state_dict", "through .data", "prune.remove")


def _zeros_written(rank, world_size):
    for how in ZEROINGS:
        runs = []
        for remainders in (False, True):
            model = make_model(0)
            opt = ShardedAdamW(param_groups(model), lr=LR, store_param_remainders=remainders)
            sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
            for step in range(5):
                if step == 3:  # (after three steps: remainders of both signs in every parameter)
                    _zeroed(model, how)
                train_step(model, opt, sched, rank, step)
            runs.append(opt)
        plain, packed = runs
        for a, b in zip(plain.buckets, packed.buckets):
            master = b.master_fp32()
            assert torch.isfinite(master).all(), f"{how}: a non-finite master"
            assert torch.equal(a.param_buffer.get_data().view(torch.int16),
                               b.param_buffer.get_data().view(torch.int16)), f"{how}: weights"
            # (as in _same_trajectory: a master on a bf16 tie is stored one fp32 ulp lower)
            ulps = (a.master.view(torch.int32).long() - master.view(torch.int32).long()).abs()
            assert int(ulps.max()) <= 2, f"{how}: masters differ by {int(ulps.max())} ulps"


def test_zeros_written_into_the_weights_train_as_with_an_fp32_master():
    """A weight written to zero (a padding row, ``nn.init.zeros_``, pruning, a checkpoint with zeros) has the master
    zero: torch.optim's fp32 weight is zero. With stored remainders the master is the weight and its remainder, and
    until session 43 a written zero kept its element's old remainder: where that was negative (half the elements)
    the master was NaN (+0's bits minus the remainder wrap around to a NaN's), and so was the weight after the next
    step, silently; elsewhere a denormal. Now a written zero (or inf, NaN) keeps no remainder: the run trains bit
    for bit as the one with fp32 masters."""
    run_on_ranks(_zeros_written, 2)
