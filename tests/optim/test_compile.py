"""An optimizer step under torch.compile: the kernels run as tritonshard custom ops, with no graph break.

One process (world size 1), but for the last test: on more ranks a compiled step runs eagerly (its handshakes).
"""

import pytest
import torch

from tests.optim.training import LR, batch, loss_fn, make_model, muon_groups, param_groups
from tritonshard import ShardedAdamW, ShardedLion, ShardedMuon, ShardedSGD

FACTORIES = {
    "adamw": lambda model: ShardedAdamW(param_groups(model), lr=LR),
    "sgd": lambda model: ShardedSGD(param_groups(model), lr=0.05, momentum=0.9),
    "lion": lambda model: ShardedLion(param_groups(model), lr=1e-3, weight_decay=0.1),
    "muon": lambda model: ShardedMuon(muon_groups(model), lr=0.02, adjust_lr_fn="match_rms_adamw"),
}
#: the update ops each optimizer's compiled step must contain
OPS = {"adamw": ["adamw_step_"], "sgd": ["sgd_step_"], "lion": ["lion_step_"],
       "muon": ["muon_momentum_", "muon_update_", "adamw_step_"]}


def _recording_backend():
    """(the graphs dynamo traced, a backend that records them and then runs each as is)."""
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward
    return graphs, capture


def _eager_then_compiled(name):
    """(compiled, model, optimizer): an eager run, then a compiled one, each from the same fresh model."""
    for compiled in (False, True):
        torch._dynamo.reset()
        model = make_model(0)
        yield compiled, model, FACTORIES[name](model)


@pytest.mark.parametrize("name", list(FACTORIES))
def test_compiled_step_has_no_graph_break_and_matches_eager(name):
    graphs, capture = _recording_backend()
    results = []
    for compiled, model, opt in _eager_then_compiled(name):

        def clip_and_step(opt=opt):  # the optimizer half of a training step: reduce, norm, clip, update
            norm = opt.clip_grad_norm_(0.5)
            opt.step()
            return norm

        step = torch.compile(clip_and_step, fullgraph=True, backend=capture) if compiled else clip_and_step
        for k in range(3):
            # (+ 0 * unused: a zero gradient for the parameter the model leaves unused, in both runs. Without one,
            # eager step() leaves it unchanged as torch.optim does, and a compiled step updates it with zeros: a
            # difference the README states)
            (loss_fn(model, batch(0, k, 0)) + 0 * model.unused.sum()).backward()
            step()  # fullgraph=True: any graph break inside the optimizer step raises
            opt.zero_grad()
        results.append([b.param_buffer.get_data().clone() for b in opt.buckets])
    for eager, compiled in zip(*results):
        assert torch.equal(eager.view(torch.int16), compiled.view(torch.int16)), "compiled step != eager step"
    targets = {str(n.target) for gm in graphs for n in gm.graph.nodes if n.op == "call_function"}
    for op in OPS[name]:
        assert any(f"tritonshard.{op}" in t for t in targets), f"no tritonshard {op} op in {targets}"
    assert any("tritonshard.sum_sq_partials_" in t for t in targets), f"no sum_sq_partials_ op in {targets}"
    assert any("tritonshard.finalize_sum_sq_" in t for t in targets), f"no finalize_sum_sq_ op in {targets}"


def test_a_parameter_reusing_the_id_of_one_whose_data_was_read_compiles_under_fullgraph():
    """A ``.data`` read is noted by the parameter's id (bucket.DATA_READS) until its optimizer's next look; a
    parameter gone before that leaves its id there, and a new parameter may get the same address. Until session
    40 that stale note made the new optimizer's first compiled step look at the weights eagerly: under
    ``fullgraph=True`` dynamo's error, now and then (the suite under xdist met it in this file's first test)."""
    from tritonshard.optim import bucket
    model = make_model(0)
    bucket.DATA_READS.add(id(next(model.parameters())))  # (as a read of a parameter gone, whose id this one got)
    opt = ShardedAdamW(param_groups(model), lr=LR)

    def clip_and_step():
        norm = opt.clip_grad_norm_(0.5)
        opt.step()
        return norm

    step = torch.compile(clip_and_step, fullgraph=True, backend="eager")
    for k in range(2):
        (loss_fn(model, batch(0, k, 0)) + 0 * model.unused.sum()).backward()
        step()  # (fullgraph=True: an eager look raises)
        opt.zero_grad()


@pytest.mark.parametrize("name", ["adamw", "sgd"])
def test_a_compiled_step_keeps_the_counts_a_parameter_has_of_its_own(name):
    # model.unused gets no gradient at the first (eager) step, so from then on it counts steps of its own
    # (param_steps.py); the compiled steps after it must advance that count and update it with it, as eager steps
    # do: the same bits, the same counts (before, dynamo could not even trace the step: it inspected the
    # parameters keying the counts, and their placeholder grads)
    graphs, capture = _recording_backend()
    results = []
    for compiled, model, opt in _eager_then_compiled(name):
        step = torch.compile(opt.step, fullgraph=True, backend=capture) if compiled else opt.step
        for k in range(3):
            loss = loss_fn(model, batch(0, k, 0))
            (loss if k == 0 else loss + 0 * model.unused.sum()).backward()  # (unused: a zero gradient from k = 1)
            opt.step() if k == 0 else step()  # the first step eager in both runs: it finds the unused parameter
            opt.zero_grad()
        counts = {i: float(e["step"]) for i, e in opt.state_dict()["state"].items()}
        order = [p for g in opt.param_groups for p in g["params"] if p.requires_grad]  # (torch.optim numbering)
        assert counts == {i: 2.0 if p is model.unused else 3.0 for i, p in enumerate(order)}, counts
        results.append([b.param_buffer.get_data().clone() for b in opt.buckets])
    for a, b in zip(*results):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16)), "compiled step != eager step"
    assert graphs, "nothing was compiled"


