"""A parameter without a gradient: torch.optim skips it (its grad is None), and so does step() when no rank gave it
one (under DDP its grad would be None everywhere). One that got a gradient on some ranks only contributes zeros on
the others (DDP's average)."""

import pytest
import torch
import torch.distributed as dist

from tests.distributed import run_on_ranks
from tests.helpers import assert_bitwise_equal
from tritonshard import ShardedAdamW, ShardedLion, ShardedSGD

HEADS = ("a", "b", "c")


class _Heads(torch.nn.Module):
    """A trunk and three heads: the loss uses the heads it is asked for (multi-task loops, a branch not taken,
    an expert no token chose)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.trunk = torch.nn.Linear(8, 16)
        self.heads = torch.nn.ModuleDict({h: torch.nn.Linear(16, 3) for h in HEADS})

    def loss(self, x, used):
        h = torch.tanh(self.trunk(x.to(self.trunk.weight.dtype)))
        return sum(self.heads[k](h).float().pow(2).mean() for k in used)


def _state(opt, model):
    """Every piece step() may change, per parameter name (weights, fp32 master, moments); the step counts are
    test_param_steps.py's."""
    names = [n for n, _ in model.named_parameters()]
    out = {n: p.detach().clone() for n, p in model.named_parameters()}
    for i, entry in opt.state_dict()["state"].items():
        for key, value in entry.items():
            if key != "step":
                out[f"{names[i]}.{key}"] = value.clone()
    return out


def _assert_changed_only(before, after, used_heads, what):
    """Every piece of the heads not in ``used_heads`` unchanged, bit for bit (of the trunk too when no head was
    used); the weights of the others moved."""
    for key, value in before.items():
        owner = key.split(".")[1] if key.startswith("heads.") else "trunk"
        if owner not in used_heads and (owner != "trunk" or not used_heads):
            assert_bitwise_equal(after[key], value, f"{what}: {key}, without a gradient")
        elif key.endswith(("weight", "bias")):
            assert not torch.equal(after[key], value), f"{what}: {key} did not train"


OPTIMIZERS = {
    "adamw": lambda params, **kw: ShardedAdamW(params, lr=1e-2, weight_decay=0.1, **kw),
    "sgd": lambda params, **kw: ShardedSGD(params, lr=1e-1, momentum=0.9, weight_decay=0.1, **kw),
    "lion": lambda params, **kw: ShardedLion(params, lr=1e-2, weight_decay=0.1, **kw),
}


@pytest.mark.parametrize("kind", list(OPTIMIZERS))
@pytest.mark.parametrize("cap", [1e-9, 25.0], ids=["a bucket per parameter", "one bucket"])
def test_a_head_without_a_gradient_is_left_unchanged_as_by_torch_optim(kind, cap):
    # Before: its zeros went through the update, so weight decay and the momentum of earlier steps moved it
    model = _Heads()
    opt = OPTIMIZERS[kind](model.parameters(), bucket_cap_mb=cap)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    for used in (HEADS, ("a",), ("b", "c"), ("a", "b")):  # every head has momentum from the first step
        before = _state(opt, model)
        model.loss(x, used).backward()
        opt.step()
        opt.zero_grad()
        _assert_changed_only(before, _state(opt, model), set(used), f"{kind}, heads {used}")


def test_step_without_backward_and_model_zero_grad_before_step_change_nothing():
    model = _Heads()
    opt = ShardedAdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    model.loss(x, HEADS).backward()
    opt.step()
    before = _state(opt, model)
    opt.zero_grad()
    opt.step()  # no gradient since zero_grad(): torch.optim skips every parameter (without the zero_grad() it would
    #             apply the last gradients again, an error here: tests/optim/test_spent_grads.py)
    _assert_changed_only(before, _state(opt, model), set(), "a step() without a backward after zero_grad()")
    model.loss(x, HEADS).backward()
    model.zero_grad()  # the gradients cleared before step(): none left
    opt.step()
    _assert_changed_only(before, _state(opt, model), set(), "step() after model.zero_grad()")


def test_zero_grad_without_set_to_none_makes_zero_gradients_that_step_applies():
    # torch: zero_grad(set_to_none=False) leaves zero tensors, and step() updates with them (decay, momentum);
    # the same as a backward whose gradients are all zeros
    runs = []
    for how in ("zero_grad(set_to_none=False)", "a backward of zeros"):
        model = _Heads()
        opt = ShardedAdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
        model.loss(x, HEADS).backward()
        opt.step()
        if how == "a backward of zeros":
            opt.zero_grad()
            (model.loss(x, HEADS) * 0).backward()
        else:
            opt.zero_grad(set_to_none=False)
        before = _state(opt, model)
        opt.step()
        after = _state(opt, model)
        _assert_changed_only(before, after, set(HEADS), how)
        runs.append(after)
    for key in runs[0]:
        assert_bitwise_equal(runs[0][key], runs[1][key], key)


def _on_ranks(rank, world_size, hybrid):
    kw = {}
    if hybrid:  # shard groups {0, 1}, {2, 3}; replica groups {0, 2}, {1, 3}
        shard = [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2]
        replica = [dist.new_group([0, 2]), dist.new_group([1, 3])][rank % 2]
        kw = dict(process_group=shard, replica_group=replica)
    model = _Heads()
    opt = ShardedAdamW(model.parameters(), lr=1e-2, weight_decay=0.1, bucket_cap_mb=1e-9, **kw)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    model.loss(x, HEADS).backward()
    opt.step()
    opt.zero_grad()
    # head "b" gets a gradient on the last rank only, "c" on none, "a" everywhere
    used = ("a", "b") if rank == world_size - 1 else ("a",)
    before = _state(opt, model)
    model.loss(x, used).backward()
    opt.step()
    _assert_changed_only(before, _state(opt, model), {"a", "b"}, f"rank {rank}")


