"""ferrocupy.flash_attn's varlen functions and flash_attn_with_kvcache's appending, paging and
rotary on CPU tensors, against tests/flash_oracle.py (flash-attn's semantics in float64).

They run on `ferrocupy.torch.attention`'s varlen keywords (`cu_seqlens_q`, `cu_seqlens_k`,
`max_seqlen_q`, `max_seqlen_k`, `block_table`) and `ferrocupy.torch.attention_with_kvcache`;
where this ferrocupy.torch lacks them the tests are skipped, saying so."""

from __future__ import annotations

import inspect
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import flash_oracle as oracle  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from test_flash_attn import _close, _grads  # noqa: E402

import ferrocupy.flash_attn as fa  # noqa: E402
import ferrocupy.torch as ft  # noqa: E402

needs_varlen = pytest.mark.skipif(
    "cu_seqlens_q" not in inspect.signature(ft.attention).parameters,
    reason="ferrocupy.torch.attention has no varlen keywords (cu_seqlens_q, ...) in this tree")
needs_kvcache = pytest.mark.skipif(
    not hasattr(ft, "attention_with_kvcache"),
    reason="ferrocupy.torch.attention_with_kvcache is not in this tree")


@pytest.fixture
def gen(rng):
    return torch.Generator().manual_seed(int(rng.integers(2**62)))


def _cu(lengths):
    return torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32)


def _packed(gen, lens_q, lens_k, H, Hkv, D):
    q = torch.randn(sum(lens_q), H, D, generator=gen)
    k = torch.randn(sum(lens_k), Hkv, D, generator=gen)
    v = torch.randn(sum(lens_k), Hkv, D, generator=gen)
    return q, k, v


def _padded_probs(probs, lens_q, lens_k):
    """The oracle's per-sequence P as flash-attn's S_dmask layout, zero outside each sequence."""
    full = torch.zeros(len(probs), probs[0].shape[0], max(lens_q), max(lens_k),
                       dtype=torch.float64)
    for n, p in enumerate(probs):
        full[n, :, :lens_q[n], :lens_k[n]] = p
    return full


# Per sequence: Sq_n > Sk_n, Sq_n < Sk_n, equal, and an empty query sequence.
LENS_Q, LENS_K = [5, 2, 4, 0, 3], [3, 6, 4, 2, 1]
VARLEN_CASES = {
    "causal": dict(causal=True),
    "window-softcap": dict(window_size=(2, 1), softcap=2.0),
    "causal-alibi-nh": dict(causal=True, alibi="nh"),
    "window-past-max-k-alibi-h": dict(window_size=(1, 6), alibi="h"),
    "plain-scale": dict(softmax_scale=0.25),
}


def _varlen_options(gen, opts, n, H):
    opts = dict(opts)
    kind = opts.pop("alibi", None)
    alibi = None if kind is None else torch.rand((n, H) if kind == "nh" else (H,),
                                                 generator=gen) * 0.5
    want = dict(causal=opts.get("causal", False), window=opts.get("window_size", (-1, -1)),
                softcap=opts.get("softcap", 0.0), softmax_scale=opts.get("softmax_scale"))
    return opts, alibi, want


@needs_varlen
@pytest.mark.parametrize("case", list(VARLEN_CASES))
def test_varlen_matches_flash_attn_semantics(gen, case):
    H, Hkv, D = 4, 2, 8
    q, k, v = _packed(gen, LENS_Q, LENS_K, H, Hkv, D)
    cu_q, cu_k = _cu(LENS_Q), _cu(LENS_K)
    opts, alibi, want_kw = _varlen_options(gen, VARLEN_CASES[case], len(LENS_Q), H)
    args = (cu_q, cu_k, max(LENS_Q), max(LENS_K))
    out, lse, s_dmask = fa.flash_attn_varlen_func(q, k, v, *args, alibi_slopes=alibi,
                                                  return_attn_probs=True, **opts)
    want_out, want_lse, probs = oracle.varlen(q, k, v, cu_q.tolist(), cu_k.tolist(),
                                              max(LENS_K), alibi=alibi, **want_kw)
    _close("out", out, want_out)
    _close("softmax_lse", lse, want_lse)
    assert lse.shape == (H, sum(LENS_Q)) and lse.dtype == torch.float32
    _close("S_dmask", s_dmask, _padded_probs(probs, LENS_Q, LENS_K))
    go = torch.randn(out.shape, generator=gen)
    _, got = _grads(lambda *x: fa.flash_attn_varlen_func(*x, *args, alibi_slopes=alibi, **opts),
                    (q, k, v), go)
    _, want = _grads(lambda *x: oracle.varlen(*x, cu_q.tolist(), cu_k.tolist(), max(LENS_K),
                                              alibi=alibi, **want_kw)[0], (q, k, v), go.double())
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        _close(name, g, w)


