"""The NumPy reference kernels: RoPE and Philox against direct formulas and known answers, the
forward against the dense oracle in helpers.py. Backward: test_reference_backward.py."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from ferrocupy import AttentionOptions, ComputeEngine, rope_params
from ferrocupy import reference as ref
from helpers import (attention_params, dense_attention, dense_keep, forward, make_qkv, poison,
                     rel_err)

TOL64 = 1e-12


# --- RoPE -----------------------------------------------------------------------------------------
def rope_direct(x, head_dim, pos, theta, seq_len, heads):
    """Element-by-element SPEC formula on a float64 copy, with float32 scalar arithmetic for
    the angle (independent of reference.rope_angles)."""
    y = np.array(x, dtype=np.float64).reshape(-1, heads, head_dim)
    half = head_dim // 2
    for tok in range(y.shape[0]):
        t = np.float32(pos + tok % seq_len)
        for i in range(half):
            e = np.float32(2 * i) / np.float32(head_dim)
            pw = np.float32(float(np.float32(theta)) ** float(e))
            angle = float(t * (np.float32(1.0) / pw))
            c, s = np.cos(angle), np.sin(angle)
            a, b = y[tok, :, i].copy(), y[tok, :, i + half].copy()
            y[tok, :, i], y[tok, :, i + half] = a * c - b * s, b * c + a * s
    return y.reshape(np.shape(x))


@pytest.mark.parametrize("shape,seq_len", [((32,), 1), ((5, 48), 5), ((2, 3, 32), 3),
                                           ((2, 4, 3, 16), 4)], ids=["rank1", "rank2", "rank3",
                                                                      "rank4"])
@pytest.mark.parametrize("pos,theta", [(0, 10000.0), (7, 10000.0), (100000, 100000.0)])
def test_rope_matches_direct_formula(rng, shape, seq_len, pos, theta):
    d = 16 if len(shape) == 4 else 8  # heads > 1 in every case
    x = rng.standard_normal(shape)
    p = rope_params(shape, d, pos, theta)
    heads = int(p["heads"])
    assert heads > 1 and int(p["seq_len"]) == seq_len
    want = rope_direct(x, d, pos, theta, seq_len, heads)
    ref.rope(x, p)  # float64, in place
    assert np.abs(x - want).max() <= 1e-13


def test_rope_engine_float32(rng):
    x = rng.standard_normal((2, 6, 4, 64)).astype(np.float32)
    want = rope_direct(x, 64, 100000, 100000.0, 6, 4)
    ComputeEngine("reference").rope_theta(x, 64, 100000, 100000.0)
    assert x.dtype == np.float32
    assert rel_err(x, want) < 1e-7


def test_rope_default_theta_is_10000(rng):
    x = rng.standard_normal((3, 32)).astype(np.float32)
    y = x.copy()
    eng = ComputeEngine("reference")
    eng.rope(x, 16, 11)
    eng.rope_theta(y, 16, 11, 10000.0)
    np.testing.assert_array_equal(x, y)
    assert not np.array_equal(x, rope_direct(y, 16, 11, 500.0, 3, 2).astype(np.float32))


def test_rope_position_restarts_each_batch(rng):
    # Rank >= 3: token s of every batch row gets pos + s, not pos + (b*S + s).
    row = rng.standard_normal((5, 2, 8))
    x = np.stack([row, row])
    ref.rope(x, rope_params(x.shape, 8, 3, 10000.0))
    np.testing.assert_array_equal(x[0], x[1])
    assert not np.allclose(x[0, 0], row[0])


def test_rope_angle_is_float32(rng):
    # At pos 1e5 a float64 angle differs from HF's float32 one by up to ~4e-3 rad; ours must
    # be the float32 one to the bit.
    d, theta = 64, 100000.0
    t = np.arange(100000, 100016)
    got = ref.rope_angles(t, d, theta)
    assert got.dtype == np.float32
    want = np.array([[np.float32(tt) * (np.float32(1.0) / np.float32(
        theta ** float(np.float32(2 * i) / np.float32(d)))) for i in range(d // 2)] for tt in t])
    assert got.view(np.uint32).tolist() == want.astype(np.float32).view(np.uint32).tolist()
    angle64 = t[:, None] / theta ** (np.arange(0, d, 2) / d)
    assert np.abs(got - angle64).max() > 1e-3

    x = rng.standard_normal((16, d))
    x64 = x.copy()
    ref.rope(x, rope_params(x.shape, d, 100000, theta))
    c, s = np.cos(angle64), np.sin(angle64)
    a, b = x64[:, :d // 2], x64[:, d // 2:]
    rot64 = np.concatenate([a * c - b * s, b * c + a * s], axis=1)
    assert np.abs(x - rot64).max() > 1e-4  # a float64-angle kernel would fail the GPU check
    assert np.abs(x - rope_direct(x64, d, 100000, theta, 16, 1)).max() <= 1e-13


# --- Philox / dropout -----------------------------------------------------------------------------
@pytest.mark.parametrize("counter,key,want", [
    ((0, 0, 0, 0), (0, 0), (0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8)),
    ((0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344), (0xa4093822, 0x299f31d0),
     (0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1))])
def test_philox_known_answers(counter, key, want):
    assert [int(w) for w in ref.philox4x32_10(counter, key)] == list(want)


@pytest.mark.parametrize("chunk", [None, 1, 7], ids=["default-chunk", "chunk1", "chunk7"])
def test_philox_vectorised_equals_scalar(rng, monkeypatch, chunk):
    """Broadcast counters (one of them a scalar) across the rounds' chunk boundaries give each
    element's scalar answer."""
    if chunk is not None:
        monkeypatch.setattr(ref, "_PHILOX_CHUNK", chunk)
    ctr = [rng.integers(0, 2**32, (5, 1), dtype=np.uint64),
           rng.integers(0, 2**32, (1, 10), dtype=np.uint64),
           int(rng.integers(0, 2**32)), rng.integers(0, 2**32, (5, 10), dtype=np.uint64)]
    key = [int(x) for x in rng.integers(0, 2**32, 2)]
    vec = np.stack(ref.philox4x32_10(ctr, key))
    assert vec.shape == (4, 5, 10) and vec.dtype == np.uint32
    for n in range(0, 50, 3):
        i, j = divmod(n, 10)
        one = ref.philox4x32_10([ctr[0][i, 0], ctr[1][0, j], ctr[2], ctr[3][i, j]], key)
        assert [int(w) for w in one] == vec[:, i, j].tolist()


