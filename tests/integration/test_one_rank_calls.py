"""A collective called on one rank only (issue 22.3). The Hugging Face Trainer calls ``optimizer.state_dict()`` on
the main process only; before, rank 1 died of gloo's "Received data size doesn't match expected size" and rank 0
of "Connection reset by peer" (NCCL would have hung). Now every entry point that runs collectives shakes hands
first, so every rank raises CollectiveMismatchError naming both calls, within seconds; the Trainer saves and
resumes on 2 ranks with ShardedOptimizerCallback; and the one-rank call that pairs with the same collectives on
the others (a norm logged on rank 0 before everyone steps) keeps working."""

from __future__ import annotations

import math
import os
import shutil
import time

import pytest
import torch

from tests.distributed import run_on_ranks
from tests.helpers import assert_bitwise_equal
from tests.integration.hf import flat_weights, lm_loss, tiny_llama, tokens
from tritonshard import ShardedAdamW
from tritonshard.checkpoint import load_sharded, save_checkpoint
from tritonshard.comm import CollectiveMismatchError, SettingsMismatchError

SECONDS = 20  # "within seconds": the handshake pairs as soon as the other rank reaches its next call (gloo's
#               default timeout, 30 min, is what a hang would take)


def _step(model, opt, rank, step, overlap=False):
    lm_loss(model, tokens(step, rank)).backward()
    opt.step()
    opt.zero_grad()


CALLS = [("state_dict", False), ("state_dict", True), ("load_state_dict", False), ("save_checkpoint", False),
         ("load_sharded", False), ("torch clip", False), ("clip value", False)]


def _one_rank_calls(rank, world_size, tmp):
    """Each case in turn, in one pair of processes (a mismatch leaves no collective in flight: both ranks raised
    at the handshake, before any data collective, so the group goes on to the next case)."""
    for case, (call, overlap) in enumerate(CALLS):
        model = tiny_llama(0)
        opt = ShardedAdamW(model.parameters(), lr=3e-3, overlap_comm=overlap)
        opt.attach(model)
        _step(model, opt, rank, 0)
        saved = opt.state_dict()  # both ranks: fine
        ckpt = save_checkpoint(opt, os.path.join(tmp, str(case)), 1)
        start = time.monotonic()
        with pytest.raises(CollectiveMismatchError) as err:
            if rank == 0:
                if call == "state_dict":
                    opt.state_dict()
                elif call == "load_state_dict":
                    opt.load_state_dict(saved)
                elif call == "save_checkpoint":
                    save_checkpoint(opt, os.path.join(tmp, str(case)), 2)
                elif call == "load_sharded":
                    load_sharded(opt, ckpt)
                elif call == "torch clip":
                    lm_loss(model, tokens(1, rank)).backward()
                    opt.grad_norm()  # the reduction: pairs with rank 1's
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # per-parameter norms: rank 1 steps
                elif call == "clip value":  # the reduction pairs with rank 1's; the check after the clamp cannot
                    lm_loss(model, tokens(1, rank)).backward()
                    torch.nn.utils.clip_grad_value_(model.parameters(), 1e-3)
                    opt.step()
            else:
                _step(model, opt, rank, 1)  # rank 1 goes on training
        elapsed = time.monotonic() - start
        message = str(err.value)
        assert "rank 0:" in message and "rank 1:" in message and "prepare_state_dict" in message, (call, message)
        assert elapsed < SECONDS, f"{call}: the mismatch took {elapsed:.1f} s to surface"


def test_a_collective_called_on_one_rank_is_an_error_on_every_rank(tmp_path):
    """state_dict (with and without overlap_comm), load_state_dict, a checkpoint save and load, torch's clipping
    (by norm, or by value, whose step checks the clamped gradients for inf) on rank 0 while rank 1 trains on."""
    run_on_ranks(_one_rank_calls, 2, str(tmp_path))


