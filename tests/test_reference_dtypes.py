"""float16 / bfloat16 on the reference backend (SPEC "Beyond the seed"), and the `lse` and
`scale` additions: every output equals the float64 computation on the same (rounded) inputs,
rounded once to its dtype (within one ulp; equal for nearly every element), checked through
ComputeEngine("reference") against the dense oracles in helpers.py."""

from __future__ import annotations

import numpy as np
import pytest

from ferrocupy import AttentionOptions, ComputeEngine
from ferrocupy.dtypes import BFLOAT16, FLOAT16, FLOAT32
from helpers import (_dense_probs, attention_params, dense_attention, dense_attention_grads,
                     dense_keep, dropout_factor_f32, f32_scale, poison, rel_err)

HALF = [FLOAT16, BFLOAT16]
ALL = [FLOAT32, FLOAT16, BFLOAT16]


@pytest.fixture(scope="module")
def eng():
    return ComputeEngine("reference")


def f64(a):
    return None if a is None else np.asarray(a).astype(np.float64)


def ulp_distance(got, want64):
    """How many representable values of got's dtype lie between `got` and `want64` rounded
    once to that dtype (sign-magnitude bits mapped to ordered integers; +0 == -0)."""
    dt = got.dtype
    want = want64.astype(dt)
    bits, sign = 8 * dt.itemsize, 1 << (8 * dt.itemsize - 1)

    def ordered(a):
        b = a.view(f"u{dt.itemsize}").astype(np.int64)
        return np.where(b & sign, -(b & (sign - 1)), b)

    assert bits in (16, 32)
    return np.abs(ordered(got) - ordered(want))


