"""torch.optim's state-dict hooks and group restore, as torch.optim runs them: ``register_state_dict_pre_hook`` /
``post_hook`` around ``state_dict()`` (a post hook's return value replaces the dict), the load hooks around
``load_state_dict()`` (a pre hook sees, and may replace, a shallow copy of the caller's dict), and a load that puts
back every saved group key (a scheduler's, the user's own), not only the optimizer's defaults. Until session 13 the
hooks were silently not called: a checkpoint without what a post hook adds. A sharded checkpoint never builds the
dict the hooks act on, so with hooks registered it is an error."""

import pytest
import torch

from tritonshard import ShardedAdamW, ShardedMuon, ShardedSGD
from tritonshard.checkpoint import load_sharded, save_checkpoint, save_sharded

OPTIMIZERS = {  # ours and torch.optim's with the same hyper-parameters
    "adamw": (lambda params: ShardedAdamW(params, lr=1e-2), lambda params: torch.optim.AdamW(params, lr=1e-2)),
    "sgd": (lambda params: ShardedSGD(params, lr=1e-1, momentum=0.9),
            lambda params: torch.optim.SGD(params, lr=1e-1, momentum=0.9)),
}


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))


def _train(model, opt, steps=2, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        model(torch.randn(4, 7, generator=g).to(dtype)).square().sum().backward()
        opt.step()
        opt.zero_grad()


def _record_hooks(opt, calls):
    """One hook of each kind, recording what torch.optim hands it; the post hook adds an entry and returns the
    dict, the load pre hook takes it out of a copy it returns."""
    opt.register_state_dict_pre_hook(lambda o: calls.append(("sd_pre", o is opt)))

    def sd_post(o, sd):
        calls.append(("sd_post", sorted(sd)))
        return {**sd, "ema_decay": 0.999}
    opt.register_state_dict_post_hook(sd_post)

    def load_pre(o, sd):
        calls.append(("load_pre", sorted(sd)))
        sd = dict(sd)
        calls.append(("ema_decay", sd.pop("ema_decay")))
        return sd
    opt.register_load_state_dict_pre_hook(load_pre)
    opt.register_load_state_dict_post_hook(lambda o: calls.append(("load_post", o.param_groups[0]["lr"])))


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_state_dict_hooks_run_as_torch_optim_runs_them(name):
    make_ours, make_torch = OPTIMIZERS[name]
    runs = {}
    for who, make, dtype in (("ours", make_ours, torch.bfloat16), ("torch", make_torch, torch.float32)):
        model = _model()
        opt = make(model.parameters())
        _train(model, opt, dtype=dtype)
        calls = []
        _record_hooks(opt, calls)
        sd = opt.state_dict()
        assert sd["ema_decay"] == 0.999, f"{who}: the post hook's returned dict is what state_dict() returns"
        sd["param_groups"][0]["lr"] = 0.5
        before = dict(sd)
        opt.load_state_dict(sd)
        assert sd == before, f"{who}: the pre hook worked on a copy, the caller's dict is unchanged"
        assert opt.param_groups[0]["lr"] == 0.5
        # (the keys our state_dict has beyond torch's: the "tritonshard" entry)
        runs[who] = [(kind, [k for k in v if k != "tritonshard"] if isinstance(v, list) else v)
                     for kind, v in calls]
    assert runs["ours"] == runs["torch"], runs
    assert [kind for kind, _ in runs["ours"]] == ["sd_pre", "sd_post", "load_pre", "ema_decay", "load_post"]


def test_a_removed_hook_no_longer_runs_and_prepare_state_dict_keeps_the_hooks():
    model = _model()
    opt = ShardedAdamW(model.parameters(), lr=1e-2)
    _train(model, opt)
    calls = []
    handle = opt.register_state_dict_post_hook(lambda o, sd: calls.append("post"))
    # the gathered dict a framework prepares on every rank for one rank's state_dict(): the hooks still run there
    opt.prepare_state_dict()
    opt.state_dict()
    assert calls == ["post"]
    handle.remove()
    opt.state_dict()
    assert calls == ["post"]


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_a_load_puts_back_every_saved_group_key_as_torch_optim_does(name):
    """What a scheduler keeps in the groups (OneCycleLR's max_lr, initial_lr...) and keys of the user's own come
    back from the checkpoint, as with torch.optim; torch.optim's implementation switches do not enter our groups."""
    make_ours, make_torch = OPTIMIZERS[name]
    groups = {}
    for who, make, dtype in (("ours", make_ours, torch.bfloat16), ("torch", make_torch, torch.float32)):
        model = _model()
        opt = make(model.parameters())
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=10)
        opt.param_groups[0]["note"] = "saved"
        _train(model, opt, dtype=dtype)
        sd = opt.state_dict()
        fresh = make(_model().parameters())
        torch.optim.lr_scheduler.OneCycleLR(fresh, max_lr=0.02, total_steps=10)  # a changed config
        fresh.param_groups[0]["note"] = "new"
        fresh.load_state_dict(sd)
        groups[who] = {k: v for k, v in fresh.param_groups[0].items() if k != "params"}
        assert groups[who]["max_lr"] == 0.05 and groups[who]["note"] == "saved", (who, groups[who])
        del sched
    shared = set(groups["ours"]) & set(groups["torch"])
    assert {k: groups["ours"][k] for k in shared} == {k: groups["torch"][k] for k in shared}
    # and a torch.optim dict's implementation switches stay out of ours
    model = _model()
    theirs = make_torch(model.parameters())
    _train(model, theirs, dtype=torch.float32)
    ours = make_ours(_model().parameters())
    ours.load_state_dict(theirs.state_dict())
    assert not {"foreach", "fused", "capturable", "differentiable"} & set(ours.param_groups[0]), ours.param_groups[0]


