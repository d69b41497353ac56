"""The decode path (issue 9): few query rows per KV group (heads / kv_heads * seq_q <= 16)
against a long cache go through a split-KV decode kernel (the engine's pick: tensor cores in half
precision, the streams kernel in float32; the streams design; the tiles design; each tested: the
`decoders` fixture), the splits merged by each group's last block (or, in the tiles design, by
the combine kernel). Compared with the
reference at decode shapes: seq_q 1-8, GQA 1-8, up to 128k keys, uneven kv_lens with NaN past
them, split counts that do not divide the keys, every forward option; out and lse.

Skipped unless `ferrocupy.cuda_available()`; `FERRO_GPU_TESTS_ON_REFERENCE=1` runs it on the
reference (see tests/gpu_helpers.py)."""

from __future__ import annotations

import numpy as np
import pytest

from ferrocupy import AttentionOptions
from ferrocupy.dtypes import BFLOAT16, FLOAT16, FLOAT32
from gpu_helpers import (check_decode_case, check_forward_with_lse, decoders,  # noqa: F401
                         dev, gpu_pytestmark, ref)

pytestmark = gpu_pytestmark()

DTYPES = [pytest.param(FLOAT32, id="f32"), pytest.param(FLOAT16, id="f16"),
          pytest.param(BFLOAT16, id="bf16")]

# (batch, seq_q, heads, kv_heads, head_dim, seq_k, options, mask, kv_lens)
CASES = {
    "sq1-gqa4-d128-cache": (3, 1, 8, 2, 128, 5000, dict(causal=True, causal_offset=4999), None,
                            [5000, 3333, 17]),
    "sq4-gqa4-d64-mask-dropout": (2, 4, 8, 2, 64, 2049,
                                  dict(causal=True, causal_offset=2045, dropout_prob=0.1,
                                       seed=9), "mask", None),
    "sq8-mha-d80-window-128k": (1, 8, 2, 2, 80, 131072,
                                dict(causal=True, causal_offset=131064, window=1000), None, None),
    "sq1-gqa8-d32-noncausal": (2, 1, 8, 1, 32, 777, dict(), None, [777, 0]),
    "sq2-gqa8-d16-window": (2, 2, 8, 1, 16, 4100, dict(window=7, causal_offset=4000), "mask",
                            [4100, 3000]),
    "sq1-d7-odd": (2, 1, 4, 4, 7, 300, dict(causal=True, causal_offset=299), None, None),
    # The streams design (rows <= 8, 16-byte rows) with every option it must honour.
    "sq2-gqa4-d128-mask-dropout": (2, 2, 8, 2, 128, 3001,
                                   dict(causal=True, causal_offset=2999, dropout_prob=0.2,
                                        seed=5), "mask", [3001, 1500]),
    "sq1-gqa2-d48-window": (1, 1, 4, 2, 48, 9000, dict(window=333, causal_offset=8000), None,
                            None),
    # 12 rows a group (the tensor-core design in half precision) with a window that starts
    # at an odd key inside a split (dropout's keys j, j + 1 can straddle a Philox group).
    "sq3-gqa4-d128-window-mask-dropout": (2, 3, 8, 2, 128, 4099,
                                          dict(window=777, causal_offset=4096, dropout_prob=0.15,
                                               seed=11), "mask", [4099, 2222]),
    # Enough (batch, KV head) pairs that one split fills the GPU: the block writes out itself.
    "b40-sq1-gqa4-d128-one-split": (40, 1, 8, 2, 128, 250, dict(causal=True, causal_offset=249),
                                    None, [250 - 6 * i for i in range(40)]),
    # Pairs split many ways with uneven kv_lens (a pair with no key, one with one) and NaN past
    # them; and a GQA-8 case of many short pairs with a mask and dropout.
    "b7-sq1-gqa4-d128-many-splits": (7, 1, 8, 2, 128, 20000,
                                      dict(causal=True, causal_offset=19999), None,
                                      [20000, 1, 0, 19999, 7777, 16, 12345]),
    "b9-sq1-gqa8-d64-short-mask-dropout": (9, 1, 16, 2, 64, 1500,
                                              dict(dropout_prob=0.1, seed=3), "mask",
                                              [1500 - 150 * i for i in range(9)]),
    # compare.py's head counts (8 KV heads) and 16, with uneven kv_lens (one of 0 keys, one of 1)
    # and NaN past them, a window starting mid-split, 8 rows a group with a mask and dropout, many
    # short pairs (one split each); and without kv_lens: one pair split many ways (100k keys), a
    # window, 16 KV heads with a mask and dropout, 300 short pairs, head_dim 96.
    "b4-sq1-gqa4-kv8-d128-cache": (4, 1, 32, 8, 128, 5000, dict(causal=True, causal_offset=4999),
                                   None, [5000, 3333, 0, 1]),
    "b2-sq1-gqa2-kv16-d64-window": (2, 1, 32, 16, 64, 20000,
                                    dict(causal=True, causal_offset=19999, window=4099), None,
                                    [20000, 11111]),
    "b2-sq2-gqa4-kv8-d128-mask-dropout": (2, 2, 32, 8, 128, 3001,
                                          dict(causal=True, causal_offset=2999,
                                               dropout_prob=0.2, seed=5), "mask", [3001, 1500]),
    "b300-sq1-gqa2-kv8-d16-short": (300, 1, 16, 8, 16, 64, dict(causal=True, causal_offset=63),
                                    None, [64 - i % 60 for i in range(300)]),
    "b1-sq1-gqa4-kv8-d128-100k": (1, 1, 32, 8, 128, 100003,
                                  dict(causal=True, causal_offset=100002), None, None),
    "b3-sq1-gqa4-kv8-d64-window": (3, 1, 32, 8, 64, 7000,
                                   dict(causal=True, causal_offset=6999, window=2501), None, None),
    "b2-sq2-gqa4-kv16-d128-mask-dropout": (2, 2, 64, 16, 128, 3001,
                                           dict(causal=True, causal_offset=2999,
                                                dropout_prob=0.2, seed=7), "mask", None),
    "b300-sq1-gqa2-kv8-d16-short-full": (300, 1, 16, 8, 16, 64,
                                         dict(causal=True, causal_offset=63), None, None),
    "b5-sq1-gqa4-kv8-d96": (5, 1, 32, 8, 96, 3000, dict(), None, None),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(CASES))
