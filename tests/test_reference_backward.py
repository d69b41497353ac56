"""The reference backward kernels against central finite differences of the reference forward
and against the dense formula; stats; fully-masked rows and NaN propagation."""

from __future__ import annotations

import numpy as np
import pytest

from ferrocupy import AttentionOptions, ComputeEngine
from helpers import (attention_params, backward, dense_attention, dense_attention_grads,
                     dense_keep, forward, make_qkv, poison, rel_err)

TOL64, TOL_FD = 1e-12, 1e-6


def fd_grads(q, k, v, go, opts, mask, eps=1e-5):
    """Central differences of L = sum(forward(q, k, v) * go) with respect to q, k and v."""
    grads = []
    for a in (q, k, v):
        g = np.empty_like(a)
        flat, gflat = a.reshape(-1), g.reshape(-1)
        for n in range(flat.size):
            orig = flat[n]
            flat[n] = orig + eps
            up = np.sum(forward(q, k, v, opts, mask) * go)
            flat[n] = orig - eps
            down = np.sum(forward(q, k, v, opts, mask) * go)
            flat[n] = orig
            gflat[n] = (up - down) / (2 * eps)
        grads.append(g)
    return grads


FD_CASES = {
    "plain": (dict(), None, (4, 2)),
    "causal": (dict(causal=True), None, (4, 2)),
    "causal-offset-window": (dict(causal=True, causal_offset=2, window=3), None, (4, 2)),
    "window-offset-dead-rows": (dict(window=2, causal_offset=3), None, (2, 2)),
    "mask": (dict(), (1, 1, 4, 5), (4, 2)),
    "mask-heads": (dict(causal=True), (1, 4, 1, 5), (4, 4)),
    "gqa-8": (dict(causal=True), None, (8, 1)),
    "dropout": (dict(dropout_prob=0.3, seed=1234), None, (4, 2)),
    "everything": (dict(causal=True, causal_offset=1, window=4, dropout_prob=0.25, seed=77),
                   (1, 4, 4, 5), (4, 2)),
}


@pytest.mark.parametrize("case", FD_CASES)
def test_backward_vs_finite_differences(rng, case):
    kw, mshape, (h, hkv) = FD_CASES[case]
    q, k, v = make_qkv(rng, 1, 4, 5, h, hkv, 3)  # batch indexing: test_backward_vs_dense_formula
    mask = None if mshape is None else rng.standard_normal(mshape)
    if mask is not None:
        mask.reshape(-1)[rng.integers(0, mask.size)] = -np.inf
    opts = AttentionOptions(**kw)
    go = rng.standard_normal(q.shape)
    out = forward(q, k, v, opts, mask)
    gq, gk, gv, _ = backward(q, k, v, out, go, opts, mask)
    for name, got, want in zip(("grad_q", "grad_k", "grad_v"), (gq, gk, gv),
                               fd_grads(q, k, v, go, opts, mask)):
        assert rel_err(got, want) < TOL_FD, name


BWD_CASES = {
    "plain": dict(),
    "causal": dict(causal=True),
    "decode": dict(causal=True, causal_offset=8),
    "window": dict(window=3),
    "window-causal-offset": dict(causal=True, window=3, causal_offset=4),
    "dropout": dict(dropout_prob=0.5, seed=5),
}


@pytest.mark.parametrize("case", BWD_CASES)
@pytest.mark.parametrize("h,hkv", [(2, 2), (4, 2), (8, 1)])
@pytest.mark.parametrize("mshape", [None, (1, 1, 1, 1), (2, 1, 1, 9), (1, "H", 6, 9),
                                    (2, "H", 6, 9), (1, 1, 6, 1)], ids=str)
