"""FlashAttention 2.x's public functions on ferrocupy: a drop-in for `from flash_attn import ...`.

`flash_attn_func`, `flash_attn_qkvpacked_func`, `flash_attn_kvpacked_func`,
`flash_attn_varlen_func`, `flash_attn_varlen_qkvpacked_func`, `flash_attn_varlen_kvpacked_func`
and `flash_attn_with_kvcache` take flash-attn's arguments, in its order, with its defaults,
layouts (`[B, S, H, D]`; varlen `[total, H, D]`) and return values, and run on
`ferrocupy.torch.attention` (CUDA tensors on the kernels, CPU tensors on the reference backend,
autograd where flash-attn has a backward). Semantics are flash-attn's:

- `causal` is aligned to the bottom right: query `i` of a sequence of `Sq` queries over `Sk` keys
  sits at position `i + Sk - Sq` (per sequence under varlen, per cache length under the KV
  cache), so rows with `i + Sk - Sq < 0` see no key (out 0).
- `window_size=(left, right)`: key `j` is visible iff `a - left <= j <= a + right`; a negative
  side, or one at least the number of keys (`max_seqlen_k` under varlen, the cache's capacity
  under the KV cache), is unbounded, as flash-attn normalizes it.
- `softcap > 0` caps the scores (`<= 0` is off); `alibi_slopes` float32 `[H]` or `[B, H]`.
- `dropout_p`: ferrocupy's Philox dropout, its seed drawn from torch's default generator
  (`torch.manual_seed` makes a call reproducible); `deterministic` is accepted (ferrocupy's
  backward is always deterministic).
- `return_attn_probs=True` returns `(out, softmax_lse, S_dmask)` whatever `dropout_p`:
  `softmax_lse` float32 `[B, H, Sq]` (varlen `[H, total_q]`), `+inf` for a row that sees no key
  (flash-attn's value there; ferrocupy's own is `-inf`); `S_dmask` `[B, H, Sq, Sk]` (varlen
  `[N, H, max_seqlen_q, max_seqlen_k]`, zero outside each sequence) in q's dtype: the attention
  probabilities, with the entries dropout dropped negated. It is computed by extra attention
  calls (about `Sk / head_dim` of them): for tests at small sizes, as in flash-attn.

An argument ferrocupy cannot honour raises `NotImplementedError` naming it.
"""

from __future__ import annotations

import functools
import inspect
import math
from typing import Optional, Sequence, Union

import numpy as np
import torch
from torch import Tensor

from . import torch as ferro
from .reference import dropout_keep

__all__ = ["flash_attn_func", "flash_attn_kvpacked_func", "flash_attn_qkvpacked_func",
           "flash_attn_varlen_func", "flash_attn_varlen_kvpacked_func",
           "flash_attn_varlen_qkvpacked_func", "flash_attn_with_kvcache"]


# --- options --------------------------------------------------------------------------------------
def _window(window_size: Sequence[int], seqlen_k: int) -> tuple[int, int]:
    """flash-attn's (left, right) as ferrocupy's sides: -1 (unbounded) for a negative side and for
    one of at least `seqlen_k` keys, as flash-attn's C++ front end normalizes them."""
    if len(window_size) != 2:
        raise ValueError(f"window_size must be (left, right), got {window_size!r}")
    return tuple(-1 if int(w) < 0 or int(w) >= seqlen_k else int(w) for w in window_size)


def _options(causal: bool, window_size, softcap: float, alibi_slopes: Optional[Tensor],
             softmax_scale: Optional[float], seqlen_k: int) -> dict:
    """The keywords of `ferrocupy.torch.attention` for flash-attn's options, less the rows'
    alignment (`_aligned` says whether it matters)."""
    opts = {"causal": bool(causal), "softcap": float(softcap) if softcap > 0 else 0.0,
            "alibi_slopes": alibi_slopes,
            "scale": None if softmax_scale is None else float(softmax_scale)}
    opts.update(_window_keywords(bool(causal), *_window(window_size, seqlen_k)))
    return opts


def _window_keywords(causal: bool, left: int, right: int) -> dict:
    """ferrocupy's window keywords for these sides: the symmetric `window = w` (`|a - j| < w`,
    which every kernel path takes) where it says the same thing (equal sides, or a causal call,
    where keys right of the row are hidden whatever `right` is), else window_left/window_right."""
    if causal:
        right = left
    if left == right:
        return {} if left < 0 else {"window": left + 1}
    return {"window_left": left, "window_right": right}