def _zero_redundancy_save(rank, world_size, tmp):
    """ZeroRedundancyOptimizer's saving idiom: ``consolidate_state_dict(to=1)`` on every rank, then ``state_dict()``
    on rank 1 alone, saved; every rank loads it into a fresh optimizer and trains on: bit for bit the run that
    was not interrupted."""
    path = os.path.join(tmp, "opt.pt")
    runs = []
    for resume in (False, True):
        model = tiny_llama(0)
        opt = ShardedAdamW(model.parameters(), lr=3e-3)
        opt.attach(model)
        for step in range(4):
            if resume and step == 2:
                opt.consolidate_state_dict(to=1)
                if rank == 1:
                    torch.save({"opt": opt.state_dict(), "model": model.state_dict()}, path)
                torch.distributed.barrier()
                saved = torch.load(path)
                model = tiny_llama(1)  # other weights: everything comes from the file
                model.load_state_dict(saved["model"])
                opt = ShardedAdamW(model.parameters(), lr=3e-3)
                opt.attach(model)
                opt.load_state_dict(saved["opt"])
            _step(model, opt, rank, step)
        runs.append(flat_weights(model))
    assert_bitwise_equal(runs[1], runs[0], "resumed from consolidate_state_dict(to=1) + state_dict() on rank 1")
    with pytest.raises(ValueError, match=r"consolidate_state_dict\(to=2\).*\[0, 2\)"):
        opt.consolidate_state_dict(to=2)


def test_zero_redundancy_optimizers_consolidate_state_dict_then_save_on_one_rank(tmp_path):
    run_on_ranks(_zero_redundancy_save, 2, str(tmp_path))


def _logged_norm_on_rank_0(rank, world_size):
    """The reduction on rank 0 (grad_norm() for a log line) pairs with rank 1's in step(): this keeps working, and
    trains exactly as when every rank asks."""
    runs = []
    for who, check in (((0,), True), ((0, 1), True), ((0, 1), False)):  # last: handshakes off (check_collectives)
        model = tiny_llama(0)
        opt = ShardedAdamW(model.parameters(), lr=3e-3, check_collectives=check)
        for step in range(2):
            lm_loss(model, tokens(step, rank)).backward()
            if rank in who:
                opt.grad_norm()
            opt.step()
            opt.zero_grad()
        runs.append(flat_weights(model))
    assert_bitwise_equal(runs[0], runs[1], "weights with grad_norm() on rank 0 only vs on every rank")
    assert_bitwise_equal(runs[2], runs[1], "weights with check_collectives=False")
    with pytest.raises(TypeError, match="check_collectives"):
        ShardedAdamW(tiny_llama(0).parameters(), check_collectives="yes")


def test_a_norm_logged_on_rank_0_only_still_trains():
    run_on_ranks(_logged_norm_on_rank_0, 2)


def _schedulers_disagree(rank, world_size):
    """Each rank updates its own shard with its own hyper-parameters: a scheduler that runs ahead on one rank used
    to train that rank's shard with another lr, silently (and ReduceLROnPlateau fed each rank's own loss, a common
    DDP slip, likewise). Now the step's handshake compares them: an error on every rank, naming each rank's."""
    for case in ("stepped on rank 0 only", "fed each rank's own metric", "a group changed on rank 1",
                 "1 ulp apart", "a CPU tensor lr filled on rank 0"):
        model = tiny_llama(0)
        # (a CPU tensor lr, as torch recommends for compiled optimizers, is compared by its value)
        opt = ShardedAdamW(model.parameters(), lr=torch.tensor(3e-3) if "tensor" in case else 3e-3)
        lam = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0, factor=0.5)
        _step(model, opt, rank, 0)  # the same settings on both: trains
        if case == "stepped on rank 0 only" and rank == 0:
            lam.step()
        elif case == "fed each rank's own metric":
            for metric in (1.0, 2.0 if rank == 0 else 0.5):
                plateau.step(metric)  # rank 0's got worse (lr halved), rank 1's better
        elif case == "a group changed on rank 1" and rank == 1:
            opt.param_groups[0]["weight_decay"] = 0.0
        elif case == "a CPU tensor lr filled on rank 0" and rank == 0:
            opt.param_groups[0]["lr"].fill_(1.5e-3)
        elif case == "1 ulp apart" and rank == 1:  # a schedule's cosine from another node's libm: not a mismatch
            opt.param_groups[0]["lr"] = math.nextafter(3e-3, 1.0)
        lm_loss(model, tokens(1, rank)).backward()
        if case == "1 ulp apart":
            opt.step()
            continue
        want = r"param_groups\[0\]: lr=0.0015.*param_groups\[0\]: lr=0.003" if case != "a group changed on rank 1" \
            else r"param_groups\[0\]: .*weight_decay=0.01.*param_groups\[0\]: .*weight_decay=0,"
        with pytest.raises(SettingsMismatchError, match=r"called step\(\)'s updates and parameter all-gathers with "
                                                        r"different settings \(rank 0: " + want):
            opt.step()


