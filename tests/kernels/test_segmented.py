"""Segmented launches (issue 20.3): one launch of an update kernel over several buckets' shards computes, bit for
bit, what one launch per bucket computes: fp32 and bf16 states, stochastic rounding with a key per bucket, the
remainder master, a skipped step, and buckets of odd sizes (0, 16, sizes that are no multiple of BLOCK; a size that
is no multiple of 16 does not merge). Through
the Triton interpreter, against the same kernel launched bucket by bucket (itself tested against the PyTorch
references in test_adamw.py and test_sgd_lion.py)."""

import pytest
import torch

from tests.helpers import assert_bitwise_equal
from tests.kernels.common import DEVICE, randn
from tritonshard.kernels import _launch, adamw, lion, sgd

# BLOCK is 2048 for every update kernel. A segment's numel is a multiple of 16 (what the kernel's masks assume, so
# its accesses stay 16 bytes wide; every shard of a Buffer with the default 64-element alignment is one): a
# single 16, a block and a bit, none, two blocks and a bit, a 3 x 16 tail, exactly one block
SIZES = [16, 2064, 0, 4112, 48, 2048]
ALIGN = 64  # a Buffer's element alignment: where a rank's shard starts inside the bucket's buffer


def _shard(n, seed, dtype):
    """A rank-1 shard of a two-rank buffer: a view ALIGN-aligned elements into a larger allocation, as the
    optimizer's grad and param shards are."""
    pad = -(-max(n, 1) // ALIGN) * ALIGN
    buffer = randn(2 * pad, seed, torch.float32, scale=1e-2).to(dtype)
    return buffer[pad:pad + n]


def _bucket(n, seed, state_dtype, remainders, stochastic):
    master = randn(n, seed, torch.float32)
    out = _shard(n, seed + 1, torch.bfloat16)
    if remainders:
        out.copy_(master.bfloat16())
        param = randn(n, seed + 2, torch.float32, scale=1000).to(torch.int16)
    else:
        param = master
    states = [randn(n, seed + 3 + k, torch.float32, scale=1e-3).abs().to(state_dtype) for k in range(2)]
    key = torch.tensor([1234 + 97 * seed], dtype=torch.int64, device=DEVICE) if stochastic else None
    return {"param": param, "grad": _shard(n, seed + 5, torch.bfloat16), "states": states, "out": out, "seed": key}


def _specs(kind, buckets, shared):
    coef, grad_scale, found_inf = shared
    specs = []
    for b in buckets:
        if kind == "adamw":
            specs.append(adamw.launch_spec(b["param"], b["grad"], *b["states"], coef, None, grad_scale, found_inf,
                                           b["out"], b["seed"], 0.9, 0.999, 1e-8, False, b["remainders"]))
        elif kind == "sgd":
            specs.append(sgd.launch_spec(b["param"], b["grad"], b["states"][0], coef, None, 3.0, grad_scale,
                                         found_inf, b["out"], b["seed"], 0.9, 0.0, 0.01, True, False,
                                         b["remainders"]))
        else:
            specs.append(lion.launch_spec(b["param"], b["grad"], b["states"][0], coef, None, grad_scale, found_inf,
                                          b["out"], b["seed"], 0.9, 0.99, False, b["remainders"]))
    return specs


def _coefficients(kind):
    lr = torch.tensor(3e-3, dtype=torch.float64, device=DEVICE)
    if kind == "adamw":
        return adamw.adamw_coefficients(lr, torch.tensor(5.0, device=DEVICE), 0.9, 0.999, 0.01)
    if kind == "sgd":
        return sgd.sgd_coefficients(lr, DEVICE)[0]
    return lion.lion_coefficients(lr, 0.1, DEVICE)[0]


def _copy(buckets):
    return [{k: ([s.clone() for s in v] if k == "states" else v.clone() if isinstance(v, torch.Tensor) else v)
             for k, v in b.items()} for b in buckets]


def _launch_all(specs):
    for kernel, grid, args, kwargs in specs:
        kernel[grid](*args, **kwargs)


@pytest.mark.parametrize("kind", ["adamw", "sgd", "lion"])
@pytest.mark.parametrize("state_dtype, stochastic, remainders",
                         [(torch.float32, False, False), (torch.bfloat16, True, False), (torch.bfloat16, False, True)])
@pytest.mark.parametrize("skipped", [False, True])
def test_one_segmented_launch_equals_one_launch_per_bucket(kind, state_dtype, stochastic, remainders, skipped):
    buckets = [_bucket(n, 10 * i, state_dtype, remainders, stochastic) for i, n in enumerate(SIZES)]
    for b in buckets:
        b["remainders"] = remainders
    before = _copy(buckets)
    shared = (_coefficients(kind), torch.tensor(0.37, device=DEVICE),
              torch.tensor(1.0 if skipped else 0.0, device=DEVICE))
    per_bucket, together = _copy(buckets), _copy(buckets)
    _launch_all(_specs(kind, per_bucket, shared))
    specs = _specs(kind, together, shared)
    merged = _launch.segmented_spec(specs, block=specs[0][3]["BLOCK"], **{"adamw": adamw, "sgd": sgd,
                                                                          "lion": lion}[kind].SEGMENTS)
    assert merged is not None, "aligned shards of one kernel's launches merge"
    assert merged[1] == (sum(-(-n // 2048) for n in SIZES),), "one program per block of every bucket"
    _launch_all([merged])
    for i, (a, b, old) in enumerate(zip(per_bucket, together, before)):
        states = 2 if kind == "adamw" else 1
        pairs = [("param", a["param"], b["param"], old["param"]), ("out", a["out"], b["out"], old["out"])]
        pairs += [(f"state {k}", a["states"][k], b["states"][k], old["states"][k]) for k in range(states)]
        for name, x, y, prior in pairs:
            assert_bitwise_equal(y, x, f"bucket {i} (numel {SIZES[i]}): {name}")
            if skipped or SIZES[i] == 0:
                assert_bitwise_equal(y, prior, f"bucket {i}: a skipped step writes nothing ({name})")
            elif name == "param" and SIZES[i] > 1:
                assert not torch.equal(y, prior), f"bucket {i}: the step must change the master"


def test_launches_that_differ_otherwise_do_not_merge():
    buckets = [_bucket(n, 10 * i, torch.float32, False, False) for i, n in enumerate([16, 80])]
    for b in buckets:
        b["remainders"] = False
    shared = (_coefficients("adamw"), torch.tensor(1.0, device=DEVICE), torch.tensor(0.0, device=DEVICE))
    specs = _specs("adamw", buckets, shared)
    merge = lambda s: _launch.segmented_spec(s, block=2048, **adamw.SEGMENTS)  # noqa: E731
    assert merge(specs) is not None
    other_eps = adamw.launch_spec(buckets[1]["param"], buckets[1]["grad"], *buckets[1]["states"], shared[0], None,
                                  shared[1], shared[2], buckets[1]["out"], None, 0.9, 0.999, 1e-6, False, False)
    assert merge([specs[0], other_eps]) is None, "another eps: two launches"
    misaligned = dict(buckets[1], grad=_shard(81, 99, torch.bfloat16)[1:])  # 1 element past a 64-element start
    (spec,) = _specs("adamw", [misaligned], shared)
    assert merge([specs[0], spec]) is None, "an offset that is no multiple of 16 elements: two launches"
    # an align=1 Buffer's shard: the kernel's mask would be wrong to assume 16-element steps (on a GPU the compiler
    # vectorizes by that promise), so it launches on its own
    odd = {k: (v[:40] if isinstance(v, torch.Tensor) and v.dim() else [x[:40] for x in v] if k == "states" else v)
           for k, v in buckets[1].items()}
    (spec,) = _specs("adamw", [odd], shared)
    assert merge([specs[0], spec]) is None, "a numel that is no multiple of 16: two launches"
    assert merge(specs) is not None
