"""The element types ferrocupy computes in, written once.

`bfloat16` is `ml_dtypes`'s NumPy dtype, which CuPy (>= 14) uses for its own `bfloat16`: a PyTorch
bf16 tensor wrapped through DLPack arrives with exactly this dtype, on the GPU and on the host.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

FLOAT32 = np.dtype(np.float32)
FLOAT16 = np.dtype(np.float16)
BFLOAT16 = np.dtype(ml_dtypes.bfloat16)

# q, k, v, out and the gradients share one of these per call.
ATTENTION_DTYPES = (FLOAT32, FLOAT16, BFLOAT16)
HALF_DTYPES = (FLOAT16, BFLOAT16)


def mask_dtypes(dtype: np.dtype) -> tuple:
    """What a mask may be in a call computing in `dtype`: float32 always, or the same dtype."""
    return (FLOAT32,) if dtype == FLOAT32 else (FLOAT32, dtype)


def parse(dtype) -> np.dtype:
    """`"bfloat16"`, `np.float16`, `ml_dtypes.bfloat16`, ... as a NumPy dtype."""
    if isinstance(dtype, str) and dtype == "bfloat16":
        return BFLOAT16
    return np.dtype(dtype)
