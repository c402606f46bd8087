"""The kernels as torch.library custom ops: a torch.compile'd step calls them with no graph break."""

import torch

from tests.helpers import assert_bitwise_equal
from tests.kernels.common import DEVICE, randn
from tritonshard.kernels import adamw_step_, flatten_into, ops, scale_


def _step(eager: bool):
    """flatten -> scale (sum of squares, flag) -> AdamW with the clip coefficient folded into grad_scale."""
    flat = ops if not eager else None

    def step(grads, buf, param, m, v, param_out, lr):
        if eager:
            flatten_into(buf, grads, [0, 64])
            sumsq, nonfinite = scale_(buf, 0.5)
        else:
            flat.flatten_into(buf, grads, [0, 64])
            sumsq, nonfinite = flat.scale_(buf, 0.5)
        clip = torch.clamp(1.0 / (sumsq.sqrt() + 1e-6), max=1.0)
        kw = dict(lr=lr, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, step=1, grad_scale=clip,
                  found_inf=nonfinite, param_out=param_out)
        (adamw_step_ if eager else flat.adamw_step_)(param, buf, m, v, **kw)
        return sumsq

    return step


def test_compiled_step_matches_eager_without_graph_breaks():
    grads = [randn(50, 1), randn(70, 2, torch.bfloat16)]
    results = []
    for eager in (True, False):
        buf = torch.zeros(134, dtype=torch.bfloat16, device=DEVICE)
        param, m, v = randn(134, 3), torch.zeros(134, device=DEVICE), torch.zeros(134, device=DEVICE)
        out = torch.empty(134, dtype=torch.bfloat16, device=DEVICE)
        lr = torch.tensor(1e-2, dtype=torch.float64, device=DEVICE)
        fn = _step(eager)
        if not eager:
            torch._dynamo.reset()
            # fullgraph=True raises on any graph break; aot_eager runs functionalization over the mutations
            fn = torch.compile(fn, fullgraph=True, backend="aot_eager")
        sumsq = fn(grads, buf, param, m, v, out, lr)
        results.append((sumsq, buf, param, m, v, out))
    for name, a, b in zip(("sumsq", "buf", "param", "exp_avg", "exp_avg_sq", "param_out"), *results):
        assert_bitwise_equal(b, a, f"compiled vs eager {name}")
    assert not bool((results[1][2] == randn(134, 3)).all()), "the compiled step did update the parameters"
