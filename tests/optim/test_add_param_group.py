"""``add_param_group()`` after construction, as torch.optim: a group added during training (a backbone unfrozen
after some steps, as Lightning's ``BackboneFinetuning`` does) trains from the next step on with its own count,
lr and state, and the groups already there carry on untouched. Until session 13 it raised.

The reference is bitwise: the optimizer that got the group late must hold, for every parameter, exactly what an
optimizer holding only that parameter's group computes from the same gradients (the new group: one built at the
moment of the add). The updates are elementwise with fp32 state, so a layout that differs (other buckets, other
offsets, other ranks' shards) cannot change a bit; a wrong count, lr, state or a parameter updated before it was
added does. Gradients are set by hand, the same on every rank (their average is then exact)."""

import copy
import pickle

import pytest
import torch

from tests.distributed import run_on_ranks
from tests.helpers import assert_bitwise_equal
from tritonshard import ShardedAdamW, ShardedLion, ShardedMuon, ShardedSGD
from tritonshard.checkpoint import load_sharded, save_sharded

from . import graph_emulation

MAKE = {
    "adamw": lambda groups, **kw: ShardedAdamW(groups, lr=1e-2, weight_decay=0.1, **kw),
    "sgd": lambda groups, **kw: ShardedSGD(groups, lr=1e-1, momentum=0.9, dampening=0.3, weight_decay=0.1, **kw),
    "lion": lambda groups, **kw: ShardedLion(groups, lr=1e-3, weight_decay=0.1, **kw),
}
ADDED_AT = 2  # the step before which the backbone is unfrozen and its group added
STEPS = 5
LATE = {"lr": 3e-3}  # the added group's own hyper-parameters


def _model():
    """A backbone (frozen at first, outside the optimizer) and a head; odd sizes, bf16 throughout (a frozen
    parameter keeps its dtype: the README's construction order)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(9, 13), torch.nn.Tanh(), torch.nn.Linear(13, 5)).to(torch.bfloat16)


def _set_grads(named: dict, step: int) -> None:
    """This step's gradients, fresh random bf16 values, for the trainable parameters among ``named``."""
    g = torch.Generator().manual_seed(100 + step)
    for name in sorted(named):
        value = torch.randn(named[name].shape, generator=g).to(torch.bfloat16)
        if named[name].requires_grad:
            named[name].grad = value


def _state(opt) -> dict:
    """state_dict's per-parameter state by position (a collective)."""
    return opt.state_dict()["state"]


def _assert_same(ours: dict, i: int, theirs: dict, j: int, what: str) -> None:
    assert set(ours[i]) == set(theirs[j]), what
    for key in ours[i]:
        assert_bitwise_equal(ours[i][key], theirs[j][key], f"{what}: {key}")