def _aligned(opts: dict) -> bool:
    """Whether the rows' positions change the result (else the alignment is left at 0, which
    every kernel path takes)."""
    return (opts["causal"] or "window" in opts or "window_left" in opts
            or opts["alibi_slopes"] is not None)


def _dropout_seed(dropout_p: float) -> Optional[int]:
    """A fresh Philox seed from torch's default generator (as `ferrocupy.torch.attention` draws
    one), or None without dropout (torch's RNG is then left alone)."""
    if not dropout_p:
        return None
    return int(torch.randint(-2**63, 2**63 - 1, (), dtype=torch.int64)) % 2**64


def _flash_lse(lse: Tensor) -> Tensor:
    """ferrocupy's lse in flash-attn's convention: +inf, not -inf, for a row that sees no key."""
    return lse.masked_fill(lse == -math.inf, math.inf)


def _rank(name: str, x: Tensor, rank: int, layout: str) -> None:
    if x.dim() != rank:
        raise ValueError(f"{name} must be {layout} (rank {rank}), got shape {tuple(x.shape)}")


# --- S_dmask: the probabilities, through the attention itself -------------------------------------
def _probabilities(attend, key_index: Tensor, n_keys: int, like: Tensor, kv_heads: int) -> Tensor:
    """P for keys 0 ..< n_keys, on the last dimension: `attend(v)` runs the call's attention with
    values `v`; `key_index` (int64, v's shape less its last two dimensions) is each key's index
    inside its sequence. With `v` holding the unit vector e_(j - c*D) at key j of the chunk
    `c*D ..< (c+1)*D`, and zero elsewhere, the output's features are P of that chunk's keys
    (dropout off: P, not P'), by every rule the engine applies."""
    d = like.shape[-1]
    units = torch.arange(d, device=like.device)
    chunks = []
    for start in range(0, max(n_keys, 1), d):
        hot = (key_index - start).unsqueeze(-1) == units
        v = hot.to(like.dtype).unsqueeze(-2).expand(*hot.shape[:-1], kv_heads, d)
        chunks.append(attend(v.contiguous()))
    return torch.cat(chunks, dim=-1)[..., :n_keys]


def _dropout_signs(probs: Tensor, dropout_p: float, seed: Optional[int], seqlens_q, seqlens_k):
    """`probs` [N, H, Sq, Sk] with the entries dropout drops negated (flash-attn's S_dmask sign
    encoding); the keep mask is the engine's, from `reference.dropout_keep` (SPEC "Dropout")."""
    if not dropout_p:
        return probs
    n_seq, heads = probs.shape[:2]
    p = {"heads": heads, "seed": seed, "dropout_prob": dropout_p}
    keep = np.ones(probs.shape, dtype=bool)
    for n in range(n_seq):
        rows, cols = np.arange(seqlens_q[n]), np.arange(seqlens_k[n])
        for h in range(heads):
            keep[n, h, :seqlens_q[n], :seqlens_k[n]] = dropout_keep(p, n, h, rows, cols)
    return torch.where(torch.from_numpy(keep).to(probs.device), probs, -probs)


