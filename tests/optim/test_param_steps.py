"""A step count per parameter, as torch.optim keeps one: a parameter step() skipped (no gradient on any rank, or
frozen) does not count that step, so when it trains again its bias correction (AdamW) or its first momentum step
(SGD) is its own, not its group's. Compared with torch.optim on an fp32 master copy, step by step, through runs
where heads of a model train on some steps only (counts exactly, state and master to fp32 op order), and bit for bit
with an optimizer holding the late parameter alone; kept by every way of saving the state."""

import copy

import pytest
import torch
import torch.distributed as dist

from tests.distributed import run_on_ranks
from tests.helpers import assert_bitwise_equal
from tests.optim.test_unused_params import HEADS, _Heads
from tritonshard import ShardedAdamW, ShardedMuon, ShardedSGD
from tritonshard.checkpoint import load_sharded, save_sharded

#: which heads the loss uses at each step: every head is first used at a different step, sits out some, and the
#: fourth step has no backward at all (torch skips every parameter: no count moves)
SCHEDULE = (("a",), ("a", "b"), ("b", "c"), None, ("a", "c"), ("c",), HEADS)

OPTIMIZERS = {  # ours and torch's, same hyper-parameters (SGD's dampening makes its first momentum step show)
    "adamw": (lambda params, **kw: ShardedAdamW(params, lr=1e-2, weight_decay=0.1, **kw),
              lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, foreach=False)),
    # the fp32 master kept as the bf16 weights plus int16 remainders: the pieces saved and updated again are those
    "adamw, remainders": (lambda params, **kw: ShardedAdamW(params, lr=1e-2, weight_decay=0.1,
                                                            store_param_remainders=True, **kw),
                          lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, foreach=False)),
    # the updates bucket by bucket, each followed by its all-gather (the pieces updated again between the two)
    "adamw, overlap_comm": (lambda params, **kw: ShardedAdamW(params, lr=1e-2, weight_decay=0.1, overlap_comm=True,
                                                              **kw),
                            lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, foreach=False)),
    "sgd": (lambda params, **kw: ShardedSGD(params, lr=1e-1, momentum=0.9, dampening=0.3, weight_decay=0.1, **kw),
            lambda params: torch.optim.SGD(params, lr=1e-1, momentum=0.9, dampening=0.3, weight_decay=0.1,
                                           foreach=False)),
}


def _grads(model, step, used):
    """This step's gradients by parameter name, set by hand (bf16, fresh random values): the trunk's and the used
    heads' (None: no backward at all). By hand, so that torch.optim gets exactly ours: no weights-to-gradients
    feedback for fp32 op-order differences to go through."""
    if used is None:
        return {}
    g = torch.Generator().manual_seed(100 + step)
    return {n: torch.randn(p.shape, generator=g).to(torch.bfloat16) for n, p in model.named_parameters()
            if n.startswith("trunk.") or n.split(".")[1] in used}


class _Twin:
    """torch.optim on an fp32 copy of ``model`` (taken before our optimizer turns it into bf16 views): what our
    optimizer must match at one rank."""

    def __init__(self, model, make_torch):
        self.master = copy.deepcopy(model)
        self.opt = make_torch(self.master.parameters())

    def step(self, step, used):
        grads = _grads(self.master, step, used)
        for n, p in self.master.named_parameters():
            p.grad = grads[n].float() if n in grads else None
        self.opt.step()
        self.opt.zero_grad()


def _step(model, opt, step, used):
    grads = _grads(model, step, used)
    for n, p in model.named_parameters():
        if n in grads:
            p.grad = grads[n]
    opt.step()
    opt.zero_grad()


