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


def _written(model, how: str) -> None:
    """The loop writes weights between two steps (``how``): zeros, as a padding row, a pruning, a re-initialized
    bias or a sparse checkpoint does, and other bf16 values, as a checkpoint of the model's dtype or an EMA swapped
    in and back out does."""
    import torch.nn.utils.prune as prune
    with torch.no_grad():
        if how == "row zeroed":  # (a padding row kept at zero: a view's zero_, which no method of ours sees)
            model.fc1.weight[2].zero_()
        elif how == "negative zeros":  # (-0: the sign bit alone)
            model.fc1.weight[0].zero_().neg_()
        elif how == "row zeroed, then a decay":  # (the decay's chain starts from the weights as the look follows
            model.fc1.weight[2].zero_()          # them)
            model.fc1.weight.mul_(1 - 1e-4)
        elif how == "nn.init.zeros_":
            torch.nn.init.zeros_(model.fc2.bias)
        elif how == "zeros through .data":
            model.fc2.weight.data.copy_(torch.zeros_like(model.fc2.weight))
        elif how == "load_state_dict, zeros":  # (bf16 values of the model's own dtype: no fp32 value to take)
            sd = {k: v.clone() for k, v in model.state_dict().items()}
            sd["fc1.weight"][:, ::3] = 0
            model.load_state_dict(sd)
        elif how == "load_state_dict, bf16 checkpoint":  # (every value new, some columns as they were)
            sd = {k: (v * 1.03 + 0.01).to(v.dtype) for k, v in model.state_dict().items()}
            sd["fc1.weight"][:, ::2] = model.fc1.weight[:, ::2]
            model.load_state_dict(sd)
        elif how == "a row set":  # (p[i] = w: a setitem of ours)
            model.fc1.weight[1] = model.fc1.weight[1] * 0.5 + 0.25
        elif how == "nn.init.normal_":
            torch.nn.init.normal_(model.fc2.weight, std=0.5)
        elif how == "an EMA swapped in and out":  # (the weights put back: their remainders are theirs again)
            backup = [p.detach().clone() for p in model.parameters()]
            for p in model.parameters():
                p.copy_(p * 0.9)
            for p, b in zip(model.parameters(), backup):
                p.copy_(b)
        elif how == "vector_to_parameters":  # (each parameter's .data swapped for a slice of the vector)
            trained = [p for p in model.parameters() if p.requires_grad]  # (the bf16 ones: not Net.frozen)
            flat = torch.nn.utils.parameters_to_vector(trained)
            torch.nn.utils.vector_to_parameters(flat * 1.01, trained)
    if how == "prune.remove":  # (the pruned weights written into the parameter: its .data swapped)
        prune.l1_unstructured(model.fc1, "weight", amount=0.5)
        prune.remove(model.fc1, "weight")


#: (not nonzero values through .data or a view, which no method of ours sees coming: the written element keeps its
#: old remainder there, within 1/2 bf16 ulp of the written value: README)
WRITTEN = ("row zeroed", "negative zeros", "row zeroed, then a decay", "nn.init.zeros_", "zeros through .data",
           "load_state_dict, zeros", "load_state_dict, bf16 checkpoint", "a row set", "nn.init.normal_",
           "an EMA swapped in and out", "prune.remove", "vector_to_parameters")


def _weights_written(rank, world_size):
    for how in WRITTEN:
        runs = []
        for remainders in (False, True):
            model = make_model(0)
            opt = ShardedAdamW(param_groups(model), lr=LR, store_param_remainders=remainders)
            sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
            for step in range(5):
                if step == 3:  # (after three steps: remainders of both signs in every parameter)
                    _written(model, how)
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


def test_weights_written_between_steps_train_as_with_an_fp32_master():
    """Weights written between steps: torch.optim's fp32 weight is the written value, and so is the fp32 master
    (where the bf16 weight is not its rounding any more). With stored remainders the master is the weight and its
    remainder, and until session 43 a written weight kept its element's old remainder: within 1/2 ulp of the
    written value, not it, and beside a written zero a NaN where the remainder was negative (half the elements: +0's
    bits minus it wrap around to a NaN's), and so after the next step the weight, silently. Now a write that
    WatchedParameter sees coming (copy_, load_state_dict, a setitem, nn.init) keeps the bucket's weights from before
    it, and the look drops the remainder wherever the weight changed; a written zero (or inf, NaN) keeps none in any
    case. The run trains bit for bit as the one with fp32 masters, also for an EMA swapped in and back out."""
    run_on_ranks(_weights_written, 2)
