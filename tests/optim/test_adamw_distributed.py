"""ShardedAdamW on 1, 2 and 4 gloo processes against a single-process reference (tests/optim/training.py)."""

import os

import pytest
import torch
import torch.distributed as dist

from tests.distributed import run_on_ranks
from tests.optim.training import LR, Reference, make_model, param_groups, schedule, train_step
import tritonshard
from tritonshard import ShardedAdamW
from tritonshard.comm import all_gather_single

STEPS = 4


def _gather_equal(t: torch.Tensor, what: str):
    world = dist.get_world_size()
    out = torch.empty(world * t.numel(), dtype=t.dtype)
    all_gather_single(out, t.contiguous())
    rows = out.view(world, -1).view(torch.uint8)  # compare bits
    for r in range(1, world):
        assert torch.equal(rows[r], rows[0]), f"{what} differs between rank 0 and rank {r}"


def _master_error(opt, ref_master_by_param):
    """max |ours - ref| / max |ref| over this rank's master shard pieces."""
    worst, scale = 0.0, 0.0
    for b in opt.buckets:
        for piece in b.param_buffer.shard_pieces():
            ref = ref_master_by_param[b.params[piece.tensor_index]].reshape(-1)[piece.tensor_start:piece.tensor_end]
            ours = b.master[piece.shard_start:piece.shard_end]
            worst = max(worst, float((ours.double() - ref.double()).abs().max()))
            scale = max(scale, float(ref.abs().max()))
    return worst / scale


def _train_vs_reference(rank, world_size, grad_dtype, bucket_cap_mb, rel_tol, results, ordered=False):
    model = make_model(0)
    ours_params = [p for g in param_groups(model) for p in g["params"]]
    opt = ShardedAdamW(param_groups(model), lr=LR, grad_dtype=grad_dtype, bucket_cap_mb=bucket_cap_mb,
                       ordered_reduce=ordered)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    ref = Reference(world_size, grad_dtype=grad_dtype)
    assert model.frozen.dtype == torch.float32, "frozen parameters are left out"
    for step in range(STEPS):
        norm = train_step(model, opt, sched, rank, step)
        ref_norm = ref.step(step)
        _gather_equal(torch.cat([p.detach().reshape(-1) for p in ours_params]), f"bf16 params after step {step}")
        assert abs(float(norm) - float(ref_norm)) <= rel_tol * float(ref_norm) + 1e-7, \
            f"step {step}: grad norm {float(norm)} vs reference {float(ref_norm)}"
        err = _master_error(opt, dict(zip(ours_params, ref.master)))
        assert err <= rel_tol, f"step {step}: master max|diff|/max|ref| = {err:.2e} > {rel_tol:.0e}"
        results.append(err)
    assert float(opt.skipped_steps) == 0 and all(float(b.step) == STEPS for b in opt.buckets)


def _check(rank, world_size, grad_dtype, bucket_cap_mb, rel_tol, ordered):
    errs = []
    _train_vs_reference(rank, world_size, grad_dtype, bucket_cap_mb, rel_tol, errs, ordered)
    if os.environ.get("TS_PRINT_ERRORS"):  # `TS_PRINT_ERRORS=1 pytest -s ...` shows the margins
        print(f"ws={world_size} {grad_dtype} rank {rank}: master errors per step {[f'{e:.1e}' for e in errs]}")


