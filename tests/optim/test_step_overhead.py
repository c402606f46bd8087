"""Host overhead of a steady-state step, counted (not timed): a regression guard for issue 14's item 5.

The CPU profiler records every aten op the optimizer issues. Ops inside a kernel launcher's range
(``tritonshard.kernel.*``, see kernels/_dispatch.traced) are the kernels' own work (on a CPU: the interpreter's or
the reference's tensor ops; on a GPU: one launch) and are left out; what remains is the optimizer's small torch
ops (clip coefficient, grad_scale, step counters, AdamW's float64 coefficients), which on a GPU are each a tiny
kernel launch plus host time. Those must not grow with the number of buckets (a 1B model has ~100 buckets).
"""

import collections
import contextlib

import pytest
import torch
from torch import nn

from tests.helpers import launcher_counts
import tritonshard
from tritonshard.optim.model_sync import ShardedGrad


def _profile_step(n_layers: int, n_groups: int = 1, **options):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(n_layers)])
    params = list(model.parameters())
    groups = [{"params": params[g::n_groups], "lr": 1e-3 * (g + 1)} for g in range(n_groups)]
    opt = tritonshard.ShardedAdamW(groups, lr=1e-3, bucket_cap_mb=1e-9, **options)  # a bucket per parameter
    x = torch.randn(4, 16).bfloat16()

    def backward():
        model(x).float().square().mean().backward()

    for _ in range(2):  # warm: caches filled, state exposed, launch order adopted
        backward()
        opt.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof_backward:
        backward()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof_step:
        opt.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
    return len(opt.buckets), _small_ops(prof_step), launcher_counts(prof_step) + launcher_counts(prof_backward)


def _inside_launcher(event) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith("tritonshard.kernel."):
            return True
        parent = parent.cpu_parent
    return False