def test_ranks_stepping_with_different_hyperparameters_get_an_error_on_every_rank():
    run_on_ranks(_schedulers_disagree, 2)


def _trained(seed, rank, steps, tmp, name):
    """A model and optimizer after ``steps`` steps from ``seed``, its state dict, and a sharded checkpoint of it."""
    model = tiny_llama(seed)
    opt = ShardedAdamW(model.parameters(), lr=3e-3)
    for step in range(steps):
        _step(model, opt, rank, step)
    return model, opt, opt.state_dict(), save_checkpoint(opt, os.path.join(tmp, name), steps)


def _loads_disagree(rank, world_size, tmp):
    """Every rank loads its own shard from its own dict or path: a rank that read an older file (or resolved "the
    latest" checkpoint before the last save reached its filesystem) used to stitch the model together from two
    checkpoints, silently. Now both loads compare what they read in their handshake: an error on every rank,
    naming each rank's, before anything is changed; the same checkpoint under another path loads."""
    _, _, older, older_dir = _trained(0, rank, 1, tmp, "older")
    _, _, other_run, other_dir = _trained(1, rank, 2, tmp, "other-run")  # another seed, the same step
    model, opt, newer, newer_dir = _trained(0, rank, 2, tmp, "newer")
    before = flat_weights(model)
    cases = [(older, r"at step 2, .*rank 1: state of \d+ parameters at step 1,"),
             (other_run, r"at step 2, fingerprint (\w+); rank 1: state of \d+ parameters at step 2, fingerprint "
                         r"(?!\1)\w+\)"),
             (older_dir, r"newer/step_0+2 \(step 2, .*rank 1: .*older/step_0+1 \(step 1, "),
             (other_dir, r"newer/step_0+2 \(step 2, meta.pt (\w+)\); rank 1: .*other-run/step_0+2 \(step 2, meta.pt "
                         r"(?!\1)\w+\)")]
    for theirs, want in cases:
        start = time.monotonic()
        sharded = isinstance(theirs, str)
        what = "a checkpoint load \\(load_sharded\\)" if sharded else r"load_state_dict\(\)"
        with pytest.raises(SettingsMismatchError, match=f"called {what} with different "
                                                        f"{'checkpoints' if sharded else 'state dicts'} "
                                                        r"\(rank 0: .*" + want):
            mine = newer_dir if sharded else newer
            load_sharded(opt, theirs if rank == 1 else mine) if sharded else opt.load_state_dict(
                theirs if rank == 1 else mine)
        assert time.monotonic() - start < SECONDS
        assert_bitwise_equal(flat_weights(model), before, "weights after a load the ranks disagreed on")
    # the same checkpoint: a copy of the directory on rank 1, a dict loaded to each rank from the file
    if rank == 1:
        shutil.copytree(newer_dir, os.path.join(tmp, "copy"))
    load_sharded(opt, newer_dir if rank == 0 else os.path.join(tmp, "copy"))
    torch.save(newer, os.path.join(tmp, f"newer-{rank}.pt"))
    opt.load_state_dict(torch.load(os.path.join(tmp, f"newer-{rank}.pt")))
    _step(model, opt, rank, 2)  # and trains on


def test_ranks_loading_different_checkpoints_get_an_error_on_every_rank(tmp_path):
    run_on_ranks(_loads_disagree, 2, str(tmp_path))