def assert_rounded_once(got, want64, dtype, name="", noise_rel=1e-10):
    """`got` (of `dtype`) is `want64` rounded once: within 1 ulp everywhere, exactly equal for
    all but 1% of the elements (or 2). Elements within `noise_rel` of the array's largest
    |x64| of their float64 value (pure cancellation noise, by default) need be no closer."""
    assert got.dtype == dtype, (name, got.dtype)
    g = got.astype(np.float64)
    assert not np.isnan(g).any(), f"{name}: NaN left in the output"
    dist = ulp_distance(got, want64)
    noise = np.abs(g - want64) <= noise_rel * max(np.abs(want64).max(), 1e-300)
    bad = (dist > 1) & ~noise
    assert not bad.any(), (f"{name}: {bad.sum()} elements more than 1 ulp away, worst "
                           f"{dist[bad].max()} ulps, e.g. got {g[bad][:4]} want {want64[bad][:4]}")
    inexact = int((~((dist == 0) | noise)).sum())
    assert inexact <= max(2, dist.size // 100), f"{name}: {inexact} of {dist.size} not exact"


def make(rng, dtype, B, Sq, Sk, H, Hkv, D):
    """q, k, v (random normal, rounded to `dtype`: never zeros)."""
    return tuple(rng.standard_normal(s).astype(dtype)
                 for s in ((B, Sq, H, D), (B, Sk, Hkv, D), (B, Sk, Hkv, D)))


def make_mask(rng, kind, dtype, B, H, Sq, Sk):
    if kind is None:
        return None
    shape = (B, 1, Sq, Sk) if kind == "f32" else (1, H, Sq, Sk)
    m = rng.standard_normal(shape)
    m[..., 1] = -np.inf  # a key every row is masked from
    return m.astype(FLOAT32 if kind == "f32" else dtype)


def oracle_kw(q, k, opts, mask):
    """Keyword arguments of the dense oracles for `opts` (dropout keep-mask from Philox)."""
    keep = None
    if opts.dropout_prob:
        B, Sq, H, _ = q.shape
        keep = dense_keep(attention_params(q, k, opts, mask), B, H, Sq, k.shape[1])
    return dict(causal=opts.causal, causal_offset=opts.causal_offset, window=opts.window,
                mask=f64(mask), keep=keep, dropout_prob=opts.dropout_prob,
                scale=None if opts.scale is None else float(np.float32(opts.scale)))


def dense_grads_given_out(q, k, v, out, go, *, causal, causal_offset, window, mask, keep,
                          dropout_prob, scale):
    """SPEC "Attention backward" in float64 with `Delta = grad_out . out` from the `out` given
    (as the kernels take it), not from a recomputed one."""
    B, Sq, H, D = q.shape
    Hkv = k.shape[2]
    scale = f32_scale(D) if scale is None else scale
    with np.errstate(all="ignore"):
        prob, _, kk = _dense_probs(q, k, causal, causal_offset, window, mask, scale)
        factor = 1.0 if keep is None else keep * dropout_factor_f32(dropout_prob)
        vv = np.repeat(v, H // Hkv, axis=2)
        delta = np.einsum("bihd,bihd->bhi", go, out)
        ds = prob * (np.einsum("bihd,bjhd->bhij", go, vv) * factor - delta[..., None])
        gq = scale * np.einsum("bhij,bjhd->bihd", ds, kk)
        gk = scale * np.einsum("bhij,bihd->bjhd", ds, q)
        gv = np.einsum("bhij,bihd->bjhd", prob * factor, go)
    fold = lambda g: g.reshape(B, -1, Hkv, H // Hkv, D).sum(axis=3)  # noqa: E731
    return gq, fold(gk), fold(gv)


# (B, Sq, Sk, H, Hkv, D), options, mask kind
CASES = [
    ((2, 5, 7, 4, 4, 16), AttentionOptions(), None),
    ((1, 6, 6, 4, 2, 8), AttentionOptions(causal=True), None),
    ((2, 4, 9, 6, 2, 16), AttentionOptions(causal=True, causal_offset=5, window=3), None),
    ((2, 5, 6, 4, 2, 8), AttentionOptions(window=3, causal_offset=4), "f32"),
    ((1, 7, 5, 4, 1, 32), AttentionOptions(dropout_prob=0.25, seed=11), "f32"),
    ((2, 6, 8, 4, 2, 16), AttentionOptions(causal=True, causal_offset=2, dropout_prob=0.2,
                                           seed=3, scale=0.7), "same"),
]
IDS = ["plain", "causal-gqa", "causal-offset-window", "window-dead-rows-f32mask",
       "dropout-mqa-f32mask", "everything-same-dtype-mask"]


@pytest.mark.parametrize("dtype", ALL, ids=str)
@pytest.mark.parametrize("dims,opts,mkind", CASES, ids=IDS)
def test_forward_rounded_once(eng, rng, dtype, dims, opts, mkind):
    B, Sq, Sk, H, Hkv, D = dims
    q, k, v = make(rng, dtype, *dims)
    mask = make_mask(rng, mkind, dtype, B, H, Sq, Sk)
    out = poison(np.empty_like(q))
    lse = poison(np.empty((B, H, Sq), np.float32))
    eng.flash_attention_v2_with(q, k, v, out, opts, mask, lse=lse)
    want, want_lse = dense_attention(f64(q), f64(k), f64(v), **oracle_kw(q, k, opts, mask))
    assert_rounded_once(out, want, dtype, "out")
    dead = want_lse == -np.inf
    assert (lse[dead] == -np.inf).all() and np.isfinite(lse[~dead]).all()
    np.testing.assert_allclose(lse[~dead], want_lse[~dead], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("dtype", ALL, ids=str)
@pytest.mark.parametrize("dims,opts,mkind", CASES, ids=IDS)
def test_backward_rounded_once(eng, rng, dtype, dims, opts, mkind):
    B, Sq, Sk, H, Hkv, D = dims
    q, k, v = make(rng, dtype, *dims)
    mask = make_mask(rng, mkind, dtype, B, H, Sq, Sk)
    out = poison(np.empty_like(q))
    eng.flash_attention_v2_with(q, k, v, out, opts, mask)
    go = rng.standard_normal(q.shape).astype(dtype)
    grads = [poison(np.empty_like(a)) for a in (q, k, v)]
    eng.flash_attention_v2_backward_with(q, k, v, out, go, *grads, opts, mask)
    want = dense_grads_given_out(*(f64(a) for a in (q, k, v, out, go)),
                                 **oracle_kw(q, k, opts, mask))
    for name, g, w in zip(("grad_q", "grad_k", "grad_v"), grads, want):
        if dtype == FLOAT32 and name != "grad_q":
            # dK/dV read each row's [Delta, LSE] from the float32 stats buffer (SPEC), which is
            # more than one float32 rounding; for half outputs it stays far below one ulp.
            err = np.abs(g.astype(np.float64) - w).max() / np.abs(w).max()
            assert g.dtype == dtype and err < 1e-6, (name, err)
        elif name != "grad_q":
            # The same float32 stats in half precision: an error of a few 1e-7 of the largest
            # gradient, below one ulp of a normal half value but several ulps of a float16
            # subnormal one (|x| < 6e-5, spacing 6e-8) that cancellation left small.
            assert_rounded_once(g, w, dtype, name, noise_rel=2e-6)
        else:
            assert_rounded_once(g, w, dtype, name)


def test_given_out_oracle_agrees_with_helpers(rng):
    # The oracle above, fed the exact float64 out, is helpers.dense_attention_grads.
    q, k, v = make(rng, np.float64, 2, 5, 6, 4, 2, 8)
    go = rng.standard_normal(q.shape)
    kw = dict(causal=True, causal_offset=1, window=4, mask=None, keep=None, dropout_prob=0.0,
              scale=None)
    out, _ = dense_attention(q, k, v, causal=True, causal_offset=1, window=4)
    for a, b in zip(dense_grads_given_out(q, k, v, out, go, **kw),
                    dense_attention_grads(q, k, v, go, **kw)):
        assert rel_err(a, b) < 1e-12


# --- RoPE ---------------------------------------------------------------------------------------
def rope64(x, head_dim, pos, theta):
    """Rotate-half on `[tokens, heads, D]` (rank 3: seq is shape[1]) in float64 with the float32
    angles SPEC prescribes."""
    y = x.astype(np.float64).reshape(-1, x.shape[-2], head_dim)
    half = head_dim // 2
    seq = x.shape[1]
    t = (pos + np.arange(y.shape[0]) % seq).astype(np.float32)
    pw = np.array([np.float32(float(np.float32(theta)) ** float(np.float32(2 * i)
                                                                / np.float32(head_dim)))
                   for i in range(half)], np.float32)
    ang = (t[:, None] * (np.float32(1.0) / pw)[None, :]).astype(np.float64)[:, None, :]
    a, b = y[..., :half], y[..., half:]
    return np.concatenate([a * np.cos(ang) - b * np.sin(ang),
                           b * np.cos(ang) + a * np.sin(ang)], axis=-1).reshape(x.shape)


@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize("pos,theta", [(0, 10000.0), (7, 10000.0), (1000, 500000.0)])
def test_rope_half_rounded_once(eng, rng, dtype, pos, theta):
    x = (3 * rng.standard_normal((2, 5, 3, 32))).astype(dtype)
    want = rope64(x, 32, pos, theta)
    eng.rope_theta(x, 32, pos, theta)
    assert_rounded_once(x, want, dtype, "rope")


# --- lse ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ALL, ids=str)
def test_lse_dead_rows_are_minus_inf(eng, rng, dtype):
    # window 2 at offset 6 over 6 keys: row 0 (at 6) sees key 5; rows 1..3 (at 7..9) see none.
    opts = AttentionOptions(window=2, causal_offset=6)
    q, k, v = make(rng, dtype, 2, 4, 6, 2, 1, 8)
    out = poison(np.empty_like(q))
    lse = poison(np.empty((2, 2, 4), np.float32))
    eng.flash_attention_v2_with(q, k, v, out, opts, lse=lse)
    want, want_lse = dense_attention(f64(q), f64(k), f64(v), window=2, causal_offset=6)
    assert (want_lse[..., 1:] == -np.inf).all() and np.isfinite(want_lse[..., 0]).all()
    assert (lse[..., 1:] == -np.inf).all()
    np.testing.assert_allclose(lse[..., 0], want_lse[..., 0], rtol=1e-6)
    assert (out[:, 1:] == 0).all()
    assert_rounded_once(out, want, dtype, "out")


BWD_CASES = [(AttentionOptions(causal=True, causal_offset=3), None),
             (AttentionOptions(window=3, causal_offset=5, dropout_prob=0.3, seed=9), "f32")]


@pytest.mark.parametrize("opts,mkind", BWD_CASES, ids=["causal", "window-dead-dropout-mask"])
def test_backward_with_lse_equals_without(eng, rng, opts, mkind):
    B, Sq, Sk, H, Hkv, D = 2, 6, 7, 4, 2, 16
    q, k, v = make(rng, FLOAT32, B, Sq, Sk, H, Hkv, D)
    mask = make_mask(rng, mkind, FLOAT32, B, H, Sq, Sk)
    out = poison(np.empty_like(q))
    lse = poison(np.empty((B, H, Sq), np.float32))
    eng.flash_attention_v2_with(q, k, v, out, opts, mask, lse=lse)
    go = rng.standard_normal(q.shape).astype(np.float32)

    def grads(lse_in):
        g = [poison(np.empty_like(a)) for a in (q, k, v)]
        eng.flash_attention_v2_backward_with(q, k, v, out, go, *g, opts, mask, lse=lse_in)
        return g

    lse.flags.writeable = False  # an input of the backward: never written
    plain, given, wrong = grads(None), grads(lse), grads(lse + 1.0)
    for a, b in zip(plain, given):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6 * np.abs(a).max())
    assert max(rel_err(w, a) for w, a in zip(wrong, plain)) > 0.1  # lse is really used
    assert rel_err(wrong[2], plain[2] / np.e) < 1e-5  # P' = P / e: grad_v shrinks by e


# --- scale --------------------------------------------------------------------------------------
@pytest.mark.parametrize("scale", [0.9, 3, 1e-3, 0.1])
def test_scale_option(eng, rng, scale):
    B, Sq, Sk, H, Hkv, D = 2, 5, 6, 4, 2, 16
    q, k, v = make(rng, FLOAT32, B, Sq, Sk, H, Hkv, D)
    opts = AttentionOptions(causal=True, causal_offset=1, scale=scale)
    s32 = float(np.float32(scale))
    out, lse = poison(np.empty_like(q)), poison(np.empty((B, H, Sq), np.float32))
    eng.flash_attention_v2_with(q, k, v, out, opts, lse=lse)
    want, want_lse = dense_attention(q, k, v, causal=True, causal_offset=1, scale=s32)
    default, _ = dense_attention(q, k, v, causal=True, causal_offset=1)
    assert rel_err(out, want) < 1e-6 and rel_err(out, default) > 1e-2
    np.testing.assert_allclose(lse, want_lse, rtol=1e-6)
    go = rng.standard_normal(q.shape).astype(np.float32)
    g = [poison(np.empty_like(a)) for a in (q, k, v)]
    eng.flash_attention_v2_backward_with(q, k, v, out, go, *g, opts)
    wg = dense_attention_grads(q, k, v, go, causal=True, causal_offset=1, scale=s32)
    for got, w in zip(g, wg):
        assert rel_err(got, w) < 1e-5


def test_scale_none_is_inverse_sqrt_head_dim(eng, rng):
    q, k, v = make(rng, FLOAT32, 1, 4, 5, 2, 2, 32)
    outs = []
    for scale in (None, f32_scale(32)):
        outs.append(poison(np.empty_like(q)))
        eng.flash_attention_v2_with(q, k, v, outs[-1], AttentionOptions(scale=scale))
    assert outs[0].tobytes() == outs[1].tobytes()
    want, _ = dense_attention(q, k, v, scale=1 / np.sqrt(32))
    assert rel_err(outs[0], want) < 1e-6


# --- torch bf16 tensors through the engine ------------------------------------------------------
def test_engine_writes_into_torch_bf16(eng, rng):
    torch = pytest.importorskip("torch", reason="torch is not installed")
    q, k, v = make(rng, np.float32, 1, 4, 6, 2, 1, 8)
    tq, tk, tv = (torch.from_numpy(a).to(torch.bfloat16) for a in (q, k, v))
    out = torch.full((1, 4, 2, 8), float("nan"), dtype=torch.bfloat16)
    eng.flash_attention_v2_with(tq, tk, tv, out, AttentionOptions(causal=True))
    want, _ = dense_attention(*(t.float().numpy().astype(np.float64) for t in (tq, tk, tv)),
                              causal=True)
    got = out.view(torch.int16).numpy().view(BFLOAT16)
    assert_rounded_once(got, want, BFLOAT16, "out")