# --- fixed-length batches -------------------------------------------------------------------------
def _attn(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
          return_attn_probs):
    """flash-attn's forward (and, through ferrocupy.torch's autograd, backward) on [B, S, H, D]."""
    _rank("q", q, 4, "[B, Sq, H, D]")
    _rank("k", k, 4, "[B, Sk, Hkv, D]")
    sq, sk = q.shape[1], k.shape[1]
    opts = _options(causal, window_size, softcap, alibi_slopes, softmax_scale, sk)
    offset = sk - sq if _aligned(opts) else 0
    seed = _dropout_seed(dropout_p)
    res = ferro.attention(q, k, v, causal_offset=offset, dropout_p=float(dropout_p), seed=seed,
                          return_lse=bool(return_attn_probs), **opts)
    if not return_attn_probs:
        return res
    out, lse = res

    def attend(unit_v):
        return ferro.attention(q, k, unit_v, causal_offset=offset, **opts)

    with torch.no_grad():
        keys = torch.arange(sk, device=q.device)[None].expand(k.shape[0], sk)
        probs = _probabilities(attend, keys, sk, q, k.shape[2]).permute(0, 2, 1, 3)
        b = q.shape[0]
        s_dmask = _dropout_signs(probs, dropout_p, seed, [sq] * b, [sk] * b)
    return out, _flash_lse(lse), s_dmask


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
                    window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                    return_attn_probs=False):
    """flash-attn's `flash_attn_func`: q `[B, Sq, H, D]`, k, v `[B, Sk, Hkv, D]` (`H % Hkv == 0`);
    returns out `[B, Sq, H, D]`, or `(out, softmax_lse, S_dmask)` with `return_attn_probs`."""
    return _attn(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                 return_attn_probs)


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False,
                              window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                              deterministic=False, return_attn_probs=False):
    """`flash_attn_func` on qkv `[B, S, 3, H, D]` (read in place; its gradient is one tensor)."""
    _rank("qkv", qkv, 5, "[B, S, 3, H, D]")
    q, k, v = _split(qkv, 2, 3, "qkv", "[B, S, 3, H, D]")
    return _attn(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                 return_attn_probs)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False,
                             window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                             deterministic=False, return_attn_probs=False):
    """`flash_attn_func` with kv `[B, Sk, 2, Hkv, D]`."""
    _rank("kv", kv, 5, "[B, Sk, 2, Hkv, D]")
    k, v = _split(kv, 2, 2, "kv", "[B, Sk, 2, Hkv, D]")
    return _attn(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                 return_attn_probs)


def _split(packed: Tensor, dim: int, parts: int, name: str, layout: str):
    if packed.shape[dim] != parts:
        raise ValueError(f"{name} must be {layout}, got shape {tuple(packed.shape)}")
    return packed.unbind(dim)


# --- variable-length batches ----------------------------------------------------------------------
_VARLEN = ("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k")


def _require(feature: str, available: bool) -> None:
    if not available:
        raise NotImplementedError(f"{feature}: this ferrocupy.torch has no such interface yet")


@functools.lru_cache(maxsize=4)
def _takes_varlen(attention) -> bool:
    """Whether this `ferrocupy.torch.attention` has the varlen keywords (asked once per
    function object)."""
    return set(_VARLEN) <= set(inspect.signature(attention).parameters)


def _lengths(cu_seqlens: Tensor) -> list[int]:
    cu = [int(x) for x in cu_seqlens.tolist()]
    return [b - a for a, b in zip(cu, cu[1:])]


def _index_in_sequence(cu_seqlens: Tensor, total: int) -> tuple[Tensor, Tensor]:
    """(sequence, index inside it) of each of `total` packed tokens, int64 on cu_seqlens' device;
    tokens past the last sequence get sequence 0 and index -1 (they belong to none)."""
    cu = cu_seqlens.long()
    tok = torch.arange(total, device=cu.device)
    seq = (torch.searchsorted(cu, tok, right=True) - 1).clamp(0, max(cu.numel() - 2, 0))
    inside = (tok >= cu[0]) & (tok < cu[-1])
    return seq.where(inside, 0), (tok - cu[seq]).where(inside, -1)


