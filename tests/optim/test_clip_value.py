"""``torch.nn.utils.clip_grad_value_`` on a model trained by a tritonshard optimizer (Lightning's
``gradient_clip_algorithm="value"``, accelerate's ``clip_grad_value_``): the reduced, averaged gradient is clamped,
as torch.optim with DDP clamps its averaged ``.grad``. Until session 13 it raised (clamp_ on a placeholder); until
session 14 an inf the clamp made finite still skipped the step.

Compared with torch.optim.SGD on an fp32 twin whose gradients are what ours average to (bf16 values; at 2 ranks
the bf16 sum the reduce-scatter makes, halved), with a clip value that bf16 represents exactly (0.25), so that
the clamp gives the same values on both sides: masters to 1e-6 (fp32 op order; without the clamp they differ by
~0.1, with a clamp at the wrong scale by ~0.04). SGD, not AdamW: its update is proportional to the gradient, so a
wrong clamp shows."""

import copy

import pytest
import torch

from tests.distributed import run_on_ranks
from tritonshard import LossScaleConfig, ShardedSGD

CLIP = 0.25  # exact in bf16, and so is CLIP / world size
MAX_NORM = 2.0  # below the gradients' norm (~6), so that the norm clipping bites too


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(9, 13), torch.nn.Tanh(), torch.nn.Linear(13, 5)).to(torch.bfloat16)


def _loss(model, step, rank):
    x = torch.randn(4, 9, generator=torch.Generator().manual_seed(100 * step + rank)).to(model[0].weight.dtype)
    return model(x).float().square().mean() * 20  # (large enough gradients for the clamp to bite)


INF_AT = 1  # the step whose rank-0 gradient of model[2].weight holds +inf and -inf (``inf=True``)


def _inject_inf(param, when):
    """A hook that puts +inf and -inf into two elements of ``param``'s gradient while ``when()`` (before the
    gradient accumulates: the optimizer's hooks, after it, see it as an overflow of the backward would be)."""
    def hook(g):
        if not when():
            return g
        g = g.clone()
        g.view(-1)[3], g.view(-1)[7] = float("inf"), float("-inf")
        return g
    param.register_hook(hook)


def _clipped_run(rank, world_size, how, inf=False):
    """A real backward (the gradients become the optimizer's placeholders), then torch's clipping on
    model.parameters(); the twin gets the average of every rank's bf16 gradients, computed here on a bf16 copy that
    holds our weights. ``inf``: rank 0's gradient of model[2].weight holds +inf and -inf at step INF_AT, which the
    clamp makes +-CLIP, and torch.optim steps with them."""
    model = _model()
    copy_ = copy.deepcopy(model)
    twin = copy.deepcopy(model).float()
    opt = ShardedSGD(model.parameters(), lr=0.1, momentum=0.5)
    topt = torch.optim.SGD(twin.parameters(), lr=0.1, momentum=0.5)
    now = {"step": 0, "rank": rank}
    if inf:
        _inject_inf(model[2].weight, lambda: now["step"] == INF_AT and rank == 0)
        _inject_inf(copy_[2].weight, lambda: now["step"] == INF_AT and now["rank"] == 0)
    for step in range(3):
        now["step"] = step
        _loss(model, step, rank).backward()
        copy_.load_state_dict(model.state_dict())
        total = None
        for r in range(world_size):
            now["rank"] = r
            copy_.zero_grad()
            _loss(copy_, step, r).backward()
            grads = [p.grad.clone() for p in copy_.parameters()]
            total = grads if total is None else [a + b for a, b in zip(total, grads)]  # (bf16 adds, as gloo's)
        for q, g in zip(twin.parameters(), total):
            q.grad = g.float() / world_size
        assert any(bool((q.grad.abs() > CLIP).any()) for q in twin.parameters()), "the clip value clamps some"
        for m in (model, twin):
            if how == "value":
                torch.nn.utils.clip_grad_value_(m.parameters(), CLIP)
            elif how == "value, foreach":
                torch.nn.utils.clip_grad_value_(m.parameters(), CLIP, foreach=True)
            elif how == "norm, then value":
                torch.nn.utils.clip_grad_norm_(m.parameters(), MAX_NORM)
                torch.nn.utils.clip_grad_value_(m.parameters(), CLIP)
            elif how == "value, then norm":  # the norm sees the clamped values
                torch.nn.utils.clip_grad_value_(m.parameters(), CLIP)
                torch.nn.utils.clip_grad_norm_(m.parameters(), MAX_NORM)
            elif how == "logged norms, value, norm":  # norms read before the clamp are not the clipping's
                [torch.linalg.vector_norm(p.grad) for p in m.parameters()]  # (a logger's per-parameter norms)
                torch.nn.utils.clip_grad_value_(m.parameters(), CLIP)
                torch.nn.utils.clip_grad_norm_(m.parameters(), MAX_NORM)
        if how == "value, then ours":  # opt.clip_grad_norm_ and grad_norm() after a clamp: the clamped values' norm
            torch.nn.utils.clip_grad_value_(model.parameters(), CLIP)
            torch.nn.utils.clip_grad_value_(twin.parameters(), CLIP)
            theirs = torch.nn.utils.clip_grad_norm_(twin.parameters(), MAX_NORM)
            torch.testing.assert_close(opt.grad_norm(), theirs, rtol=1e-5, atol=0)
            torch.testing.assert_close(opt.clip_grad_norm_(MAX_NORM), theirs, rtol=1e-5, atol=0)
        opt.step()
        topt.step()
        assert not opt.last_step_skipped, f"step {step} was skipped"
        opt.zero_grad()
        topt.zero_grad()
    state = opt.state_dict()["state"]
    # torch's clip_grad_norm_ over bf16 gradients computes its norm, so its coefficient, in bf16 (as torch does on a
    # bf16 model; the fp32 twin's is fp32): up to 2^-8 relative on the clipped steps' update, lr * 2^-8 * |g| <= 4e-4
    # over these steps; a missing clamp or one at the wrong scale moves the masters by > 1e-2
    atol = 1e-3 if "norm" in how else 1e-6
    for i, q in enumerate(twin.parameters()):
        torch.testing.assert_close(state[i]["master"], q.detach(), rtol=0, atol=atol,
                                   msg=lambda m, i=i: f"{how}, rank {rank} of {world_size}, parameter {i}: {m}")