def _skipping_run(name, compiled: bool, fullgraph: bool = False):
    """(model, optimizer, the parameters' values after step 1, the graphs dynamo traced) of five steps, of which four skip parameters as
    torch.optim does: model.unused gets no gradient (steps 0, 2, 4), fc2.bias is frozen for step 2, step 3 has no
    backward (every parameter skipped); step 1 gives every parameter a gradient (the compiled, traced step)."""
    torch._dynamo.reset()
    model = make_model(0)
    opt = FACTORIES[name](model)
    graphs, capture = _recording_backend()
    step = torch.compile(opt.step, fullgraph=fullgraph, backend=capture) if compiled else opt.step
    after_traced = None
    for k in range(5):
        if k == 2:
            model.fc2.bias.requires_grad_(False)
        if k != 3:
            loss = loss_fn(model, batch(0, k, 0))
            (loss + 0 * model.unused.sum() if k == 1 else loss).backward()
        step()
        opt.zero_grad()
        model.fc2.bias.requires_grad_(True)
        if k == 1:
            after_traced = {n: p.detach().clone() for n, p in model.named_parameters()}
    return model, opt, after_traced, graphs


@pytest.mark.parametrize("name", list(FACTORIES))
def test_a_compiled_step_skips_what_torch_optim_skips(name):
    # torch.compile(opt.step) (torch's recipe for compiled optimizers; fullgraph=False, its default) over a model
    # with a parameter that gets no gradient: torch.optim leaves it unchanged, and so must the compiled step. Until
    # session 23 it updated it with zeros (AdamW's weight decay shrank model.unused; its step counted), silently
    model, opt, after_traced, _ = _skipping_run(name, compiled=False)
    compiled_model, compiled_opt, compiled_traced, graphs = _skipping_run(name, compiled=True)
    targets = {str(n.target) for gm in graphs for n in gm.graph.nodes if n.op == "call_function"}
    assert all(any(f"tritonshard.{op}" in t for t in targets) for op in OPS[name]), "step 1 was not compiled"
    assert torch.equal(after_traced["unused"], model.unused.detach())  # (eager steps 2-4 skip it, as torch.optim)
    for n, p in compiled_model.named_parameters():
        assert torch.equal(compiled_traced[n].view(torch.int16), after_traced[n].view(torch.int16)), n
        assert torch.equal(p.detach().view(torch.int16), dict(model.named_parameters())[n].detach().view(
            torch.int16)), f"{n}: compiled step != eager step"
    for a, b in zip(opt.buckets, compiled_opt.buckets):
        assert torch.equal(a.master, b.master)
        for key in a.state:
            assert torch.equal(a.state[key], b.state[key]), key
    counts = [{i: float(e["step"]) for i, e in o.state_dict()["state"].items() if "step" in e}
              for o in (opt, compiled_opt)]
    assert counts[0] == counts[1]


def test_under_fullgraph_a_step_that_skips_names_why_it_cannot_compile():
    # (with fullgraph=True dynamo refuses the eager step: its error carries the reason and the ways out)
    with pytest.raises(torch._dynamo.exc.Unsupported, match="some have no gradient.*0 \\* p.sum"):
        _skipping_run("adamw", compiled=True, fullgraph=True)


def _scheduled_run(name, compiled: bool):
    """(model, optimizer, graphs) of eight steps with a new lr for each (a Python float, as a scheduler sets) and,
    before steps 4-6, an eager clip: torch's clip_grad_norm_, the optimizer's, torch's clip_grad_value_ (steps 0-3
    and 7 compiled: once the lr has changed twice, dynamo traces the step with it as a symbolic float)."""
    torch._dynamo.reset()
    model = make_model(0)
    opt = FACTORIES[name](model)
    base = [g["lr"] for g in opt.param_groups]
    graphs, capture = _recording_backend()
    step = torch.compile(opt.step, backend=capture) if compiled else opt.step
    for k in range(8):
        (loss_fn(model, batch(0, k, 0)) + 0 * model.unused.sum()).backward()  # (every parameter: a gradient)
        if k == 4:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        elif k == 5:
            opt.clip_grad_norm_(0.05)
        elif k == 6:
            torch.nn.utils.clip_grad_value_(model.parameters(), 1e-3)
        for g, lr in zip(opt.param_groups, base):  # (a scheduler's work; torch's own wrap opt.step in a function
            g["lr"] = lr / (k + 1)                 # dynamo does not trace, so that torch.compile(opt.step) would
        step()                                     # trace less than this)
        opt.zero_grad()
    return model, opt, graphs