# Tolerances, relative to max |master|:
# * world size 1 and 2: our arithmetic is the reference's (bf16 accumulation rne(acc + g); a 2-rank bf16 sum
#   is one correctly rounded add whatever the order), except the AdamW kernel's and torch's fp32 op order and
#   the norm's summation order: a few fp32 ulps per step (measured <= 1e-7 after 4 steps) -> 1e-6. One lr-sized
#   step is 2e-2 relative, so any real bug is 4 orders of magnitude above it.
# * world size 4: gloo adds the 4 bf16 contributions in ring order, the reference in rank order; each of the
#   3 adds rounds at 2^-9 relative, so the averaged gradient can differ by up to ~3 * 2^-9 = 6e-3 relative per
#   element. Adam's update is ~lr * m/sqrt(v), whose relative change is of the same order: per step
#   <= lr * 6e-3 ~ 1.2e-4 absolute, over 4 steps ~5e-4, against max|master| ~0.5-1: 1e-3.
# * world size 4 with ordered_reduce=True: the ranks' gradients are added in rank order, as the reference adds
#   them, so only the fp32 op-order differences of world size 1 and 2 are left: 1e-6 (measured 1.1e-7).
CASES = [
    (1, torch.bfloat16, 25.0, 1e-6, False),
    (2, torch.bfloat16, 200 * 2 / 2 ** 20, 1e-6, False),   # ~200-element buckets: several buckets per group
    (4, torch.bfloat16, 200 * 2 / 2 ** 20, 1e-3, False),   # measured up to 5e-4
    (4, torch.bfloat16, 200 * 2 / 2 ** 20, 1e-6, True),
    (2, torch.float32, 25.0, 1e-6, False),
]


@pytest.mark.parametrize("world_size, grad_dtype, bucket_cap_mb, rel_tol, ordered", CASES)
def test_matches_single_process_reference(world_size, grad_dtype, bucket_cap_mb, rel_tol, ordered):
    run_on_ranks(_check, world_size, grad_dtype, bucket_cap_mb, rel_tol, ordered)


def _nan_on_one_rank(rank, world_size):
    model = make_model(0)
    opt = ShardedAdamW(param_groups(model), lr=LR, bucket_cap_mb=200 * 2 / 2 ** 20)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    train_step(model, opt, sched, rank, 0)
    before = {
        "params": [b.param_buffer.get_data().clone() for b in opt.buckets],
        "master": [b.master.clone() for b in opt.buckets],
        "state": [t.clone() for b in opt.buckets for t in b.state.values()],
        "step": [b.step.clone() for b in opt.buckets],
    }
    norm = train_step(model, opt, sched, rank, 1, poison=(rank == world_size - 1))  # NaN on the last rank only
    assert not bool(norm.isfinite()), "the global norm reports the non-finite gradient on every rank"
    after = {
        "params": [b.param_buffer.get_data() for b in opt.buckets],
        "master": [b.master for b in opt.buckets],
        "state": [t for b in opt.buckets for t in b.state.values()],
        "step": [b.step for b in opt.buckets],
    }
    for key in before:
        for x, y in zip(before[key], after[key]):
            assert torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)), \
                f"{key} changed on a skipped step"
    assert int(opt.skipped_steps) == 1 and bool(opt.last_step_skipped)
    # the next clean step goes through again
    train_step(model, opt, sched, rank, 2)
    assert int(opt.skipped_steps) == 1 and not bool(opt.last_step_skipped)
    assert all(float(b.step) == 2 for b in opt.buckets)


@pytest.mark.parametrize("world_size", [2, 4])
def test_non_finite_gradient_on_one_rank_skips_the_step_everywhere(world_size):
    run_on_ranks(_nan_on_one_rank, world_size)


DISAGREEING = [
    ("overlap_comm", (False, True)),                    # hung (no output in 75 s) before issue 23
    ("grad_dtype", (torch.bfloat16, torch.float32)),    # aborted rank 0 inside gloo
    ("ordered_reduce", (False, True)),
    ("state_dtype", (torch.float32, torch.bfloat16)),
]


def _options_disagree(rank, world_size):
    for option, values in DISAGREEING:  # one process group for all (a spawn costs ~2 s)
        with pytest.raises(ValueError, match=rf"different {option} \(rank 0: .*, rank 1: .*\)"):
            ShardedAdamW(param_groups(make_model(0)), lr=LR, **{option: values[rank]})
        # the process group is still usable: nothing was left half-issued
        t = torch.ones(1)
        dist.all_reduce(t)
        assert float(t) == world_size
    ShardedAdamW(param_groups(make_model(0)), lr=LR, overlap_comm=True)  # agreeing ranks build as before