# ---------------------------------------------------------------------------------------------- the HF Trainer
def _in_order_trainer(rank, world_size):
    """A ``transformers.Trainer`` subclass that hands out the batches in order, on this rank of the process group
    that exists already (accelerate reads it from the environment)."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(
        world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT="29998")
    from torch.utils.data import SequentialSampler
    from transformers import Trainer

    class InOrder(Trainer):
        def _get_train_sampler(self, *args, **kwargs):
            return SequentialSampler(self.train_dataset)

    return InOrder


def _trainer(rank, world_size, out, resume, callback):
    from transformers import TrainingArguments

    from tritonshard.integrations.hf import ShardedOptimizerCallback

    InOrder = _in_order_trainer(rank, world_size)

    data = [{"input_ids": ids, "labels": ids} for step in range(4) for ids in tokens(step, batch=4)]
    model = tiny_llama(0)
    opt = ShardedAdamW(model.parameters(), lr=3e-3)
    opt.attach(model)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    args = TrainingArguments(output_dir=out, per_device_train_batch_size=2, max_steps=4, save_steps=2,
                             save_strategy="steps", learning_rate=3e-3, report_to=[], use_cpu=True,
                             dataloader_num_workers=0, disable_tqdm=True)
    trainer = InOrder(model=model, args=args, train_dataset=data, optimizers=(opt, sched),
                      callbacks=[ShardedOptimizerCallback()] if callback else [])
    trainer.train(resume_from_checkpoint=os.path.join(out, "checkpoint-2") if resume else None)
    # without one passed, the optimizer's first step() added it (the first save deadlocked in accelerate's gather)
    assert sum(isinstance(cb, ShardedOptimizerCallback) for cb in trainer.callback_handler.callbacks) == 1
    weights = flat_weights(model)
    if resume:
        want = torch.load(os.path.join(out, f"weights-{rank}.pt"))
        assert_bitwise_equal(weights, want, "weights after resuming the Trainer from checkpoint-2")
        assert_bitwise_equal(torch.tensor(float(sched.get_last_lr()[0])), torch.tensor(3e-3 / 5), "lr")
    else:
        torch.save(weights, os.path.join(out, f"weights-{rank}.pt"))
        assert os.path.isfile(os.path.join(out, "checkpoint-2", "optimizer.pt"))


def test_the_hf_trainer_saves_and_resumes_on_two_ranks(tmp_path):
    """4 steps with a checkpoint every 2 (the callback passed), then a fresh run resumed from checkpoint-2 (the
    callback adopted at the first step()): the same weights bit for bit (the saved optimizer state is the gathered,
    full one). Before: rank 1 died of gloo's "Received data size doesn't match expected size" at the first save;
    without a callback now, the save would deadlock (rank 1 in accelerate's gather, rank 0 in state_dict())."""
    run_on_ranks(_trainer, 2, str(tmp_path), False, True)
    run_on_ranks(_trainer, 2, str(tmp_path), True, False)


def _trainer_builds_the_optimizer(rank, world_size, out):
    """``Trainer(optimizer_cls_and_kwargs=(ShardedAdamW, {...}))``: the Trainer builds the optimizer over its
    weight-decay groups, then wraps the model in DDP, with no point in between for ``opt.attach(model)``. Against
    the same optimizer built and attached by hand and passed in ``optimizers=``: the same grad norms and weights,
    bit for bit."""
    from transformers import Trainer, TrainingArguments

    from tritonshard.integrations.hf import ShardedOptimizerCallback

    InOrder = _in_order_trainer(rank, world_size)

    data = [{"input_ids": ids, "labels": ids} for step in range(3) for ids in tokens(step, batch=4)]
    args = TrainingArguments(output_dir=out, per_device_train_batch_size=2, max_steps=3, save_strategy="no",
                             learning_rate=3e-3, weight_decay=0.1, max_grad_norm=0.5, logging_steps=1, report_to=[],
                             use_cpu=True, dataloader_num_workers=0, disable_tqdm=True)
    results = {}
    for how in ("by the Trainer", "by hand"):
        model = tiny_llama(0)
        if how == "by the Trainer":
            trainer = InOrder(model=model, args=args, train_dataset=data,
                              optimizer_cls_and_kwargs=(ShardedAdamW, {"lr": 3e-3, "bucket_cap_mb": 0.05}))
        else:  # what the Trainer's create_optimizer builds from those (its two weight-decay groups), attached
            decay = set(Trainer.get_decay_parameter_names(None, model))
            groups = [{"params": [p for n, p in model.named_parameters() if n in decay], "weight_decay": 0.1},
                      {"params": [p for n, p in model.named_parameters() if n not in decay], "weight_decay": 0.0}]
            opt = ShardedAdamW(groups, lr=3e-3, bucket_cap_mb=0.05)
            opt.attach(model)
            trainer = InOrder(model=model, args=args, train_dataset=data, optimizers=(opt, None),
                              callbacks=[ShardedOptimizerCallback()])
        trainer.train()
        sharded = trainer.optimizer.optimizer  # (accelerate's AcceleratedOptimizer around it)
        assert isinstance(sharded, ShardedAdamW) and sharded._attached is not None, how
        assert sum(isinstance(cb, ShardedOptimizerCallback) for cb in trainer.callback_handler.callbacks) == 1, how
        norms = [entry["grad_norm"] for entry in trainer.state.log_history if "grad_norm" in entry]
        assert len(norms) == 3 and min(norms) > 0.5, (how, norms)  # every step clipped
        results[how] = (torch.tensor(norms), flat_weights(model))
    assert_bitwise_equal(results["by the Trainer"][0], results["by hand"][0], "the Trainer's logged grad norms")
    assert_bitwise_equal(results["by the Trainer"][1], results["by hand"][1], "weights")


def test_a_sharded_optimizer_the_hf_trainer_builds_itself_trains_on_two_ranks(tmp_path):
    """Until session 29 the first backward raised (DDP's reducer read the placeholder gradients: the model was
    never attached) and nothing in the Trainer's flow let the loop attach it. Now the optimizer finds the Trainer
    building it and adds its callback, which attaches the model at the start of training."""
    run_on_ranks(_trainer_builds_the_optimizer, 2, str(tmp_path))


def _error_on_one_rank(rank, world_size, case):
    """An error that step() finds on one rank only, before any collective: that rank raises it, and the other one
    PeerFailedError naming it, at once; then both clear their gradients and train on together."""
    from tritonshard.comm import PeerFailedError
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3)).to(torch.bfloat16)
    overlap = "overlap_comm" in case
    opt = ShardedAdamW(model.parameters(), lr=1e-2, overlap_comm=overlap)
    if overlap:
        opt.attach(model)  # (the end of backward launches the reduce-scatters: its handshake is behind the step)

    def loss(step):
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(10 * step + rank)).to(torch.bfloat16)
        return model(x).float().square().mean()

    loss(0).backward()
    opt.step()
    call = opt.step
    if case.startswith("spent gradient"):  # rank 0 clears param.grad after step(), rank 1 forgets to: its step
        if rank == 0:                      # would reuse it
            opt.zero_grad()
        torch_clip = case == "spent gradient, torch's clip"
        if torch_clip:  # and rank 1 skipped its backward: torch's clip meets the spent markers before any reduction
            call = lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # noqa: E731
        if not torch_clip or rank == 0:
            loss(1).backward()
        mine = r"was used by the last step\(\)"
    else:  # "bad lr": rank 1 alone sets an lr of -1 after both clipped (the reduction ran), or with overlap_comm
        opt.zero_grad()  # after the backward that launched the reduction
        loss(1).backward()
        if not overlap:
            opt.clip_grad_norm_(1.0)
        if rank == 1:
            opt.param_groups[0]["lr"] = -1.0
        mine = r"lr"
    start = time.monotonic()
    if rank == 1:
        with pytest.raises(Exception, match=mine) as raised:
            call()
        assert not isinstance(raised.value, PeerFailedError), raised.value
    else:
        with pytest.raises(PeerFailedError, match=r"another rank raised in .* would go on into collectives without "
                                                  r"it.*\(rank 1: \w+Error: .*" + mine):
            call()
    assert time.monotonic() - start < SECONDS, "the ranks waited for each other"
    opt.param_groups[0]["lr"] = 1e-2
    opt.zero_grad()
    for step in range(2, 4):  # (together again: the next handshakes pair)
        loss(step).backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("case", ["spent gradient", "bad lr after the reduction", "spent gradient, torch's clip",
                                  "spent gradient, overlap_comm", "bad lr, overlap_comm"])
