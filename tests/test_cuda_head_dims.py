"""head_dim above 128, up to SPEC's 256 (issue 26), on the GPU: forward and backward in float32,
float16 and bfloat16, and decode, against the float64 reference with every output NaN-poisoned
first; half precision by SPEC's rule (tests/half_rule.py). The forward and backward run twice:
on the kernels the GPU picks (on sm_90a in half precision the wgmma ones: the forward and dQ at
width 192 or 256, dK/dV at 256 with its columns split between two warpgroups; also
tests/test_cuda_wgmma_dims.py) and on the mma.sync kernels alone (`kernels`), whose dK/dV runs
in two column ranges (configs.py `dkdv_parts`): head_dim 136 and 200 pad to 144 and 208, whose
ranges overlap by 16 columns; 255 (forward and backward) copies one element at a time in half precision (an odd
row).

Skipped unless `ferrocupy.cuda_available()`; `FERRO_GPU_TESTS_ON_REFERENCE=1` runs it on the
reference (see tests/gpu_helpers.py).
"""

from __future__ import annotations

import pytest

from ferrocupy import AttentionOptions
from ferrocupy.dtypes import BFLOAT16, FLOAT16, FLOAT32
from gpu_helpers import (DROPOUT_SEED, axis, check_backward, check_decode_case, check_forward,
                         covering, decoders, dev, gpu_pytestmark, kernels, make_case, ref)
from half_rule import rounded
from test_cuda_half import check_half

__all__ = ["decoders", "dev", "kernels", "ref"]  # fixtures, imported for pytest (`rng` comes from conftest)

pytestmark = gpu_pytestmark()

DTYPES = [pytest.param(FLOAT32, id="f32"), pytest.param(FLOAT16, id="f16"),
          pytest.param(BFLOAT16, id="bf16")]
HEAD_DIMS = [136, 160, 192, 200, 255, 256]

# Options per case, on 2 x 150 query rows (two forward tiles of 128, three dQ tiles of 64) over
# 203 keys (four dK/dV tiles of 64, the last short) in 4 heads over 2 KV heads (GQA).
CASES = {
    "full": dict(),
    "causal": dict(causal=True, causal_offset=53),
    "mask": dict(mask="B,1,Sq,Sk", neg_inf=0.05),
    "causal-mask-dropout": dict(causal=True, causal_offset=53, mask="1,H,Sq,Sk", neg_inf=0.05,
                                dropout_prob=0.2, seed=DROPOUT_SEED),
    "window-dropout": dict(window=40, causal_offset=53, dropout_prob=0.1, seed=DROPOUT_SEED),
}


@pytest.mark.parametrize("dtype,d,name", covering({
    "dtype": axis(DTYPES),
    "d": axis(HEAD_DIMS, ids=lambda d: f"d{d}"),
    "name": axis(list(CASES)),
}))
def test_wide_head_dim_forward_and_backward(kernels, ref, rng, dtype, d, name):
    case = make_case(rng, b=2, sq=150, sk=203, h=4, hkv=2, d=d, qk_scale=1.0, **CASES[name])
    if dtype == FLOAT32:
        check_forward(kernels, ref, case)
        check_backward(kernels, ref, case)
    else:
        check_half(kernels, rounded(case, dtype))


@pytest.mark.parametrize("d", [136, 256], ids=lambda d: f"d{d}")
@pytest.mark.parametrize("dtype", DTYPES)
def test_wide_head_dim_backward_without_lse_and_one_head(dev, ref, rng, dtype, d):
    """MHA (one KV head a query head), a query tile per key tile; the half backward without the
    forward's lse (dQ's own statistics pass)."""
    case = make_case(rng, b=1, sq=64, sk=64, h=3, d=d, qk_scale=1.0, causal=True)
    if dtype == FLOAT32:
        check_backward(dev, ref, case)
    else:
        check_half(dev, rounded(case, dtype), give_lse=False)


# (batch, seq_q, heads, kv_heads, seq_k, options, mask, kv_lens): one query row a GQA-4 group
# over a cache with uneven lengths (NaN past them, one empty) split many ways; 12 rows a group
# (the tensor-core and tiles designs) with a window, a mask and dropout; 8 rows (streams).
DECODE_CASES = {
    "sq1-gqa4-cache": (3, 1, 8, 2, 5000, dict(causal=True, causal_offset=4999), False,
                       [5000, 0, 1777]),
    "sq3-gqa4-window-mask-dropout": (2, 3, 8, 2, 4099,
                                     dict(window=777, causal_offset=4096, dropout_prob=0.15,
                                          seed=11), True, [4099, 2222]),
    "sq2-gqa4-causal": (2, 2, 8, 2, 3001, dict(causal=True, causal_offset=2999), False, None),
}


@pytest.mark.parametrize("dtype,d,name", covering({
    "dtype": axis(DTYPES),
    "d": axis([136, 160, 192, 200, 256], ids=lambda d: f"d{d}"),
    "name": axis(list(DECODE_CASES)),
}))
def test_wide_head_dim_decode(decoders, ref, rng, dtype, d, name):
    b, sq, h, hkv, sk, opts, mask, lens = DECODE_CASES[name]
    check_decode_case(decoders, ref, rng, dtype, b, sq, h, hkv, d, sk, AttentionOptions(**opts),
                      mask, lens, what=f"{name} d{d}")
