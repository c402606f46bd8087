"""A parameter frozen when the optimizer was built (in its groups, ``requires_grad=False``) and unfrozen later
trains from then on, as with torch.optim (until session 13: an error at ``step()``). It is laid out in new
buckets of its group at the end of the backward that first gives it a gradient (or at the next step), with its
master from its current values, zero state and a step count of its own from 0.

The reference is bitwise, as in test_add_param_group: an optimizer holding only that parameter, built when it was
unfrozen, fed the same gradients (here from a real backward of an identical bf16 model, the same input on every
rank); the other parameters against an optimizer of their own from the start."""

import copy

import pytest
import torch

from tests.distributed import run_on_ranks
from tests.helpers import assert_bitwise_equal
from tritonshard import ShardedAdamW, ShardedLion, ShardedSGD

from .test_add_param_group import SEVERAL_IDS, SEVERAL_RANKS, _hybrid_options

MAKE = {
    "adamw": lambda params, **kw: ShardedAdamW(params, lr=1e-2, weight_decay=0.1, **kw),
    "sgd": lambda params, **kw: ShardedSGD(params, lr=1e-1, momentum=0.9, dampening=0.3, weight_decay=0.1, **kw),
    "lion": lambda params, **kw: ShardedLion(params, lr=1e-3, weight_decay=0.1, **kw),
}
UNFROZEN_AT = 2
STEPS = 5


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(9, 13), torch.nn.Tanh(), torch.nn.Linear(13, 5)).to(torch.bfloat16)


def _loss(model, step):
    x = torch.randn(4, 9, generator=torch.Generator().manual_seed(step)).to(torch.bfloat16)
    return model(x).float().square().mean()


def _weight_frozen_at_build():
    """(model, opt): :func:`_model` with its first weight frozen, and a ShardedAdamW built over every parameter."""
    model = _model()
    model[0].weight.requires_grad_(False)
    return model, ShardedAdamW(model.parameters(), lr=1e-2)


def _unfreeze_run(rank, world_size, kind, options):
    """``options``: the optimizer's, and ``torch_clip`` (torch's clip_grad_norm_ every step), ``frozen_at`` (step ->
    names of the backbone's parameters frozen again in that step, after the unfreeze), ``hybrid``
    (test_add_param_group._hybrid_options)."""
    options = _hybrid_options(options)
    clip = options.pop("torch_clip", False)
    frozen_at = options.pop("frozen_at", {})
    model = _model()
    for p in model[0].parameters():
        p.requires_grad_(False)
    ref = copy.deepcopy(model)  # the references train this copy: the same forward, so the same gradients
    make = MAKE[kind]
    opt = make(list(model.parameters()), **options)  # the frozen backbone is in the group from the start
    if options.get("overlap_comm"):
        opt.attach(model)
    opt_head, opt_backbone = make(list(ref[2].parameters())), None
    for step in range(STEPS + (3 if frozen_at else 0)):
        if step >= UNFROZEN_AT:
            for m in (model, ref):  # progressive unfreezing, the torch way: nothing else
                for name, p in m[0].named_parameters():
                    p.requires_grad_(name not in frozen_at.get(step, ()))
        if step == UNFROZEN_AT:
            opt_backbone = make(list(ref[0].parameters()))
        _loss(model, step).backward()
        _loss(ref, step).backward()
        if clip:  # torch's clipping over model.parameters(): the unfrozen weight's gradient is ours by then
            norms = [torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05) for m in (model, ref)]
            assert_bitwise_equal(norms[0], norms[1], f"step {step}: the total norm")
        for o in (opt, opt_head, opt_backbone):
            if o is not None:
                o.step()
                o.zero_grad()
        opt.wait_for_params()
        what = f"{kind} {options}, rank {rank} of {world_size}, after step {step}"
        for a, b in zip(model.parameters(), ref.parameters()):
            assert_bitwise_equal(a.detach(), b.detach(), f"{what}: the weights")
            assert torch.isfinite(a).all(), what
        if opt_backbone is None:
            continue
        ours = opt.state_dict()["state"]  # torch.optim numbering: the backbone (0, 1), the head (2, 3)
        for i, theirs in ((0, opt_backbone.state_dict()["state"][0]), (1, opt_backbone.state_dict()["state"][1]),
                          (2, opt_head.state_dict()["state"][0]), (3, opt_head.state_dict()["state"][1])):
            assert set(ours[i]) == set(theirs), what
            for key in theirs:
                assert_bitwise_equal(ours[i][key], theirs[key], f"{what}: state {i} {key}")
        if kind != "lion" and not frozen_at:  # (Lion's update reads no count, but keeps it)
            assert float(ours[0]["step"]) == step + 1 - UNFROZEN_AT and float(ours[2]["step"]) == step + 1
    if not frozen_at:
        assert float(opt.state[model[0].weight]["step"]) == STEPS - UNFROZEN_AT
    return opt, model