def test_muon_puts_back_its_adamw_groups_betas():
    model = _model()
    make = lambda m: ShardedMuon([{"params": [m[0].weight, m[2].weight]},  # noqa: E731
                                  {"params": [m[0].bias, m[2].bias], "use_muon": False, "betas": (0.8, 0.9)}],
                                 lr=1e-2)
    opt = make(model)
    _train(model, opt)
    sd = opt.state_dict()
    fresh_model = _model()
    fresh = make(fresh_model)
    fresh.param_groups[1]["betas"] = (0.5, 0.6)
    fresh.load_state_dict(sd)
    assert fresh.param_groups[1]["betas"] == (0.8, 0.9)


@pytest.mark.parametrize("kind", ["state_dict_pre", "state_dict_post", "load_state_dict_pre", "load_state_dict_post"])
def test_a_sharded_checkpoint_with_state_dict_hooks_is_an_error(tmp_path, kind):
    model = _model()
    opt = ShardedAdamW(model.parameters(), lr=1e-2)
    _train(model, opt)
    save_sharded(opt, str(tmp_path / "before"))
    hook = {"state_dict_pre": lambda o: None, "state_dict_post": lambda o, sd: None,
            "load_state_dict_pre": lambda o, sd: None, "load_state_dict_post": lambda o: None}[kind]
    handle = getattr(opt, f"register_{kind}_hook")(hook)
    calls = ((lambda: save_sharded(opt, str(tmp_path / "ckpt")), lambda: save_checkpoint(opt, str(tmp_path), 3))
             if kind.startswith("state") else (lambda: load_sharded(opt, str(tmp_path / "before")),))
    for call in calls:
        with pytest.raises(RuntimeError, match=f"register_{kind}_hook.*never builds that dict"):
            call()
    assert not (tmp_path / "ckpt").exists() and not (tmp_path / "step_00000003").exists()
    handle.remove()
    for call in calls:
        call()


def test_a_loaded_tensor_lr_is_the_optimizers_own_not_the_dicts():
    """torch.optim deep-copies the saved groups: a scheduler that fills the lr tensor in place must not change the
    dict it was loaded from (a checkpoint kept in memory, loaded again later)."""
    model = _model()
    opt = ShardedAdamW(model.parameters(), lr=torch.tensor(1e-2))
    _train(model, opt, steps=1)
    sd = opt.state_dict()
    fresh = ShardedAdamW(_model().parameters(), lr=torch.tensor(5e-3))
    fresh.load_state_dict(sd)
    fresh.param_groups[0]["lr"].fill_(0.5)
    assert float(sd["param_groups"][0]["lr"]) == pytest.approx(1e-2)
