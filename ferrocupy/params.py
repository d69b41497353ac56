"""Shapes and packed parameter structs, word for word as the seed packs its uniforms.

Each struct is a NumPy structured scalar whose bytes are the seed's little-endian 32-bit words in
the seed's order; the CUDA kernels receive exactly these bytes as a struct passed by value, and the
reference backend reads the same fields, so both see one source of truth.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

MAX_HEAD_DIM = 256  # SPEC's limit for attention; a backend may take less (its max_head_dim)


def _struct(fields: list[tuple[str, str]]) -> np.dtype:
    return np.dtype([(name, np.dtype(kind).newbyteorder("<")) for name, kind in fields])


ROPE_PARAMS = _struct([
    ("head_dim", "u4"), ("seq_len", "u4"), ("pos", "u4"), ("heads", "u4"),
    ("theta", "f4"), ("rotary_dim", "u4"), ("flags", "u4"), ("_pad0", "u4"),
])
# RoPE's `flags` word (0 in a seed call, as is `rotary_dim`: 0 means the whole head_dim).
ROPE_INTERLEAVED = 1  # pairs (x[2i], x[2i+1]) (GPT-J) instead of (x[i], x[i + rotary_dim/2])
ROPE_INVERSE = 2  # rotate by the negative angle (the gradient of the rotation)
ROPE_POSITIONS = 4  # token (b, s) sits at positions[b, s] (or positions[s]), not at pos + s
ROPE_POSITIONS_INT64 = 8  # those positions are int64 (else int32)

# causal_offset is a signed word (int32, two's complement): the seed's values keep their bytes.
_MASK_FIELDS = [("has_mask", "u4"), ("causal_offset", "i4"), ("mask_stride_b", "u4"),
                ("mask_stride_h", "u4"), ("mask_stride_q", "u4"), ("mask_stride_k", "u4"),
                ("window", "u4"), ("_pad0", "u4"), ("_pad1", "u4"), ("_pad2", "u4")]

FLASH_V2_PARAMS = _struct([
    ("batch", "u4"), ("heads", "u4"), ("seq_q", "u4"), ("seq_k", "u4"), ("head_dim", "u4"),
    ("causal", "u4"), ("scale", "f4"), ("kv_heads", "u4"), ("dropout_prob", "f4"),
    ("seed", "u4"), *_MASK_FIELDS,
])

FLASH_BWD_PARAMS = _struct([
    ("batch", "u4"), ("heads", "u4"), ("seq_q", "u4"), ("seq_k", "u4"), ("head_dim", "u4"),
    ("kv_heads", "u4"), ("scale", "f4"), ("dropout_prob", "f4"), ("seed", "u4"),
    ("causal", "u4"), *_MASK_FIELDS,
])

assert ROPE_PARAMS.itemsize == 32 and FLASH_V2_PARAMS.itemsize == 80
assert FLASH_BWD_PARAMS.itemsize == 80


def forward_params_of(bwd: np.void) -> np.void:
    """The forward's struct (FLASH_V2_PARAMS) of the call a backward's (FLASH_BWD_PARAMS)
    describes, without dropout: the forward a backward runs for its rows' lse."""
    p = np.zeros((), FLASH_V2_PARAMS)
    for name in FLASH_V2_PARAMS.names:
        p[name] = bwd[name]
    p["dropout_prob"] = np.float32(0.0)
    return p[()]


# The second struct beside the seed's (ferro_params.cuh's AttnLayout): element strides (batch,
# row, head) of each [batch, seq, heads, head_dim] tensor of an attention call, whose last
# dimension is contiguous; zeros for a tensor the call does not have. The seed's structs stay as
# they are; the kernels and the reference address every tensor through this one.
LAYOUT_TENSORS = ("q", "k", "v", "out", "grad_out", "grad_q", "grad_k", "grad_v")
ATTN_LAYOUT = _struct([(f"{t}_{c}", "u8") for t in LAYOUT_TENSORS for c in "bsh"])
assert ATTN_LAYOUT.itemsize == 192


# The third struct beside the seed's (SPEC "Beyond the seed, part 2"): the options the seed's
# words have no room for. window_left/right: key j is visible to position a iff
# a - window_left <= j <= a + window_right (-1: unbounded on that side), whichever form of
# window the call gave; softcap (0: none); flags say which optional tensors the call has.
# page_size: rows per block of a paged KV cache (0: not paged); new_keys: the keys a KV-cache
# append writes per sequence (`k_new`'s seq dimension); rotary_dim: the width the append's RoPE
# rotates (0: none). A seed call packs (-1, -1, 0, 0, 0, 0, 0, 0) unless it has a seed window,
# which this restates.
ATTN_EXTRAS = _struct([("window_left", "i4"), ("window_right", "i4"), ("softcap", "f4"),
                       ("flags", "u4"), ("page_size", "u4"), ("new_keys", "u4"),
                       ("rotary_dim", "u4"), ("_pad0", "u4")])
