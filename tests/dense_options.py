"""A dense float64 oracle with every option of SPEC "Beyond the seed, part 2", written
independently of `ferrocupy.reference` in PyTorch (whole score tensors, no blocking), so its
gradients (sinks' included) come from autograd rather than from a hand-written backward.

`dense(q, k, v, **options)` returns `(out [B,Sq,H,D], lse [B,H,Sq])` as float64 torch tensors;
`dense_grads(...)` returns the gradients of `sum(out * grad_out)` by autograd. Small sizes only.
With `dtype=torch.float16` (or bfloat16) both compute in that dtype throughout, no upcast: the
plain PyTorch computation that SPEC's half-precision rule measures against.
"""

from __future__ import annotations

import math

import numpy as np
import torch


def visible(sq, sk, offsets, *, causal, window_left, window_right):
    """`[B, 1, Sq, Sk]` bool: key j is visible to row i of batch b (position a = i + offsets[b])
    iff (not causal or j <= a) and a - window_left <= j <= a + window_right (-1: unbounded)."""
    a = torch.arange(sq)[None, :, None] + torch.as_tensor(offsets)[:, None, None]
    j = torch.arange(sk)[None, None, :]
    vis = torch.ones(a.shape[0], sq, sk, dtype=torch.bool)
    if causal:
        vis &= j <= a
    if window_left >= 0:
        vis &= j >= a - window_left
    if window_right >= 0:
        vis &= j <= a + window_right
    return vis[:, None], (a - j).abs()[:, None].double()


def dense(q, k, v, **options):
    """SPEC's formula, float64. Inputs are torch tensors (or arrays) of any float dtype;
    `alibi_slopes` [H] or [B, H]; `sinks` [H]; `mask` broadcastable to [B, H, Sq, Sk];
    `kv_lens` [B]: keys past kv_lens[b] do not exist and rows sit kv_lens[b] - Sk earlier;
    `keep` a bool [B, H, Sq, Sk] dropout keep-mask; `dtype`: what it computes in."""
    out, lse, _ = _dense(q, k, v, **options)
    return out, lse


