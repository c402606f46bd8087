"""ShardedAdamW in one process (world size 1, torch.distributed not initialized): API, semantics, errors."""

import pytest
import torch

from tests.optim.training import LR, Reference, loss_fn, make_model, param_groups, schedule, train_step
import tritonshard
from tritonshard import ShardedAdamW, ShardedSGD
from tritonshard.optim.model_sync import ShardedGrad


def test_single_process_without_torch_distributed_matches_reference():
    model = make_model(0)
    params = [p for g in param_groups(model) for p in g["params"]]
    opt = ShardedAdamW(param_groups(model), lr=LR)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    ref = Reference(1)
    for step in range(3):
        train_step(model, opt, sched, 0, step)
        ref.step(step)
    assert opt.param_groups[0]["lr"] == LR * schedule(3), "the scheduler drives the groups' lr"
    for p, want in zip(params, ref.bf16_weights()):
        # same arithmetic up to fp32 op order in AdamW (see test_adamw_distributed); bf16 weights: at most one
        # bf16 ulp apart where the master sits on a rounding boundary, i.e. 2^-7 relative
        assert torch.allclose(p.float(), want.float(), rtol=2 ** -7, atol=0)
    assert all(p.dtype == torch.bfloat16 for p in params)
    assert model.frozen.dtype == torch.float32


def test_parameters_alias_the_param_buffer_and_master_keeps_original_values():
    """Each parameter is its piece of the bucket's buffer (the same memory: a write to the buffer is in the
    parameter) with a storage of its own that covers exactly it (code that groups tensors by storage, as
    accelerate's and safetensors' saves do, sees each parameter as a tensor of its own)."""
    model = make_model(0)
    original = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = ShardedAdamW(model.parameters(), lr=LR)
    (bucket,) = opt.buckets
    data = bucket.param_buffer.get_data()
    for p, view in zip(bucket.params, bucket.param_buffer.get_views()):
        assert p.data_ptr() == view.data_ptr() and p.shape == view.shape
        assert p.untyped_storage().data_ptr() == p.data_ptr() and p.untyped_storage().nbytes() == p.nbytes
    kept = data.clone()
    with torch.no_grad():
        data.add_(1.0)
    for p, view in zip(bucket.params, bucket.param_buffer.get_views()):
        assert torch.equal(p.detach(), view), "a write to the buffer is in the parameter"
    with torch.no_grad():
        data.copy_(kept)
    by_id = {id(p): n for n, p in model.named_parameters()}
    for piece in bucket.param_buffer.shard_pieces():
        p = bucket.params[piece.tensor_index]
        want = original[by_id[id(p)]].reshape(-1)[piece.tensor_start:piece.tensor_end]
        got = bucket.master[piece.shard_start:piece.shard_end]
        assert torch.equal(got, want), "the master is the fp32 original, not the bf16-rounded copy"
        assert torch.equal(p.detach().reshape(-1)[piece.tensor_start:piece.tensor_end], want.to(torch.bfloat16))
    assert not any(p is model.frozen for p in bucket.params)


def test_manually_set_grads_are_used_and_match_torch_adamw():
    model = make_model(1)
    ref = make_model(1)
    ref_params = [p for p in ref.parameters() if p.requires_grad]
    opt = ShardedAdamW(model.parameters(), lr=1e-2, weight_decay=0.05)
    ref_opt = torch.optim.AdamW(ref_params, lr=1e-2, weight_decay=0.05, foreach=False)
    trainable = [p for p in model.parameters() if p.requires_grad]
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        grads = [torch.randn(p.shape, generator=g).to(torch.bfloat16) for p in trainable]
        for p, q, gr in zip(trainable, ref_params, grads):
            p.grad, q.grad = gr, gr.float()
        opt.step()
        ref_opt.step()
        opt.zero_grad()
    for p, q in zip(trainable, ref_params):
        # fp32 AdamW op-order differences only (a few ulps), then the same rounding to bf16: <= 1 bf16 ulp
        assert torch.allclose(p.float(), q.detach().to(torch.bfloat16).float(), rtol=2 ** -7, atol=0)


def test_zero_grad_then_backward_overwrites_without_a_fill():
    model = make_model(0)
    opt = ShardedAdamW(model.parameters(), lr=LR)
    x1, x2 = torch.randn(4, 13).bfloat16(), torch.randn(4, 13).bfloat16()
    model(x1).float().sum().backward()
    opt.zero_grad(set_to_none=True)
    model(x2).float().sum().backward()
    first = opt.buckets[0].grad_buffer.get_data().clone()
    opt.zero_grad(set_to_none=False)
    assert bool((opt.buckets[0].grad_buffer.get_data() == 0).all()), "set_to_none=False zero-fills the buffers"
    model(x2).float().sum().backward()
    assert torch.equal(opt.buckets[0].grad_buffer.get_data(), first), "only the backward after zero_grad counts"
    model(x2).float().sum().backward()
    assert torch.equal(opt.buckets[0].grad_buffer.get_data(), (first.float() * 2).to(torch.bfloat16)), \
        "a second backward accumulates"
    # the gradients moved into the buffer; param.grad only says so (no storage): a placeholder where a gradient
    # arrived, None where none did (the unused parameter) and for the frozen one, as torch leaves them
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert grads.pop("unused") is None and grads.pop("frozen") is None
    assert all(type(g) is ShardedGrad for g in grads.values()), {n: type(g) for n, g in grads.items()}


def test_memory_bytes():
    model = make_model(0)
    opt = ShardedAdamW(model.parameters(), lr=LR)
    mem = opt.memory_bytes()
    padded = sum(b.param_buffer.padded_numel for b in opt.buckets)
    shard = sum(b.param_buffer.shard_numel for b in opt.buckets)
    n = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert mem["params"] == mem["grads"] == 2 * padded
    assert mem["master"] == 4 * shard and mem["state"] == 8 * shard
    assert mem["total"] == sum(v for k, v in mem.items() if k != "total")
    assert padded >= n and padded - n < 64 * len(list(model.parameters()))  # align=64 padding per tensor at most


