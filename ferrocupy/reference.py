"""The NumPy reference backend: the four kernels, one function each, as the CUDA kernels run them.

Every function reads its sizes, flags, strides, scale and seed from the same packed struct the
CUDA kernel receives (`ferrocupy.params`), computes in float64 from inputs of any dtype (float32,
float16, bfloat16) and writes its outputs in place, rounded once to the output arrays' dtype.
They also run on float64 arrays when called directly (the tests use that for finite
differences); `ReferenceBackend.dtypes` is what the engine accepts.

Memory stays bounded: attention loops over (batch, head) and blocks of query rows, so no
temporary holds more than about `_CHUNK_ELEMS` float64 scores.

Where SPEC leaves non-finite inputs open, this is what the oracle does: an element a row cannot
see (not visible, or a score of exactly −inf, e.g. from a −inf mask entry) takes no part in that
row's sums, so NaN/inf garbage there (an unused KV-cache tail) never reaches the output or the
gradients; a NaN that a row does see propagates (NaN in q, a visible k or v, the mask, grad_out;
also a visible v whose dropout keep is 0, since 0 * NaN is NaN).
"""

from __future__ import annotations

import numpy as np

from .dtypes import ATTENTION_DTYPES
from .params import (EXTRAS_ALIBI, EXTRAS_ALIBI_PER_BATCH, EXTRAS_SINKS, ROPE_INTERLEAVED,
                     ROPE_INVERSE, ROPE_POSITIONS, contiguous_layout, contiguous_rope_layout,
                     seed_extras)

_CHUNK_ELEMS = 1 << 21  # scores per temporary: 16 MB of float64
_BLOCK_ROWS = 256  # query rows per block: small blocks let causal/window skip unseen keys

# Philox4x32-10 constants (Random123).
PHILOX_M0, PHILOX_M1 = 0xD2511F53, 0xCD9E8D57
PHILOX_W0, PHILOX_W1 = 0x9E3779B9, 0xBB67AE85
_U32 = np.uint64(0xFFFFFFFF)


# --- RoPE -----------------------------------------------------------------------------------------
def rope_inverse_frequencies(rotary_dim: int, theta) -> np.ndarray:
    """float32 `inv_i` for `i < rotary_dim/2`, bit for bit as SPEC "RoPE" forms them:
    `e = f32(2i)/f32(rotary_dim)`, `pw = f32(pow(f64(f32(theta)), f64(e)))`, `inv = 1/pw` (float32
    division). The CUDA backend uploads exactly these values for its kernel."""
    half = rotary_dim // 2
    e = np.arange(0, rotary_dim, 2, dtype=np.float32)[:half] / np.float32(rotary_dim)
    pw = np.power(np.float64(np.float32(theta)), e.astype(np.float64)).astype(np.float32)
    return np.float32(1.0) / pw


def rope_angles(t, head_dim: int, theta) -> np.ndarray:
    """float32 angles `[len(t), head_dim/2]` for positions `t` (any integers), bit for bit as the
    kernel forms them: `angle = f32(t) * inv_i` in float32 (Hugging Face's order), so angles near
    1e5 rad agree. `head_dim` is the rotated width (rotary_dim under partial rotary)."""
    inv = rope_inverse_frequencies(head_dim, theta)
    t32 = np.asarray(t, dtype=np.int64).astype(np.float32)
    return t32[:, None] * inv[None, :]


