"""ComputeEngine: the seed's eight methods. Validates and packs in one place, then hands each
operation (rope, forward, backward: named buffers and the packed params) to a backend, CUDA or the
NumPy reference, which picks, orders and launches its own kernels."""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass, field

import numpy as np

from . import rope_args
from .params import check_seed
from .plan import (ARGS, BACKWARD, FORWARD, AttentionPlan, PlanScalars, TensorSpec,
                   check_device, check_dtypes)
from .tensor import UnifiedTensor, cuda_available


@dataclass(frozen=True)
class AttentionOptions:
    """Options of `flash_attention_v2_with` and its backward (the seed's five fields, `scale`,
    and SPEC part 2's `window_left`, `window_right`, `softcap`).

    Query `i` sits at absolute position `a = i + causal_offset` (a signed 32-bit integer: a
    negative offset leaves the first rows dead under `causal`); key `j` is visible when
    `j <= a` (if `causal`) and `|a - j| < window` (if `window > 0`), or, with the asymmetric
    form, `a - window_left <= j <= a + window_right` (each -1: unbounded; None, the default,
    is -1 once the other is given; the symmetric `window = w` is `window_left = window_right =
    w - 1`, and giving both forms is an error).
    `scale` multiplies `q . k` before the softmax; None is `1/sqrt(head_dim)` (the seed's).
    `softcap > 0` turns each scaled score `x` into `softcap * tanh(x / softcap)`.
    """

    causal: bool = False
    causal_offset: int = 0
    window: int = 0
    dropout_prob: float = 0.0
    seed: int = 0
    scale: float | None = None
    window_left: int | None = None
    window_right: int | None = None
    softcap: float = 0.0
    # The values but the seed, with their types (True == 1 == 1.0, but not all are valid),
    # hashable: what a plan is kept by (the seed is a value of each run: dropout with a fresh seed
    # per step reuses the step's plans). None when a value is unhashable (validate() says why).
    key: "_Key | None" = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        values = tuple((type(x), x) for x in (self.causal, self.causal_offset, self.window,
                                              self.dropout_prob, self.scale, self.window_left,
                                              self.window_right, self.softcap))
        try:
            key = _Key(values)
        except TypeError:
            key = None
        object.__setattr__(self, "key", key)

    def validate(self) -> None:
        if not isinstance(self.causal, (bool, np.bool_)):
            raise TypeError(f"causal must be a bool, got {self.causal!r}")
        # causal_offset is a signed 32-bit word; window an unsigned one; window_left/right are
        # int32 with -1 for unbounded.
        for name, lo, hi, text in (("causal_offset", -2**31, 2**31, "[-2**31, 2**31)"),
                                   ("window", 0, 2**32, "[0, 2**32)"),
                                   ("window_left", -1, 2**31, "[-1, 2**31)"),
                                   ("window_right", -1, 2**31, "[-1, 2**31)")):
            value = getattr(self, name)
            if value is None and name in ("window_left", "window_right"):
                continue
            if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
                raise TypeError(f"{name} must be an int, got {type(value).__name__}")
            if not lo <= value < hi:
                raise ValueError(f"{name} must be in {text}, got {value}")
        if self.window and (self.window_left is not None or self.window_right is not None):
            raise ValueError(f"give either window ({self.window}) or window_left/window_right "
                             f"({self.window_left}, {self.window_right}), not both")
        _check_float("softcap", self.softcap, lambda c: c >= 0, "finite and >= 0")
        p = self.dropout_prob
        if isinstance(p, (bool, np.bool_)) or not isinstance(p, (int, float, np.integer,
                                                                 np.floating)):
            raise TypeError(f"dropout_prob must be a number, got {p!r}")
        if not 0.0 <= float(p) < 1.0 or not 0.0 <= float(np.float32(p)) < 1.0:
            raise ValueError(f"dropout_prob must lie in [0, 1), got {self.dropout_prob}")
        check_seed(self.seed)
        if self.scale is not None:
            # (The kernels flush subnormal floats to 0 and bring scaled scores back to raw units
            # through 1 / scale: both the scale and its reciprocal must be normal float32s.)
            _check_float("scale", self.scale, lambda c: _SCALE_MIN <= c <= _SCALE_MAX,
                         "finite and > 0, in [2**-126, 2**126]", " or None")

    def windows(self) -> tuple[int, int]:
        """(window_left, window_right) of these options, -1 for unbounded, whichever form was
        given (the symmetric `window = w > 0` is `w - 1` each side)."""
        if self.window_left is not None or self.window_right is not None:
            return (-1 if self.window_left is None else int(self.window_left),
                    -1 if self.window_right is None else int(self.window_right))
        w = int(self.window)
        return (w - 1, w - 1) if w > 0 else (-1, -1)


