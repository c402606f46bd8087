"""Sharded optimizers with the torch.optim.Optimizer API."""

from .adamw import ShardedAdamW
from .base import ShardedOptimizer

__all__ = ["ShardedOptimizer", "ShardedAdamW"]