def _late_group_run(rank, world_size, kind, options):
    """The backbone's group added before step ADDED_AT; every parameter compared with an optimizer of its own
    (``options``: the optimizer's, and ``hybrid``: 2 replicas x 2 shards of a 4-rank DeviceMesh)."""
    options = _hybrid_options(options)
    model = _model()
    head, backbone = copy.deepcopy(model[2]), copy.deepcopy(model[0])  # the references' parameters
    make = MAKE[kind]
    for p in model[0].parameters():
        p.requires_grad_(False)
    opt = make([{"params": model[2].parameters()}], **options)
    if options.get("overlap_comm"):
        opt.attach(model)
    opt_head, opt_backbone = make([{"params": head.parameters()}]), None
    initial = [p.detach().clone() for p in model[0].parameters()]
    for step in range(STEPS):
        if step == ADDED_AT:
            for p in model[0].parameters():
                p.requires_grad_(True)
            opt.add_param_group({"params": model[0].parameters(), **LATE})
            opt_backbone = make([{"params": backbone.parameters(), **LATE}])
        names = dict(model.named_parameters())
        _set_grads(names, step)
        for ref, prefix in ((head, "2."), (backbone, "0.")):
            for n, p in ref.named_parameters():
                if names[prefix + n].requires_grad:
                    p.grad = names[prefix + n].grad.clone()
        for o in (opt, opt_head, opt_backbone):
            if o is not None:
                o.step()
                o.zero_grad()
        # with overlap_comm + attach the all-gathers are still in flight: a block's own read path waits for its
        # buckets, the added group's too (attach's guards extended to them)
        seen = {k: v.clone() for k, v in model[0].state_dict().items()}
        opt.wait_for_params()
        for k, v in model[0].state_dict().items():
            assert_bitwise_equal(seen[k], v, f"model[0].{k} read right after step {step}")
        if options.get("overlap_comm") and opt_backbone is not None:
            # (the read above passes whenever gloo's gathers happen to be done already: that it waits is checked
            # here, as the buckets its guard and its forward pre-hook wait for)
            mine = {opt._bucket_of[p][0].index for p in model[0].parameters()}
            guards = model[0]._tritonshard_guards()
            assert [(o, set(i)) for o, i in guards] == [(opt, mine)], "model[0]'s read path waits for its buckets"
            waits = {i for h in model[0]._forward_pre_hooks.values() for i in getattr(h, "bucket_indices", ())}
            assert waits == mine, "model[0]'s forward waits for its buckets"
        what = f"{kind} {options}, rank {rank} of {world_size}, after step {step}"
        for a, b in zip(model[2].parameters(), head.parameters()):
            assert_bitwise_equal(a.detach(), b.detach(), f"{what}: the head, against an optimizer of its own")
        if opt_backbone is None:
            for a, b in zip(model[0].parameters(), initial):
                assert_bitwise_equal(a.detach(), b, f"{what}: the backbone before it was added")
            continue
        for a, b in zip(model[0].parameters(), backbone.parameters()):
            assert_bitwise_equal(a.detach(), b.detach(), f"{what}: the backbone, against an optimizer built when "
                                 "it was added")
        ours = _state(opt)  # torch.optim numbering: the head's group (0, 1), then the added group (2, 3)
        theirs_head, theirs_backbone = _state(opt_head), _state(opt_backbone)
        for i in range(2):
            _assert_same(ours, i, theirs_head, i, f"{what}: head state {i}")
            _assert_same(ours, 2 + i, theirs_backbone, i, f"{what}: backbone state {i}")
        if kind == "adamw":  # the counts: the added group's started at 0
            assert float(ours[0]["step"]) == step + 1 and float(ours[2]["step"]) == step + 1 - ADDED_AT
    groups = opt.state_dict()["param_groups"]
    assert [g["params"] for g in groups] == [[0, 1], [2, 3]] and groups[1]["lr"] == LATE["lr"], groups
    assert opt.param_groups[1]["lr"] == LATE["lr"]


@pytest.mark.parametrize("options", [{}, {"bucket_cap_mb": 1e-9}, {"overlap_comm": True}],
                         ids=["one bucket per group", "a bucket per parameter", "overlap_comm + attach"])
@pytest.mark.parametrize("kind", list(MAKE))
@pytest.mark.usefixtures("with_overlap_machinery")  # (overlap_comm: the waits of many ranks, in this one process)
def test_a_group_added_during_training_trains_as_an_optimizer_built_then(kind, options):
    _late_group_run(0, 1, kind, options)


def _hybrid_options(options: dict) -> dict:
    """``options`` with ``hybrid=True`` turned into a 2 x 2 DeviceMesh (replicas x shards), made on this rank."""
    options = dict(options)
    if options.pop("hybrid", False):
        from torch.distributed.device_mesh import init_device_mesh
        options["device_mesh"] = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    return options


SEVERAL_RANKS = [(2, {"bucket_cap_mb": 1e-9, "overlap_comm": True}),
                 (4, {"bucket_cap_mb": 1e-9, "overlap_comm": True}),
                 # (ordered_reduce's all-to-alls and scratch buffers, and hybrid sharding's replica all-reduce:
                 # the buckets laid out later take the same paths as those laid out at construction)
                 (4, {"bucket_cap_mb": 1e-9, "overlap_comm": True, "ordered_reduce": True}),
                 (4, {"bucket_cap_mb": 1e-9, "hybrid": True})]