@needs_varlen
def test_varlen_packed_layouts(gen):
    lens = [4, 1, 6]
    H, D = 2, 8
    cu = _cu(lens)
    qkv = torch.randn(sum(lens), 3, H, D, generator=gen)
    kw = dict(causal=True, window_size=(3, 0), return_attn_probs=True)
    want = fa.flash_attn_varlen_func(*qkv.unbind(1), cu, cu, max(lens), max(lens), **kw)
    got_qkv = fa.flash_attn_varlen_qkvpacked_func(qkv, cu, max(lens), **kw)
    got_kv = fa.flash_attn_varlen_kvpacked_func(qkv[:, 0], qkv[:, 1:], cu, cu, max(lens),
                                                max(lens), **kw)
    for got in (got_qkv, got_kv):
        for g, w in zip(got, want):
            assert torch.equal(g, w)
    go = torch.randn(sum(lens), H, D, generator=gen)
    _, (dqkv,) = _grads(lambda x: fa.flash_attn_varlen_qkvpacked_func(x, cu, max(lens),
                                                                       causal=True), (qkv,), go)
    _, want_g = _grads(lambda *x: oracle.varlen(*x, cu.tolist(), cu.tolist(), max(lens),
                                                causal=True)[0], qkv.unbind(1), go.double())
    _close("dqkv", dqkv, torch.stack(want_g, dim=1))


@needs_varlen
def test_varlen_dropout_s_dmask(gen):
    """Dropout's counter restarts in each sequence (b = n, i and j inside it): the S_dmask signs,
    as the oracle's keep mask, reproduce out; out == clipped S_dmask / (1-p) @ v per sequence."""
    p = 0.25
    lens_q, lens_k = [6, 3, 8], [9, 3, 5]
    q, k, v = _packed(gen, lens_q, lens_k, 4, 2, 8)
    cu_q, cu_k = _cu(lens_q), _cu(lens_k)
    torch.manual_seed(int(torch.randint(2**62, (), generator=gen)))
    out, lse, s_dmask = fa.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 8, 9, dropout_p=p,
                                                  causal=True, return_attn_probs=True)
    keep = [~torch.signbit(s_dmask[n, :, :lens_q[n], :lens_k[n]]) for n in range(3)]
    want_out, _, probs = oracle.varlen(q, k, v, cu_q.tolist(), cu_k.tolist(), 9, causal=True,
                                       keep=keep, dropout_p=p)
    _close("out", out, want_out)
    _close("|S_dmask|", s_dmask.abs(), _padded_probs(probs, lens_q, lens_k))
    dropped = torch.cat([(~kn).flatten() for kn in keep]).float().mean().item()
    assert 0.05 < dropped < 0.5, dropped


def _paged(gen, cache, page, n_blocks):
    """`cache` [B, cap, Hkv, D] scattered into shuffled pages: (pages, block_table)."""
    B, cap, Hkv, D = cache.shape
    per = cap // page
    order = torch.randperm(n_blocks, generator=gen)[:B * per]
    pages = torch.full((n_blocks, page, Hkv, D), math.nan)
    pages[order] = cache.reshape(B * per, page, Hkv, D)
    return pages, order.reshape(B, per).to(torch.int32)


