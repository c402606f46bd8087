"""ShardedMuon: torch.optim.Muon + torch.optim.AdamW semantics, on 1 process and on 2 and 4 gloo processes.

References: torch's own optimizers on an fp32 master (tests/optim/training.py's TorchMuonAdamW), fed the same
bf16 gradients; on several ranks, the single-process simulation of training.py (bf16 sums in rank order).
"""

import copy

import pytest
import torch
from torch import nn

from tests.distributed import run_on_ranks
from tests.optim.training import (Reference, TorchMuonAdamW, make_model, muon_groups, schedule, train_step)
from tritonshard import ShardedMuon
from tritonshard.checkpoint import load_sharded, save_sharded
from tritonshard.layout import newton_schulz_flops

MUON_KW = dict(lr=0.02, weight_decay=0.1, momentum=0.95)


class Mlp(nn.Module):
    """A tall (19 x 7) and a wide (5 x 19) matrix, so both Newton-Schulz orientations and lr adjustments run."""

    def __init__(self):
        super().__init__()
        self.up, self.down, self.norm = nn.Linear(7, 19), nn.Linear(19, 5), nn.LayerNorm(5)

    def forward(self, x):
        return self.norm(self.down(torch.relu(self.up(x))))


def _groups(m: Mlp):
    return [{"params": [m.up.weight, m.down.weight]},
            {"params": [m.up.bias, m.down.bias, m.norm.weight, m.norm.bias], "use_muon": False, "lr": 3e-3}]


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("adjust_lr_fn", [None, "match_rms_adamw"])
def test_one_process_matches_torch_muon_and_adamw(nesterov, adjust_lr_fn):
    torch.manual_seed(0)
    model = Mlp()
    ref = copy.deepcopy(model)
    kw = dict(MUON_KW, nesterov=nesterov, adjust_lr_fn=adjust_lr_fn)
    torch_opt = TorchMuonAdamW(_groups(ref), **kw)
    opt = ShardedMuon(_groups(model), **kw)
    ours, theirs = [p for g in _groups(model) for p in g["params"]], [p for g in _groups(ref) for p in g["params"]]
    for step in range(6):
        for i, (p, q) in enumerate(zip(ours, theirs)):
            g = torch.randn(p.shape, generator=torch.Generator().manual_seed(100 * step + i)).bfloat16()
            p.grad, q.grad = g, g.float()
        opt.step()
        torch_opt.step()
    state = opt.state_dict()["state"]
    for i, q in enumerate(theirs):
        # the same fp32 arithmetic and the same bf16 Newton-Schulz: differences are fp32 op order (FMA), ~1 ulp
        # per step, and a rare bf16 NS input one ulp off (2^-8 of one step's update, lr * ratio * |O| < 0.02)
        scale = float(q.detach().abs().max())
        assert float((state[i]["master"] - q.detach()).abs().max()) <= 1e-6 * scale + 2e-4 * 0.02, f"param {i}"
        assert torch.equal(ours[i].detach(), state[i]["master"].to(torch.bfloat16)), "bf16 weights = master rounded"
    for i in (0, 1):
        torch_buf = torch_opt.muon.state[theirs[i]]["momentum_buffer"]
        assert set(state[i]) == {"momentum_buffer", "master"}, "torch.optim.Muon's format (no step) + master"
        assert float((state[i]["momentum_buffer"] - torch_buf).abs().max()) <= 1e-6 * float(torch_buf.abs().max())
    for i in range(2, 6):
        assert {"step", "exp_avg", "exp_avg_sq", "master"} == set(state[i])
        assert float(state[i]["step"]) == 6.0


