"""Hugging Face accelerate and the Trainer driving ShardedAdamW, the way their documentation writes the loop.

accelerate's documented order: build the model and the optimizer, then ``accelerator.prepare(model, optimizer)``,
which moves the model (``model.to("cpu:0")`` copies on CPU) and, on several processes, wraps it in
DistributedDataParallel; the loop uses ``accelerator.accumulate``, ``accelerator.backward`` and
``accelerator.clip_grad_norm_``. With ``opt.attach(model)`` before ``prepare`` this must train exactly as our own
loop does without accelerate; without it, the DDP wrapper is an error (it would reduce the gradients twice).
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.distributed import run_on_ranks
from tests.helpers import assert_bitwise_equal, assert_close_rel
from tests.integration.hf import flat_weights, lm_loss, tiny_llama, tokens
from tritonshard import ShardedAdamW

STEPS, ACCUMULATION, MAX_NORM = 3, 2, 0.5


def _plain_loop(rank):
    """Our loop, without accelerate: the same micro-batches, loss / ACCUMULATION, torch's clipping."""
    model = tiny_llama(0)
    opt = ShardedAdamW(model.parameters(), lr=3e-3)
    norms = []
    for step in range(STEPS):
        for micro in range(ACCUMULATION):
            (lm_loss(model, tokens(step, rank, micro)) / ACCUMULATION).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM))
        opt.step()
        opt.zero_grad()
    return flat_weights(model), torch.stack(norms)


def _accelerate_loop(rank, world_size, attach, overlap=False):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(
        world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT="29999")  # the process group exists already
    from accelerate import Accelerator
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=ACCUMULATION)
    assert accelerator.num_processes == world_size
    model = tiny_llama(0)
    opt = ShardedAdamW(model.parameters(), lr=3e-3, overlap_comm=overlap)
    if attach:
        opt.attach(model)
    model, opt = accelerator.prepare(model, opt)
    assert isinstance(model, torch.nn.parallel.DistributedDataParallel), "accelerate wrapped the model in DDP"
    if not attach:
        with pytest.raises(RuntimeError, match="DistributedDataParallel"):
            accelerator.backward(lm_loss(model, tokens(0, rank, 0)))
            accelerator.clip_grad_norm_(model.parameters(), MAX_NORM)
            opt.step()
        return
    norms = []
    for step in range(STEPS):
        for micro in range(ACCUMULATION):
            with accelerator.accumulate(model):
                accelerator.backward(lm_loss(model, tokens(step, rank, micro)))
                if accelerator.sync_gradients:
                    norms.append(accelerator.clip_grad_norm_(model.parameters(), MAX_NORM))
                opt.step()       # AcceleratedOptimizer: steps only when the accumulation is complete
                opt.zero_grad()
    weights, plain_norms = _plain_loop(rank)
    assert float(plain_norms.min()) > MAX_NORM, "the test must clip"
    assert_bitwise_equal(torch.stack(norms), plain_norms, "accelerate's clip_grad_norm_ results")
    assert_bitwise_equal(flat_weights(accelerator.unwrap_model(model)), weights, "weights trained via accelerate")


@pytest.mark.parametrize("attach,overlap", [(True, False), (False, False), (True, True)])
def test_accelerate_prepare_in_the_documented_order(attach, overlap):
    """Before the fix: prepare() copied the weights (the model never trained again) and DDP reduced the gradients
    a second time; accelerate's clip_grad_norm_ returned 0.0. With ``overlap_comm`` (bit for bit the loop without
    it): until session 27 accumulate()'s first micro-batch ran in DDP's own no_sync() (prepare wraps the model
    after attach, and the wrapper is guarded at its first forward), so its backward launched the reduction and
    the second micro-batch's gradients were an error."""
    run_on_ranks(_accelerate_loop, 2, attach, overlap)