@needs_varlen
@pytest.mark.parametrize("causal, window", [(True, (-1, -1)), (False, (2, 1))])
def test_varlen_paged_keys(gen, causal, window):
    """flash-attn's varlen block_table: sequence n's keys live in its own shuffled pages of a
    shared cache; the answer is the packed call's, S_dmask included; unused pages are NaN."""
    lens_q, lens_k, page = [2, 3, 0], [5, 8, 3], 4
    H, Hkv, D = 4, 2, 8
    q = torch.randn(sum(lens_q), H, D, generator=gen)
    k = torch.randn(sum(lens_k), Hkv, D, generator=gen)
    v = torch.randn(sum(lens_k), Hkv, D, generator=gen)
    order = torch.randperm(11, generator=gen)
    table = order[:6].reshape(3, 2).to(torch.int32)
    pages = [torch.full((11, page, Hkv, D), math.nan) for _ in range(2)]
    start = 0
    for n, length in enumerate(lens_k):
        for j in range(length):
            for cache, x in zip(pages, (k, v)):
                cache[int(table[n, j // page]), j % page] = x[start + j]
        start += length
    cu_q, cu_k = _cu(lens_q), _cu(lens_k)
    kw = dict(causal=causal, window_size=window, return_attn_probs=True)
    got = fa.flash_attn_varlen_func(q, pages[0], pages[1], cu_q, cu_k, 3, 8, block_table=table,
                                    **kw)
    want = fa.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 3, 8, **kw)
    for name, g, w in zip(("out", "softmax_lse", "S_dmask"), got, want):
        assert torch.equal(g, w), name


@pytest.mark.parametrize("table, match", [
    (torch.zeros(2, 2, dtype=torch.int32), r"N = 3 sequences"),
    (torch.zeros(3, 1, dtype=torch.int32), r"sequence 0 has 5 keys .* reaches 4"),
    (torch.full((3, 2), 7, dtype=torch.int32), r"names block 7, outside the 7 blocks of k"),
    (torch.zeros(3, 2), r"integer tensor"),
])
def test_varlen_paged_refusals(gen, table, match):
    q = torch.randn(5, 4, 8, generator=gen)
    pages = torch.randn(7, 4, 2, 8, generator=gen)
    with pytest.raises(ValueError, match=match):
        fa.flash_attn_varlen_func(q, pages, pages, _cu([2, 3, 0]), _cu([5, 8, 3]), 3, 8,
                                  block_table=table)


@needs_varlen
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_varlen_randomized(data):
    n = data.draw(st.integers(1, 4))
    lens_q = data.draw(st.lists(st.integers(0, 6), min_size=n, max_size=n))
    lens_k = data.draw(st.lists(st.integers(1, 6), min_size=n, max_size=n))
    lens_q[0] = max(lens_q[0], 1)  # max_seqlen_q >= 1
    hkv = data.draw(st.integers(1, 2))
    h = hkv * data.draw(st.integers(1, 2))
    causal = data.draw(st.booleans())
    window = (data.draw(st.integers(-1, 7)), data.draw(st.integers(-1, 7)))
    softcap = data.draw(st.sampled_from([0.0, 3.0]))
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31)))
    q, k, v = _packed(gen, lens_q, lens_k, h, hkv, 8)
    cu_q, cu_k = _cu(lens_q), _cu(lens_k)
    out, lse, s_dmask = fa.flash_attn_varlen_func(
        q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal,
        window_size=window, softcap=softcap, return_attn_probs=True)
    want_out, want_lse, probs = oracle.varlen(q, k, v, cu_q.tolist(), cu_k.tolist(),
                                              max(lens_k), causal=causal, window=window,
                                              softcap=softcap)
    _close("out", out, want_out)
    _close("lse", lse, want_lse)
    _close("S_dmask", s_dmask, _padded_probs(probs, lens_q, lens_k))


