"""PyTorch ops: `attention` and `rope` (autograd, `torch.compile`-able) and in-place `rope_`.

Importable as `ferrocupy.torch` when PyTorch is installed (`pip install 'ferrocupy[torch]'`);
nothing else in ferrocupy needs torch.

Tensors use ferrocupy's layout: `q` is `[B, Sq, H, D]`, `k` and `v` are `[B, Sk, Hkv, D]`
(`H % Hkv == 0`), not torch SDPA's `[B, H, S, D]`. CPU tensors run on the NumPy reference backend
(so this works in a notebook without a GPU), CUDA tensors on the CUDA kernels, launched on torch's
current stream. The forward and the backward are each a `torch.library.custom_op`
(`ferrocupy::attention_fwd`, `ferrocupy::attention_bwd`, with fake kernels for `torch.compile`);
the forward saves its log-sum-exp and the backward takes it, so the forward is never recomputed.
Both run the engine's plans (`ComputeEngine.plan_attention`): its public front door, like every
other caller's.

Inputs need not be contiguous: any view whose last dimension is contiguous (`x.transpose(1, 2)` of
SDPA's `[B, H, S, D]`, one part of a packed QKV tensor) is read where it lies, through its
strides; only a tensor whose last dimension is strided (or broadcast) is copied first.
"""

from __future__ import annotations

import contextlib
import functools
import math
import threading
from typing import Optional

import torch
from torch import Tensor

from .engine import AttentionOptions, ComputeEngine
from .tensor import UnifiedTensor

__all__ = ["attention", "attention_with_kvcache", "context_parallel_attention", "rope", "rope_"]


_REFERENCE = ComputeEngine("reference", quiet=True)  # every CPU tensor
_CUDA: dict[int, ComputeEngine] = {}  # one per GPU, created at first use
_CUDA_LOCK = threading.Lock()
# torch.device -> its engine, for devices that name one engine for good (CPU, a CUDA device with
# its index, as every CUDA tensor's is): one hashed lookup a call instead of reading the
# device's type (a fresh string each time) twice.
_BY_DEVICE: dict = {}


def _engine(device: torch.device) -> ComputeEngine:
    engine = _BY_DEVICE.get(device)
    if engine is None:
        engine = _engine_of(device)
        if device.type == "cpu" or device.index is not None:
            _BY_DEVICE[device] = engine
    return engine


def _engine_of(device: torch.device) -> ComputeEngine:
    if device.type == "cpu":
        return _REFERENCE
    if device.type != "cuda":
        raise ValueError(f"ferrocupy runs on CPU or CUDA tensors, not {device.type}")
    index = torch.cuda.current_device() if device.index is None else device.index
    engine = _CUDA.get(index)
    if engine is None:
        with _CUDA_LOCK:
            engine = _CUDA.get(index)
            if engine is None:
                import cupy

                with cupy.cuda.Device(index):
                    engine = _CUDA[index] = ComputeEngine("cuda", quiet=True)
    return engine


@contextlib.contextmanager
def _on_torch_stream(device: torch.device):
    """CUDA: launch on torch's current stream of `device` (and make it CuPy's current device).
    CPU: nothing to do."""
    if device.type != "cuda":
        yield
        return
    import cupy

    from .cuda.launch import external_stream

    index = torch.cuda.current_device() if device.index is None else device.index
    stream = torch.cuda.current_stream(index).cuda_stream
    with cupy.cuda.Device(index), external_stream(cupy, stream, index):
        yield


def _mask(m: Optional[Tensor]) -> Optional[Tensor]:
    """The mask itself (the kernels gather it through its strides, which the parameter struct
    holds in 32 bits), or a contiguous copy where a stride does not fit."""
    if m is None or all(st < 2**32 for st in m.stride()):
        return m
    return m.contiguous()


def _rows(t: Optional[Tensor]) -> Optional[Tensor]:
    """`t` itself when the kernels can read it through its strides (a contiguous last
    dimension), else a contiguous copy (a broadcast gradient, every other element)."""
    if t is None or t.stride()[-1] == 1 or t.shape[-1] <= 1:
        return t
    return t.contiguous()