def _unpaged(cache: Tensor, name: str, block_table: Tensor, cu_seqlens_k: Tensor) -> Tensor:
    """A paged cache `[num_blocks, page_size, Hkv, D]` read through `block_table` `[N,
    max_blocks]` as packed keys `[total_k, Hkv, D]`: key j of sequence n is row `j % page_size`
    of block `block_table[n, j // page_size]` (a gather: a copy, differentiable). The table and
    the lengths are checked here, by name, before anything runs."""
    _rank(f"{name} (paged, with block_table)", cache, 4, "[num_blocks, page_size, Hkv, D]")
    lens, page = _lengths(cu_seqlens_k), cache.shape[1]
    if block_table.dim() != 2 or block_table.shape[0] != len(lens) or \
            block_table.is_floating_point():
        raise ValueError(f"block_table must be an integer tensor [N, max_blocks] with N = "
                         f"{len(lens)} sequences (cu_seqlens_k shape "
                         f"{tuple(cu_seqlens_k.shape)}), got {block_table.dtype} shape "
                         f"{tuple(block_table.shape)}")
    reach = block_table.shape[1] * page
    for n, length in enumerate(lens):
        if length > reach:
            raise ValueError(f"sequence {n} has {length} keys (cu_seqlens_k) but block_table "
                             f"(shape {tuple(block_table.shape)}) reaches {reach} with pages of "
                             f"{page}")
    seq, idx = _index_in_sequence(cu_seqlens_k, int(cu_seqlens_k[-1]))
    table = block_table.to(device=cache.device, dtype=torch.long)
    used = table[seq.to(cache.device), (idx // page).to(cache.device)]
    if used.numel() and (int(used.min()) < 0 or int(used.max()) >= cache.shape[0]):
        raise ValueError(f"block_table (shape {tuple(block_table.shape)}) names block "
                         f"{int(used.min()) if int(used.min()) < 0 else int(used.max())}, outside "
                         f"the {cache.shape[0]} blocks of {name} (shape {tuple(cache.shape)})")
    rows = used * page + (idx % page).to(cache.device)
    return cache.reshape(-1, *cache.shape[2:])[rows]


def _varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
            softmax_scale, causal, window_size, softcap, alibi_slopes, return_attn_probs,
            block_table=None):
    """flash-attn's varlen forward (and backward) on ferrocupy.torch.attention's varlen keywords.
    Those right-align each sequence in the [max_seqlen_q, max_seqlen_k] frame, so
    causal_offset = max_seqlen_k - max_seqlen_q is flash-attn's bottom-right alignment in every
    sequence (for the window and ALiBi too, causal or not)."""
    _require("flash_attn varlen (cu_seqlens_q, cu_seqlens_k)", _takes_varlen(ferro.attention))
    _rank("q", q, 3, "[total_q, H, D]")
    opts = _options(causal, window_size, softcap, alibi_slopes, softmax_scale, max_seqlen_k)
    opts.update(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                max_seqlen_q=int(max_seqlen_q), max_seqlen_k=int(max_seqlen_k),
                causal_offset=int(max_seqlen_k) - int(max_seqlen_q))
    if block_table is not None:
        k, v = (_unpaged(x, name, block_table, cu_seqlens_k) for x, name in ((k, "k"), (v, "v")))
    seed = _dropout_seed(dropout_p)
    res = ferro.attention(q, k, v, dropout_p=float(dropout_p), seed=seed,
                          return_lse=bool(return_attn_probs), **opts)
    if not return_attn_probs:
        return res
    out, lse = res

    def attend(unit_v):
        return ferro.attention(q, k, unit_v, **opts)

    with torch.no_grad():
        _, key_index = _index_in_sequence(cu_seqlens_k, k.shape[0])
        rows = _probabilities(attend, key_index, int(max_seqlen_k), q, k.shape[1])
        seq, row = _index_in_sequence(cu_seqlens_q, q.shape[0])
        lens_q = _lengths(cu_seqlens_q)
        probs = rows.new_zeros((len(lens_q), q.shape[1], int(max_seqlen_q), int(max_seqlen_k)))
        real = row >= 0
        probs[seq[real], :, row[real]] = rows[real]
        s_dmask = _dropout_signs(probs, dropout_p, seed, lens_q, _lengths(cu_seqlens_k))
    return out, _flash_lse(lse), s_dmask


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                           softcap=0.0, alibi_slopes=None, deterministic=False,
                           return_attn_probs=False, block_table=None):
    """flash-attn's `flash_attn_varlen_func`: q `[total_q, H, D]`, k, v `[total_k, Hkv, D]`
    (paged: `[num_blocks, page_size, Hkv, D]` with `block_table`), cu_seqlens int32 `[N + 1]`;
    returns out `[total_q, H, D]`, or `(out, softmax_lse [H, total_q], S_dmask)`."""
    return _varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                   softmax_scale, causal, window_size, softcap, alibi_slopes, return_attn_probs,
                   block_table)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0,
                                     softmax_scale=None, causal=False, window_size=(-1, -1),
                                     softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False):
    """`flash_attn_varlen_func` on qkv `[total, 3, H, D]`, one cu_seqlens for queries and keys."""
    _rank("qkv", qkv, 4, "[total, 3, H, D]")
    q, k, v = _split(qkv, 1, 3, "qkv", "[total, 3, H, D]")
    return _varlen(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p,
                   softmax_scale, causal, window_size, softcap, alibi_slopes, return_attn_probs)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                    max_seqlen_k, dropout_p=0.0, softmax_scale=None, causal=False,
                                    window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                                    deterministic=False, return_attn_probs=False):
    """`flash_attn_varlen_func` with kv `[total_k, 2, Hkv, D]`."""
    _rank("kv", kv, 4, "[total_k, 2, Hkv, D]")
    k, v = _split(kv, 1, 2, "kv", "[total_k, 2, Hkv, D]")
    return _varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                   softmax_scale, causal, window_size, softcap, alibi_slopes, return_attn_probs)


