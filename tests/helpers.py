"""Shared test helpers (CPU and GPU tests import these: `from helpers import ...`).

- `requires_gpu`: the `gpu` marker; conftest skips marked tests when no CUDA GPU is usable.
- `poison(a)`: fill with NaN in place, so an element a kernel forgot to write fails the check.
- `rel_err(out, ref)`: ||out - ref|| / ||ref|| in float64; any NaN/inf mismatch gives inf.
- `dense_attention(...)`, `dense_attention_grads(...)`: direct-formula oracles, written
  independently of `ferrocupy.reference` (whole 4-D arrays, explicit visibility loops).
- `make_qkv`, `attention_params`, `forward`, `backward`: call the reference kernels directly
  (any float dtype, float64 for finite differences) with the engine's packed structs.
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from ferrocupy import AttentionDims, AttentionOptions
from ferrocupy import reference as ref

requires_gpu = pytest.mark.gpu


_NAN_BITS = {"float16": 0x7E00, "bfloat16": 0x7FC0}  # a quiet NaN's 16-bit pattern


def poison(a: np.ndarray) -> np.ndarray:
    """Fill `a` (NumPy or CuPy) with NaN in place and return it. Half dtypes are filled through
    their 16-bit pattern, which needs no float conversion of the array library."""
    bits = _NAN_BITS.get(str(a.dtype))
    if bits is not None:
        a.view(np.uint16).fill(bits)
    else:
        a[...] = np.nan
    return a


def rel_err(out, ref_) -> float:
    """Relative L2 error in float64; inf when either side has a NaN (so `< tol` fails)."""
    out = np.asarray(out, dtype=np.float64)
    ref_ = np.asarray(ref_, dtype=np.float64)
    assert out.shape == ref_.shape, (out.shape, ref_.shape)
    if np.isnan(out).any() or np.isnan(ref_).any():
        return float("inf")
    den = np.linalg.norm(ref_)
    num = np.linalg.norm(out - ref_)
    return float(num / den) if den else float(num)


def f32_scale(head_dim: int) -> float:
    """The seed's scale: float32 `1 / sqrt(f32(D))`, as a float64 number."""
    return float(np.float32(1.0) / np.sqrt(np.float32(head_dim)))


def dropout_factor_f32(p: float) -> float:
    """`1/(1-p)` computed in float32 (SPEC "Dropout")."""
    p32 = np.float32(p)
    return float(np.float32(1.0) / (np.float32(1.0) - p32))


def visibility(seq_q, seq_k, causal=False, causal_offset=0, window=0) -> np.ndarray:
    """`[Sq, Sk]` bool, element by element from SPEC's rule (plain loops, independent code)."""
    vis = np.zeros((seq_q, seq_k), dtype=bool)
    for i in range(seq_q):
        a = i + causal_offset
        for j in range(seq_k):
            vis[i, j] = (not causal or j <= a) and (window == 0 or abs(a - j) < window)
    return vis


