"""ShardedSGD and ShardedLion on 2 and 4 gloo processes against the single-process reference of training.py."""

import pytest
import torch

from tests.distributed import run_on_ranks
from tests.helpers import assert_close_rel
from tests.optim.training import PaperLion, Reference, make_model, param_groups, schedule, train_step
from tritonshard import ShardedLion, ShardedSGD
from tritonshard.checkpoint import CheckpointMismatchError, load_sharded, save_sharded

STEPS = 4
SGD_KW = dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3)
LION_KW = dict(lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1)

OPTIMIZERS = {
    "sgd": (lambda groups, **kw: ShardedSGD(groups, **SGD_KW, **kw),
            lambda groups: torch.optim.SGD(groups, foreach=False, **SGD_KW)),
    "lion": (lambda groups, **kw: ShardedLion(groups, **LION_KW, **kw), lambda groups: PaperLion(groups, **LION_KW)),
}


def _train(rank, world_size, name, rel_tol):
    ours_factory, ref_factory = OPTIMIZERS[name]
    model = make_model(0)
    params = [p for g in param_groups(model) for p in g["params"]]
    opt = ours_factory(param_groups(model), bucket_cap_mb=200 * 2 / 2 ** 20)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    ref = Reference(world_size, make_opt=ref_factory)
    for step in range(STEPS):
        train_step(model, opt, sched, rank, step)
        ref.step(step)
    state = opt.state_dict()["state"]
    worst = max(float((state[i]["master"].double() - p.detach().double()).abs().max())
                for i, p in enumerate(ref.master))
    scale = max(float(p.detach().abs().max()) for p in ref.master)
    assert worst <= rel_tol * scale, f"{name} at {world_size} ranks: master off by {worst / scale:.2e}"
    for p, q in zip(params, ref.bf16_weights()):
        # bf16 weights: the same rounding of masters that agree to rel_tol, so at most that plus one bf16 ulp apart
        assert bool(((p.float() - q.float()).abs() <= rel_tol * scale + 2 ** -7 * q.float().abs()).all())


# Tolerances as for AdamW (tests/optim/test_adamw_distributed.py): 2 ranks reproduce the reference's bf16 sums,
# leaving fp32 op-order differences (1e-6); 4 ranks add in ring order, each add rounding at 2^-9, which moves
# an SGD update by the same relative amount (lr * |g| * 6e-3 per step, 4 steps) and can flip the sign of a Lion
# update whose interpolated momentum is within that of zero (one lr = 1e-3 relative per flip): 2e-3.
@pytest.mark.parametrize("name", ["sgd", "lion"])
@pytest.mark.parametrize("world_size, rel_tol", [(2, 1e-6), (4, 2e-3)])
def test_matches_reference(name, world_size, rel_tol):
    run_on_ranks(_train, world_size, name, rel_tol)


def test_torch_sgd_state_dict_loads():
    model = make_model(0)
    params = [p for g in param_groups(model) for p in g["params"]]
    torch_opt = torch.optim.SGD(param_groups(model), **SGD_KW)
    for step in range(2):
        for p in params:
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(step))
        torch_opt.step()
    opt = ShardedSGD(param_groups(model), lr=1.0, momentum=0.5)
    opt.load_state_dict(torch_opt.state_dict())
    assert opt.param_groups[0]["lr"] == SGD_KW["lr"] and opt.param_groups[0]["nesterov"] is True
    ours = opt.state_dict()["state"]
    for i in range(len(params)):
        assert torch.equal(ours[i]["momentum_buffer"], torch_opt.state_dict()["state"][i]["momentum_buffer"])
        assert float(ours[i]["step"]) == 1.0, "a loaded momentum buffer counts as initialized"


@pytest.mark.parametrize("make, match", [
    (lambda ps: ShardedSGD(ps, lr=-1), "lr must be >= 0"),
    (lambda ps: ShardedSGD(ps, momentum=-0.1), "momentum must be >= 0"),
    (lambda ps: ShardedSGD(ps, nesterov=True), "nesterov"),
    (lambda ps: ShardedSGD(ps, weight_decay=-1), "weight_decay"),
    (lambda ps: ShardedLion(ps, betas=(0.9, 1.0)), r"betas\[1\]"),
    (lambda ps: ShardedLion([{"params": ps[:1]}, {"params": ps[1:], "lr": -2}]), r"param_groups\[1\]"),
])
def test_bad_arguments(make, match):
    with pytest.raises(ValueError, match=match):
        make([torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.randn(4))])