# --- KV cache -------------------------------------------------------------------------------------
def _cache_seqlens(cache_seqlens, batch: int, capacity: int, device) -> Optional[Tensor]:
    """cache_seqlens as int32 `[B]` on `device`; None (every slot of the cache holds a key) stays
    None."""
    if cache_seqlens is None:
        return None
    if isinstance(cache_seqlens, int):
        return torch.full((batch,), cache_seqlens, dtype=torch.int32, device=device)
    return cache_seqlens.to(device=device, dtype=torch.int32)


def _attend_cache(q, k_cache, v_cache, k, v, lens, block_table, rotary_cos, rotary_sin,
                  interleaved: bool, opts: dict, sides, capacity: int, return_lse: bool):
    """The cache call on ferrocupy.torch: `attention` with kv_lens when nothing is appended to a
    contiguous cache (every backend runs it), else `attention_with_kvcache`."""
    if k is None and block_table is None:
        offset = capacity - q.shape[1] if _aligned(opts) else 0
        return ferro.attention(q, k_cache, v_cache, kv_lens=lens, causal_offset=offset,
                               return_lse=return_lse, **opts)
    _require("flash_attn_with_kvcache with k/v to append, block_table or rotary",
             hasattr(ferro, "attention_with_kvcache"))
    if lens is None:
        lens = torch.full((q.shape[0],), capacity, dtype=torch.int32, device=q.device)
    return ferro.attention_with_kvcache(
        q, k_cache, v_cache, k, v, cache_seqlens=lens, block_table=block_table,
        rotary_cos=rotary_cos, rotary_sin=rotary_sin, rotary_interleaved=interleaved,
        causal=opts["causal"], window_left=sides[0], window_right=sides[1],
        softcap=opts["softcap"], alibi_slopes=opts["alibi_slopes"], scale=opts["scale"],
        return_lse=return_lse)


