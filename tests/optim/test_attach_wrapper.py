"""attach(wrapper) after attach(model): a wrapper made around an attached model (a user's nn.Module, PEFT's
PeftModel, torch.compile's OptimizedModule) and attached again. Its hooks take over from the inner model's: one set
of root hooks per forward (two sets made two buffer handshakes and broadcasts per forward on more than one rank,
until session 30) and one wait per module with overlap_comm, and the training is bit for bit that of a model
attached once, through the wrapper."""

import copy

import pytest
import torch

from tests.helpers import assert_bitwise_equal
from tritonshard import ShardedAdamW
from tritonshard.optim import model_sync


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.norm, self.fc2 = torch.nn.Linear(6, 12), torch.nn.LayerNorm(12), torch.nn.Linear(12, 3)

    def forward(self, x):
        return self.fc2(torch.relu(self.norm(self.fc1(x))))


class _Wrapper(torch.nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x) * 2.0


def _waits(root, opt):
    return {name: sum(type(h) is model_sync.WaitForParamsHook and h.optimizer() is opt
                      for h in m._forward_pre_hooks.values()) for name, m in root.named_modules()}


WRAPPERS = {"module": _Wrapper,
            # (the eager backend: what is tested is whose hooks run, which dynamo's tracing does not change)
            "torch.compile": lambda model: torch.compile(model, backend="eager")}


def _train(attach_inner_first: bool, overlap: bool, kind: str):
    torch.manual_seed(0)
    model = _Net()
    opt = ShardedAdamW(model.parameters(), lr=1e-2, overlap_comm=overlap, bucket_cap_mb=12 * 12 * 2 / 2 ** 20)
    if attach_inner_first:
        opt.attach(model)
    wrapper = WRAPPERS[kind](model)
    opt.attach(wrapper)
    roots = []
    before = opt._before_model_forward
    opt._before_model_forward = lambda module: (roots.append(module), before(module))[1]
    torch.manual_seed(1)
    for _ in range(3):
        with opt.no_sync():
            wrapper(torch.randn(5, 6)).float().square().mean().backward()
        wrapper(torch.randn(5, 6)).float().square().mean().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
    opt.wait_for_params()
    return copy.deepcopy(model.state_dict()), roots, _waits(wrapper, opt), wrapper, opt


@pytest.mark.parametrize("kind", sorted(WRAPPERS))
@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.usefixtures("with_overlap_machinery")  # (overlap_comm: the modules' waits of many ranks, in one process)
def test_a_wrapper_attached_after_its_model_runs_one_set_of_hooks_and_trains_as_attached_once(overlap, kind):
    weights, roots, waits, wrapper, opt = _train(attach_inner_first=True, overlap=overlap, kind=kind)
    reference, ref_roots, ref_waits, _, _ = _train(attach_inner_first=False, overlap=overlap, kind=kind)
    assert len(ref_roots) == 6 and all(m is not None for m in ref_roots), "the control: one root pre-hook per forward"
    assert len(roots) == 6 and all(m is wrapper for m in roots), \
        f"{len(roots)} root pre-hook runs in 6 forwards (the inner model's set still ran)"
    assert waits == ref_waits, f"waits per module {waits} (attached once: {ref_waits})"
    if overlap:
        assert max(waits.values()) == 1 and sum(waits.values()) == 3, waits  # fc1, norm, fc2
    for name in reference:
        assert_bitwise_equal(weights[name], reference[name], name)
    # the handles attach returned cover every hook of this optimizer still on the model: a later optimizer built
    # over the same parameters takes over and removes them all
    ShardedAdamW(wrapper.parameters(), lr=1e-2, overlap_comm=overlap)
    assert set(_waits(wrapper, opt).values()) <= {0}
    assert not any(isinstance(h, (model_sync.RootForwardPreHook, model_sync.RootForwardHook)) and h.optimizer() is opt
                   for m in wrapper.modules() for h in [*m._forward_pre_hooks.values(), *m._forward_hooks.values()])


@pytest.mark.parametrize("attached_before", [False, True])
def test_attaching_a_model_that_holds_none_of_the_parameters_is_an_error(attached_before):
    """attach() of another model than the optimizer's (a second model of a script, a copy made before building):
    its training would step nothing, silently (its parameters are in no optimizer). A clear error instead, which
    leaves an earlier attach in place. A model holding some of them (the trainable adapters of a frozen base
    model, with the optimizer over the adapters only) is attached as before."""
    model = _Net().to(torch.bfloat16)
    opt = ShardedAdamW(model.fc2.parameters(), lr=1e-2)  # (a subset: the model is the optimizer's)
    if attached_before:
        handles = opt.attach(model)
    other = copy.deepcopy(model)
    with pytest.raises(ValueError, match=r"attach\(\): _Net holds none of this optimizer's parameters"):
        opt.attach(other)
    with pytest.raises(ValueError, match="holds none of this optimizer's parameters"):
        opt.attach(torch.nn.Sequential(model.fc1, model.norm))  # (modules of the model, none of fc2's)
    if attached_before:
        assert opt.attach(model) is handles, "the earlier attach stands"
    else:
        opt.attach(model)
    model(torch.randn(4, 6)).float().sum().backward()
    before = model.fc2.weight.detach().clone()
    opt.step()
    assert not torch.equal(model.fc2.weight.detach(), before)