def test_momentum_set_on_an_sgd_built_without_any_is_a_clear_error_before_anything_changes():
    """torch.optim.SGD makes a buffer at the first step with momentum; ShardedSGD lays its buffers out when it is
    built, for every group where any group has momentum then. Built without, a momentum set later (by hand, by a
    scheduler that cycles it, by add_param_group) failed inside step() until session 49 ("momentum_buffer must be a
    torch.Tensor, got NoneType"); now a ValueError naming the way out, before any weight changes. With momentum in
    some group at construction, a group turned from 0 to momentum later trains (its buffers exist)."""
    model = torch.nn.Linear(4, 3)
    opt = ShardedSGD(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    model(torch.randn(2, 4, dtype=torch.bfloat16)).float().sum().backward()
    opt.param_groups[0]["momentum"] = 0.9
    with pytest.raises(ValueError, match=r"momentum=0\.9, but this ShardedSGD was built without momentum in any "
                                         r"param group.*build it with momentum > 0.*\(param_groups\[0\], at step\(\)\)"):
        opt.step()
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    opt.param_groups[0]["momentum"] = 0.0
    opt.step()  # (as built: plain SGD)
    assert not all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    with pytest.raises(ValueError, match=r"built without momentum in any param group.*\(param_groups\[1\]"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.randn(3))], "momentum": 0.5})
    model = torch.nn.Linear(4, 3)
    opt = ShardedSGD([{"params": [model.weight], "momentum": 0.9}, {"params": [model.bias]}], lr=0.1)
    opt.param_groups[1]["momentum"] = 0.9
    model(torch.randn(2, 4, dtype=torch.bfloat16)).float().sum().backward()
    bias = model.bias.detach().clone()
    opt.step()
    assert not torch.equal(bias, model.bias)


# Momentum per step for group 0 (group 1 keeps SGD_SWITCH's 0.9 throughout): none at first (a group built with
# momentum=0 beside one with momentum), turned on at step 2, off at 4, on again at 6 (a scheduler that cycles it)
MOMENTUM_AT = [0.0, 0.0, 0.9, 0.8, 0.0, 0.0, 0.7, 0.9]
SGD_SWITCH = dict(lr=0.1, momentum=0.9, dampening=0.5, weight_decay=0.01)


def _grads(step, shapes, unused):
    """The same bf16 gradients on every rank (so the reduced average is them, exactly); None where ``unused``."""
    gen = torch.Generator().manual_seed(1000 + step)
    return [None if (step, i) in unused else torch.randn(shape, generator=gen).bfloat16()
            for i, shape in enumerate(shapes)]


def _momentum_switch(rank, world_size, unused, bucket_cap_mb):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape).bfloat16()) for shape in [(5, 3), (7,), (2, 11), (13,)]]
    ref = [torch.nn.Parameter(p.detach().float().clone()) for p in params]  # the masters' start, exactly
    split = lambda ps: [{"params": ps[:2], "momentum": 0.0}, {"params": ps[2:]}]  # noqa: E731
    opt = ShardedSGD(split(params), bucket_cap_mb=bucket_cap_mb, **SGD_SWITCH)
    torch_opt = torch.optim.SGD(split(ref), foreach=False, **SGD_SWITCH)
    for step, momentum in enumerate(MOMENTUM_AT):
        opt.param_groups[0]["momentum"] = torch_opt.param_groups[0]["momentum"] = momentum
        for p, q, g in zip(params, ref, _grads(step, [p.shape for p in params], unused)):
            p.grad, q.grad = g, None if g is None else g.float()
        opt.step()
        torch_opt.step()
        # fp32 on both sides from the same gradients; the kernel's op order (fused multiply-adds) against torch's
        # separate ops: a few fp32 ulps per step, 8 steps (a wrong first buffer is off by dampening * lr * |g|,
        # 0.05 * ~1)
        state = opt.state_dict()["state"]
        for i, q in enumerate(ref):
            assert_close_rel(state[i]["master"], q.detach(), 1e-6, f"step {step}: master of parameter {i}")
            assert ("momentum_buffer" in state[i]) == ("momentum_buffer" in torch_opt.state[q]), \
                f"step {step}: parameter {i} has a momentum buffer in one state dict only"
            if "momentum_buffer" in state[i]:
                assert_close_rel(state[i]["momentum_buffer"], torch_opt.state[q]["momentum_buffer"], 1e-6,
                                 f"step {step}: momentum buffer of parameter {i}")