def test_dropout_keep_follows_counter_layout(rng):
    B, H, Sq, Sk, D = 2, 3, 3, 9, 4
    seed = int(rng.integers(0, 2**32))
    q, k, _ = make_qkv(rng, B, Sq, Sk, H, H, D)
    p = attention_params(q, k, AttentionOptions(dropout_prob=0.3, seed=seed + 2**33))
    thr = int(float(np.float32(0.3)) * 2**32)
    assert ref.dropout_threshold(p) == thr
    for b in range(B):
        for h in range(H):
            keep = ref.dropout_keep(p, b, h, np.arange(Sq), np.arange(Sk))
            for i in range(Sq):
                for j in range(Sk):
                    word = ref.philox4x32_10((j >> 2, i, b * H + h, 0), (seed, 0))[j & 3]
                    assert keep[i, j] == (int(word) >= thr)


def test_dropout_threshold_boundary(rng):
    # An element whose word equals thr exactly is kept ("dropped iff word < thr"); one below
    # is dropped. Words with 24 significant bits are exact float32 probabilities.
    seed = int(rng.integers(0, 2**32))
    ctr = np.arange(4096, dtype=np.uint64)
    words = np.stack(ref.philox4x32_10((ctr, 0, 0, 0), (seed, 0)), axis=-1).reshape(-1)
    exact = np.flatnonzero((words & 0xFF) == 0)
    j = int(exact[words[exact] > 2**24][0])  # keep[0, 0, 0, j] has word w = words[j]
    w = int(words[j])
    prob = float(np.float32(w / 2**32))
    assert int(prob * 2**32) == w
    q, k, _ = make_qkv(rng, 1, 1, j + 1, 1, 1, 2)
    for p_try, kept in ((prob, True), (float(np.float32(prob) + np.float32(2**-32 * 256)),
                                       False)):
        p = attention_params(q, k, AttentionOptions(dropout_prob=p_try, seed=seed))
        assert bool(ref.dropout_keep(p, 0, 0, [0], [j])[0, 0]) is kept


