"""torch's schedulers that change more than the lr at every step: OneCycleLR's and CyclicLR's ``cycle_momentum`` (on
by default) cycles beta1 of Adam-like optimizers and SGD's momentum. Each step's values must reach the update: the bound
launches take new floats and hyper-parameter bits at each call (kernels/_launch.py; until session 36 each change
bound every launch anew, ~15 ms of host time per 125M step, which benchmarks.host_overhead would show), and the
masters must follow torch.optim's within 2e-6 (fp32 op order, as tests/optim/test_loop_fuzz.py), far below what
one step with the wrong beta or momentum moves them (~1e-4 here)."""

import pytest
import torch

from tests.optim.training import make_model, small_step, small_trained
from tritonshard import ShardedAdamW, ShardedSGD

CASES = {
    "adamw": (ShardedAdamW, torch.optim.AdamW, dict(weight_decay=0.05), lambda g: g["betas"][0]),
    "sgd": (ShardedSGD, torch.optim.SGD, dict(momentum=0.9, dampening=0.1, weight_decay=0.01),
            lambda g: g["momentum"]),
}


#: schedulers that cycle the momentum (beta1 of Adam-like optimizers) with the lr, by default
SCHEDULERS = {
    "OneCycleLR": lambda opt: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=5e-2, total_steps=10),
    "CyclicLR": lambda opt: torch.optim.lr_scheduler.CyclicLR(opt, base_lr=1e-3, max_lr=5e-2, step_size_up=4),
}


@pytest.mark.parametrize("scheduler", sorted(SCHEDULERS))
@pytest.mark.parametrize("name", sorted(CASES))
def test_momentum_cycling_schedulers_match_torch_optim(name, scheduler):
    ours, theirs, hparams, cycled = CASES[name]
    model, ref = make_model(1), make_model(1)
    trainable = [p for p in model.parameters() if p.requires_grad]
    ref_params = [p for p in ref.parameters() if p.requires_grad]
    opt = ours(trainable, lr=1e-2, **hparams)
    ref_opt = theirs(ref_params, lr=1e-2, foreach=False, **hparams)
    schedulers = [SCHEDULERS[scheduler](o) for o in (opt, ref_opt)]
    seen = []
    for step in range(7):
        g = torch.Generator().manual_seed(step)
        grads = [torch.randn(p.shape, generator=g).to(torch.bfloat16) for p in trainable]
        for p, q, grad in zip(trainable, ref_params, grads):
            p.grad, q.grad = grad, grad.float()
        if step % 2:
            opt.clip_grad_norm_(0.5)  # (a clip in every other step: two variants of each launch)
            torch.nn.utils.clip_grad_norm_(ref_params, 0.5, foreach=False)
        opt.step()
        ref_opt.step()
        for s in schedulers:
            s.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        seen.append((opt.param_groups[0]["lr"], cycled(opt.param_groups[0])))
    assert all(a[0] != b[0] and a[1] != b[1] for a, b in zip(seen, seen[1:])), (
        f"the schedule must change the lr and {name}'s momentum at every step: {seen}")
    state = opt.state_dict()["state"]
    for i, (p, q) in enumerate(zip(trainable, ref_params)):
        torch.testing.assert_close(state[i]["master"].reshape(q.shape), q.detach(), rtol=0, atol=2e-6,
                                   msg=lambda m: f"parameter {i}: {m}")


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")  # (stepped here on purpose)
@pytest.mark.parametrize("kind", ["adamw", "sgd", "lion", "muon"])
def test_an_lr_decayed_below_fp32s_normal_range_steps_as_a_zero_lr(kind):
    """ExponentialLR over a long run takes the lr below fp32's smallest normal number (2^-126): Triton gives such a
    float argument an fp64 parameter, and ShardedSGD's launch failed there ("Cannot bitcast data-type of size 64")
    until session 52, after the gradients were reduced. An fp32 step with such an lr moves no master of a normal
    magnitude (torch.optim's fp32 step leaves them too): the step is the step with lr 0, bit for bit, masters,
    moments and weights."""
    model, opt, _ = small_trained(kind)
    twin, twin_opt, _ = small_trained(kind)
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=1e-20)
    for _ in range(2):
        sched.step()
    assert all(0 < g["lr"] < 2.0 ** -126 for g in opt.param_groups), [g["lr"] for g in opt.param_groups]
    for g in twin_opt.param_groups:
        g["lr"] = 0.0
    torch.manual_seed(1)
    small_step(model, opt)
    torch.manual_seed(1)
    small_step(twin, twin_opt)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters()))
    ours, zero = opt.state_dict()["state"], twin_opt.state_dict()["state"]
    for key, entry in zero.items():
        assert all(torch.equal(entry[name], ours[key][name]) for name in entry), key