_SCALE_MIN, _SCALE_MAX = np.float32(2.0**-126), np.float32(2.0**126)  # scale: normal, as 1/scale


def _check_float(name: str, value, ok, rule: str, alternative: str = "") -> None:
    """`value` is a number (not a bool) that, as the float32 the kernels take, is finite and
    passes `ok`."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer,
                                                                   np.floating)):
        raise TypeError(f"{name} must be a number{alternative}, got {value!r}")
    try:
        v64 = float(value)
    except OverflowError:
        v64 = float("inf")
    with np.errstate(over="ignore"):
        v32 = np.float32(v64)
    if not (np.isfinite(v64) and np.isfinite(v32) and ok(v32)):
        raise ValueError(f"{name} must be {rule} (as float32, which the kernels take: {v32}), "
                         f"got {value}")


class _Key:
    """Hashable values, hashed once (a plan lookup hashes its key on every call)."""

    __slots__ = ("values", "_hash")

    def __init__(self, values: tuple):
        self.values, self._hash = values, hash(values)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other) -> bool:
        return self is other or (type(other) is _Key and self.values == other.values)


def _make_backend(backend: str):
    if backend == "reference":
        from .reference import ReferenceBackend

        return ReferenceBackend()
    if backend == "cuda":
        # No CuPy, no driver or no GPU: say which, and what to install, not CuPy's raw error.
        missing, cause = None, None
        try:
            import cupy

            if cupy.cuda.runtime.getDeviceCount() == 0:
                missing = "CuPy sees no CUDA GPU"
        except ImportError as e:
            missing, cause = f"CuPy is not installed ({type(e).__name__}: {e})", e
        except Exception as e:  # CUDARuntimeError: no NVIDIA driver, or one too old
            missing, cause = f"no usable NVIDIA driver or GPU ({type(e).__name__}: {e})", e
        if missing:
            raise RuntimeError(
                f"backend='cuda' needs CuPy, an NVIDIA driver and a CUDA GPU: {missing}. "
                f"Install CuPy with pip install 'ferrocupy[cuda13]' (for drivers that support "
                f"CUDA 13) or 'ferrocupy[cuda12]' (CUDA 12), on a machine with an NVIDIA GPU and "
                f"its driver; or use backend='reference' (NumPy, no GPU)") from cause
        from .cuda.backend import CudaBackend

        return CudaBackend()
    raise ValueError(f"backend must be 'cuda' or 'reference', got {backend!r}")


_NO_SCALARS = PlanScalars()  # a call without varlen or an append (the hot path: keyed once)
_NO_SCALARS_KEY = _NO_SCALARS.key()


def _varlen_scalars(max_seqlen_q, max_seqlen_k) -> PlanScalars:
    if max_seqlen_q is None and max_seqlen_k is None:
        return _NO_SCALARS
    return PlanScalars(max_seqlen_q, max_seqlen_k)


class ComputeEngine:
    """Owns the kernels and the device context; outputs are written into the tensors passed in."""

    def __init__(self, backend: str | None = None, *, quiet: bool = False):
        if backend is None:
            backend = "cuda" if cuda_available() else "reference"
            if not quiet:
                why = "a CUDA GPU is usable" if backend == "cuda" else "no CUDA GPU is usable"
                print(f"ferrocupy: using the {backend} backend ({why})", file=sys.stderr)
        self.backend = _make_backend(backend)
        self._plans: dict = {}  # see _plan

    @property
    def backend_name(self) -> str:
        return self.backend.name

    def __repr__(self) -> str:
        return f"ComputeEngine(backend={self.backend.name!r}, device={self.backend.device!r})"

    # --- RoPE -----------------------------------------------------------------------------------
    def rope(self, tensor, head_dim: int, pos: int, *, positions=None, rotary_dim=None,
             interleaved: bool = False, inverse: bool = False, out=None) -> None:
        """Rotate-half RoPE (theta 10000) in place; token `s` gets position `pos + s`. The
        keywords are `rope_theta`'s."""
        self.rope_theta(tensor, head_dim, pos, 10000.0, positions=positions,
                        rotary_dim=rotary_dim, interleaved=interleaved, inverse=inverse, out=out)

    def rope_theta(self, tensor, head_dim: int, pos: int, theta: float, *, positions=None,
                   rotary_dim=None, interleaved: bool = False, inverse: bool = False,
                   out=None) -> None:
        """`rope` with base frequency `theta` (a Hugging Face config's `rope_theta`).

        `tensor` is read as `[batch, seq_len, heads, head_dim]`: `[batch, seq_len, ...]` from
        rank 3 on, `[seq_len, ...]` at rank 2, one token at rank 1. Any view whose head_dim
        elements are contiguous and whose heads are evenly spaced is read (and written) where it
        lies, through its strides. Keywords, each off by default:

        - `positions`: int32 or int64 `[seq_len]` or `[batch, seq_len]` on this engine's device,
          its last dimension contiguous (any batch stride: an expanded row too); token (b, s)
          sits at `positions[s]` or `positions[b, s]` instead of `pos + s` (pos must then be 0).
          Its values are not checked: every integer is a position.
        - `rotary_dim`: an even width in [2, head_dim]; only the first `rotary_dim` features of
          each head rotate (frequencies over `rotary_dim`), the rest pass through.
        - `interleaved`: rotate the pairs (x[2i], x[2i+1]) (GPT-J) instead of (x[i], x[i + r/2]).
        - `inverse`: rotate by the negative angle (RoPE's gradient).
        - `out`: write the result here (same shape and dtype, any such view) and leave `tensor`
          as it is; `out` may be `tensor` itself, but must not otherwise share its memory."""
        t = self._tensor("tensor", tensor, contiguous=False)
        o = None if out is None else self._tensor("out", out, contiguous=False)
        ps = None if positions is None else self._tensor("positions", positions, contiguous=False)
        self._check_dtype(("tensor", t), *(() if o is None else (("out", o),)))
        opts = rope_args.Options(head_dim, pos, theta, rotary_dim, interleaved, inverse)
        call = rope_args.checked_call(self.backend, t, o, ps, opts)
        in_place = rope_args.check_buffers(t, o, ps)
        if t.numel:
            self.backend.rope(t.buffer(), call.params, out=None if in_place else o.buffer(),
                              positions=None if ps is None else ps.buffer(), layout=call.layout)

    # --- forward --------------------------------------------------------------------------------
    def flash_attention(self, q, k, v, out, causal: bool = False) -> None:
        """Single-head attention on `[seq, head_dim]` tensors (the v2 kernel on 4-D views)."""
        q4, k4, v4, o4 = (_single_head_view(n, t, self) for n, t in
                          (("q", q), ("k", k), ("v", v), ("out", out)))
        self.flash_attention_v2(q4, k4, v4, o4, causal, 0.0, 0, None)

    def flash_attention_v2(self, q, k, v, out, causal: bool = False, dropout_prob: float = 0.0,
                           seed: int = 0, mask=None) -> None:
        """Fused attention with GQA, causal masking, an additive mask and dropout.

        `q`, `out`: `[batch, seq_q, heads, head_dim]`; `k`, `v`: `[batch, seq_k, kv_heads,
        head_dim]`; `mask`: additive, broadcastable to `[batch, heads, seq_q, seq_k]`.
        """
        opts = AttentionOptions(causal=causal, dropout_prob=dropout_prob, seed=seed)
        self.flash_attention_v2_with(q, k, v, out, opts, mask)

    def flash_attention_v2_with(self, q, k, v, out, opts: AttentionOptions = AttentionOptions(),
                                mask=None, *, lse=None, kv_lens=None, alibi_slopes=None,
                                sinks=None, cu_seqlens_q=None, cu_seqlens_k=None,
                                max_seqlen_q=None, max_seqlen_k=None, block_table=None) -> None:
        """`flash_attention_v2` with every option (KV-cache offset, sliding window, scale).

        `lse` (optional output, float32 `[batch, heads, seq_q]`): each row's log-sum-exp of its
        scaled, masked scores (natural log, before dropout; -inf for a row that sees no key).
        Give it to the backward to spare it recomputing it.

        `kv_lens` (optional input, int32 `[batch]`, on this engine's device): batch `b` has
        `kv_lens[b] <= seq_k` keys; the slots past them are never read (a preallocated KV
        cache may hold anything there), and its rows sit at `i + causal_offset + kv_lens[b] - seq_k`.
        Its values are read (one small copy to the host) and checked before any launch.

        `alibi_slopes` (optional input, float32 `[heads]` or `[batch, heads]`): adds
        `-slope * |a - j|` to each visible score (after softcap, before the mask).
        `sinks` (optional input, float32 `[heads]`): head h's logit joins each row's softmax
        denominator without a value (`lse` includes it; a dead row has `lse = sinks[h]`).

        Varlen (packed sequences): `cu_seqlens_q`, `cu_seqlens_k` (int32 `[N + 1]`) with
        `max_seqlen_q`, `max_seqlen_k` (ints): `q`, `out` are `[total_q, heads, head_dim]`,
        `k`, `v` `[total_k, kv_heads, head_dim]`, `lse` `[heads, total_q]`; sequence n is the
        attention of rows `cu_seqlens_q[n] ..< cu_seqlens_q[n+1]` over keys `cu_seqlens_k[n]
        ..< cu_seqlens_k[n+1]`, every option applied inside it (dropout's batch index is n).
        Each sequence sits right-aligned in the `[max_seqlen_q, max_seqlen_k]` frame of a
        dense call: its row i is at `a = i + causal_offset + (Sk_n - max_seqlen_k) - (Sq_n -
        max_seqlen_q)`, so `causal_offset = max_seqlen_k - max_seqlen_q` is bottom-right in
        every sequence (FlashAttention's), and 0 is top-left where `Sq_n = Sk_n` (packed
        self-attention). No mask, kv_lens or block_table with it. The values are checked
        before any launch (start 0, non-decreasing, end at the totals, steps at most the
        max_seqlen).

        Paged KV cache: `block_table` (int32 `[batch, max_blocks]`): `k`, `v` are `[num_blocks,
        page_size, kv_heads, head_dim]` and key j of batch b is row `j % page_size` of block
        `block_table[b, j // page_size]`; seq_k is `max_blocks * page_size` for the kv_lens
        rule (`kv_lens` are the cache lengths). Blocks a sequence does not reach are never
        read; one it reaches outside `[0, num_blocks)` is an error. Forward only.

        Every option runs on both backends, bar what plan.check_backend_reach lists (the CUDA
        kernels refuse it by name when the plan is made)."""
        self._call(FORWARD, (q, k, v, out, mask, lse, kv_lens, alibi_slopes, sinks,
                             cu_seqlens_q, cu_seqlens_k, block_table, None, None, None, None),
                   opts, _varlen_scalars(max_seqlen_q, max_seqlen_k))

    def plan_attention(self, q, k, v, out, opts: AttentionOptions = AttentionOptions(),
                       mask=None, *, lse=None, kv_lens=None, alibi_slopes=None,
                       sinks=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                       max_seqlen_k=None, block_table=None) -> AttentionPlan:
        """The plan of `flash_attention_v2_with` for tensors like these (tensors, or
        `TensorSpec`s: only their shapes, strides, dtypes and devices count), every check that
        depends on them done. The engine keeps one plan per combination: the same arguments
        give the same plan object. `plan.run(q, k, v, out, ...)` runs it on each call's
        tensors (their memory checked every time)."""
        return self._plan(FORWARD, (q, k, v, out, mask, lse, kv_lens, alibi_slopes, sinks,
                                    cu_seqlens_q, cu_seqlens_k, block_table, None, None, None,
                                    None),
                          opts, False, _varlen_scalars(max_seqlen_q, max_seqlen_k))[0]

    # --- KV-cache append ------------------------------------------------------------------------
    def attention_with_kvcache(self, q, k_cache, v_cache, out,
                               opts: AttentionOptions = AttentionOptions(), *, cache_seqlens,
                               k_new=None, v_new=None, block_table=None, rotary_cos=None,
                               rotary_sin=None, rotary_interleaved: bool = False, lse=None,
                               alibi_slopes=None, sinks=None) -> None:
        """FlashAttention's `flash_attn_with_kvcache` (SPEC "Appending to a KV cache"), forward
        only. `k_cache`, `v_cache`: `[batch, capacity, kv_heads, head_dim]`, or paged
        `[num_blocks, page_size, kv_heads, head_dim]` with `block_table`; `cache_seqlens`
        (int32 `[batch]`) keys of batch b are in the cache.

        With `k_new`, `v_new` (`[batch, new_keys, kv_heads, head_dim]`, C-contiguous) they are
        written into the cache at `cache_seqlens[b] ..< cache_seqlens[b] + new_keys` (past the
        capacity: an error, nothing written), k_new rotated first when `rotary_cos`,
        `rotary_sin` (`[seqlen_ro, rotary_dim / 2]`, float32 or q's dtype) are given:
        rotate-half, or pairs `(x[2i], x[2i+1])` with `rotary_interleaved`; q is rotated too, at
        `cache_seqlens[b] + i` when causal or windowed, else at `cache_seqlens[b]` (rounded to
        q's dtype before the attention). `cache_seqlens` itself is not updated.

        Then `q` (`[batch, seq_q, heads, head_dim]`) attends over `cache_seqlens[b] + new_keys`
        keys, bottom-right aligned: row i sits at `a = i + causal_offset + cache_seqlens[b] +
        new_keys - seq_q` (so `causal_offset = 0` is FlashAttention's alignment). `lse`,
        `alibi_slopes`, `sinks` as in `flash_attention_v2_with`."""
        plan = self.plan_attention_with_kvcache(
            q, k_cache, v_cache, out, opts, cache_seqlens=cache_seqlens, k_new=k_new,
            v_new=v_new, block_table=block_table, rotary_cos=rotary_cos, rotary_sin=rotary_sin,
            rotary_interleaved=rotary_interleaved, lse=lse, alibi_slopes=alibi_slopes,
            sinks=sinks)
        plan.run(q, k_cache, v_cache, out, lse=lse, kv_lens=cache_seqlens,
                 alibi_slopes=alibi_slopes, sinks=sinks, block_table=block_table, k_new=k_new,
                 v_new=v_new, rotary_cos=rotary_cos, rotary_sin=rotary_sin)

    def plan_attention_with_kvcache(self, q, k_cache, v_cache, out,
                                    opts: AttentionOptions = AttentionOptions(), *,
                                    cache_seqlens, k_new=None, v_new=None, block_table=None,
                                    rotary_cos=None, rotary_sin=None,
                                    rotary_interleaved: bool = False, lse=None,
                                    alibi_slopes=None, sinks=None) -> AttentionPlan:
        """The plan of `attention_with_kvcache` (a forward plan; its `run` takes the cache as
        `k`, `v` and `cache_seqlens` as `kv_lens`)."""
        if cache_seqlens is None:
            raise TypeError("attention_with_kvcache needs cache_seqlens (int32 [batch])")
        if not isinstance(rotary_interleaved, (bool, np.bool_)):
            raise TypeError(f"rotary_interleaved must be a bool, got {rotary_interleaved!r}")
        if k_new is None:
            # No append: the kv_lens rule over cache_seqlens keys, bottom-right.
            if rotary_cos is not None or rotary_sin is not None:
                raise ValueError("rotary_cos/rotary_sin rotate an append's q and k_new: they "
                                 "need k_new and v_new")
            if v_new is not None:
                raise ValueError(f"an append needs k_new and v_new: v_new (shape "
                                 f"{self._spec('v_new', v_new).shape}) is given alone")
        if not isinstance(opts, AttentionOptions):
            raise TypeError(f"opts must be AttentionOptions, got {type(opts).__name__}")
        # Bottom-right: the kv_lens rule's row position with causal_offset + capacity - seq_q.
        qs, ks = self._spec("q", q), self._spec("k_cache", k_cache)
        capacity = (ks.shape[1] if len(ks.shape) > 1 else 0) * (
            1 if block_table is None else self._spec("block_table", block_table).shape[-1])
        seq_q = qs.shape[1] if len(qs.shape) > 1 else 0
        shifted = _shifted(opts, capacity - seq_q)
        return self._plan(FORWARD, (q, k_cache, v_cache, out, None, lse, cache_seqlens,
                                    alibi_slopes, sinks, None, None, block_table, k_new, v_new,
                                    rotary_cos, rotary_sin), shifted, False,
                          PlanScalars(rotary_interleaved=bool(rotary_interleaved)))[0]

    # --- backward -------------------------------------------------------------------------------
    def flash_attention_backward(self, q, k, v, out, grad_out, grad_q, grad_k, grad_v,
                                 causal: bool = False) -> None:
        """Single-head backward for `[seq, head_dim]` tensors; writes the three gradients."""
        names = ("q", "k", "v", "out", "grad_out", "grad_q", "grad_k", "grad_v")
        views = [_single_head_view(n, x, self) for n, x in
                 zip(names, (q, k, v, out, grad_out, grad_q, grad_k, grad_v))]
        self.flash_attention_v2_backward(*views, causal)

    def flash_attention_v2_backward(self, q, k, v, out, grad_out, grad_q, grad_k, grad_v,
                                    causal: bool = False) -> None:
        """Backward of `flash_attention_v2` without mask or dropout."""
        self.flash_attention_v2_backward_with(q, k, v, out, grad_out, grad_q, grad_k, grad_v,
                                              AttentionOptions(causal=causal), None)

    def flash_attention_v2_backward_with(self, q, k, v, out, grad_out, grad_q, grad_k, grad_v,
                                         opts: AttentionOptions = AttentionOptions(),
                                         mask=None, *, lse=None, kv_lens=None,
                                         alibi_slopes=None, sinks=None, grad_sinks=None,
                                         cu_seqlens_q=None, cu_seqlens_k=None,
                                         max_seqlen_q=None, max_seqlen_k=None) -> None:
        """Backward of `flash_attention_v2_with`: `out` is the forward's output for the same
        inputs, `opts` and `mask` (dropout is regenerated from `opts.seed`). Writes, never
        accumulates into, `grad_q`, `grad_k`, `grad_v`; no gradient for the mask.

        `lse` (optional input, float32 `[batch, heads, seq_q]`): the forward's, taken as it is;
        the backward then skips recomputing it (same results to float32 rounding).

        `alibi_slopes`, `sinks`: the forward's (no gradient for the slopes). `grad_sinks`
        (optional output, float32 `[heads]`, with `sinks`): written with
        `-sum_{b,i} exp(sinks[h] - lse_bhi) * Delta_bhi`.

        `cu_seqlens_q`, `cu_seqlens_k`, `max_seqlen_q`, `max_seqlen_k`: the forward's varlen
        split (`lse` then `[heads, total_q]`; `grad_k`, `grad_v` like the packed `k`, `v`).

        `kv_lens` is not taken: a cache with per-sequence lengths is an inference-time thing."""
        if kv_lens is not None:
            raise ValueError(_NO_BACKWARD_KV_LENS)
        self._call(BACKWARD, (q, k, v, out, grad_out, grad_q, grad_k, grad_v, mask, lse,
                              alibi_slopes, sinks, grad_sinks, cu_seqlens_q, cu_seqlens_k),
                   opts, _varlen_scalars(max_seqlen_q, max_seqlen_k))

    def plan_attention_backward(self, q, k, v, out, grad_out, grad_q, grad_k, grad_v,
                                opts: AttentionOptions = AttentionOptions(), mask=None, *,
                                lse=None, alibi_slopes=None, sinks=None, grad_sinks=None,
                                cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                                max_seqlen_k=None) -> AttentionPlan:
        """The plan of `flash_attention_v2_backward_with` for tensors like these (see
        `plan_attention`)."""
        return self._plan(BACKWARD, (q, k, v, out, grad_out, grad_q, grad_k, grad_v, mask, lse,
                                     alibi_slopes, sinks, grad_sinks, cu_seqlens_q,
                                     cu_seqlens_k), opts, False,
                          _varlen_scalars(max_seqlen_q, max_seqlen_k))[0]

    # --- plans ----------------------------------------------------------------------------------
    def _call(self, op: str, args: tuple, opts, scalars: PlanScalars = _NO_SCALARS) -> None:
        plan, ptrs = self._plan(op, args, opts, scalars=scalars)
        if ptrs is not None:  # CUDA arrays or tensors: their addresses were read with their specs
            plan.run_pointers(ptrs)
        else:
            plan.run(*args)

    def _plan(self, op: str, args: tuple, opts, addresses: bool = True,
              scalars: PlanScalars = _NO_SCALARS):
        """(the plan for `args`, their device addresses by name, or None where they were not
        asked for or cannot be read). Plans are kept by the arguments' metadata as read here
        (type-specific, cheap: no wrapping) and the options' values; an argument whose metadata
        this cannot read makes a plan that is not kept; so does an unhashable scalar."""
        if not isinstance(opts, AttentionOptions):
            raise TypeError(f"opts must be AttentionOptions, got {type(opts).__name__}")
        names = ARGS[op]
        metas, ptrs = _describe(names, args, addresses and self.backend.name == "cuda")
        skey = _NO_SCALARS_KEY if scalars is _NO_SCALARS else scalars.key()
        key = None if metas is None or opts.key is None else (op, opts.key, metas, skey)
        try:
            plan = None if key is None else self._plans.get(key)
        except TypeError:  # an unhashable max_seqlen: the plan's checks say why
            key = plan = None
        if plan is None:
            specs = {n: None if x is None else self._spec(n, x) for n, x in zip(names, args)}
            plan = AttentionPlan(self.backend, op, specs, opts, scalars)
            if key is not None:
                if len(self._plans) >= _PLANS_MAX:
                    self._plans.clear()
                self._plans[key] = plan
        elif type(plan.options.seed) is not type(opts.seed) or plan.options.seed != opts.seed:
            plan = plan.reseeded(opts)  # (the type first: a seed of another type is checked)
        return plan, ptrs

    def _spec(self, name: str, x) -> TensorSpec:
        try:
            return TensorSpec.of(x)
        except TypeError as e:
            raise TypeError(f"{name}: {e}") from None

    # --- validation (every check runs before any kernel) ----------------------------------------
    def _tensor(self, name: str, x, contiguous: bool = True) -> UnifiedTensor:
        """`x` as a UnifiedTensor on this engine's device; C-contiguous unless `contiguous` is
        False."""
        try:
            t = x if isinstance(x, UnifiedTensor) else UnifiedTensor(x)
        except TypeError as e:
            raise TypeError(f"{name}: {e}") from None
        check_device(self.backend, name, t)
        if contiguous and not t.is_contiguous:
            raise ValueError(f"{name} (shape {t.shape}) is not C-contiguous (strides "
                             f"{t.buffer().strides}); pass a contiguous copy")
        return t

    def _check_dtype(self, *named) -> None:
        """(name, tensor) pairs: one data dtype the backend takes (see `check_dtypes`)."""
        check_dtypes(self.backend, dict(named))


