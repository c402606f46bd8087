"""``param.grad`` after ``step()``: torch.optim leaves the gradient there until the loop clears it, so a loop
without ``zero_grad()`` between two steps applies it again, or adds the next backward's gradient to it.
tritonshard's step consumes the reduced gradient; ``param.grad`` then holds a ``SpentGrad`` marker, and every
use torch.optim would make of the old gradient is an error instead of a silently different step (until session 18
``param.grad`` was None after ``step()``: a second step skipped every parameter, and accumulation across steps
restarted from zero). Clearing or zeroing it works as in torch."""

import copy
import io

import pytest
import torch

from tests.distributed import run_on_ranks
from tests.helpers import assert_bitwise_equal
from tritonshard import ShardedAdamW
from tritonshard.optim.model_sync import SpentGrad

SPENT = r"was used by the last step\(\) and is gone"


class _TwoHeads(torch.nn.Module):
    """A trunk and two heads; the loss uses the heads it is asked for (a head without a gradient shows whether a
    step applied a zero gradient to it, as torch.optim does, or skipped it)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.trunk = torch.nn.Linear(7, 13)
        self.a = torch.nn.Linear(13, 3)
        self.b = torch.nn.Linear(13, 2)

    def loss(self, x, heads=("a", "b")):
        h = torch.tanh(self.trunk(x.to(self.trunk.weight.dtype)))
        return sum(getattr(self, k)(h).float().pow(2).mean() for k in heads)


def _x(i: int) -> torch.Tensor:
    return torch.randn(5, 7, generator=torch.Generator().manual_seed(i))


def _state(opt, model) -> dict:
    """Weights, fp32 masters and moments by name (a failed call must leave every bit of them)."""
    names = [n for n, _ in model.named_parameters()]
    out = {n: p.detach().clone() for n, p in model.named_parameters()}
    for i, entry in opt.state_dict()["state"].items():
        for key, value in entry.items():
            out[f"{names[i]}.{key}"] = value.clone() if torch.is_tensor(value) else value
    return out


def _assert_same(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert_bitwise_equal(a[key], b[key], f"{what}: {key}")


@pytest.mark.parametrize("overlap", [False, True], ids=["", "overlap_comm"])
def test_a_second_step_without_zero_grad_is_an_error_and_changes_nothing(overlap):
    model = _TwoHeads()
    opt = ShardedAdamW(model.parameters(), lr=1e-2, weight_decay=0.1, overlap_comm=overlap)
    model.loss(_x(0)).backward()
    opt.step()
    assert all(isinstance(p.grad, SpentGrad) for p in model.parameters())
    before = _state(opt, model)
    with pytest.raises(RuntimeError, match=r"while the param.grad of 6 parameters still holds the last step\(\)'s gradient: .*" + SPENT):
        opt.step()  # torch.optim would apply the same gradients a second time
    _assert_same(before, _state(opt, model), "after the refused step")
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    model.loss(_x(1)).backward()
    opt.step()  # trains on
    assert not torch.equal(model.trunk.weight.detach(), before["trunk.weight"])


@pytest.mark.parametrize("use", ["step()", "opt.clip_grad_norm_", "torch's clip_grad_norm_", "opt.grad_norm()"])
def test_a_backward_onto_spent_gradients_is_an_error_where_the_sum_would_be_used(use):
    model = _TwoHeads()
    opt = ShardedAdamW(model.parameters(), lr=1e-2)
    model.loss(_x(0)).backward()
    opt.step()
    before = _state(opt, model)
    model.loss(_x(1)).backward()  # no zero_grad(): torch.optim's param.grad is the sum of both backwards
    with pytest.raises(RuntimeError, match=r"after a backward that added to the last step\(\)'s gradients \(6 parameters; no "
                                           r"zero_grad\(\) in between\).*" + SPENT):
        if use == "step()":
            opt.step()
        elif use == "opt.clip_grad_norm_":
            opt.clip_grad_norm_(1.0)
        elif use == "torch's clip_grad_norm_":
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        else:
            opt.grad_norm()
    _assert_same(before, _state(opt, model), f"after the refused {use}")


def test_a_backward_onto_the_spent_gradients_of_some_parameters_only_is_an_error():
    # head b got no gradient in the second backward: its param.grad still holds the spent marker (torch.optim
    # would apply its old gradient again), head a's is a sum (torch.optim would add): the step names them
    model = _TwoHeads()
    opt = ShardedAdamW(model.parameters(), lr=1e-2)
    model.loss(_x(0)).backward()
    opt.step()
    model.loss(_x(1), heads=("a",)).backward()
    assert isinstance(model.b.weight.grad, SpentGrad) and not isinstance(model.a.weight.grad, SpentGrad)
    with pytest.raises(RuntimeError, match=r"param.grad of 2 parameters still holds.*the gradient of "
                                           r"param_groups\[0\]\['params'\]\[4\] \(shape \(2, 13\)\)"):
        opt.step()


def _train(clear: str, overlap: bool = False, steps: int = 4) -> dict:
    """``steps`` steps with every head, the spent gradients cleared after each step() by ``clear``; the state."""
    model = _TwoHeads()
    opt = ShardedAdamW(model.parameters(), lr=1e-2, weight_decay=0.1, overlap_comm=overlap)
    for i in range(steps):
        model.loss(_x(i)).backward()
        opt.step()
        if clear.startswith("a backward, then "):  # harmless in torch: the sum is cleared before anything uses it
            with opt.no_sync():  # (head a only: head b's parameters keep their markers until the clear)
                model.loss(_x(100 + i), heads=("a",)).backward()
            clear = clear[len("a backward, then "):]
        if clear == "opt.zero_grad()":
            opt.zero_grad()
        elif clear == "model.zero_grad()":
            model.zero_grad()
        elif clear == "p.grad = None":
            for p in model.parameters():
                p.grad = None
        else:
            raise AssertionError(clear)
    return _state(opt, model)


@pytest.mark.parametrize("clear, overlap", [
    ("model.zero_grad()", False), ("p.grad = None", False), ("a backward, then opt.zero_grad()", False),
    ("a backward, then model.zero_grad()", False), ("model.zero_grad()", True),
    ("a backward, then opt.zero_grad()", True), ("a backward, then model.zero_grad()", True),
    ("a backward, then p.grad = None", True)])
def test_clearing_the_spent_gradients_trains_as_opt_zero_grad_does(clear, overlap):
    _assert_same(_train("opt.zero_grad()", overlap), _train(clear, overlap), clear)


@pytest.mark.parametrize("zero", ["model.zero_grad(set_to_none=False)", "p.grad.zero_()"])
def test_zeroing_the_spent_gradients_makes_zero_gradients_as_torch_optim_does(zero):
    # torch: a zeroed param.grad stays a gradient, which the next backward adds to and step() applies even where
    # that backward gave none (head b: weight decay and the moments move it); opt.zero_grad(set_to_none=False) does
    # that here already (tests/optim/test_unused_params.py), so the zeroed markers must give the same bits
    runs = {}
    for how in ("opt.zero_grad(set_to_none=False)", zero, "opt.zero_grad()"):
        model = _TwoHeads()
        opt = ShardedAdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        model.loss(_x(0)).backward()
        opt.step()
        if how == "opt.zero_grad(set_to_none=False)":
            opt.zero_grad(set_to_none=False)
        elif how == "model.zero_grad(set_to_none=False)":
            model.zero_grad(set_to_none=False)
        elif how == "p.grad.zero_()":  # the pre-set_to_none idiom
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.zero_()
        else:
            opt.zero_grad()
        if how == zero:  # a gradient of zeros, as torch's zeroed tensor: there (not None), no marker
            assert all(p.grad is not None and not isinstance(p.grad, SpentGrad) for p in model.parameters())
        model.loss(_x(1), heads=("a",)).backward()
        opt.step()
        runs[how] = _state(opt, model)
    _assert_same(runs["opt.zero_grad(set_to_none=False)"], runs[zero], zero)
    assert not torch.equal(runs[zero]["b.weight"], runs["opt.zero_grad()"]["b.weight"]), \
        "a zero gradient is applied to head b (decay), not skipped as a cleared one is"


def test_a_step_with_every_spent_gradient_zeroed_and_no_backward_applies_zeros():
    runs = []
    for zero in (lambda opt, model: opt.zero_grad(set_to_none=False),
                 lambda opt, model: model.zero_grad(set_to_none=False)):
        model = _TwoHeads()
        opt = ShardedAdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        model.loss(_x(0)).backward()
        opt.step()
        zero(opt, model)
        before = model.a.weight.detach().clone()
        opt.step()
        assert not torch.equal(model.a.weight.detach(), before), "weight decay on a zero gradient"
        runs.append(_state(opt, model))
    _assert_same(runs[0], runs[1], "model.zero_grad(set_to_none=False), then step() without a backward")


def test_reading_a_spent_gradient_is_an_error_and_the_models_own_paths_work():
    model = _TwoHeads()
    opt = ShardedAdamW(model.parameters(), lr=1e-2)
    model.loss(_x(0)).backward()
    opt.step()
    g = model.trunk.weight.grad
    assert g is not None and g.shape == model.trunk.weight.shape and g.dtype == torch.bfloat16  # as torch's
    assert "trunk" in repr(g) or "param_groups[0]['params'][0]" in repr(g)
    for read in (lambda: g.norm(), lambda: g.sum(), lambda: g.float().abs().max(), lambda: g.clone(), lambda: g.data,
                 lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)):
        with pytest.raises(RuntimeError, match=SPENT):
            read()
    # the model's own paths: a deep copy has no gradient; pickling and conversions on the same device go on
    twin = copy.deepcopy(model)
    assert all(p.grad is None for p in twin.parameters())
    for a, b in zip(model.parameters(), twin.parameters()):
        assert_bitwise_equal(a.detach(), b.detach(), "deep copy")
    torch.save(model, io.BytesIO())
    model.cpu()
    model.to("cpu")
    assert isinstance(model.trunk.weight.grad, SpentGrad)
    opt.zero_grad()
    model.loss(_x(1)).backward()
    opt.step()


def _on_ranks(rank, world_size):
    model = _TwoHeads()
    opt = ShardedAdamW(model.parameters(), lr=1e-2, bucket_cap_mb=1e-9)
    model.loss(_x(rank)).backward()
    opt.step()
    with pytest.raises(RuntimeError, match=SPENT):  # on every rank, before any collective: no rank waits
        opt.step()
    model.loss(_x(10 + rank)).backward()
    with pytest.raises(RuntimeError, match=SPENT):
        opt.step()
    opt.zero_grad()
    model.loss(_x(20 + rank)).backward()
    opt.step()  # the collectives still pair up
    weights = torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(weights) for _ in range(world_size)]
    torch.distributed.all_gather(gathered, weights)
    for other in gathered[1:]:
        assert_bitwise_equal(other, gathered[0], "every rank's weights")


def test_spent_gradients_on_two_ranks_raise_everywhere_and_training_goes_on():
    run_on_ranks(_on_ranks, 2)


@pytest.mark.parametrize("zero_first", [False, True], ids=["", "zero_grad(set_to_none=False) before"])
def test_a_spent_gradient_the_next_backward_did_not_reach_is_no_gradient_once_cleared(zero_first):
    # step(); a backward reaching head a only (head b keeps its marker: the spent gradient, still in the buffer);
    # model.zero_grad(); step(): torch.optim skips every parameter (all None). Before, head b's part of the buffer
    # (the first step's gradient) was stepped with again. Found by tests/optim/test_loop_fuzz.py
    model = _TwoHeads()
    opt = ShardedAdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    model.loss(_x(0)).backward()
    if zero_first:
        opt.zero_grad(set_to_none=False)
    opt.step()
    before = _state(opt, model)
    model.loss(_x(1), heads=("a",)).backward()
    model.zero_grad()
    opt.step()
    _assert_same(before, _state(opt, model), "a step after model.zero_grad()")