@pytest.mark.parametrize("name", list(FACTORIES))
def test_a_compiled_step_follows_an_lr_scheduler_and_an_eager_clip(name):
    # torch.compile(opt.step) with an LR scheduler: until session 23 the second step raised InternalTorchDynamoError
    # (the changed lr made dynamo trace it as a symbolic float, the lr check's math.isfinite broke the graph, and the
    # code after the break looked at the parameters). A clip run eagerly before the compiled step (torch's, the
    # optimizer's, or GradScaler.unscale_) raised it too: the step looks at each param.grad after an early
    # reduction, so that step runs eagerly now
    compiled_model, compiled_opt, graphs = _scheduled_run(name, compiled=True)
    model, opt, _ = _scheduled_run(name, compiled=False)
    targets = {str(n.target) for gm in graphs for n in gm.graph.nodes if n.op == "call_function"}
    assert all(any(f"tritonshard.{op}" in t for t in targets) for op in OPS[name]), "no step was compiled"
    for (n, p), q in zip(model.named_parameters(), compiled_model.parameters()):
        assert torch.equal(p.detach().view(torch.int16), q.detach().view(torch.int16)), f"{n}: compiled != eager"
    for a, b in zip(opt.buckets, compiled_opt.buckets):
        assert torch.equal(a.master, b.master)
        for key in a.state:
            assert torch.equal(a.state[key], b.state[key]), key


def test_what_a_compiled_step_consumed_is_spent_as_after_an_eager_step():
    # a step traced by torch.compile cannot put the spent markers in param.grad (they need the parameters), and
    # dynamo drops its writes to the optimizer's attributes; until session 23 nothing made up for it: a second step
    # without zero_grad() skipped every parameter (torch.optim applies the gradients again; an eager step raises
    # the spent-gradient error), a clip did not raise, and a new optimizer refused to be built (found by
    # test_loop_fuzz.py's CompiledTrainingLoop). Now the next eager call finishes the compiled step
    for then in ("step", "clip", "backward", "new optimizer"):
        torch._dynamo.reset()
        model = make_model(0)
        opt = FACTORIES["adamw"](model)
        step = torch.compile(opt.step, backend="eager")
        (loss_fn(model, batch(0, 0, 0)) + 0 * model.unused.sum()).backward()
        step()  # (traced: every parameter has a gradient)
        assert type(model.fc1.weight.grad).__name__ == "ShardedGrad", "the step was not traced"
        with pytest.raises(RuntimeError, match="was used by the last step"):
            if then == "step":
                step()
            elif then == "clip":
                opt.clip_grad_norm_(1.0)
            elif then == "backward":
                loss_fn(model, batch(0, 1, 0)).backward()  # (torch.optim would step with the sum)
                step()
            else:
                opt = FACTORIES["adamw"](model)  # (it takes over the spent gradients, as from an eager step)
                opt.step()
        opt.zero_grad()


def _clip_then_step(compiled: bool, unused: bool, norm_only: bool = False):
    torch._dynamo.reset()
    model = make_model(0)
    opt = FACTORIES["adamw"](model)

    def clip_and_step():
        norm = opt.grad_norm() if norm_only else opt.clip_grad_norm_(0.05)
        opt.step()
        return norm

    call = torch.compile(clip_and_step, backend="eager") if compiled else clip_and_step
    norms = []
    for k in range(3):
        loss = loss_fn(model, batch(0, k, 0))
        (loss if unused else loss + 0 * model.unused.sum()).backward()
        norms.append(call())
        opt.zero_grad()
    return torch.stack(norms), [b.param_buffer.get_data() for b in opt.buckets]


def test_a_clip_compiled_with_a_step_that_runs_eagerly_runs_eagerly_too():
    # the clip and the step in one compiled function, with a parameter without a gradient (so the step runs
    # eagerly): dynamo drops what the traced clip set on the optimizer, so the eager step reduced again and did not
    # clip (session 23, between two commits); the clip now runs eagerly with it
    # (opt.grad_norm() the same way: until session 24 its traced reduction made that eager step raise, as a clip
    # compiled without its step did then)
    for unused, norm_only in ((False, False), (True, False), (True, True)):
        (norms, bufs), (cnorms, cbufs) = (_clip_then_step(c, unused, norm_only) for c in (False, True))
        assert torch.equal(norms, cnorms), unused
        assert all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(bufs, cbufs)), unused


def _separate_graphs_run(how, compiled: bool):
    """(norms, the parameters) after three steps with a clip (or a norm) and a step that torch.compile compiles as
    graphs of their own: ``how`` "clip alone" (torch.compile(opt.clip_grad_norm_), an eager step), "norm alone"
    (torch.compile(opt.grad_norm), an eager clip-free step), "clip + step, LR scheduler" (one compiled function;
    the scheduler's wrapper of step() makes dynamo compile the step as a frame of its own)."""
    torch._dynamo.reset()
    model = make_model(0)
    opt = FACTORIES["adamw"](model)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    maybe = (lambda f: torch.compile(f, backend="eager")) if compiled else (lambda f: f)
    clip, norm = maybe(opt.clip_grad_norm_), maybe(opt.grad_norm)

    def clip_and_step():
        n = opt.clip_grad_norm_(0.05)
        opt.step()
        return n

    both = maybe(clip_and_step)
    norms = []
    for k in range(3):
        (loss_fn(model, batch(0, k, 0)) + 0 * model.unused.sum()).backward()
        if how == "clip alone":
            norms.append(clip(0.05))
            opt.step()
        elif how == "norm alone":
            norms.append(norm())
            opt.step()
        else:
            norms.append(both())
        sched.step()
        opt.zero_grad()
    return torch.stack(norms), [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("how", ["clip alone", "norm alone", "clip + step, LR scheduler"])
def test_a_clip_compiled_in_a_graph_without_its_step_reaches_the_step(how):
    # dynamo drops a traced function's writes to the optimizer's attributes, so a clip compiled in a graph without
    # its step lost its reduction and coefficient: until session 23 the step then reduced again and did not clip,
    # silently; in session 23 it raised, also in the common loop of a compiled clip + step with an LR scheduler
    # (the scheduler's wrapper of step() is a separate graph). Now the reduction keeps a copy in the flags object
    # (whose writes dynamo replays) and the step takes it back: the eager run's norms and weights, bit for bit
    (norms, params), (cnorms, cparams) = (_separate_graphs_run(how, c) for c in (False, True))
    assert torch.equal(norms, cnorms), how
    for a, b in zip(params, cparams):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16)), f"{how}: compiled != eager"