def test_backward_vs_dense_formula(rng, case, h, hkv, mshape):
    kw = BWD_CASES[case]
    q, k, v = make_qkv(rng, 2, 6, 9, h, hkv, 5)
    mask = None if mshape is None else rng.standard_normal(
        tuple(h if d == "H" else d for d in mshape))
    opts = AttentionOptions(**kw)
    keep = None
    if opts.dropout_prob:
        keep = dense_keep(attention_params(q, k, opts), 2, h, 6, 9)
    dense_kw = dict(causal=opts.causal, causal_offset=opts.causal_offset, window=opts.window,
                    mask=mask, keep=keep, dropout_prob=opts.dropout_prob)
    go = rng.standard_normal(q.shape)
    out = forward(q, k, v, opts, mask)
    assert rel_err(out, dense_attention(q, k, v, **dense_kw)[0]) < TOL64
    gq, gk, gv, stats = backward(q, k, v, out, go, opts, mask)
    wq, wk, wv, delta, lse = dense_attention_grads(q, k, v, go, **dense_kw)
    assert rel_err(gq, wq) < TOL64
    assert rel_err(gk, wk) < TOL64
    assert rel_err(gv, wv) < TOL64
    st = stats.reshape(2, h, 6, 2)
    assert rel_err(st[..., 0], delta) < TOL64
    assert rel_err(st[..., 1], lse) < TOL64


def test_stats_rows_are_delta_and_lse(rng):
    B, Sq, Sk, H = 2, 5, 7, 3
    q, k, v = make_qkv(rng, B, Sq, Sk, H, 1, 4)
    go = rng.standard_normal(q.shape)
    out = forward(q, k, v, AttentionOptions(causal=True))
    _, _, _, stats = backward(q, k, v, out, go, AttentionOptions(causal=True))
    scale = float(np.float32(1.0) / np.sqrt(np.float32(4)))
    for b in range(B):
        for h in range(H):
            for i in range(Sq):
                row = stats[(b * H + h) * Sq + i]
                s = scale * (k[b, :i + 1, 0] @ q[b, i, h])
                assert abs(row[0] - go[b, i, h] @ out[b, i, h]) < 1e-12
                assert abs(row[1] - np.log(np.exp(s).sum())) < 1e-12


def test_float32_stats_buffer(rng):
    # What the engine allocates: the backward still agrees to float32 rounding of the stats.
    q, k, v = make_qkv(rng, 1, 8, 8, 2, 1, 8)
    go = rng.standard_normal(q.shape)
    opts = AttentionOptions(causal=True)
    out = forward(q, k, v, opts)
    g64 = backward(q, k, v, out, go, opts)
    g32 = backward(q, k, v, out, go, opts, stats_dtype=np.float32)
    assert g32[3].dtype == np.float32
    assert rel_err(g32[3], g64[3]) < 1e-7
    for a, b in zip(g32[:3], g64[:3]):
        assert rel_err(a, b) < 1e-5


def test_engine_backward_float32(rng):
    eng = ComputeEngine("reference")
    q, k, v = make_qkv(rng, 2, 12, 20, 4, 2, 32, np.float32)
    go = rng.standard_normal(q.shape).astype(np.float32)
    mask = rng.standard_normal((1, 4, 12, 20)).astype(np.float32)
    opts = AttentionOptions(causal=True, causal_offset=8, window=10, dropout_prob=0.2, seed=3)
    out = poison(np.empty_like(q))
    eng.flash_attention_v2_with(q, k, v, out, opts, mask)
    gq, gk, gv = (poison(np.empty_like(a)) for a in (q, k, v))
    eng.flash_attention_v2_backward_with(q, k, v, out, go, gq, gk, gv, opts, mask)
    keep = dense_keep(attention_params(q, k, opts), 2, 4, 12, 20)
    want = dense_attention_grads(q, k, v, go, causal=True, causal_offset=8, window=10,
                                 mask=mask, keep=keep, dropout_prob=0.2)
    for got, w in zip((gq, gk, gv), want):
        assert got.dtype == np.float32 and rel_err(got, w) < 1e-5