def _dense(q, k, v, *, causal=False, causal_offset=0, window_left=-1, window_right=-1,
           softcap=0.0, alibi_slopes=None, sinks=None, mask=None, scale=None, kv_lens=None,
           keep=None, dropout_prob=0.0, dtype=torch.float64):
    """`dense`'s out and lse, and what `uncancelled` reads: a dict of the undropped
    probabilities `prob` [B, H, Sq, Sk], the dropout factor `kept` (keep / (1 - p), or 1),
    the softmax `scale` and the KV heads repeated to H (`kk`, `vv`)."""
    q, k, v = (torch.as_tensor(x).to(dtype) for x in (q, k, v))
    B, Sq, H, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    scale = float(np.float32(1.0) / np.sqrt(np.float32(D))) if scale is None else scale
    kk = k.repeat_interleave(H // Hkv, dim=2)
    vv = v.repeat_interleave(H // Hkv, dim=2)
    s = torch.einsum("bihd,bjhd->bhij", q, kk) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    lens = [Sk] * B if kv_lens is None else [int(n) for n in kv_lens]
    offsets = [causal_offset + n - Sk for n in lens]
    vis, dist = visible(Sq, Sk, offsets, causal=causal, window_left=window_left,
                        window_right=window_right)
    vis = vis & (torch.arange(Sk) < torch.tensor(lens)[:, None])[:, None, None, :]
    if alibi_slopes is not None:
        slopes = torch.as_tensor(alibi_slopes).to(dtype)
        slopes = slopes.expand(B, H) if slopes.ndim == 1 else slopes
        s = s - slopes[:, :, None, None] * dist.to(dtype)
    if mask is not None:
        s = s + torch.as_tensor(mask).to(dtype)
    s = torch.where(vis, s, -math.inf)
    dead = (s == -math.inf).all(dim=-1, keepdim=True).detach()  # no key takes part
    s_live = torch.where(dead, 0.0, s)  # finite rows keep autograd away from -inf - -inf
    lse = torch.where(dead[..., 0], -math.inf, torch.logsumexp(s_live, dim=-1))
    if sinks is not None:
        sink = torch.as_tensor(sinks).to(dtype)[None, :, None].expand_as(lse)
        lse = torch.logaddexp(lse, sink)
    safe = torch.where(torch.isinf(lse), 0.0, lse)  # a dead row without a sink: P = 0
    prob = torch.exp(s_live - safe[..., None]) * (~dead)
    kept = 1.0
    if keep is not None:
        f32 = np.float32(dropout_prob)
        kept = torch.as_tensor(keep).to(dtype) * float(np.float32(1.0) / (np.float32(1.0) - f32))
    out = torch.einsum("bhij,bjhd->bihd", prob * kept, vv)
    return out, lse, dict(prob=prob, kept=kept, scale=scale, kk=kk, vv=vv)


def uncancelled(q, k, v, grad_out, **options) -> dict:
    """What float32 rounding in a backward is proportional to: each gradient's sum of the
    magnitudes of its terms (float64 arrays, shaped as the gradients), the cancellation of
    dS = P (dP - Delta) left out. A gradient that cancels to ~0 (grad_k of a lone key: dP =
    Delta) still carries rounding of the order of eps32 times this; the softcap's tanh'
    (<= 1) is bounded by 1."""
    q, k, v, go = (torch.as_tensor(np.asarray(x, np.float64)) for x in (q, k, v, grad_out))
    options = {n: o for n, o in options.items() if n != "dtype"}
    out, _, f = _dense(q, k, v, **options)
    prob, kept, scale = f["prob"], f["kept"], f["scale"]
    dp = torch.einsum("bihd,bjhd->bhij", go.abs(), f["vv"].abs()) * kept  # |dP| bound
    ds = prob * (dp + (prob * dp).sum(-1, keepdim=True))  # |P| (|dP| + |Delta|) bound
    H, Hkv = q.shape[2], k.shape[2]

    def per_kv_head(x):  # [B, S, H, D] -> [B, S, Hkv, D], a KV group's query heads summed
        return x.reshape(*x.shape[:2], Hkv, H // Hkv, x.shape[-1]).sum(3)

    grads = (scale * torch.einsum("bhij,bjhd->bihd", ds, f["kk"].abs()),
             per_kv_head(scale * torch.einsum("bhij,bihd->bjhd", ds, q.abs())),
             per_kv_head(torch.einsum("bhij,bihd->bjhd", prob * kept, go.abs())))
    return dict(zip(("grad_q", "grad_k", "grad_v"), (g.numpy() for g in grads)))


def dense_grads(q, k, v, grad_out, dtype=torch.float64, **options):
    """(grad_q, grad_k, grad_v, grad_sinks or None) of `sum(out * grad_out)`, by autograd
    through `dense` in `dtype` (float64 arrays)."""
    def leaf(x):
        return torch.as_tensor(np.asarray(x, np.float64)).to(dtype).requires_grad_(True)

    leaves = [leaf(x) for x in (q, k, v)]
    sinks = options.pop("sinks", None)
    if sinks is not None:
        sinks = leaf(sinks)
    out, _ = dense(*leaves, sinks=sinks, dtype=dtype, **options)
    (out * torch.as_tensor(np.asarray(grad_out, np.float64)).to(dtype)).sum().backward()
    grads = [x.grad.double().numpy() for x in leaves]
    return (*grads, None if sinks is None else sinks.grad.double().numpy())


def per_head_inputs(rng, batch: int, heads: int, *, alibi=None, sinks=False) -> dict:
    """A test call's optional per-head tensors: `alibi_slopes` float32 `[heads]` (alibi "h")
    or `[batch, heads]` ("bh"), `sinks` float32 `[heads]` (when `sinks`)."""
    t = {}
    if alibi == "h":
        t["alibi_slopes"] = rng.uniform(0, 0.5, heads).astype(np.float32)
    elif alibi == "bh":
        t["alibi_slopes"] = rng.uniform(0, 0.5, (batch, heads)).astype(np.float32)
    if sinks:
        t["sinks"] = rng.normal(0, 2, heads).astype(np.float32)
    return t
