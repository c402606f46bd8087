"""Hugging Face ``transformers.Trainer`` on several ranks.

The Trainer saves the optimizer from the main process only (``torch.save(optimizer.state_dict(), ...)`` under
``args.should_save``), but a sharded optimizer's ``state_dict()`` gathers the shards of every rank: a collective.
:class:`ShardedOptimizerCallback` has every rank gather it at the end of each step (and epoch) that the Trainer is
about to save, so the main process's later ``state_dict()`` returns the gathered state without communicating
(:meth:`~tritonshard.optim.base.ShardedOptimizer.prepare_state_dict`). Resuming needs nothing: the Trainer loads
the optimizer on every rank.

    trainer = Trainer(model=model, args=args, optimizers=(opt, scheduler),
                      callbacks=[ShardedOptimizerCallback()])

A Trainer can also build the optimizer itself, ``Trainer(..., optimizer_cls_and_kwargs=(ShardedAdamW, {...}))``,
and then wraps the model in ``DistributedDataParallel`` (on more than one rank) with no point in between where the
loop could call ``opt.attach(model)``, which that wrapper needs (else its reducer meets tritonshard's placeholder
gradients: an error). The optimizer finds the Trainer building it and adds the callback, and the callback attaches
the Trainer's model at the start of training where the optimizer is not attached yet, on more than one rank.

A Trainer that drives a sharded optimizer on several ranks without the callback gets one at the optimizer's first
``step()`` (:func:`adopt_trainer`, logged): without it the first save would deadlock, since the other ranks go on
into the Trainer's own collectives (accelerate's gather of the token count) while the main process waits in
``state_dict()``. Saves decided after the step's callbacks ran (``save_strategy="best"``) are not prepared: the
main process then waits in ``state_dict()`` and logs why after ``tritonshard.comm.WARN_AFTER_S`` seconds.
"""

from __future__ import annotations

import logging
import sys

from transformers import Trainer, TrainerCallback

from ..optim.base import ShardedOptimizer

__all__ = ["ShardedOptimizerCallback", "adopt_trainer"]

_log = logging.getLogger("tritonshard")


def _sharded(optimizer):
    """The ShardedOptimizer inside what the Trainer holds (accelerate wraps it in an AcceleratedOptimizer)."""
    for _ in range(4):
        if isinstance(optimizer, ShardedOptimizer):
            return optimizer
        optimizer = getattr(optimizer, "optimizer", None)
    return None


class ShardedOptimizerCallback(TrainerCallback):
    """Gathers the sharded optimizer's state on every rank before each save the Trainer is about to make."""

    def _prepare(self, args, control, optimizer) -> None:
        opt = _sharded(optimizer)
        if control.should_save and opt is not None and not args.save_only_model:
            opt.prepare_state_dict(keep=bool(args.should_save))  # only the saving processes keep a copy

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        """Attach the Trainer's model (the one inside the DDP wrapper the Trainer made) to a sharded optimizer not
        attached yet, on more than one rank: before the wrapper's first forward, which is where ``attach`` switches
        its gradient reduction off. (Where the optimizer is attached already, to this model or another, nothing.)"""
        opt = _sharded(optimizer)
        if opt is None or model is None or opt._attached is not None or opt.world_size * opt.replica_size == 1:
            return
        opt.attach(model)
        _log.info("tritonshard: attached the Trainer's model to %s (the Trainer wraps the model in "
                  "DistributedDataParallel; attach switches its gradient reduction off)", type(opt).__name__)

    def on_step_end(self, args, state, control, optimizer=None, **kwargs):
        self._prepare(args, control, optimizer)

    def on_epoch_end(self, args, state, control, optimizer=None, **kwargs):
        self._prepare(args, control, optimizer)


def adopt_trainer(opt: ShardedOptimizer, max_frames: int = 24, skip_frames: int = 1) -> bool:
    """If a ``transformers.Trainer`` is up the call stack (its training loop calling ``opt.step()``) and has no
    :class:`ShardedOptimizerCallback`, add one. Returns whether a Trainer was found. Called, when transformers is
    imported, for an optimizer with more than one rank as it is built (a Trainer building it itself) and, where no
    Trainer was found then, once more at its first ``step()``. The stack is read from ``skip_frames`` above this
    function (its caller's, by default)."""
    frame = sys._getframe(skip_frames)
    for _ in range(max_frames):
        if frame is None:
            return False
        # (the frames of transformers and of libraries built on its Trainer only: on Python < 3.13 reading a
        # frame's f_locals leaves a copy of its locals in it until it ends, so the user's loop's frames kept their
        # first step's batch, model and optimizer: a `del opt` freed nothing until session 28)
        module = frame.f_globals.get("__name__") or ""
        trainer = frame.f_locals.get("self") if module.startswith(("transformers.", "trl.")) else None
        if isinstance(trainer, Trainer):
            if not any(isinstance(cb, ShardedOptimizerCallback) for cb in trainer.callback_handler.callbacks):
                trainer.add_callback(ShardedOptimizerCallback())
                _log.info("tritonshard: added ShardedOptimizerCallback to the Trainer driving %s: the Trainer saves "
                          "the optimizer on the main process only, and its state_dict() is a collective",
                          type(opt).__name__)
            return True
        frame = frame.f_back
    return False