@pytest.mark.parametrize("how", ["value", "value, foreach", "norm, then value", "value, then norm",
                                 "logged norms, value, norm", "value, then ours"])
def test_clip_grad_value_clamps_the_averaged_gradient_as_with_torch_optim(how):
    _clipped_run(0, 1, how)


def test_clip_grad_value_on_two_ranks_clamps_the_average():
    run_on_ranks(_clipped_run, 2, "norm, then value")


@pytest.mark.parametrize("how", ["value", "value, then norm"])
def test_an_inf_gradient_clamped_by_value_steps_as_with_torch_optim(how):
    """torch.optim steps with an inf clamped to the clip value (until session 14 ours skipped that step: its
    non-finite flag was the reduction's, taken before the clamp). (Norm clipping first makes the norm inf and the
    coefficient 0, so torch's gradients NaN, inf * 0: that order is in the next test.)"""
    _clipped_run(0, 1, how, inf=True)


def test_an_inf_gradient_clamped_by_value_on_two_ranks():
    run_on_ranks(_clipped_run, 2, "value", True)


def test_a_one_sided_clamp_and_a_mix_with_plain_tensors():
    """clamp_min_ alone, through the foreach op, over a list that also holds a tensor of no optimizer."""
    model = _model()
    twin = copy.deepcopy(model).float()
    copy_ = copy.deepcopy(model)
    opt = ShardedSGD(model.parameters(), lr=0.1)
    topt = torch.optim.SGD(twin.parameters(), lr=0.1)
    _loss(model, 0, 0).backward()
    _loss(copy_, 0, 0).backward()
    for q, p in zip(twin.parameters(), copy_.parameters()):
        q.grad = p.grad.float()
    extra = torch.randn(7)
    torch._foreach_clamp_min_([p.grad for p in model.parameters()] + [extra], -CLIP)
    torch._foreach_clamp_min_([q.grad for q in twin.parameters()], -CLIP)
    assert float(extra.min()) >= -CLIP and any(bool((q.grad == -CLIP).any()) for q in twin.parameters())
    opt.step()
    topt.step()
    for i, q in enumerate(twin.parameters()):
        torch.testing.assert_close(opt.state_dict()["state"][i]["master"], q.detach(), rtol=0, atol=1e-6)


@pytest.mark.parametrize("case", ["NaN", "one-sided clamp", "norm clipping first", "own loss scale", "GradScaler"])
def test_gradients_left_non_finite_by_the_clamp_still_skip_the_step(case):
    """What the clamp leaves non-finite still skips the step, weights and state unchanged: a NaN (torch's clamp
    keeps it, and torch.optim would write NaN into the weights), a -inf under a clamp from above only, an inf after
    norm clipping (torch: inf * coefficient 0 = NaN). With the optimizer's own loss scale (fp16) an inf is an
    overflow: skipped and the scale backed off, clamped or not; so with torch's GradScaler, whose flag
    ``unscale_`` takes before the clamp."""
    model = _model()
    own_scale = case == "own loss scale"
    if own_scale:
        model = model.half()
    # (an initial scale of 2^8: the default 2^16 overflows these fp16 gradients at step 0, as dynamic scaling may)
    opt = ShardedSGD(model.parameters(), lr=0.1, momentum=0.5,
                     **({"param_dtype": torch.float16, "loss_scale": LossScaleConfig(init_scale=2.0 ** 8)}
                        if own_scale else {}))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8) if case == "GradScaler" else None
    bad = {"step": 1}

    def hook(g):
        if bad["step"]:
            g = g.clone()
            g.view(-1)[3] = float("nan") if case == "NaN" else float("-inf")
        return g
    model[2].weight.register_hook(hook)
    for step in range(2):
        bad["step"] = step == 1
        before = [p.detach().clone() for p in model.parameters()]
        state = opt.state_dict()["state"]
        scale = float(opt.loss_scale if scaler is None else scaler.get_scale()) if own_scale or scaler else None
        loss = _loss(model, step, 0)
        (scaler.scale(loss) if scaler else opt.scale_loss(loss)).backward()
        if scaler:
            scaler.unscale_(opt)
        if case == "one-sided clamp":
            for p in model.parameters():
                p.grad.clamp_(max=CLIP)
        elif case == "norm clipping first":
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
            torch.nn.utils.clip_grad_value_(model.parameters(), CLIP)
        else:
            torch.nn.utils.clip_grad_value_(model.parameters(), CLIP)
        if scaler:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        opt.zero_grad()
        assert bool(opt.last_step_skipped) == bad["step"], f"{case}, step {step}"
        if bad["step"]:
            for a, b in zip(model.parameters(), before):
                assert torch.equal(a.detach(), b), case
            after = opt.state_dict()["state"]
            for i in state:
                for key in state[i]:
                    assert torch.equal(after[i][key], state[i][key]), (case, i, key)
            if own_scale:
                assert float(opt.loss_scale) < scale, "the loss scale backs off"
            if scaler:
                assert scaler.get_scale() < scale, "GradScaler backs off"
        else:
            assert not all(torch.equal(a.detach(), b) for a, b in zip(model.parameters(), before)), case