@pytest.mark.parametrize("options", [{}, {"bucket_cap_mb": 1e-9}, {"overlap_comm": True}, {"torch_clip": True}],
                         ids=["one bucket", "a bucket per parameter", "overlap_comm + attach", "torch's clipping"])
@pytest.mark.parametrize("kind", list(MAKE))
def test_a_parameter_unfrozen_after_building_trains_as_in_an_optimizer_built_then(kind, options):
    _unfreeze_run(0, 1, kind, options)


@pytest.mark.parametrize("world_size, options", SEVERAL_RANKS, ids=SEVERAL_IDS)
def test_a_parameter_unfrozen_after_building_on_several_ranks(world_size, options):
    run_on_ranks(_unfreeze_run, world_size, "adamw", options)


def _ranks_unfreeze_different(rank, world_size):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    model = model.to(torch.bfloat16)
    for p in [*model[0].parameters(), *model[1].parameters()]:
        p.requires_grad_(False)
    opt = ShardedAdamW(list(model.parameters()), lr=1e-2)  # (held: its hooks hold it weakly)
    for p in model[rank].parameters():  # rank 0 the first layer, rank 1 the second: the same shapes
        p.requires_grad_(True)
    x = torch.randn(3, 4).to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"the ranks unfroze parameters of ShardedAdamW with different unfrozen "
                                         r"parameters \(rank 0: .*\['params'\]\[0\].*, rank 1: .*\['params'\]\[2\].*"
                                         r"every rank must unfreeze the same parameters"):
        model(x).float().sum().backward()
    assert opt.skipped_steps == 0  # (no step was taken)


def test_ranks_that_unfreeze_different_parameters_get_an_error():
    """Until session 15 parameters of one shape unfrozen on different ranks were laid out alike and their gradients
    summed into each other's (the new buckets' layout compared shapes only)."""
    run_on_ranks(_ranks_unfreeze_different, 2)


def test_unfrozen_with_gradients_set_by_hand_is_taken_at_step():
    """No backward reaches the optimizer's hooks (gradients set by hand): the unfrozen parameter is laid out at
    step(), its gradient kept; the same bits as a backward's."""
    runs = []
    for by_hand in (False, True):
        model, opt = _weight_frozen_at_build()
        for step in range(3):
            if step == 1:
                model[0].weight.requires_grad_(True)
            if by_hand:
                grads = torch.autograd.grad(_loss(model, step), [p for p in model.parameters() if p.requires_grad])
                for p, g in zip([p for p in model.parameters() if p.requires_grad], grads):
                    p.grad = g
            else:
                _loss(model, step).backward()
            opt.step()
            opt.zero_grad()
        runs.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*runs):
        assert_bitwise_equal(b, a, "unfrozen with gradients set by hand against a backward")