def test_step_inside_no_sync_is_an_error():
    model = make_model(0)
    opt = ShardedAdamW(model.parameters(), lr=LR)
    with opt.no_sync():
        model(torch.randn(2, 13).bfloat16()).float().sum().backward()
        with pytest.raises(RuntimeError, match="no_sync"):
            opt.step()


def _params():
    return [torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.randn(2, 2))]


@pytest.mark.parametrize("make, exc, match", [
    (lambda: ShardedAdamW([_params()[0]] * 2), ValueError, "passed twice"),
    # torch.optim's TypeError; list(param) iterated its rows and said "can't optimize a non-leaf Tensor"
    (lambda: ShardedAdamW(_params()[1]), TypeError, r"should be an iterable of Tensors or dicts, but got a "
     r"torch\.FloatTensor \(pass \[param\] for one parameter\)"),
    (lambda: ShardedAdamW([torch.nn.Parameter(torch.ones(3, dtype=torch.int64), requires_grad=False)]), TypeError,
     "floating point"),
    # a meta-device parameter has no values: before issue 23 it was accepted and its steps "succeeded" unchanged
    (lambda: ShardedAdamW([torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(3, device="meta"))]),
     ValueError, r"param_groups\[0\]\['params'\]\[1\] \(shape \(3,\)\) is on the meta device"),
    (lambda: ShardedAdamW(_params(), lr=-1.0), ValueError, "lr must be >= 0"),
    # a tensor lr: one element, as torch.optim's "Tensor lr must be 1-element" (until session 46 it passed and
    # failed inside step() with "shape '[]' is invalid for input of size 2"), and not negative (torch.optim refuses
    # it; it trained uphill, silently)
    (lambda: ShardedAdamW(_params(), lr=torch.tensor([1e-3, 2e-3])), ValueError,
     r"lr must be a number or a 1-element tensor, got a tensor of shape \(2,\) \(param_groups\[0\]\)"),
    (lambda: ShardedAdamW(_params(), lr=torch.tensor(-1e-3)), ValueError, r"lr must be >= 0 and finite, got -0\.001"),
    (lambda: ShardedSGD(_params(), lr=torch.tensor([float("nan")])), ValueError, "lr must be >= 0 and finite, got nan"),
    # infinities passed construction and failed at step() (issue 23)
    (lambda: ShardedAdamW(_params(), lr=float("inf")), ValueError, "lr must be >= 0 and finite, got inf"),
    (lambda: ShardedAdamW(_params(), eps=float("inf")), ValueError, "eps must be > 0 and finite"),
    (lambda: ShardedAdamW(_params(), weight_decay=float("inf")), ValueError, "weight_decay must be >= 0 and finite"),
    (lambda: ShardedAdamW(_params(), bucket_cap_mb=float("nan")), ValueError, "bucket_cap_mb must be a finite"),
    (lambda: ShardedAdamW(_params(), bucket_cap_mb=float("inf")), ValueError, "bucket_cap_mb must be a finite"),
    (lambda: ShardedAdamW(_params(), betas=(1.0, 0.999)), ValueError, r"betas\[0\] must be in \[0, 1\)"),
    (lambda: ShardedAdamW(_params(), betas=(0.9, -0.1)), ValueError, r"betas\[1\]"),
    (lambda: ShardedAdamW(_params(), betas=(0.9,)), ValueError, r"betas must be a pair \(beta1, beta2\), got \(0\.9,\)"),
    (lambda: ShardedAdamW(_params(), betas=(True, 0.999)), ValueError, r"betas\[0\] must be in \[0, 1\), got True"),
    (lambda: ShardedAdamW([{"params": _params()[:1]}, {"params": _params()[1:], "betas": (0.9, float("nan"))}]),
     ValueError, r"betas\[1\] must be in \[0, 1\), got nan \(param_groups\[1\]\)"),
    (lambda: ShardedAdamW(_params(), eps=0.0), ValueError, "eps must be > 0"),
    (lambda: ShardedAdamW(_params(), weight_decay=-1e-2), ValueError, "weight_decay must be >= 0"),
    (lambda: ShardedAdamW([{"params": _params()[:1]}, {"params": _params()[1:], "lr": -1}]), ValueError,
     r"lr must be >= 0 and finite, got -1 \(param_groups\[1\]\)"),
    (lambda: ShardedAdamW(_params(), param_dtype=torch.float32), ValueError, "param_dtype"),
    (lambda: ShardedAdamW(_params(), loss_scale=2.0 ** 16), TypeError, "LossScaleConfig"),
    (lambda: ShardedAdamW(_params(), grad_dtype=torch.float16), ValueError, "grad_dtype"),
    (lambda: ShardedAdamW(_params(), bucket_cap_mb=0), ValueError, "bucket_cap_mb"),
    # torch.optim.AdamW's own arguments that change what is computed: named, not "unexpected keyword argument"
    (lambda: ShardedAdamW(_params(), 1e-3, (0.9, 0.999), 1e-8, 1e-2, True), ValueError, "amsgrad=True"),
    (lambda: ShardedAdamW(_params(), differentiable=True), ValueError, "differentiable=True"),
    # only lr may be a tensor (torch.optim's fused and capturable paths take tensor betas): named, where the message
    # said "must be in [0, 1), got tensor(0.9000)" until session 49
    (lambda: ShardedAdamW(_params(), betas=(torch.tensor(0.9), 0.999)), TypeError,
     r"betas\[0\] must be a Python number, got a tensor \(tensor\(0\.9000\)\): only lr may be a tensor"),
    (lambda: ShardedAdamW(_params(), weight_decay=torch.tensor(0.1)), TypeError,
     r"weight_decay must be a Python number, got a tensor .*\(param_groups\[0\]\)"),
    (lambda: ShardedSGD(_params(), momentum=0.9, dampening=torch.tensor(0.1)), TypeError,
     "dampening must be a Python number, got a tensor"),
    # (torch.optim.SGD takes any dampening; a NaN one made NaN buffers, here it failed in the launcher after the
    # reduction, until session 52: found by tests/optim/test_state_dict_fuzz.py)
    (lambda: ShardedSGD(_params(), momentum=0.9, dampening=float("nan")), ValueError,
     r"dampening must be a finite number, got nan \(param_groups\[0\]\)"),
    # (the kernels take the lr in fp32: a larger one failed in ShardedSGD's launch until session 52)
    (lambda: ShardedSGD(_params(), lr=1e39), ValueError,
     r"lr must be >= 0 and finite, got 1e\+39 \(the kernels take it in fp32, whose largest number is 3\.4e38\) "
     r"\(param_groups\[0\]\)"),
    # the switches take bools only: until session 49 overlap_comm and store_param_remainders took any value's
    # truth, so the string "False" of a config file switched overlap_comm on
    (lambda: ShardedAdamW(_params(), overlap_comm="False"), TypeError,
     "overlap_comm must be True or False, got 'False'"),
    (lambda: ShardedAdamW(_params(), ordered_reduce=1), TypeError, "ordered_reduce must be True or False, got 1"),
    (lambda: ShardedAdamW(_params(), store_param_remainders=None), TypeError,
     "store_param_remainders must be True or False, got None"),
    (lambda: ShardedAdamW(_params(), check_collectives="yes"), TypeError,
     "check_collectives must be True or False, got 'yes'"),
    # maximize and SGD's nesterov are True or False: until session 50 they took any value's truth, as torch.optim
    # does, so maximize="False" trained uphill; a group given amsgrad=True trained without it
    (lambda: ShardedAdamW(_params(), maximize="False"), TypeError, "maximize must be True or False, got 'False'"),
    (lambda: ShardedSGD(_params(), maximize=0), TypeError, r"maximize must be True or False, got 0 \(param_groups"),
    (lambda: ShardedSGD(_params(), momentum=0.9, nesterov="no"), TypeError, "nesterov must be True or False"),
    (lambda: tritonshard.ShardedLion(_params(), maximize=None), TypeError, "maximize must be True or False"),
    (lambda: ShardedAdamW([{"params": _params()[:1]}, {"params": _params()[1:], "amsgrad": True}]), ValueError,
     r"amsgrad=True: ShardedAdamW implements AdamW without the AMSGrad variant.*\(param_groups\[1\]\)"),
    # what is not a parameter, in torch.optim's words (until session 49 a str, or a value given twice, raised an
    # AttributeError about .shape; a dict, one group without its list, named its key as a non-tensor)
    (lambda: ShardedAdamW("weights"), TypeError, "should be an iterable of Tensors or dicts, but got a str"),
    (lambda: ShardedAdamW({"params": _params()}), TypeError, r"but got a dict \(pass \[group\] for one param group\)"),
    (lambda: ShardedAdamW([None, None]), TypeError,
     r"optimizer can only optimize Tensors, but one of the params is NoneType \(param_groups\[0\]\)"),
    (lambda: ShardedAdamW([{"params": _params()[:1]}, {"params": [_params()[1], 3]}]), TypeError,
     r"one of the params is int \(param_groups\[1\]\)"),
    # named parameters, torch.optim's (name, tensor) pairs: a pair given twice is the duplicate it is
    (lambda: ShardedAdamW(list(torch.nn.Linear(3, 2).named_parameters()) * 2), ValueError,
     r"a parameter of shape \(2, 3\) is passed twice"),
])
def test_bad_arguments(make, exc, match):
    with pytest.raises(exc, match=match):
        make()


