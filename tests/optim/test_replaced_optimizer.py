"""A second optimizer built over parameters a first one still holds (a second phase of training with another
optimizer, a notebook cell run again while an LR scheduler still refers to the old one, an optimizer rebuilt
after unfreezing). With torch.optim that just works: the new optimizer trains them. A tritonshard parameter is a
view of one optimizer's buffer, so the new optimizer takes the parameters over and the old one is retired (its
hooks removed, every call that would train, save or load through it an error). Until session 14 the old
optimizer's hooks still fired in the next backward and it failed there ("reshape() on the gradient of ...").

The reference is bitwise: the new optimizer on the model must compute exactly what the same optimizer built over a
fresh copy of the model (the same weights, no optimizer before it) computes from the same data."""

import gc

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
@pytest.mark.usefixtures("with_overlap_machinery")  # (overlap_comm: gathers in flight, as on many ranks)
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
    # nothing cleared the gradients old.step() used: torch.optim's new optimizer would add the next backward's to
    # them, so its step is the spent-gradient error (test_spent_grads.py), until the loop clears them
    model(torch.randn(4, 9).to(torch.bfloat16)).float().sum().backward()
    with pytest.raises(RuntimeError, match="was used by the last step"):
        new.step()
    new.zero_grad()
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


def _torch_reference(model, grads, make):
    """torch.optim over fp32 masters taken from ``model``'s bf16 weights (as a new ShardedAdamW/SGD takes them),
    with ``grads`` (None or an fp32 tensor per parameter) as the gradients its first step finds."""
    masters = [p.detach().float().clone().requires_grad_() for p in model.parameters()]
    for m, g in zip(masters, grads):
        m.grad = g
    return masters, make(masters)


def _reference_backward(model, masters, x):
    """The bf16 gradients a backward of ``model``'s architecture at the masters' rounding gives, as fp32 ``.grad``
    of the masters (what the optimizer steps them with)."""
    twin = _model()
    with torch.no_grad():
        for t, m in zip(twin.parameters(), masters):
            t.copy_(m)
    twin(x).float().square().mean().backward()
    for t, m in zip(twin.parameters(), masters):
        m.grad = t.grad.float()


def _assert_as_torch(model, new, masters, ropt, what):
    """Weights within one bf16 ulp (+2e-6: a master within fp32 op-order noise of a rounding boundary), masters to
    2e-6 (values ~0.3, a wrong step moves them by ~lr), step counts exact."""
    state = new.state_dict()["state"]
    for i, (p, m) in enumerate(zip(model.parameters(), masters)):
        bound = m.detach().abs() * 2.0 ** -7 + 2e-6
        assert ((p.detach().float() - m.detach()).abs() <= bound).all(), f"{what}: weights of parameter {i}"
        torch.testing.assert_close(state[i]["master"].reshape(m.shape), m.detach(), rtol=0, atol=2e-6,
                                   msg=f"{what}: master of parameter {i}")
        theirs = ropt.state.get(m, {})
        if "step" in theirs:
            assert float(state[i]["step"]) == float(theirs["step"]), f"{what}: step count of parameter {i}"


_MAKERS = {
    "ShardedAdamW": (lambda ps: ShardedAdamW(ps, lr=1e-2, weight_decay=0.1),
                     lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=False)),
    "ShardedSGD": (lambda ps: ShardedSGD(ps, lr=0.1, momentum=0.9, weight_decay=0.1),
                   lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.1, foreach=False)),
}


def _first_step_on_zeros(model, maker: str, zeroed: int, what: str):
    """A new optimizer of ``maker`` over ``model`` and torch.optim's over fp32 masters of its weights, each finding
    the ``param.grad`` the loop left (``zeroed`` parameters hold zeros, the rest None), both stepped once and
    compared (the reference's first weight moved: the zeros were applied, weight decay); (new, masters, ropt)."""
    ours, theirs = _MAKERS[maker]
    grads = [None if p.grad is None else torch.zeros(p.shape) for p in model.parameters()]
    assert sum(g is not None for g in grads) == zeroed
    new = ours(list(model.parameters()))
    masters, ropt = _torch_reference(model, grads, theirs)
    before = masters[0].detach().clone()
    new.step()
    ropt.step()
    _assert_as_torch(model, new, masters, ropt, f"{what}: first step")
    assert not torch.equal(masters[0].detach(), before), "the reference's first step did not move the weights"
    return new, masters, ropt


@pytest.mark.parametrize("maker", list(_MAKERS))
@pytest.mark.parametrize("zeroed_by", ["opt.zero_grad(set_to_none=False) after step()",
                                       "model.zero_grad(set_to_none=False) after a backward"])