def test_adamw_groups_take_torch_adamw_defaults_not_muons():
    m = Mlp()
    opt = ShardedMuon([{"params": [m.up.weight]}, {"params": [m.up.bias], "use_muon": False}], lr=0.05, eps=1e-7,
                      weight_decay=0.3)
    adamw_group = opt.param_groups[1]
    assert (adamw_group["lr"], adamw_group["eps"], adamw_group["weight_decay"]) == (1e-3, 1e-8, 1e-2)
    assert adamw_group["betas"] == (0.9, 0.999)
    assert (opt.param_groups[0]["lr"], opt.param_groups[0]["eps"]) == (0.05, 1e-7)


def test_non_matrix_in_a_muon_group_is_rejected_before_anything_changes():
    m = Mlp()
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[1\] \(shape \(19,\)\).*1-D.*use_muon=False"):
        ShardedMuon([m.up.weight, m.up.bias])
    with pytest.raises(ValueError, match=r"'up.bias'.*use_muon=False"):
        ShardedMuon([{"params": [m.up.weight, m.up.bias], "param_names": ["up.weight", "up.bias"]}])
    assert m.up.weight.dtype == torch.float32, "a failed construction leaves the model alone"


@pytest.mark.parametrize("kw, error, match", [
    (dict(momentum=1.0), ValueError, r"momentum must be in \[0, 1\)"),
    (dict(ns_steps=100), ValueError, r"ns_steps must be an int in \[0, 100\)"),
    (dict(adjust_lr_fn="rms"), ValueError, "adjust_lr_fn must be"),
    (dict(ns_coefficients=(1.0, 2.0)), ValueError, "ns_coefficients must be three finite numbers"),
    (dict(ns_coefficients=(3.4445, float("nan"), 2.0315)), ValueError, r"ns_coefficients must be three finite "
                                                                        r"numbers \(a, b, c\), got \(3\.4445, nan"),
    (dict(lr=-1.0), ValueError, "lr must be >= 0"),
    (dict(eps=1e39), ValueError, "eps must be below fp32's largest number, got 1e\\+39"),
    # (a TypeError, as every other optimizer's flags: ShardedSGD's nesterov, maximize; a ValueError until session 52)
    (dict(nesterov=1), TypeError, "nesterov must be True or False, got 1"),
])
def test_bad_hyper_parameters(kw, error, match):
    m = Mlp()
    with pytest.raises(error, match=match):
        ShardedMuon([m.up.weight], **kw)
    with pytest.raises(TypeError, match=r"use_muon must be True or False, got 'no' \(param_groups\[0\]\)"):
        ShardedMuon([{"params": [m.up.weight], "use_muon": "no"}])


@pytest.mark.parametrize("group", [0, 1])
def test_use_muon_switched_after_building_is_an_error_at_step_before_anything_changes(group):
    """A group's buckets hold Muon's momentum or AdamW's moments, laid out when the optimizer is built: a use_muon
    switched later (by hand, a config applied to the groups) failed inside the update with a KeyError
    'momentum_buffer' after the gradients were reduced, until session 52 (found by a random probe of group
    edits); switched back, the optimizer trains on."""
    m = Mlp().to(torch.bfloat16)
    opt = ShardedMuon(_groups(m), lr=0.02)
    was = opt.param_groups[group]["use_muon"]
    opt.param_groups[group]["use_muon"] = not was
    m(torch.randn(3, 7, dtype=torch.bfloat16)).float().square().sum().backward()
    weights = [p.detach().clone() for p in m.parameters()]
    with pytest.raises(ValueError, match=rf"use_muon={not was}, but this group was built with use_muon={was}: "
                                         rf".*\(param_groups\[{group}\], at step\(\)\)"):
        opt.step()
    assert all(torch.equal(a, p) for a, p in zip(weights, m.parameters()))
    opt.param_groups[group]["use_muon"] = was
    opt.step()
    assert not all(torch.equal(a, p) for a, p in zip(weights, m.parameters()))