@pytest.mark.parametrize("flag, value", [("cast_forward_inputs", "False"), ("broadcast_buffers", 0)])
def test_attachs_switches_take_true_or_false_and_name_anything_else_before_hooking_the_model(flag, value):
    """attach()'s switches say what the constructor's say (one check, _hparams.check_flag): a config file's string
    "False" is truthy, so a switch that took any value's truth would turn on what the file turns off."""
    model = torch.nn.Linear(3, 2).bfloat16()
    opt = ShardedAdamW(model.parameters(), overlap_comm=True)
    with pytest.raises(TypeError, match=f"{flag} must be True or False, got {value!r}"):
        opt.attach(model, **{flag: value})
    assert not model._forward_pre_hooks and opt._attached is None


@pytest.mark.parametrize("cls", ["ShardedAdamW", "ShardedSGD", "ShardedLion", "ShardedMuon"])
def test_params_that_are_not_an_iterable_of_parameters_get_torch_optims_error_from_every_optimizer(cls):
    """ShardedSGD and ShardedMuon read the groups before ShardedOptimizer's checks: until session 49 they iterated a
    tensor's rows ("can't optimize a non-leaf Tensor"; Muon: "only supports 2-D parameters ... is 1-D") and a
    string's letters."""
    cls = getattr(tritonshard, cls)
    weight = torch.nn.Parameter(torch.randn(3, 3))
    with pytest.raises(TypeError, match=r"should be an iterable of Tensors or dicts, but got a torch\.FloatTensor "
                                        r"\(pass \[param\] for one parameter\)"):
        cls(weight)
    with pytest.raises(TypeError, match="should be an iterable of Tensors or dicts, but got a str"):
        cls("weights")
    with pytest.raises(TypeError, match=r"but got a dict \(pass \[group\] for one param group\)"):
        cls({"params": [weight]})