def test_single_head_backward(rng):
    eng = ComputeEngine("reference")
    q, k, v = (rng.standard_normal((n, 8)).astype(np.float32) for n in (5, 7, 7))
    go = rng.standard_normal(q.shape).astype(np.float32)
    out = poison(np.empty_like(q))
    eng.flash_attention(q, k, v, out, causal=True)
    gq, gk, gv = (poison(np.empty_like(a)) for a in (q, k, v))
    eng.flash_attention_backward(q, k, v, out, go, gq, gk, gv, causal=True)
    want = dense_attention_grads(*(a[None, :, None] for a in (q, k, v, go)), causal=True)
    for got, w in zip((gq, gk, gv), want):
        assert rel_err(got, w[0, :, 0]) < 1e-5


# --- fully-masked rows: zeros and LSE -inf, never NaN ---------------------------------------------
DEAD_CASES = {
    # window around a = i + 3 misses every key for the last rows (Sk = 5)
    "window-offset": (dict(window=2, causal_offset=3), [False, False, False, True]),
    # causal + window: visible j in (a - 2, a], and a = i + 6 >= Sk + 1 for every row
    "causal-window-offset": (dict(causal=True, window=2, causal_offset=6), [True] * 4),
    "window-offset-all": (dict(window=1, causal_offset=5), [True] * 4),
}


@pytest.mark.parametrize("case", DEAD_CASES)
def test_rows_without_visible_keys(rng, case):
    kw, dead = DEAD_CASES[case]
    q, k, v = make_qkv(rng, 2, 4, 5, 2, 1, 4)
    opts = AttentionOptions(**kw)
    out = forward(q, k, v, opts)
    assert not np.isnan(out).any()
    rows_dead = np.all(out == 0, axis=(0, 2, 3))
    assert rows_dead.tolist() == dead
    go = rng.standard_normal(q.shape)
    gq, gk, gv, stats = backward(q, k, v, out, go, opts)
    assert not any(np.isnan(a).any() for a in (gq, gk, gv, stats))
    assert np.all(gq[:, dead] == 0)
    lse = stats.reshape(2, 2, 4, 2)[..., 1]
    assert np.all(lse[:, :, dead] == -np.inf) and np.isfinite(lse[:, :, ~np.array(dead)]).all()


def test_mask_all_minus_inf(rng):
    q, k, v = make_qkv(rng, 2, 3, 4, 2, 2, 4)
    mask = np.full((1, 1, 3, 4), -np.inf)
    out = forward(q, k, v, AttentionOptions(), mask)
    np.testing.assert_array_equal(out, 0.0)
    gq, gk, gv, stats = backward(q, k, v, out, rng.standard_normal(q.shape), mask=mask)
    for g in (gq, gk, gv):
        np.testing.assert_array_equal(g, 0.0)
    assert np.all(stats[:, 1] == -np.inf) and np.all(stats[:, 0] == 0)


def test_mask_minus_inf_on_one_row(rng):
    q, k, v = make_qkv(rng, 1, 4, 6, 2, 1, 4)
    mask = rng.standard_normal((1, 1, 4, 6))
    mask[0, 0, 2] = -np.inf
    out = forward(q, k, v, AttentionOptions(dropout_prob=0.5, seed=2), mask)
    np.testing.assert_array_equal(out[0, 2], 0.0)
    want, _ = dense_attention(q, k, v, mask=mask, dropout_prob=0.5,
                              keep=dense_keep(attention_params(
                                  q, k, AttentionOptions(dropout_prob=0.5, seed=2)), 1, 2, 4, 6))
    assert rel_err(out, want) < TOL64


def test_engine_float32_dead_rows(rng):
    eng = ComputeEngine("reference")
    q, k, v = make_qkv(rng, 1, 4, 5, 2, 1, 8, np.float32)
    out = poison(np.empty_like(q))
    eng.flash_attention_v2_with(q, k, v, out, AttentionOptions(causal=True, window=2,
                                                               causal_offset=6))
    np.testing.assert_array_equal(out, 0.0)