# --- flash_attn_with_kvcache: appending, rotary, paging -----------------------------------------
def _rotary_tables(gen, length, rotary_dim):
    angles = torch.rand(length, rotary_dim // 2, generator=gen) * 6
    return angles.cos(), angles.sin()


@needs_kvcache
@pytest.mark.parametrize("causal, window", [(True, (-1, -1)), (False, (-1, -1)),
                                            (False, (3, 1))])
@pytest.mark.parametrize("rotary", [None, "half", "interleaved"])
@pytest.mark.parametrize("paged", [False, True])
def test_kvcache_append(gen, causal, window, rotary, paged):
    """New k, v go into the cache at cache_seqlens[b] (rotated at those positions when rotary
    tables are given), q is rotated at cache_seqlens[b] + i when causal or windowed, else at
    cache_seqlens[b], then attends over cache_seqlens[b] + Sn keys, bottom-right aligned."""
    B, cap, H, Hkv, D, Sn, page = 2, 12, 4, 2, 16, 3, 4
    q = torch.randn(B, Sn, H, D, generator=gen)
    k_new = torch.randn(B, Sn, Hkv, D, generator=gen)
    v_new = torch.randn(B, Sn, Hkv, D, generator=gen)
    k_cache = torch.randn(B, cap, Hkv, D, generator=gen)
    v_cache = torch.randn(B, cap, Hkv, D, generator=gen)
    lens = torch.tensor([2, 9], dtype=torch.int32)
    cos = sin = None
    if rotary is not None:
        cos, sin = _rotary_tables(gen, cap, 8)
    qr, want_k, want_v = oracle.append(q, k_cache, v_cache, k_new, v_new, lens, cos=cos, sin=sin,
                                       interleaved=rotary == "interleaved", causal=causal,
                                       window=window)
    want_out, want_lse = oracle.kvcache(qr, want_k, want_v, lens + Sn, causal=causal,
                                        window=window)
    kc, vc, table = k_cache.clone(), v_cache.clone(), None
    if paged:
        kc, table = _paged(gen, k_cache, page, 9)
        vc = torch.full_like(kc, math.nan)
        vc[table.flatten().long()] = v_cache.reshape(-1, page, Hkv, D)
    out, lse = fa.flash_attn_with_kvcache(
        q, kc, vc, k_new, v_new, rotary_cos=cos, rotary_sin=sin, cache_seqlens=lens,
        block_table=table, causal=causal, window_size=window,
        rotary_interleaved=rotary == "interleaved", return_softmax_lse=True)
    _close("out", out, want_out, tol=1e-4)
    _close("softmax_lse", lse, want_lse, tol=1e-4)
    got_k = kc if not paged else kc[table.long()].reshape(B, cap, Hkv, D)
    got_v = vc if not paged else vc[table.long()].reshape(B, cap, Hkv, D)
    _close("k_cache", got_k, want_k, tol=1e-5)
    _close("v_cache", got_v, want_v, tol=1e-5)


@needs_kvcache
def test_kvcache_paged_read_only(gen):
    B, cap, Hkv, D, page = 2, 8, 2, 8, 2
    q = torch.randn(B, 1, 4, D, generator=gen)
    k_cache = torch.randn(B, cap, Hkv, D, generator=gen)
    v_cache = torch.randn(B, cap, Hkv, D, generator=gen)
    kp, table = _paged(gen, k_cache, page, 11)
    vp = torch.full_like(kp, math.nan)
    vp[table.flatten().long()] = v_cache.reshape(-1, page, Hkv, D)
    lens = torch.tensor([3, 8], dtype=torch.int32)
    out = fa.flash_attn_with_kvcache(q, kp, vp, cache_seqlens=lens, block_table=table,
                                     causal=True)
    _close("out", out, oracle.kvcache(q, k_cache, v_cache, lens, causal=True)[0])


# --- flash_attn_with_kvcache: cache_batch_idx and cache_leftpad ----------------------------------
def _shifted(cache, pad):
    """Each sequence's cache from its left pad on (flash-attn's keys of a left-padded cache)."""
    out = torch.zeros_like(cache)
    for b, p in enumerate(pad):
        out[b, :cache.shape[1] - p] = cache[b, p:]
    return out


@needs_kvcache
@pytest.mark.parametrize("causal, window", [(True, (-1, -1)), (False, (-1, -1)),
                                            (False, (3, 1))])
@pytest.mark.parametrize("rotary, append", [(None, False), (None, True), ("half", True),
                                            ("interleaved", True)])
@pytest.mark.parametrize("rows", ["batch_idx", "leftpad", "both"])
def test_kvcache_batch_idx_and_leftpad(gen, causal, window, rotary, rows, append):
    """Sequence b lives in cache row cache_batch_idx[b]; its keys start at cache_leftpad[b]
    (positions for the mask and ALiBi count from there; rotary positions are the cache's own,
    as flash-attn's kernel and test reference have it). Appends land in the chosen rows only."""
    B, Bc, cap, H, Hkv, D, Sn = 3, 5, 12, 4, 2, 16, 3
    sq = Sn if append else 2
    q = torch.randn(B, sq, H, D, generator=gen)
    k_new = torch.randn(B, Sn, Hkv, D, generator=gen) if append else None
    v_new = torch.randn(B, Sn, Hkv, D, generator=gen) if append else None
    k_cache = torch.randn(Bc, cap, Hkv, D, generator=gen)
    v_cache = torch.randn(Bc, cap, Hkv, D, generator=gen)
    lens = torch.tensor([2, 9, 6], dtype=torch.int32)
    idx = torch.tensor([4, 0, 2], dtype=torch.int32) if rows != "leftpad" else None
    pad = torch.tensor([1, 6, 0], dtype=torch.int32) if rows != "batch_idx" else None
    alibi = torch.rand(B, H, generator=gen) * 0.3
    cos = sin = None
    if rotary is not None:
        cos, sin = _rotary_tables(gen, cap, 8)
    _check_rows_and_pads(q, k_cache, v_cache, k_new, v_new, lens, idx, pad, cos=cos, sin=sin,
                         rotary=rotary, causal=causal, window=window, alibi=alibi)


def _check_rows_and_pads(q, k_cache, v_cache, k_new, v_new, lens, idx, pad, *, cos, sin, rotary,
                         causal, window, alibi=None):
    """flash_attn_with_kvcache with cache_batch_idx `idx` and cache_leftpad `pad` (int32 [B] or
    None) against the oracle: out, lse, the chosen cache rows after the call, the others
    untouched."""
    B, sn = q.shape[0], 0 if k_new is None else k_new.shape[1]
    chosen = idx.long() if idx is not None else torch.arange(B)
    if sn:
        qr, want_k, want_v = oracle.append(q, k_cache[chosen], v_cache[chosen], k_new, v_new,
                                           lens, cos=cos, sin=sin,
                                           interleaved=rotary == "interleaved", causal=causal,
                                           window=window)
    else:
        qr, want_k, want_v = q.double(), k_cache[chosen].double(), v_cache[chosen].double()
    p = [0] * B if pad is None else pad.tolist()
    seen = lens + sn - torch.tensor(p, dtype=torch.int32)
    want_out, want_lse = oracle.kvcache(qr, _shifted(want_k, p), _shifted(want_v, p), seen,
                                        causal=causal, window=window, alibi=alibi)
    kc, vc = k_cache.clone(), v_cache.clone()
    out, lse = fa.flash_attn_with_kvcache(
        q, kc, vc, k_new, v_new, rotary_cos=cos, rotary_sin=sin, cache_seqlens=lens,
        cache_batch_idx=idx, cache_leftpad=pad, causal=causal, window_size=window,
        alibi_slopes=alibi, rotary_interleaved=rotary == "interleaved", return_softmax_lse=True)
    _close("out", out, want_out, tol=1e-4)
    _close("softmax_lse", lse, want_lse, tol=1e-4)
    _close("k_cache", kc[chosen], want_k, tol=1e-5)
    _close("v_cache", vc[chosen], want_v, tol=1e-5)
    others = [r for r in range(k_cache.shape[0]) if r not in chosen.tolist()]
    assert torch.equal(kc[others], k_cache[others]) and torch.equal(vc[others], v_cache[others])


@needs_kvcache
@pytest.mark.parametrize("bad, match", [
    (dict(cache_batch_idx=torch.tensor([0, 5], dtype=torch.int32)), r"cache_batch_idx\[1\] = 5"),
    (dict(cache_batch_idx=torch.tensor([0], dtype=torch.int32)), r"cache_batch_idx must be"),
    (dict(cache_batch_idx=torch.zeros(2)), r"cache_batch_idx must be an integer"),
    (dict(cache_leftpad=torch.tensor([0, 4], dtype=torch.int32)), r"cache_leftpad\[1\] = 4"),
    (dict(cache_leftpad=torch.tensor([-1, 0], dtype=torch.int32)), r"cache_leftpad\[0\] = -1"),
    (dict(cache_seqlens=torch.tensor([2, 6], dtype=torch.int32),
          cache_batch_idx=torch.tensor([1, 0], dtype=torch.int32)), r"cache_seqlens\[1\] = 6"),
    (dict(cache_leftpad=torch.zeros(2, dtype=torch.int32),
          block_table=torch.zeros(2, 1, dtype=torch.int32)), r"cache_leftpad with block_table"),
])
def test_kvcache_batch_idx_and_leftpad_refusals(gen, bad, match):
    """Bad rows, pads and appends past a row's end: the named error, nothing written."""
    q, kc, vc = _qkv_cache(gen)
    before_k, before_v = kc.clone(), vc.clone()
    kw = dict(cache_seqlens=torch.tensor([2, 3], dtype=torch.int32))
    kw.update(bad)
    kn, vn = torch.randn(2, 2, 2, 8, generator=gen), torch.randn(2, 2, 2, 8, generator=gen)
    with pytest.raises((ValueError, NotImplementedError), match=match):
        fa.flash_attn_with_kvcache(q, kc, vc, kn, vn, **kw)
    assert torch.equal(kc, before_k) and torch.equal(vc, before_v)


def _qkv_cache(gen):
    return (torch.randn(2, 2, 4, 8, generator=gen), torch.randn(3, 7, 2, 8, generator=gen),
            torch.randn(3, 7, 2, 8, generator=gen))


@needs_kvcache
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_kvcache_rows_and_pads_randomized(data):
    """Random cache rows, left pads, lengths, appends and options against the oracle."""
    B = data.draw(st.integers(1, 3))
    Bc = B + data.draw(st.integers(0, 2))
    cap, Hkv, group, D = data.draw(st.integers(2, 9)), data.draw(st.sampled_from([1, 2])), \
        data.draw(st.sampled_from([1, 2])), 8
    Sn = data.draw(st.integers(0, 2))
    lens = [data.draw(st.integers(0, cap - Sn)) for _ in range(B)]
    pads = [data.draw(st.integers(0, n)) for n in lens]
    idx = data.draw(st.permutations(range(Bc)))[:B]
    causal = data.draw(st.booleans())
    window = data.draw(st.sampled_from([(-1, -1), (1, 0), (2, 3)]))
    rotary = data.draw(st.sampled_from([None, "half", "interleaved"])) if Sn else None
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31)))
    sq = Sn if Sn else data.draw(st.integers(1, 2))
    q = torch.randn(B, sq, Hkv * group, D, generator=gen)
    k_new = torch.randn(B, Sn, Hkv, D, generator=gen) if Sn else None
    v_new = torch.randn(B, Sn, Hkv, D, generator=gen) if Sn else None
    k_cache = torch.randn(Bc, cap, Hkv, D, generator=gen)
    v_cache = torch.randn(Bc, cap, Hkv, D, generator=gen)
    cos = sin = None
    if rotary is not None:
        cos, sin = _rotary_tables(gen, cap, 4)
    _check_rows_and_pads(q, k_cache, v_cache, k_new, v_new, torch.tensor(lens, dtype=torch.int32),
                         torch.tensor(idx, dtype=torch.int32),
                         torch.tensor(pads, dtype=torch.int32), cos=cos, sin=sin, rotary=rotary,
                         causal=causal, window=window)


