"""Code written for torch.optim edits ``opt.state``: it resets it (``opt.state.clear()``, ``opt.state =
defaultdict(dict)``, ``del opt.state[p]``: torch.optim then starts those parameters afresh at their next step),
restarts a count or replaces a tensor. tritonshard keeps the state in its buffers and shows views of this rank's
pieces, so until session 16 every such edit silently changed nothing (the moments and counts carried on). Now the
next step carries them into the buffers (tritonshard/optim/state_view.py), checked against torch.optim on an fp32
twin fed the same gradients, at 1 and 2 ranks; what cannot be carried is an error."""

import collections
import copy

import pytest
import torch

from tests.distributed import run_on_ranks
from tritonshard import ShardedAdamW, ShardedSGD

STEPS, EDIT_AT = 5, 2


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(9, 13), torch.nn.Tanh(), torch.nn.Linear(13, 5)).to(torch.bfloat16)


def _set_grads(params, step):
    g = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g).to(p.dtype)


def _edit(how, opt, params):
    """``how``, done to an optimizer's ``state`` the way torch.optim code does it (``params``: its parameters)."""
    if how == "clear":
        opt.state.clear()
    elif how == "replaced":
        opt.state = collections.defaultdict(dict)
    elif how == "one deleted":
        del opt.state[params[0]]
    elif how == "one emptied":
        opt.state[params[2]] = {}
    elif how == "one cleared in place":
        opt.state[params[1]].clear()
    elif how == "count restarted":
        opt.state[params[1]]["step"] = torch.tensor(0.0)
    elif how == "moment replaced":
        opt.state[params[0]]["exp_avg"] = torch.zeros_like(opt.state[params[0]]["exp_avg"])
    elif how == "moment zeroed in place":
        opt.state[params[3]]["exp_avg_sq"].zero_()
    elif how == "every value copied (Lightning's teardown)":  # (_optimizer_to_device: every value but step moved)
        for entry in opt.state.values():
            for key, value in list(entry.items()):
                if key != "step":
                    entry[key] = value.clone() if torch.is_tensor(value) else tuple(list(value))


MAKE = {"adamw": (lambda ps: ShardedAdamW(ps, lr=1e-2, weight_decay=0.1, bucket_cap_mb=1e-4),
                  lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=False)),
        "sgd": (lambda ps: ShardedSGD(ps, lr=1e-1, momentum=0.9, weight_decay=0.1, bucket_cap_mb=1e-4),
                lambda ps: torch.optim.SGD(ps, lr=1e-1, momentum=0.9, weight_decay=0.1, foreach=False))}
CASES = [("adamw", how) for how in ("clear", "replaced", "one deleted", "one emptied", "one cleared in place",
                                    "count restarted",
                                    "moment replaced", "moment zeroed in place",
                                    "every value copied (Lightning's teardown)")] + \
        [("sgd", how) for how in ("clear", "one deleted")]


def _train_with_edit(how, model, opt, twin, topt):
    """STEPS steps of ``opt`` on ``model`` and ``topt`` on its fp32 ``twin``, fed the same gradients (the same on
    every rank: their average is exact), with ``how`` done to both optimizers' state before step EDIT_AT."""
    for step in range(STEPS):
        _set_grads(list(model.parameters()), step)
        for p, q in zip(model.parameters(), twin.parameters()):
            q.grad = p.grad.float()
        if step == EDIT_AT:
            _edit(how, opt, list(model.parameters()))
            _edit(how, topt, list(twin.parameters()))
        opt.step()
        topt.step()
        opt.zero_grad()
        topt.zero_grad()


def _against_torch(rank, world_size, kind, how):
    model = _model()
    twin = copy.deepcopy(model).float()
    make_ours, make_torch = MAKE[kind]
    opt, topt = make_ours(list(model.parameters())), make_torch(list(twin.parameters()))
    _train_with_edit(how, model, opt, twin, topt)
    ours, theirs = opt.state_dict()["state"], topt.state_dict()["state"]
    for i, q in enumerate(twin.parameters()):
        if kind == "adamw":  # (torch.optim.SGD keeps no count)
            assert float(ours[i]["step"]) == float(theirs[i]["step"]), (how, i)
        for key in theirs[i]:
            if key != "step":  # fp32 state against torch's: within its op order (an edit not followed: ~1e-2)
                torch.testing.assert_close(ours[i][key], theirs[i][key], rtol=0, atol=1e-6, msg=f"{how}: {i}.{key}")
        torch.testing.assert_close(ours[i]["master"], q.detach(), rtol=0, atol=1e-6, msg=f"{how}: master {i}")


