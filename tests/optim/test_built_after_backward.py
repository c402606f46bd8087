"""An optimizer built after a backward (a loop that makes its optimizer lazily, at the first step) uses the
gradients the parameters hold, as torch.optim does: its first ``step()`` applies them. Until session 14
construction dropped them (laying a parameter out in a buffer set its ``.grad`` to None), so that first step
silently updated nothing. The reference is bitwise: the same optimizer built before the backward."""

import pytest
import torch

from tests.distributed import run_on_ranks
from tests.helpers import assert_bitwise_equal
from tritonshard import ShardedAdamW, ShardedSGD

MAKE = {
    "adamw": lambda params: ShardedAdamW(params, lr=1e-2, weight_decay=0.1),
    "sgd": lambda params: ShardedSGD(params, lr=1e-1, momentum=0.9),
}


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(9, 13), torch.nn.Tanh(), torch.nn.Linear(13, 5)).to(torch.bfloat16)


def _loss(model, step, rank):
    x = torch.randn(4, 9, generator=torch.Generator().manual_seed(100 * step + rank)).to(torch.bfloat16)
    return model(x).float().square().mean()


def _lazy_run(rank, world_size, kind):
    runs = []
    for lazy in (False, True):
        model = _model()
        opt = None if lazy else MAKE[kind](model.parameters())
        for step in range(3):
            _loss(model, step, rank).backward()
            if opt is None:  # built at the first step, the gradients of its backward held by the parameters
                held = [p.grad.clone() for p in model.parameters()]
                opt = MAKE[kind](model.parameters())
                for p, g in zip(model.parameters(), held):
                    assert_bitwise_equal(p.grad, g, "the gradient a parameter held is still its .grad")
            opt.step()
            opt.zero_grad()
        runs.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*runs):
        assert_bitwise_equal(b, a, f"{kind}, rank {rank} of {world_size}: built after the first backward against "
                             "built before it")


@pytest.mark.parametrize("kind", list(MAKE))
def test_an_optimizer_built_after_a_backward_steps_with_its_gradients(kind):
    _lazy_run(0, 1, kind)


def test_an_optimizer_built_after_a_backward_on_two_ranks():
    run_on_ranks(_lazy_run, 2, "adamw")


def test_an_fp32_gradient_is_kept_in_the_weights_dtype():
    """A model still in fp32 at the backward: construction makes its weights bf16 views, so the gradient is kept
    as bf16 (the dtype autograd requires of a parameter's .grad), rounded once, and the first step uses it: the
    same bits as the gradient set by hand after construction."""
    runs = []
    for after in (False, True):
        torch.manual_seed(0)
        model = torch.nn.Linear(9, 5)
        if after:
            model(torch.randn(4, 9, generator=torch.Generator().manual_seed(1))).square().sum().backward()
            grads = [p.grad.to(torch.bfloat16) for p in model.parameters()]
        opt = ShardedSGD(model.parameters(), lr=1.0)
        if after:
            for p, g in zip(model.parameters(), grads):
                assert p.grad.dtype == torch.bfloat16 == p.dtype
                assert_bitwise_equal(p.grad, g, "the held gradient, rounded once")
        else:  # the reference: the same fp32 gradients computed on a twin, rounded, set by hand
            torch.manual_seed(0)
            fp32 = torch.nn.Linear(9, 5)  # (the fp32 weights the other run's backward saw)
            fp32(torch.randn(4, 9, generator=torch.Generator().manual_seed(1))).square().sum().backward()
            for p, q in zip(model.parameters(), fp32.parameters()):
                p.grad = q.grad.to(torch.bfloat16)
        opt.step()
        runs.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*runs):
        assert_bitwise_equal(b, a, "built after an fp32 backward against the gradient set by hand")


def test_with_its_own_loss_scale_a_held_gradient_is_an_error():
    """Its own loss scale (fp16 weights) divides the gradients by the scale: one from a backward before the
    optimizer existed was never multiplied by it. A clear error (before anything changed), and after zero_grad the
    construction works."""
    model = _model().half()
    model(torch.randn(4, 9).half()).float().sum().backward()
    with pytest.raises(ValueError, match=r"hold gradients from a backward run before this ShardedSGD.*zero_grad"):
        ShardedSGD(model.parameters(), lr=0.1, param_dtype=torch.float16)
    assert model[0].weight.grad is not None and model[0].weight.dtype == torch.float16
    model.zero_grad()
    ShardedSGD(model.parameters(), lr=0.1, param_dtype=torch.float16)
