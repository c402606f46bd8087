"""torch's distributed-checkpoint state-dict API on a tritonshard optimizer, the way torchtitan and Lightning's
ModelParallelStrategy save and resume: ``get_state_dict(model, opt)`` (FQN-keyed), ``dcp.save`` of both, then in
a fresh process state ``get_state_dict`` again (which first initializes an empty optimizer state with a step of
lr 0 on zero gradients, ``_init_optim_state``), ``dcp.load`` into it and ``set_state_dict``. The resumed run must
continue bit for bit, on 2 gloo ranks."""

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from tests.distributed import run_on_ranks
from tritonshard import ShardedAdamW


def _build(seed):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(9, 17), torch.nn.Tanh(), torch.nn.Linear(17, 5))
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