def test_a_tensor_lr_set_after_construction_is_checked_at_step():
    """A scheduler or a loop that sets ``group["lr"]`` to a tensor of more than one element (or a negative CPU one)
    between steps: step() names it and the group before anything changes, as construction does."""
    model = make_model(0)
    opt = ShardedAdamW(param_groups(model), lr=LR)
    x = torch.randn(6, 13).to(torch.bfloat16)
    before = [p.detach().clone() for p in model.parameters()]
    for lr, match in ((torch.tensor([LR, LR]), r"1-element tensor, got a tensor of shape \(2,\) \(param_groups\[1\], "
                                                r"at step\(\)\)"),
                      (torch.tensor(-LR), r"lr must be >= 0 and finite, got -.* \(a tensor\) \(param_groups\[1\]")):
        opt.param_groups[1]["lr"] = lr
        loss_fn(model, x).backward()
        with pytest.raises(ValueError, match=match):
            opt.step()
        opt.zero_grad()
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters())), "a refused step wrote the weights"
    opt.param_groups[1]["lr"] = torch.tensor([LR])  # (one element: as torch.optim, it trains)
    loss_fn(model, x).backward()
    opt.step()
    assert not all(torch.equal(a, p) for a, p in zip(before, model.parameters()))


def test_hooks_on_the_model_do_not_keep_the_optimizer_alive():
    # The gradient hooks (and attach()'s forward pre-hooks) live on the user's parameters and modules. They must
    # not own the optimizer: otherwise `del opt` frees nothing while the model lives, and the optimizer (with its
    # buffers and process group) is torn down during interpreter shutdown.
    import gc
    import weakref

    model = make_model(0)
    opt = ShardedAdamW(param_groups(model), lr=LR, overlap_comm=True)
    opt.attach(model)
    x = torch.randn(6, 13).to(torch.bfloat16)
    loss_fn(model, x).backward()
    opt.step()
    opt.zero_grad()
    alive = weakref.ref(opt)
    del opt
    gc.collect()
    assert alive() is None, "the model's hooks keep the optimizer alive"
    before = [p.detach().clone() for p in model.parameters()]
    loss_fn(model, x).backward()  # the orphaned hooks do nothing
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))


def test_a_generator_param_group_keeps_its_parameters():
    # {"params": model.parameters()}, as in countless scripts: the duplicate check used to consume the generator,
    # leaving torch.optim an empty group and training nothing, silently (issue 23)
    model = make_model(0)
    opt = ShardedAdamW([{"params": model.fc1.parameters()}, {"params": model.fc2.parameters(), "lr": LR / 2}], lr=LR)
    want = torch.optim.AdamW([{"params": make_model(0).fc1.parameters()}, {"params": make_model(0).fc2.parameters()}])
    assert [len(g["params"]) for g in opt.param_groups] == [len(g["params"]) for g in want.param_groups] == [2, 2]
    before = [p.detach().clone() for p in model.fc1.parameters()]
    loss_fn(model, torch.randn(6, 13).bfloat16()).backward()
    opt.step()
    assert all(not torch.equal(a, p) for a, p in zip(before, model.fc1.parameters())), "group 0 did not train"


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1.0])
def test_a_bad_hyperparameter_at_step_changes_nothing(bad):
    # a scheduler or the user sets group 1's lr to nonsense: step() raises before group 0 is updated or any step
    # counter moves (it used to raise from group 1's launch, after group 0's update)
    model = make_model(0)
    opt = ShardedAdamW(param_groups(model), lr=LR, bucket_cap_mb=1e-9)
    loss_fn(model, torch.randn(6, 13).bfloat16()).backward()
    opt.step()
    opt.zero_grad()
    loss_fn(model, torch.randn(6, 13).bfloat16()).backward()
    opt.param_groups[1]["lr"] = bad
    before = {"params": [p.detach().clone() for p in model.parameters()],
              "master": [b.master.clone() for b in opt.buckets], "step": [b.step.clone() for b in opt.buckets]}
    with pytest.raises(ValueError, match=r"lr must be >= 0 and finite, got .* \(param_groups\[1\], at step\(\)\)"):
        opt.step()
    after = {"params": list(model.parameters()), "master": [b.master for b in opt.buckets],
             "step": [b.step for b in opt.buckets]}
    for key in before:
        assert all(torch.equal(x, y) for x, y in zip(before[key], after[key])), f"{key} changed"


def test_a_sparse_gradient_is_an_error_naming_the_parameter():
    emb = torch.nn.Embedding(10, 4, sparse=True)
    opt = ShardedAdamW(emb.parameters(), lr=LR)
    opt.attach(emb)
    with pytest.raises(RuntimeError, match=r"the gradient of 'weight' is torch.sparse_coo.*sparse=False"):
        emb(torch.tensor([1, 2, 3])).float().sum().backward()


@pytest.mark.parametrize("bucket_cap_mb", [1e-9, 1.0])  # a bucket per parameter (merged flush), one bucket
def test_gradients_of_other_parameters_at_reused_addresses_land_in_their_own_places(bucket_cap_mb):
    """When the parameters that get a gradient change from one step to the next (an unused expert, a branch not
    taken), the caching allocator hands one parameter's gradient the block another one's had. The flatten's plan
    cache found its last plan by the addresses alone and wrote C's gradient into A's place: against the same
    gradients in tensors of their own, every weight must come out the same bits."""
    from tests.helpers import assert_bitwise_equal

    def train(reuse: bool):
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(64)) for _ in range(4)]
        opt = ShardedAdamW(params, lr=1e-2, bucket_cap_mb=bucket_cap_mb)
        slots = [torch.empty(64, dtype=torch.bfloat16) for _ in range(2)]
        for step, which in enumerate([(0, 1), (0, 1), (1, 2), (2, 3), (0, 3)]):
            gen = torch.Generator().manual_seed(step)
            for k, i in enumerate(which):
                g = torch.randn(64, generator=gen).bfloat16()
                params[i].grad = slots[k].copy_(g) if reuse else g  # reuse: the same two addresses every step
            opt.step()
            opt.zero_grad()
        return torch.cat([p.detach().float() for p in params])

    assert_bitwise_equal(train(reuse=True), train(reuse=False), "weights")