def test_dropout_keep_same_for_forward_and_backward_struct(rng):
    q, k, _ = make_qkv(rng, 2, 9, 13, 4, 2, 8)
    opts = AttentionOptions(dropout_prob=0.4, seed=int(rng.integers(0, 2**40)))
    pf, pb = attention_params(q, k, opts), attention_params(q, k, opts, bwd=True)
    kf, kb = dense_keep(pf, 2, 4, 9, 13), dense_keep(pb, 2, 4, 9, 13)
    np.testing.assert_array_equal(kf, kb)
    assert 0 < (~kf).sum() < kf.size


@pytest.mark.parametrize("prob", [0.1, 0.5])
def test_dropout_rate_within_binomial_tolerance(rng, prob):
    q, k, _ = make_qkv(rng, 2, 64, 64, 2, 1, 4)
    p = attention_params(q, k, AttentionOptions(dropout_prob=prob,
                                                seed=int(rng.integers(0, 2**32))))
    keep = dense_keep(p, 2, 2, 64, 64)
    n = keep.size
    dropped = 1.0 - keep.mean()
    assert abs(dropped - prob) < 5 * np.sqrt(prob * (1 - prob) / n)


def test_dropout_forward_matches_dense_with_keep(rng):
    q, k, v = make_qkv(rng, 2, 6, 9, 4, 2, 8)
    opts = AttentionOptions(causal=True, dropout_prob=0.3, seed=int(rng.integers(0, 2**32)))
    keep = dense_keep(attention_params(q, k, opts), 2, 4, 6, 9)
    want, _ = dense_attention(q, k, v, causal=True, keep=keep, dropout_prob=0.3)
    assert rel_err(forward(q, k, v, opts), want) < TOL64
    nodrop, _ = dense_attention(q, k, v, causal=True)
    assert rel_err(want, nodrop) > 1e-2  # dropout did change something


def test_dropout_seed_determinism(rng):
    eng = ComputeEngine("reference")
    q, k, v = make_qkv(rng, 1, 16, 16, 2, 2, 8, np.float32)
    seed = int(rng.integers(0, 2**32))
    outs = []
    for s in (seed, seed, seed + 1, seed + 2**32):
        o = poison(np.empty_like(q))
        eng.flash_attention_v2(q, k, v, o, dropout_prob=0.5, seed=s)
        outs.append(o)
    np.testing.assert_array_equal(outs[0], outs[1])
    assert not np.array_equal(outs[0], outs[2])
    np.testing.assert_array_equal(outs[0], outs[3])  # only the low 32 bits count


# --- forward --------------------------------------------------------------------------------------
FORWARD_CASES = {
    "plain": dict(),
    "causal": dict(causal=True),
    "causal-offset": dict(causal=True, causal_offset=3),
    "window": dict(window=3),
    "window-causal": dict(causal=True, window=2),
    "window-causal-offset": dict(causal=True, window=4, causal_offset=5),
    "window-offset": dict(window=3, causal_offset=2),
}


@pytest.mark.parametrize("case", FORWARD_CASES)
@pytest.mark.parametrize("sq,sk", [(7, 7), (5, 9), (9, 4)])
def test_forward_options_vs_dense(rng, case, sq, sk):
    kw = FORWARD_CASES[case]
    q, k, v = make_qkv(rng, 2, sq, sk, 4, 2, 8)
    want, _ = dense_attention(q, k, v, **kw)
    assert rel_err(forward(q, k, v, AttentionOptions(**kw)), want) < TOL64


def test_forward_decode_offset(rng):
    # One new token against a 300-entry KV cache: it sees every key at offset 299.
    q, k, v = make_qkv(rng, 2, 1, 300, 4, 2, 16)
    opts = AttentionOptions(causal=True, causal_offset=299)
    want, _ = dense_attention(q, k, v, causal=True, causal_offset=299)
    got = forward(q, k, v, opts)
    assert rel_err(got, want) < TOL64
    assert rel_err(got, dense_attention(q, k, v)[0]) < TOL64  # all 300 keys visible
    # Offset 150 hides keys 151..299, so the answer changes.
    assert rel_err(forward(q, k, v, AttentionOptions(causal=True, causal_offset=150)), want) > 1e-3