@pytest.mark.parametrize("unused", [
    frozenset(),
    # parameter 0 without a gradient at the step its group's momentum is turned on (its buffer is made a step
    # later than parameter 1's: a count of its own), parameter 1 at a step without momentum
    frozenset({(2, 0), (5, 1)}),
])
@pytest.mark.parametrize("bucket_cap_mb", [25, 8 * 2 / 2 ** 20])  # (one bucket per group; 8 bf16 elements each)
def test_momentum_turned_on_later_starts_its_buffer_from_the_gradient_as_torch(unused, bucket_cap_mb):
    """torch.optim.SGD makes a parameter's momentum buffer at its first step with momentum (buf = g, no dampening)
    and leaves it alone in steps without. Until session 50, ShardedSGD decided "first" by the count of all steps, so
    a group whose momentum was 0 at first (laid out with buffers because another group had momentum) started at
    buf = (1 - dampening) * g: off by dampening * lr * |g| from its first step with momentum, silently."""
    _momentum_switch(0, 1, unused, bucket_cap_mb)


@pytest.mark.parametrize("world_size", [2, 4])
def test_momentum_turned_on_later_on_ranks(world_size):
    run_on_ranks(_momentum_switch, world_size, frozenset({(2, 0), (5, 1)}), 8 * 2 / 2 ** 20)


