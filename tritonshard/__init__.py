"""tritonshard: mixed-precision sharded-gradient data parallelism for PyTorch, with fused Triton kernels."""

from .buffer import DEFAULT_ALIGN, Buffer, LayoutMismatchError
from .layout import Layout, ShardPiece
from .optim import LossScaleConfig, ShardedAdamW, ShardedLion, ShardedOptimizer, ShardedSGD

__version__ = "0.1.0"

__all__ = ["ShardedAdamW", "ShardedSGD", "ShardedLion", "ShardedOptimizer", "LossScaleConfig", "Buffer", "Layout",
           "ShardPiece", "LayoutMismatchError", "DEFAULT_ALIGN", "__version__"]
