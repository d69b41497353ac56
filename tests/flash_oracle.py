"""flash-attn 2.x's semantics as a dense PyTorch computation, written from flash-attn's documented
rules (its docstrings and C++ front end), independently of ferrocupy: the oracle of
tests/test_flash_attn*.py. Whole score tensors, so small sizes only; float64 by default, any
dtype for the plain-PyTorch side of the half-precision rule (no upcast then).

- `attention(q, k, v, ...)` -> `(out [B,Sq,H,D], lse [B,H,Sq], P [B,H,Sq,Sk])`: bottom-right
  causal (row i at a = i + Sk - Sq), windows normalized as flash-attn does (a negative side, or
  one >= `seqlen_k`, is unbounded), softcap, ALiBi `-slope * |a - j|`, dropout through a given
  keep mask. Rows that see no key: out 0, lse +inf (flash-attn's value), P 0.
- `varlen(...)`, `kvcache(...)`: the same per sequence / per cache length.
- `rotary(x, cos, sin, positions, interleaved)`: flash-attn's rotary tables applied.
"""

from __future__ import annotations

import math

import numpy as np
import torch


def _sides(window, seqlen_k):
    return tuple(-1 if w < 0 or w >= seqlen_k else w for w in window)


def visible(sq: int, sk: int, causal: bool, window=(-1, -1), seqlen_k=None, device=None):
    """`[Sq, Sk]` bool, and the rows' positions a = i + Sk - Sq as `[Sq, 1]`."""
    left, right = _sides(window, sk if seqlen_k is None else seqlen_k)
    a = torch.arange(sq, device=device)[:, None] + (sk - sq)
    j = torch.arange(sk, device=device)[None, :]
    vis = torch.ones(sq, sk, dtype=torch.bool, device=device)
    if causal:
        vis &= j <= a
    if left >= 0:
        vis &= j >= a - left
    if right >= 0:
        vis &= j <= a + right
    return vis, a


def scale_of(d: int, softmax_scale=None) -> float:
    """The default scale as ferrocupy packs it (float32 1/sqrt(D)); flash-attn's is the same
    number rounded to float32 in its kernel."""
    if softmax_scale is not None:
        return float(softmax_scale)
    return float(np.float32(1.0) / np.sqrt(np.float32(d)))


