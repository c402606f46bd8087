"""tritonshard: mixed-precision sharded-gradient data parallelism for PyTorch, with fused Triton kernels."""

from .buffer import DEFAULT_ALIGN, Buffer, LayoutMismatchError
from .layout import Layout, ShardPiece
from .optim import LossScaleConfig, ShardedAdamW, ShardedLion, ShardedMuon, ShardedOptimizer, ShardedSGD

__version__ = "0.1.0"

__all__ = ["ShardedAdamW", "ShardedSGD", "ShardedLion", "ShardedMuon", "ShardedOptimizer", "LossScaleConfig", "Buffer", "Layout",
           "ShardPiece", "LayoutMismatchError", "DEFAULT_ALIGN", "__version__"]