def test_an_error_on_one_rank_before_the_collectives_is_an_error_on_every_rank(case):
    """Until session 19 the rank that found the error raised it and the others went on into the step's collectives
    and waited for it (until that process exited, or for gloo's 30 minutes where the loop caught the error); until
    session 20 still so with overlap_comm (the reduction in flight since the end of backward: the failing rank now
    takes part in it, then tells the others at the step's handshake) and where torch's clip_grad_norm_ met the
    spent gradient (SpentGrad now tells them through the reduction's handshake)."""
    run_on_ranks(_error_on_one_rank, 2, case, timeout_s=3 * SECONDS)


# ---------------------------------------------------------------------------------------------- checkpoints
SAVE_CASES = ["another directory on rank 1", "numpy scalar in rank 0's extra", "hook on rank 1",
              "the directory is a file"]
LOAD_CASES = ["no checkpoint at rank 1's path", "meta.pt digest wrong in rank 1's copy", "hook on rank 1"]
DICT_CASES = ["state_dict pre-hook fails on rank 1", "load_state_dict pre-hook fails on rank 1"]


def _checkpoint_error_on_one_rank(rank, world_size, tmp, kind, case, check=True):
    """A save or load (sharded, or of the full state dict) that fails on one rank only (a file only it cannot see,
    read or write; a check only its arguments fail; a hook of the user's): that rank raises its error and the
    other PeerFailedError naming it, within seconds, nothing complete is left that looks like a checkpoint, and
    both go on to save, load and train together."""
    import numpy as np

    from tritonshard.checkpoint import CheckpointError, latest_checkpoint, save_sharded
    from tritonshard.comm import PeerFailedError

    model = tiny_llama(0)
    opt = ShardedAdamW(model.parameters(), lr=3e-3, check_collectives=check)
    _step(model, opt, rank, 0)
    good = save_checkpoint(opt, os.path.join(tmp, "good"), 1)
    directory, failing, extra = os.path.join(tmp, "run"), 1, None
    if kind == "save":
        target = os.path.join(directory, "step_00000002")
        if case == "another directory on rank 1":  # (a step number off by one on one rank): the lead sees it
            failing, mine = 0, (CheckpointError, r"rank\(s\) \[1\] of the shard group did not write into .*"
                                                 r"the same directory")
            call = lambda: save_sharded(opt, target if rank == 0 else target + "-other")  # noqa: E731
        elif case == "numpy scalar in rank 0's extra":  # (used to save fine and never load)
            failing, mine = 0, (TypeError, r"extra\['best'\] is a numpy.float64, which load_sharded cannot read back")
            extra = {"step": 2, "best": np.float64(1.5) if rank == 0 else 1.5}
            call = lambda: save_checkpoint(opt, directory, 2, extra=extra)  # noqa: E731
        elif case == "hook on rank 1":
            mine = (RuntimeError, r"save_checkpoint: the optimizer has 1 hook\(s\) from register_state_dict_pre")
            if rank == 1:
                handle = opt.register_state_dict_pre_hook(lambda o: None)
            call = lambda: save_checkpoint(opt, directory, 2)  # noqa: E731
        else:  # the lead makes the directory: a file in its way fails there only
            failing, mine = 0, (FileExistsError, r"File exists")
            if rank == 0:
                with open(directory, "w") as f:
                    f.write("not a directory\n")
            call = lambda: save_checkpoint(opt, directory, 2)  # noqa: E731
    elif kind == "dict":  # a pre-hook of the user's that fails on one rank (it reads a file only that rank lacks)
        def fails(*args):
            raise OSError("the hook's file is missing on this rank")
        mine = (OSError, r"the hook's file is missing on this rank")
        saved = opt.state_dict()
        if case.startswith("state_dict"):
            if rank == 1:
                handle = opt.register_state_dict_pre_hook(fails)
            call = opt.state_dict
        else:
            if rank == 1:
                handle = opt.register_load_state_dict_pre_hook(fails)
            call = lambda: opt.load_state_dict(saved)  # noqa: E731
    else:
        if case == "no checkpoint at rank 1's path":
            mine = (FileNotFoundError, r"is not a tritonshard sharded checkpoint \(no meta.pt\)")
            call = lambda: load_sharded(opt, good if rank == 0 else os.path.join(tmp, "nowhere"))  # noqa: E731
        elif case == "meta.pt digest wrong in rank 1's copy":
            copy = os.path.join(tmp, "copy")
            if rank == 1:
                shutil.copytree(good, copy)
                with open(os.path.join(copy, "meta.pt.blake2b"), "w") as f:
                    f.write("0" * 32 + "\n")
            mine = (CheckpointError, r"meta.pt is corrupt: its checksum does not match")
            call = lambda: load_sharded(opt, good if rank == 0 else copy)  # noqa: E731
        else:
            mine = (RuntimeError, r"load_sharded: the optimizer has 1 hook\(s\) from register_load_state_dict_pre")
            if rank == 1:
                handle = opt.register_load_state_dict_pre_hook(lambda o, sd: None)
            call = lambda: load_sharded(opt, good)  # noqa: E731
    before = flat_weights(model)
    start = time.monotonic()
    if rank == failing:
        with pytest.raises(mine[0], match=mine[1]) as raised:
            call()
        assert not isinstance(raised.value, PeerFailedError), raised.value
    else:
        told = (rf"\(rank {failing}: {mine[0].__name__}: .*{mine[1]}" if check
                else r"check_collectives=False the ranks agree on a failure flag only")
        with pytest.raises(PeerFailedError, match=r"another rank raised in .*" + told):
            call()
    assert time.monotonic() - start < SECONDS, f"{kind}, {case}: the ranks waited for each other"
    assert_bitwise_equal(flat_weights(model), before, f"weights after a failed {kind}")
    if kind == "save":  # nothing that looks like a checkpoint (the lead completes one only with every shard)
        assert not os.path.isdir(target) and latest_checkpoint(directory) is None, os.listdir(tmp)
    if "handle" in locals():
        handle.remove()
    # together again: a save, a load of it, a step
    if rank == 0 and os.path.isfile(directory):  # (the rank that put it there)
        os.remove(directory)
    saved = save_checkpoint(opt, os.path.join(tmp, "after"), 2)
    _step(model, opt, rank, 1)
    load_sharded(opt, saved)
    assert_bitwise_equal(flat_weights(model), before, "weights loaded from the checkpoint saved after the error")
    _step(model, opt, rank, 2)