def test_a_torch_optim_call_site_runs_unchanged_and_its_switches_change_no_bit():
    """``AdamW(params, lr, betas, eps, weight_decay, amsgrad=False, foreach=..., fused=..., capturable=...)`` as
    torch.optim takes them: the implementation switches are accepted (until session 16 a TypeError, "unexpected
    keyword argument 'fused'"), and the update is the same fused kernel whatever they say."""
    runs = []
    for switches in ({}, dict(amsgrad=False, foreach=False, fused=True, capturable=True, differentiable=False),
                     dict(foreach=True, fused=None)):
        model = make_model(0)
        opt = ShardedAdamW(param_groups(model), LR, (0.9, 0.95), 1e-8, 0.1, **switches)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
        for step in range(2):
            train_step(model, opt, sched, 0, step)
        runs.append(torch.cat([p.detach().float().reshape(-1) for p in model.parameters()]))
    for other in runs[1:]:
        assert torch.equal(other, runs[0])
    assert "fused" not in opt.param_groups[0]  # (not a hyper-parameter here: state dicts carry none)


@pytest.mark.parametrize("cls, key, value, match", [
    ("ShardedAdamW", "maximize", "False", "maximize must be True or False"),
    ("ShardedAdamW", "amsgrad", True, "amsgrad=True: ShardedAdamW implements AdamW without the AMSGrad variant"),
    ("ShardedAdamW", "decoupled_weight_decay", False, r"weight_decay with decoupled_weight_decay=False \(torch"),
    ("ShardedSGD", "nesterov", "False", "nesterov must be True or False"),
    ("ShardedLion", "maximize", 1, "maximize must be True or False"),
])
def test_a_switch_set_in_a_group_later_is_checked_at_step_before_anything_changes(cls, key, value, match):
    """What a loop or a config sets in a param group between steps is checked as at construction (a string
    "False" is true, so it trained uphill or with Nesterov, silently; amsgrad and Adam's coupled decay were
    ignored), at step() and before any weight changes."""
    model = torch.nn.Linear(5, 3).to(torch.bfloat16)
    opt = getattr(tritonshard, cls)(model.parameters(), lr=0.1, **({"momentum": 0.9} if cls == "ShardedSGD" else {}))
    for _ in range(2):
        model(torch.randn(2, 5, dtype=torch.bfloat16)).float().sum().backward()
        if _ == 1:
            opt.param_groups[0][key] = value
            before = [p.detach().clone() for p in model.parameters()]
            with pytest.raises((TypeError, ValueError), match=rf"{match}.*\(param_groups\[0\], at step\(\)\)"):
                opt.step()
            assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
        else:
            opt.step()
            opt.zero_grad()



class _WithoutEps(ShardedAdamW):
    """A dict whose groups hold every key ShardedLion's have and none that marks another kind."""

    def state_dict(self):
        saved = super().state_dict()
        for g in saved["param_groups"]:
            del g["eps"]
        return saved


_KINDS = {
    "ShardedAdamW": lambda ps: ShardedAdamW(ps, lr=0.1),
    "ShardedSGD": lambda ps: ShardedSGD(ps, lr=0.1, momentum=0.9),
    "ShardedLion": lambda ps: tritonshard.ShardedLion(ps, lr=0.1),
    "ShardedMuon": lambda ps: tritonshard.ShardedMuon(ps, lr=0.1),
    "torch.optim.AdamW": lambda ps: torch.optim.AdamW(ps, lr=0.1),
    "torch.optim.SGD": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "torch.optim.RMSprop": lambda ps: torch.optim.RMSprop(ps, lr=0.1),
    "torch.optim.Adam(weight_decay)": lambda ps: torch.optim.Adam(ps, lr=0.1, weight_decay=0.01),
    "ShardedAdamW without eps": lambda ps: _WithoutEps(ps, lr=0.1),
    "torch.optim.AdamW before any step": lambda ps: torch.optim.AdamW(ps, lr=0.1),
    "torch.optim.NAdam before any step": lambda ps: torch.optim.NAdam(ps, lr=0.1),
}
_OTHER_KIND = [  # (saved by, loaded into, what the error names)
    ("ShardedAdamW", "ShardedSGD", r"param_groups\[0\] of the state dict has no 'momentum', 'dampening', "
                                   r"'nesterov', which every ShardedSGD group has \(lr, momentum, dampening, "
                                   r"weight_decay, nesterov\): the state dict of another kind of optimizer\?"),
    ("torch.optim.AdamW", "ShardedSGD", r"has no 'momentum', 'dampening', 'nesterov'"),
    ("ShardedSGD", "ShardedAdamW", r"has no 'betas', 'eps', which every ShardedAdamW group has"),
    ("torch.optim.SGD", "ShardedAdamW", r"has no 'betas', 'eps', which every ShardedAdamW group has"),
    ("ShardedLion", "ShardedAdamW", r"has no 'eps', which every ShardedAdamW group has"),
    ("ShardedAdamW", "ShardedLion", r"param_groups\[0\] of the state dict has 'eps', which no ShardedLion group has"),
    ("torch.optim.AdamW", "ShardedLion", r"has 'eps', which no ShardedLion group has"),
    # (groups that fit, state that does not: named by the state)
    ("ShardedAdamW without eps", "ShardedLion", r"state of parameter 0 in the state dict has 'exp_avg_sq', which "
                                                r"ShardedLion does not keep \(its state: exp_avg, step, master\)"),
    ("ShardedAdamW", "ShardedMuon", r"has no 'momentum', 'nesterov', 'ns_coefficients', 'ns_steps', which every "
                                    r"ShardedMuon group has"),
    ("torch.optim.RMSprop", "ShardedSGD", r"has no 'dampening', 'nesterov'"),
    # (named as another kind, not as the L2 decay of torch.optim.Adam that ShardedAdamW refuses)
    ("torch.optim.Adam(weight_decay)", "ShardedSGD", r"has no 'momentum', 'dampening', 'nesterov', which every "
                                                     r"ShardedSGD group has"),
    # (no state to tell them apart, and Lion's group keys are a subset of Adam's: the epsilon names the kind; until
    # session 52 ShardedLion took AdamW's lr and decay)
    ("torch.optim.AdamW before any step", "ShardedLion", r"param_groups\[0\] of the state dict has 'eps', which no "
                                                          r"ShardedLion group has: the state dict of another kind"),
    ("torch.optim.NAdam before any step", "ShardedLion", r"has 'eps', which no ShardedLion group has"),
]


