"""torch.optim's step hooks and closure on a tritonshard optimizer, as torch.optim runs them: the per-instance and
global ``register_step_pre_hook`` / ``register_step_post_hook`` (EMA updates, warm-up hooks, loggers and profilers
hang off them) around every ``step()``, with the optimizer and the call's arguments; a pre hook's change of the
hyper-parameters is this step's; a post hook reads the new weights (with ``overlap_comm`` too, whose all-gathers
are still in flight then); a removed hook no longer runs; ``step(closure)`` runs the closure and returns its loss."""

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from tritonshard import ShardedAdamW


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3)).to(torch.bfloat16)


def _backward(model, step):
    x = torch.randn(4, 7, generator=torch.Generator().manual_seed(step)).to(torch.bfloat16)
    model(x).float().square().sum().backward()


def _record(opt, calls):
    """Every kind of step hook, recording what it is handed (torch.optim hands the step's arguments, the optimizer
    first); returns the handles."""
    return [
        opt.register_step_pre_hook(lambda o, args, kwargs: calls.append(("pre", o is opt, args[0] is opt,
                                                                         args[1:], kwargs))),
        opt.register_step_post_hook(lambda o, args, kwargs: calls.append(("post", o is opt, args[0] is opt,
                                                                          args[1:], kwargs))),
        register_optimizer_step_pre_hook(lambda o, args, kwargs: calls.append(("global pre", o is opt))),
        register_optimizer_step_post_hook(lambda o, args, kwargs: calls.append(("global post", o is opt))),
    ]


def test_step_hooks_run_around_every_step_as_torch_optims():
    recorded = {}
    for name, make in (("tritonshard", lambda ps: ShardedAdamW(ps, lr=1e-2)),
                       ("torch", lambda ps: torch.optim.AdamW(ps, lr=1e-2))):
        model, calls = _model(), []
        opt = make(model.parameters())
        handles = _record(opt, calls)
        try:
            for step in range(2):
                _backward(model, step)
                opt.step()
                opt.zero_grad()
            for h in handles:
                h.remove()
            _backward(model, 2)
            opt.step()  # no hook runs any more
        finally:
            for h in handles:
                h.remove()
        recorded[name] = calls
    assert recorded["tritonshard"] == recorded["torch"], recorded
    assert recorded["torch"][:4] == [("global pre", True), ("pre", True, True, (), {}),
                                     ("post", True, True, (), {}), ("global post", True)], recorded["torch"]
    assert len(recorded["torch"]) == 8


def test_a_pre_hooks_hyper_parameters_are_that_steps():
    """A warm-up written as a step pre hook (lr set from the step count before each step) trains bit for bit as the
    same lr set by the loop before step()."""
    lrs = [1e-3, 4e-3, 1e-2]
    results = []
    for by_hook in (True, False):
        model = _model()
        opt = ShardedAdamW(model.parameters(), lr=1.0, betas=(0.8, 0.9))
        count = iter(range(len(lrs)))
        if by_hook:
            def warm_up(o, args, kwargs, count=count):
                lr = lrs[next(count)]
                for g in o.param_groups:
                    g["lr"] = lr
            opt.register_step_pre_hook(warm_up)
        for step, lr in enumerate(lrs):
            _backward(model, step)
            if not by_hook:
                opt.param_groups[0]["lr"] = lr
            opt.step()
            opt.zero_grad()
        results.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*results):
        assert torch.equal(a, b)
    assert not torch.equal(results[0][0], _model()[0].weight.detach())  # it trained


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.usefixtures("with_overlap_machinery")  # (overlap_comm: gathers in flight, as on many ranks)
def test_a_post_hook_reads_the_new_weights(overlap):
    """An EMA updated from a step post hook (the weights read through the model right after the update): with
    overlap_comm the all-gathers are in flight then, and the model's reads wait for them."""
    model = _model()
    opt = ShardedAdamW(model.parameters(), lr=1e-2, overlap_comm=overlap, bucket_cap_mb=1e-9)  # a bucket per param
    opt.attach(model)
    seen = []
    opt.register_step_post_hook(lambda o, a, k: seen.append({n: p.detach().clone()
                                                             for n, p in model.named_parameters()}))
    for step in range(3):
        _backward(model, step)
        opt.step()
        opt.zero_grad()
        opt.wait_for_params()
        for n, p in model.named_parameters():
            assert torch.equal(seen[-1][n], p.detach()), (step, n)
    assert not torch.equal(seen[0]["0.weight"], seen[-1]["0.weight"])


def test_step_with_a_closure_returns_its_loss_as_torch_optims():
    results = {}
    for name, make in (("tritonshard", lambda ps: ShardedAdamW(ps, lr=1e-2)),
                       ("torch", lambda ps: torch.optim.AdamW(ps, lr=1e-2))):
        model = _model()
        opt = make(model.parameters())

        def closure():
            opt.zero_grad()
            loss = model(torch.ones(2, 7, dtype=torch.bfloat16)).float().square().sum()
            loss.backward()
            return loss

        with torch.no_grad():  # step() runs the closure with grad enabled, as torch.optim's does
            loss = opt.step(closure).detach()
        opt.zero_grad()
        results[name] = loss.item()
    assert results["tritonshard"] == results["torch"], results  # the same model, the loss before the update


def test_a_pre_hook_may_replace_the_steps_arguments_and_the_profiler_sees_the_step_as_torch_optims():
    # tritonshard wraps step() as torch.optim does, but enters the "Optimizer.step#<class>.step" profiler range only
    # while a profiler records (torch's costs ~8 us per step without one): the hooks' contract is torch's either way
    for name, make in (("tritonshard", lambda ps: ShardedAdamW(ps, lr=1e-2)),
                       ("torch", lambda ps: torch.optim.AdamW(ps, lr=1e-2))):
        model = _model()
        opt = make(model.parameters())
        ran = []

        def closure():
            ran.append(True)
            return torch.tensor(3.0)

        handle = opt.register_step_pre_hook(lambda o, args, kwargs: ((args[0],), {"closure": closure}))
        _backward(model, 0)
        assert float(opt.step()) == 3.0 and ran == [True], name  # the hook's closure, run by the step
        handle.remove()
        opt.zero_grad()
        bad = opt.register_step_pre_hook(lambda o, args, kwargs: "not a tuple")
        _backward(model, 1)
        with pytest.raises(RuntimeError, match="must return None or a tuple of \\(new_args, new_kwargs\\)"):
            opt.step()
        bad.remove()
        opt.zero_grad()
        _backward(model, 2)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            opt.step()
        names = {e.name for e in prof.events()}
        assert f"Optimizer.step#{type(opt).__name__}.step" in names, (name, sorted(names)[:20])
        opt.zero_grad()