def _rotate(x: Tensor, cos: Tensor, sin: Tensor, positions: Tensor, interleaved: bool) -> Tensor:
    """flash-attn's rotary embedding of `x` `[B, S, H, D]` at int64 `positions` `[B, S]` from its
    tables `[S_ro, rotary_dim / 2]`, in float32 and rounded to x's dtype, as its kernels do;
    features past rotary_dim pass through."""
    rd = 2 * cos.shape[1]
    c = cos.float()[positions][:, :, None]
    s = sin.float()[positions][:, :, None]
    xf = x.float()
    if interleaved:
        x1, x2 = xf[..., 0:rd:2], xf[..., 1:rd:2]
        rot = torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2)
    else:
        x1, x2 = xf[..., :rd // 2], xf[..., rd // 2:rd]
        rot = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    return torch.cat((rot.to(x.dtype), x[..., rd:]), dim=-1)


class _CacheRows:
    """flash-attn's `cache_batch_idx` and `cache_leftpad` over a contiguous cache `[B_cache,
    S_cache, Hkv, D]`, as a paged view of the same memory: pages of `g` rows (`g` divides
    S_cache and every left pad), sequence b's table starting at page `(idx[b] * S_cache +
    leftpad[b]) / g`, its cache length `cache_seqlens[b] - leftpad[b]`. The values are read on
    the host and checked here, before anything is written: an append past S_cache would run into
    the next cache row, so it is refused by name (flash-attn does not check)."""

    def __init__(self, q, k_cache, v_cache, k, lens, batch_idx, leftpad, block_table):
        B, cap = q.shape[0], k_cache.shape[1]
        for name, arg in (("cache_batch_idx", batch_idx), ("cache_leftpad", leftpad)):
            if arg is None:
                continue
            if block_table is not None:
                raise NotImplementedError(
                    f"flash_attn_with_kvcache: {name} with block_table (shape "
                    f"{tuple(block_table.shape)}): a paged cache takes neither, as in flash-attn")
            if arg.dim() != 1 or arg.shape[0] != B or arg.is_floating_point():
                raise ValueError(f"flash_attn_with_kvcache: {name} must be an integer tensor "
                                 f"[batch] = [{B}], got {arg.dtype} shape {tuple(arg.shape)}")
        n_rows = k_cache.shape[0]
        idx = list(range(B)) if batch_idx is None else [int(i) for i in batch_idx.tolist()]
        pad = [0] * B if leftpad is None else [int(i) for i in leftpad.tolist()]
        have = [int(i) for i in lens.tolist()]
        new = 0 if k is None else int(k.shape[1])
        for b in range(B):
            if not 0 <= idx[b] < n_rows:
                raise ValueError(f"flash_attn_with_kvcache: cache_batch_idx[{b}] = {idx[b]} is "
                                 f"outside the cache's {n_rows} rows (k_cache shape "
                                 f"{tuple(k_cache.shape)})")
            if not 0 <= pad[b] <= have[b]:
                raise ValueError(f"flash_attn_with_kvcache: cache_leftpad[{b}] = {pad[b]} must "
                                 f"be in 0 ..= cache_seqlens[{b}] = {have[b]}")
            if have[b] + new > cap:
                raise ValueError(f"flash_attn_with_kvcache: cache_seqlens[{b}] = {have[b]} plus "
                                 f"{new} new keys pass the cache's capacity {cap} (k_cache "
                                 f"shape {tuple(k_cache.shape)})")
        self.pad = pad
        self.g = math.gcd(cap, *pad)
        self.pages_total = n_rows * (cap // self.g)
        self.lens = torch.tensor([h - p for h, p in zip(have, pad)], dtype=torch.int32,
                                 device=q.device)
        self.abs_lens, self.k_cache, self.v_cache = lens, k_cache, v_cache
        self.idx = torch.tensor(idx, dtype=torch.long, device=q.device)

    def table(self) -> Tensor:
        """The paged view's block_table, int32 `[B, width]`: sequence b's pages from `(idx[b] *
        S_cache + pad[b]) / g` on; entries past the cache's last page (never read: each
        sequence's keys end inside its own row) are 0."""
        cap, dev = self.k_cache.shape[1], self.idx.device
        pad = torch.tensor(self.pad, dtype=torch.long, device=dev)
        width = max([1] + [(cap - p) // self.g for p in self.pad])  # a pad of S_cache: no key
        first = (self.idx * cap + pad) // self.g
        pages = first[:, None] + torch.arange(width, device=dev)[None]
        return pages.masked_fill(pages >= self.pages_total, 0).to(torch.int32)

    def attend(self, q, k, v, cos, sin, interleaved: bool, opts: dict, sides, return_lse: bool):
        if k is None:
            # Nothing written: each sequence's rows gathered into a contiguous cache (a copy,
            # which every backend runs), its keys from its left pad on.
            return _attend_cache(q, self.gather(self.k_cache), self.gather(self.v_cache), None,
                                 None, self.lens, None, None, None, interleaved, opts, sides,
                                 self.k_cache.shape[1], return_lse)
        if cos is not None and any(self.pad):
            # flash-attn rotates at the cache's own positions, not the left-padded ones: rotate
            # here and pass no tables.
            new = k.shape[1]
            base = self.abs_lens.long()[:, None]
            pos = base + torch.arange(new, device=q.device)[None]
            local = opts["causal"] or sides != (-1, -1)
            q_pos = base + torch.arange(q.shape[1], device=q.device)[None] if local else \
                base.expand(q.shape[0], q.shape[1])
            q, k = _rotate(q, cos, sin, q_pos, interleaved), _rotate(k, cos, sin, pos, interleaved)
            cos = sin = None
        _require("flash_attn_with_kvcache with cache_batch_idx or cache_leftpad",
                 hasattr(ferro, "attention_with_kvcache"))
        return ferro.attention_with_kvcache(
            q, _pages(self.k_cache, self.g, "k_cache"), _pages(self.v_cache, self.g, "v_cache"),
            k, v, cache_seqlens=self.lens, block_table=self.table(),
            rotary_cos=cos, rotary_sin=sin, rotary_interleaved=interleaved,
            causal=opts["causal"], window_left=sides[0], window_right=sides[1],
            softcap=opts["softcap"], alibi_slopes=opts["alibi_slopes"], scale=opts["scale"],
            return_lse=return_lse)


    def gather(self, cache: Tensor) -> Tensor:
        """`[B, S_cache, Hkv, D]`: row j of sequence b is cache row `leftpad[b] + j` of
        `cache[idx[b]]` (past the cache's end: its last row, which no length reaches)."""
        cap = cache.shape[1]
        pad = torch.tensor(self.pad, dtype=torch.long, device=cache.device)
        rows = (pad[:, None] + torch.arange(cap, device=cache.device)[None]).clamp(max=cap - 1)
        return cache[self.idx[:, None], rows]


def _pages(cache: Tensor, g: int, name: str) -> Tensor:
    """`cache` `[B_cache, S_cache, Hkv, D]` viewed (never copied: appends write through it) as
    pages `[B_cache * S_cache / g, g, Hkv, D]`."""
    try:
        return cache.view(-1, g, *cache.shape[2:])
    except RuntimeError as err:
        raise ValueError(f"flash_attn_with_kvcache: {name} (shape {tuple(cache.shape)}, stride "
                         f"{cache.stride()}) must have its batch and sequence dimensions "
                         f"contiguous for cache_batch_idx / cache_leftpad") from err


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None,
                            rotary_sin=None,
                            cache_seqlens: Optional[Union[int, Tensor]] = None,
                            cache_batch_idx: Optional[Tensor] = None,
                            cache_leftpad: Optional[Tensor] = None,
                            block_table: Optional[Tensor] = None, softmax_scale=None,
                            causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0,
                            return_softmax_lse=False):
    """flash-attn's `flash_attn_with_kvcache` (forward only, no gradient): q `[B, Sq, H, D]`
    attends over the first `cache_seqlens[b]` keys of the cache (`[B, S_cache, Hkv, D]`, or
    paged `[num_blocks, page_size, Hkv, D]` with `block_table`), bottom-right aligned; with `k`,
    `v` (`[B, Sn, Hkv, D]`) those are first written into the cache at `cache_seqlens[b]`, rotated
    by `rotary_cos`/`rotary_sin` (`[S_ro, rotary_dim / 2]`) when given, as is q. Returns out, or
    `(out, softmax_lse [B, H, Sq])` with `return_softmax_lse`. `num_splits` is a performance hint
    of flash-attn's kernel and changes nothing here.

    A contiguous cache also takes flash-attn's `cache_batch_idx` (int `[B]`: sequence b lives in
    cache row `cache_batch_idx[b]`) and `cache_leftpad` (int `[B]`: sequence b's keys start at
    `cache_leftpad[b]`; the keys before it are not attended, positions for the mask and ALiBi
    count from it, rotary positions stay the cache's own). Neither goes with `block_table`, as in
    flash-attn."""
    if (k is None) != (v is None):
        raise ValueError("flash_attn_with_kvcache: give both k and v (the new keys and values) "
                         "or neither")
    if (rotary_cos is None) != (rotary_sin is None):
        raise ValueError("flash_attn_with_kvcache: give both rotary_cos and rotary_sin or neither")
    if rotary_cos is not None and k is None:
        raise ValueError("flash_attn_with_kvcache: rotary_cos/rotary_sin rotate the new keys, so "
                         "they need k and v")
    _rank("q", q, 4, "[B, Sq, H, D]")
    _rank("k_cache", k_cache, 4, "[B, S_cache, Hkv, D] or [num_blocks, page_size, Hkv, D]")
    capacity = k_cache.shape[1] * (1 if block_table is None else block_table.shape[1])
    lens = _cache_seqlens(cache_seqlens, q.shape[0], capacity, q.device)
    opts = _options(causal, window_size, softcap, alibi_slopes, softmax_scale, capacity)
    if cache_batch_idx is not None or cache_leftpad is not None:
        if lens is None:
            lens = torch.full((q.shape[0],), capacity, dtype=torch.int32, device=q.device)
        rows = _CacheRows(q, k_cache, v_cache, k, lens, cache_batch_idx, cache_leftpad,
                          block_table)
        with torch.no_grad():
            res = rows.attend(q, k, v, rotary_cos, rotary_sin, bool(rotary_interleaved), opts,
                              _window(window_size, capacity), bool(return_softmax_lse))
    else:
        with torch.no_grad():
            res = _attend_cache(q, k_cache, v_cache, k, v, lens, block_table, rotary_cos,
                                rotary_sin, bool(rotary_interleaved), opts,
                                _window(window_size, capacity), capacity,
                                bool(return_softmax_lse))
    if not return_softmax_lse:
        return res
    out, lse = res
    return out, _flash_lse(lse)