@pytest.mark.parametrize("saved_by,loaded_into,match", _OTHER_KIND, ids=[f"{a} into {b}" for a, b, _ in _OTHER_KIND])
def test_a_state_dict_of_another_kind_of_optimizer_is_named_before_anything_is_loaded(saved_by, loaded_into, match):
    """A resumed run whose --optimizer changed loads the other optimizer's dict. Until session 51 that loaded
    silently: the saved groups' hyper-parameters replaced this optimizer's (a ShardedSGD trained on with AdamW's lr
    and weight decay, its momentum kept from its own groups), and a state tensor both kinds name was taken (AdamW's
    exp_avg as ShardedLion's momentum). torch.optim fails at the next step on such a group (KeyError: 'momentum');
    here a ValueError naming what does not fit, and nothing is loaded."""
    torch.manual_seed(0)
    saved_model = torch.nn.Linear(6, 4, bias=False)
    if saved_by.startswith("Sharded"):
        saved_model.to(torch.bfloat16)
    saved = _KINDS[saved_by](saved_model.parameters())
    saved_model(torch.randn(3, 6, dtype=saved_model.weight.dtype)).float().square().sum().backward()
    if not saved_by.endswith("before any step"):
        saved.step()
    model = torch.nn.Linear(6, 4, bias=False).to(torch.bfloat16)
    opt = _KINDS[loaded_into](model.parameters())
    model(torch.randn(3, 6, dtype=torch.bfloat16)).float().square().sum().backward()
    opt.step()
    opt.zero_grad()
    before = opt.state_dict()
    weights = model.weight.detach().clone()
    with pytest.raises(ValueError, match=match):
        opt.load_state_dict(saved.state_dict())
    after = opt.state_dict()
    assert after["param_groups"] == before["param_groups"] and torch.equal(model.weight, weights)
    for key, entry in before["state"].items():
        assert all(torch.equal(entry[k], after["state"][key][k]) for k in entry), key
    # the same kind loads, also from torch.optim (the error is about the kind, not the source)
    same = _KINDS[loaded_into](torch.nn.Linear(6, 4, bias=False).to(torch.bfloat16).parameters())
    opt.load_state_dict(same.state_dict())


def test_a_key_of_the_users_own_that_another_kind_has_loads_where_this_optimizers_groups_hold_it():
    """The key that names an Adam-family dict to ShardedLion (``eps``) is the user's own where the optimizer's own
    groups hold it too (torch.optim keeps any key a group is given): such a dict loads, its values with it."""
    model = torch.nn.Linear(6, 4).to(torch.bfloat16)
    opt = tritonshard.ShardedLion([{"params": model.parameters(), "eps": 1e-8}], lr=0.1)
    model(torch.randn(3, 6, dtype=torch.bfloat16)).float().square().sum().backward()
    opt.step()
    saved = opt.state_dict()
    saved["param_groups"][0]["eps"] = 1e-6
    again = tritonshard.ShardedLion([{"params": model.parameters(), "eps": 1e-8}], lr=0.2)
    again.load_state_dict(saved)
    assert again.param_groups[0]["eps"] == 1e-6 and again.param_groups[0]["lr"] == 0.1


def _drop(entry: dict, key: str) -> None:
    del entry[key]