def _assert_like_torch(ours: dict, twin: _Twin, what: str):
    """Every parameter's step count equal torch's, and its state and master close to torch's: fp32 op order
    (torch's CPU kernels contract some multiply-adds, the interpreter does not) leaves a few ulps per step, so the
    state to 1e-5 relative or 1e-7 absolute (a few ulps of the ~0.1 terms that can cancel in the moments' lerp:
    measured 2e-9) and the master (values ~0.3, ulp 3e-8) to 1e-6 absolute, over 7 steps; a wrong count
    moves the master by ~lr/4 = 2.5e-3 (AdamW's bias correction) and SGD's momentum by 30 % (dampening on a first
    step). A parameter torch never stepped has step 0 and zero state here (torch has none), and its initial
    weights, bit for bit."""
    for i, (name, m) in enumerate(twin.master.named_parameters()):
        entry, theirs = ours["state"][i], twin.opt.state.get(m, {})
        if not theirs:
            assert float(entry["step"]) == 0.0, f"{what}: {name} never stepped, step {float(entry['step'])}"
            for key, value in entry.items():
                if key not in ("step", "master"):
                    assert not value.any(), f"{what}: {name} never stepped, {key} not zero"
            assert_bitwise_equal(entry["master"], m.detach(), f"{what}: {name} master")
            continue
        if "step" in theirs:  # (torch.optim.SGD keeps none)
            assert float(entry["step"]) == float(theirs["step"]), \
                f"{what}: {name} step {float(entry['step'])}, torch {float(theirs['step'])}"
        for key, value in theirs.items():
            if key != "step":
                torch.testing.assert_close(entry[key], value, rtol=1e-5, atol=1e-7,
                                           msg=lambda m, key=key: f"{what}: {name} {key}: {m}")
        torch.testing.assert_close(entry["master"], m.detach(), rtol=0, atol=1e-6, msg=f"{what}: {name} master")
    assert len(ours["state"]) == len(list(twin.master.parameters()))


@pytest.mark.parametrize("kind", list(OPTIMIZERS))
@pytest.mark.parametrize("cap", [1e-9, 25.0], ids=["a bucket per parameter", "one bucket"])
def test_each_parameter_counts_its_own_steps_as_torch_optim(kind, cap):
    # Before: one count per param group, so a head first used at step 2 got step 2's bias correction (AdamW:
    # an update ~3x torch's) and no first-step momentum (SGD); the state dict said step 2 for a head torch never
    # stepped
    make_ours, make_torch = OPTIMIZERS[kind]
    model = _Heads()
    twin = _Twin(model, make_torch)
    opt = make_ours(model.parameters(), bucket_cap_mb=cap)
    for step, used in enumerate(SCHEDULE):
        _step(model, opt, step, used)
        twin.step(step, used)
        _assert_like_torch(opt.state_dict(), twin, f"{kind}, step {step}, heads {used}")


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_a_parameter_on_its_own_count_trains_bit_for_bit_as_in_an_optimizer_of_its_own(kind):
    # head b sits out step 0, so from step 1 on its pieces are updated again by a launch of their own with their
    # own count; an optimizer holding head b alone runs the flat update at that count: the same bits
    make_ours, _ = OPTIMIZERS[kind]
    model = _Heads()
    alone = copy.deepcopy(model.heads["b"])
    opt, opt_alone = make_ours(model.parameters()), make_ours(alone.parameters())
    for step, used in enumerate((("a",), HEADS, ("b", "c"))):
        grads = _grads(model, step, used)
        for n, p in model.named_parameters():
            p.grad = grads.get(n)
        for n, p in alone.named_parameters():
            p.grad = grads.get(f"heads.b.{n}")
        opt.step()
        opt_alone.step()
        opt.zero_grad()
        opt_alone.zero_grad()
    state, state_alone = opt.state_dict()["state"], opt_alone.state_dict()["state"]
    names = [n for n, _ in model.named_parameters()]
    for j, n in enumerate(("weight", "bias")):
        entry = state[names.index(f"heads.b.{n}")]
        assert float(entry["step"]) == 2.0
        for key, value in state_alone[j].items():
            assert_bitwise_equal(entry[key], value, f"heads.b.{n} {key}")