@pytest.mark.parametrize("world_size,hybrid", [(2, False), (4, True)], ids=["2 ranks", "2x2 hybrid"])
def test_a_head_without_a_gradient_on_every_rank_is_left_unchanged_one_with_some_trains(world_size, hybrid):
    run_on_ranks(_on_ranks, world_size, hybrid)


def test_zero_grad_without_set_to_none_gives_no_gradient_to_a_parameter_that_had_none():
    # torch zeroes the gradients that exist and leaves None alone: an optimizer that never saw a backward changes
    # nothing at step(), and a gradient set by hand, zeroed, then cleared is no gradient. Before, every parameter
    # got a zero gradient: weight decay moved the weights torch.optim skips
    model = _Heads()
    opt = ShardedAdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    before = _state(opt, model)
    opt.zero_grad(set_to_none=False)
    opt.step()
    _assert_changed_only(before, _state(opt, model), set(), "zero_grad(set_to_none=False) before any backward")
    opt.zero_grad()
    model.heads["a"].weight.grad = torch.ones_like(model.heads["a"].weight)
    opt.zero_grad(set_to_none=False)
    assert torch.equal(model.heads["a"].weight.grad, torch.zeros_like(model.heads["a"].weight))  # zeroed, there
    model.zero_grad()
    opt.step()
    _assert_changed_only(before, _state(opt, model), set(), "a zeroed gradient cleared before step()")
    assert all(float(e.get("step", 0)) == 0 for e in opt.state_dict()["state"].values())


def test_a_parameter_frozen_after_its_backward_is_updated_with_that_gradient_as_by_torch_optim():
    # torch.optim skips a parameter whose grad is None, not one with requires_grad=False: frozen between its
    # backward and step(), head a still steps with its gradient (as unfrozen), and from the next backward on it has
    # none and is left alone. Before, it was skipped at once
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    runs = []
    for freeze in (True, False):
        model = _Heads()
        opt = ShardedAdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        model.loss(x, HEADS).backward()
        if freeze:
            model.heads["a"].requires_grad_(False)
        opt.step()
        opt.zero_grad()
        runs.append(_state(opt, model))
    for key in runs[0]:
        assert_bitwise_equal(runs[0][key], runs[1][key], f"{key}: frozen after the backward")
    before = _state(opt, model)  # (the unfrozen run's optimizer: freeze now, as the first run did)
    model.heads["a"].requires_grad_(False)
    model.loss(x, HEADS).backward()
    opt.step()
    _assert_changed_only(before, _state(opt, model), {"b", "c"}, "head a frozen, without a gradient")


def _torch_clip_over_different_lists(rank, world_size, overlap_comm):
    """Rank 0's backward uses head a, rank 1's heads a and b: param.grad of head b is None on rank 0 only."""
    model = _Heads().to(torch.bfloat16)
    opt = ShardedAdamW(model.parameters(), lr=1e-2, weight_decay=0.1, bucket_cap_mb=1e-9, overlap_comm=overlap_comm)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    used = ["a"] if rank == 0 else ["a", "b"]
    model.loss(x, used).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)  # (each rank: the norm of its own list)
    before = _state(opt, model)
    # (head b's two parameters named, only they: head c has no gradient anywhere)
    with pytest.raises(RuntimeError, match=r"different parameters: param_groups\[0\]\['params'\]\[5\] \(shape "
                                           r"\(3,\)\), param_groups\[0\]\['params'\]\[4\] \(shape \(3, 16\)\) got a "
                                           r"gradient on some ranks only.*Nothing was updated.*opt\.clip_grad_norm_"):
        opt.step()
    after = _state(opt, model)
    for key in before:
        assert_bitwise_equal(after[key], before[key], f"{key}: the refused step changed it")
    opt.zero_grad()
    # the same loop with the optimizer's clip (the norm over every rank's gradients) trains, and after its step
    # head b's param.grad is spent on rank 0 too, as under DDP (it held the average there): a step without
    # zero_grad() is the spent-gradient error on every rank, not on rank 1 alone (which left rank 0 waiting in
    # the next step's collectives)
    model.loss(x, used).backward()
    opt.clip_grad_norm_(0.01)
    opt.step()
    assert type(model.heads["b"].weight.grad).__name__ == "SpentGrad", f"rank {rank}"
    assert model.heads["c"].weight.grad is None, f"rank {rank}: no rank gave head c a gradient"
    model.loss(x, ["a"]).backward()
    with pytest.raises(RuntimeError, match="was used by the last step"):
        opt.step()
    opt.zero_grad()
    model.loss(x, used).backward()
    opt.step()
    opt.zero_grad()


@pytest.mark.parametrize("overlap_comm", [False, True])
def test_torch_clip_over_lists_that_differ_between_ranks_is_an_error_on_every_rank(overlap_comm):
    """torch.nn.utils.clip_grad_norm_(model.parameters()) collects the param.grad that are not None: on a rank whose
    backward did not reach a head that another rank's did, its list lacks that head, so its norm and its clip
    coefficient differ from the other ranks', and each rank would clip its shard of the update by its own. Until
    session 19 that was silent (found by tests/optim/test_loop_fuzz_ranks.py). Now step() raises on every rank,
    before anything changes (the step's handshake already exchanges which parameters got no gradient where)."""
    run_on_ranks(_torch_clip_over_different_lists, 2, overlap_comm)
