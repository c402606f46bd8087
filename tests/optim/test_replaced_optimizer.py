"""A second optimizer built over parameters a first one still holds (a second phase of training with another
optimizer, a notebook cell run again while an LR scheduler still refers to the old one, an optimizer rebuilt
after unfreezing). With torch.optim that just works: the new optimizer trains them. A tritonshard parameter is a
view of one optimizer's buffer, so the new optimizer takes the parameters over and the old one is retired (its
hooks removed, every call that would train, save or load through it an error). Until session 14 the old
optimizer's hooks still fired in the next backward and it failed there ("reshape() on the gradient of ...").

The reference is bitwise: the new optimizer on the model must compute exactly what the same optimizer built over a
fresh copy of the model (the same weights, no optimizer before it) computes from the same data."""

import pytest
import torch

from tests.distributed import run_on_ranks
from tests.helpers import assert_bitwise_equal
from tritonshard import ShardedAdamW, ShardedSGD
from tritonshard.checkpoint import save_sharded


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(9, 13), torch.nn.Tanh(), torch.nn.Linear(13, 5)).to(torch.bfloat16)


def _train(model, opt, steps, rank=0, wait=True):
    for step in steps:
        x = torch.randn(4, 9, generator=torch.Generator().manual_seed(100 * step + rank)).to(torch.bfloat16)
        model(x).float().square().mean().backward()
        opt.step()
        opt.zero_grad()
    if wait:
        opt.wait_for_params()


def _fresh_copy(model):
    fresh = _model()
    fresh.load_state_dict(model.state_dict())
    return fresh


def _replaced_run(rank, world_size, options, subset):
    """Phase 1 with ShardedAdamW (a scheduler keeps it alive), phase 2 with a ShardedSGD over the same model (or
    only its head), built right after the last phase-1 step; against the ShardedSGD over a fresh copy."""
    model = _model()
    old = ShardedAdamW(model.parameters(), lr=1e-2, **options)
    if options.get("overlap_comm"):
        old.attach(model)
    sched = torch.optim.lr_scheduler.LambdaLR(old, lambda s: 1.0)  # (holds the old optimizer)
    picked = (lambda m: m[2].parameters()) if subset else (lambda m: m.parameters())
    # the list taken before the last step, so that nothing reads the attached model (whose guards would wait)
    params = list(picked(model))
    # (with overlap_comm the last step's all-gathers are still pending: the new optimizer waits for them)
    _train(model, old, range(2), rank, wait=False)
    in_flight = [b.index for b in old.buckets if b.ag_work is not None]
    assert bool(in_flight) == bool(options.get("overlap_comm")), in_flight
    new = ShardedSGD(params, lr=0.1, momentum=0.9, **options)
    # the old one's gathers write the weights the new one takes as its masters: waited for first (on gloo they
    # have usually landed anyway, so the bits below cannot tell; what is left in flight can)
    assert all(b.ag_work is None for b in old.buckets), "the new optimizer read weights still being gathered"
    fresh = _fresh_copy(model)
    ref = ShardedSGD(picked(fresh), lr=0.1, momentum=0.9, **options)
    if options.get("overlap_comm"):
        new.attach(model)
        ref.attach(fresh)
    _train(model, new, range(2, 5), rank)
    _train(fresh, ref, range(2, 5), rank)
    what = f"{options}, subset={subset}, rank {rank} of {world_size}"
    for a, b in zip(model.parameters(), fresh.parameters()):
        assert_bitwise_equal(a.detach(), b.detach(), f"{what}: the weights")
    ours, theirs = new.state_dict()["state"], ref.state_dict()["state"]
    for i in theirs:
        for key in theirs[i]:
            assert_bitwise_equal(ours[i][key], theirs[i][key], f"{what}: state {i} {key}")
    # the old optimizer is retired: each of these would train, save or load through buffers it no longer owns
    x = torch.randn(4, 9).to(torch.bfloat16)
    model(x).float().sum().backward()  # (its hooks are gone: this backward is the new optimizer's alone)
    for call in (old.step, old.zero_grad, old.state_dict, old.grad_norm, lambda: old.clip_grad_norm_(1.0),
                 lambda: old.load_state_dict(old.state_dict()), lambda: old.attach(model),
                 lambda: old.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))]})):
        with pytest.raises(RuntimeError, match=r"no longer trains its parameters: a ShardedSGD built later"):
            call()
    new.zero_grad()
    sched.step()  # (a scheduler of the old one only sets its lr: harmless)


@pytest.mark.parametrize("subset", [False, True], ids=["the whole model", "its head only"])
@pytest.mark.parametrize("options", [{}, {"bucket_cap_mb": 1e-9}, {"overlap_comm": True}],
                         ids=["one bucket", "a bucket per parameter", "overlap_comm + attach"])
def test_a_second_optimizer_over_the_same_parameters_takes_them_over(options, subset):
    _replaced_run(0, 1, options, subset)


def test_a_second_optimizer_takes_over_on_two_ranks():
    run_on_ranks(_replaced_run, 2, {"bucket_cap_mb": 1e-9, "overlap_comm": True}, False)


def test_the_old_optimizer_cannot_save_a_checkpoint_that_would_lie(tmp_path):
    model = _model()
    old = ShardedAdamW(model.parameters(), lr=1e-2)
    _train(model, old, range(1))
    new = ShardedAdamW(model.parameters(), lr=1e-2)
    _train(model, new, range(1, 2))
    with pytest.raises(RuntimeError, match="no longer trains its parameters"):
        save_sharded(old, str(tmp_path / "ckpt"))  # its masters are a step behind the weights
    save_sharded(new, str(tmp_path / "ckpt"))


def test_built_between_a_backward_and_its_step_is_an_error_until_the_step():
    """The old optimizer's buffers hold that backward's gradients: a clear error, and after step() (or
    zero_grad()) the takeover works."""
    model = _model()
    old = ShardedAdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 9).to(torch.bfloat16)).float().sum().backward()
    with pytest.raises(RuntimeError, match=r"still holds between a backward and its step\(\)"):
        ShardedSGD(model.parameters(), lr=0.1)
    old.step()  # the old optimizer was left as it was: it steps
    new = ShardedSGD(model.parameters(), lr=0.1)
    _train(model, new, range(2))
    with pytest.raises(RuntimeError, match="no longer trains"):
        old.step()


def test_add_param_group_takes_parameters_over_too():
    """The backbone trained by a first optimizer, then added as a group to a second one (the head's)."""
    model, twin = _model(), _model()
    old = ShardedAdamW(model[0].parameters(), lr=1e-2)
    twin_old = ShardedAdamW(twin[0].parameters(), lr=1e-2)
    for m, o in ((model, old), (twin, twin_old)):
        _train(m, o, range(2))
    model.zero_grad()  # (the head, in no optimizer so far, accumulated every backward's gradient: a new
    #                    optimizer would use them, as torch.optim does, and the fresh copy has none)
    head = ShardedAdamW(model[2].parameters(), lr=1e-2)
    head.add_param_group({"params": model[0].parameters(), "lr": 3e-3})
    fresh = _fresh_copy(twin)
    ref = ShardedAdamW(fresh[2].parameters(), lr=1e-2)
    ref.add_param_group({"params": fresh[0].parameters(), "lr": 3e-3})
    _train(model, head, range(2, 4))
    _train(fresh, ref, range(2, 4))
    for a, b in zip(model.parameters(), fresh.parameters()):
        assert_bitwise_equal(a.detach(), b.detach(), "after add_param_group took the backbone over")
    with pytest.raises(RuntimeError, match="no longer trains"):
        old.zero_grad()
