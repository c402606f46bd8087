"""Sharded optimizers with the torch.optim.Optimizer API."""

from .adamw import ShardedAdamW
from .base import LossScaleConfig, ShardedOptimizer
from .muon import ShardedMuon
from .sgd import ShardedLion, ShardedSGD

__all__ = ["LossScaleConfig", "ShardedOptimizer", "ShardedAdamW", "ShardedSGD", "ShardedLion", "ShardedMuon"]