# All 16 ways for each of [B, H, Sq, Sk] to be 1 (broadcast) or full.
MASK_SHAPES = ["".join(c if full else "1" for c, full in zip("BHQK", bits))
               for bits in itertools.product((False, True), repeat=4)]


@pytest.mark.parametrize("mshape", MASK_SHAPES)
@pytest.mark.parametrize("causal", [False, True])
def test_forward_mask_broadcast_vs_dense(rng, mshape, causal):
    B, Sq, Sk, H = 2, 5, 6, 4
    sizes = dict(B=B, H=H, Q=Sq, K=Sk)
    shape = tuple(sizes.get(c, 1) for c in mshape)
    q, k, v = make_qkv(rng, B, Sq, Sk, H, 2, 8)
    mask = rng.standard_normal(shape) * 2
    if mask.size > 1:
        mask.reshape(-1)[rng.integers(0, mask.size)] = -np.inf  # additive -inf hides a score
    want, _ = dense_attention(q, k, v, causal=causal, mask=mask)
    got = forward(q, k, v, AttentionOptions(causal=causal), mask=mask)
    assert rel_err(got, want) < TOL64
    unmasked = dense_attention(q, k, v, causal=causal)[0]
    if mshape == "1111":  # one constant added to every score: softmax cannot see it
        assert rel_err(got, unmasked) < TOL64
    else:  # a varying mask, or a -inf that empties rows, changes the answer
        assert rel_err(got, unmasked) > 1e-3


@pytest.mark.parametrize("h,hkv", [(4, 4), (4, 2), (8, 1), (16, 2)])
def test_forward_gqa_vs_dense(rng, h, hkv):
    q, k, v = make_qkv(rng, 2, 6, 7, h, hkv, 8)
    want, _ = dense_attention(q, k, v, causal=True)
    assert rel_err(forward(q, k, v, AttentionOptions(causal=True)), want) < TOL64


@pytest.mark.parametrize("d", [1, 2, 3, 128])
def test_forward_head_dims_vs_dense(rng, d):
    q, k, v = make_qkv(rng, 1, 4, 5, 2, 1, d)
    want, _ = dense_attention(q, k, v)
    assert rel_err(forward(q, k, v), want) < TOL64


def test_forward_engine_float32(rng):
    eng = ComputeEngine("reference")
    q, k, v = make_qkv(rng, 2, 33, 40, 8, 2, 64, np.float32)
    mask = rng.standard_normal((2, 1, 33, 40)).astype(np.float32)
    out = poison(np.empty_like(q))
    opts = AttentionOptions(causal=True, causal_offset=7, window=20)
    eng.flash_attention_v2_with(q, k, v, out, opts, mask)
    assert out.dtype == np.float32
    want, _ = dense_attention(q, k, v, causal=True, causal_offset=7, window=20, mask=mask)
    assert rel_err(out, want) < 1e-6


def test_single_head_form(rng):
    eng = ComputeEngine("reference")
    q, k, v = (rng.standard_normal((n, 16)).astype(np.float32) for n in (6, 9, 9))
    out = poison(np.empty_like(q))
    eng.flash_attention(q, k, v, out, causal=True)
    want, _ = dense_attention(q[None, :, None], k[None, :, None], v[None, :, None], causal=True)
    assert rel_err(out, want[0, :, 0]) < 1e-6


def test_chunked_rows_equal_unchunked(rng, monkeypatch):
    # Tiny chunks force many row blocks; results must not depend on the blocking.
    q, k, v = make_qkv(rng, 2, 9, 11, 4, 2, 8)
    mask = rng.standard_normal((2, 1, 9, 11))
    opts = AttentionOptions(causal=True, causal_offset=2, window=6, dropout_prob=0.2, seed=9)
    whole = forward(q, k, v, opts, mask)
    monkeypatch.setattr(ref, "_CHUNK_ELEMS", 25)  # 2 rows of 11 keys per block
    assert rel_err(forward(q, k, v, opts, mask), whole) < 1e-14  # BLAS blocking may differ