def test_unfrozen_between_the_reduction_and_step_waits_for_the_next_backward_or_is_an_error():
    """Unfrozen after clip_grad_norm_ reduced this step's gradients: without a gradient it is skipped in this step
    (as torch.optim skips it) and taken in at the next backward; holding one (set by hand), step() raises rather
    than leave it out of the reduction."""
    model, opt = _weight_frozen_at_build()
    before = model[0].weight.detach().clone()
    _loss(model, 0).backward()
    opt.clip_grad_norm_(1.0)  # reduces this step's gradients, without the frozen weight
    model[0].weight.requires_grad_(True)
    opt.step()
    assert_bitwise_equal(model[0].weight.detach(), before, "skipped in the step it was unfrozen in")
    opt.zero_grad()
    _loss(model, 1).backward()
    opt.step()
    assert float(opt.state[model[0].weight]["step"]) == 1
    assert not torch.equal(model[0].weight.detach(), before)
    opt.zero_grad()

    model, opt = _weight_frozen_at_build()
    _loss(model, 0).backward()
    opt.clip_grad_norm_(1.0)
    model[0].weight.requires_grad_(True)
    model[0].weight.grad = torch.ones_like(model[0].weight)
    with pytest.raises(RuntimeError, match=r"params'\]\[0\].*holding a gradient.*already reduced"):
        opt.step()


@pytest.mark.parametrize("before_unfreezing", ["clip without a gradient", "backward, clip, model.zero_grad()"])
def test_unfrozen_after_a_reduction_that_holds_no_gradient_steps_as_without_it(before_unfreezing):
    """On one rank, a reduction none of whose gradients is held at step() (a clip before any backward, or every
    gradient cleared after it), then a parameter frozen at construction is unfrozen and step() runs: torch.optim
    steps nothing there (no parameter holds a gradient), and the unfrozen one trains from the next backward. Until
    session 47 that step() failed with "cannot unpack non-iterable NoneType object": the look at the unfrozen
    parameters forgot the reduction, and the step was handed the forgotten one (found by
    tests.optim.loop_fuzz_long's FP32GradsTrainingLoop). The reference: the same loop without the reduction."""
    runs = []
    for reduced in (True, False):
        model, opt = _weight_frozen_at_build()
        if reduced:
            if before_unfreezing != "clip without a gradient":
                _loss(model, 0).backward()
            norm = opt.clip_grad_norm_(0.05)
            model.zero_grad()
            assert torch.isfinite(norm)
        model[0].weight.requires_grad_(True)
        before = [p.detach().clone() for p in model.parameters()]
        opt.step()  # (no gradient anywhere: nothing moves)
        for i, (p, b) in enumerate(zip(model.parameters(), before)):
            assert_bitwise_equal(p.detach(), b, f"parameter {i}: stepped without a gradient")
        for step in (1, 2):
            _loss(model, step).backward()
            opt.clip_grad_norm_(0.05)
            opt.step()
            opt.zero_grad()
        assert float(opt.state[model[0].weight]["step"]) == 2, "the unfrozen weight trains from the next backward"
        runs.append([p.detach().clone() for p in model.parameters()])
    for i, (a, b) in enumerate(zip(*runs)):
        assert_bitwise_equal(a, b, f"parameter {i}: after a reduction that held no gradient")


@pytest.mark.parametrize("then", ["backward", "step"])
@pytest.mark.parametrize("reduced_by", ["opt.clip_grad_norm_", "torch clip_grad_norm_", "per-parameter norms"])
def test_a_frozen_parameter_given_a_gradient_with_every_reduced_one_replaced_is_stepped(reduced_by, then):
    """On one rank, after a reduction (a clip, or a log line's norms), the loop sets every gradient by hand, a
    frozen parameter's too: none of the reduction's gradients is held any more, so the reduction is forgotten (as
    for trainable parameters only: README) and the loop goes on as torch.optim's, which steps with what
    param.grad holds, the frozen parameter's included (on two ranks an error on every rank: below). Until session 37 the next backward raised ("frozen when the optimizer
    was built and holding a gradient now, but this step's gradients were already reduced"): the frozen look ran
    before the look that forgets the reduction (found by tests.optim.loop_fuzz_long's SGDTrainingLoop). The
    reference: the same loop without the first backward and its reduction, bit for bit."""
    runs = []
    for reduced in (True, False):
        model, opt = _weight_frozen_at_build()
        if reduced:
            _loss(model, 0).backward()
            if reduced_by == "opt.clip_grad_norm_":
                opt.clip_grad_norm_(0.05)
            elif reduced_by == "torch clip_grad_norm_":
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            else:
                [float(p.grad.norm()) for p in model.parameters() if p.grad is not None]
        gen = torch.Generator().manual_seed(7)
        for p in model.parameters():  # (every gradient the reduction held, and the frozen weight's)
            p.grad = torch.randn(p.shape, generator=gen).to(torch.bfloat16)
        if then == "backward":
            _loss(model, 1).backward()
        opt.step()
        assert float(opt.state[model[0].weight]["step"]) == 1, "the frozen weight holding a gradient is stepped"
        runs.append([p.detach().clone() for p in model.parameters()])
    for i, (a, b) in enumerate(zip(*runs)):
        assert_bitwise_equal(a, b, f"parameter {i}: after a reduction whose gradients were all replaced")