assert ATTN_EXTRAS.itemsize == 32
EXTRAS_ALIBI = 1  # alibi_slopes given: score - slope[b, h] * |a - j|
EXTRAS_ALIBI_PER_BATCH = 2  # alibi_slopes is [batch, heads] (else [heads])
EXTRAS_SINKS = 4  # sinks given: sinks[h] joins each row's softmax denominator
# varlen: the seed struct's batch is the number of sequences N, its seq_q/seq_k the
# max_seqlen_q/max_seqlen_k; sequence n spans rows cu_seqlens_q[n]..<cu_seqlens_q[n+1] of q
# and keys cu_seqlens_k[n]..<cu_seqlens_k[n+1] of k (each [total, heads, head_dim]).
EXTRAS_VARLEN = 8
# paged: k and v are [num_blocks, page_size, kv_heads, head_dim]; key j of batch b is row
# j % page_size of block block_table[b, j // page_size]; the seed struct's seq_k is the
# capacity max_blocks * page_size.
EXTRAS_PAGED = 16
# append: k_new/v_new [batch, new_keys, kv_heads, head_dim] are written into the cache at
# kv_lens[b]..< kv_lens[b] + new_keys before the attention, which then follows the kv_lens
# rule with kv_lens[b] + new_keys keys.
EXTRAS_APPEND = 32
EXTRAS_ROTARY = 64  # the append rotates q and k_new by rotary_cos/rotary_sin tables
EXTRAS_ROTARY_INTERLEAVED = 128  # ... pairing (x[2i], x[2i+1]) (else rotate-half)


def check_seed(seed) -> None:
    """Dropout's seed is an int in [0, 2**64)."""
    if (isinstance(seed, (bool, np.bool_)) or not isinstance(seed, (int, np.integer))
            or not 0 <= seed < 2**64):
        raise ValueError(f"seed must be an int in [0, 2**64), got {seed!r}")


def extras_params(opts, alibi_slopes=None, sinks=None, *, varlen: bool = False,
                  page_size: int = 0, new_keys: int | None = None, rotary_dim: int = 0,
                  rotary_interleaved: bool = False) -> np.void:
    """`AttnExtras` of options `opts` (validated) and the shapes of the optional tensors:
    `varlen` (cu_seqlens given), `page_size` (of a paged cache, else 0), `new_keys` (an
    append's; None: no append), `rotary_dim` (an append's RoPE width, 0: none)."""
    p = np.zeros((), ATTN_EXTRAS)
    p["window_left"], p["window_right"] = opts.windows()
    p["softcap"] = np.float32(opts.softcap)
    flags = 0
    if alibi_slopes is not None:
        flags |= EXTRAS_ALIBI | (EXTRAS_ALIBI_PER_BATCH if len(alibi_slopes.shape) == 2 else 0)
    if sinks is not None:
        flags |= EXTRAS_SINKS
    if varlen:
        flags |= EXTRAS_VARLEN
    if page_size:
        flags |= EXTRAS_PAGED
        p["page_size"] = _u32(page_size, "page_size")
    if new_keys is not None:
        flags |= EXTRAS_APPEND
        p["new_keys"] = _u32(new_keys, "new_keys")
    if rotary_dim:
        flags |= EXTRAS_ROTARY | (EXTRAS_ROTARY_INTERLEAVED if rotary_interleaved else 0)
        p["rotary_dim"] = _u32(rotary_dim, "rotary_dim")
    p["flags"] = flags
    return p[()]


def seed_extras(params: np.void) -> np.void:
    """`AttnExtras` of a call with the seed's options alone, read from its FlashV2Params or
    FlashBwdParams (its window word)."""
    w = int(params["window"])
    p = np.zeros((), ATTN_EXTRAS)
    p["window_left"] = p["window_right"] = w - 1 if w else -1
    return p[()]