def _small_ops(prof) -> collections.Counter:
    """Outermost aten ops issued outside the kernel launchers."""
    return collections.Counter(
        e.name for e in prof.events()
        if e.name.startswith("aten::") and not _inside_launcher(e)
        and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")))



@pytest.mark.parametrize("options", [{}, {"state_dtype": torch.bfloat16}, {"overlap_comm": True}, "machinery"],
                         ids=["default", "bf16 states", "overlap_comm on one rank", "overlap_comm on many ranks"])
def test_small_ops_per_step_do_not_grow_with_buckets(options):
    # (bf16 states: each bucket's stochastic-rounding seed advances every step, all of them in one op)
    from tests.helpers import overlap_machinery
    machinery = options == "machinery"  # (many ranks' per-bucket machinery, in this one process)
    options = {"overlap_comm": True} if machinery else options
    with overlap_machinery(machinery):
        few, ops_few, _ = _profile_step(2, **options)
        many, ops_many, _ = _profile_step(6, **options)
    assert (few, many) == (4, 12)
    assert ops_many == ops_few, f"per-bucket small ops: {ops_many - ops_few} more with {many - few} more buckets"
    # measured 4 here (torch 2.13; 31 until session 31, 22 until session 34, when one rank's finalize began to write
    # the fp32 sum and flag itself, grad_scale, the flags and the step counters went into one launch and the clip's
    # coefficient into another, kernels/scalars.py; 6 until session 36, when the lr became a kernel argument and the
    # clip's norm stopped being copied): the clip's norm (torch's sqrt), and AdamW's step in float64 and the two
    # powers of its bias corrections, which only the interpreter needs (compiled, the kernels compute the sqrt and
    # the powers: no op left); a bound with some room, so a new per-step op is a decision, not an accident
    assert sum(ops_few.values()) <= 6, ops_few


def test_zero_grad_to_zeros_fills_every_empty_grad_buffer_in_one_op():
    """zero_grad(set_to_none=False) after a step: every grad buffer without gradients zero-filled in one
    multi-tensor launch (one fill per bucket until session 36: 9 launches at the 125M layout), then each parameter
    that had a gradient holds its placeholder, standing for zeros (the bits: the loop fuzzers' zero_grad rule)."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(4)])
    opt = tritonshard.ShardedAdamW(model.parameters(), lr=1e-3, bucket_cap_mb=1e-9)
    x = torch.randn(4, 16).bfloat16()
    for _ in range(2):
        model(x).float().square().mean().backward()
        opt.step()
        opt.zero_grad()
    model(x).float().square().mean().backward()
    opt.step()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        opt.zero_grad(set_to_none=False)
    ops = _small_ops(prof)
    assert len(opt.buckets) == 8 and ops == {"aten::_foreach_zero_": 1}, ops
    assert all(isinstance(p.grad, ShardedGrad) for p in model.parameters())
    assert all(b.grad_buffer.get_data().count_nonzero() == 0 for b in opt.buckets)


def test_coefficients_are_computed_once_per_param_group():
    _, one_group, _ = _profile_step(4, n_groups=1)
    _, two_groups, _ = _profile_step(4, n_groups=2)
    extra = sum(two_groups.values()) - sum(one_group.values())
    # a second group adds its coefficients' inputs under the interpreter (the step in float64, the two powers:
    # measured 3; 14 until session 31, when the rest of the coefficients went into one kernel launch, 5 until session
    # 34, when the step counters' increments went into the launch of the step's scalars, 4 until session 36, when
    # the lr became a kernel argument; compiled, none), not per-bucket work (the first group's 4 buckets here would
    # add 4 x that)
    assert 0 < extra <= 4, (extra, two_groups - one_group)


@pytest.mark.parametrize("groups", [1, 2])
def test_launches_per_bucket_and_per_group(groups):
    buckets, _, launchers = _profile_step(3, n_groups=groups)
    # per step, whatever the number of buckets (issue 20.3): one flatten for every bucket at the end of backward,
    # one read-only norm pass over every grad shard (per-program partials into each bucket's slice of one
    # workspace), one finalize of the norm; per param group, one segmented update over all its buckets' shards
    # (without overlap_comm)
    assert buckets == 6
    # and per param group, one launch for its coefficients (kernels.adamw.adamw_coefficients_launch); per step one
    # for the clip's coefficient and one for the step's scalars (the flag, the counters of every group, grad_scale:
    # kernels.scalars, session 34)
    assert launchers == {"flatten_into": 1, "sum_sq_partials_": 1, "adamw_step_": groups,
                         "adamw_coefficients_kernel": groups, "finalize_sum_sq_": 1, "clip_coefficient_kernel": 1,
                         "step_flags_kernel": 1}, launchers


@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.usefixtures("with_overlap_machinery")  # (one process: the machinery of many ranks)
def test_with_overlap_each_group_is_one_update_and_each_bucket_one_gather_in_forward_order(groups):
    # overlap_comm keeps per bucket only what the overlap needs: the all-gathers, in the order the next forward
    # reads the buckets; the updates are one segmented launch per param group, as without it (issue 20.3), all of
    # them launched before the first gather (the forward's kernels queue behind the updates on the stream anyway)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(3)])
    params = list(model.parameters())
    opt = tritonshard.ShardedAdamW([{"params": params[g::groups]} for g in range(groups)], lr=1e-3,
                                   bucket_cap_mb=1e-9, overlap_comm=True)
    opt.attach(model)  # the gather order: the forward's
    x = torch.randn(4, 16)
    for _ in range(3):
        model(x).float().square().mean().backward()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            opt.step()
        opt.zero_grad()
    events = sorted(prof.events(), key=lambda e: e.time_range.start)
    updates = [e for e in events if e.name == "tritonshard.kernel.adamw_step_"]
    gathers = [e for e in events if e.name.startswith("tritonshard.all_gather[")]
    assert len(updates) == groups
    # a bucket per parameter: the forward reads them in model.parameters() order
    forward_order = [opt._bucket_of[p][0].index for p in params]
    assert len(opt.buckets) == 6 and sorted(forward_order) == list(range(6))
    assert [e.name for e in gathers] == [f"tritonshard.all_gather[bucket {i}]" for i in forward_order]
    assert max(e.time_range.end for e in updates) <= gathers[0].time_range.start


def test_preallocated_norm_table_sums_every_bucket():
    # each bucket writes its own row of the table (a bug that let them share one row clipped with the last
    # bucket's norm only, and passed every count above)
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(n)) for n in (7, 130, 1, 4099, 64)]
    opt = tritonshard.ShardedAdamW(params, lr=1e-3, bucket_cap_mb=1e-9)
    assert len(opt.buckets) == len(params)
    grads = [torch.randn(p.shape, generator=torch.Generator().manual_seed(i)).bfloat16() for i, p in enumerate(params)]
    for p, g in zip(params, grads):
        p.grad = g
    norm = opt.clip_grad_norm_(1e9)
    expected = torch.linalg.vector_norm(torch.cat([g.float() for g in grads]))
    assert float(norm) == pytest.approx(float(expected), rel=1e-6)  # fp32 sums in another order


class _CountOps(torch.utils._python_dispatch.TorchDispatchMode):
    """Every aten op dispatched while active (ops the placeholders answer in __torch_function__ never get here)."""

    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


def _torch_clip_ops(layers: int, norm_type: float):
    """torch's clip_grad_norm_ over the placeholders of a ShardedAdamW over ``layers`` Linear(8, 8) in one bucket
    (the reduction's own ops, its kernels' under the interpreter, are a constant; what grows is per parameter):
    (the aten ops of the second iteration's clip, its parameters, the clip's norm, the fp32 control's)."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(layers)])
    opt = tritonshard.ShardedAdamW(model.parameters(), lr=1e-3)
    x = torch.randn(4, 8)
    for _ in range(2):
        weights = [p.detach().clone() for p in model.parameters()]  # (the counted iteration's, for the control)
        model(x.bfloat16()).float().square().mean().backward()
        counter = _CountOps()
        with counter:
            total = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9, norm_type=norm_type)  # (clips nothing)
        opt.step()
        opt.zero_grad()
    assert len(opt.buckets) == 1
    # the control: the same bf16 weights and input in plain torch, whose bf16 gradients the reduced grad buffer
    # holds exactly at one rank; their norm in fp32 here, in fp64 there: within 1e-5 relative
    plain = nn.Sequential(*[nn.Linear(8, 8) for _ in range(layers)]).bfloat16()
    for p, w in zip(plain.parameters(), weights):
        p.data.copy_(w)
    plain(x.bfloat16()).float().square().mean().backward()
    norms = torch.stack([torch.linalg.vector_norm(p.grad.float(), norm_type) for p in plain.parameters()])
    return counter.ops, len(weights), total, torch.linalg.vector_norm(norms, norm_type)


@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf")])
def test_torchs_clip_over_the_placeholders_costs_one_torch_op_per_parameter(norm_type):
    """torch.nn.utils.clip_grad_norm_ on param.grad (accelerate's and the HF Trainer's clip): each parameter's norm
    from the reduced shards. Until session 30 that cost ~6 torch ops per parameter (an fp64 copy of each piece, abs,
    square, sum, then an index per parameter): 1820 for a 292-parameter model, 9.3 ms of host time on the CPU
    here and more on a GPU, where each is a launch. Then one fp64-accumulating norm per piece (over a view made
    once), one unbind for all parameters; since session 37 for the 2-norm (the clip's default) none per piece
    where the Triton kernels run: two launches for all pieces (the norm pass's kernel over them, then a sum per
    piece), so no torch op per parameter at all, but torch's own norm of the norms: the same ops for a model of
    20 parameters as for one of 60. The norm itself is checked against the fp32 reference gradients."""
    ops, params, total, expected = _torch_clip_ops(30, norm_type)
    assert torch.allclose(total.float(), expected, rtol=1e-5), (total, expected)
    per_param = {op: n for op, n in ops.items() if n >= params}
    if norm_type == 2.0:
        assert per_param == {}, per_param
        assert ops["aten.linalg_vector_norm.default"] == 1, ops  # (torch's, of the norms)
        fewer, _, total, expected = _torch_clip_ops(10, norm_type)
        assert torch.allclose(total.float(), expected, rtol=1e-5), (total, expected)
        assert fewer == ops, "the ops of torch's clip depend on the number of parameters"
    else:  # (1-norm, inf-norm: a torch norm per piece, one more of the norms, and the reduction's ~60 ops)
        assert per_param == {"aten.linalg_vector_norm.default": params + 1}, per_param
        assert sum(ops.values()) <= params + 80, ops


@contextlib.contextmanager
def _counted_hashes():
    """Inside, Tensor.__hash__ calls are counted into the yielded one-element list (Parameter and its subclasses
    inherit it: hash() looks it up on the class)."""
    calls, tensor_hash = [0], torch.Tensor.__hash__

    def counting(self):
        calls[0] += 1
        return tensor_hash(self)
    torch.Tensor.__hash__ = counting
    try:
        yield calls
    finally:
        torch.Tensor.__hash__ = tensor_hash


def _hashes_per_iteration(n_params: int, overlap_comm: bool, machinery: bool = False) -> int:
    """Tensor.__hash__ calls in one steady iteration (two micro-batches, the first in no_sync(), then clip, step and
    zero_grad) of a ShardedAdamW over ``n_params`` parameters in one bucket."""
    torch.manual_seed(0)
    from tests.helpers import overlap_machinery
    params = [nn.Parameter(torch.randn(8)) for _ in range(n_params)]
    with overlap_machinery(machinery):
        opt = tritonshard.ShardedAdamW(params, lr=1e-3, overlap_comm=overlap_comm)
    x = torch.randn(8).bfloat16()

    def iteration():
        with opt.no_sync():
            torch.stack([(p * x).sum() for p in params]).sum().backward()
        torch.stack([(p * x).sum() for p in params]).sum().backward()
        opt.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()

    for _ in range(2):
        iteration()
    with _counted_hashes() as calls:
        iteration()
    return calls[0]


@pytest.mark.parametrize("overlap_comm, machinery", [(False, False), (True, False), (True, True)],
                         ids=["", "overlap_comm on one rank", "overlap_comm on many ranks"])
def test_an_iteration_hashes_each_parameter_at_most_once(overlap_comm, machinery):
    """Per parameter and iteration, the flush, the step and zero_grad walk each bucket's lists beside its parameters
    (placeholders, markers, a prebuilt placed dict) instead of looking each parameter up in dicts keyed by it:
    Tensor.__hash__ is a Python method (~0.15 us). What is left per parameter: the second micro-batch's backward
    takes its placeholder out of its bucket's placed dict (its placeholder and bucket by index). Until session 31:
    12 per parameter without overlap_comm, 16 with it."""
    small, large = (_hashes_per_iteration(8, overlap_comm, machinery),
                    _hashes_per_iteration(40, overlap_comm, machinery))
    per_param = (large - small) / 32
    assert per_param <= 1, (small, large, per_param)


def _hashes_of_torchs_clip_and_step(n_params: int, scaler: bool) -> tuple[int, tuple, int]:
    """Tensor.__hash__ calls in torch's foreach clip (its default on CUDA; after GradScaler's unscale_ with
    ``scaler``) and the step after it, the coefficients the optimizer noted for every held gradient, and the torch
    ops of the clip."""
    params, opt, loss = _three_buckets(n_params)
    amp = torch.amp.GradScaler("cpu", init_scale=4.0) if scaler else None
    for _ in range(3):
        (amp.scale(loss()) if scaler else loss()).backward()
        with _counted_hashes() as calls:
            if scaler:
                amp.unscale_(opt)
            counter = _CountOps()
            with counter:
                torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
            noted = (len(opt._grad_multipliers), len(opt._all_multipliers))
            if scaler:
                amp.step(opt)
                amp.update()
            else:
                opt.step()
        opt.zero_grad()
    return calls[0], noted, sum(counter.ops.values())


def _three_buckets(n_params: int) -> tuple:
    """``n_params`` parameters of 8 in three buckets, their ShardedAdamW, and a loss over all of them."""
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(8)) for _ in range(n_params)]
    opt = tritonshard.ShardedAdamW(params, lr=1e-3, bucket_cap_mb=n_params * 8 * 2 / 3 / 2 ** 20)
    x = torch.randn(8).bfloat16()
    return params, opt, lambda: torch.stack([(p * x).sum() for p in params]).sum()