def _frozen_given_a_gradient_after_a_clip(rank, world_size, replaced_on):
    """A clip, then every rank sets the frozen weight's gradient and the ranks in ``replaced_on`` also replace
    every gradient the clip reduced, then a backward: an error on every rank (whether the reduction is gone is each
    rank's own; a rank that forgot it alone would wait in the layout's handshake for the others). Where every rank
    replaced them all, torch.optim would train on (as on one rank, above): a limit, an error rather than a hang."""
    model, opt = _weight_frozen_at_build()
    _loss(model, rank).backward()
    opt.clip_grad_norm_(0.05)
    gen = torch.Generator().manual_seed(7)
    for p in model.parameters():
        if rank in replaced_on or not p.requires_grad:
            p.grad = torch.randn(p.shape, generator=gen).to(torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"frozen when the optimizer was built and holding a gradient now.*before "
                                           r"that reduction"):
        _loss(model, 10 + rank).backward()
    opt.zero_grad()


@pytest.mark.parametrize("replaced_on", [(0,), (0, 1)], ids=["on rank 0", "on every rank"])
def test_on_two_ranks_a_frozen_parameter_given_a_gradient_after_a_clip_is_an_error_on_every_rank(replaced_on):
    """Until the one-rank fix above was limited to one rank (session 37, the same day), rank 0, having replaced
    every reduced gradient, laid the frozen weight out and waited in that handshake for rank 1, which had raised:
    a hang."""
    run_on_ranks(_frozen_given_a_gradient_after_a_clip, 2, replaced_on, timeout_s=60)


def _train_unfreezing(model, opt, steps):
    """Steps ``steps`` of a loop that unfreezes the first layer at step UNFROZEN_AT."""
    for step in steps:
        if step == UNFROZEN_AT:
            for p in model[0].parameters():
                p.requires_grad_(True)
        _loss(model, step).backward()
        opt.step()
        opt.zero_grad()


def test_a_run_that_unfroze_resumes_from_its_checkpoint(tmp_path):
    """Saved after the unfreeze (state_dict and save_sharded), loaded into a fresh optimizer built as the run was
    (the backbone frozen), once the loop has unfrozen it again or before (the load lays it out, frozen, with its
    state: until session 19 the sharded load was an error there): the run continues bit for bit."""
    from tritonshard.checkpoint import save_sharded

    def build():
        model = _model()
        for p in model[0].parameters():
            p.requires_grad_(False)
        return model, ShardedAdamW(list(model.parameters()), lr=1e-2)

    model, opt = build()
    _train_unfreezing(model, opt, range(UNFROZEN_AT + 1))
    saved, weights = opt.state_dict(), {k: v.clone() for k, v in model.state_dict().items()}
    save_sharded(opt, str(tmp_path / "ckpt"))
    _train_unfreezing(model, opt, range(UNFROZEN_AT + 1, STEPS))
    truth = [p.detach().clone() for p in model.parameters()]
    for how in ("state_dict", "save_sharded"):
        for loaded_while_frozen in (False, True):
            model, opt = build()
            model.load_state_dict(weights)
            if loaded_while_frozen:
                _load(opt, how, saved, tmp_path)
            for p in model[0].parameters():
                p.requires_grad_(True)  # the loop unfreezes at its step, as before the save
            if not loaded_while_frozen:
                _load(opt, how, saved, tmp_path)
            assert not opt._own_steps, "the unfrozen parameters count on their buckets' counter after the load too"
            _train_unfreezing(model, opt, range(UNFROZEN_AT + 1, STEPS))
            for a, b in zip(model.parameters(), truth):
                assert_bitwise_equal(a.detach(), b, f"resumed through {how} after an unfreeze "
                                                    f"(loaded while frozen: {loaded_while_frozen})")