def test_a_compiled_clip_after_an_eager_read_of_each_gradients_norm_gives_the_eager_weights():
    # A log line reading each parameter's gradient norm (p.grad.norm()) after a compiled clip takes that traced
    # reduction back eagerly; the next compiled clip of the step must then run eagerly, as after any eager
    # reduction (it looks at param.grad again). Until session 35 it traced that look and failed in dynamo
    # (found by tests.optim.loop_fuzz_long's TracedTrainingLoop)
    results = []
    for compiled, model, opt in _eager_then_compiled("adamw"):
        clip = torch.compile(opt.clip_grad_norm_, backend="eager") if compiled else opt.clip_grad_norm_
        step = torch.compile(opt.step, backend="eager") if compiled else opt.step
        norms = []
        for k in range(3):
            (loss_fn(model, batch(0, k, 0)) + 0 * model.unused.sum()).backward()
            norms.append(clip(0.5))
            norms += [p.grad.norm() for p in model.parameters() if p.grad is not None]
            norms.append(clip(0.5))
            step()
            opt.zero_grad()
        results.append((torch.stack(norms), [p.detach().clone() for p in model.parameters()]))
    (norms, params), (cnorms, cparams) = results
    assert torch.equal(norms, cnorms)
    for a, b in zip(params, cparams):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16)), "compiled != eager"


@pytest.mark.parametrize("compiled_step", [False, True])
def test_gradients_zeroed_through_the_model_after_a_compiled_step_are_zeros(compiled_step):
    # model.zero_grad(set_to_none=False) right after a traced step zeroes its placeholders: they are that step's
    # spent gradients, which zeroing turns into zeros the next backward adds to (as torch.optim's, and as after an
    # eager step); before, the next backward found them spent ("a backward that added to the last step()'s
    # gradients", found by CompiledTrainingLoop)
    results = []
    for compiled in (False, compiled_step):
        torch._dynamo.reset()
        model = make_model(0)
        opt = FACTORIES["adamw"](model)
        step = torch.compile(opt.step, backend="eager") if compiled else opt.step
        for k in range(3):
            (loss_fn(model, batch(0, k, 0)) + 0 * model.unused.sum()).backward()
            step()
            model.zero_grad(set_to_none=False)
        results.append([b.param_buffer.get_data() for b in opt.buckets])
    assert all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(*results))


def _assert_the_same_with_steps_traced(eager: list, compiled: list, graphs: list, what: str) -> None:
    """``compiled`` bit for bit ``eager`` (tensors), and an update among the graphs dynamo traced (the steps the
    loop did not make eager stayed traced)."""
    targets = {str(n.target) for gm in graphs for n in gm.graph.nodes if n.op == "call_function"}
    assert any("tritonshard.adamw_step_" in t for t in targets), f"{what}: no step was traced"
    for i, (a, b) in enumerate(zip(eager, compiled)):
        bits = torch.int16 if a.element_size() == 2 else torch.int32
        assert torch.equal(a.view(bits), b.view(bits)), f"{what}: tensor {i}: compiled step != eager step"


HAND_SETS = {
    "model.zero_grad()": lambda model: model.zero_grad(),  # (torch.optim then skips every parameter)
    "p.grad = None": lambda model: setattr(model.fc1.weight, "grad", None),
    "p.grad = t": lambda model: setattr(model.fc1.weight, "grad", torch.full_like(model.fc1.weight, 0.25)),
}


@pytest.mark.parametrize("how", list(HAND_SETS))
def test_a_compiled_step_sees_gradients_set_or_cleared_by_hand_after_the_backward(how):
    # the loop assigns param.grad between a backward and a compiled step: torch.optim uses what it finds there
    # (skips a parameter set to None, applies a gradient set by hand). Until session 24 the compiled step used the
    # backward's gradients, silently: it cannot look at the parameters. Now an assignment to a parameter's .grad
    # sets the flag a compiled step reads, so that step runs eagerly; the steps before it stay traced
    def run(compiled):  # (every parameter gets a gradient from each backward; the last step's set by hand)
        return _run_with_write(lambda model, opt: HAND_SETS[how](model), 2, True, compiled)
    _assert_the_same_with_steps_traced(run(False)[0], *run(True), how)


@pytest.mark.parametrize("at", [0, 1])
def test_a_compiled_step_after_gradients_zeroed_through_the_model_steps_with_zeros(at):
    # model.zero_grad(set_to_none=False) between a backward and a compiled step (its first, or a later one):
    # torch.optim steps with zeros (AdamW's moments decay, the weight decay applies). Until session 37 the traced
    # step raised an InternalTorchDynamoError: its reset cleared the dict of zeroed placeholders, keyed by the
    # parameters, which dynamo wraps along with their param.grad (found by tests.optim.loop_fuzz_long's
    # TracedTrainingLoop: a backward in no_sync(), model.zero_grad(set_to_none=False), the step)
    def run(compiled):
        return _run_with_write(lambda model, opt: model.zero_grad(set_to_none=False), at, True, compiled)
    _assert_the_same_with_steps_traced(run(False)[0], *run(True), f"zeroed before step {at}")


