"""torch's distributed-checkpoint state-dict API on a tritonshard optimizer, the way torchtitan and Lightning's
ModelParallelStrategy save and resume: ``get_state_dict(model, opt)`` (FQN-keyed), ``dcp.save`` of both, then in
a fresh process state ``get_state_dict`` again (which first initializes an empty optimizer state with a step of
lr 0 on zero gradients, ``_init_optim_state``), ``dcp.load`` into it and ``set_state_dict``. The resumed run must
continue bit for bit, on 2 gloo ranks."""

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict, set_state_dict)

from tests.distributed import run_on_ranks
from tritonshard import ShardedAdamW, ShardedMuon


def _model(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(9, 17), torch.nn.Tanh(), torch.nn.Linear(17, 5))


def _build(seed):
    model = _model(seed)
    opt = ShardedAdamW(model.parameters(), lr=1e-2, weight_decay=0.1, bucket_cap_mb=1e-9)
    opt.attach(model)
    return model, opt


def _train(model, opt, steps, first, rank):
    for step in range(first, first + steps):
        x = torch.randn(4, 9, generator=torch.Generator().manual_seed(100 * step + rank))
        model(x).float().square().mean().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()


def _save_and_resume(rank, world_size, path):
    model, opt = _build(0)
    _train(model, opt, 3, 0, rank)
    model_sd, optim_sd = get_state_dict(model, opt)
    assert set(optim_sd["state"]) == {n for n, _ in model.named_parameters()}, sorted(optim_sd["state"])
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    _train(model, opt, 3, 3, rank)
    truth = [p.detach().clone() for p in model.parameters()]
    truth_state = opt.state_dict()["state"]

    model, opt = _build(1)  # other weights: everything must come from the checkpoint
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
    assert float(opt.state[model[0].weight]["step"]) == 3
    _train(model, opt, 3, 3, rank)
    for a, b in zip(model.parameters(), truth):
        assert torch.equal(a.detach(), b), "resumed through torch.distributed.checkpoint.state_dict"
    state = opt.state_dict()["state"]
    for i in truth_state:
        for key in truth_state[i]:
            assert torch.equal(state[i][key], truth_state[i][key]), (i, key)


def test_get_and_set_state_dict_with_dcp_resume_bit_for_bit(tmp_path):
    run_on_ranks(_save_and_resume, 2, str(tmp_path / "ckpt"))


#: what else a resume must carry: the optimizer-wide values (``state_dict()["tritonshard"]``), which DCP's
#: get_state_dict leaves out of the optimizer's dict, and state opt.state[p] shows otherwise than the dict holds
KINDS = {
    # (a loss scale backed off by an overflow, and a skipped step)
    "fp16": lambda model: ShardedAdamW(model.parameters(), lr=1e-2, param_dtype=torch.float16, bucket_cap_mb=1e-9),
    # (stochastic rounding: its random stream's position)
    "bf16 states": lambda model: ShardedAdamW(model.parameters(), lr=1e-2, state_dtype=torch.bfloat16,
                                              bucket_cap_mb=1e-9),
    # (the fp32 master as the bf16 weight plus an int16 remainder: opt.state[p] shows no "master")
    "remainders": lambda model: ShardedAdamW(model.parameters(), lr=1e-2, store_param_remainders=True,
                                             bucket_cap_mb=1e-9),
    # (Muon's state dict keeps no step for its matrices, as torch.optim.Muon's; opt.state[p] shows one)
    "muon": lambda model: ShardedMuon([dict(params=[model[0].weight, model[2].weight]),
                                       dict(params=[model[0].bias, model[2].bias], use_muon=False, lr=1e-2)],
                                      lr=0.02, bucket_cap_mb=1e-9),
}


def _train_kind(model, opt, steps, first, rank):
    for step in range(first, first + steps):
        x = torch.randn(4, 9, generator=torch.Generator().manual_seed(100 * step + rank))
        if step == 1 and opt.loss_scale is not None:
            x[0, 0] = float("inf")  # an overflow: the scale backs off and the step is skipped
        loss = model(x.to(model[0].weight.dtype)).float().square().mean()
        (loss * opt.loss_scale if opt.loss_scale is not None else loss).backward()
        opt.clip_grad_norm_(0.5)
        opt.step()
        opt.zero_grad()