_PLANS_MAX = 256  # plans kept per engine (a long-running job sees few call shapes)
_NO_BACKWARD_KV_LENS = ("flash_attention_v2_backward_with does not take kv_lens (the forward's "
                        "per-sequence cache lengths); train on unpadded keys or use an additive "
                        "mask")


def _describe(names, args, cuda: bool):
    """(each argument's metadata, {name: device address} of the present ones or None) for
    the kinds of tensor read without wrapping (UnifiedTensor, NumPy, CuPy, PyTorch); (None,
    None) if any other kind is among them. Addresses only where `cuda` and every one is on a
    GPU. (The hot path of every call: PyTorch tensors are read inline.)"""
    torch_tensor = _TORCH_TENSOR[0]
    if not cuda:  # metadata alone
        metas = []
        for x in args:
            if x is None:
                metas.append(None)
            elif type(x) is torch_tensor:
                metas.append((x.shape, x.stride(), x.dtype, x.device))
            else:
                read = _READERS.get(type(x)) or _reader(type(x))
                if read is None:
                    return None, None
                metas.append(read(x)[0])
        return tuple(metas), None
    metas, ptrs = [], {}
    for name, x in zip(names, args):
        if x is None:
            metas.append(None)
            continue
        kind = type(x)
        if kind is torch_tensor:
            dev = x.device
            metas.append((x.shape, x.stride(), x.dtype, dev))
            if ptrs is not None:
                if dev.type == "cuda":
                    ptrs[name] = x.data_ptr()
                else:
                    ptrs = None
            continue
        read = _READERS.get(kind) or _reader(kind)
        if read is None:
            return None, None
        meta, ptr = read(x)
        metas.append(meta)
        if ptrs is not None:
            if ptr is None:
                ptrs = None
            else:
                ptrs[name] = ptr
    return tuple(metas), ptrs