SEVERAL_IDS = ["2 ranks, overlap", "4 ranks, overlap", "4 ranks, ordered_reduce + overlap", "2 x 2 hybrid"]


@pytest.mark.parametrize("world_size, options", SEVERAL_RANKS, ids=SEVERAL_IDS)
def test_a_group_added_during_training_on_several_ranks(world_size, options):
    run_on_ranks(_late_group_run, world_size, "adamw", options)


def test_like_torch_optim_on_a_twin():
    """The same schedule against torch.optim.AdamW on an fp32 copy: the same counts, and the masters within fp32
    op order of torch's (1e-6; an update at the wrong count or lr moves them by ~1e-3)."""
    model = _model()
    twin = copy.deepcopy(model).float()
    for m in (model, twin):
        for p in m[0].parameters():
            p.requires_grad_(False)
    opt = ShardedAdamW(model[2].parameters(), lr=1e-2, weight_decay=0.1)
    topt = torch.optim.AdamW(twin[2].parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    for step in range(STEPS):
        if step == ADDED_AT:
            for m, o in ((model, opt), (twin, topt)):
                for p in m[0].parameters():
                    p.requires_grad_(True)
                o.add_param_group({"params": m[0].parameters(), **LATE})
        _set_grads(dict(model.named_parameters()), step)
        for (n, p), q in zip(model.named_parameters(), twin.parameters()):
            q.grad = None if p.grad is None else p.grad.float()
        opt.step()
        topt.step()
        opt.zero_grad()
        topt.zero_grad()
    ours, theirs = opt.state_dict(), topt.state_dict()
    assert [g["params"] for g in ours["param_groups"]] == [g["params"] for g in theirs["param_groups"]]
    for i, q in enumerate(p for g in topt.param_groups for p in g["params"]):
        assert float(ours["state"][i]["step"]) == float(theirs["state"][i]["step"])
        torch.testing.assert_close(ours["state"][i]["master"], q.detach(), rtol=0, atol=1e-6)
    # opt.state shows the new parameters' pieces from their first step on (none before it, as torch)
    assert float(opt.state[model[0].weight]["step"]) == STEPS - ADDED_AT


def test_muon_takes_both_kinds_of_group_late():
    model = _model()
    refs = copy.deepcopy(model)
    make = lambda groups: ShardedMuon(groups, lr=2e-2)  # noqa: E731
    for p in model[0].parameters():
        p.requires_grad_(False)
    opt = make([{"params": [model[2].weight]}, {"params": [model[2].bias], "use_muon": False}])
    late = None
    for step in range(STEPS):
        if step == ADDED_AT:
            for p in model[0].parameters():
                p.requires_grad_(True)
            opt.add_param_group({"params": [model[0].weight]})
            opt.add_param_group({"params": [model[0].bias], "use_muon": False, "lr": 1e-3})
            late = make([{"params": [refs[0].weight]}, {"params": [refs[0].bias], "use_muon": False, "lr": 1e-3}])
        _set_grads(dict(model.named_parameters()), step)
        if late is not None:
            for n, p in refs[0].named_parameters():
                p.grad = getattr(model[0], n).grad.clone()
            late.step()
            late.zero_grad()
        opt.step()
        opt.zero_grad()
    for a, b in zip(model[0].parameters(), refs[0].parameters()):
        assert_bitwise_equal(a.detach(), b.detach(), "Muon's late groups against an optimizer built then")
    assert not torch.equal(model[2].weight.detach(), refs[2].weight.detach()), "the head trained from step 0"


def test_the_state_after_an_add_saves_and_loads_like_any_other(tmp_path):
    """state_dict() and save_sharded after an add, loaded into an optimizer built with both groups: the run
    continues bit for bit."""
    runs = {}
    for how in ("uninterrupted", "state_dict", "save_sharded"):
        model = _model()
        for p in model[0].parameters():
            p.requires_grad_(False)
        opt = ShardedAdamW([{"params": model[2].parameters()}], lr=1e-2, bucket_cap_mb=1e-9)
        for step in range(STEPS):
            if step == ADDED_AT:
                for p in model[0].parameters():
                    p.requires_grad_(True)
                opt.add_param_group({"params": model[0].parameters(), **LATE})
            if step == ADDED_AT + 1 and how != "uninterrupted":
                weights = copy.deepcopy(model.state_dict())
                if how == "state_dict":
                    saved = opt.state_dict()
                else:
                    save_sharded(opt, str(tmp_path / how))
                model = _model()
                model.load_state_dict(weights)
                opt = ShardedAdamW([{"params": model[2].parameters()}, {"params": model[0].parameters(), **LATE}],
                                   lr=1e-2)
                if how == "state_dict":
                    opt.load_state_dict(saved)
                else:
                    load_sharded(opt, str(tmp_path / how))
            _set_grads(dict(model.named_parameters()), step)
            opt.step()
            opt.zero_grad()
        runs[how] = [p.detach().clone() for p in model.parameters()]
    for how in ("state_dict", "save_sharded"):
        for a, b in zip(runs[how], runs["uninterrupted"]):
            assert_bitwise_equal(a, b, f"resumed through {how} after an add_param_group")


def test_cuda_graph_recaptures_after_an_add_and_keeps_the_eager_bits(monkeypatch):
    graph_emulation.install(monkeypatch)
    runs = []
    for graphed in (False, True):
        model = _model()
        for p in model[0].parameters():
            p.requires_grad_(False)
        opt = ShardedAdamW(model[2].parameters(), lr=1e-2, cuda_graph=graphed)
        for step in range(STEPS + 2):
            if step == ADDED_AT:
                for p in model[0].parameters():
                    p.requires_grad_(True)
                opt.add_param_group({"params": model[0].parameters(), **LATE})
                if graphed:
                    captured = opt._graphs.captures
            _set_grads(dict(model.named_parameters()), step)
            opt.step()
            opt.zero_grad()
        runs.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*runs):
        assert_bitwise_equal(b, a, "graphed against eager, with a group added")
    assert captured > 0 and opt._graphs.captures > captured, "the steps after the add were captured anew"