def test_under_fullgraph_a_step_after_gradients_set_by_hand_names_why():
    torch._dynamo.reset()
    model = make_model(0)
    opt = FACTORIES["adamw"](model)
    (loss_fn(model, batch(0, 0, 0)) + 0 * model.unused.sum()).backward()
    model.fc1.weight.grad = None
    with pytest.raises(torch._dynamo.exc.Unsupported, match="gradients were set or cleared by hand"):
        torch.compile(opt.step, fullgraph=True, backend="eager")()


def _load(model, opt):  # (weights loaded after the optimizer was built: a checkpoint, pretrained weights)
    model.load_state_dict(make_model(7).state_dict())


def _clamp(model, opt):  # (weight clipping after step(), as WGAN's loop does)
    with torch.no_grad():
        model.fc1.weight.clamp_(-0.01, 0.01)


def _data_clamp(model, opt):
    model.fc1.weight.data.clamp_(-0.01, 0.01)


def _data_assign(model, opt):
    model.fc2.weight.data = torch.full_like(model.fc2.weight, 0.125)


def _state_replaced(model, opt):
    opt.state[model.fc1.weight]["exp_avg"] = torch.full_like(opt.state[model.fc1.weight]["exp_avg"], 0.5)


#: (what the loop writes, before which step, after that step's backward or before it)
WRITES = {
    "load_state_dict after the build": (_load, 0, False),
    "in-place clamp after step()": (_clamp, 1, False),
    ".data clamp after step()": (_data_clamp, 1, False),
    ".data clamp after the backward": (_data_clamp, 1, True),
    "p.data = t after the backward": (_data_assign, 1, True),
    "opt.state entry replaced after the backward": (_state_replaced, 1, True),
}


def _run_with_write(write, at: int, after_backward: bool, compiled: bool):
    """(parameters, masters and moments after three steps, the graphs traced), ``write(model, opt)`` done once,
    before step ``at``, after its backward or before it."""
    torch._dynamo.reset()
    model = make_model(0)
    opt = FACTORIES["adamw"](model)
    graphs, capture = _recording_backend()
    step = torch.compile(opt.step, backend=capture) if compiled else opt.step
    for k in range(3):
        if k == at and not after_backward:
            write(model, opt)
        (loss_fn(model, batch(0, k, 0)) + 0 * model.unused.sum()).backward()
        if k == at and after_backward:
            write(model, opt)
        step()
        opt.zero_grad()
    kept = [p.detach().clone() for p in model.parameters()]
    kept += [t.clone() for b in opt.buckets for t in (b.master, *b.state.values())]
    return kept, graphs


@pytest.mark.parametrize("how", list(WRITES))
def test_a_compiled_step_keeps_what_the_loop_wrote_to_the_weights_and_state(how):
    # torch.optim steps from the weights and state as the loop left them. A compiled step cannot look at the
    # parameters (it skips sync_from_model), and until session 24 it overwrote written weights from the fp32
    # masters, silently: a checkpoint loaded after the optimizer was built never reached training. Now the end of
    # each backward looks (sync_from_model's cheap looks, acting on none), a .data read or assignment and an edit
    # of opt.state's entries say so at once, and such a step runs eagerly, following the writes
    _assert_the_same_with_steps_traced(_run_with_write(*WRITES[how], False)[0], *_run_with_write(*WRITES[how], True),
                                       how)


#: what the loop does between a compiled clip and the step (weight clipping, an LR finder's reset), and whether a
#: compiled step follows it by itself (an opt.state edit makes the step eager; a weight written in place between
#: the backward and a compiled step needs opt.sync_from_model(), README: so that one runs with an eager step only)
AFTER_CLIP = {
    "in-place clamp of a weight": (_clamp, False),
    "opt.state[p] cleared": (lambda model, opt: opt.state[model.fc1.weight].clear(), True),
    "opt.state entry replaced": (_state_replaced, True),
}


def _clip_write_step_run(write, compiled: bool, compiled_step: bool):
    """(parameters, masters, moments and step counts after three steps, the graphs traced), with ``write(model,
    opt)`` done between the second step's clip and its step."""
    torch._dynamo.reset()
    model = make_model(0)
    opt = FACTORIES["adamw"](model)
    graphs, capture = _recording_backend()
    clip = torch.compile(opt.clip_grad_norm_, backend=capture) if compiled else opt.clip_grad_norm_
    step = torch.compile(opt.step, backend=capture) if compiled and compiled_step else opt.step
    for k in range(3):
        (loss_fn(model, batch(0, k, 0)) + 0 * model.unused.sum()).backward()
        clip(0.5)
        if k == 1:
            write(model, opt)
        step()
        opt.zero_grad()
    kept = [p.detach().clone() for p in model.parameters()]
    kept += [t.clone() for b in opt.buckets for t in (b.master, *b.state.values())]
    kept += [torch.tensor([float(entry["step"]) for entry in opt.state_dict()["state"].values()])]
    return kept, graphs