def _row_views(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """`_rows` of each, with one test for the common case (every last dimension contiguous)."""
    if q.stride()[-1] == 1 and k.stride()[-1] == 1 and v.stride()[-1] == 1:
        return q, k, v
    return _rows(q), _rows(k), _rows(v)


def _wrap(t: Optional[Tensor]) -> Optional[UnifiedTensor]:
    # detach(): DLPack refuses a tensor that requires grad, as the op's inputs may (no copy).
    return None if t is None else UnifiedTensor(t.detach())


# torch's current raw stream of a device (a CUDA build of torch has it; else see _stream)
_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _stream(device: torch.device) -> int:
    """torch's current stream on `device`, as a CUstream handle."""
    index = device.index
    if index is None:
        index = torch.cuda.current_device()
    if _RAW_STREAM is not None:
        return _RAW_STREAM(index)
    return torch.cuda.current_stream(index).cuda_stream


def _run(plan, named: dict, fresh=()) -> None:
    """Run an engine plan on torch tensors (`named`: the plan's argument names, None for an
    absent one): CUDA ones through their addresses (`_run_cuda`), CPU ones on the reference
    backend."""
    q = named["q"]
    if q.is_cuda:
        _run_cuda(plan, {n: t.data_ptr() for n, t in named.items() if t is not None}, q.device,
                  fresh)
    else:
        plan.run(**named)


def _run_cuda(plan, pointers: dict, device: torch.device, fresh=()) -> None:
    """Run an engine plan on the CUDA tensors at `pointers` (name -> address) on torch's current
    stream, with the workspace (decode splits, backward stats) from torch's allocator (ordered on
    torch's stream, and kept by a CUDA graph that captures the call). `fresh`: the outputs this
    module just made with torch.empty (they overlap nothing)."""
    plan.run_pointers(pointers, stream=_stream(device),
                      alloc=lambda shape: torch.empty(*shape, dtype=torch.float32, device=device),
                      capturing=torch.cuda.is_current_stream_capturing, fresh=fresh)


def _seed_int(seed: Optional[Tensor]) -> int:
    """The op's int64 seed tensor as the engine's seed in [0, 2**64); None (a call without
    dropout, whose seed nothing reads) is 0."""
    return 0 if seed is None else int(seed) % 2**64


def _options(causal, causal_offset, window, dropout_p, seed: Optional[Tensor], scale,
             window_left=None, window_right=None, softcap=0.0) -> AttentionOptions:
    return _options_of(causal, causal_offset, window, dropout_p, _seed_int(seed), scale,
                       window_left, window_right, softcap)


@functools.lru_cache(maxsize=256)  # a frozen dataclass: one object per set of values, reused
def _options_of(causal, causal_offset, window, dropout_p, seed: int, scale, window_left=None,
                window_right=None, softcap=0.0) -> AttentionOptions:
    return AttentionOptions(causal=causal, causal_offset=causal_offset, window=window,
                            dropout_prob=dropout_p, seed=seed, scale=scale,
                            window_left=window_left, window_right=window_right, softcap=softcap)


# --- attention: forward -----------------------------------------------------------------------
def _fwd_body(q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor], causal: bool,
              causal_offset: int, window: int, dropout_p: float, seed: Optional[Tensor],
              scale: Optional[float], kv_lens: Optional[Tensor], window_left: Optional[int] = None,
              window_right: Optional[int] = None, softcap: float = 0.0,
              alibi_slopes: Optional[Tensor] = None,
              sinks: Optional[Tensor] = None, cu_seqlens_q: Optional[Tensor] = None,
              cu_seqlens_k: Optional[Tensor] = None, max_seqlen_q: Optional[int] = None,
              max_seqlen_k: Optional[int] = None,
              block_table: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """(out [B, Sq, H, D] in q's dtype, lse float32 [B, H, Sq]; varlen: out [total_q, H, D],
    lse [H, total_q]): the forward op's body."""
    q, k, v = _row_views(q, k, v)
    mask = _mask(attn_mask)
    lens = None if kv_lens is None else kv_lens.contiguous()
    opts = _options(causal, causal_offset, window, dropout_p, seed, scale, window_left,
                    window_right, softcap)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if cu_seqlens_q is None:
        B, Sq, H, _ = q.shape
        # (sizes as separate arguments: torch parses them ~0.7 us faster than a tuple)
        lse = torch.empty(B, H, Sq, dtype=torch.float32, device=q.device)
    else:
        lse = torch.empty(_lse_shape(q, cu_seqlens_q), dtype=torch.float32, device=q.device)
    index = (_NO_INDEX if cu_seqlens_q is None and cu_seqlens_k is None and block_table is None
             else _index_tensors(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                                 block_table=block_table))
    named = {"q": q, "k": k, "v": v, "out": out, "mask": mask, "lse": lse, "kv_lens": lens,
             "alibi_slopes": alibi_slopes, "sinks": sinks, **index}
    _run(_engine(q.device).plan_attention(q, k, v, out, opts, mask, lse=lse, kv_lens=lens,
                                          alibi_slopes=alibi_slopes, sinks=sinks,
                                          max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                                          **index), named,
         fresh=("out", "lse"))
    return out, lse


def _lse_shape(q: Tensor, cu_seqlens_q: Optional[Tensor]) -> tuple:
    """The forward's lse: `[B, H, Sq]`, or `[H, total_q]` for a varlen (packed) q."""
    if cu_seqlens_q is not None:
        return (q.shape[-2], q.shape[0])
    B, Sq, H, _ = q.shape
    return (B, H, Sq)


_NO_INDEX: dict = {}  # a call without index tensors (never written)


def _index_tensors(**named: Optional[Tensor]) -> dict:
    """Tensors the engine takes C-contiguous (cu_seqlens, block_table, an append's new keys and
    RoPE tables): themselves, or a copy where a view is not."""
    return {n: None if t is None else t.contiguous() for n, t in named.items()}


_attention_fwd = torch.library.custom_op("ferrocupy::attention_fwd", _fwd_body, mutates_args=())


@_attention_fwd.register_fake
def _(q, k, v, attn_mask, causal, causal_offset, window, dropout_p, seed, scale, kv_lens,
      window_left=None, window_right=None, softcap=0.0, alibi_slopes=None, sinks=None,
      cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
      block_table=None):
    return q.new_empty(q.shape), q.new_empty(_lse_shape(q, cu_seqlens_q), dtype=torch.float32)


# --- attention: backward ----------------------------------------------------------------------
def _bwd_body(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
              attn_mask: Optional[Tensor], causal: bool, causal_offset: int, window: int,
              dropout_p: float, seed: Optional[Tensor], scale: Optional[float],
              window_left: Optional[int] = None, window_right: Optional[int] = None,
              softcap: float = 0.0, alibi_slopes: Optional[Tensor] = None,
              sinks: Optional[Tensor] = None, cu_seqlens_q: Optional[Tensor] = None,
              cu_seqlens_k: Optional[Tensor] = None, max_seqlen_q: Optional[int] = None,
              max_seqlen_k: Optional[int] = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(grad_q, grad_k, grad_v, grad_sinks), given the forward's `out` and `lse` (never
    recomputed): the backward op's body. grad_sinks is float32 `[H]` with sinks, else empty."""
    (q, k, v), out = _row_views(q, k, v), _rows(out)
    lse = lse.contiguous()
    grad_out = _rows(grad_out.to(q.dtype))
    mask = _mask(attn_mask)
    opts = _options(causal, causal_offset, window, dropout_p, seed, scale, window_left,
                    window_right, softcap)
    gq, gk, gv = (torch.empty_like(x, memory_format=torch.contiguous_format) for x in (q, k, v))
    gs = _grad_sinks_like(q, sinks)
    has_gs = sinks is not None
    index = (_NO_INDEX if cu_seqlens_q is None and cu_seqlens_k is None
             else _index_tensors(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k))
    plan = _engine(q.device).plan_attention_backward(
        q, k, v, out, grad_out, gq, gk, gv, opts, mask, lse=lse, alibi_slopes=alibi_slopes,
        sinks=sinks, grad_sinks=gs if has_gs else None, max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k, **index)
    _run(plan, {"q": q, "k": k, "v": v, "out": out, "grad_out": grad_out, "grad_q": gq,
                "grad_k": gk, "grad_v": gv, "mask": mask, "lse": lse,
                "alibi_slopes": alibi_slopes, "sinks": sinks,
                "grad_sinks": gs if has_gs else None, **index},
         fresh=("grad_q", "grad_k", "grad_v", "grad_sinks"))
    return gq, gk, gv, gs


def _grad_sinks_like(q: Tensor, sinks: Optional[Tensor]) -> Tensor:
    """The backward's grad_sinks output: float32 like `sinks`, or empty `[0]` without sinks (an
    op returns a tensor either way)."""
    shape = (0,) if sinks is None else tuple(sinks.shape)
    return q.new_empty(shape, dtype=torch.float32)


_attention_bwd = torch.library.custom_op("ferrocupy::attention_bwd", _bwd_body, mutates_args=())


@_attention_bwd.register_fake
def _(grad_out, q, k, v, out, lse, attn_mask, causal, causal_offset, window, dropout_p, seed,
      scale, window_left=None, window_right=None, softcap=0.0, alibi_slopes=None, sinks=None,
      cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None):
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape),
            _grad_sinks_like(q, sinks))