def rope(x, p, out=None, positions=None, layout=None) -> None:
    """RoPE (SPEC "RoPE") of `x` viewed as `[batch, seq_len, heads, head_dim]` through `layout`'s
    element strides (the packed RopeLayout; None: `x` C-contiguous), written into `out` viewed
    the same way (None: `x`, in place). `positions`: the int32/int64 array the struct's flags
    announce, `[seq_len]` or `[batch, seq_len]` (its batch stride is the layout's). Rotations in
    float64 from the float32 angles; each output rounded once to its dtype."""
    d, seq_len, heads = (int(p[f]) for f in ("head_dim", "seq_len", "heads"))
    if x.size == 0 or heads == 0 or d == 0 or seq_len == 0:
        return
    if layout is None:
        if not x.flags.c_contiguous:  # a reshape would copy and the rotation would be lost
            raise ValueError(f"rope needs C-contiguous data, got strides {x.strides}")
        layout = contiguous_rope_layout(p)
    out = x if out is None else out
    rd, flags = int(p["rotary_dim"]) or d, int(p["flags"])
    shape = (x.size // (seq_len * heads * d), seq_len, heads, d)
    xv, ov = (_strided(a, shape, [int(layout[f"{n}_{c}"]) for c in "bsh"] + [1])
              for a, n in ((x, "x"), (out, "out")))
    if flags & ROPE_POSITIONS:
        t = _strided(positions, shape[:2], (int(layout["positions_b"]), 1))
    else:
        t = np.broadcast_to(int(p["pos"]) + np.arange(seq_len, dtype=np.int64), shape[:2])
    # The pair (a, b) of frequency i: (x[2i], x[2i+1]) interleaved, else (x[i], x[i + rd/2]).
    first, second = ((slice(0, rd, 2), slice(1, rd, 2)) if flags & ROPE_INTERLEAVED
                     else (slice(0, rd // 2), slice(rd // 2, rd)))
    sign = -1.0 if flags & ROPE_INVERSE else 1.0
    step = max(1, _CHUNK_ELEMS // (heads * d))
    for b in range(shape[0]):
        for s0 in range(0, seq_len, step):
            rows = slice(s0, s0 + step)
            ang = rope_angles(t[b, rows], rd, p["theta"]).astype(np.float64)[:, None, :]
            cos, sin = np.cos(ang), sign * np.sin(ang)
            src, dst = xv[b, rows], ov[b, rows]
            x1, x2 = src[..., first].astype(np.float64), src[..., second].astype(np.float64)
            if out is not x:
                dst[..., rd:] = src[..., rd:]
            dst[..., first] = x1 * cos - x2 * sin
            dst[..., second] = x2 * cos + x1 * sin


def _strided(a, shape, strides):
    """The view of `a` with this shape and element strides, from its first element."""
    return np.lib.stride_tricks.as_strided(a, shape, tuple(s * a.itemsize for s in strides))


# --- Philox dropout -------------------------------------------------------------------------------
def philox4x32_10(counter, key):
    """Philox4x32-10 (Random123), vectorised: `counter` is 4 uint arrays (broadcast together),
    `key` 2 uints; returns the 4 output words as uint32 arrays."""
    c0, c1, c2, c3 = np.broadcast_arrays(*(np.asarray(c, dtype=np.uint64) & _U32
                                           for c in counter))
    k0, k1 = (np.uint64(int(k) & 0xFFFFFFFF) for k in key)
    m0, m1 = np.uint64(PHILOX_M0), np.uint64(PHILOX_M1)
    for r in range(10):
        if r:  # Random123 bumps the key before every round but the first
            k0 = (k0 + np.uint64(PHILOX_W0)) & _U32
            k1 = (k1 + np.uint64(PHILOX_W1)) & _U32
        p0 = m0 * c0  # 32x32 -> 64-bit products: the mulhilo
        p1 = m1 * c2
        c0, c1, c2, c3 = (p1 >> np.uint64(32)) ^ c1 ^ k0, p1 & _U32, \
            (p0 >> np.uint64(32)) ^ c3 ^ k1, p0 & _U32
    return tuple(c.astype(np.uint32) for c in (c0, c1, c2, c3))


def dropout_threshold(p) -> int:
    """`thr = uint32(float64(p_f32) * 2^32)`, truncated: a word below it drops the element."""
    return int(float(np.float32(p["dropout_prob"])) * 2.0**32)


def dropout_scale(p) -> np.float64:
    """`1/(1-p)` computed in float32, as the kernels do."""
    p32 = np.float32(p["dropout_prob"])
    return np.float64(np.float32(1.0) / (np.float32(1.0) - p32))


def dropout_keep(p, b: int, h: int, rows, cols) -> np.ndarray:
    """keep[b, h, rows, cols] as a bool `[len(rows), len(cols)]` array (SPEC "Dropout").

    Counter `(j >> 2, i, b*H + h, 0)`, key `(seed, 0)`, word `j & 3`; dropped iff word < thr.
    Usable by GPU tests with any packed struct holding `heads`, `seed`, `dropout_prob`."""
    rows = np.asarray(rows, dtype=np.int64)
    cols = np.asarray(cols, dtype=np.int64)
    thr = dropout_threshold(p)
    if thr == 0:
        return np.ones((rows.size, cols.size), dtype=bool)
    if rows.size == 0 or cols.size == 0:
        return np.ones((rows.size, cols.size), dtype=bool)
    g0 = int(cols.min()) >> 2  # one Philox call per group of 4 columns
    groups = np.arange(g0, (int(cols.max()) >> 2) + 1, dtype=np.int64)
    bh = b * int(p["heads"]) + h
    words = np.stack(philox4x32_10((groups[None, :], rows[:, None], bh, 0),
                                   (int(p["seed"]), 0)), axis=-1)  # [rows, groups, 4]
    return words[:, (cols >> 2) - g0, cols & 3] >= np.uint32(thr)


# --- the three shared attention pieces ------------------------------------------------------------
class _Fields:
    """One call's packed structs read as one: the seed's struct `p`, its `AttnExtras` (window
    sides, softcap, flags) and values that override both (a batch entry's under `kv_lens`:
    `kv_lens[b]` keys, rows `kv_lens[b] - seq_k` positions earlier)."""

    def __init__(self, p, extras, **over):
        self._p, self._extras, self._over = p, extras, over

    def __getitem__(self, name):
        if name in self._over:
            return self._over[name]
        if name in ATTN_EXTRAS_FIELDS:
            return self._extras[name]
        return self._p[name]

    def batch(self, kv_len: int) -> "_Fields":
        return _Fields(self._p, self._extras, seq_k=kv_len, causal_offset=int(
            self["causal_offset"]) + kv_len - int(self._p["seq_k"]))


ATTN_EXTRAS_FIELDS = ("window_left", "window_right", "softcap", "flags")


def _fields(p, extras=None) -> _Fields:
    """`p` with its extras (None: a seed call's, from `p`'s window word)."""
    if isinstance(p, _Fields):
        return p
    return _Fields(p, seed_extras(p) if extras is None else extras)


def visible(p, rows, cols, extras=None) -> np.ndarray:
    """Key `j` visible to row `i` (absolute position `a = i + causal_offset`) iff
    (not causal or j <= a) and a - window_left <= j <= a + window_right (a side of -1 is
    unbounded; a seed window w is w - 1 each side)."""
    p = _fields(p, extras)
    a = np.asarray(rows, dtype=np.int64)[:, None] + int(p["causal_offset"])
    j = np.asarray(cols, dtype=np.int64)[None, :]
    vis = np.ones((a.shape[0], j.shape[1]), dtype=bool)
    if int(p["causal"]):
        vis &= j <= a
    left, right = int(p["window_left"]), int(p["window_right"])
    if left >= 0:
        vis &= j >= a - left
    if right >= 0:
        vis &= j <= a + right
    return vis


def _limited(p) -> bool:
    """Whether some key can be invisible to some row by position (causal or a window)."""
    return bool(int(p["causal"])) or int(p["window_left"]) >= 0 or int(p["window_right"]) >= 0


def alibi_slope(p, alibi_slopes, b: int, h: int):
    """Head h's ALiBi slope in batch b as float64, or None when the call has none."""
    if alibi_slopes is None or not int(p["flags"]) & EXTRAS_ALIBI:
        return None
    flat = np.asarray(alibi_slopes).reshape(-1)
    return np.float64(flat[b * int(p["heads"]) + h if int(p["flags"]) & EXTRAS_ALIBI_PER_BATCH
                           else h])


def sink_logit(p, sinks, h: int):
    """Head h's sink logit as float64, or None when the call has none."""
    if sinks is None or not int(p["flags"]) & EXTRAS_SINKS:
        return None
    return np.float64(np.asarray(sinks)[h])


def mask_block(mask, p, b: int, h: int, rows, cols):
    """Additive mask `[len(rows), len(cols)]` in float64, gathered from the flat buffer with the
    struct's broadcast strides exactly as the kernel indexes it; None when there is no mask."""
    if mask is None or not int(p["has_mask"]):
        return None
    sb, sh, sq, sk = (int(p[f"mask_stride_{c}"]) for c in "bhqk")
    rows, cols = np.asarray(rows, dtype=np.int64), np.asarray(cols, dtype=np.int64)
    mask = np.asarray(mask)
    if rows.size == 0 or cols.size == 0:
        return np.zeros((rows.size, cols.size))
    size = mask.dtype.itemsize  # memory addressed through the struct's strides, as a kernel does
    m = np.lib.stride_tricks.as_strided(
        mask, shape=(b + 1, h + 1, int(rows.max()) + 1, int(cols.max()) + 1),
        strides=(sb * size, sh * size, sq * size, sk * size), writeable=False)
    return m[b, h][rows[:, None], cols[None, :]].astype(np.float64)


def _scores(qh, kh, p, mask, b, h, rows, cols, slope=None):
    """Scores `softcap(scale*q.k) - slope*|a - j| + mask` where visible, −inf elsewhere,
    `live = s != −inf`: the elements that take part (a −inf mask entry hides a key like the
    visibility rule; NaN is live so it propagates), and the softcap's derivative `1 − tanh²`
    (None without softcap), which the backward multiplies dS by."""
    s = (qh @ kh.T) * np.float64(np.float32(p["scale"]))
    cap, dcap = np.float64(np.float32(p["softcap"])), None
    if cap:
        t = np.tanh(s / cap)
        s, dcap = cap * t, 1.0 - t * t
    if slope is not None:
        a = np.asarray(rows, dtype=np.int64)[:, None] + int(p["causal_offset"])
        s -= slope * np.abs(a - np.asarray(cols, dtype=np.int64)[None, :])
    m = mask_block(mask, p, b, h, rows, cols)
    if m is not None:
        s += m
    if _limited(p):
        s[~visible(p, rows, cols)] = -np.inf
    return s, s != -np.inf, dcap


def _masked_matmul(a, b, live):
    """`a @ b` summing only the terms where `live`: a key (or query) an element does not see
    must not reach it, even when it holds inf/NaN (0 * NaN is NaN in a plain matmul), so e.g.
    garbage in an unused KV-cache tail stays out of the result."""
    a = np.where(live, a, 0.0)
    bad = ~np.isfinite(b).all(axis=1)
    if not bad.any():
        return a @ b
    out = a[:, ~bad] @ b[~bad]
    for j in np.flatnonzero(bad):  # rare: only rows of b with inf/NaN
        on = live[:, j]
        out[on] += a[on, j, None] * b[j]
    return out


def _softmax(s, sink=None):
    """Row softmax and LSE, with the sink logit (None: none) in each denominator: a row whose
    max (sink included) is −inf gets P = 0, LSE = −inf; a row that sees no key but has a sink
    gets P = 0, LSE = sink; NaN stays NaN."""
    mx = s.max(axis=1, initial=-np.inf)
    if sink is not None:
        mx = np.maximum(mx, sink)
    dead = mx == -np.inf
    shift = np.where(dead, 0.0, mx)
    e = np.exp(s - shift[:, None])
    total = e.sum(axis=1)
    if sink is not None:
        total = total + np.exp(sink - shift)
    prob = e / np.where(dead, 1.0, total)[:, None]
    lse = np.where(dead, -np.inf, mx + np.log(np.where(dead, 1.0, total)))
    return prob, lse


def _dropout_factor(p, b, h, rows, cols):
    """`keep / (1-p)` as float64 `[rows, cols]` (so `P' = P * factor`); None when dropout is off."""
    if dropout_threshold(p) == 0:
        return None
    return dropout_keep(p, b, h, rows, cols) * dropout_scale(p)


def _apply(a, factor):
    return a if factor is None else a * factor


def _dims(p):
    return tuple(int(p[f]) for f in ("batch", "heads", "kv_heads", "seq_q", "seq_k", "head_dim"))


def _blocks(p, seq_q: int, seq_k: int):
    """`(rows, cols, keys)` blocks covering every query row: `cols` (and the slice `keys`) is
    the range of keys some row of the block can see. Keys outside it are invisible to every row
    of the block, so leaving them out changes nothing (they never reach a row they do not see)."""
    step = max(1, min(_BLOCK_ROWS, _CHUNK_ELEMS // max(seq_k, 1)))
    off, left, right = (int(p[n]) for n in ("causal_offset", "window_left", "window_right"))
    for r0 in range(0, seq_q, step):
        r1 = min(r0 + step, seq_q)
        lo, hi = 0, seq_k
        if int(p["causal"]):
            hi = min(hi, r1 - 1 + off + 1)
        if left >= 0:
            lo = max(lo, r0 + off - left)
        if right >= 0:
            hi = min(hi, r1 - 1 + off + right + 1)
        hi = max(lo, hi)
        yield np.arange(r0, r1, dtype=np.int64), np.arange(lo, hi, dtype=np.int64), slice(lo, hi)


def _f64(a):
    return a.astype(np.float64)


# --- the three attention kernels ------------------------------------------------------------------
def _views(p, lay, **named):
    """The named buffers as rank-4 views through `lay` (None: C-contiguous)."""
    B, H, Hkv, Sq, Sk, D = _dims(p)
    if lay is None:
        lay = contiguous_layout(p)
    out = []
    for name, x in named.items():
        seq, heads = (Sk, Hkv) if name in ("k", "v", "grad_k", "grad_v") else (Sq, H)
        size = x.dtype.itemsize
        strides = tuple(int(lay[f"{name}_{c}"]) * size for c in "bsh") + (size,)
        out.append(np.lib.stride_tricks.as_strided(x, shape=(B, seq, heads, D), strides=strides))
    return out


def flash_attn_v2(q, k, v, out, mask, p, lse=None, kv_lens=None, layout=None,
                  alibi_slopes=None, sinks=None, extras=None) -> None:
    """Forward (SPEC "Attention forward"): writes `out` [B, Sq, H, D] and, when given, `lse`
    [B, H, Sq] (float32: each row's log-sum-exp, -inf for a row that sees no key). With
    `kv_lens` [B], batch b has kv_lens[b] keys (the rest are never read) and its rows sit
    kv_lens[b] - Sk positions earlier. `extras`: the AttnExtras struct (None: a seed call's),
    whose flags say whether `alibi_slopes` and `sinks` are read."""
    B, H, Hkv, Sq, Sk, D = _dims(p)
    p = _fields(p, extras)
    q4, o4, k4, v4 = _views(p, layout, q=q, out=out, k=k, v=v)
    group = H // Hkv
    with np.errstate(all="ignore"):  # inf/NaN are meant to flow through
        for b in range(B):
            pb = p if kv_lens is None else p.batch(int(kv_lens[b]))
            n_keys = Sk if kv_lens is None else int(kv_lens[b])
            for h in range(H):
                kh = _f64(k4[b, :n_keys, h // group])
                vh = _f64(v4[b, :n_keys, h // group])
                slope, sink = alibi_slope(p, alibi_slopes, b, h), sink_logit(p, sinks, h)
                for rows, cols, keys in _blocks(pb, Sq, n_keys):
                    s, live, _ = _scores(_f64(q4[b, rows, h]), kh[keys], pb, mask, b, h, rows,
                                         cols, slope)
                    prob, row_lse = _softmax(s, sink)
                    prob = _apply(prob, _dropout_factor(pb, b, h, rows, cols))
                    o4[b, rows, h] = _masked_matmul(prob, vh[keys], live)
                    if lse is not None:
                        lse.reshape(B, H, Sq)[b, h, rows] = row_lse


def flash_attn_v2_bw_dq(q, k, v, out, grad_out, grad_q, mask, stats, p, lse=None,
                        layout=None, alibi_slopes=None, sinks=None, grad_sinks=None,
                        extras=None) -> None:
    """Backward, first kernel: writes `stats` [B*H*Sq, 2] = [Delta, LSE] per row
    (row `(b*H + h)*Sq + i`), `grad_q` and, when given (with sinks), `grad_sinks` [H] =
    `-sum_{b,i} exp(sink_h - LSE) * Delta`. With `lse` [B, H, Sq] given (the forward's), P is
    `exp(s - lse)` and that LSE is what `stats` passes on, as the CUDA kernel does."""
    B, H, Hkv, Sq, Sk, D = _dims(p)
    p = _fields(p, extras)
    q4, o4, do4, dq4, k4, v4 = _views(p, layout, q=q, out=out, grad_out=grad_out,
                                      grad_q=grad_q, k=k, v=v)
    st = stats.reshape(B, H, Sq, 2)
    group, scale = H // Hkv, np.float64(np.float32(p["scale"]))
    d_sinks = np.zeros(H)
    with np.errstate(all="ignore"):
        for b in range(B):
            for h in range(H):
                kh, vh = _f64(k4[b, :, h // group]), _f64(v4[b, :, h // group])
                slope, sink = alibi_slope(p, alibi_slopes, b, h), sink_logit(p, sinks, h)
                for rows, cols, keys in _blocks(p, Sq, Sk):
                    do = _f64(do4[b, rows, h])
                    delta = np.einsum("rd,rd->r", do, _f64(o4[b, rows, h]))
                    s, live, dcap = _scores(_f64(q4[b, rows, h]), kh[keys], p, mask, b, h, rows,
                                            cols, slope)
                    if lse is None:
                        prob, row_lse = _softmax(s, sink)
                    else:
                        row_lse = _f64(lse.reshape(B, H, Sq)[b, h, rows])
                        live &= (row_lse != -np.inf)[:, None]
                        prob = np.where(live, np.exp(s - row_lse[:, None]), 0.0)
                    dprob = _apply(do @ vh[keys].T, _dropout_factor(p, b, h, rows, cols))
                    ds = _apply(prob * (dprob - delta[:, None]), dcap)
                    if sink is not None:
                        d_sinks[h] -= np.sum(np.exp(sink - row_lse) * delta)
                    st[b, h, rows, 0] = delta
                    st[b, h, rows, 1] = row_lse
                    dq4[b, rows, h] = scale * _masked_matmul(ds, kh[keys], live)
    if grad_sinks is not None:
        grad_sinks[...] = d_sinks


def flash_attn_v2_bw_dkdv(q, k, v, grad_out, grad_k, grad_v, mask, stats, p,
                          layout=None, alibi_slopes=None, extras=None) -> None:
    """Backward, second kernel: reads `stats`, recomputes `P = exp(s - LSE)` (0 where not
    visible or LSE = −inf; the LSE holds any sink) and writes `grad_k`, `grad_v` summed over
    each KV head's group."""
    B, H, Hkv, Sq, Sk, D = _dims(p)
    p = _fields(p, extras)
    q4, do4, k4, v4, dk4, dv4 = _views(p, layout, q=q, grad_out=grad_out, k=k, v=v,
                                       grad_k=grad_k, grad_v=grad_v)
    st = stats.reshape(B, H, Sq, 2)
    group, scale = H // Hkv, np.float64(np.float32(p["scale"]))
    with np.errstate(all="ignore"):
        for b in range(B):
            for hk in range(Hkv):
                kh, vh = _f64(k4[b, :, hk]), _f64(v4[b, :, hk])
                dk, dv = np.zeros((Sk, D)), np.zeros((Sk, D))
                for h in range(hk * group, (hk + 1) * group):
                    slope = alibi_slope(p, alibi_slopes, b, h)
                    for rows, cols, keys in _blocks(p, Sq, Sk):
                        qh, do = _f64(q4[b, rows, h]), _f64(do4[b, rows, h])
                        delta, lse = _f64(st[b, h, rows, 0]), _f64(st[b, h, rows, 1])
                        s, live, dcap = _scores(qh, kh[keys], p, mask, b, h, rows, cols, slope)
                        live &= (lse != -np.inf)[:, None]  # a dead row has P = 0
                        prob = np.where(live, np.exp(s - lse[:, None]), 0.0)
                        factor = _dropout_factor(p, b, h, rows, cols)
                        ds = _apply(prob * (_apply(do @ vh[keys].T, factor) - delta[:, None]),
                                    dcap)
                        dk[keys] += _masked_matmul(ds.T, qh, live.T)
                        dv[keys] += _masked_matmul(_apply(prob, factor).T, do, live.T)
                dk4[b, :, hk] = scale * dk
                dv4[b, :, hk] = dv


KERNELS = {"rope": rope, "flash_attn_v2": flash_attn_v2,
           "flash_attn_v2_bw_dq": flash_attn_v2_bw_dq,
           "flash_attn_v2_bw_dkdv": flash_attn_v2_bw_dkdv}


class ReferenceBackend:
    """Runs each operation on the host in NumPy; the oracle the CUDA kernels are tested against
    and the backend of a machine without a GPU. Same operations, same order of kernels, same
    packed bytes as the CUDA backend."""

    name = "reference"
    device = "cpu"
    xp = np
    dtypes = ATTENTION_DTYPES

    def empty(self, shape, dtype):
        return np.empty(shape, dtype=dtype)

    def zero(self, array) -> None:
        array.fill(0)

    # Kernels are looked up in KERNELS at each call, so a test can stand a wrong one in.
    def rope(self, x, params: np.void, *, out=None, positions=None,
             layout: np.void | None = None) -> None:
        """`x` rotated into `out` (None: in place); `layout`: both one's strides and positions'
        batch stride (None: C-contiguous)."""
        KERNELS["rope"](x, params, out=out, positions=positions, layout=layout)

    def forward(self, buffers: dict, params: np.void, layout: np.void | None = None,
                extras: np.void | None = None) -> None:
        """buffers: q, k, v, out, mask, lse, kv_lens, alibi_slopes, sinks (each optional one
        may be None or absent); `layout`: their strides (None: C-contiguous); `extras`: the
        AttnExtras struct (None: a seed call's)."""
        KERNELS["flash_attn_v2"](**buffers, p=params, layout=layout, extras=extras)

    def backward(self, buffers: dict, params: np.void, layout: np.void | None = None,
                 extras: np.void | None = None) -> None:
        """buffers: q, k, v, out, grad_out, grad_q, grad_k, grad_v, mask, lse (None: computed
        again), alibi_slopes, sinks, grad_sinks (each optional one may be None or absent). The
        dQ kernel writes each row's [Delta, LSE] for the dK/dV kernel."""
        b = buffers
        stats = np.empty((int(params["batch"]) * int(params["heads"]) * int(params["seq_q"]), 2),
                         np.float32)
        alibi = b.get("alibi_slopes")
        KERNELS["flash_attn_v2_bw_dq"](b["q"], b["k"], b["v"], b["out"], b["grad_out"],
                                       b["grad_q"], b["mask"], stats, params, lse=b["lse"],
                                       layout=layout, alibi_slopes=alibi, sinks=b.get("sinks"),
                                       grad_sinks=b.get("grad_sinks"), extras=extras)
        if int(params["seq_k"]):
            KERNELS["flash_attn_v2_bw_dkdv"](b["q"], b["k"], b["v"], b["grad_out"], b["grad_k"],
                                             b["grad_v"], b["mask"], stats, params, layout=layout,
                                             alibi_slopes=alibi, extras=extras)
