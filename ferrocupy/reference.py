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
from .params import (EXTRAS_ALIBI, EXTRAS_ALIBI_PER_BATCH, EXTRAS_APPEND, EXTRAS_PAGED,
                     EXTRAS_ROTARY, EXTRAS_ROTARY_INTERLEAVED, EXTRAS_SINKS, EXTRAS_VARLEN,
                     ROPE_INTERLEAVED,
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
    `key` 2 uints; returns the 4 output words as uint32 arrays of the broadcast shape (uint32
    scalars where every counter word is a scalar).

    The rounds run on `_PHILOX_CHUNK` counters at a time, in place on uint64 buffers that stay in
    cache (5x faster than whole-array temporaries at a test's 12M counters)."""
    shape = np.broadcast_shapes(*(np.shape(c) for c in counter))
    # each counter word as uint32 (its low 32 bits), broadcast and flattened: the one copy of
    # every counter; the rounds widen a chunk at a time
    words = [np.broadcast_to((np.asarray(c, dtype=np.uint64) & _U32).astype(np.uint32),
                             shape).reshape(-1) for c in counter]
    k0, k1 = (int(k) & 0xFFFFFFFF for k in key)
    # Random123 bumps the key before every round but the first
    keys = [(np.uint64((k0 + r * PHILOX_W0) & 0xFFFFFFFF),
             np.uint64((k1 + r * PHILOX_W1) & 0xFFFFFFFF)) for r in range(10)]
    n = words[0].size
    outs = [np.empty(n, np.uint32) for _ in range(4)]
    work = [np.empty(min(n, _PHILOX_CHUNK), np.uint64) for _ in range(6)]
    for s in range(0, n, _PHILOX_CHUNK):
        e = min(n, s + _PHILOX_CHUNK)
        c0, c1, c2, c3, p0, p1 = (w[:e - s] for w in work)
        for c, src in zip((c0, c1, c2, c3), words):
            c[...] = src[s:e]
        for ka, kb in keys:
            np.multiply(c0, _PHILOX_M0, out=p0)  # 32x32 -> 64-bit products: the mulhilo
            np.multiply(c2, _PHILOX_M1, out=p1)
            # (c0, c1, c2, c3) <- (hi(p1) ^ c1 ^ ka, lo(p1), hi(p0) ^ c3 ^ kb, lo(p0)): each old
            # word is read before it is overwritten
            np.right_shift(p1, _SHIFT32, out=c0)
            c0 ^= c1
            c0 ^= ka
            np.bitwise_and(p1, _U32, out=c1)
            np.right_shift(p0, _SHIFT32, out=c2)
            c2 ^= c3
            c2 ^= kb
            np.bitwise_and(p0, _U32, out=c3)
        for o, c in zip(outs, (c0, c1, c2, c3)):
            o[s:e] = c
    return tuple(o.reshape(shape)[()] if shape == () else o.reshape(shape) for o in outs)


_PHILOX_CHUNK = 1 << 16  # counters per round pass: 6 uint64 buffers of 512 KB (in L2)
_PHILOX_M0, _PHILOX_M1, _SHIFT32 = np.uint64(PHILOX_M0), np.uint64(PHILOX_M1), np.uint64(32)


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

    def replaced(self, **over) -> "_Fields":
        return _Fields(self._p, self._extras, **(self._over | over))

    def batch(self, kv_len: int) -> "_Fields":
        return self.replaced(seq_k=kv_len, causal_offset=int(self["causal_offset"]) + kv_len
                             - int(self._p["seq_k"]))


ATTN_EXTRAS_FIELDS = ("window_left", "window_right", "softcap", "flags", "page_size",
                      "new_keys", "rotary_dim")


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


# --- batch entries: dense batches, packed sequences (varlen), paged caches -----------------------
class _Entry:
    """One batch entry of a call (a sequence of a varlen call): `b`, its index for dropout's
    counter and ALiBi's `[batch, heads]` slopes; `p`, the call's fields with this entry's
    `seq_q`, `seq_k` and row positions; where its query rows and keys lie in the rank-4 views
    (`rows`, `keys`), and its `[heads, rows]` part of a per-row `[B', heads, S']` array
    (`per_row`)."""

    def __init__(self, b, p, at, rows, keys, pages=None, page_size=0):
        self.b, self.p, self._at, self._rows, self._keys = b, p, at, rows, keys
        self._pages, self._page_size = pages, page_size

    def rows(self, x4):
        return x4[self._at, self._rows]

    def per_row(self, x3):
        return x3[self._at, :, self._rows]

    def keys(self, x4):
        """This entry's keys `[seq_k, heads, head_dim]`: a view, or (paged) gathered from the
        blocks the entry reaches, no other block read."""
        if self._pages is None:
            return x4[self._at, self._keys]
        n = self._keys.stop
        blocks = self._pages[:-(-n // self._page_size)] if n else self._pages[:0]
        return x4[np.asarray(blocks, np.int64)].reshape((-1,) + x4.shape[2:])[:n]


class _Frame:
    """How a call's buffers are laid out: the rank-4 view shapes (q-shaped `[qb, qs, H, D]`,
    k-shaped `[kb, ks, Hkv, D]`) and the batch entries. Dense: `[B, Sq]` and `[B, Sk]`;
    varlen: `[1, total_q]` and `[1, total_k]`; paged: k-shaped `[num_blocks, page_size]`."""

    def __init__(self, p, q, k, cu_seqlens_q=None, cu_seqlens_k=None, block_table=None,
                 kv_lens=None):
        B, _, _, Sq, Sk, _ = _dims(p)
        flags = int(p["flags"])
        self.p, self.varlen = p, bool(flags & EXTRAS_VARLEN)
        self.page_size = int(p["page_size"]) if flags & EXTRAS_PAGED else 0
        self.new_keys = int(p["new_keys"]) if flags & EXTRAS_APPEND else 0
        self.cu_q, self.cu_k = cu_seqlens_q, cu_seqlens_k
        self.block_table, self.kv_lens = block_table, kv_lens
        if self.varlen:
            self.q_shape, self.k_shape = (1, int(q.shape[0])), (1, int(k.shape[0]))
        elif self.page_size:
            self.q_shape, self.k_shape = (B, Sq), (int(k.shape[0]), self.page_size)
        else:
            self.q_shape, self.k_shape = (B, Sq), (B, Sk)

    def views(self, lay, **named):
        """The named buffers as rank-4 views through `lay` (None: C-contiguous)."""
        _, H, Hkv, _, _, D = _dims(self.p)
        if lay is None:
            lay = contiguous_layout(self.p)
        out = []
        for name, x in named.items():
            (nb, seq), heads = ((self.k_shape, Hkv) if name in ("k", "v", "grad_k", "grad_v")
                                else (self.q_shape, H))
            size = x.dtype.itemsize
            strides = tuple(int(lay[f"{name}_{c}"]) * size for c in "bsh") + (size,)
            out.append(np.lib.stride_tricks.as_strided(x, shape=(nb, seq, heads, D),
                                                       strides=strides))
        return out

    def per_row(self, x, width=None):
        """A per-row buffer (`lse`: `[B, H, Sq]`, varlen `[H, total_q]`; `width`: a trailing
        dimension, the backward's stats) as `[B', H, S'(, width)]`."""
        H = int(self.p["heads"])
        shape = (self.q_shape[0], H, self.q_shape[1]) + (() if width is None else (width,))
        return x.reshape(shape)

    def entries(self):
        p = self.p
        B, _, _, Sq, Sk, _ = _dims(p)
        if self.varlen:
            off = int(p["causal_offset"])
            for n in range(B):
                r0, r1 = int(self.cu_q[n]), int(self.cu_q[n + 1])
                k0, k1 = int(self.cu_k[n]), int(self.cu_k[n + 1])
                # SPEC varlen: sequence n right-aligned in the [max_seqlen_q, max_seqlen_k] frame
                pn = p.replaced(seq_q=r1 - r0, seq_k=k1 - k0,
                                causal_offset=off + (k1 - k0 - Sk) - (r1 - r0 - Sq))
                yield _Entry(n, pn, 0, slice(r0, r1), slice(k0, k1))
            return
        for b in range(B):
            n_keys = Sk if self.kv_lens is None else int(self.kv_lens[b]) + self.new_keys
            pb = p if self.kv_lens is None else p.batch(n_keys)
            pages = None if not self.page_size else self.block_table[b]
            yield _Entry(b, pb, b, slice(0, Sq), slice(0, n_keys), pages, self.page_size)


# --- the KV-cache append and its RoPE -----------------------------------------------------------
def rotate_with_tables(x, cos, sin, positions, interleaved: bool):
    """RoPE of `x` `[n, heads, head_dim]` (float64) with token t at `positions[t]`, from tables
    `cos`, `sin` `[seqlen_ro, rotary_dim / 2]` (flash-attn's `rotary_cos`/`rotary_sin`): each
    pair (a, b) of frequency i (rotate-half `(x[i], x[i + r/2])`, or interleaved `(x[2i],
    x[2i+1])`) becomes `(a cos - b sin, b cos + a sin)`; features past rotary_dim pass."""
    positions = np.asarray(positions, np.int64)
    c = _f64(np.asarray(cos)[positions])[:, None, :]
    s = _f64(np.asarray(sin)[positions])[:, None, :]
    rd = 2 * c.shape[-1]
    first, second = ((slice(0, rd, 2), slice(1, rd, 2)) if interleaved
                     else (slice(0, rd // 2), slice(rd // 2, rd)))
    out = np.array(x, dtype=np.float64)
    a, b = x[..., first], x[..., second]
    out[..., first] = a * c - b * s
    out[..., second] = b * c + a * s
    return out


def _rotary(p):
    """(interleaved,) of a call whose append rotates, or None."""
    flags = int(p["flags"])
    return None if not flags & EXTRAS_ROTARY else bool(flags & EXTRAS_ROTARY_INTERLEAVED)


def append_kv(k, v, k_new, v_new, kv_lens, p, layout=None, extras=None, block_table=None,
              rotary_cos=None, rotary_sin=None) -> None:
    """SPEC "Appending to a KV cache": batch b's `k_new[b]`, `v_new[b]` `[new_keys, kv_heads,
    head_dim]` are written into the cache (`k`, `v`: `[B, Sk, ...]`, or paged `[num_blocks,
    page_size, ...]` through `block_table`) at positions `kv_lens[b] ..< kv_lens[b] +
    new_keys`, k_new rotated first (at those positions) when the call has RoPE tables."""
    p = _fields(p, extras)
    frame = _Frame(p, k_new, k, block_table=block_table)
    k4, v4 = frame.views(layout, k=k, v=v)
    interleaved = _rotary(p)
    n = int(k_new.shape[1])
    for b in range(int(p["batch"])):
        pos = int(kv_lens[b]) + np.arange(n, dtype=np.int64)
        kb = _f64(k_new[b])
        if interleaved is not None:
            kb = rotate_with_tables(kb, rotary_cos, rotary_sin, pos, interleaved)
        if frame.page_size:
            at = (np.asarray(block_table[b], np.int64)[pos // frame.page_size],
                  pos % frame.page_size)
        else:
            at = (b, pos)
        k4[at] = kb
        v4[at] = v_new[b]


def _query_rows(e, q4, p, rotary_cos, rotary_sin):
    """Entry `e`'s query rows `[rows, heads, head_dim]` in float64: rotated, when the call's
    append has RoPE, at `kv_lens[b] + i` (causal or windowed) or `kv_lens[b]` (flash-attn's
    rule) and rounded to q's dtype, as a rotated q stored first would be."""
    rows = e.rows(q4)
    interleaved = _rotary(p)
    if interleaved is None:
        return _f64(rows)
    start = int(e.p["seq_k"]) - int(p["new_keys"])  # kv_lens[b]
    i = np.arange(rows.shape[0], dtype=np.int64)
    pos = start + (i if _limited(p) else 0 * i)
    rotated = rotate_with_tables(_f64(rows), rotary_cos, rotary_sin, pos, interleaved)
    return _f64(rotated.astype(rows.dtype))


# --- the three attention kernels ------------------------------------------------------------------
def flash_attn_v2(q, k, v, out, mask, p, lse=None, kv_lens=None, layout=None,
                  alibi_slopes=None, sinks=None, extras=None, cu_seqlens_q=None,
                  cu_seqlens_k=None, block_table=None, rotary_cos=None,
                  rotary_sin=None) -> None:
    """Forward (SPEC "Attention forward"): writes `out` [B, Sq, H, D] and, when given, `lse`
    [B, H, Sq] (float32: each row's log-sum-exp, -inf for a row that sees no key). With
    `kv_lens` [B], batch b has kv_lens[b] keys (the rest are never read) and its rows sit
    kv_lens[b] - Sk positions earlier. `extras`: the AttnExtras struct (None: a seed call's),
    whose flags say whether `alibi_slopes` and `sinks` are read, and whether the call is
    varlen (`q`, `out` `[total_q, H, D]`, `lse` `[H, total_q]`, `k`, `v` `[total_k, Hkv, D]`,
    split by `cu_seqlens_q`/`cu_seqlens_k`), paged (`k`, `v` blocks read through
    `block_table`) or the attention of an append (kv_lens[b] + new_keys keys; q rotated by
    `rotary_cos`/`rotary_sin` when the flags say so)."""
    B, H, Hkv, Sq, Sk, D = _dims(p)
    p = _fields(p, extras)
    frame = _Frame(p, q, k, cu_seqlens_q, cu_seqlens_k, block_table, kv_lens)
    q4, o4, k4, v4 = frame.views(layout, q=q, out=out, k=k, v=v)
    lse3 = None if lse is None else frame.per_row(lse)
    group = H // Hkv
    with np.errstate(all="ignore"):  # inf/NaN are meant to flow through
        for e in frame.entries():
            pb, b = e.p, e.b
            sq, n_keys = int(pb["seq_q"]), int(pb["seq_k"])
            qb, kb, vb = _query_rows(e, q4, p, rotary_cos, rotary_sin), e.keys(k4), e.keys(v4)
            ob = e.rows(o4)
            for h in range(H):
                kh, vh = _f64(kb[:, h // group]), _f64(vb[:, h // group])
                slope, sink = alibi_slope(p, alibi_slopes, b, h), sink_logit(p, sinks, h)
                for rows, cols, keys in _blocks(pb, sq, n_keys):
                    s, live, _ = _scores(qb[rows, h], kh[keys], pb, mask, b, h, rows, cols,
                                         slope)
                    prob, row_lse = _softmax(s, sink)
                    prob = _apply(prob, _dropout_factor(pb, b, h, rows, cols))
                    ob[rows, h] = _masked_matmul(prob, vh[keys], live)
                    if lse3 is not None:
                        e.per_row(lse3)[h, rows] = row_lse


def flash_attn_v2_bw_dq(q, k, v, out, grad_out, grad_q, mask, stats, p, lse=None,
                        layout=None, alibi_slopes=None, sinks=None, grad_sinks=None,
                        extras=None, cu_seqlens_q=None, cu_seqlens_k=None) -> None:
    """Backward, first kernel: writes `stats` [B*H*Sq, 2] = [Delta, LSE] per row
    (row `(b*H + h)*Sq + i`; varlen: [H*total_q, 2], row `h*total_q + r`), `grad_q` and, when
    given (with sinks), `grad_sinks` [H] = `-sum_{b,i} exp(sink_h - LSE) * Delta`. With `lse`
    [B, H, Sq] (varlen [H, total_q]) given (the forward's), P is `exp(s - lse)` and that LSE
    is what `stats` passes on, as the CUDA kernel does."""
    B, H, Hkv, Sq, Sk, D = _dims(p)
    p = _fields(p, extras)
    frame = _Frame(p, q, k, cu_seqlens_q, cu_seqlens_k)
    q4, o4, do4, dq4, k4, v4 = frame.views(layout, q=q, out=out, grad_out=grad_out,
                                           grad_q=grad_q, k=k, v=v)
    st = frame.per_row(stats, 2)
    lse3 = None if lse is None else frame.per_row(lse)
    group, scale = H // Hkv, np.float64(np.float32(p["scale"]))
    d_sinks = np.zeros(H)
    with np.errstate(all="ignore"):
        for e in frame.entries():
            pb, b = e.p, e.b
            sq, sk = int(pb["seq_q"]), int(pb["seq_k"])
            qb, kb, vb, ob, dob = (e.rows(q4), e.keys(k4), e.keys(v4), e.rows(o4), e.rows(do4))
            dqb, stb = e.rows(dq4), e.per_row(st)
            for h in range(H):
                kh, vh = _f64(kb[:, h // group]), _f64(vb[:, h // group])
                slope, sink = alibi_slope(p, alibi_slopes, b, h), sink_logit(p, sinks, h)
                for rows, cols, keys in _blocks(pb, sq, sk):
                    do = _f64(dob[rows, h])
                    delta = np.einsum("rd,rd->r", do, _f64(ob[rows, h]))
                    s, live, dcap = _scores(_f64(qb[rows, h]), kh[keys], pb, mask, b, h, rows,
                                            cols, slope)
                    if lse3 is None:
                        prob, row_lse = _softmax(s, sink)
                    else:
                        row_lse = _f64(e.per_row(lse3)[h, rows])
                        live &= (row_lse != -np.inf)[:, None]
                        prob = np.where(live, np.exp(s - row_lse[:, None]), 0.0)
                    dprob = _apply(do @ vh[keys].T, _dropout_factor(pb, b, h, rows, cols))
                    ds = _apply(prob * (dprob - delta[:, None]), dcap)
                    if sink is not None:
                        # A row with LSE -inf (no key, sink -inf) has no sink share: 0, not NaN.
                        share = np.where(row_lse == -np.inf, 0.0, np.exp(sink - row_lse))
                        d_sinks[h] -= np.sum(share * delta)
                    stb[h, rows, 0] = delta
                    stb[h, rows, 1] = row_lse
                    dqb[rows, h] = scale * _masked_matmul(ds, kh[keys], live)
    if grad_sinks is not None:
        grad_sinks[...] = d_sinks


def flash_attn_v2_bw_dkdv(q, k, v, grad_out, grad_k, grad_v, mask, stats, p,
                          layout=None, alibi_slopes=None, extras=None, cu_seqlens_q=None,
                          cu_seqlens_k=None) -> None:
    """Backward, second kernel: reads `stats`, recomputes `P = exp(s - LSE)` (0 where not
    visible or LSE = −inf; the LSE holds any sink) and writes `grad_k`, `grad_v` summed over
    each KV head's group (varlen: each sequence's keys from its own rows)."""
    B, H, Hkv, Sq, Sk, D = _dims(p)
    p = _fields(p, extras)
    frame = _Frame(p, q, k, cu_seqlens_q, cu_seqlens_k)
    q4, do4, k4, v4, dk4, dv4 = frame.views(layout, q=q, grad_out=grad_out, k=k, v=v,
                                            grad_k=grad_k, grad_v=grad_v)
    st = frame.per_row(stats, 2)
    group, scale = H // Hkv, np.float64(np.float32(p["scale"]))
    with np.errstate(all="ignore"):
        for e in frame.entries():
            pb, b = e.p, e.b
            sq, sk = int(pb["seq_q"]), int(pb["seq_k"])
            qb, dob, kb, vb, stb = e.rows(q4), e.rows(do4), e.keys(k4), e.keys(v4), e.per_row(st)
            dkb, dvb = e.keys(dk4), e.keys(dv4)
            for hk in range(Hkv):
                kh, vh = _f64(kb[:, hk]), _f64(vb[:, hk])
                dk, dv = np.zeros((sk, D)), np.zeros((sk, D))
                for h in range(hk * group, (hk + 1) * group):
                    slope = alibi_slope(p, alibi_slopes, b, h)
                    for rows, cols, keys in _blocks(pb, sq, sk):
                        qh, do = _f64(qb[rows, h]), _f64(dob[rows, h])
                        delta, lse = _f64(stb[h, rows, 0]), _f64(stb[h, rows, 1])
                        s, live, dcap = _scores(qh, kh[keys], pb, mask, b, h, rows, cols, slope)
                        live &= (lse != -np.inf)[:, None]  # a dead row has P = 0
                        prob = np.where(live, np.exp(s - lse[:, None]), 0.0)
                        factor = _dropout_factor(pb, b, h, rows, cols)
                        ds = _apply(prob * (_apply(do @ vh[keys].T, factor) - delta[:, None]),
                                    dcap)
                        dk[keys] += _masked_matmul(ds.T, qh, live.T)
                        dv[keys] += _masked_matmul(_apply(prob, factor).T, do, live.T)
                dkb[:, hk] = scale * dk
                dvb[:, hk] = dv


KERNELS = {"rope": rope, "flash_attn_v2": flash_attn_v2, "append_kv": append_kv,
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
        """buffers: q, k, v, out, mask, lse, kv_lens, alibi_slopes, sinks, cu_seqlens_q,
        cu_seqlens_k, block_table, k_new, v_new, rotary_cos, rotary_sin (each optional one may
        be None or absent); `layout`: their strides (None: C-contiguous); `extras`: the
        AttnExtras struct (None: a seed call's). With k_new, the append runs first."""
        b = dict(buffers)
        k_new, v_new = b.pop("k_new", None), b.pop("v_new", None)
        if k_new is not None:
            KERNELS["append_kv"](b["k"], b["v"], k_new, v_new, b["kv_lens"], params, layout,
                                 extras, block_table=b.get("block_table"),
                                 rotary_cos=b.get("rotary_cos"), rotary_sin=b.get("rotary_sin"))
        KERNELS["flash_attn_v2"](**b, p=params, layout=layout, extras=extras)

    def backward(self, buffers: dict, params: np.void, layout: np.void | None = None,
                 extras: np.void | None = None) -> None:
        """buffers: q, k, v, out, grad_out, grad_q, grad_k, grad_v, mask, lse (None: computed
        again), alibi_slopes, sinks, grad_sinks, cu_seqlens_q, cu_seqlens_k (each optional one
        may be None or absent). The dQ kernel writes each row's [Delta, LSE] for the dK/dV
        kernel."""
        b = buffers
        varlen = {n: b.get(n) for n in ("cu_seqlens_q", "cu_seqlens_k")}
        heads = int(params["heads"])
        rows = (int(b["q"].shape[0]) if varlen["cu_seqlens_q"] is not None
                else int(params["batch"]) * int(params["seq_q"]))
        stats = np.empty((rows * heads, 2), np.float32)
        alibi = b.get("alibi_slopes")
        KERNELS["flash_attn_v2_bw_dq"](b["q"], b["k"], b["v"], b["out"], b["grad_out"],
                                       b["grad_q"], b["mask"], stats, params, lse=b["lse"],
                                       layout=layout, alibi_slopes=alibi, sinks=b.get("sinks"),
                                       grad_sinks=b.get("grad_sinks"), extras=extras, **varlen)
        if int(params["seq_k"]):
            KERNELS["flash_attn_v2_bw_dkdv"](b["q"], b["k"], b["v"], b["grad_out"], b["grad_k"],
                                             b["grad_v"], b["mask"], stats, params, layout=layout,
                                             alibi_slopes=alibi, extras=extras, **varlen)