_MALFORMED = {  # (what is wrong: how the saved dict is changed, what the error says)
    "a model's state dict": (lambda d, model: model.state_dict(), r"state_dict must be a dict with 'state' and "
                             r"'param_groups' \(torch.optim format\)"),
    "None": (lambda d, model: None, "state_dict must be a dict with 'state' and 'param_groups'"),
    "a group missing a parameter": (lambda d, model: d["param_groups"][0].update(params=[0, 1, 2]),
                                    r"param_groups\[0\] has 3 parameters in the state dict but 4 in the optimizer"),
    "state of an index in no group": (lambda d, model: d["state"].update({9: d["state"][0]}),
                                      "the state dict has state for parameter 9, which is in no param group"),
    # (after a round trip through JSON: named as such, where the message said "parameter 0" of the key "0")
    "keys as strings": (lambda d, model: d.update(state={str(k): v for k, v in d["state"].items()}),
                        r"state for parameter '0', which is in no param group \(its keys are strings, the param "
                        r"groups' indices are ints"),
    "a state tensor missing": (lambda d, model: _drop(d["state"][1], "exp_avg_sq"),
                               "state of parameter 1 has no 'exp_avg_sq'"),
    # (loaded as a count of 1 until session 52: bias corrections of a second step at the next; torch.optim's next
    # step is a KeyError)
    "no step": (lambda d, model: _drop(d["state"][1], "step"),
                r"state of parameter 1 has no 'step', which ShardedAdamW's update reads \(its bias corrections\)"),
    # (an AttributeError on .shape until session 52)
    "a state tensor as a list": (lambda d, model: d["state"][1].update(exp_avg=d["state"][1]["exp_avg"].tolist()),
                                 r"state 'exp_avg' of parameter 1 is a list, not a tensor of the parameter's shape "
                                 r"\(4,\)"),
    "the state of a parameter as a list": (lambda d, model: d["state"].update({1: [d["state"][1]["exp_avg"]]}),
                                           "the state of parameter 1 is a list, not a dict"),
    "a state tensor of another shape": (lambda d, model: d["state"][0].update(exp_avg=torch.zeros(3)),
                                        r"state 'exp_avg' of parameter 0 has shape \(3,\) but the parameter has "
                                        r"shape \(4, 5\)"),
    "amsgrad": (lambda d, model: d["param_groups"][0].update(amsgrad=True),
                r"amsgrad=True: ShardedAdamW implements AdamW without the AMSGrad variant.*\(param_groups\[0\] of the "
                r"state dict\)"),
    # (hyper-parameters checked as at construction: until session 52 they loaded, and every step() refused them)
    "a negative lr": (lambda d, model: d["param_groups"][0].update(lr=-0.1),
                      r"lr must be >= 0.*got -0\.1 \(param_groups\[0\] of the state dict\)"),
    "betas as a string": (lambda d, model: d["param_groups"][0].update(betas="0.9,0.999"),
                          r"betas.*\(param_groups\[0\] of the state dict\)"),
    # (the structure and the counts: an AttributeError, a KeyError, a float() of two elements, or a NaN count that
    # trained on silently, until session 52; found by tests/optim/test_state_dict_fuzz.py)
    "state as a list": (lambda d, model: d.update(state=list(d["state"].values())),
                        r"state_dict\['state'\] must be a dict of parameter index -> that parameter's state, got "
                        r"a list"),
    "a group without params": (lambda d, model: _drop(d["param_groups"][0], "params"),
                               r"state_dict\['param_groups'\] must be a list of dicts, each with 'params'.*: "
                               r"param_groups\[0\] is \{'lr'"),
    "a step of two elements": (lambda d, model: d["state"][1].update(step=torch.zeros(2)),
                               r"state 'step' of parameter 1 must be a step count >= 0 \(a number or a 1-element "
                               r"tensor\), got tensor\(\[0., 0.\]\)"),
    "a step of NaN": (lambda d, model: d["state"][0].update(step=torch.tensor(float("nan"))),
                      r"state 'step' of parameter 0 must be a step count >= 0.*got tensor\(nan\)"),
    # (the optimizer-wide values, read at the end of the load: an error there came after the state was replaced,
    # until session 53)
    "the optimizer-wide values as a list": (lambda d, model: d.update(tritonshard=[0]),
                                            r"state_dict\['tritonshard'\] must be a dict of the optimizer-wide "
                                            r"values.*got a list"),
    "a skipped-step count of NaN": (lambda d, model: d["tritonshard"].update(skipped_steps=float("nan")),
                                    r"state_dict\['tritonshard'\]\['skipped_steps'\] must be a count \(an "
                                    r"integer >= 0\), got nan"),
    # (DCP's get_state_dict keeps only the group's copy)
    "the group's copy only, with a negative count": (
        lambda d, model: (d.pop("tritonshard"), d["param_groups"][0]["tritonshard"].update(sr_steps=-1)) and None,
        r"state_dict\['param_groups'\]\[0\]\['tritonshard'\]\['sr_steps'\] must be a count.*got -1"),
}