@needs_kvcache
@pytest.mark.parametrize("window", [(2, 3), (5, 0), (0, 2)])
def test_kvcache_rotary_window_wider_than_the_cache_is_not_local(gen, window):
    """A window side >= the cache's capacity is unbounded (flash-attn's C++ front end clamps it),
    so the call is local only through its other side: (2, 3) over 2 slots rotates q at
    cache_seqlens alone, (5, 0) and (0, 2) at cache_seqlens + i (hypothesis found the first)."""
    B, cap, sn = 3, 2, 2
    q = torch.randn(B, sn, 1, 8, generator=gen)
    k_new, v_new = (torch.randn(B, sn, 1, 8, generator=gen) for _ in range(2))
    k_cache, v_cache = (torch.randn(B, cap, 1, 8, generator=gen) for _ in range(2))
    cos, sin = _rotary_tables(gen, cap, 4)
    zeros = torch.zeros(B, dtype=torch.int32)
    _check_rows_and_pads(q, k_cache, v_cache, k_new, v_new, zeros,
                         torch.arange(B, dtype=torch.int32), zeros, cos=cos, sin=sin,
                         rotary="half", causal=False, window=window)


@needs_kvcache
def test_kvcache_left_pad_of_the_whole_cache_sees_no_key(gen):
    """A pad equal to cache_seqlens = S_cache leaves the sequence no key: out 0, lse +inf
    (found by the randomized test: the paged view had no page then)."""
    q, kc, vc = (torch.randn(1, 1, 1, 8, generator=gen), torch.randn(1, 2, 1, 8, generator=gen),
                 torch.randn(1, 2, 1, 8, generator=gen))
    lens = torch.tensor([2], dtype=torch.int32)
    out, lse = fa.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, cache_leftpad=lens,
                                          return_softmax_lse=True)
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.equal(lse, torch.full_like(lse, math.inf))
