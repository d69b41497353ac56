"""Keys past every row's reach are never read (SPEC "Beyond the seed", issue 9): under causal
(with a KV-cache offset, negative included) or a window's right side, keys no row of the call
can see may hold anything, NaN included, as a preallocated cache does; every kernel, in every
dtype, gives exactly what it gives with zeros there, and nothing non-finite.

Skipped unless `ferrocupy.cuda_available()`; `FERRO_GPU_TESTS_ON_REFERENCE=1` runs it on the
reference (see tests/gpu_helpers.py)."""

from __future__ import annotations

import numpy as np
import pytest

from ferrocupy import AttentionOptions
from ferrocupy.dtypes import BFLOAT16, FLOAT16, FLOAT32
from gpu_helpers import (check_forward_with_lse, dev, gpu_pytestmark, kernels,  # noqa: F401
                         ref)

pytestmark = gpu_pytestmark()

DTYPES = [pytest.param(FLOAT32, id="f32"), pytest.param(FLOAT16, id="f16"),
          pytest.param(BFLOAT16, id="bf16")]
# (options, the first key no row of a 5-row call reaches)
REACH = [
    pytest.param(AttentionOptions(causal=True, causal_offset=100), 105, id="causal-offset100"),
    pytest.param(AttentionOptions(causal=True, causal_offset=100, window=9), 105, id="causal-window"),
    pytest.param(AttentionOptions(window=3, causal_offset=100), 107, id="window3-offset100"),
    pytest.param(AttentionOptions(window_right=6, causal_offset=100), 111, id="right6-offset100"),
    pytest.param(AttentionOptions(window_left=2, window_right=0, causal_offset=100), 105,
                 id="left2-right0"),
    pytest.param(AttentionOptions(causal=True, causal_offset=-2), 3, id="causal-negative"),
    pytest.param(AttentionOptions(window_right=1, causal_offset=-3), 3, id="right1-negative"),
]


def _run(d, q, k, v, go, opts, dtype):
    put = lambda a: d.put(a.astype(dtype))  # noqa: E731
    tq, tk, tv, tgo = put(q), put(k), put(v), put(go)
    out = d.poisoned(q.shape, dtype=dtype)
    lse = d.poisoned(q.shape[:1] + (q.shape[2], q.shape[1]), dtype=np.float32)
    d.engine.flash_attention_v2_with(tq, tk, tv, out, opts, lse=lse)
    grads = [d.poisoned(x.shape, dtype=dtype) for x in (q, k, v)]
    d.engine.flash_attention_v2_backward_with(tq, tk, tv, out, tgo, *grads, opts, lse=lse)
    names = ("out", "lse", "grad_q", "grad_k", "grad_v")
    return {n: d.get(t).astype(np.float32) for n, t in zip(names, (out, lse, *grads))}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [32, 64, 128], ids=lambda d: f"d{d}")
@pytest.mark.parametrize("opts, reach", REACH)
def test_nan_past_the_reach_changes_nothing(kernels, rng, dtype, d, opts, reach):
    b, sq, sk, h, hkv = 2, 5, 300, 4, 2
    q = rng.standard_normal((b, sq, h, d)).astype(np.float32)
    k = rng.standard_normal((b, sk, hkv, d)).astype(np.float32)
    v = rng.standard_normal((b, sk, hkv, d)).astype(np.float32)
    go = rng.standard_normal((b, sq, h, d)).astype(np.float32)
    k[:, reach:], v[:, reach:] = 0, 0
    want = _run(kernels, q, k, v, go, opts, dtype)
    k[:, reach:], v[:, reach:] = np.nan, np.nan
    got = _run(kernels, q, k, v, go, opts, dtype)
    for name in want:
        assert not np.isnan(got[name]).any(), f"{name}: NaN past the reach got in"
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    assert (got["grad_k"][:, reach:] == 0).all() and (got["grad_v"][:, reach:] == 0).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [32, 64, 128], ids=lambda d: f"d{d}")
@pytest.mark.parametrize("opts, mask", [
    pytest.param(AttentionOptions(causal=True), None, id="causal"),
    pytest.param(AttentionOptions(causal=True, causal_offset=37), "mask", id="causal-offset-mask"),
    pytest.param(AttentionOptions(window=50, causal_offset=20, dropout_prob=0.2, seed=5), None,
                 id="window-dropout"),
    pytest.param(AttentionOptions(), None, id="none"),
])
def test_kv_lens_matches_the_reference(kernels, ref, rng, dtype, d, opts, mask):  # noqa: F811
    """Uneven per-sequence lengths (full, partial, a tile-straddling one, 1 and 0), NaN past
    each: the device's out and lse equal the reference's, and no NaN gets in."""
    b, sq, sk, h, hkv = 6, 7, 333, 4, 2
    q = (rng.standard_normal((b, sq, h, d)) * 1.2).astype(np.float32).astype(dtype)
    k = (rng.standard_normal((b, sk, hkv, d)) * 1.2).astype(np.float32).astype(dtype)
    v = rng.standard_normal((b, sk, hkv, d)).astype(np.float32).astype(dtype)
    m = rng.standard_normal((b, 1, sq, sk)).astype(np.float32) if mask else None
    lens = np.array([333, 250, 129, 64, 1, 0], np.int32)
    for i, n in enumerate(lens):
        k[i, n:], v[i, n:] = np.nan, np.nan
    check_forward_with_lse(kernels, ref, q, k, v, opts, m, lens)