def test_state_dict_without_a_buffer_where_torch_has_none_and_it_loads_into_torch_sgd():
    """A parameter that has not stepped with momentum has no buffer in torch.optim.SGD's state; ShardedSGD's dict
    leaves its (laid out, zero) buffer out too: torch.optim.SGD would take a zero buffer as made and start at
    (1 - dampening) * g. Both ways round, the run goes on as one that never stopped."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape).bfloat16()) for shape in [(5, 3), (7,), (2, 11)]]
    split = lambda ps: [{"params": ps[:2], "momentum": 0.0}, {"params": ps[2:]}]  # noqa: E731
    opt = ShardedSGD(split(params), **SGD_SWITCH)
    for step in range(2):
        for p, g in zip(params, _grads(step, [p.shape for p in params], ())):
            p.grad = g
        opt.step()
    saved = opt.state_dict()
    assert [sorted(saved["state"][i]) for i in range(3)] == [["master", "step"], ["master", "step"],
                                                              ["master", "momentum_buffer", "step"]]
    assert [float(saved["state"][i]["step"]) for i in range(3)] == [0.0, 0.0, 2.0]
    ref = [torch.nn.Parameter(saved["state"][i]["master"].clone()) for i in range(3)]
    torch_opt = torch.optim.SGD(split(ref), foreach=False, **SGD_SWITCH)
    torch_opt.load_state_dict(saved)
    again = ShardedSGD(split([torch.nn.Parameter(p.detach().clone()) for p in params]), lr=1.0, momentum=0.5)
    again.load_state_dict(saved)
    for step in range(2, 4):
        for o in (opt, torch_opt, again):
            o.param_groups[0]["momentum"] = 0.9
        grads = _grads(step, [p.shape for p in params], ())
        for p, q, r, g in zip(params, ref, again.param_groups[0]["params"] + again.param_groups[1]["params"], grads):
            p.grad, q.grad, r.grad = g, g.float(), g
        for o in (opt, torch_opt, again):
            o.step()
    ours, resumed = opt.state_dict()["state"], again.state_dict()["state"]
    for i, q in enumerate(ref):
        assert torch.equal(ours[i]["master"], resumed[i]["master"]), "a resumed run is the run, bit for bit"
        assert_close_rel(ours[i]["master"], q.detach(), 1e-6, f"master of parameter {i} (see above: fp32 op order)")


def _resume_without_momentum(rank, world_size, path):
    torch.manual_seed(0)
    shapes = [(5, 3), (7,), (2, 11)]
    params = [torch.nn.Parameter(torch.randn(shape).bfloat16()) for shape in shapes]
    split = lambda ps: [{"params": ps[:2]}, {"params": ps[2:], "lr": 0.05}]  # noqa: E731
    without = dict(lr=0.1, dampening=0.5, weight_decay=0.01)  # (momentum=0 in every group: no buffers held)
    opt = ShardedSGD(split(params), bucket_cap_mb=8 * 2 / 2 ** 20, **without)
    for step in range(2):
        for p, g in zip(params, _grads(step, shapes, ())):
            p.grad = g
        opt.step()
    save_sharded(opt, path)
    saved = opt.state_dict()
    # resumed by an optimizer built with momentum: from the sharded checkpoint, from the state dict, and torch's
    # from the state dict (fp32 weights from the saved masters)
    copies = lambda: [torch.nn.Parameter(p.detach().clone()) for p in params]  # noqa: E731
    sharded, loaded = ShardedSGD(split(copies()), lr=1.0, momentum=0.5), ShardedSGD(split(copies()), momentum=0.5)
    assert load_sharded(sharded, path) == {}
    loaded.load_state_dict(saved)
    ref = [torch.nn.Parameter(saved["state"][i]["master"].clone()) for i in range(len(shapes))]
    torch_opt = torch.optim.SGD(split(ref), foreach=False, **without)
    torch_opt.load_state_dict(saved)
    for o in (sharded, loaded):  # the saved run's groups, as torch's load_state_dict gives them
        assert [g["momentum"] for g in o.param_groups] == [0.0, 0.0] and o.param_groups[1]["lr"] == 0.05
        assert all(sorted(s) == ["master", "step"] and float(s["step"]) == 0 for s in o.state_dict()["state"].values())
    runs = [(o, [p for g in o.param_groups for p in g["params"]]) for o in (sharded, loaded, torch_opt)]
    for step in range(2, 5):  # momentum turned on after the resume: every buffer starts at its first such step
        grads = _grads(step, shapes, ())
        for o, ps in runs:
            for g in o.param_groups:
                g["momentum"] = 0.9
            for p, grad in zip(ps, grads):
                p.grad = grad.float() if o is torch_opt else grad
            o.step()
    a, b = sharded.state_dict()["state"], loaded.state_dict()["state"]
    for i, q in enumerate(ref):
        for key in ("master", "momentum_buffer", "step"):
            assert torch.equal(a[i][key], b[i][key]), f"parameter {i}: {key} differs between the two resumes"
        # (fp32 op order against torch's: see _momentum_switch; a buffer started at (1 - dampening) * g instead of
        # g is off by 0.5 * lr * |g| ~ 0.05)
        assert_close_rel(a[i]["master"], q.detach(), 1e-6, f"master of parameter {i}")
        assert_close_rel(a[i]["momentum_buffer"], torch_opt.state[q]["momentum_buffer"], 1e-6,
                         f"momentum buffer of parameter {i}")
    # the other way round, a checkpoint with buffers into an optimizer without: it could not hold them
    save_sharded(sharded, path + "-with")
    with pytest.raises(CheckpointMismatchError, match=r"holds state \['momentum_buffer'\], this optimizer needs "
                                                      r"\[\] \(a ShardedSGD holds momentum buffers only when built"):
        load_sharded(ShardedSGD(split(copies()), **without), path + "-with")


@pytest.mark.parametrize("world_size", [1, 2])
def test_a_checkpoint_saved_without_momentum_resumes_in_an_optimizer_built_with_it(tmp_path, world_size):
    """A run built without momentum (no buffers held), resumed by one built with it: ``load_state_dict`` loaded
    (the buffers start at their first step with momentum, as torch.optim.SGD's), ``load_sharded`` of the same run
    was a CheckpointMismatchError until session 52. Both load now, to the same bits."""
    if world_size == 1:
        _resume_without_momentum(0, 1, str(tmp_path / "ckpt"))
    else:
        run_on_ranks(_resume_without_momentum, world_size, str(tmp_path / "ckpt"))