@pytest.mark.parametrize("kind,how", CASES, ids=[f"{k} {h}" for k, h in CASES])
def test_an_edit_of_opt_state_acts_as_in_torch_optim(kind, how):
    _against_torch(0, 1, kind, how)


def _on_two_ranks(rank, world_size):
    for kind, how in CASES:  # (one pair of processes for them all: each rank edits its own pieces)
        _against_torch(rank, world_size, kind, how)


def test_edits_on_two_ranks_act_on_each_ranks_pieces():
    run_on_ranks(_on_two_ranks, 2)


def test_what_cannot_be_carried_into_the_buffers_is_an_error_and_reads_cost_nothing(monkeypatch):
    model = _model()
    frozen = torch.nn.Parameter(torch.randn(3), requires_grad=False)
    params = list(model.parameters())
    for edit, message in ((lambda o: o.state.__setitem__(params[0], {"exp_avg": torch.zeros(3)}),
                           r"was replaced by dict with keys \['exp_avg'\]"),
                          (lambda o: o.state[params[0]].pop("exp_avg_sq"), r"\['exp_avg_sq'\] was deleted"),
                          (lambda o: o.state[params[0]].__setitem__("exp_avg", torch.zeros(7)),
                           r"\['exp_avg'\] was replaced by a tensor of shape \(7,\).* \(117,\)")):
        opt = ShardedAdamW(params, lr=1e-2)
        _set_grads(params, 0)
        opt.step()
        opt.zero_grad()  # (else the step's spent gradients are the error: tests/optim/test_spent_grads.py)
        edit(opt)
        with pytest.raises(RuntimeError, match=message):
            opt.step()
    # a logger reading every parameter's state, frozen ones too (a defaultdict inserts an entry), is no edit: the
    # step does not look at the state
    opt = ShardedAdamW(params + [frozen], lr=1e-2)
    followed = []
    monkeypatch.setattr(type(opt), "_follow_state_edits", lambda self: followed.append(1))
    for step in range(3):
        _set_grads(params, step)
        opt.step()
        logged = [float(opt.state[p].get("exp_avg", torch.zeros(1)).abs().sum()) for p in params + [frozen]]
        assert logged[-1] == 0.0 and logged[0] > 0.0
    assert not followed


@pytest.mark.parametrize("how", ["clear", "one deleted"])
def test_a_reset_of_muon_state_acts_as_in_torch_optim_muon(how):
    """ShardedMuon's momentum buffers through the same path, against torch.optim.Muon on an fp32 twin (matrices
    only). Tolerance as tests/optim/test_muon.py's: fp32 op order, and a rare bf16 Newton-Schulz input one ulp off
    (2^-8 of one step's update); a reset not followed moves the masters by a whole update's share (~lr)."""
    from tritonshard import ShardedMuon
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(9, 13, bias=False), torch.nn.Linear(13, 5, bias=False))
    twin = copy.deepcopy(model)
    kw = dict(lr=2e-2, weight_decay=0.1, momentum=0.95, nesterov=True)
    opt, topt = ShardedMuon(list(model.parameters()), **kw), torch.optim.Muon(list(twin.parameters()), **kw)
    _train_with_edit(how, model, opt, twin, topt)
    state = opt.state_dict()["state"]
    for i, q in enumerate(twin.parameters()):
        scale = float(q.detach().abs().max())
        assert float((state[i]["master"] - q.detach()).abs().max()) <= 1e-6 * scale + 2e-4 * 0.02, (how, i)
        buf = topt.state[q]["momentum_buffer"]
        assert float((state[i]["momentum_buffer"] - buf).abs().max()) <= 1e-6 * float(buf.abs().max()), (how, i)