@pytest.mark.parametrize("kind,case", [("save", c) for c in SAVE_CASES] + [("load", c) for c in LOAD_CASES]
                         + [("dict", c) for c in DICT_CASES])
def test_a_checkpoint_error_on_one_rank_is_an_error_on_every_rank(tmp_path, kind, case):
    """Until session 20 the rank that failed raised and the others went on into the next collective (DCP's, a
    barrier, the state dict's gather) and waited for it: 30 minutes, gloo's default timeout. A save into
    directories that differ between ranks completed a checkpoint at rank 0's path without rank 1's shards, which
    looked whole (its checksums list what rank 0 sees) and failed only when loaded; a numpy scalar in ``extra``
    saved fine and could not be loaded."""
    run_on_ranks(_checkpoint_error_on_one_rank, 2, str(tmp_path), kind, case, timeout_s=3 * SECONDS)


@pytest.mark.parametrize("kind,case", [("save", "another directory on rank 1"), ("save", "the directory is a file"),
                                       ("load", "no checkpoint at rank 1's path")])
def test_a_checkpoint_error_on_one_rank_is_an_error_on_every_rank_without_the_handshakes(tmp_path, kind, case):
    """check_collectives=False: the steps of a save or load meet in an all-reduce of a failure flag (they met in
    barriers until session 20, and the others waited there)."""
    run_on_ranks(_checkpoint_error_on_one_rank, 2, str(tmp_path), kind, case, False, timeout_s=3 * SECONDS)