def test_decode_matches_the_reference(decoders, ref, rng, dtype, name):  # noqa: F811
    b, sq, h, hkv, d, sk, opts, mask, lens = CASES[name]
    check_decode_case(decoders, ref, rng, dtype, b, sq, h, hkv, d, sk, AttentionOptions(**opts),
                      bool(mask), lens, what=name)


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_split_merge_leaves_its_tickets_at_zero(decoders, ref, rng, dtype):  # noqa: F811
    """The same split call shape three times with fresh inputs (one plan, its workspace reused on
    the stream): each right. The pair's last block merges the splits only if every launch leaves
    the tickets at zero; a launch that did not would leave the next one's out unwritten (NaN)."""
    b, sq, h, hkv, d, sk = 2, 1, 32, 8, 128, 20000
    opts = AttentionOptions(causal=True, causal_offset=sk - 1)
    for i in range(3):
        q = rng.standard_normal((b, sq, h, d)).astype(np.float32).astype(dtype)
        k = rng.standard_normal((b, sk, hkv, d)).astype(np.float32).astype(dtype)
        v = rng.standard_normal((b, sk, hkv, d)).astype(np.float32).astype(dtype)
        check_forward_with_lse(decoders, ref, q, k, v, opts, what=f"call {i}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kv_heads", [8, 16])
def test_decode_nan_past_the_reach_changes_nothing(dev, rng, dtype, kv_heads):  # noqa: F811
    """A preallocated cache with NaN past the last key a row sees (causal with an offset), at
    compare.py's decode shapes (8 KV heads, and 16; 1 and 2 rows a head): out and lse bit for bit
    what zeros there give."""
    b, sk, reach = 3, 6000, 4001
    for sq in (1, 2):
        q = rng.standard_normal((b, sq, 4 * kv_heads, 128)).astype(np.float32).astype(dtype)
        k = rng.standard_normal((b, sk, kv_heads, 128)).astype(np.float32).astype(dtype)
        v = rng.standard_normal((b, sk, kv_heads, 128)).astype(np.float32).astype(dtype)
        opts = AttentionOptions(causal=True, causal_offset=reach - sq)
        got = []
        for fill in (0.0, np.nan):
            k[:, reach:], v[:, reach:] = fill, fill
            out = dev.poisoned(q.shape, dtype=dtype)
            lse = dev.poisoned((b, 4 * kv_heads, sq), dtype=np.float32)
            dev.engine.flash_attention_v2_with(dev.put(q), dev.put(k), dev.put(v), out, opts,
                                               lse=lse)
            got.append((dev.get(out).astype(np.float32), dev.get(lse)))
        assert not np.isnan(got[1][0]).any() and not np.isnan(got[1][1]).any()
        np.testing.assert_array_equal(got[1][0], got[0][0])
        np.testing.assert_array_equal(got[1][1], got[0][1])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_lens", [True, False], ids=["kv_lens", "no-kv_lens"])
def test_decode_repeats_exactly_on_one_stream_and_on_another(dev, ref, rng, dtype,  # noqa: F811
                                                             with_lens):
    """The same call again on the stream, and on another stream, writes every element (poisoned
    before) with the same bits: nothing in the decode path depends on which block finishes
    first, or on state a launch leaves behind (a workspace, a counter); with kv_lens and
    without."""
    b, h, hkv, d, sk = 5, 32, 8, 128, 9000
    q = rng.standard_normal((b, 1, h, d)).astype(np.float32).astype(dtype)
    k = rng.standard_normal((b, sk, hkv, d)).astype(np.float32).astype(dtype)
    v = rng.standard_normal((b, sk, hkv, d)).astype(np.float32).astype(dtype)
    lens = np.array([9000, 4500, 1, 8999, 3], np.int32) if with_lens else None
    opts = AttentionOptions(causal=True, causal_offset=sk - 1)
    check_forward_with_lse(dev, ref, q, k, v, opts, None, lens, what="first call")
    qd, kd, vd = dev.put(q), dev.put(k), dev.put(v)
    ld = dev.put(lens) if with_lens else None

    def run():
        out = dev.poisoned(q.shape, dtype=dtype)
        lse = dev.poisoned((b, h, 1), dtype=np.float32)
        dev.engine.flash_attention_v2_with(qd, kd, vd, out, opts, None, lse=lse, kv_lens=ld)
        return dev.get(out), dev.get(lse)

    def same_bits(a, b):
        return all((x.view(np.uint8) == y.view(np.uint8)).all() for x, y in zip(a, b))

    first = run()
    assert not np.isnan(first[0].astype(np.float32)).any()
    for _ in range(3):
        assert same_bits(first, run())
    if dev.where == "cuda":
        import cupy

        with cupy.cuda.Stream(non_blocking=True):
            other = run()
        assert same_bits(first, other)