def _every_kind(rank, world_size, root, flatten):
    options = StateDictOptions(flatten_optimizer_state_dict=flatten)
    for name, make in KINDS.items():
        model = _model(0)
        opt = make(model)
        _train_kind(model, opt, 3, 0, rank)
        if name == "fp16":
            assert float(opt.loss_scale) == 2.0 ** 15 and int(opt.skipped_steps) == 1  # (what must come back)
        model_sd, optim_sd = get_state_dict(model, opt, options=options)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=f"{root}/{name}")
        saved = opt.state_dict()["state"]
        _train_kind(model, opt, 3, 3, rank)
        truth, truth_state = [p.detach().clone() for p in model.parameters()], opt.state_dict()

        model = _model(1)  # other weights: everything must come from the checkpoint
        opt = make(model)
        model_sd, optim_sd = get_state_dict(model, opt, options=options)
        dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=f"{root}/{name}")
        if flatten and name in ("fp16", "remainders"):  # (what opt.state[p] does not show is not in DCP's dict)
            lost = "loss scaler's scale" if name == "fp16" else "fp32 master weights"
            with pytest.raises(ValueError, match=f"flatten_optimizer_state_dict=True.*lost the {lost}"):
                set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=optim_sd, options=options)
            continue
        set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=optim_sd, options=options)
        loaded = opt.state_dict()["state"]
        for i, entry in saved.items():
            for key, value in entry.items():
                assert torch.equal(loaded[i][key], value), (name, flatten, i, key)
        if flatten and name == "bf16 states":  # (stochastic rounding's position is not in DCP's flattened dict: the
            continue  # run goes on with another random stream, its moments and masters as saved)
        _train_kind(model, opt, 3, 3, rank)
        for a, b in zip(model.parameters(), truth):
            assert torch.equal(a.detach(), b), f"{name}: resumed through torch.distributed.checkpoint.state_dict"
        now = opt.state_dict()
        for i, entry in truth_state["state"].items():
            for key, value in entry.items():
                assert torch.equal(now["state"][i][key], value), (name, i, key)
        for key, value in truth_state["tritonshard"].items():
            assert torch.equal(torch.as_tensor(now["tritonshard"][key]), torch.as_tensor(value)), (name, key)


@pytest.mark.parametrize("flatten", [False, True], ids=["nested", "flattened"])
def test_every_state_format_resumes_through_get_and_set_state_dict_or_names_what_it_lost(tmp_path, flatten):
    """The optimizer-wide values (a backed-off loss scale, the skipped steps, stochastic rounding's position) ride
    in the first param group too (state_io.CARRIED): until session 53 DCP's get_state_dict dropped them, so
    the resumed fp16 run restarted at the initial loss scale and the bf16-state run drew other random bits,
    silently. torchtitan's flattened dicts keep of each entry only the keys opt.state[p] shows: Muon's matrices
    show a step their state dict does not keep (refused until session 53), and what opt.state[p] does not show
    (the fp32 masters under store_param_remainders, the loss scale) is a ValueError naming the way that keeps it."""
    run_on_ranks(_every_kind, 2, str(tmp_path), flatten)


def _full_from_rank0(rank, world_size):
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)  # (rank 0 alone gets the dicts)
    model = _model(0)
    opt = KINDS["bf16 states"](model)
    _train_kind(model, opt, 3, 0, rank)
    model_sd, optim_sd = get_state_dict(model, opt, options=options)
    assert bool(model_sd) == (rank == 0) and bool(optim_sd) == (rank == 0)
    _train_kind(model, opt, 3, 3, rank)
    truth = [p.detach().clone() for p in model.parameters()]

    model = _model(1)
    opt = KINDS["bf16 states"](model)
    load = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, model_sd, options=load)
    set_optimizer_state_dict(model, opt, optim_sd, options=load)
    _train_kind(model, opt, 3, 3, rank)
    for a, b in zip(model.parameters(), truth):
        assert torch.equal(a.detach(), b), "resumed from rank 0's full state dicts"


def test_full_state_dicts_on_rank_0_broadcast_to_every_rank_resume_bit_for_bit():
    """torchtitan's and FSDP2's way to load a full checkpoint: rank 0 alone holds the dicts (full_state_dict with
    cpu_offload), set_model_state_dict / set_optimizer_state_dict broadcast them (broadcast_from_rank0). Also with
    stochastic rounding's position, which rides in the first param group (state_io.CARRIED)."""
    run_on_ranks(_full_from_rank0, 2)