@pytest.mark.parametrize("scaler", [False, True], ids=["", "after GradScaler's unscale_"])
def test_torchs_foreach_clip_and_the_step_look_up_no_parameter(scaler):
    """torch's clip_grad_norm_ over param.grad with foreach (HF Trainer's and accelerate's on CUDA) multiplies every
    gradient the optimizer holds by one coefficient (GradScaler's unscale_ too): noted once for all, not once per
    parameter, and the step takes their product without comparing each parameter's list. Until session 39 the
    fold noted it per parameter (a Tensor.__hash__, a list) and the step compared every parameter's coefficients:
    ~0.4 ms of host time per step at 292 parameters on this CPU (the step after torch's clip 0.79-0.86 ms against
    0.49-0.51 since, side by side), before the update's launch; and after unscale_, the clip's per-parameter norms
    were each multiplied by the scaler's coefficient (a torch op per parameter, a launch each on a GPU), now the
    vector of them once."""
    few, noted, ops = _hashes_of_torchs_clip_and_step(8, scaler)
    many, noted_many, ops_many = _hashes_of_torchs_clip_and_step(40, scaler)
    assert noted == noted_many == (0, 1 + scaler), (noted, noted_many)
    assert many == few, (few, many)
    assert ops == ops_many, (ops, ops_many)