def _setup_context(ctx, inputs, output):
    (q, k, v, attn_mask, causal, causal_offset, window, dropout_p, seed, scale, kv_lens,
     window_left, window_right, softcap, alibi_slopes, sinks, cu_seqlens_q, cu_seqlens_k,
     max_seqlen_q, max_seqlen_k, block_table) = _full_inputs(inputs)
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, attn_mask, seed, alibi_slopes, sinks, cu_seqlens_q,
                          cu_seqlens_k)
    ctx.options = (causal, causal_offset, window, dropout_p, scale, window_left, window_right,
                   softcap)
    ctx.max_seqlens = (max_seqlen_q, max_seqlen_k)
    ctx.has_kv_lens = kv_lens is not None or block_table is not None
    ctx.n_inputs = len(inputs)


# the forward op's trailing optional arguments
_OP_DEFAULTS = (None, None, 0.0, None, None, None, None, None, None, None)
_SINKS_INPUT = 15  # sinks' place among the forward op's inputs


def _full_inputs(inputs: tuple) -> tuple:
    """The forward op's 21 inputs, the trailing defaults filled in where a call left them out."""
    return tuple(inputs) + _OP_DEFAULTS[len(inputs) - 11:]


def _backward(ctx, grad_out, grad_lse, bwd=None):
    # lse is not differentiable (`attention` does not return it); `grad_lse` is ignored. `bwd`:
    # the backward op (the default), or its body (the eager Function).
    if ctx.has_kv_lens:
        raise ValueError("ferrocupy.torch.attention has no backward with kv_lens or block_table "
                         "(a KV cache is for inference); train on unpadded keys, packed "
                         "sequences (cu_seqlens) or an additive attn_mask")
    q, k, v, out, lse, attn_mask, seed, alibi_slopes, sinks, cu_q, cu_k = ctx.saved_tensors
    causal, causal_offset, window, dropout_p, scale, window_left, window_right, softcap = \
        ctx.options
    gq, gk, gv, gs = (bwd or _attention_bwd)(grad_out, q, k, v, out, lse, attn_mask, causal,
                                             causal_offset, window, dropout_p, seed, scale,
                                             window_left, window_right, softcap, alibi_slopes,
                                             sinks, cu_q, cu_k, *ctx.max_seqlens)
    # None for every input but q, k, v and sinks (no gradient for the mask, the slopes or the
    # index tensors)
    grads = [gq, gk, gv] + [None] * (len(_OP_DEFAULTS) + 8)
    grads[_SINKS_INPUT] = None if sinks is None else gs
    return tuple(grads[:ctx.n_inputs])


