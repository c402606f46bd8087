"""``torch.nn.utils.clip_grad_value_`` on a model trained by a tritonshard optimizer (Lightning's
``gradient_clip_algorithm="value"``, accelerate's ``clip_grad_value_``): the reduced, averaged gradient is clamped,
as torch.optim with DDP clamps its averaged ``.grad``. Until session 13 it raised (clamp_ on a placeholder).

Compared with torch.optim.SGD on an fp32 twin whose gradients are what ours average to (bf16 values; at 2 ranks
the bf16 sum the reduce-scatter makes, halved), with a clip value that bf16 represents exactly (0.25), so that
the clamp gives the same values on both sides: masters to 1e-6 (fp32 op order; without the clamp they differ by
~0.1, with a clamp at the wrong scale by ~0.04). SGD, not AdamW: its update is proportional to the gradient, so a
wrong clamp shows."""

import copy

import pytest
import torch

from tests.distributed import run_on_ranks
from tritonshard import ShardedSGD

CLIP = 0.25  # exact in bf16, and so is CLIP / world size
MAX_NORM = 2.0  # below the gradients' norm (~6), so that the norm clipping bites too


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(9, 13), torch.nn.Tanh(), torch.nn.Linear(13, 5)).to(torch.bfloat16)


def _loss(model, step, rank):
    x = torch.randn(4, 9, generator=torch.Generator().manual_seed(100 * step + rank)).to(torch.bfloat16)
    return model(x).float().square().mean() * 20  # (large enough gradients for the clamp to bite)


def _clipped_run(rank, world_size, how):
    """A real backward (the gradients become the optimizer's placeholders), then torch's clipping on
    model.parameters(); the twin gets the average of every rank's bf16 gradients, computed here on a bf16 copy that
    holds our weights."""
    model = _model()
    copy_ = copy.deepcopy(model)
    twin = copy.deepcopy(model).float()
    opt = ShardedSGD(model.parameters(), lr=0.1, momentum=0.5)
    topt = torch.optim.SGD(twin.parameters(), lr=0.1, momentum=0.5)
    for step in range(3):
        _loss(model, step, rank).backward()
        copy_.load_state_dict(model.state_dict())
        total = None
        for r in range(world_size):
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