def test_adamw_group_rejects_what_it_does_not_have():
    m = Mlp()
    with pytest.raises(ValueError, match=r"amsgrad=True is not supported.*param_groups\[1\]"):
        ShardedMuon([{"params": [m.up.weight]}, {"params": [m.up.bias], "use_muon": False, "amsgrad": True}])
    with pytest.raises(TypeError, match=r"maximize must be True or False, got 'False' \(param_groups\[1\]\)"):
        ShardedMuon([{"params": [m.up.weight]}, {"params": [m.up.bias], "use_muon": False, "maximize": "False"}])


def test_plan_for_gpt2_small_at_8_ranks():
    # GPT-2 small's 48 block matrices (nn.Linear weight shapes: attention qkv and projection, MLP up and down)
    shapes = [(2304, 768), (768, 768), (3072, 768), (768, 3072)] * 12
    plan = ShardedMuon.plan(shapes, 8)
    single = sum(newton_schulz_flops(s) for s in shapes)
    assert plan["ns_flops_total"] == single, "every matrix orthogonalized exactly once over all ranks"
    assert plan["ns_flops_max_over_mean"] <= 1.25, plan  # the balance goal (measured: 1.024)
    assert plan["extra_bytes_per_step"] == 0 and plan["buckets"] == 1, plan
    # one layer (4 matrices, 13.5 MiB of bf16) per bucket at 8 ranks: half the ranks own nothing in a bucket and
    # the others' shards are padded to the largest matrix: the cost plan() exists to show
    small = ShardedMuon.plan(shapes, 8, bucket_cap_mb=13.5 / 8)
    assert small["buckets"] == 12 and small["extra_bytes_per_step"] > 0 and small["ns_flops_total"] == single


# ------------------------------------------------------------------------------------------------ distributed
def _train(rank, world_size, nesterov, adjust_lr_fn, rel_tol):
    kw = dict(MUON_KW, nesterov=nesterov, adjust_lr_fn=adjust_lr_fn)
    model = make_model(0)
    params = [p for g in muon_groups(model) for p in g["params"]]
    opt = ShardedMuon(muon_groups(model), **kw, bucket_cap_mb=100 * 2 / 2 ** 20)
    owners = [b.param_buffer.layout.owners for b in opt.buckets if opt.param_groups[b.group_index]["use_muon"]]
    assert owners and all(o is not None for o in owners)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    ref = Reference(world_size, make_opt=lambda groups: TorchMuonAdamW(groups, **kw), groups_fn=muon_groups)
    for step in range(4):
        train_step(model, opt, sched, rank, step)
        ref.step(step)
    state = opt.state_dict()["state"]
    scale = max(float(p.detach().abs().max()) for p in ref.master)
    for i, p in enumerate(ref.master):
        worst = float((state[i]["master"].double() - p.detach().double()).abs().max())
        assert worst <= rel_tol * scale, f"param {i} at {world_size} ranks: master off by {worst / scale:.2e}"
    for p, q in zip(params, ref.bf16_weights()):
        assert bool(((p.float() - q.float()).abs() <= rel_tol * scale + 2 ** -7 * q.float().abs()).all())


# 2 ranks reproduce the reference's bf16 sums exactly, so the NS inputs agree and what is left is fp32 op order
# (1e-6). 4 ranks add in ring order (each add rounds at 2^-9): the NS input moves by bf16 ulps, which moves the
# orthogonalized update by about as much relative to it, lr * ratio * |O| * 2^-8 per step and element, with lr
# 0.02, |O| <= 1 and ratio <= 0.2 sqrt(13): < 6e-5 per step, 4 steps, against weights of size ~0.3: 1e-3.
@pytest.mark.parametrize("world_size, rel_tol", [(2, 1e-6), (4, 1e-3)])
def test_matches_reference_on_ranks(world_size, rel_tol):
    run_on_ranks(_train, world_size, True, "match_rms_adamw", rel_tol)


def test_matches_reference_without_nesterov_original_lr():
    run_on_ranks(_train, 2, False, None, 1e-6)