torch.library.register_autograd("ferrocupy::attention_fwd", _backward,
                                setup_context=_setup_context)


class _EagerAttention(torch.autograd.Function):
    """The same forward and backward as the ops (their bodies, `_setup_context`, `_backward`),
    for eager calls that need a gradient: a custom op with autograd costs about 100 us of host
    time per call more than this (measured on CPU tensors), more than a decode step's kernel.
    torch.compile and tensor subclasses take the ops."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, rest, tail=()):
        # `rest`, `tail`: the op's other arguments before and after sinks, in its order, as
        # one argument each (apply's per-argument bookkeeping is a good part of its cost); none
        # of them takes a gradient.
        inputs = (q, k, v, *rest, sinks, *tail)
        out, lse = _fwd_body(*inputs)
        _setup_context(ctx, inputs, (out, lse))
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable  # as the op: no double backward, an error
    def backward(ctx, grad_out, grad_lse):
        grads = _backward(ctx, grad_out, grad_lse, bwd=_bwd_body)
        return grads[:3] + (grads[_SINKS_INPUT], None, None)


def _seed_tensor(seed: Optional[int], dropout_p: float) -> Optional[Tensor]:
    """The ops' `seed`: None for a call without dropout (nothing reads it; no CPU tensor enters
    a compiled graph, where CUDA graph trees refuse one as an input of a captured partition:
    torch.compile(mode="reduce-overhead"), as transformers' static-cache generate runs); else
    an int64 CPU scalar."""
    if seed is None:
        if not dropout_p:
            return None  # (torch's RNG left alone)
        # A fresh seed from torch's default CPU generator (torch.manual_seed makes it
        # reproducible); a tensor, so that torch.compile traces it with no graph break.
        return torch.randint(-2**63, 2**63 - 1, (), dtype=torch.int64)
    if isinstance(seed, Tensor):
        return seed.to(device="cpu", dtype=torch.int64).reshape(()) if dropout_p else None
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**64:
        raise ValueError(f"seed must be None or an int in [0, 2**64), got {seed!r}")
    if not dropout_p:
        return None
    return torch.tensor(seed - 2**64 if seed >= 2**63 else seed, dtype=torch.int64)


def attention(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False, causal_offset: int = 0,
              window: int = 0, dropout_p: float = 0.0, seed: Optional[int] = None,
              attn_mask: Optional[Tensor] = None, scale: Optional[float] = None,
              kv_lens: Optional[Tensor] = None, softcap: float = 0.0,
              window_left: Optional[int] = None, window_right: Optional[int] = None,
              alibi_slopes: Optional[Tensor] = None, sinks: Optional[Tensor] = None,
              cu_seqlens_q: Optional[Tensor] = None, cu_seqlens_k: Optional[Tensor] = None,
              max_seqlen_q: Optional[int] = None, max_seqlen_k: Optional[int] = None,
              block_table: Optional[Tensor] = None,
              return_lse: bool = False) -> Tensor | tuple[Tensor, Tensor]:
    """Fused attention with autograd; returns `out`, `[B, Sq, H, D]` in q's dtype (with
    `return_lse`, `(out, lse)`: lse float32 `[B, H, Sq]` (varlen: `[H, total_q]`), SPEC's
    log-sum-exp, not differentiable).

    - `q`: `[B, Sq, H, D]`; `k`, `v`: `[B, Sk, Hkv, D]` (ferrocupy's layout, not SDPA's
      `[B, H, S, D]`: pass `x.transpose(1, 2)` to convert). float32, float16 or bfloat16, all
      one dtype, all on one device (CPU: the NumPy reference backend; CUDA: the kernels, on
      torch's current stream). Any view with a contiguous last dimension is read in place
      (`x.transpose(1, 2)` of SDPA's layout costs no copy); others are copied first.
    - `causal`, `causal_offset`, `window`: query `i` sits at position `i + causal_offset` and sees
      key `j` iff (`not causal` or `j <= i + causal_offset`) and (`window == 0` or
      `|i + causal_offset - j| < window`).
    - `attn_mask`: additive, rank 4, each dimension 1 or the full `[B, H, Sq, Sk]` size, float32
      or q's dtype; a bool mask (True: take part, as in SDPA) is turned into 0 / -inf. It gets no
      gradient.
    - `dropout_p`, `seed`: dropout on the attention weights, Philox-generated from `seed` (the
      same mask in the forward and the backward). `seed=None` draws a fresh seed from torch's
      default generator on each call (reproducible under `torch.manual_seed`); the backward
      reuses that call's seed.
    - `scale`: the softmax scale, default `1/sqrt(D)`.
    - `kv_lens`: int32 `[B]` on q's device, per-sequence lengths of a preallocated KV cache:
      sequence `b` has `kv_lens[b]` keys (the slots past them are never read) and its queries
      sit `kv_lens[b] - Sk` positions earlier. Inference only: the backward refuses it.
    - `causal_offset` may be negative (rows below position 0 see no key under causal: out 0);
      `window_left`, `window_right` (each -1: unbounded; None: -1 once the other is given): key
      `j` is visible iff `a - window_left <= j <= a + window_right` (give them or `window`).
    - `softcap` (> 0): each scaled score `x` becomes `softcap * tanh(x / softcap)`.
    - `alibi_slopes`: float32 `[H]` or `[B, H]`, adds `-slope * |a - j|` to each score (no
      gradient). `sinks`: float32 `[H]`, a per-head logit in each row's softmax denominator;
      it gets a gradient.
    - `cu_seqlens_q`, `cu_seqlens_k` (int32 `[N + 1]`), `max_seqlen_q`, `max_seqlen_k` (ints):
      packed variable-length sequences (varlen): `q` is `[total_q, H, D]`, `k`, `v` `[total_k,
      Hkv, D]`, out like q; sequence n is rows `cu_seqlens_q[n]..<cu_seqlens_q[n+1]` over keys
      `cu_seqlens_k[n]..<cu_seqlens_k[n+1]`, every option applied inside it, each sequence
      right-aligned in a `[max_seqlen_q, max_seqlen_k]` frame (so `causal_offset =
      max_seqlen_k - max_seqlen_q` is bottom-right in each, and 0 is plain causal for packed
      self-attention). Gradients for q, k, v and sinks. No attn_mask or kv_lens with it.
    - `block_table` (int32 `[B, max_blocks]`): a paged KV cache: `k`, `v` are `[num_blocks,
      page_size, Hkv, D]`, key j of batch b is row `j % page_size` of block
      `block_table[b, j // page_size]` (with `kv_lens` as the cache lengths over a capacity of
      `max_blocks * page_size`). Inference only, as kv_lens.
    Varlen runs on both (the CUDA kernels: one launch per kernel for the packed batch); a paged
    cache too (on CUDA tensors the decode kernels up to 16 query rows a KV group, the forward's
    paged builds beyond).
    """
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        attn_mask = torch.zeros(attn_mask.shape, dtype=torch.float32,
                                device=attn_mask.device).masked_fill(~attn_mask, -math.inf)
    if (kv_lens is not None or block_table is not None) and torch.is_grad_enabled() and any(
            x.requires_grad for x in (q, k, v)):
        # Refused here, not in the backward: torch.compile traces the backward ahead of time.
        raise ValueError("ferrocupy.torch.attention has no backward with kv_lens or block_table "
                         "(a KV cache is for inference): call it under torch.no_grad() or "
                         "with inputs that do not require grad")
    # the op's arguments after sinks (none in the common call: tested one by one, the cheapest)
    if (cu_seqlens_q is None and cu_seqlens_k is None and max_seqlen_q is None
            and max_seqlen_k is None and block_table is None):
        tail = ()
    else:
        tail = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table)
    if (not return_lse and alibi_slopes is None and sinks is None and not tail
            and _eager_inference(q, k, v, attn_mask, kv_lens)):
        return _forward_now(q, k, v, attn_mask, causal, causal_offset, window, float(dropout_p),
                            seed, None if scale is None else float(scale), kv_lens, window_left,
                            window_right, float(softcap))
    windows = (window_left, window_right, float(softcap))
    eager = _plain_eager(q, k, v, attn_mask, kv_lens) and all(
        x is None or type(x) is Tensor for x in (alibi_slopes, sinks, cu_seqlens_q,
                                                 cu_seqlens_k, block_table))
    seed_t = _seed_tensor(seed, dropout_p)
    rest = (attn_mask, causal, causal_offset, window, float(dropout_p), seed_t,
            None if scale is None else float(scale), kv_lens, *windows, alibi_slopes)
    out, lse = (_EagerAttention.apply(q, k, v, sinks, rest, tail) if eager
                else _attention_fwd(q, k, v, *rest, sinks, *tail))
    # lse is detached: the backward ignores its gradient, so none may flow into it
    return (out, lse.detach()) if return_lse else out


# --- eager calls without the ops ----------------------------------------------------------------
# The custom ops' dispatch and autograd bookkeeping cost 20 us (no gradient) to 100 us (with
# autograd) of host time per call, more than a decode step's kernel. Eager calls on plain tensors
# skip them: one that needs a gradient runs the ops' bodies through `_EagerAttention`; one on
# CUDA that no gradient will flow through (inference, or under torch.no_grad()) runs the forward
# body directly, with no lse. Same checks, kernels, stream and answers. torch.compile, tensor
# subclasses and functorch transforms (fake tensors, vmap) take the ops.
_is_compiling = getattr(getattr(torch, "compiler", None), "is_compiling", lambda: False)
_is_wrapped = getattr(getattr(torch._C, "_functorch", None), "is_functorch_wrapped_tensor",
                      lambda t: False)


def _plain_eager(q, k, v, attn_mask, kv_lens) -> bool:
    """Plain tensors, outside torch.compile and functorch transforms."""
    if not (type(q) is Tensor and type(k) is Tensor and type(v) is Tensor):
        return False
    if attn_mask is not None and type(attn_mask) is not Tensor:
        return False
    if kv_lens is not None and type(kv_lens) is not Tensor:
        return False
    return not (_is_compiling() or _is_wrapped(q) or _is_wrapped(k) or _is_wrapped(v))


def _eager_inference(q, k, v, attn_mask, kv_lens) -> bool:
    """A plain eager call on CUDA that no gradient flows through."""
    if not q.is_cuda:
        return False
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return False
    return _plain_eager(q, k, v, attn_mask, kv_lens)


def _forward_now(q, k, v, attn_mask, causal, causal_offset, window, dropout_p, seed, scale,
                 kv_lens, window_left=None, window_right=None, softcap=0.0) -> Tensor:
    seed_int = _seed_int(_seed_tensor(seed, dropout_p))
    opts = _options_of(causal, causal_offset, window, dropout_p, seed_int, scale, window_left,
                       window_right, softcap)
    # (A tensor on another device than q's fails the engine's checks, which name it: the first
    # call of a combination, devices included, goes through them.)
    q, k, v = _row_views(q, k, v)
    if attn_mask is not None:
        attn_mask = _mask(attn_mask)
    lens = None if kv_lens is None else kv_lens.contiguous()
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    device = q.device
    plan = _engine(device).plan_attention(q, k, v, out, opts, attn_mask, kv_lens=lens)
    pointers = {"q": q.data_ptr(), "k": k.data_ptr(), "v": v.data_ptr(), "out": out.data_ptr()}
    if attn_mask is not None:
        pointers["mask"] = attn_mask.data_ptr()
    if lens is not None:
        pointers["kv_lens"] = lens.data_ptr()
    _run_cuda(plan, pointers, device, _OUT)
    return out


_OUT = ("out",)


# --- KV-cache append -------------------------------------------------------------------------
def attention_with_kvcache(q: Tensor, k_cache: Tensor, v_cache: Tensor,
                           k_new: Optional[Tensor] = None, v_new: Optional[Tensor] = None, *,
                           cache_seqlens, block_table: Optional[Tensor] = None,
                           rotary_cos: Optional[Tensor] = None,
                           rotary_sin: Optional[Tensor] = None, rotary_interleaved: bool = False,
                           causal: bool = False, window_left: int = -1, window_right: int = -1,
                           softcap: float = 0.0, alibi_slopes: Optional[Tensor] = None,
                           scale: Optional[float] = None, return_lse: bool = False):
    """FlashAttention's `flash_attn_with_kvcache` (inference only): appends `k_new`, `v_new`
    to the cache in place, then attends; returns `out` `[B, Sq, H, D]`, or `(out, lse)` with
    `return_lse` (lse float32 `[B, H, Sq]`).

    - `q`: `[B, Sq, H, D]`; `k_cache`, `v_cache`: `[B, capacity, Hkv, D]`, or with
      `block_table` (int32 `[B, max_blocks]`) a paged cache `[num_blocks, page_size, Hkv, D]`
      (key j of batch b: row `j % page_size` of block `block_table[b, j // page_size]`).
    - `cache_seqlens`: int32 `[B]` (int64 is converted; an int is every sequence's): the keys
      already in the cache. Not updated.
    - `k_new`, `v_new`: `[B, Sn, Hkv, D]`, written at `cache_seqlens[b] ..< cache_seqlens[b] +
      Sn` (past the capacity: an error, nothing written), rotated first with `rotary_cos`,
      `rotary_sin` (`[seqlen_ro, rotary_dim / 2]`, flash-attn's tables; rotate-half, or pairs
      `(x[2i], x[2i+1])` with `rotary_interleaved`); q is rotated too, at `cache_seqlens[b] + i`
      when causal or windowed, else at `cache_seqlens[b]`.
    - The attention sees `cache_seqlens[b] + Sn` keys, bottom-right aligned (row i at
      `cache_seqlens[b] + Sn - Sq + i`): `causal`, `window_left`, `window_right` (-1:
      unbounded), `softcap`, `alibi_slopes` (float32 `[H]` or `[B, H]`), `scale` as in
      `attention`.
    CPU tensors run the reference backend; CUDA tensors the kernels (a paged cache with more
    than 16 query rows a KV group: the forward's paged builds)."""
    if torch.is_grad_enabled() and any(x is not None and x.requires_grad
                                       for x in (q, k_cache, v_cache, k_new, v_new)):
        raise ValueError("ferrocupy.torch.attention_with_kvcache has no backward (a KV cache is "
                         "for inference): call it under torch.no_grad() or with inputs that do "
                         "not require grad")
    if isinstance(cache_seqlens, int):
        cache_seqlens = torch.full((q.shape[0],), cache_seqlens, dtype=torch.int32,
                                   device=q.device)
    elif isinstance(cache_seqlens, Tensor) and cache_seqlens.dtype == torch.int64:
        cache_seqlens = cache_seqlens.to(torch.int32)
    if not isinstance(cache_seqlens, Tensor):
        raise TypeError(f"cache_seqlens must be an int or an int32 tensor [batch], got "
                        f"{type(cache_seqlens).__name__}")
    out, lse = _attention_with_kvcache(
        q, k_cache, v_cache, k_new, v_new, cache_seqlens, block_table, rotary_cos, rotary_sin,
        bool(rotary_interleaved), bool(causal), int(window_left), int(window_right),
        float(softcap), alibi_slopes, None if scale is None else float(scale), bool(return_lse))
    return (out, lse) if return_lse else out


@torch.library.custom_op("ferrocupy::attention_with_kvcache", mutates_args=("k_cache", "v_cache"))
def _attention_with_kvcache(q: Tensor, k_cache: Tensor, v_cache: Tensor, k_new: Optional[Tensor],
                            v_new: Optional[Tensor], cache_seqlens: Tensor,
                            block_table: Optional[Tensor], rotary_cos: Optional[Tensor],
                            rotary_sin: Optional[Tensor], rotary_interleaved: bool, causal: bool,
                            window_left: int, window_right: int, softcap: float,
                            alibi_slopes: Optional[Tensor], scale: Optional[float],
                            return_lse: bool) -> tuple[Tensor, Tensor]:
    """The append op (the cache written in place): (out, lse), lse empty `[0]` unless
    `return_lse`."""
    opts = _options_of(causal, 0, 0, 0.0, 0, scale,
                       None if window_left == -1 else window_left,
                       None if window_right == -1 else window_right, softcap)
    lens = cache_seqlens.contiguous()
    q = _rows(q)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.empty(_kvcache_lse_shape(q, return_lse), dtype=torch.float32, device=q.device)
    named = _index_tensors(k_new=k_new, v_new=v_new, block_table=block_table,
                           rotary_cos=rotary_cos, rotary_sin=rotary_sin)
    kept_lse = lse if return_lse else None
    plan = _engine(q.device).plan_attention_with_kvcache(
        q, k_cache, v_cache, out, opts, cache_seqlens=lens, lse=kept_lse,
        alibi_slopes=alibi_slopes, rotary_interleaved=rotary_interleaved, **named)
    _run(plan, {"q": q, "k": k_cache, "v": v_cache, "out": out, "lse": kept_lse, "kv_lens": lens,
                "alibi_slopes": alibi_slopes, **named}, fresh=("out", "lse"))
    return out, lse


def _kvcache_lse_shape(q: Tensor, return_lse: bool) -> tuple:
    B, Sq, H, _ = q.shape
    return (B, H, Sq) if return_lse else (0,)


@_attention_with_kvcache.register_fake
def _(q, k_cache, v_cache, k_new, v_new, cache_seqlens, block_table, rotary_cos, rotary_sin,
      rotary_interleaved, causal, window_left, window_right, softcap, alibi_slopes, scale,
      return_lse):
    return q.new_empty(q.shape), q.new_empty(_kvcache_lse_shape(q, return_lse),
                                             dtype=torch.float32)


# --- RoPE -------------------------------------------------------------------------------------
# `rope` is the op `ferrocupy::rope` (out of place, with autograd: the gradient of a rotation is
# the rotation by the negative angle, the same op with `inverse` flipped); `rope_` is the op
# `ferrocupy::rope_` (in place, no gradient). Both call the engine's `rope_theta`, which reads
# any view whose head_dim elements are contiguous through its strides (a part of a fused QKV
# projection, SDPA's layout transposed) and remembers what depends only on the call's shapes.


def _rope_rows(x: Tensor) -> Tensor:
    """`x` itself when the engine can read it where it lies (head_dim contiguous), else a
    contiguous copy (a gradient broadcast from a sum, say)."""
    return x if x.shape[-1] <= 1 or x.stride(-1) == 1 else x.contiguous()


def _rope_into(x: Tensor, out: Optional[Tensor], head_dim: int, pos: int, theta: float,
               positions: Optional[Tensor], rotary_dim: Optional[int], interleaved: bool,
               inverse: bool) -> None:
    """The engine's RoPE of `x` into `out` (None: in place), on torch's current stream."""
    engine = _engine(x.device)
    with _on_torch_stream(x.device):
        engine.rope_theta(_wrap(x), head_dim, pos, theta, positions=_wrap(positions),
                          rotary_dim=rotary_dim, interleaved=interleaved, inverse=inverse,
                          out=_wrap(out))


@torch.library.custom_op("ferrocupy::rope", mutates_args=())
def _rope(x: Tensor, head_dim: int, pos: int, theta: float, positions: Optional[Tensor],
          rotary_dim: Optional[int], interleaved: bool, inverse: bool) -> Tensor:
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _rope_into(_rope_rows(x), out, head_dim, pos, theta, positions, rotary_dim, interleaved,
               inverse)
    return out


@_rope.register_fake
def _(x, head_dim, pos, theta, positions, rotary_dim, interleaved, inverse):
    return x.new_empty(x.shape)


def _rope_setup_context(ctx, inputs, output):
    x, head_dim, pos, theta, positions, rotary_dim, interleaved, inverse = inputs
    ctx.save_for_backward(positions)
    ctx.options = (head_dim, pos, theta, rotary_dim, interleaved, inverse)


def _rope_backward(ctx, grad):
    head_dim, pos, theta, rotary_dim, interleaved, inverse = ctx.options
    (positions,) = ctx.saved_tensors
    grad_x = _rope(grad, head_dim, pos, theta, positions, rotary_dim, interleaved, not inverse)
    return grad_x, None, None, None, None, None, None, None


torch.library.register_autograd("ferrocupy::rope", _rope_backward,
                                setup_context=_rope_setup_context)


def rope(x: Tensor, head_dim: int, pos: int = 0, theta: float = 10000.0, *,
         positions: Optional[Tensor] = None, rotary_dim: Optional[int] = None,
         interleaved: bool = False) -> Tensor:
    """RoPE of `x` as a new tensor (contiguous, x's dtype), with autograd; `x` is left as it is.

    - `x`: `[B, S, H, D]`, `[B, S, H*D]` or `[S, H*D]` (`D = head_dim`, even), float32, float16
      or bfloat16, on CPU (the NumPy reference backend) or CUDA (the kernel, on torch's current
      stream). Any view whose head_dim elements are contiguous and whose heads are evenly
      spaced (q or k sliced from a fused QKV projection) is read where it lies.
    - Token `s` of each sequence sits at `pos + s`, or at `positions[s]` / `positions[b, s]`:
      int32 or int64 `[S]` or `[B, S]` (`[1, S]` too) on x's device, e.g. transformers'
      `position_ids` (then `pos` is 0). Positions get no gradient.
    - `theta`: the base frequency (a Hugging Face config's `rope_theta`).
    - `rotary_dim`: rotate only the first `rotary_dim` features of each head (even, at most
      `head_dim`; frequencies over `rotary_dim`, Hugging Face's `partial_rotary_factor`); the
      rest pass through.
    - `interleaved`: rotate the pairs `(x[2i], x[2i+1])` (GPT-J, GPT-NeoX's `rotary_interleaved`)
      instead of `(x[i], x[i + rotary_dim/2])` (rotate-half, Llama's).
    The gradient is the rotation by the negative angle (`torch.compile`-able, no graph break)."""
    return _rope(x, head_dim, pos, float(theta), positions, rotary_dim, interleaved, False)


@torch.library.custom_op("ferrocupy::rope_", mutates_args=("x",))
def _rope_(x: Tensor, head_dim: int, pos: int, theta: float, positions: Optional[Tensor] = None,
           rotary_dim: Optional[int] = None, interleaved: bool = False) -> None:
    target = _rope_rows(x)
    _rope_into(target, None, head_dim, pos, theta, positions, rotary_dim, interleaved, False)
    if target is not x:
        x.copy_(target)


@_rope_.register_fake
def _(x, head_dim, pos, theta, positions=None, rotary_dim=None, interleaved=False):
    return None


def rope_(x: Tensor, head_dim: int, pos: int = 0, theta: float = 10000.0, *,
          positions: Optional[Tensor] = None, rotary_dim: Optional[int] = None,
          interleaved: bool = False) -> Tensor:
    """`rope` in place: rotates `x` (`[B, S, H, D]`, `[B, S, H*D]` or `[S, H*D]`; token `s` at
    `pos + s` or at `positions`) and returns it. It has no gradient, so a tensor autograd records
    is refused with a RuntimeError, as PyTorch refuses in-place ops on a leaf that requires grad
    (under `torch.no_grad()` it is rotated). A view whose head_dim elements are not contiguous is
    rotated through a contiguous copy, written back."""
    if x.requires_grad and torch.is_grad_enabled():
        if x.is_leaf:
            raise RuntimeError(
                f"a leaf Variable that requires grad is being used in an in-place operation "
                f"(ferrocupy.torch.rope_ on x of shape {tuple(x.shape)}); use "
                f"ferrocupy.torch.rope(x, ...), which returns a new tensor and has a gradient")
        raise RuntimeError(
            f"ferrocupy.torch.rope_ has no gradient, and x (shape {tuple(x.shape)}) requires "
            f"grad: rotating it in place would give a wrong gradient; use "
            f"ferrocupy.torch.rope(x, ...), which returns a new tensor and has a gradient, or "
            f"call rope_ under torch.no_grad()")
    _rope_(x, head_dim, pos, float(theta), positions, rotary_dim, interleaved)
    return x


# Ring attention (issue 28) lives in its own module, which imports this one inside its calls.
from .context_parallel import context_parallel_attention  # noqa: E402 - after what it uses