@pytest.mark.parametrize("how", list(AFTER_CLIP))
def test_what_the_loop_writes_between_a_compiled_clip_and_the_step_reaches_the_step(how):
    # A clip traced by torch.compile cannot look at the model (dynamo would wrap the parameters), so the step after
    # it must: sync_from_model, as after an eager clip. Until session 36 the step took the traced reduction back
    # without it, so it updated from the masters as they were (a weight written since overwritten, silently) and
    # followed an opt.state edit only after the update, at the next look (a cleared entry zeroed the moments just
    # computed and set every count back; found by tests.optim.loop_fuzz_long's CompiledTrainingLoop)
    write, compiled_step = AFTER_CLIP[how]
    eager, _ = _clip_write_step_run(write, False, compiled_step)
    compiled, graphs = _clip_write_step_run(write, True, compiled_step)
    targets = {str(n.target) for gm in graphs for n in gm.graph.nodes if n.op == "call_function"}
    assert any("sum_sq_partials" in t for t in targets), f"{how}: no clip was traced: {sorted(targets)}"
    if compiled_step:
        _assert_the_same_with_steps_traced(eager, compiled, graphs, how)
    else:
        for i, (a, b) in enumerate(zip(eager, compiled)):
            assert torch.equal(a, b), f"{how}: tensor {i}: after a compiled clip != after an eager one"


@pytest.mark.parametrize("then", ["read at once", "zero_grad() first", "opt.state.clear(), a step"])
def test_opt_state_after_a_first_compiled_step_is_shown_as_after_an_eager_one(then):
    # a traced step cannot fill opt.state (dynamo would wrap the parameters) and the first step is what shows it;
    # until session 24 opt.state[p] read right after a first compiled step was an empty dict, and stayed empty
    # after opt.zero_grad() (which cleared the step's unfinished work without showing it); and an
    # opt.state.clear() there (an LR finder's reset) was lost when the state was shown (found by the compiled loop
    # fuzzer): the next step counted 2, where torch.optim starts afresh
    shown = []
    for compiled, model, opt in _eager_then_compiled("adamw"):
        step = torch.compile(opt.step, fullgraph=True, backend="eager") if compiled else opt.step
        (loss_fn(model, batch(0, 0, 0)) + 0 * model.unused.sum()).backward()
        step()
        if then == "zero_grad() first":
            opt.zero_grad()
        if then == "opt.state.clear(), a step":
            opt.state.clear()
            opt.zero_grad()
            (loss_fn(model, batch(0, 1, 0)) + 0 * model.unused.sum()).backward()
            opt.step()  # (eagerly: after a state edit a compiled one runs eagerly, which fullgraph=True refuses)
        entry = opt.state[model.fc1.weight]
        shown.append((sorted(entry), entry["exp_avg"].clone(), float(entry["step"]), len(opt.state)))
    (keys, exp_avg, count, n), (ckeys, cexp_avg, ccount, cn) = shown
    assert keys == ckeys and count == ccount == 1.0 and n == cn
    assert torch.equal(exp_avg, cexp_avg) and exp_avg.abs().sum() > 0


def _compiled_loop_run(how, compiled: bool):
    """The parameters after three steps, ``how`` compiled: "step + zero_grad" (one function), or "the whole
    iteration" (forward, backward, step, zero_grad: dynamo breaks the graph at backward())."""
    torch._dynamo.reset()
    model = make_model(0)
    opt = FACTORIES["adamw"](model)

    def step_and_zero():
        opt.step()
        opt.zero_grad()

    def iteration(x):
        (loss_fn(model, x) + 0 * model.unused.sum()).backward()
        step_and_zero()

    call = torch.compile(iteration if how == "the whole iteration" else step_and_zero, backend="eager")
    for k in range(3):
        if how == "the whole iteration":
            (call if compiled else iteration)(batch(0, k, 0))
        else:
            (loss_fn(model, batch(0, k, 0)) + 0 * model.unused.sum()).backward()
            (call if compiled else step_and_zero)()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("how", ["step + zero_grad", "the whole iteration"])
def test_zero_grad_compiled_with_the_step_runs_eagerly(how):
    # opt.zero_grad() looks at each param.grad, tritonshard's placeholders, which dynamo cannot wrap: compiled with
    # the step it raised an InternalTorchDynamoError, and the whole iteration compiled (the graph broken at
    # backward()) gave other weights than eager, silently, until session 24. Now it runs eagerly (a graph break)
    eager, compiled = _compiled_loop_run(how, False), _compiled_loop_run(how, True)
    for a, b in zip(eager, compiled):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16)), f"{how}: compiled != eager"
    torch._dynamo.reset()
    model = make_model(0)
    opt = FACTORIES["adamw"](model)
    with pytest.raises(torch._dynamo.exc.Unsupported, match="opt.zero_grad.. runs eagerly under torch.compile"):
        torch.compile(opt.zero_grad, fullgraph=True, backend="eager")()


def _whole_iteration_run(how, compiled: bool, attach: bool, zero="model", scheduler=False):
    """The parameters after three iterations (forward, backward, ``how``, step, ``zero``.zero_grad()), the whole
    iteration compiled or not; ``scheduler``: an LR scheduler built on the optimizer (which wraps its step())."""
    torch._dynamo.reset()
    model = make_model(0)
    opt = FACTORIES["adamw"](model)
    if scheduler:
        torch.optim.lr_scheduler.StepLR(opt, 1, gamma=1.0)
    if attach:
        opt.attach(model)

    def iteration(x):
        (loss_fn(model, x) + 0 * model.unused.sum()).backward()
        if how == "torch's clip":
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        if how == "opt.clip_grad_norm_":
            opt.clip_grad_norm_(0.05)
        opt.step()
        (model if zero == "model" else opt).zero_grad()

    call = torch.compile(iteration, backend="eager") if compiled else iteration
    for k in range(3):
        call(batch(0, k, 0))
    return [p.detach().clone() for p in model.parameters()]


