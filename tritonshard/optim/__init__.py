"""Sharded optimizers with the torch.optim.Optimizer API."""

from .adamw import ShardedAdamW
from .base import ShardedOptimizer
from .sgd import ShardedLion, ShardedSGD

__all__ = ["ShardedOptimizer", "ShardedAdamW", "ShardedSGD", "ShardedLion"]