def test_ranks_that_disagree_on_an_option_get_a_clear_error_not_a_hang():
    run_on_ranks(_options_disagree, 2)


def _order_disagrees(rank, world_size):
    model = torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.Linear(3, 3))
    params = list(model.parameters())
    hint = r"different parameters \(rank 0: '4 tensors, \w+', rank 1: '4 tensors, \w+'\); every rank must pass the same"
    # another order, the shapes differing at each position (until session 15 the first bucket's Buffer caught it,
    # as a LayoutMismatchError on its shapes: now the optimizer, before any bucket, with what to do)
    with pytest.raises(ValueError, match=hint):
        ShardedAdamW(params if rank == 0 else params[::-1], lr=LR)
    # the same shapes in another order, named (torch.optim takes model.named_parameters()): the names tell them
    # apart. Until session 15 it built, and every step summed rank 1's 0.bias gradients into rank 0's 1.bias
    named = list(model[1].named_parameters(prefix="1")) + [("0.bias", model[0].bias)]
    with pytest.raises(ValueError, match=hint.replace("4 tensors", "3 tensors")):
        ShardedAdamW(named if rank == 0 else [named[0], named[2], named[1]], lr=LR)
    # another parameter frozen on one rank only (its count of trainable parameters is compared first)
    model[1].bias.requires_grad_(rank == 0)
    with pytest.raises(ValueError, match=r"different trainable_params \(rank 0: 4, rank 1: 3\)"):
        ShardedAdamW(params, lr=LR)
    model[1].bias.requires_grad_(True)
    t = torch.ones(1)  # the process group is still usable: nothing was left half-issued
    dist.all_reduce(t)
    assert float(t) == world_size
    ShardedAdamW(params, lr=LR)  # the same order on both: builds
    opt = ShardedAdamW([("0.weight", model[0].weight), named[0]], lr=LR)
    # and a group added later, likewise (there its shapes were compared, not its names)
    with pytest.raises(ValueError, match=r"added param groups to ShardedAdamW with different parameters"):
        opt.add_param_group({"params": named[1:] if rank == 0 else named[:0:-1]})
    opt.add_param_group({"params": named[1:]})


def test_ranks_that_pass_the_parameters_in_another_order_get_a_clear_error():
    run_on_ranks(_order_disagrees, 2)


@pytest.mark.parametrize("cls", [ShardedAdamW, tritonshard.ShardedSGD, tritonshard.ShardedLion,
                                 tritonshard.ShardedMuon])
def test_a_set_of_parameters_is_refused(cls):
    """A set's order is its elements' addresses: another order on every rank and in every run. torch.optim refuses
    one inside a param group (but ours listed it before torch.optim looked) and takes one as params; for sharded
    buffers both are an error, for every optimizer (until session 49 ShardedSGD and ShardedMuon listed ``params``
    before the check, and took a set)."""
    model = torch.nn.Linear(3, 2, bias=False)
    other = torch.nn.Linear(3, 2, bias=False)
    with pytest.raises(TypeError, match="params is a set: a set's order differs between processes"):
        cls({model.weight, other.weight}, lr=LR)
    with pytest.raises(TypeError, match=r"param_groups\[1\]\['params'\] is a set"):
        cls([{"params": [model.weight]}, {"params": {other.weight}}], lr=LR)


def test_a_set_of_parameters_added_later_is_refused():
    model = torch.nn.Linear(3, 2)
    opt = ShardedAdamW([model.weight], lr=LR)
    with pytest.raises(TypeError, match="ordering of tensors in sets will change"):  # torch.optim's own error
        opt.add_param_group({"params": {model.bias}})