def test_a_new_optimizer_applies_the_zeroed_gradients_it_finds(maker, zeroed_by):
    """Gradients of zeros in param.grad when the new optimizer is built: torch.optim's first step applies them
    (weight decay, momentum, a step count); until session 19 the new optimizer dropped them, so its first step
    skipped every parameter (and a backward right after a zeroing refused the new optimizer as 'between a
    backward and its step'). A parameter whose gradient is None stays skipped."""
    model = _model()
    old = ShardedAdamW(model.parameters(), lr=1e-2)
    _train(model, old, range(1))
    model(torch.randn(4, 9, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)).float().sum().backward()
    if zeroed_by.startswith("opt"):
        old.step()
        old.zero_grad(set_to_none=False)
    else:
        model.zero_grad(set_to_none=False)
    model[2].bias.grad = None  # (this one has no gradient: skipped by both)
    new, masters, ropt = _first_step_on_zeros(model, maker, 3, f"{maker}, {zeroed_by}")
    new.zero_grad()
    ropt.zero_grad()
    x = torch.randn(4, 9, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
    model(x).float().square().mean().backward()
    _reference_backward(model, masters, x)
    new.step()
    ropt.step()
    _assert_as_torch(model, new, masters, ropt, f"{maker}, {zeroed_by}: second step")


@pytest.mark.parametrize("maker", list(_MAKERS))
@pytest.mark.parametrize("overlap", [False, True])
def test_a_hand_set_gradient_zeroed_before_a_gradient_only_backward_is_the_new_optimizers(maker, overlap):
    """A gradient set by hand, zeroed by ``opt.zero_grad(set_to_none=False)``, then ``torch.autograd.grad`` through
    the attached model (a metric's gradient: it accumulates nothing): torch.optim keeps the zeros in param.grad and
    a new optimizer's first step applies them. Until session 35 the end of that backward flushed the zeros into
    the old optimizer's buffer, and the new optimizer was refused as built 'between a backward and its step()'
    (found by tests.optim.loop_fuzz_long's OverlappedTrainingLoop)."""
    model = _model()
    old = ShardedAdamW(model.parameters(), lr=1e-2, overlap_comm=overlap)
    old.attach(model)
    _train(model, old, range(1))
    model[0].weight.grad = torch.randn(model[0].weight.shape).to(torch.bfloat16)
    old.zero_grad(set_to_none=False)
    x = torch.randn(4, 9, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    torch.autograd.grad(model(x).float().sum(), list(model.parameters()))
    _first_step_on_zeros(model, maker, 1, f"{maker}, overlap_comm={overlap}")


@pytest.mark.parametrize("maker", list(_MAKERS))
@pytest.mark.parametrize("then", ["nothing", "model.zero_grad(set_to_none=False), the old optimizer gone",
                                  "new.zero_grad(set_to_none=False)"])
def test_a_frozen_parameter_holding_the_old_optimizers_marker_is_taken_over_with_it(maker, then):
    """A parameter frozen after the old optimizer was built, given a gradient by hand and stepped with it (as
    torch.optim steps any parameter whose grad is not None), holds the old optimizer's spent marker; the new
    optimizer finds it frozen. torch.optim's new optimizer would apply that gradient again (ours: the spent error,
    also after a second new optimizer, with the other parameters' new gradients set), or, once the loop zeroed
    it, zeros (weight decay, momentum, a step count). Until session 21 the marker stayed the old optimizer's until
    the next step: zeroing it raised once the old one was gone, zeroing through the new one did not make it zeros
    (the step count differed from torch's) and the step applied the spent gradient again without the error (found
    by tests/optim/test_loop_fuzz.py)."""
    ours, theirs = _MAKERS[maker]
    model = _model()
    old = ShardedAdamW(model.parameters(), lr=1e-2)
    model[2].weight.requires_grad_(False)
    model(torch.randn(4, 9, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)).float().sum().backward()
    model[2].weight.grad = torch.randn(5, 13, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
    old.step()
    new = ours(list(model.parameters()))
    if then == "nothing":
        new = ours(list(model.parameters()))  # (a cell run again: a third optimizer takes over from the second)
        del old
        gc.collect()
        for p in (model[0].weight, model[0].bias, model[2].bias):  # (new gradients of the others, by hand)
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
        before = [p.detach().clone() for p in model.parameters()]
        with pytest.raises(RuntimeError, match="was used by the last step"):
            new.step()
        for p, b in zip(model.parameters(), before):
            assert_bitwise_equal(p.detach(), b, "weights after the refused step")
        return
    if then.startswith("model"):
        del old
        gc.collect()
        model.zero_grad(set_to_none=False)
    else:
        new.zero_grad(set_to_none=False)
    masters, ropt = _torch_reference(model, [torch.zeros(p.shape) for p in model.parameters()], theirs)
    new.step()
    ropt.step()
    _assert_as_torch(model, new, masters, ropt, f"{maker}, {then}")  # (step counts too, where torch keeps them)


def test_a_new_optimizer_built_right_after_step_keeps_the_spent_gradient_error():
    """old.step() and no zero_grad(): torch.optim's new optimizer would apply the same gradient again at its
    first step; ours raises there instead (the gradient is gone: test_spent_grads.py), until the loop clears it.
    Until session 19 the new optimizer found no gradient and its step skipped every parameter, silently."""
    model = _model()
    old = ShardedAdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 9).to(torch.bfloat16)).float().sum().backward()
    old.step()
    new = ShardedSGD(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    for call in (new.step, lambda: new.clip_grad_norm_(1.0)):
        with pytest.raises(RuntimeError, match="was used by the last step"):
            call()
    for p, b in zip(model.parameters(), before):
        assert_bitwise_equal(p.detach(), b, "weights after the refused step")
    model.zero_grad()
    _train(model, new, range(1))


def test_a_placeholder_of_an_optimizer_that_is_gone_is_an_error():
    """A backward's gradients in the buffers of an optimizer the program let go of before its step(): the new
    optimizer cannot take them (torch.optim would apply them), so it says so instead of starting without them."""
    model = _model()
    old = ShardedAdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 9).to(torch.bfloat16)).float().sum().backward()
    del old
    gc.collect()
    with pytest.raises(RuntimeError, match="optimizer that no longer exists, from a backward that no step"):
        ShardedAdamW(model.parameters(), lr=1e-2)
    model.zero_grad()
    _train(model, ShardedAdamW(model.parameters(), lr=1e-2), range(1))