def test_stochastically_rounded_bf16_states_update_a_parameter_with_its_own_count():
    # the pieces updated again draw rounding bits of their own (param_steps._piece_seed): the run is reproducible,
    # and its masters stay within bf16-state rounding of torch's fp32 run (each moment off by <= 2^-8 relative:
    # <= lr * 2^-7 ~ 8e-5 per step, 7 steps -> 1e-3; a wrong count: ~2.5e-3 at the head's first step, and more
    # on the next ones)
    make_ours, make_torch = OPTIMIZERS["adamw"]
    runs = []
    for _ in range(2):
        model = _Heads()
        twin = _Twin(model, make_torch)
        opt = make_ours(model.parameters(), bucket_cap_mb=25.0, state_dtype=torch.bfloat16)
        for step, used in enumerate(SCHEDULE):
            _step(model, opt, step, used)
            twin.step(step, used)
        state = opt.state_dict()["state"]
        for i, (name, m) in enumerate(twin.master.named_parameters()):
            assert float(state[i]["step"]) == float(twin.opt.state[m]["step"]), name
            torch.testing.assert_close(state[i]["master"], m.detach(), rtol=0, atol=1e-3, msg=name)
        runs.append(state)
    for i, entry in runs[0].items():
        for key, value in entry.items():
            assert_bitwise_equal(runs[1][i][key], value, f"parameter {i} {key}, run twice")


def test_the_live_state_shows_each_parameters_count():
    # opt.state[p]["step"] (the live view) is the parameter's own count once it has one
    model = _Heads()
    opt = ShardedAdamW(model.parameters(), lr=1e-2)
    for step, used in enumerate((HEADS, ("a",), ("a",))):
        _step(model, opt, step, used)
    counts = {n: float(opt.state[p]["step"]) for n, p in model.named_parameters()}
    assert counts == {"trunk.weight": 3, "trunk.bias": 3, "heads.a.weight": 3, "heads.a.bias": 3,
                      "heads.b.weight": 1, "heads.b.bias": 1, "heads.c.weight": 1, "heads.c.bias": 1}


def test_a_step_that_skips_every_parameter_keeps_the_shared_count():
    # step() without a backward: no count moves, and no parameter leaves its group's count (no update launched
    # again per parameter on every later step)
    model = _Heads()
    opt = ShardedAdamW(model.parameters(), lr=1e-2)
    _step(model, opt, 0, HEADS)
    _step(model, opt, 1, None)
    assert {float(e["step"]) for e in opt.state_dict()["state"].values()} == {1.0}
    assert not opt._own_steps


@pytest.mark.parametrize("overlap", [False, True], ids=["", "overlap_comm"])
def test_a_group_none_of_whose_parameters_trains_is_not_updated(overlap):
    # step() before any backward: every count stays 0, and the update is not launched; at count 0 it would write
    # NaN into the buffers' padding (0 / sqrt(1 - beta2^0)), which no parameter's pieces cover. Nor are the
    # pieces copied to be put back (a copy of the whole optimizer state, for a model that skips a step)
    model = _Heads()
    opt = ShardedAdamW(model.parameters(), lr=1e-2, bucket_cap_mb=1e-9, overlap_comm=overlap)
    buffers = lambda: [t.clone() for b in opt.buckets  # noqa: E731
                       for t in (b.param_buffer.get_data(), b.master, *b.state.values())]
    before = buffers()
    assert any(b.param_buffer.padded_numel > b.param_buffer.layout.total_numel for b in opt.buckets), "no padding"
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        opt.step()
    clones = [e.name for e in prof.events() if e.name == "aten::clone"]
    assert not clones, f"{len(clones)} copies in a step that updates nothing"
    for i, (a, b) in enumerate(zip(buffers(), before)):
        assert_bitwise_equal(a, b, f"buffer {i}, padding included")
    _step(model, opt, 0, HEADS)  # and the first real step counts 1
    assert {float(e["step"]) for e in opt.state_dict()["state"].values()} == {1.0}


def test_muons_adamw_groups_count_per_parameter():
    # ShardedMuon: the matrices in Muon (no step count, as torch.optim.Muon), the biases in an AdamW group, whose
    # counts are each bias's own: the number of steps that used its head
    model = _Heads()
    opt = ShardedMuon([dict(params=[model.trunk.weight] + [model.heads[h].weight for h in HEADS]),
                       dict(params=[model.trunk.bias] + [model.heads[h].bias for h in HEADS], use_muon=False,
                            lr=1e-2)], lr=1e-2)
    schedule = (("a",), ("a", "b"), ("b",), ("a", "b"))
    for step, used in enumerate(schedule):
        _step(model, opt, step, used)
    state = opt.state_dict()["state"]
    index = {p: i for i, p in enumerate(p for g in opt.param_groups for p in g["params"])}
    counts = {h: float(state[index[model.heads[h].bias]]["step"]) for h in HEADS}
    assert counts == {h: float(sum(h in used for used in schedule)) for h in HEADS}  # a 3, b 3, c 0
    assert float(state[index[model.trunk.bias]]["step"]) == len(schedule)
    assert "step" not in state[index[model.heads["a"].weight]]