# RoPE's second struct (ferro_params.cuh's RopeLayout): the element strides (batch, seq, head) of
# the input and of the output, each viewed as [batch, seq_len, heads, head_dim] with a contiguous
# last dimension, and the batch stride of a [batch, seq_len] positions tensor (0: one row of
# positions shared by every batch entry, or none). The engine packs 0 for a dimension of size 1
# (never stepped over).
ROPE_LAYOUT = _struct([(f"{t}_{c}", "u8") for t in ("x", "out") for c in "bsh"]
                      + [("positions_b", "u8"), ("_pad0", "u8")])
assert ROPE_LAYOUT.itemsize == 64


def layout_params(tensors: dict) -> np.void:
    """`AttnLayout` from the element strides of the rank-4 tensors in `tensors` (name -> tensor
    with `.shape` and `.strides`, or None); a packed (varlen) `[total, heads, head_dim]` one
    is read as `[1, total, heads, head_dim]`. A dimension of size 1 takes stride 0 (never
    stepped over, so whatever stride it had is irrelevant)."""
    p = np.zeros((), ATTN_LAYOUT)
    for name in LAYOUT_TENSORS:
        t = tensors.get(name)
        if t is None:
            continue
        shape, strides = tuple(t.shape), tuple(t.strides)
        if len(shape) == 3:
            shape, strides = (1,) + shape, (0,) + strides
        for c, n, st in zip("bsh", shape[:3], strides[:3]):
            p[f"{name}_{c}"] = int(st) if n > 1 else 0
    return p[()]


def contiguous_layout(params: np.void) -> np.void:
    """`AttnLayout` of C-contiguous tensors of the call `params` (a FlashV2Params or
    FlashBwdParams): q-shaped ones `[B, Sq, H, D]`, k-shaped ones `[B, Sk, Hkv, D]`."""
    sq, sk, h, hkv, d = (int(params[n]) for n in ("seq_q", "seq_k", "heads", "kv_heads",
                                                   "head_dim"))
    p = np.zeros((), ATTN_LAYOUT)
    for name in LAYOUT_TENSORS:
        rows, heads = (sk, hkv) if name in ("k", "v", "grad_k", "grad_v") else (sq, h)
        p[f"{name}_b"], p[f"{name}_s"], p[f"{name}_h"] = rows * heads * d, heads * d, d
    return p[()]


def words(params: np.void) -> np.ndarray:
    """The struct's bytes as little-endian uint32 words (what the seed's uniform held)."""
    return np.frombuffer(params.tobytes(), dtype="<u4")


def _u32(value: int, name: str) -> int:
    if not 0 <= int(value) < 2**32:
        raise ValueError(f"{name} = {value} does not fit in 32 bits")
    return int(value)


def _i32(value: int, name: str) -> int:
    if not -2**31 <= int(value) < 2**31:
        raise ValueError(f"{name} = {value} does not fit in a signed 32-bit word")
    return int(value)


def rope_dims(shape) -> tuple[int, int]:
    """(batch, seq_len) of a RoPE tensor, the seed's rule: rank 0 or 1 is one token; rank 2 is
    `[seq_len, ...]`; rank 3 or more is `[batch, seq_len, ...]`. Its tokens are batch * seq_len."""
    shape = tuple(int(s) for s in shape)
    if len(shape) <= 1:
        return 1, 1
    if len(shape) == 2:
        return 1, shape[0]
    return shape[0], shape[1]


def rope_params(shape, head_dim: int, pos: int, theta: float, *, rotary_dim: int | None = None,
                interleaved: bool = False, inverse: bool = False,
                positions_dtype=None) -> np.void:
    """RoPE's struct: the seed's `head_dim, seq_len, pos, heads, theta`, then `rotary_dim` (0:
    all of head_dim, as in a seed call), `flags` (the ROPE_* bits), 0. `positions_dtype`: the
    dtype of a positions tensor given instead of `pos` (None: none given)."""
    shape = tuple(int(s) for s in shape)
    batch, seq_len = rope_dims(shape)
    tokens = batch * seq_len
    numel = math.prod(shape)
    heads = numel // max(tokens * head_dim, 1)
    flags = (ROPE_INTERLEAVED if interleaved else 0) | (ROPE_INVERSE if inverse else 0)
    if positions_dtype is not None:
        flags |= ROPE_POSITIONS | (ROPE_POSITIONS_INT64 if np.dtype(positions_dtype).itemsize == 8
                                   else 0)
    p = np.zeros((), ROPE_PARAMS)
    p["head_dim"] = _u32(head_dim, "head_dim")
    p["seq_len"] = _u32(seq_len, "seq_len")
    p["pos"] = _u32(pos, "pos")
    p["heads"] = _u32(heads, "heads")
    p["theta"] = np.float32(theta)
    p["rotary_dim"] = 0 if rotary_dim is None or rotary_dim == head_dim else _u32(rotary_dim,
                                                                                 "rotary_dim")
    p["flags"] = flags
    return p[()]