def test_a_momentum_buffer_set_after_steps_without_momentum_is_taken_as_made_as_torch_sgd_takes_it():
    """torch.optim.SGD takes a momentum buffer it finds in the state (buf = momentum * buf + (1 - dampening) * g),
    one set by hand where it had none too; it makes one from the gradient only where there is none. ShardedSGD
    shows a buffer (zeros) from the first step on also in a group without momentum, and a buffer set there at count
    0 counts as made (until session 50 the first step with momentum overwrote it with the gradient, silently). A
    1-D parameter on one rank, whose piece has the parameter's shape, as code written for torch.optim sets it."""
    model = _model()
    twin = copy.deepcopy(model).float()
    kw = dict(lr=1e-1, momentum=0.9, dampening=0.3)
    groups = lambda m: [{"params": [m[0].bias], "momentum": 0.0},  # noqa: E731
                        {"params": [m[0].weight, m[2].weight, m[2].bias]}]
    opt = ShardedSGD(groups(model), bucket_cap_mb=1e-4, **kw)
    topt = torch.optim.SGD(groups(twin), foreach=False, **kw)
    start = torch.linspace(-1, 1, model[0].bias.numel())
    for step in range(4):
        _set_grads(list(model.parameters()), step)
        for p, q in zip(model.parameters(), twin.parameters()):
            q.grad = p.grad.float()
        if step == 2:  # after two steps without momentum: a buffer set, and momentum turned on
            opt.state[model[0].bias]["momentum_buffer"] = start.clone()
            topt.state[twin[0].bias]["momentum_buffer"] = start.clone()
            opt.param_groups[0]["momentum"] = topt.param_groups[0]["momentum"] = 0.9
        opt.step()
        topt.step()
    ours, theirs = opt.state_dict()["state"], topt.state_dict()["state"]
    for i, q in enumerate([twin[0].bias, twin[0].weight, twin[2].weight, twin[2].bias]):  # (torch.optim's order)
        # (fp32 against torch's op order, as _against_torch)
        torch.testing.assert_close(ours[i]["momentum_buffer"], theirs[i]["momentum_buffer"], rtol=0, atol=1e-6,
                                   msg=f"momentum buffer {i}")
        torch.testing.assert_close(ours[i]["master"], q.detach(), rtol=0, atol=1e-6, msg=f"master {i}")


def _step_refuses_state_given_to_the_bias_before_its_first_step(opt, model, key) -> list:
    """``opt.step()`` raises naming ``model[0].bias``'s state ``key`` and changes no weight; the weights."""
    before = [p.detach().clone() for p in model.parameters()]
    name = r"param_groups\[0\]\['params'\]\[1\] \(shape \(13,\)\)"
    with pytest.raises(RuntimeError, match=rf"opt.state\[{name}\] was given \['{key}'\] before the parameter's "
                                           r"first step.*opt.load_state_dict"):
        opt.step()
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    return before


@pytest.mark.parametrize("kind", ["sgd", "adamw"])
def test_state_given_before_the_first_step_is_an_error_before_anything_changes(kind):
    """Before its first step a parameter has no state in opt.state (as in torch.optim); state code gives it there
    (a momentum buffer torch.optim.SGD would take; AdamW's moments, where torch.optim.AdamW would fail on the missing
    step) went unseen until session 50, and the first step overwrote it. Now a RuntimeError naming the parameter and
    the way to load state, before any weight changes."""
    model = _model()
    opt = MAKE[kind][0](list(model.parameters()))
    key = "momentum_buffer" if kind == "sgd" else "exp_avg"
    opt.state[model[0].bias][key] = torch.ones(model[0].bias.shape)
    _set_grads(list(model.parameters()), 0)
    before = _step_refuses_state_given_to_the_bias_before_its_first_step(opt, model, key)
    del opt.state[model[0].bias]  # (what a logger's read leaves, an empty entry, is no edit)
    assert opt.state[model[0].weight] == {}
    opt.step()
    assert not all(torch.equal(a, p) for a, p in zip(before, model.parameters()))


@pytest.mark.parametrize("kind", ["sgd", "adamw"])
def test_state_given_to_a_parameter_held_frozen_is_an_error_at_its_first_step(kind):
    """A parameter frozen when the optimizer was built has no state until it trains. State code gives it while it
    is frozen stays there, as in torch.optim (which would take it at the parameter's first step); until session 51
    the step that laid the parameter out after it was unfrozen showed its own state over it, unseen. Now that step
    is the RuntimeError of state given before a first step, before any weight changes."""
    model = _model()
    model[0].bias.requires_grad_(False)
    opt = MAKE[kind][0](list(model.parameters()))
    trained = [p for p in model.parameters() if p.requires_grad]
    _set_grads(trained, 0)
    opt.step()
    key = "momentum_buffer" if kind == "sgd" else "exp_avg"
    opt.state[model[0].bias][key] = torch.ones(model[0].bias.shape)
    _set_grads(trained, 1)
    opt.step()  # (still frozen: the entry is kept, as torch.optim keeps it)
    assert torch.equal(opt.state[model[0].bias][key], torch.ones(13))
    model[0].bias.requires_grad_(True)
    opt.zero_grad()
    loss = model(torch.randn(4, 9, dtype=torch.bfloat16)).float().square().sum()
    loss.backward()
    before = _step_refuses_state_given_to_the_bias_before_its_first_step(opt, model, key)
    del opt.state[model[0].bias]
    opt.step()
    assert not torch.equal(before[1], model[0].bias)
    assert sorted(opt.state[model[0].bias]) == sorted(["step", key, "master", "shard_range"]
                                                       + (["exp_avg_sq"] if kind == "adamw" else []))
