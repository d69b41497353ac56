"""SPEC part 2's KV-cache append (FlashAttention's `flash_attn_with_kvcache`, forward only) on the
reference backend: `ComputeEngine.attention_with_kvcache` writes k_new/v_new (rotated by RoPE
tables, rotate-half or interleaved) into a contiguous or paged cache at cache_seqlens[b], then
attends bottom-right over cache_seqlens[b] + new keys. Checked against an independent oracle
(flash-attn's own torch formula for the rotation, the dense float64 oracle of
tests/dense_options.py for the attention) with every other cache slot unchanged bit for bit;
hypothesis over layouts and options; bad inputs refused by name with nothing written (the cache
included); the CUDA backend plans it (tests/test_cuda_append.py runs it on the GPU)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dense_options import dense, per_head_inputs
from ferrocupy import AttentionOptions, ComputeEngine
from helpers import poison
from test_model_options import _CudaRecorder, _close, _oracle_options
from test_paged_kv import gathered

torch = pytest.importorskip("torch")


def _eng():
    return ComputeEngine("reference", quiet=True)


def rotary_oracle(x, cos, sin, positions, interleaved):
    """flash-attn's `apply_rotary_emb_torch` in float64: `x * cos + rotate_half(x) * sin` over
    the first rotary_dim features, x `[n, heads, D]`, token t at positions[t]."""
    x = np.asarray(x, np.float64)
    c = np.asarray(cos, np.float64)[positions][:, None, :]
    s = np.asarray(sin, np.float64)[positions][:, None, :]
    rd = 2 * c.shape[-1]
    r = x[..., :rd]
    if interleaved:
        c, s = np.repeat(c, 2, axis=-1), np.repeat(s, 2, axis=-1)
        x1, x2 = r[..., 0::2], r[..., 1::2]
        half = np.stack((-x2, x1), axis=-1).reshape(r.shape)
    else:
        c, s = np.concatenate((c, c), -1), np.concatenate((s, s), -1)
        x1, x2 = r[..., :rd // 2], r[..., rd // 2:]
        half = np.concatenate((-x2, x1), axis=-1)
    return np.concatenate((r * c + half * s, x[..., rd:]), axis=-1)


def tables(rng, seqlen_ro, rotary_dim, dtype=np.float32):
    angles = rng.uniform(0, 2 * np.pi, (seqlen_ro, rotary_dim // 2))
    return np.cos(angles).astype(dtype), np.sin(angles).astype(dtype)


def case(rng, b, sq, sn, h, hkv, d, cache_seqlens, *, capacity, page_size=None, rotary_dim=0,
         alibi=None, sinks=False):
    """A cache (contiguous `[b, capacity]` or paged with `page_size`) holding cache_seqlens[b]
    keys, NaN elsewhere; q, k_new, v_new; RoPE tables over the capacity."""
    t = dict(q=rng.standard_normal((b, sq, h, d), dtype=np.float32),
             k_new=rng.standard_normal((b, sn, hkv, d), dtype=np.float32),
             v_new=rng.standard_normal((b, sn, hkv, d), dtype=np.float32),
             cache_seqlens=np.array(cache_seqlens, np.int32))
    if page_size is None:
        k = np.full((b, capacity, hkv, d), np.nan, np.float32)
        v = k.copy()
        for i, n in enumerate(cache_seqlens):
            k[i, :n], v[i, :n] = (rng.standard_normal((n, hkv, d)) for _ in "kv")
    else:
        max_blocks = -(-capacity // page_size)
        num_blocks = b * max_blocks + 1
        table = rng.permutation(num_blocks)[:b * max_blocks].reshape(b, max_blocks)
        t["block_table"] = table.astype(np.int32)
        k = np.full((num_blocks, page_size, hkv, d), np.nan, np.float32)
        v = k.copy()
        for i, n in enumerate(cache_seqlens):
            for j in range(n):
                k[table[i, j // page_size], j % page_size] = rng.standard_normal((hkv, d))
                v[table[i, j // page_size], j % page_size] = rng.standard_normal((hkv, d))
    t["k_cache"], t["v_cache"] = k, v
    if rotary_dim:
        t["rotary_cos"], t["rotary_sin"] = tables(rng, capacity + sq, rotary_dim)
    return t | per_head_inputs(rng, b, h, alibi=alibi, sinks=sinks)


def _kwargs(t, interleaved=False):
    names = ("k_new", "v_new", "block_table", "rotary_cos", "rotary_sin", "alibi_slopes",
             "sinks")
    kw = {n: t[n] for n in names if t.get(n) is not None}
    return kw | dict(cache_seqlens=t["cache_seqlens"], rotary_interleaved=interleaved)


def run(t, opts, interleaved=False, eng=None):
    """(out, lse, k_cache, v_cache) after the call, on copies of the cache."""
    k_cache, v_cache = t["k_cache"].copy(), t["v_cache"].copy()
    q = t["q"]
    out = poison(np.empty_like(q))
    lse = poison(np.empty((q.shape[0], q.shape[2], q.shape[1]), np.float32))
    (eng or _eng()).attention_with_kvcache(q, k_cache, v_cache, out, opts, lse=lse,
                                           **_kwargs(t, interleaved))
    return out, lse, k_cache, v_cache


def oracle(t, opts, interleaved=False):
    """The expected (out, lse, k_cache, v_cache): the cache with the new keys written (rotated,
    rounded to float32) at cache_seqlens[b]..; q rotated at cache_seqlens[b] + i (causal or
    windowed) or cache_seqlens[b]; then the dense attention bottom-right over the keys."""
    k_cache, v_cache = t["k_cache"].copy(), t["v_cache"].copy()
    q = t["q"].copy()
    b, sq = q.shape[:2]
    sn = t["k_new"].shape[1]
    rotary = t.get("rotary_cos") is not None
    per_row = opts.causal or opts.windows() != (-1, -1)
    for i, c in enumerate(t["cache_seqlens"]):
        pos = c + np.arange(sn)
        k_new = t["k_new"][i]
        if rotary:
            k_new = rotary_oracle(k_new, t["rotary_cos"], t["rotary_sin"], pos, interleaved)
            qpos = c + (np.arange(sq) if per_row else np.zeros(sq, np.int64))
            q[i] = rotary_oracle(q[i], t["rotary_cos"], t["rotary_sin"], qpos,
                                 interleaved).astype(np.float32)
        for n, j in enumerate(pos):
            if t.get("block_table") is None:
                k_cache[i, j], v_cache[i, j] = k_new[n], t["v_new"][i, n]
            else:
                page = k_cache.shape[1]
                blk = t["block_table"][i, j // page]
                k_cache[blk, j % page], v_cache[blk, j % page] = k_new[n], t["v_new"][i, n]
    if t.get("block_table") is None:
        k, v = k_cache, v_cache
    else:
        k, v = gathered(dict(k=k_cache, v=v_cache, block_table=t["block_table"]))
    lens = t["cache_seqlens"] + sn
    capacity = k.shape[1]
    o = _oracle_options(opts, alibi_slopes=t.get("alibi_slopes"), kv_lens=lens)
    o["causal_offset"] = opts.causal_offset + capacity - sq
    out, lse = dense(q, np.nan_to_num(k), np.nan_to_num(v), sinks=t.get("sinks"), **o)
    return out.numpy(), lse.numpy(), k_cache, v_cache


def check(t, opts, interleaved=False):
    got = run(t, opts, interleaved)
    want = oracle(t, opts, interleaved)
    _close(got[0], want[0], what="out")
    _close(got[1], want[1], what="lse")
    for name, g, w in zip(("k_cache", "v_cache"), got[2:], want[2:]):
        # the appended slots to float32 rounding of float64 rotations; every other slot as it was
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6, equal_nan=True, err_msg=name)
        untouched = np.isnan(t[name]) == np.isnan(w)
        assert np.array_equal(g[untouched], t[name][untouched], equal_nan=True), name


LAYOUTS = {"contiguous": None, "page-1": 1, "page-3": 3, "page-16": 16}
ROTARY = {"none": (0, False), "rotate-half": (8, False), "interleaved": (8, True),
          "partial-interleaved": (4, True), "partial-half": (6, False)}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("rotary", list(ROTARY))
@pytest.mark.parametrize("opts", [AttentionOptions(causal=True),
                                  AttentionOptions(),
                                  AttentionOptions(window_left=3, softcap=2.0)],
                         ids=["causal", "full", "windowed"])
def test_append_against_the_oracle(rng, layout, rotary, opts):
    rd, interleaved = ROTARY[rotary]
    t = case(rng, 3, 2, 2, 4, 2, 8, [5, 0, 11], capacity=13, page_size=LAYOUTS[layout],
             rotary_dim=rd, alibi="bh", sinks=True)
    check(t, opts, interleaved)


def test_append_without_rotary_is_a_write_then_the_kv_lens_call(rng):
    """No RoPE: the cache gets k_new/v_new bit for bit, and out is the engine's kv_lens call
    (bottom-right) on that cache."""
    t = case(rng, 2, 3, 3, 2, 2, 8, [4, 7], capacity=10)
    out, lse, k, v = run(t, AttentionOptions(causal=True))
    for i, c in enumerate(t["cache_seqlens"]):
        assert np.array_equal(k[i, c:c + 3], t["k_new"][i])
        assert np.array_equal(v[i, c:c + 3], t["v_new"][i])
    want = np.empty_like(out)
    _eng().flash_attention_v2_with(t["q"], k, v, want, AttentionOptions(causal=True,
                                                                        causal_offset=10 - 3),
                                   kv_lens=t["cache_seqlens"] + 3)
    np.testing.assert_array_equal(out, want)


def test_no_new_keys_is_bottom_right_over_the_cache(rng):
    t = case(rng, 2, 2, 0, 2, 1, 8, [6, 3], capacity=9, page_size=4)
    del t["k_new"], t["v_new"]
    t["k_new"] = t["v_new"] = None
    out, lse, k, v = run(t, AttentionOptions(causal=True))
    assert np.array_equal(k, t["k_cache"], equal_nan=True)
    t["k_new"] = t["v_new"] = np.zeros((2, 0, 1, 8), np.float32)
    want = oracle(t, AttentionOptions(causal=True))
    _close(out, want[0], what="out")
    _close(lse, want[1], what="lse")


def test_append_with_no_query_rows_still_writes(rng):
    t = case(rng, 1, 0, 2, 2, 1, 8, [3], capacity=6, rotary_dim=4)
    check(t, AttentionOptions(causal=True))


def test_half_precision_tables_and_cache(rng):
    """float16 cache, q and tables (flash-attn's); the rotated keys are rounded once."""
    t = case(rng, 2, 1, 2, 2, 1, 16, [3, 5], capacity=8, rotary_dim=16)
    for n in ("q", "k_new", "v_new", "k_cache", "v_cache", "rotary_cos", "rotary_sin"):
        t[n] = t[n].astype(np.float16)
    out, lse, k, _ = run(t, AttentionOptions(causal=True))
    want = oracle(t, AttentionOptions(causal=True))
    _close(k[0, 3:5], want[2][0, 3:5], tol=1e-3, what="k_cache")
    _close(out, want[0], tol=2e-3, what="out")


@st.composite
def append_calls(draw):
    b, sn, sq = draw(st.integers(1, 3)), draw(st.integers(0, 3)), draw(st.integers(0, 3))
    page = draw(st.sampled_from([None, 1, 2, 5]))
    capacity = draw(st.integers(max(sn, 1), 12))
    lens = draw(st.lists(st.integers(0, capacity - sn), min_size=b, max_size=b))
    hkv = draw(st.sampled_from([1, 2]))
    d = draw(st.sampled_from([4, 8]))
    rd = draw(st.sampled_from([0, 2, d]))
    o = dict(causal=draw(st.booleans()), causal_offset=draw(st.integers(-2, 2)))
    if draw(st.booleans()):
        o["window_left"] = draw(st.sampled_from([None, 0, 2]))
        o["window_right"] = draw(st.sampled_from([None, 1]))
    o["softcap"] = draw(st.sampled_from([0.0, 1.5]))
    return (b, sq, sn, hkv * draw(st.sampled_from([1, 2])), hkv, d, lens, capacity, page, rd,
            draw(st.booleans()), o, draw(st.booleans()), draw(st.integers(0, 2**32 - 1)))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(append_calls())
def test_random_appends(call):
    b, sq, sn, h, hkv, d, lens, capacity, page, rd, interleaved, o, sinks, seed = call
    t = case(np.random.default_rng(seed), b, sq, sn, h, hkv, d, lens, capacity=capacity,
             page_size=page, rotary_dim=rd, sinks=sinks)
    check(t, AttentionOptions(**o), interleaved)


# --- bad inputs: refused by name, nothing written (the cache included) ----------------------------
def _bad_calls(rng):
    t = case(rng, 2, 1, 2, 2, 1, 8, [3, 6], capacity=8, rotary_dim=8)
    i32 = lambda *x: np.array(x, np.int32)  # noqa: E731
    f32 = np.float32
    paged = case(rng, 2, 1, 2, 2, 1, 8, [3, 6], capacity=8, page_size=4)
    bad_table = paged["block_table"].copy()
    bad_table[1, 1] = 99
    return t, paged, [
        (dict(cache_seqlens=i32(3, 7)), ValueError,
         r"cache_seqlens\[1\] = 7 plus 2 new keys \(k_new\) = 9 overflows the cache's capacity "
         r"of 8 keys"),
        (dict(cache_seqlens=i32(3, 9)), ValueError, r"kv_lens\[1\] = 9 is outside"),
        (dict(k_new=np.zeros((2, 2, 1, 4), f32)), ValueError,
         r"k_new shape \(2, 2, 1, 4\) must be \[batch, new_keys, kv_heads, head_dim\] with "
         r"batch, kv_heads, head_dim = 2, 1, 8"),
        (dict(v_new=np.zeros((2, 1, 1, 8), f32)), ValueError,
         r"v_new shape \(2, 1, 1, 8\) must equal k_new shape \(2, 2, 1, 8\)"),
        (dict(v_new=None), ValueError, r"an append needs k_new and v_new: k_new \(shape "
                                       r"\(2, 2, 1, 8\)\) is given alone"),
        (dict(k_new=t["k_new"].astype(np.float16)), TypeError,
         r"k_new has dtype float16 \(shape \(2, 2, 1, 8\)\); it must be the cache's and q's"),
        (dict(k_new=np.ascontiguousarray(t["k_new"].transpose(1, 0, 2, 3)).transpose(
            1, 0, 2, 3)), ValueError, r"k_new \(shape \(2, 2, 1, 8\)\) is not C-contiguous"),
        (dict(rotary_sin=None), ValueError,
         r"RoPE needs rotary_cos and rotary_sin: rotary_cos \(shape \(9, 4\)\) is given alone"),
        (dict(rotary_cos=np.ones((9, 5), f32), rotary_sin=np.ones((9, 5), f32)), ValueError,
         r"rotary_cos shape \(9, 5\) must be \[seqlen_ro, rotary_dim / 2\] with 2 <= rotary_dim "
         r"<= head_dim = 8"),
        (dict(rotary_sin=np.ones((9, 2), f32)), ValueError,
         r"rotary_sin shape \(9, 2\) must equal rotary_cos shape \(9, 4\)"),
        (dict(rotary_cos=np.ones((9, 4)), rotary_sin=np.ones((9, 4))), TypeError,
         r"rotary_cos has dtype float64 \(shape \(9, 4\)\); it must be float32 or q's"),
        (dict(rotary_cos=np.ones((7, 4), f32), rotary_sin=np.ones((7, 4), f32)), ValueError,
         r"rotary_cos/rotary_sin have 7 positions \(shape \[7, ...\]\), but sequence 1 rotates "
         r"positions up to 7 \(cache_seqlens\[1\] = 6\)"),
        (dict(cache_seqlens=i32(3, 6).astype(np.int64)), TypeError,
         r"kv_lens has dtype int64"),
        (dict(paged=True, block_table=bad_table), ValueError,
         r"block_table\[1, 1\] = 99 is not a block of the cache"),
        (dict(paged=True, cache_seqlens=i32(3, 7)), ValueError,
         r"cache_seqlens\[1\] = 7 plus 2 new keys"),
    ]


def test_bad_inputs_raise_naming_the_argument_and_write_nothing(rng):
    t, paged, cases = _bad_calls(rng)
    for change, err, match in cases:
        base = paged if change.pop("paged", False) else t
        args = _kwargs(base) | change
        k_cache, v_cache = base["k_cache"].copy(), base["v_cache"].copy()
        out, lse = np.zeros_like(base["q"]), np.zeros((2, 2, 1), np.float32)
        with pytest.raises(err, match=match):
            _eng().attention_with_kvcache(base["q"], k_cache, v_cache, out,
                                          AttentionOptions(causal=True), lse=lse, **args)
        assert not out.any() and not lse.any()
        assert np.array_equal(k_cache, base["k_cache"], equal_nan=True)
        assert np.array_equal(v_cache, base["v_cache"], equal_nan=True)


def test_rope_tables_of_two_dtypes_are_refused(rng):
    """rotary_cos and rotary_sin share one dtype (flash-attn: both q's): the CUDA append reads
    both tables as rotary_cos's type (append_kv.cu's `tables_f32`), so float32 cos beside
    float16 sin would read sin's bytes as floats (past its end). Refused by name on every
    backend, nothing written."""
    t = case(rng, 2, 1, 2, 2, 1, 16, [3, 5], capacity=8, rotary_dim=16)
    for n in ("q", "k_new", "v_new", "k_cache", "v_cache", "rotary_sin"):
        t[n] = t[n].astype(np.float16)
    for cos, sin in ((t["rotary_cos"], t["rotary_sin"]),
                     (t["rotary_cos"].astype(np.float16), t["rotary_sin"].astype(np.float32))):
        k_cache, v_cache = t["k_cache"].copy(), t["v_cache"].copy()
        out = np.zeros_like(t["q"])
        args = _kwargs(t) | dict(rotary_cos=cos, rotary_sin=sin)
        with pytest.raises(TypeError, match=rf"rotary_sin has dtype {sin.dtype} \(shape "
                           rf"\(9, 8\)\); it must be rotary_cos's \({cos.dtype}\)"):
            _eng().attention_with_kvcache(t["q"], k_cache, v_cache, out,
                                          AttentionOptions(causal=True), **args)
        assert not out.any()
        assert np.array_equal(k_cache, t["k_cache"], equal_nan=True)
        assert np.array_equal(v_cache, t["v_cache"], equal_nan=True)


def test_rotary_or_v_new_without_k_new_is_refused(rng):
    t = case(rng, 1, 1, 1, 2, 1, 8, [2], capacity=4, rotary_dim=4)
    out = np.zeros_like(t["q"])
    for args, match in ((dict(rotary_cos=t["rotary_cos"], rotary_sin=t["rotary_sin"]),
                         r"rotary_cos/rotary_sin rotate an append's q and k_new: they need "
                         r"k_new and v_new"),
                        (dict(v_new=t["v_new"]), r"an append needs k_new and v_new: v_new")):
        with pytest.raises(ValueError, match=match):
            _eng().attention_with_kvcache(t["q"], t["k_cache"], t["v_cache"], out,
                                          cache_seqlens=t["cache_seqlens"], **args)
    with pytest.raises(TypeError, match="cache_seqlens"):
        _eng().attention_with_kvcache(t["q"], t["k_cache"], t["v_cache"], out,
                                      cache_seqlens=None)
    assert not out.any()


def test_the_cache_sharing_memory_is_refused(rng):
    """The cache is written: it must share no byte with q, k_new, v_new, out or the other
    cache; nothing is written when it does."""
    t = case(rng, 1, 1, 2, 2, 1, 8, [2], capacity=6)
    kc, vc = np.zeros_like(t["k_cache"]), np.zeros_like(t["v_cache"])
    new = dict(k_new=t["k_new"], v_new=t["v_new"])
    calls = [  # (q, k_cache, v_cache, out, k_new/v_new, message)
        (t["q"], kc, vc, np.zeros_like(t["q"]), dict(new, k_new=kc[:, :2]),
         r"k \(shape \(1, 6, 1, 8\)\) shares memory with k_new"),
        (t["q"], kc, vc, np.zeros_like(t["q"]), dict(new, v_new=vc[:, 4:]),
         r"v \(shape \(1, 6, 1, 8\)\) shares memory with v_new"),
        (t["q"], kc, kc, np.zeros_like(t["q"]), new,
         r"k \(shape \(1, 6, 1, 8\)\) shares memory with v"),
        (kc[:, :1, :1].reshape(1, 1, 1, 8).repeat(2, 2), kc, vc, np.zeros_like(t["q"]), new,
         None),  # a copy of cache rows: accepted
        (t["q"], kc, vc, kc.reshape(-1)[:16].reshape(1, 1, 2, 8), new,
         r"k \(shape \(1, 6, 1, 8\)\) shares memory with out"),
    ]
    for q, k_cache, v_cache, out, kv_new, match in calls:
        k_before, v_before = k_cache.copy(), v_cache.copy()
        run = lambda: _eng().attention_with_kvcache(  # noqa: E731
            q, k_cache, v_cache, out, cache_seqlens=t["cache_seqlens"], **kv_new)
        if match is None:
            run()
            continue
        with pytest.raises(ValueError, match=match):
            run()
        assert np.array_equal(k_cache, k_before) and np.array_equal(v_cache, v_before)


@st.composite
def carved_appends(draw):
    """An append whose float tensors (q, the caches, out, lse, k_new, v_new) are carved from one
    buffer, each at a drawn offset: apart, or onto / into another's span."""
    names = ("q", "k_cache", "v_cache", "out", "lse", "k_new", "v_new")
    shapes = dict(q=(1, 2, 2, 4), k_cache=(1, 6, 1, 4), v_cache=(1, 6, 1, 4), out=(1, 2, 2, 4),
                  lse=(1, 2, 2), k_new=(1, 2, 1, 4), v_new=(1, 2, 1, 4))
    places, end = {}, 0
    for n in names:
        if places and draw(st.booleans()):
            off = draw(st.integers(0, end - 1))
        else:
            off = end + draw(st.integers(0, 3))
        places[n] = off
        end = max(end, off + int(np.prod(shapes[n])))
    return shapes, places, end, draw(st.integers(0, 2**32 - 1))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(carved_appends())
def test_carved_appends_are_refused_exactly_when_an_output_meets_another_tensor(call):
    """The written tensors (out, lse and the cache) may share no byte with any other argument;
    a call where one does is refused with the buffer unchanged, any other runs as on copies."""
    shapes, places, size, seed = call
    rng = np.random.default_rng(seed)
    buf = rng.standard_normal(size).astype(np.float32)
    views = {n: buf[o:o + int(np.prod(shapes[n]))].reshape(shapes[n]) for n, o in places.items()}
    spans = {n: (o, o + int(np.prod(shapes[n]))) for n, o in places.items()}
    written = ("out", "lse", "k_cache", "v_cache")
    clash = any(spans[w][0] < spans[n][1] and spans[n][0] < spans[w][1]
                for w in written for n in spans if n != w)
    lens = np.array([3], np.int32)
    call_args = lambda v: (  # noqa: E731
        (v["q"], v["k_cache"], v["v_cache"], v["out"]),
        dict(cache_seqlens=lens, k_new=v["k_new"], v_new=v["v_new"], lse=v["lse"]))
    if clash:
        before = buf.copy()
        args, kw = call_args(views)
        with pytest.raises(ValueError, match="shares memory"):
            _eng().attention_with_kvcache(*args, **kw)
        assert np.array_equal(buf, before)
        return
    copies = {n: v.copy() for n, v in views.items()}
    args, kw = call_args(views)
    _eng().attention_with_kvcache(*args, **kw)
    args, kw = call_args(copies)
    _eng().attention_with_kvcache(*args, **kw)
    for n in written:
        np.testing.assert_array_equal(views[n], copies[n], err_msg=n)


def test_plans_are_kept_by_rotary_interleaved(rng):
    t = case(rng, 1, 1, 1, 2, 1, 8, [2], capacity=4, rotary_dim=4)
    eng = _eng()
    out = np.zeros_like(t["q"])
    plan = lambda inter: eng.plan_attention_with_kvcache(  # noqa: E731
        t["q"], t["k_cache"], t["v_cache"], out, **_kwargs(t, inter))
    assert plan(False) is plan(False)
    assert plan(True) is not plan(False)
    assert int(plan(True).extras["flags"]) == 32 | 64 | 128
    assert int(plan(False).params["causal_offset"]) == 4 - 1


# --- CUDA plans the append (tests/test_cuda_append.py runs it) -----------------------------------
def test_cuda_backend_plans_the_append(rng):
    eng = _eng()
    eng.backend = rec = _CudaRecorder()
    for page in (None, 4):
        t = case(rng, 2, 1, 2, 2, 1, 8, [3, 6], capacity=8, page_size=page, rotary_dim=8)
        plan = eng.plan_attention_with_kvcache(t["q"], t["k_cache"], t["v_cache"],
                                               np.zeros_like(t["q"]), **_kwargs(t))
        assert plan.written == ("out", "k", "v")
    assert rec.plans == []  # (the launches come on the first run)