@pytest.mark.parametrize("how", ["state_dict", "save_sharded"])
def test_the_counts_survive_a_checkpoint_and_the_resumed_run_continues_bit_for_bit(tmp_path, how):
    make_ours, _ = OPTIMIZERS["adamw"]
    runs = []
    for resume in (False, True):
        model = _Heads()
        opt = make_ours(model.parameters(), bucket_cap_mb=1e-9)
        for step, used in enumerate(SCHEDULE[:3]):
            _step(model, opt, step, used)
        if resume:
            saved = opt.state_dict()
            if how == "save_sharded":
                save_sharded(opt, str(tmp_path / "ckpt"))
            model = _Heads()  # a fresh model (initial weights) and optimizer with another bucket layout
            opt = make_ours(model.parameters(), bucket_cap_mb=25.0)
            if how == "save_sharded":
                load_sharded(opt, str(tmp_path / "ckpt"))
            else:
                opt.load_state_dict(saved)
            assert [float(e["step"]) for e in opt.state_dict()["state"].values()] == \
                [float(e["step"]) for e in saved["state"].values()]
        for step, used in enumerate(SCHEDULE[3:], start=3):
            _step(model, opt, step, used)
        runs.append(opt.state_dict()["state"])
    for i, entry in runs[0].items():
        for key, value in entry.items():
            assert_bitwise_equal(runs[1][i][key], value, f"parameter {i} {key}")


def test_a_torch_optim_state_with_different_counts_loads_and_continues_as_torch():
    # torch.optim.AdamW's state: each parameter its own step, none for a parameter never stepped. Before, a load
    # with different steps in one param group raised ("tritonshard keeps one step per param group")
    make_ours, make_torch = OPTIMIZERS["adamw"]
    model = _Heads()
    twin = _Twin(model, make_torch)
    for step, used in enumerate((("a",), ("a", "b"))):  # head c: no state in torch's dict
        twin.step(step, used)
    model.load_state_dict(twin.master.state_dict())  # the weights torch trained, fp32, before ours takes them
    opt = make_ours(model.parameters())
    opt.load_state_dict(twin.opt.state_dict())
    for step, used in enumerate((("c",), ("b", "c"), HEADS), start=2):
        _step(model, opt, step, used)
        twin.step(step, used)
        _assert_like_torch(opt.state_dict(), twin, f"after the load, step {step}, heads {used}")


def _on_ranks(rank, world_size):
    model = _Heads()
    opt = ShardedAdamW(model.parameters(), lr=1e-2, weight_decay=0.1, bucket_cap_mb=1e-9)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    # a backward (hooks, buckets completing) on every rank; head b: used on the last rank only at step 1 (so every
    # rank counts it), head c never until step 2
    schedule = [("a",), ("a", "b") if rank == world_size - 1 else ("a",), HEADS]
    expected = []
    for used in schedule:
        model.loss(x, used).backward()
        opt.step()
        opt.zero_grad()
        state = opt.state_dict()["state"]
        expected.append({n: float(state[i]["step"]) for i, (n, _) in enumerate(model.named_parameters())})
    got = [None] * world_size
    dist.all_gather_object(got, expected)
    assert all(g == expected for g in got), "ranks disagree on the counts"
    last = expected[-1]
    assert (last["trunk.weight"], last["heads.a.weight"], last["heads.b.weight"], last["heads.c.weight"]) == \
        (3.0, 3.0, 2.0, 1.0), last


@pytest.mark.parametrize("world_size", [2])
def test_ranks_count_a_step_where_any_rank_gave_a_gradient(world_size):
    run_on_ranks(_on_ranks, world_size)