def test_the_whole_iteration_compiled_gives_the_eager_weights_or_a_clear_error():
    # a compiled function that runs the backward too: dynamo breaks its graph at backward() and compiles each call
    # after it as a graph of its own, with its frame callback still on during the eager backward, so on the CPU it
    # compiled tritonshard's gradient hooks too, which took the paths of a traced step: until session 24 the
    # weights differed from eager, silently (with model.zero_grad() and with torch's clip). The hooks now run
    # eagerly; what dynamo then cannot trace is a clear error
    for how in ("no clip", "opt.clip_grad_norm_"):  # (an attached model's zero_grad() runs eagerly)
        eager, compiled = (_whole_iteration_run(how, c, attach=True) for c in (False, True))
        for a, b in zip(eager, compiled):
            assert torch.equal(a.view(torch.int16), b.view(torch.int16)), f"{how}: whole iteration compiled != eager"
    for how, attach in (("no clip", False), ("torch's clip", True)):
        with pytest.raises(torch._dynamo.exc.InternalTorchDynamoError, match="torch.compile is tracing code that "
                                                                             "reads param.grad"):
            _whole_iteration_run(how, True, attach)
    # (an LR scheduler wraps step(): dynamo then compiles the clip and the step as graphs of their own; the
    # clip's results reach the step all the same, see test_a_clip_compiled_in_a_graph_without_its_step_...)
    eager, compiled = (_whole_iteration_run("opt.clip_grad_norm_", c, attach=True, scheduler=True)
                       for c in (False, True))
    for a, b in zip(eager, compiled):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16)), "with a scheduler: compiled != eager"


def test_dynamo_may_set_attributes_on_a_sharded_optimizer_it_wraps():
    """torch 2.11 (the GPU machine's) builds dynamo's OptimizerVariable without a mutation type: the first attribute
    a traced step set failed dynamo's assertion (pytorch/pytorch#171590), so every compiled step and clip failed
    there (the suite under torch 2.11 + Triton 3.6, session 48: 30 tests). The variable built as 2.11's builder
    builds it (no mutation type) gets the type 2.12 and later pass, for tritonshard's optimizers only; torch's own are
    left as that torch builds them."""
    from torch._dynamo.source import LocalSource
    from torch._dynamo.variables.base import AttributeMutationExisting
    from torch._dynamo.variables.optimizer import OptimizerVariable
    ours = FACTORIES["adamw"](make_model(0))
    assert isinstance(OptimizerVariable(ours, source=LocalSource("opt")).mutation_type, AttributeMutationExisting)
    assert OptimizerVariable(ours).mutation_type is None  # (sourceless: built inside the traced code, not ours to say)
    theirs = torch.optim.SGD(make_model(0).parameters(), lr=0.1)
    assert OptimizerVariable(theirs, source=LocalSource("opt")).mutation_type is None


def test_a_placeholder_read_while_dynamo_wraps_it_names_torch_compile():
    """A placeholder gradient read by dynamo's own work around the traced code (wrapping the parameters that
    ``model.zero_grad()`` of a model not attached walks, in a compiled function) says torch.compile is at work,
    with its fixes. torch 2.13 holds ``torch.compiler.is_compiling()`` True for the whole compilation, torch 2.11
    only inside the traced code, so there the message meant for eager code came (no word of torch.compile): here
    the compile context dynamo opens, without that flag, as on 2.11."""
    model = make_model(0)
    opt = FACTORIES["adamw"](model)
    (loss_fn(model, batch(0, 0, 0)) + 0 * model.unused.sum()).backward()
    grad = next(model.parameters()).grad
    with pytest.raises(RuntimeError, match="It supports the norms") as eager:
        grad.untyped_storage()
    assert "torch.compile" not in str(eager.value)
    with torch._guards.compile_context(torch._guards.CompileContext(None)):
        assert not torch.compiler.is_compiling()
        with pytest.raises(RuntimeError, match="torch.compile is tracing code that reads param.grad"):
            grad.untyped_storage()
    opt.step()