# ------------------------------------------------------------------------------------------------ errors
def test_what_cannot_be_added_is_an_error_that_leaves_the_optimizer_as_it_was():
    model = _model()
    for p in model[0].parameters():
        p.requires_grad_(False)
    opt = ShardedAdamW(model[2].parameters(), lr=1e-2)
    with pytest.raises(ValueError, match="more than one parameter group"):  # torch.optim's own check
        opt.add_param_group({"params": [model[2].weight]})
    with pytest.raises(ValueError, match=r"betas\[0\] must be in \[0, 1\).*param_groups\[1\]"):
        opt.add_param_group({"params": model[0].parameters(), "betas": (1.5, 0.9)})
    assert len(opt.param_groups) == 1 and len(opt.buckets) == 1
    # between a backward and its step()
    for p in model[0].parameters():
        p.requires_grad_(True)
    model(torch.randn(2, 9, dtype=torch.bfloat16)).sum().backward()
    with pytest.raises(RuntimeError, match="between a backward and its step"):
        opt.add_param_group({"params": model[0].parameters()})
    opt.step()
    opt.zero_grad()
    opt.add_param_group({"params": model[0].parameters()})
    assert len(opt.param_groups) == 2
    # a ShardedSGD without momentum buffers cannot take a group with momentum
    sgd_model = _model()
    sgd = ShardedSGD(sgd_model[2].parameters(), lr=0.1)
    with pytest.raises(ValueError, match="built without momentum"):
        sgd.add_param_group({"params": sgd_model[0].parameters(), "momentum": 0.9})
    sgd.add_param_group({"params": sgd_model[0].parameters()})


