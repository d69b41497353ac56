"""ferrocupy: fused attention and rotary embeddings for NVIDIA GPUs through CuPy."""

from .engine import AttentionOptions, ComputeEngine
from .params import AttentionDims, rope_params
from .plan import AttentionPlan, TensorSpec
from .tensor import UnifiedTensor, cuda_available

__all__ = ["AttentionDims", "AttentionOptions", "AttentionPlan", "ComputeEngine", "TensorSpec",
           "UnifiedTensor", "cuda_available", "rope_params"]
__version__ = "0.1.0"