def _read_numpy(a):
    return (a.shape, a.strides, a.dtype, "cpu"), None


def _read_cupy(a):
    data = a.data
    return (a.shape, a.strides, a.dtype, data.device_id), data.ptr


def _read_torch(t):
    dev = t.device
    return (t.shape, t.stride(), t.dtype, dev), t.data_ptr() if dev.type == "cuda" else None


def _read_unified(t):
    a = t.buffer()
    return (_READERS.get(type(a)) or _reader(type(a)))(a)


_READERS = {np.ndarray: _read_numpy, UnifiedTensor: _read_unified}
_TORCH_TENSOR = [None]  # torch.Tensor once a PyTorch tensor was seen: _describe reads it inline


def _reader(kind):
    """The metadata reader of tensors of type `kind` once its library is imported (CuPy's
    ndarray, torch.Tensor), else None (such an argument is wrapped every call)."""
    cupy, torch = sys.modules.get("cupy"), sys.modules.get("torch")
    if cupy is not None and kind is cupy.ndarray:
        _READERS[kind] = _read_cupy
    elif torch is not None and kind is torch.Tensor:
        _READERS[kind] = _read_torch
        _TORCH_TENSOR[0] = kind
    return _READERS.get(kind)


def _shifted(opts: AttentionOptions, shift: int) -> AttentionOptions:
    """`opts` with `shift` added to its causal_offset (validated first, so an error names the
    caller's values)."""
    opts.validate()
    return dataclasses.replace(opts, causal_offset=opts.causal_offset + shift)


def _single_head_view(name: str, x, engine: ComputeEngine) -> UnifiedTensor:
    t = engine._tensor(name, x)
    if len(t.shape) != 2:
        raise ValueError(f"{name} must be a [seq_len, head_dim] tensor, got shape {t.shape}")
    return t.reshaped((1, t.shape[0], 1, t.shape[1]))