def _different_groups(rank, world_size):
    model = _model()
    for p in model[0].parameters():
        p.requires_grad_(False)
    opt = ShardedAdamW(model[2].parameters(), lr=1e-2)
    for p in model[0].parameters():
        p.requires_grad_(True)
    params = [model[0].weight] if rank == 0 else list(model[0].parameters())
    with pytest.raises(ValueError, match=r"the ranks added param groups to ShardedAdamW with different trainable"):
        opt.add_param_group({"params": params})
    # one rank's group fails its checks: every rank raises
    lr = -1.0 if rank == 1 else 1e-3
    with pytest.raises(ValueError, match="lr must be >= 0" if rank == 1 else "with different error"):
        opt.add_param_group({"params": list(model[0].parameters()), "lr": lr})
    opt.add_param_group({"params": list(model[0].parameters())})  # and then the same group on both: fine
    _set_grads(dict(model.named_parameters()), 0)
    opt.step()


def test_ranks_that_add_different_groups_all_get_an_error():
    run_on_ranks(_different_groups, 2)


def test_a_compiled_step_takes_the_added_group():
    """torch.compile'd step(): the add changes what step() reads (its bucket lists), so dynamo recompiles, and the
    run is the eager run's, bit for bit."""
    runs = []
    for compiled in (False, True):
        model = _model()
        for p in model[0].parameters():
            p.requires_grad_(False)
        opt = ShardedAdamW(model[2].parameters(), lr=1e-2)
        step_fn = torch.compile(opt.step, backend="eager") if compiled else opt.step
        for step in range(STEPS):
            if step == ADDED_AT:
                for p in model[0].parameters():
                    p.requires_grad_(True)
                opt.add_param_group({"params": model[0].parameters(), **LATE})
            model(torch.randn(4, 9, generator=torch.Generator().manual_seed(step)).bfloat16()).square().sum().backward()
            step_fn()
            opt.zero_grad()
        runs.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*runs):
        assert_bitwise_equal(b, a, "compiled against eager, with a group added")
    assert not torch.equal(runs[1][0], _model()[0].weight.detach()), "the added backbone trained"