def test_forward_memory_is_bounded(rng):
    import tracemalloc

    q, k, v = make_qkv(rng, 1, 4096, 4096, 1, 1, 8, np.float32)
    out = np.empty_like(q)
    p = attention_params(q, k, AttentionOptions(causal=True))
    tracemalloc.start()
    try:
        ref.flash_attn_v2(q, k, v, out, None, p)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4096 * 4096 * 8  # less than one whole float64 score matrix
    assert np.isfinite(out).all()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_reference_never_reads_past_the_reach(dtype):
    """NaN in cache slots no row can see (causal offset 100, 5 rows: keys 105+) changes nothing
    in the forward or the backward (SPEC "Beyond the seed"; the GPU side is test_cuda_reach.py)."""
    from ferrocupy.dtypes import parse

    dt = parse(dtype)
    rng = np.random.default_rng(7)
    eng = ComputeEngine("reference", quiet=True)
    opts = AttentionOptions(causal=True, causal_offset=100)
    q, go = (rng.standard_normal((1, 5, 2, 16)).astype(np.float32) for _ in range(2))
    k, v = (rng.standard_normal((1, 300, 2, 16)).astype(np.float32) for _ in range(2))

    def run():
        out = np.full(q.shape, np.nan, dt)
        grads = [np.full(x.shape, np.nan, dt) for x in (q, k, v)]
        args = [x.astype(dt) for x in (q, k, v)]
        eng.flash_attention_v2_with(*args, out, opts)
        eng.flash_attention_v2_backward_with(*args, out, go.astype(dt), *grads, opts)
        return [x.astype(np.float32) for x in (out, *grads)]

    k[:, 105:], v[:, 105:] = 0, 0
    want = run()
    k[:, 105:], v[:, 105:] = np.nan, np.nan
    for g, w in zip(run(), want):
        np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("causal, offset, window", [(True, 0, 0), (True, 6, 0), (False, 0, 0),
                                                    (True, 3, 4), (False, 2, 3)])
def test_reference_kv_lens_is_each_sequence_on_its_own(causal, offset, window):
    """kv_lens[b] = L: batch b is the same call on its first L keys with its rows L - Sk
    earlier; the slots past L (NaN here) are never read."""
    rng = np.random.default_rng(11)
    eng = ComputeEngine("reference", quiet=True)
    B, Sq, Sk, H, Hkv, D = 4, 3, 12, 4, 2, 8
    q = rng.standard_normal((B, Sq, H, D)).astype(np.float32)
    k, v = (rng.standard_normal((B, Sk, Hkv, D)).astype(np.float32) for _ in range(2))
    mask = rng.standard_normal((B, 1, Sq, Sk)).astype(np.float32)
    lens = np.array([12, 9, 5, 0], np.int32)
    for b, n in enumerate(lens):
        k[b, n:], v[b, n:] = np.nan, np.nan
    opts = AttentionOptions(causal=causal, causal_offset=offset + Sk, window=window)
    out = np.full(q.shape, np.nan, np.float32)
    lse = np.full((B, H, Sq), np.nan, np.float32)
    eng.flash_attention_v2_with(q, k, v, out, opts, mask, lse=lse, kv_lens=lens)
    assert not np.isnan(out).any()
    for b, n in enumerate(lens):
        one = AttentionOptions(causal=causal, causal_offset=offset + int(n), window=window)
        want = np.full((1, Sq, H, D), np.nan, np.float32)
        want_lse = np.full((1, H, Sq), np.nan, np.float32)
        eng.flash_attention_v2_with(q[b:b + 1], np.ascontiguousarray(k[b:b + 1, :n]),
                                    np.ascontiguousarray(v[b:b + 1, :n]), want, one,
                                    np.ascontiguousarray(mask[b:b + 1, :, :, :n]),
                                    lse=want_lse)
        np.testing.assert_array_equal(out[b], want[0])
        np.testing.assert_array_equal(lse[b], want_lse[0])