def test_hf_trainer_clips_with_the_global_norm(tmp_path):
    """transformers.Trainer with ShardedAdamW passed in ``optimizers=``: its clipping (accelerate's
    clip_grad_norm_ on model.parameters()) must report and apply the real gradient norm (0.0 before the fix), and
    training must match our own loop over the same batches with torch's clipping."""
    from torch.utils.data import SequentialSampler
    from transformers import Trainer, TrainingArguments

    class InOrder(Trainer):  # the same batches in the same order as the loop below
        def _get_train_sampler(self, *args, **kwargs):
            return SequentialSampler(self.train_dataset)

    batch, steps, lr = 4, 3, 3e-3
    data = [{"input_ids": ids, "labels": ids} for step in range(steps) for ids in tokens(step, batch=batch)]
    model = tiny_llama(0)
    opt = ShardedAdamW(model.parameters(), lr=lr, weight_decay=0.0)
    opt.attach(model)  # the documented order: before handing both to the Trainer
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=batch, max_steps=steps,
                             max_grad_norm=MAX_NORM, learning_rate=lr, logging_steps=1, report_to=[],
                             save_strategy="no", use_cpu=True, dataloader_num_workers=0, disable_tqdm=True)
    trainer = InOrder(model=model, args=args, train_dataset=data, optimizers=(opt, sched))
    trainer.train()
    logged = [float(entry["grad_norm"]) for entry in trainer.state.log_history if "grad_norm" in entry]

    ref = tiny_llama(0)
    ref_opt = ShardedAdamW(ref.parameters(), lr=lr, weight_decay=0.0)
    ref_norms = []
    for step in range(steps):
        lm_loss(ref, tokens(step, batch=batch)).backward()
        ref_norms.append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM)))
        ref_opt.step()
        ref_opt.zero_grad()
    assert min(ref_norms) > MAX_NORM, "the test must clip"
    assert len(logged) == steps
    # The Trainer divides the summed token losses by the batch's token count (num_items_in_batch) where the
    # loop takes the model's mean: the same value up to fp32 summation order, which bf16 gradients then round;
    # one bf16 ulp (2^-8 relative) of the norm or of a weight is the bound.
    assert_close_rel(torch.tensor(logged), torch.tensor(ref_norms), 2.0 ** -8, what="grad norms the Trainer logged")
    assert_close_rel(flat_weights(model), flat_weights(ref), 2.0 ** -8, what="weights trained by the Trainer")


def _accelerate_save_and_resume(rank, world_size, tmp, resume, safe):
    """accelerate's checkpointing: ``save_state`` after 2 steps (model, optimizer, scheduler, RNG states), 2 steps
    more; then a new run that ``load_state``s and takes the same 2 steps."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(
        world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT="29999")  # the process group exists already
    from accelerate import Accelerator
    accelerator = Accelerator(cpu=True)
    model = tiny_llama(0)
    opt = ShardedAdamW(model.parameters(), lr=3e-3)
    opt.attach(model)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    model, opt, sched = accelerator.prepare(model, opt, sched)

    def step(s):
        accelerator.backward(lm_loss(model, tokens(s, rank)))
        accelerator.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        sched.step()
        opt.zero_grad()

    state, want = os.path.join(tmp, "state"), os.path.join(tmp, f"weights-{rank}.pt")
    if not resume:
        for s in range(2):
            step(s)
        accelerator.save_state(state, safe_serialization=safe)
        for s in range(2, 4):
            step(s)
        torch.save(flat_weights(accelerator.unwrap_model(model)), want)
        if safe:  # every weight is in the file (accelerate keeps one tensor per storage)
            from safetensors.torch import load_file
            saved = load_file(os.path.join(state, "model.safetensors"))
            assert saved.keys() == accelerator.unwrap_model(model).state_dict().keys(), sorted(saved)
        return
    accelerator.load_state(state)
    for s in range(2, 4):
        step(s)
    assert_bitwise_equal(flat_weights(accelerator.unwrap_model(model)), torch.load(want),
                         "weights resumed with accelerate's load_state")


@pytest.mark.parametrize("safe", [True, False])
def test_accelerate_save_state_and_load_state_resume_bit_for_bit(tmp_path, safe):
    """accelerate's checkpoints resume bit for bit: weights, the gathered optimizer state, the scheduler, with the
    model in safetensors (accelerate's default) or pickled. Until session 20 the safetensors file held one weight of
    21 (accelerate keeps one tensor per storage, and every parameter was a view of its bucket's buffer: now each
    has a storage of its own over the same memory, bucket.alone), with a log line only; safetensors' load_model
    refused the model ("None is covering the entire storage")."""
    run_on_ranks(_accelerate_save_and_resume, 2, str(tmp_path), False, safe)
    run_on_ranks(_accelerate_save_and_resume, 2, str(tmp_path), True, safe)