def _twins():
    """Our model with the backbone outside the optimizer (trainable: it may hold a gradient), and torch.optim.AdamW
    on an fp32 copy."""
    model = _model()
    twin = copy.deepcopy(model).float()
    opt = ShardedAdamW(model[2].parameters(), lr=1e-2, weight_decay=0.1)
    topt = torch.optim.AdamW(twin[2].parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    return model, twin, opt, topt


def _assert_like_twin(opt, topt, what):
    ours, theirs = opt.state_dict()["state"], topt.state_dict()["state"]
    assert sorted(ours) == list(range(4)), what
    for i, q in enumerate(p for g in topt.param_groups for p in g["params"]):
        if i not in theirs:  # torch never stepped it: count 0 here, and the initial weights
            assert float(ours[i]["step"]) == 0, f"{what}: parameter {i} stepped"
            torch.testing.assert_close(ours[i]["master"], q.detach(), rtol=0, atol=0)
            continue
        assert float(ours[i]["step"]) == float(theirs[i]["step"]), f"{what}: parameter {i}'s count"
        torch.testing.assert_close(ours[i]["master"], q.detach(), rtol=0, atol=1e-6, msg=f"{what}: {i}")


def test_a_gradient_held_before_the_add_is_used_by_the_next_step_as_in_torch_optim():
    model, twin, opt, topt = _twins()
    _set_grads(dict(model.named_parameters()), 0)  # the backbone's too: trainable, outside the optimizer
    for p, q in zip(model.parameters(), twin.parameters()):
        q.grad = p.grad.float()
    opt.add_param_group({"params": model[0].parameters(), **LATE})
    topt.add_param_group({"params": twin[0].parameters(), **LATE})
    assert model[0].weight.grad is not None and model[0].weight.grad.dtype == torch.bfloat16
    opt.step()
    topt.step()
    _assert_like_twin(opt, topt, "a held gradient")


def test_an_add_after_zero_grad_set_to_none_false_skips_the_new_group_as_torch_optim():
    """zero_grad(set_to_none=False) leaves zero gradients in the buffers (the head steps on them, as in torch): not
    the middle of a reduction, so the add works, and the new group, with no gradient, is skipped."""
    model, twin, opt, topt = _twins()
    for p in (*model[0].parameters(), *twin[0].parameters()):
        p.requires_grad_(False)
    _set_grads(dict(model.named_parameters()), 0)
    for p, q in zip(model.parameters(), twin.parameters()):
        q.grad = None if p.grad is None else p.grad.float()
    for o in (opt, topt):
        o.step()
        o.zero_grad(set_to_none=False)
    for m, o in ((model, opt), (twin, topt)):
        for p in m[0].parameters():
            p.requires_grad_(True)
        o.add_param_group({"params": m[0].parameters(), **LATE})
    opt.step()
    topt.step()
    _assert_like_twin(opt, topt, "after zero_grad(set_to_none=False)")


def test_parameters_added_by_editing_param_groups_are_an_error_not_left_untrained():
    """torch.optim reads its groups afresh at every step, so ``opt.param_groups[0]["params"].append(p)`` trains
    ``p`` there (and a group appended to ``param_groups`` likewise). Here the buffers were laid out when the group
    was added: until session 16 such a parameter was silently never trained (and one removed from a list trained
    on). Now step(), state_dict() and saves raise, pointing at add_param_group; a list replaced by a new one with
    the same parameters trains on as before."""
    x = torch.randn(4, 9, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    extra = torch.nn.Parameter(torch.randn(5, dtype=torch.bfloat16))

    def edits():
        yield "appended", lambda opt, model: opt.param_groups[0]["params"].append(extra), "1 parameters then, 2"
        yield "removed", lambda opt, model: opt.param_groups[0]["params"].pop(), "1 parameters then, 0"
        yield "swapped", lambda opt, model: opt.param_groups[0].update(params=[extra]), r"changed after it was added"
        yield "group appended", lambda opt, model: opt.param_groups.append(
            {**opt.param_groups[0], "params": [extra]}), "has 2 groups, but 1 were added"
        # (model surgery: a layer swapped after building, its new parameter put where the old one was)
        yield "replaced in place", lambda opt, model: opt.param_groups[0]["params"].__setitem__(0, extra), \
            r"changed after it was added \(1 parameters then, 1 now\)"

        def in_users_list(opt, model):  # (a list of the user's is compared element by element at every step)
            opt.param_groups[0]["params"] = mine = list(opt.param_groups[0]["params"])
            model(x).float().sum().backward()
            opt.step()  # (takes the new list: the same parameters)
            opt.zero_grad()
            mine[0] = extra
        yield "replaced in a list of the user's", in_users_list, r"changed after it was added"

    for what, edit, message in edits():
        model = _model()
        opt = ShardedAdamW([model[2].weight], lr=1e-2)
        edit(opt, model)
        (model(x).float().sum() + extra.float().sum()).backward()
        with pytest.raises(RuntimeError, match=message + ".*add_param_group"):
            opt.step()
        with pytest.raises(RuntimeError, match=message):
            opt.state_dict()

    # the same parameters in a new list (code that rebuilds the groups): trains exactly as without the rebuild
    # or written back in place
    runs = []
    for rebuild in ("no", "a new list", "written back"):
        model = _model()
        opt = ShardedAdamW([model[2].weight], lr=1e-2)
        for step in range(2):
            if rebuild == "a new list":
                opt.param_groups[0]["params"] = list(opt.param_groups[0]["params"])
            elif rebuild == "written back":
                ps = opt.param_groups[0]["params"]
                ps[0] = ps[0]
            model(x).float().square().sum().backward()
            opt.step()
            opt.zero_grad()
        runs.append(model[2].weight.detach().clone())
    assert_bitwise_equal(runs[1], runs[0], "weights with the group's list rebuilt every step")
    assert_bitwise_equal(runs[2], runs[0], "weights with the group's list written back in place every step")
    # the lists stay lists for the code that reads them (a copy, a pickle: plain lists)
    ps = opt.param_groups[0]["params"]
    assert isinstance(ps, list) and type(copy.copy(ps)) is list and type(copy.deepcopy(ps)) is list
    assert type(pickle.loads(pickle.dumps(ps))) is list