def _load(opt, how, saved, tmp_path):
    from tritonshard.checkpoint import load_sharded
    if how == "state_dict":
        opt.load_state_dict(saved)
    else:
        load_sharded(opt, str(tmp_path / "ckpt"))


@pytest.mark.parametrize("kind", ["adamw", "sgd"])  # (the rules whose update reads the count)
def test_a_run_that_unfroze_resumed_with_everything_trainable_counts_per_bucket(tmp_path, monkeypatch, kind):
    """The same checkpoint loaded into an optimizer built with the backbone trainable (the resume script builds
    the model as the run ended): the layout puts the backbone in buckets with the head, at another count. With a
    bucket per parameter, the load gives the backbone's buckets a counter of their own (_split_counters): no
    parameter counts on its own, so no piece is updated twice per step (until session 15 each backbone parameter
    got its own count at the load and a second, checked update launch in every step for the rest of the run). With
    one bucket for all, the backbone's parameters count on their own, as before (one bucket has one counter). The
    bits are the uninterrupted run's either way."""
    from tritonshard.checkpoint import load_sharded, save_sharded

    model = _model()
    for p in model[0].parameters():
        p.requires_grad_(False)
    opt = MAKE[kind](list(model.parameters()))
    _train_unfreezing(model, opt, range(UNFROZEN_AT + 1))
    saved, weights = opt.state_dict(), {k: v.clone() for k, v in model.state_dict().items()}
    save_sharded(opt, str(tmp_path / "ckpt"))
    _train_unfreezing(model, opt, range(UNFROZEN_AT + 1, STEPS))
    truth = [p.detach().clone() for p in model.parameters()]
    second = ShardedAdamW._update_slice if kind == "adamw" else ShardedSGD._update_slice
    for how in ("state_dict", "save_sharded"):
        for options in ({"bucket_cap_mb": 1e-9}, {}):
            model = _model()
            model.load_state_dict(weights)
            opt = MAKE[kind](list(model.parameters()), **options)
            if how == "state_dict":
                opt.load_state_dict(saved)
            else:
                load_sharded(opt, str(tmp_path / "ckpt"))
            what = f"{kind}, {how}, {options or 'one bucket'}"
            if options:
                assert len(opt._step_units) == 2 and not opt._own_steps, what
                _no_update_by_slice(monkeypatch)
            else:  # one bucket, one counter: the head's count (3 steps) is the common one
                assert set(opt._own_steps) == set(model[0].parameters()), what
            assert [float(opt._param_step(p)) for p in model.parameters()] == [1, 1, 3, 3], what
            _train_unfreezing(model, opt, range(UNFROZEN_AT + 1, STEPS))
            monkeypatch.setattr(type(opt), "_update_slice", second)
            for a, b in zip(model.parameters(), truth):
                assert_bitwise_equal(a.detach(), b, f"{what}: resumed with the backbone trainable")


# --------------------------------------------------------------------------- the unfrozen parameters' own counter
def _no_update_by_slice(monkeypatch):
    """Make the second update of a parameter counting on its own (param_steps.py) an error: parameters unfrozen
    together count on their buckets' counter, so their flat update is their only one."""
    def second_update(*args, **kwargs):
        raise AssertionError("a piece was updated a second time, with a count of its own")
    for cls in (ShardedAdamW, ShardedSGD):
        monkeypatch.setattr(cls, "_update_slice", second_update)


@pytest.mark.parametrize("kind", ["adamw", "sgd"])  # (the rules whose update reads the count)
def test_parameters_unfrozen_together_are_updated_once_per_step(monkeypatch, kind):
    """Unfrozen parameters start at count 0 while their group's counter is at 2: they are laid out in buckets
    with a counter of their own (one update launch per counter), not updated a second time with a count per
    parameter (until session 14: a checked launch per parameter and step, for as long as they trained). The
    bits are those of the optimizer built when they were unfrozen (_unfreeze_run)."""
    _no_update_by_slice(monkeypatch)
    for options in ({}, {"bucket_cap_mb": 1e-9}, {"overlap_comm": True}):
        _unfreeze_run(0, 1, kind, options)