def _hashes_of_the_step_after(how: str, n_params: int) -> int:
    """Tensor.__hash__ calls in step() after torch code multiplied each gradient on its own: ``"clip"`` torch's
    clip without foreach (a mul_ per gradient by its one coefficient tensor), ``"divide"`` ``p.grad /= 4`` per
    parameter (a reciprocal per parameter: equal numbers, other objects)."""
    params, opt, loss = _three_buckets(n_params)
    for _ in range(3):
        loss().backward()
        if how == "clip":
            torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=False)
        else:
            for p in params:
                p.grad /= 4
        with _counted_hashes() as calls:
            opt.step()
        opt.zero_grad()
    return calls[0]


@pytest.mark.parametrize("how", ["clip", "divide"])
def test_the_step_after_a_multiply_per_gradient_looks_up_no_parameter(how):
    """torch's clip without foreach (its CPU default) and ``p.grad /= n`` in a loop note a coefficient per
    parameter; the step finds them all the same in C-level passes over the lists instead of a tuple key per
    parameter: 0.75-0.83 -> 0.54-0.60 ms of host time for the step after either at 292 parameters on this CPU
    (dry-run driver, side by side; 0.51-0.56 without a multiply)."""
    assert _hashes_of_the_step_after(how, 8) == _hashes_of_the_step_after(how, 40)