def _dense_probs(q, k, causal, causal_offset, window, mask, scale):
    B, Sq, H, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    kk = np.repeat(np.asarray(k, np.float64), H // Hkv, axis=2)  # query head h -> h // group
    s = np.einsum("bihd,bjhd->bhij", np.asarray(q, np.float64), kk) * scale
    if mask is not None:
        s = s + np.broadcast_to(np.asarray(mask, np.float64), s.shape)
    vis = np.broadcast_to(visibility(Sq, Sk, causal, causal_offset, window), s.shape)
    s = np.where(vis, s, -np.inf)
    mx = s.max(axis=-1, keepdims=True, initial=-np.inf)
    dead = mx == -np.inf  # no visible key, or all scores -inf
    e = np.where(vis, np.exp(s - np.where(dead, 0.0, mx)), 0.0)
    tot = e.sum(axis=-1, keepdims=True)
    prob = np.where(dead, 0.0, e / np.where(dead, 1.0, tot))
    lse = np.where(dead, -np.inf, mx + np.log(np.where(dead, 1.0, tot)))[..., 0]
    return prob, lse, kk


def dense_attention(q, k, v, *, causal=False, causal_offset=0, window=0, mask=None,
                    keep=None, dropout_prob=0.0, scale=None):
    """Direct-formula forward. q [B,Sq,H,D], k/v [B,Sk,Hkv,D], mask broadcastable to
    [B,H,Sq,Sk], keep a bool [B,H,Sq,Sk] dropout keep-mask (or None). Returns (out, lse) in
    float64: out [B,Sq,H,D], lse [B,H,Sq]. Small sizes only (the whole score tensor is built)."""
    H = q.shape[2]
    scale = f32_scale(q.shape[3]) if scale is None else scale
    with np.errstate(all="ignore"):
        prob, lse, _ = _dense_probs(q, k, causal, causal_offset, window, mask, scale)
        if keep is not None:
            prob = prob * keep * dropout_factor_f32(dropout_prob)
        vv = np.repeat(np.asarray(v, np.float64), H // v.shape[2], axis=2)
        out = np.einsum("bhij,bjhd->bihd", prob, vv)
    return out, lse


def dense_attention_grads(q, k, v, grad_out, *, causal=False, causal_offset=0, window=0,
                          mask=None, keep=None, dropout_prob=0.0, scale=None):
    """Direct-formula backward (SPEC "Attention backward"), float64. Returns
    (grad_q, grad_k, grad_v, delta [B,H,Sq], lse [B,H,Sq])."""
    B, Sq, H, D = q.shape
    Hkv = k.shape[2]
    scale = f32_scale(D) if scale is None else scale
    go = np.asarray(grad_out, np.float64)
    with np.errstate(all="ignore"):
        prob, lse, kk = _dense_probs(q, k, causal, causal_offset, window, mask, scale)
        factor = 1.0 if keep is None else keep * dropout_factor_f32(dropout_prob)
        vv = np.repeat(np.asarray(v, np.float64), H // Hkv, axis=2)
        out = np.einsum("bhij,bjhd->bihd", prob * factor, vv)
        delta = np.einsum("bihd,bihd->bhi", go, out)
        dprob = np.einsum("bihd,bjhd->bhij", go, vv) * factor
        ds = prob * (dprob - delta[..., None])
        gq = scale * np.einsum("bhij,bjhd->bihd", ds, kk)
        gk_h = scale * np.einsum("bhij,bihd->bjhd", ds, np.asarray(q, np.float64))
        gv_h = np.einsum("bhij,bihd->bjhd", prob * factor, go)
    # Sum each KV head's group of query heads.
    gk = gk_h.reshape(B, -1, Hkv, H // Hkv, D).sum(axis=3)
    gv = gv_h.reshape(B, -1, Hkv, H // Hkv, D).sum(axis=3)
    return gq, gk, gv, delta, lse


def dense_keep(p, B, H, Sq, Sk) -> np.ndarray:
    """The full [B,H,Sq,Sk] keep-mask from the reference's Philox (for the dense oracle)."""
    keep = np.ones((B, H, Sq, Sk), dtype=bool)
    for b in range(B):
        for h in range(H):
            keep[b, h] = ref.dropout_keep(p, b, h, np.arange(Sq), np.arange(Sk))
    return keep


def make_qkv(rng, B, Sq, Sk, H, Hkv, D, dtype=np.float64):
    """Fresh standard-normal q [B,Sq,H,D], k, v [B,Sk,Hkv,D] (never zeros)."""
    q = rng.standard_normal((B, Sq, H, D)).astype(dtype)
    k = rng.standard_normal((B, Sk, Hkv, D)).astype(dtype)
    v = rng.standard_normal((B, Sk, Hkv, D)).astype(dtype)
    return q, k, v


def attention_params(q, k, opts=AttentionOptions(), mask=None, bwd=False):
    """The packed struct the engine would hand to the kernel for these shapes."""
    dims = AttentionDims.new(q, k)
    return dims.params_bwd(opts, mask) if bwd else dims.params(opts, mask)


def forward(q, k, v, opts=AttentionOptions(), mask=None) -> np.ndarray:
    """Run `reference.flash_attn_v2` directly into a NaN-poisoned output of q's dtype."""
    out = poison(np.empty_like(q))
    ref.flash_attn_v2(q, k, v, out, mask, attention_params(q, k, opts, mask))
    return out


def backward(q, k, v, out, grad_out, opts=AttentionOptions(), mask=None, stats_dtype=None):
    """Run both reference backward kernels directly; returns (grad_q, grad_k, grad_v, stats).
    `stats_dtype` defaults to q's dtype (float64 keeps full precision for oracle checks)."""
    p = attention_params(q, k, opts, mask, bwd=True)
    B, Sq, H, _ = q.shape
    gq, gk, gv = (poison(np.empty_like(a)) for a in (q, k, v))
    stats = poison(np.empty((B * H * Sq, 2), dtype=stats_dtype or q.dtype))
    ref.flash_attn_v2_bw_dq(q, k, v, out, grad_out, gq, mask, stats, p)
    ref.flash_attn_v2_bw_dkdv(q, k, v, grad_out, gk, gv, mask, stats, p)
    return gq, gk, gv, stats


def _cxx_compiler() -> bool:
    return any(shutil.which(c) for c in ("g++", "c++", "clang++"))


# torch.compile backends the torch tests compile with: inductor needs a C++ compiler on CPU.
COMPILE_BACKENDS = [
    "aot_eager",
    pytest.param("inductor", marks=pytest.mark.skipif(
        not _cxx_compiler(), reason="inductor on CPU needs a C++ compiler (none on PATH)")),
]