def _refreeze_run(rank, world_size, options):
    """Unfrozen at UNFROZEN_AT; then the bias frozen again for one step (its counter's other parameter trains: the
    bias counts on its own from there), then the whole unfrozen layer for one step (its counter idle: not updated,
    not counted, while the head trains), then both trainable again. Against AdamW optimizers built at the unfreeze
    and for the head, on the same gradients: every weight and state tensor bit for bit, every step
    (_unfreeze_run)."""
    frozen_at = {UNFROZEN_AT + 1: ["bias"], UNFROZEN_AT + 2: ["weight", "bias"]}
    opt, model = _unfreeze_run(rank, world_size, "adamw", {**options, "frozen_at": frozen_at})
    # the cost: only the bias, skipped while its counter's other parameter trained, counts (and is updated) on its
    # own; the step that skipped both left their counter as it was instead of giving the weight a count of its own
    assert list(opt._own_steps) == [model[0].bias], [opt._param_names[p] for p in opt._own_steps]
    # torch.optim's counts: the weight skipped one step, the bias two
    assert float(opt.state[model[0].weight]["step"]) == STEPS + 3 - UNFROZEN_AT - 1
    assert float(opt.state[model[0].bias]["step"]) == STEPS + 3 - UNFROZEN_AT - 2


@pytest.mark.parametrize("options", [{}, {"bucket_cap_mb": 1e-9}], ids=["one bucket", "a bucket per parameter"])
def test_unfrozen_parameters_skipped_later_count_as_in_an_optimizer_built_then(options):
    _refreeze_run(0, 1, options)


def test_unfrozen_parameters_skipped_later_on_two_ranks():
    run_on_ranks(_refreeze_run, 2, {"bucket_cap_mb": 1e-9, "overlap_comm": True})