def test_without_overlap_comm_each_parameter_has_one_optimizer_hook():
    """Without overlap_comm the AccumulateGrad pre-hook also notes the gradient's arrival, so no post-accumulate
    hook is registered (one C++ -> Python call per parameter and backward less); with it, where there is something
    to overlap (many ranks; here their machinery in one process), the post-accumulate hook flushes a bucket once
    its last gradient is accumulated. On one rank overlap_comm has nothing to overlap: one hook (session 33)."""
    from tests.helpers import overlap_machinery
    for overlap_comm, machinery, want in ((False, False, 0), (True, False, 0), (True, True, 1)):
        params = [nn.Parameter(torch.randn(4)) for _ in range(3)]
        with overlap_machinery(machinery):
            opt = tritonshard.ShardedAdamW(params, lr=1e-3, overlap_comm=overlap_comm)
        assert [len(p._post_accumulate_grad_hooks or {}) for p in params] == [want] * 3, (overlap_comm, machinery)
        del opt


@pytest.mark.usefixtures("with_overlap_machinery")  # (one process: the machinery of many ranks)
def test_with_overlap_buckets_that_launch_nothing_are_flushed_four_at_a_time():
    """overlap_comm flushes a bucket from the backward hooks as soon as it is complete, so that its reduce-scatter
    can start. Where none starts (inside no_sync()) each flush of its own only cost host time (~45 us per bucket on
    the GPU path, session 32): completed buckets are flushed FLUSH_TOGETHER at a time, in one flatten launch, the
    rest at the end of the backward, so that at most FLUSH_TOGETHER - 1 buckets' gradients wait alive (flushing
    only at the end would keep every one). The last backward flushes each bucket as it completes, for its
    reduce-scatter (one rank runs this machinery in tests only, as many ranks do: until session 40 it flushed
    four at a time there too, where one rank ran the machinery for real before session 33)."""
    from tritonshard.optim.backward import FLUSH_TOGETHER
    from tritonshard.optim.model_sync import ShardedGrad
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(16, 16, bias=False) for _ in range(9)])
    opt = tritonshard.ShardedAdamW(model.parameters(), lr=1e-3, bucket_cap_mb=1e-9, overlap_comm=True)
    assert len(opt.buckets) == 9 and FLUSH_TOGETHER == 4
    waiting = []  # after the optimizer's own hook (hooks run in the order they were registered)

    def count(_):
        waiting.append(sum(type(p.grad) is not ShardedGrad and p.grad is not None for p in model.parameters()))
    for p in model.parameters():  # (through torch's method, which the optimizer does not note: a hook of the loop's
        # would keep the bucket it completes for the end of the backward, so that the hook reads param.grad)
        torch.Tensor.register_post_accumulate_grad_hook(p, count)
    x = torch.randn(4, 16).bfloat16()

    def backward():
        model(x).float().square().mean().backward()

    for _ in range(2):  # warm
        with opt.no_sync():
            backward()
        backward()
        opt.step()
        opt.zero_grad()
    flushes = []
    waiting.clear()
    for sync in (opt.no_sync, contextlib.nullcontext):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof, sync():
            backward()
        flushes.append(launcher_counts(prof)["flatten_into"])
        if sync is opt.no_sync:
            assert max(waiting) == FLUSH_TOGETHER - 1, waiting
    # no_sync(): 4 + 4 in the hooks, 1 at the end (a launch per bucket was 9); the last backward: one per bucket
    assert flushes == [3, 9], flushes
    opt.step()


@pytest.mark.usefixtures("with_overlap_machinery")  # (one process: the machinery of many ranks)
def test_the_flush_groups_plans_stay_bounded_when_buckets_complete_in_changing_orders():
    # a static model brings back the same few groups of four every backward; one whose buckets complete in changing
    # orders (here a different subset of layers each backward, as experts routed anew each step) must not keep a
    # launch plan for every group it ever saw
    torch.manual_seed(0)
    layers = nn.ModuleList(nn.Linear(8, 8, bias=False) for _ in range(12))
    opt = tritonshard.ShardedAdamW(layers.parameters(), lr=1e-3, bucket_cap_mb=1e-9, overlap_comm=True)
    assert len(opt.buckets) == 12
    x = torch.randn(2, 8).bfloat16()
    gen = torch.Generator().manual_seed(1)
    seen = set()
    for _ in range(40):
        chosen = torch.randperm(12, generator=gen)[:9].tolist()
        with opt.no_sync():
            sum(layers[i](x).float().sum() for i in chosen).backward()
        seen.update(opt._group_launches)
        opt.zero_grad()
    assert len(seen) > 12, len(seen)  # (the orders did change)
    assert len(opt._group_launches) <= max(8, len(opt.buckets)), len(opt._group_launches)