def _compiled_on_ranks(rank, world_size, overlap_comm):
    """The same two-rank loop eagerly, then with its clip + step compiled (torch's recipe, fullgraph=False): the
    same bits and norms; the head that gets a gradient on no rank is left unchanged, as torch.optim leaves it, and
    the one with a gradient on the last rank only trains (DDP's average). Then fullgraph=True: dynamo's error, on
    every rank, naming why; and a rank stepping with another lr: the step's handshake still runs (its
    SettingsMismatchError on every rank)."""
    from tests.optim.test_unused_params import HEADS, _assert_changed_only, _Heads, _state
    from tritonshard.comm import SettingsMismatchError
    runs = []
    for compiled in (False, True):
        torch._dynamo.reset()
        model = _Heads()
        opt = ShardedAdamW(model.parameters(), lr=1e-2, weight_decay=0.1, bucket_cap_mb=1e-9, overlap_comm=overlap_comm)

        def clip_and_step(opt=opt):
            norm = opt.clip_grad_norm_(0.5)
            opt.step()
            return norm

        step = torch.compile(clip_and_step, backend="eager") if compiled else clip_and_step
        norms = []
        for k, used in enumerate([HEADS, ("a", "b") if rank == world_size - 1 else ("a",), HEADS]):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * k + rank))
            model.loss(x, used).backward()
            before = _state(opt, model)
            norms.append(step())
            opt.zero_grad()
            if k == 1:  # (head "c": no gradient anywhere; "b": on the last rank only)
                _assert_changed_only(before, _state(opt, model), {"a", "b"}, f"compiled={compiled}, rank {rank}")
        runs.append((torch.stack(norms), _state(opt, model)))
    (norms, state), (compiled_norms, compiled_state) = runs
    assert torch.equal(norms, compiled_norms)
    for key, value in state.items():
        assert torch.equal(value.view(torch.int32 if value.dtype == torch.float32 else torch.int16),
                           compiled_state[key].view(torch.int32 if value.dtype == torch.float32 else torch.int16)), key

    model.loss(torch.randn(4, 8), HEADS).backward()
    torch._dynamo.reset()  # (dynamo caches per code object: step()'s frame, compiled above with fullgraph=False)
    with pytest.raises(torch._dynamo.exc.Unsupported, match="on more than one rank an optimizer step"):
        torch.compile(opt.step, fullgraph=True, backend="eager")()
    opt.param_groups[0]["lr"] = 1e-2 * (1 + rank)  # (a scheduler stepped on one rank only)
    with pytest.raises(SettingsMismatchError, match="rank 0: param_groups.0.: lr=0.01.*rank 1: param_groups.0.: lr=0.02"):
        torch.compile(opt.step, backend="eager")()


@pytest.mark.parametrize("overlap_comm", [False, True], ids=["no overlap", "overlap_comm"])
def test_a_compiled_step_on_two_ranks_is_the_eager_step(overlap_comm):
    # torch.compile(opt.step) on more than one rank: until session 24 it raised dynamo's InternalTorchDynamoError
    # (UnsafeScriptObjectError on the ProcessGroup's collectives, torch 2.13) even with fullgraph=False, and the
    # README said its handshakes were skipped there (a parameter without a gradient anywhere updated with zeros,
    # the ranks' hyper-parameters not compared); it had no test. Now it runs eagerly, with every handshake
    from tests.distributed import run_on_ranks
    run_on_ranks(_compiled_on_ranks, 2, overlap_comm)


def _patched_step_run(how, compiled: bool):
    """The parameters after four steps of a loop whose ``opt.step`` was replaced by its compiled self (so that
    GradScaler.step(opt) calls it too), ``how``: under torch.amp.GradScaler (unscale_, the optimizer's clip),
    with a per-group LambdaLR built before the replacement, or with two micro-batches a step."""
    torch._dynamo.reset()
    model = make_model(0)
    opt = FACTORIES["adamw"](model)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 4) if how == "GradScaler" else None
    sched = (torch.optim.lr_scheduler.LambdaLR(opt, [lambda s: 1.0 / (1 + s), lambda s: 0.9 ** s])
             if how == "LambdaLR" else None)
    if compiled:
        opt.step = torch.compile(opt.step, backend="eager")
    for k in range(4):
        for micro in range(2 if how == "accumulation" else 1):
            loss = loss_fn(model, batch(0, k, micro)) + 0 * model.unused.sum()
            (scaler.scale(loss) if scaler else loss).backward()
        if scaler:
            scaler.unscale_(opt)
            opt.clip_grad_norm_(0.5)
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        if sched:
            sched.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("how", ["GradScaler", "LambdaLR", "accumulation"])
def test_a_step_replaced_by_its_compiled_self_gives_the_eager_weights(how):
    # opt.step = torch.compile(opt.step): code that calls opt.step() itself (GradScaler.step, a trainer) runs the
    # compiled step; a scheduler built before wraps the original (dynamo compiles our step as a frame of its own)
    for a, b in zip(_patched_step_run(how, False), _patched_step_run(how, True)):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16)), f"{how}: compiled != eager"


def test_a_compiled_sgd_step_counts_only_the_steps_with_momentum_as_an_eager_one():
    """ShardedSGD counts the steps with momentum (its first one makes the buffer from the gradient, as
    torch.optim.SGD's; tests/optim/test_sgd_lion_distributed.py); a compiled step, which counts through other code
    than an eager one (param_steps._count_steps, not the step-flags launch), must count the same: group 1 without
    momentum for two steps, then with it, dampening 0.5 (a first step counted as a later one is off by half the
    gradient's share); the same bits as eager steps, and the same counts."""
    results = []
    for compiled in (False, True):
        torch._dynamo.reset()
        model = make_model(0)
        groups = param_groups(model)
        groups[1]["momentum"] = 0.0
        opt = ShardedSGD(groups, lr=0.05, momentum=0.9, dampening=0.5)
        step = torch.compile(opt.step, backend="eager") if compiled else opt.step
        for k in range(4):
            if k == 2:
                opt.param_groups[1]["momentum"] = 0.9
            (loss_fn(model, batch(0, k, 0)) + 0 * model.unused.sum()).backward()
            step()
            opt.zero_grad()
        state = opt.state_dict()["state"]
        counts = {i: float(e["step"]) for i, e in state.items()}
        assert counts == {i: 4.0 if i < 3 else 2.0 for i in range(7)}, f"compiled={compiled}: {counts}"
        results.append([b.param_buffer.get_data().clone() for b in opt.buckets])
    for a, b in zip(*results):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16)), "compiled step != eager step"