def _reshard(rank, world_size, path):
    model = make_model(0)
    opt = ShardedMuon(muon_groups(model), **MUON_KW)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    if world_size == 2:
        for step in range(2):
            train_step(model, opt, sched, rank, step)
        save_sharded(opt, path)
        full = opt.state_dict()  # a collective: every rank gathers
        if rank == 0:
            torch.save(full, path + ".full.pt")
        return
    load_sharded(opt, path)
    saved, now = torch.load(path + ".full.pt"), opt.state_dict()
    for i, entry in saved["state"].items():
        assert set(entry) == set(now["state"][i]), i
        for name, t in entry.items():
            assert torch.equal(t, now["state"][i][name]), (i, name)
    assert now["param_groups"][1]["betas"] == saved["param_groups"][1]["betas"]


def test_sharded_checkpoint_reshards_from_2_to_4_ranks(tmp_path):
    path = str(tmp_path / "ckpt")
    run_on_ranks(_reshard, 2, path)
    run_on_ranks(_reshard, 4, path)


def _hybrid_overlap_skip(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    kw = dict(MUON_KW, adjust_lr_fn="match_rms_adamw")
    model = make_model(0)
    opt = ShardedMuon(muon_groups(model), **kw, device_mesh=mesh, overlap_comm=True)
    opt.attach(model)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    ref = Reference(4, make_opt=lambda groups: TorchMuonAdamW(groups, **kw), groups_fn=muon_groups)
    for step in range(4):
        poison = step == 1 and rank == 3  # one rank's NaN: every rank must skip the step
        train_step(model, opt, sched, rank, step, poison=poison)
        if step == 1:
            ref.sched.step()  # the reference skips the update and keeps the schedule
        else:
            ref.step(step)
    assert int(opt.skipped_steps) == 1
    state = opt.state_dict()["state"]
    scale = max(float(p.detach().abs().max()) for p in ref.master)
    worst = max(float((state[i]["master"] - p.detach()).abs().max()) for i, p in enumerate(ref.master))
    # 4 bf16 contributions summed in another order than the reference: the 4-rank bound above (1e-3)
    assert worst <= 1e-3 * scale, f"hybrid + overlap vs reference: {worst / scale:.2e}"
    for i, p in enumerate(ref.master):
        assert bool(torch.isfinite(state[i]["master"]).all())


def test_hybrid_overlap_and_a_non_finite_step_on_4_ranks():
    run_on_ranks(_hybrid_overlap_skip, 4)


def _three_steps(**kw):
    torch.manual_seed(0)
    model = Mlp()
    opt = ShardedMuon(_groups(model), **MUON_KW, **kw)
    params = [p for g in _groups(model) for p in g["params"]]
    for step in range(3):
        for i, p in enumerate(params):
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(100 * step + i)).bfloat16()
        opt.step()
    return opt.state_dict()["state"]


def test_remainders_and_bf16_momentum():
    plain = _three_steps()
    # the int16 remainders rebuild the exact fp32 master in every kernel: the same bits as an fp32 master
    with_remainders = _three_steps(store_param_remainders=True)
    for i in plain:
        assert torch.equal(plain[i]["master"], with_remainders[i]["master"]), i
    # a bf16 momentum (round to nearest) moves NS inputs by bf16 ulps; Newton-Schulz's 15 bf16 matmuls then round
    # differently, a few % of |O| at most (measured: 6.4e-4 after 3 steps), so each update moves by at most ~5% of
    # lr * ratio * |O| <= 0.02 * sqrt(19/7) = 0.033: 3 x 0.05 x 0.033 = 5e-3
    bf16_state = _three_steps(state_dtype=torch.bfloat16, state_rounding="nearest")
    for i in (0, 1):
        assert bf16_state[i]["momentum_buffer"].dtype == torch.float32  # torch.optim's format on the way out
        diff = float((bf16_state[i]["master"] - plain[i]["master"]).abs().max())
        assert 0 < diff < 5e-3, (i, diff)