@pytest.mark.parametrize("overlap_comm", [False, True])
@pytest.mark.parametrize("when", ["left from before it was frozen", "set by hand after building"])
@pytest.mark.usefixtures("with_overlap_machinery")  # (overlap_comm: its hooks' launches, as on many ranks)
def test_a_frozen_parameter_holding_a_gradient_is_stepped_as_torch_optim_steps_it(when, overlap_comm):
    """torch.optim steps every parameter whose .grad is not None, requires_grad or not: a layer frozen without
    clearing its gradient keeps being updated with it (until zero_grad()), and a gradient set by hand on a frozen
    parameter is applied. Until session 19 a parameter frozen when the optimizer was built was left out while
    frozen, gradient or not, silently. Laid out when it is found holding one, it is a parameter like the others:
    skipped while frozen without a gradient, trained once unfrozen (its hooks launch its bucket's reduction during
    the backward, with overlap_comm). Against torch.optim.AdamW on fp32 masters from the same bf16 weights: the
    weights within one bf16 ulp (+2e-6: a master within fp32 op-order noise of a rounding boundary), step counts
    exact."""
    model = _model()
    weight = model[0].weight
    masters = [p.detach().float().clone().requires_grad_() for p in model.parameters()]
    ropt = torch.optim.AdamW(masters, lr=1e-2, weight_decay=0.1, foreach=False)
    grad = torch.randn(weight.shape, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    if when.startswith("left"):
        weight.grad = grad.clone()
    weight.requires_grad_(False)
    opt = ShardedAdamW(model.parameters(), lr=1e-2, weight_decay=0.1, bucket_cap_mb=1e-9, overlap_comm=overlap_comm)
    if overlap_comm:
        opt.attach(model)
    if when.startswith("set"):
        weight.grad = grad.clone()
    twin = copy.deepcopy(model)  # (its bf16 gradients are the reference's)

    def check(what):
        for i, (p, m) in enumerate(zip(model.parameters(), masters)):
            bound = m.detach().abs() * 2.0 ** -7 + 2e-6
            assert ((p.detach().float() - m.detach()).abs() <= bound).all(), f"{what}: weights of parameter {i}"
            assert float(opt.state[p].get("step", 0)) == float(ropt.state.get(m, {}).get("step", 0)), \
                f"{what}: step count of parameter {i}"

    for step in range(4):
        if step == 2:
            for p in (weight, twin[0].weight):
                p.requires_grad_(True)
        launched = opt.reduce_scatters_launched
        _loss(model, step).backward()
        if overlap_comm and step >= 2:
            assert opt.reduce_scatters_launched - launched == len(opt.buckets), "the unfrozen weight's hooks"
        with torch.no_grad():
            for t, m in zip(twin.parameters(), masters):
                t.copy_(m)
        twin.zero_grad()
        _loss(twin, step).backward()
        for t, m in zip(twin.parameters(), masters):
            m.grad = None if t.grad is None else t.grad.float()
        if step == 0:
            masters[0].grad = grad.float()  # (the frozen weight's gradient, in torch.optim's loop too)
        opt.step()
        ropt.step()
        check(f"{when}, overlap_comm={overlap_comm}, step {step}")
        opt.zero_grad()
        ropt.zero_grad()


def _frozen_resume_run(rank, world_size, kind, how, tmp_path):
    """Frozen after building (it has state by then), the run saved with it frozen (``how``: state_dict or
    save_sharded into ``tmp_path``), resumed by a script that freezes it before building the optimizer and loads
    the state; it is unfrozen again later."""
    from tritonshard.checkpoint import save_sharded
    make = MAKE[kind]
    frozen_steps = range(2, 5)

    def train(model, opt, steps):
        for step in steps:
            model[0].weight.requires_grad_(step not in frozen_steps)
            x = torch.randn(4, 9, generator=torch.Generator().manual_seed(10 * step + rank)).to(torch.bfloat16)
            model(x).float().square().mean().backward()
            opt.step()
            opt.zero_grad()

    model = _model()
    opt = make(list(model.parameters()))
    train(model, opt, range(4))
    saved, weights = opt.state_dict(), {k: v.clone() for k, v in model.state_dict().items()}
    if how == "save_sharded":
        save_sharded(opt, str(tmp_path / "ckpt"))
    train(model, opt, range(4, 7))
    truth = [p.detach().clone() for p in model.parameters()]
    truth_state = opt.state_dict()["state"]

    model = _model()
    model.load_state_dict(weights)
    model[0].weight.requires_grad_(False)  # (the resume script freezes it as the run had it, then builds)
    opt = make(list(model.parameters()))
    _load(opt, how, saved, tmp_path)
    train(model, opt, range(4, 7))
    what = f"{kind}, {how}, rank {rank} of {world_size}: resumed with a frozen parameter"
    for a, b in zip(model.parameters(), truth):
        assert_bitwise_equal(a.detach(), b, f"{what}: the weights")
    state = opt.state_dict()["state"]
    assert state.keys() == truth_state.keys(), what
    for i in truth_state:
        for key in truth_state[i]:
            assert_bitwise_equal(state[i][key], truth_state[i][key], f"{what}: state {i} {key}")


@pytest.mark.parametrize("how", ["state_dict", "save_sharded"])
@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_a_run_that_froze_a_parameter_resumes_with_it_frozen(kind, how, tmp_path):
    """torch.optim loads the state of a parameter that is frozen when the resumed optimizer is built, and trains
    it from that state once it is unfrozen. Until session 19 the load was a ValueError naming it (the parameter,
    frozen at construction, had no buffers to load into); now it is laid out at the load, as an unfrozen one is,
    and the run continues bit for bit (its moments and its step count, which differs from the others': AdamW's
    bias correction reads it). The sharded checkpoint's load was a CheckpointMismatchError telling to unfreeze it
    first."""
    _frozen_resume_run(0, 1, kind, how, tmp_path)


def test_a_run_that_froze_a_parameter_resumes_with_it_frozen_on_two_ranks(tmp_path):
    run_on_ranks(_frozen_resume_run, 2, "adamw", "save_sharded", tmp_path)