def rope_layout(x_strides, out_strides, positions_b: int = 0) -> np.void:
    """`RopeLayout` from the (batch, seq, head) element strides of the input and the output."""
    p = np.zeros((), ROPE_LAYOUT)
    for name, strides in (("x", x_strides), ("out", out_strides)):
        for c, st in zip("bsh", strides):
            p[f"{name}_{c}"] = int(st)
    p["positions_b"] = int(positions_b)
    return p[()]


def contiguous_rope_layout(params: np.void) -> np.void:
    """`RopeLayout` of a C-contiguous tensor (input and output alike) of the call `params`."""
    d, s, h = (int(params[n]) for n in ("head_dim", "seq_len", "heads"))
    strides = (s * h * d, h * d, d)
    return rope_layout(strides, strides)


def mask_strides(mask) -> tuple[int, tuple[int, int, int, int]]:
    """`(has_mask, (b, h, q, k))` element strides of a broadcast `[mb, mh, mq, mk]` mask: the
    seed's for a contiguous one, its own for a strided view (a UnifiedTensor's element strides,
    an array's byte strides over its item size); 0 for a dimension of size 1 (broadcast)."""
    if mask is None:
        return 0, (0, 0, 0, 0)
    mb, mh, mq, mk = (int(d) for d in mask.shape)
    strides = getattr(mask, "strides", None)
    if strides is None:  # a shape alone: the seed's rule (C order)
        strides = (mk * mq * mh, mk * mq, mk, 1)
    elif hasattr(mask, "itemsize"):  # a NumPy or CuPy array: byte strides
        strides = tuple(st // mask.itemsize for st in strides)
    s = lambda dim, stride: int(stride) if dim > 1 else 0  # noqa: E731 - the seed's closure
    return 1, (s(mb, strides[0]), s(mh, strides[1]), s(mq, strides[2]), s(mk, strides[3]))


@dataclass(frozen=True)
class AttentionDims:
    """Shapes of a `[batch, seq, heads, head_dim]` attention call."""

    batch: int
    seq_q: int
    seq_k: int
    heads: int
    kv_heads: int
    head_dim: int

    @classmethod
    def new(cls, q, k) -> "AttentionDims":
        if len(q.shape) != 4:
            raise ValueError(f"q must be [batch, seq, heads, head_dim], got shape {tuple(q.shape)}")
        if len(k.shape) != 4:
            raise ValueError(
                f"k must be [batch, seq, kv_heads, head_dim], got shape {tuple(k.shape)}")
        if int(k.shape[0]) != int(q.shape[0]):
            raise ValueError(f"batch of q {tuple(q.shape)} and k {tuple(k.shape)} differ")
        return cls._checked(q, k, batch=int(q.shape[0]), seq_q=int(q.shape[1]),
                            seq_k=int(k.shape[1]))

    @classmethod
    def packed(cls, q, k, sequences: int, max_seqlen_q: int,
               max_seqlen_k: int) -> "AttentionDims":
        """A varlen call's: `q [total_q, heads, head_dim]`, `k [total_k, kv_heads, head_dim]`;
        batch is the number of sequences, seq_q / seq_k the max_seqlen_q / max_seqlen_k."""
        if len(q.shape) != 3:
            raise ValueError(f"with cu_seqlens, q must be [total_q, heads, head_dim], got shape "
                             f"{tuple(q.shape)}")
        if len(k.shape) != 3:
            raise ValueError(f"with cu_seqlens, k must be [total_k, kv_heads, head_dim], got "
                             f"shape {tuple(k.shape)}")
        return cls._checked(q, k, batch=sequences,
                            seq_q=max_seqlen_q, seq_k=max_seqlen_k)

    @classmethod
    def paged(cls, q, k, block_table) -> "AttentionDims":
        """A paged call's: `q [batch, seq_q, heads, head_dim]`, `k [num_blocks, page_size,
        kv_heads, head_dim]`, `block_table [batch, max_blocks]`; seq_k is the capacity
        max_blocks * page_size."""
        if len(q.shape) != 4:
            raise ValueError(f"q must be [batch, seq, heads, head_dim], got shape {tuple(q.shape)}")
        if len(k.shape) != 4:
            raise ValueError(f"with block_table, k must be [num_blocks, page_size, kv_heads, "
                             f"head_dim], got shape {tuple(k.shape)}")
        if len(block_table.shape) != 2 or int(block_table.shape[0]) != int(q.shape[0]):
            raise ValueError(f"block_table shape {tuple(block_table.shape)} must be [batch, "
                             f"max_blocks] with batch = {int(q.shape[0])} (q shape "
                             f"{tuple(q.shape)})")
        if int(k.shape[1]) == 0:
            raise ValueError(f"page_size must be at least 1, got k shape {tuple(k.shape)}")
        return cls._checked(q, k, batch=int(q.shape[0]), seq_q=int(q.shape[1]),
                            seq_k=int(block_table.shape[1]) * int(k.shape[1]))

    @classmethod
    def _checked(cls, q, k, *, batch: int, seq_q: int, seq_k: int) -> "AttentionDims":
        """The dims, heads and head_dim read from the last two dimensions of `q` and `k`, and
        checked."""
        dims = cls(batch=batch, seq_q=seq_q, heads=int(q.shape[-2]), head_dim=int(q.shape[-1]),
                   seq_k=seq_k, kv_heads=int(k.shape[-2]))
        if int(k.shape[-1]) != dims.head_dim:
            raise ValueError(f"head_dim of q {tuple(q.shape)} and k {tuple(k.shape)} differ")
        for name, n in (("seq_q", dims.seq_q), ("seq_k", dims.seq_k)):
            if n >= 2**31:  # the kernels count tiles in 32 bits
                raise ValueError(f"{name} = {n} must be below 2**31 (q shape {tuple(q.shape)}, "
                                 f"k shape {tuple(k.shape)})")
        if dims.head_dim == 0:
            raise ValueError(f"head_dim must be at least 1, got q shape {tuple(q.shape)}")
        if dims.head_dim > MAX_HEAD_DIM:
            raise ValueError(f"flash attention supports head_dim <= {MAX_HEAD_DIM}, "
                             f"got {dims.head_dim} (q shape {tuple(q.shape)})")
        if dims.kv_heads == 0 or dims.heads % dims.kv_heads:
            raise ValueError(f"num_heads ({dims.heads}, q shape {tuple(q.shape)}) must be a "
                             f"multiple of num_kv_heads ({dims.kv_heads}, k shape "
                             f"{tuple(k.shape)})")
        return dims

    def scale(self) -> np.float32:
        return np.float32(1.0) / np.sqrt(np.float32(self.head_dim))

    def check_mask(self, mask) -> None:
        """Reject what the seed silently mis-packed: rank != 4 or a dim neither 1 nor full."""
        if mask is None:
            return
        want = (self.batch, self.heads, self.seq_q, self.seq_k)
        shape = tuple(int(d) for d in mask.shape)
        if len(shape) != 4 or any(m not in (1, w) for m, w in zip(shape, want)):
            raise ValueError(f"mask of shape {shape} does not broadcast to [batch, heads, "
                             f"seq_q, seq_k] = {list(want)}: each dim must be 1 or the full size")

    def _fill(self, p: np.ndarray, opts, mask) -> np.void:
        self.check_mask(mask)
        has_mask, (sb, sh, sq, sk) = mask_strides(mask)
        for name, value in [("batch", self.batch), ("heads", self.heads),
                            ("seq_q", self.seq_q), ("seq_k", self.seq_k),
                            ("head_dim", self.head_dim), ("kv_heads", self.kv_heads),
                            ("causal", int(bool(opts.causal))), ("has_mask", has_mask),
                            ("window", opts.window),
                            ("mask_stride_b", sb), ("mask_stride_h", sh),
                            ("mask_stride_q", sq), ("mask_stride_k", sk)]:
            p[name] = _u32(value, name)
        p["causal_offset"] = _i32(opts.causal_offset, "causal_offset")
        scale = getattr(opts, "scale", None)
        p["scale"] = self.scale() if scale is None else np.float32(scale)
        p["dropout_prob"] = np.float32(opts.dropout_prob)
        p["seed"] = int(opts.seed) & 0xFFFFFFFF  # the seed uses the low 32 bits only
        return p[()]

    def params(self, opts, mask=None) -> np.void:
        """`FlashV2Params`, the forward kernel's struct."""
        return self._fill(np.zeros((), FLASH_V2_PARAMS), opts, mask)

    def params_bwd(self, opts, mask=None) -> np.void:
        """`FlashBwdParams`, the backward kernels' struct."""
        return self._fill(np.zeros((), FLASH_BWD_PARAMS), opts, mask)