# --- NaN propagates -------------------------------------------------------------------------------
def test_nan_in_q_propagates(rng):
    q, k, v = make_qkv(rng, 1, 4, 5, 2, 1, 4)
    q[0, 1, 1, 2] = np.nan
    out = forward(q, k, v)
    assert np.isnan(out[0, 1, 1]).all()
    nan_rows = np.isnan(out).any(axis=-1)
    assert nan_rows.sum() == 1  # only that (row, head)


def test_nan_in_visible_v_and_grad_out_propagates(rng):
    q, k, v = make_qkv(rng, 1, 4, 4, 1, 1, 4)
    v[0, 2, 0, 1] = np.nan
    opts = AttentionOptions(causal=True)
    out = forward(q, k, v, opts)
    assert np.isnan(out[0, 2:, 0, 1]).all() and not np.isnan(out[0, :2]).any()
    q, k, v = make_qkv(rng, 1, 4, 4, 1, 1, 4)
    out = forward(q, k, v, opts)
    go = rng.standard_normal(q.shape)
    go[0, 3, 0, 0] = np.nan
    gq, gk, gv, _ = backward(q, k, v, out, go, opts)
    assert np.isnan(gq[0, 3]).all() and not np.isnan(gq[0, :3]).any()
    assert np.isnan(gv).any() and np.isnan(gk).any()


def test_nan_in_mask_propagates(rng):
    q, k, v = make_qkv(rng, 1, 3, 4, 1, 1, 4)
    mask = rng.standard_normal((1, 1, 3, 4))
    mask[0, 0, 1, 2] = np.nan
    out = forward(q, k, v, AttentionOptions(), mask)
    assert np.isnan(out[0, 1]).all() and not np.isnan(out[0, [0, 2]]).any()


# --- empty sizes through the engine ---------------------------------------------------------------
def test_empty_seq_k_gives_zero_output_and_grads(rng):
    eng = ComputeEngine("reference")
    q = rng.standard_normal((1, 3, 2, 4)).astype(np.float32)
    k = np.empty((1, 0, 2, 4), np.float32)
    out = poison(np.empty_like(q))
    eng.flash_attention_v2(q, k, k, out)
    np.testing.assert_array_equal(out, 0.0)
    gq = poison(np.empty_like(q))
    eng.flash_attention_v2_backward(q, k, k, out, q.copy(), gq, k.copy(), k.copy())
    np.testing.assert_array_equal(gq, 0.0)


@pytest.mark.parametrize("q_shape", [(1, 0, 2, 4), (1, 3, 0, 4)], ids=["seq_q=0", "heads=0"])
def test_empty_queries_give_zero_kv_grads(rng, q_shape):
    eng = ComputeEngine("reference")
    q = np.empty(q_shape, np.float32)
    k, v = (rng.standard_normal((1, 3, 1, 4)).astype(np.float32) for _ in range(2))
    gk, gv = poison(np.empty_like(k)), poison(np.empty_like(v))
    eng.flash_attention_v2_backward(q, k, v, q, q, q.copy(), gk, gv)
    np.testing.assert_array_equal(gk, 0.0)
    np.testing.assert_array_equal(gv, 0.0)