@pytest.mark.parametrize("maker", list(_MAKERS))
def test_zeroed_gradients_beside_a_backwards_cleared_ones_are_not_in_a_new_optimizers_way(maker):
    """``opt.zero_grad(set_to_none=False)``, a backward through the head only (its gradients flushed into the
    buffers), the head's gradients cleared (``p.grad = None``): param.grad holds zeros or None, which torch.optim's
    new optimizer takes (it applies the zeros). Until session 43 the flush forgot which parameters held zeros, so
    the first layer's zeros counted as a backward's gradient and the new optimizer was refused as built 'between a
    backward and its step()' (found by tests.optim.loop_fuzz_long with stored remainders; any options)."""
    model = _model()
    old = ShardedAdamW(model.parameters(), lr=1e-2)
    _train(model, old, range(1))
    model(torch.randn(4, 9, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)).float().sum().backward()
    old.step()
    old.zero_grad(set_to_none=False)
    h = torch.randn(4, 13, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
    model[2](h).float().square().mean().backward()  # (the head only: its gradients added onto its zeros)
    model[2].weight.grad = model[2].bias.grad = None
    _first_step_on_zeros(model, maker, 2, maker)


@pytest.mark.parametrize("maker", list(_MAKERS))
def test_hand_set_gradients_zeroed_beside_a_backwards_cleared_ones_are_not_in_a_new_optimizers_way(maker):
    """As above, with the zeros those of gradients set by hand (``p.grad = t``) and zeroed in place by
    ``opt.zero_grad(set_to_none=False)``: the head's backward flushes them into the buffers beside its own
    gradients, unchanged. Until session 46 that flush counted them as the backward's, so once the head's gradients
    were cleared the new optimizer was refused as built 'between a backward and its step()', where torch.optim's
    takes the zeros (found by tests.optim.loop_fuzz_long's TrainingLoop)."""
    model = _model()
    old = ShardedAdamW(model.parameters(), lr=1e-2)
    _train(model, old, range(1))
    gen = torch.Generator().manual_seed(9)
    for p in model[0].parameters():
        p.grad = torch.randn(p.shape, generator=gen).to(torch.bfloat16)
    old.zero_grad(set_to_none=False)
    h = torch.randn(4, 13, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
    model[2](h).float().square().mean().backward()  # (the head only)
    model[2].weight.grad = model[2].bias.grad = None
    _first_step_on_zeros(model, maker, 2, maker)


def test_a_refused_new_optimizer_can_be_built_once_the_launched_gradients_are_cleared():
    """overlap_comm: a backward's end launched the reduce-scatters, so a new optimizer is refused; the loop then
    clears every gradient (model.zero_grad()), which drops the launched reductions as torch.optim would drop the
    gradients, and the new optimizer can be built. Until session 19 the refused attempt had used up the old
    optimizer's one look at whether the launches were discarded, so it stayed refused until the old one stepped."""
    model = _model()
    old = ShardedAdamW(model.parameters(), lr=1e-2, overlap_comm=True, bucket_cap_mb=1e-9)
    old.attach(model)
    model(torch.randn(4, 9).to(torch.bfloat16)).float().sum().backward()
    assert old.reduce_scatters_launched == len(old.buckets)
    with pytest.raises(RuntimeError, match=r"still holds between a backward and its step\(\)"):
        ShardedSGD(model.parameters(), lr=0.1)
    model.zero_grad()
    new = ShardedSGD(model.parameters(), lr=0.1, momentum=0.9)
    fresh = _fresh_copy(model)
    ref = ShardedSGD(fresh.parameters(), lr=0.1, momentum=0.9)
    _train(model, new, range(2))
    _train(fresh, ref, range(2))
    for a, b in zip(model.parameters(), fresh.parameters()):
        assert_bitwise_equal(a.detach(), b.detach(), "the weights")