def attention(q, k, v, *, causal=False, window=(-1, -1), softcap=0.0, alibi=None,
              softmax_scale=None, keep=None, dropout_p=0.0, seqlen_k=None,
              dtype=torch.float64):
    """See the module docstring. `keep`: bool `[B,H,Sq,Sk]` (dropout), `seqlen_k`: the key count
    flash-attn normalizes windows by (default Sk). Differentiable in q, k, v."""
    q, k, v = (x.to(dtype) for x in (q, k, v))
    b, sq, h, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    kh = k.repeat_interleave(h // hkv, dim=2)
    vh = v.repeat_interleave(h // hkv, dim=2)
    s = torch.einsum("bihd,bjhd->bhij", q, kh) * scale_of(d, softmax_scale)
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    vis, a = visible(sq, sk, causal, window, seqlen_k, q.device)
    if alibi is not None:
        slopes = (alibi if alibi.dim() == 2 else alibi[None].expand(b, h)).to(q.device, dtype)
        s = s - slopes[:, :, None, None] * (a - torch.arange(sk, device=q.device)).abs().to(dtype)
    s = s.masked_fill(~vis, -math.inf)
    dead = ~vis.any(-1)[:, None]                                          # [Sq, 1]
    lse = torch.logsumexp(s.masked_fill(dead, 0.0), -1).masked_fill(dead[:, 0], math.inf)
    p = torch.softmax(s.masked_fill(dead, 0.0), -1).masked_fill(dead, 0.0)
    pd = p
    if keep is not None:
        factor = float(np.float32(1) / (np.float32(1) - np.float32(dropout_p)))
        pd = p * keep.to(q.device, dtype) * factor
    out = torch.einsum("bhij,bjhd->bihd", pd, vh)
    return out, lse, p


def varlen(q, k, v, cu_q, cu_k, max_k, *, alibi=None, keep=None, **kw):
    """Packed sequences: `(out [total_q,H,D], lse [H,total_q], [P_n [H,Sq_n,Sk_n]])`; windows
    normalized by `max_k`; `alibi` `[H]` or `[N, H]`; `keep[n]` `[H, Sq_n, Sk_n]`."""
    outs, lses, probs = [], [], []
    for n in range(len(cu_q) - 1):
        qn = q[cu_q[n]:cu_q[n + 1]][None]
        kn, vn = k[cu_k[n]:cu_k[n + 1]][None], v[cu_k[n]:cu_k[n + 1]][None]
        slopes = None if alibi is None else (alibi[n] if alibi.dim() == 2 else alibi)
        o, lse, p = attention(qn, kn, vn, alibi=slopes, seqlen_k=max_k,
                              keep=None if keep is None else keep[n][None], **kw)
        outs.append(o[0])
        lses.append(lse[0])
        probs.append(p[0])
    return torch.cat(outs), torch.cat(lses, dim=-1), probs


def kvcache(q, k_cache, v_cache, lens, *, alibi=None, **kw):
    """q over the first `lens[b]` keys of each batch's (contiguous) cache, bottom-right per
    length; windows normalized by the cache's capacity. Returns (out, lse)."""
    outs, lses = [], []
    for b in range(q.shape[0]):
        n = int(lens[b])
        slopes = None if alibi is None else (alibi[b] if alibi.dim() == 2 else alibi)
        o, lse, _ = attention(q[b:b + 1], k_cache[b:b + 1, :n], v_cache[b:b + 1, :n],
                              alibi=slopes, seqlen_k=k_cache.shape[1], **kw)
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


def rotary(x, cos, sin, positions, interleaved: bool):
    """flash-attn's rotary embedding of x `[B, S, H, D]` at integer `positions` `[B, S]`, from
    tables `cos`, `sin` `[S_ro, rotary_dim / 2]`; features past rotary_dim pass through."""
    rd = 2 * cos.shape[1]
    c = cos.to(torch.float64)[positions][:, :, None]                      # [B, S, 1, rd/2]
    s = sin.to(torch.float64)[positions][:, :, None]
    x = x.to(torch.float64)
    if interleaved:
        x1, x2 = x[..., 0:rd:2], x[..., 1:rd:2]
        rot = torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2)
    else:
        x1, x2 = x[..., :rd // 2], x[..., rd // 2:rd]
        rot = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    return torch.cat((rot, x[..., rd:]), dim=-1)


def append(q, k_cache, v_cache, k_new, v_new, lens, *, cos=None, sin=None, interleaved=False,
           causal=False, window=(-1, -1)):
    """flash_attn_with_kvcache's appending in float64: (q, k_cache, v_cache) after it, with the
    new keys (rotated at cache_seqlens[b] + i when tables are given) at cache_seqlens[b] ..< +Sn,
    and q rotated at cache_seqlens[b] + i when causal or windowed (the window normalized by the
    capacity), else at cache_seqlens[b]."""
    b, sn = k_new.shape[:2]
    q, k_new = q.double(), k_new.double()
    if cos is not None:
        pos = lens[:, None].long() + torch.arange(sn)[None]
        # windowed as flash-attn's C++ front end decides it: after normalizing the window by
        # the cache's capacity (a side >= it is unbounded), so (2, 3) over 2 slots is not local
        local = causal or _sides(window, k_cache.shape[1]) != (-1, -1)
        k_new = rotary(k_new, cos, sin, pos, interleaved)
        q = rotary(q, cos, sin, pos if local else lens[:, None].long().expand(b, q.shape[1]),
                   interleaved)
    k_cache, v_cache = k_cache.double().clone(), v_cache.double().clone()
    for i in range(b):
        k_cache[i, lens[i]:lens[i] + sn] = k_new[i]
        v_cache[i, lens[i]:lens[i] + sn] = v_new[i].double()
    return q, k_cache, v_cache