@pytest.mark.parametrize("case", list(_MALFORMED))
def test_a_malformed_state_dict_is_named_and_nothing_is_loaded(case):
    """What a converted, hand-edited or mixed-up optimizer checkpoint can hold, each named, before anything is
    loaded: the weights and the state stay as they were."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Linear(4, 3)).to(torch.bfloat16)
    opt = ShardedAdamW(model.parameters(), lr=0.1)
    for _ in range(2):
        model(torch.randn(2, 5, dtype=torch.bfloat16)).float().square().sum().backward()
        opt.step()
        opt.zero_grad()
    saved = opt.state_dict()
    for entry in saved["state"].values():  # (values the optimizer does not hold now: a load would show)
        for key in ("exp_avg", "exp_avg_sq", "master"):
            entry[key] = entry[key] + 1.0
    change, match = _MALFORMED[case]
    replacement = change(saved, model)  # (None where the change edits ``saved`` in place, but for the case "None")
    to_load = replacement if replacement is not None or case == "None" else saved
    before, weights = opt.state_dict(), [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=match):
        opt.load_state_dict(to_load)
    after = opt.state_dict()
    assert all(torch.equal(a, p) for a, p in zip(weights, model.parameters())), "the weights were changed"
    assert after["param_groups"] == before["param_groups"]
    for key, entry in before["state"].items():
        assert all(torch.equal(entry[k], after["state"][key][k]) for k in entry), key


def _step_with_torch(opt, model, torch_opt, twin) -> None:
    """One step of ``opt`` over ``model`` and of ``torch_opt`` over its fp32 ``twin``, with the same fresh bf16
    gradients."""
    for p, q in zip(model.parameters(), twin):
        g = torch.randn(p.shape).bfloat16()
        p.grad, q.grad = g, g.float()
    opt.step()
    torch_opt.step()


def test_torch_sgds_state_dict_without_step_counts_loads_into_sharded_sgd():
    """torch.optim.SGD keeps no step in its state (nor does a Lion): unlike an AdamW's, its dict loads without one,
    and trains on as torch.optim.SGD does from it."""
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 3).to(torch.bfloat16)
    twin = [torch.nn.Parameter(p.detach().float().clone()) for p in model.parameters()]
    torch_opt = torch.optim.SGD(twin, lr=0.1, momentum=0.9, foreach=False)
    for p in twin:
        p.grad = torch.randn_like(p)
    torch_opt.step()
    saved = torch_opt.state_dict()
    assert all("step" not in entry for entry in saved["state"].values())
    with torch.no_grad():
        for p, q in zip(model.parameters(), twin):
            p.copy_(q)
    without = ShardedSGD(model.parameters(), lr=0.5)  # (no momentum: it holds no buffers to load into)
    with pytest.raises(ValueError, match=r"momentum=0\.9, but this ShardedSGD was built without momentum in any "
                                         r"param group.*\(param_groups\[0\] of the state dict\)"):
        without.load_state_dict(saved)
    assert without.param_groups[0]["momentum"] == 0.0, "nothing is loaded (it used to load, and step() to refuse)"
    del without
    opt = ShardedSGD(model.parameters(), lr=0.5, momentum=0.5)
    opt.load_state_dict(saved)
    start = [s["master"].clone() for s in opt.state_dict()["state"].values()]  # (the bf16 weights: no master saved)
    twin_start = [q.detach().clone() for q in twin]
    _step_with_torch(opt, model, torch_opt, twin)
    state = opt.state_dict()["state"]
    for i, q in enumerate(twin):
        # the step from the loaded buffer with the loaded lr 0.1 and momentum 0.9 (a buffer started afresh, or the
        # lr 0.5 of the constructor, is off by ~0.1 * |buf| or more), compared as the update: the masters start
        # apart by the bf16 rounding of torch's fp32 weights; fp32 ulps of the weights (~3e-8) in the differences
        torch.testing.assert_close(state[i]["master"] - start[i], q.detach() - twin_start[i], rtol=0, atol=1e-6)
        torch.testing.assert_close(state[i]["momentum_buffer"], torch_opt.state[q]["momentum_buffer"])


def test_a_momentum_buffer_of_none_from_an_older_torch_sgd_is_no_buffer_yet():
    """torch.optim.SGD before 2.0 kept ``momentum_buffer: None`` for the parameters it stepped without momentum; a
    torch.optim.SGD of today loads that dict and makes each buffer at its first step with momentum (buf = g). Until
    session 52 ShardedSGD failed on it (an AttributeError on ``None.shape``)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 3).to(torch.bfloat16)
    twin = [torch.nn.Parameter(p.detach().float().clone()) for p in model.parameters()]
    saved = {"state": {0: {"momentum_buffer": None}, 1: {"momentum_buffer": None}},
             "param_groups": [{"lr": 0.1, "momentum": 0, "dampening": 0.5, "weight_decay": 0, "nesterov": False,
                               "maximize": False, "foreach": None, "differentiable": False, "params": [0, 1]}]}
    torch_opt = torch.optim.SGD(twin, lr=0.5, momentum=0.5, foreach=False)
    torch_opt.load_state_dict(saved)
    opt = ShardedSGD(model.parameters(), lr=0.5, momentum=0.5)
    opt.load_state_dict(saved)
    for step in range(2):
        for o in (opt, torch_opt):
            o.param_groups[0]["momentum"] = 0.9  # (the saved groups had none)
        _step_with_torch(opt, model, torch_opt, twin)
    state = opt.state_dict()["state"]
    for i, q in enumerate(twin):
        # the same fp32 start (bf16 weights); op order against torch's: fp32 ulps (see test_sgd_lion_distributed);
        # a first buffer of (1 - dampening) * g instead of g is off by 0.5 * 0.1 * |g| ~ 0.05
        torch.testing.assert_close(state[i]["master"], q.detach(), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(state[i]["momentum_buffer"], torch_opt.state[q]["momentum_buffer"])


def test_an_empty_entry_in_a_torch_adamw_state_dict_is_a_parameter_without_state():
    """torch.optim's state is a defaultdict: a logger's read of ``opt.state[p]`` before p's first step leaves an
    empty entry in its state dict, and torch.optim starts p afresh at its step. Until session 52 such a dict was
    refused ("state of parameter 1 has no 'exp_avg'")."""
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 3).to(torch.bfloat16)
    twin = [torch.nn.Parameter(p.detach().float().clone()) for p in model.parameters()]
    torch_opt = torch.optim.AdamW(twin, lr=0.1, foreach=False)
    twin[0].grad = torch.randn(twin[0].shape)
    torch_opt.step()
    assert torch_opt.state[twin[1]] == {}  # (the read)
    saved = torch_opt.state_dict()
    assert saved["state"][1] == {}
    with torch.no_grad():
        for p, q in zip(model.parameters(), twin):
            p.copy_(q)
    opt = ShardedAdamW(model.parameters(), lr=0.1)
    opt.load_state_dict(saved)
    start = [s["master"].clone() for s in opt.state_dict()["state"].values()]
    twin_start = [q.detach().clone() for q in twin]
    _step_with_torch(opt, model, torch_opt, twin)
    state = opt.state_dict()["state"]
    assert [float(state[i]["step"]) for i in range(2)] == [2.0, 1.0]
    for i, q in enumerate(twin):
        # the updates (the masters start apart by the bf16 rounding of torch's weights): Adam's first step moves
        # each element by ~lr, its second by another bias correction; fp32 ulps of the weights (~3e-8) in these
        torch.testing.assert_close(state[i]["master"] - start[i], q.detach() - twin_start[i], rtol=0, atol=1e-6)
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(state[i][key], torch_opt.state[q][key])


def test_torch_adams_state_dict_loads_where_it_has_no_weight_decay_and_is_named_where_it_has():
    """torch.optim.Adam is AdamW where weight_decay=0: its state dict loads and trains on (a run moved from
    torch.optim.Adam). With weight decay, Adam's is an L2 penalty in the gradient (its groups hold
    decoupled_weight_decay=False), which ShardedAdamW does not have: until session 50 the load took it as AdamW's
    decoupled decay, silently; now a ValueError naming it, before anything is loaded."""
    for wd in (0.0, 0.01):
        model = torch.nn.Linear(5, 3).to(torch.bfloat16)
        twin = [torch.nn.Parameter(p.detach().float().clone()) for p in model.parameters()]
        adam = torch.optim.Adam(twin, lr=0.1, weight_decay=wd)
        for p in twin:
            p.grad = torch.randn(p.shape)
        adam.step()
        opt = ShardedAdamW(model.parameters(), lr=0.1, weight_decay=0.0)
        if wd:
            with pytest.raises(ValueError, match=r"weight_decay with decoupled_weight_decay=False \(torch\.optim\."
                                                 r"Adam's L2 penalty in the gradient\).*\(param_groups\[0\] of the "
                                                 r"state dict\)"):
                opt.load_state_dict(adam.state_dict())
            assert opt.param_groups[0]["lr"] == 0.1 and opt.param_groups[0]["weight_decay"] == 0.0
            continue
        opt.load_state_dict(adam.state_dict())
        model(torch.randn(2, 5, dtype=torch.bfloat16)).float().sum().backward()
        before = [p.detach().clone() for p in model.parameters()]
        opt.step()
        assert not all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