def test_garbage_in_hidden_keys_stays_out(rng):
    # An unused KV-cache tail (NaN/inf garbage) that no row can see must not reach any output;
    # the answer equals attention over the used prefix only.
    q, k, v = make_qkv(rng, 1, 2, 10, 2, 1, 4)
    used = 6
    k[:, used:], v[:, used:] = np.nan, np.inf
    opts = AttentionOptions(causal=True, causal_offset=used - 2)  # rows at positions 4, 5
    out = forward(q, k, v, opts)
    want, _ = dense_attention(q, k[:, :used], v[:, :used], causal=True, causal_offset=used - 2)
    assert rel_err(out, want) < TOL64
    go = rng.standard_normal(q.shape)
    gq, gk, gv, _ = backward(q, k, v, out, go, opts)
    wq, wk, wv, _, _ = dense_attention_grads(q, k[:, :used], v[:, :used], go, causal=True,
                                             causal_offset=used - 2)
    assert rel_err(gq, wq) < TOL64
    assert rel_err(gk[:, :used], wk) < TOL64 and rel_err(gv[:, :used], wv) < TOL64
    np.testing.assert_array_equal(gk[:, used:], 0.0)
    np.testing.assert_array_equal(gv[:, used:], 0.0)


def test_garbage_behind_minus_inf_mask_stays_out(rng):
    # A -inf mask entry gives P = 0 exactly, and that key's v stays out. (k must be finite:
    # the mask is additive, so NaN + -inf is a NaN score, which propagates.)
    q, k, v = make_qkv(rng, 1, 3, 5, 1, 1, 4)
    mask = np.zeros((1, 1, 1, 5))
    mask[..., 3:] = -np.inf
    v[:, 3:] = np.nan
    out = forward(q, k, v, AttentionOptions(), mask)
    assert rel_err(out, dense_attention(q, k[:, :3], v[:, :3])[0]) < TOL64
    gq, gk, gv, _ = backward(q, k, v, out, rng.standard_normal(q.shape), mask=mask)
    assert np.isfinite(gq).all() and np.isfinite(gk).all() and np.isfinite(gv).all()
    k[0, 4, 0, 0] = np.nan
    assert np.isnan(forward(q, k, v, AttentionOptions(), mask)).all()


def test_nan_query_in_dead_row_stays_out(rng):
    # Row 3 sees no key (window); its NaN query must leave its output 0 and grad_k finite.
    q, k, v = make_qkv(rng, 1, 4, 5, 1, 1, 4)
    q[0, 3] = np.nan
    opts = AttentionOptions(window=2, causal_offset=3)
    out = forward(q, k, v, opts)
    np.testing.assert_array_equal(out[0, 3], 0.0)
    gq, gk, gv, _ = backward(q, k, v, out, rng.standard_normal(q.shape), opts)
    assert np.isfinite(gk).all() and np.isfinite(gv).all()
    np.testing.assert_array_equal(gq[0, 3], 0.0)


@pytest.mark.parametrize("kw", [dict(causal=True), dict(window=3, causal_offset=2),
                                dict(causal=True, window=2, causal_offset=9, dropout_prob=0.3,
                                     seed=4)], ids=["causal", "window", "dead-rows-dropout"])
def test_small_blocks_vs_dense(rng, monkeypatch, kw):
    # Blocks of 2 rows see only their keys' range; every block boundary must still add up.
    from ferrocupy import reference

    monkeypatch.setattr(reference, "_BLOCK_ROWS", 2)
    q, k, v = make_qkv(rng, 2, 9, 11, 4, 2, 4)
    opts = AttentionOptions(**kw)
    keep = dense_keep(attention_params(q, k, opts), 2, 4, 9, 11) if opts.dropout_prob else None
    dense_kw = dict(causal=opts.causal, causal_offset=opts.causal_offset, window=opts.window,
                    keep=keep, dropout_prob=opts.dropout_prob)
    go = rng.standard_normal(q.shape)
    out = forward(q, k, v, opts)
    assert rel_err(out, dense_attention(q, k, v, **dense_kw)[0]) < TOL64
    gq, gk, gv, stats = backward(q, k, v, out, go, opts)
    want = dense_attention_grads(q, k, v, go, **dense_kw)
    for got, w in zip((gq, gk, gv), want):
        assert rel_err(got, w) < TOL64
    lse = stats.reshape(2, 4, 9, 2)[..., 1]
    assert np.array_equal(np.isneginf(lse), np.isneginf(want[4]))
