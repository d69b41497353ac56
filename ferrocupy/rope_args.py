"""RoPE's arguments, checked and packed for `ComputeEngine.rope_theta`: the tensor viewed as
`[batch, seq_len, heads, head_dim]` through its strides (no copy), the options, the positions
tensor, the output. What depends only on shapes, strides, dtypes, devices and option values is
checked once per such combination and remembered (`checked_call`); what can change between calls
with the same metadata (writability, and aliasing between the output and the other tensors) is
checked on every call (`check_buffers`)."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .params import rope_dims, rope_layout, rope_params
from .plan import memory_range, overlaps_itself

POSITION_DTYPES = (np.dtype(np.int32), np.dtype(np.int64))
_CHECKED: dict = {}  # (backend, metadata, option values) -> RopeCall
_CHECKED_MAX = 256


class RopeCall(NamedTuple):
    """A checked call: the packed struct and layout the kernels receive."""

    params: np.void
    layout: np.void


class Options(NamedTuple):
    head_dim: object
    pos: object
    theta: object
    rotary_dim: object
    interleaved: object
    inverse: object


def checked_call(backend, t, o, ps, opts: Options) -> RopeCall:
    """The call's RopeCall after every check that depends only on metadata and option values;
    remembered per such combination. `t`, `o`, `ps`: UnifiedTensors (input, output or None,
    positions or None) already on the backend's device, dtypes checked."""
    key = _key(backend, t, o, ps, opts)
    hit = None if key is None else _CHECKED.get(key)
    if hit is None:
        hit = _check(t, o, ps, opts)
        if key is not None:
            if len(_CHECKED) >= _CHECKED_MAX:
                _CHECKED.clear()
            _CHECKED[key] = hit
    return hit


def _key(backend, t, o, ps, opts: Options):
    meta = tuple(None if x is None else (x.shape, x.strides, x.dtype, x.device) for x in (t, o, ps))
    values = tuple((v.__class__, v) for v in opts)
    key = (backend.name, backend.device, meta, values)
    try:
        hash(key)
    except TypeError:  # an unhashable option: _check says what is wrong with it
        return None
    return key


def _check(t, o, ps, opts: Options) -> RopeCall:

    head_dim, pos, rotary_dim = _check_scalars(t, opts)
    batch, seq_len = rope_dims(t.shape)
    tokens = max(1, batch * seq_len)
    if t.numel % (tokens * head_dim):
        raise ValueError(f"tensor of shape {t.shape} ({t.numel} elements) is not a whole "
                         f"number of {tokens} tokens x head_dim {head_dim}")
    if ps is None and pos + seq_len > 2**32:
        raise ValueError(f"pos {pos} + seq_len {seq_len} overflows 32 bits")
    positions_b = 0 if ps is None else _check_positions(ps, t, pos, batch, seq_len)
    if o is not None and o.shape != t.shape:
        raise ValueError(f"out shape {o.shape} must equal tensor shape {t.shape}")
    heads = t.numel // (tokens * head_dim)
    x_strides = _head_view("tensor", t, heads, head_dim)
    out_strides = x_strides if o is None else _head_view("out", o, heads, head_dim)
    if t.numel and overlaps_itself((batch, seq_len, heads, head_dim), out_strides + (1,)):
        name, x = ("tensor", t) if o is None else ("out", o)
        raise ValueError(f"{name} (shape {x.shape}, element strides {x.strides}) has elements "
                         f"that share memory; rope writes one place per element")
    params = rope_params(t.shape, head_dim, pos, opts.theta, rotary_dim=rotary_dim,
                         interleaved=bool(opts.interleaved), inverse=bool(opts.inverse),
                         positions_dtype=None if ps is None else ps.dtype)
    return RopeCall(params, rope_layout(x_strides, out_strides, positions_b))


def _check_scalars(t, opts: Options) -> tuple[int, int, int | None]:
    """(head_dim, pos, rotary_dim) as ints once every scalar option is checked."""
    head_dim, pos, theta, rotary_dim, interleaved, inverse = opts
    for name, value in (("head_dim", head_dim), ("pos", pos)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
            raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    head_dim, pos = int(head_dim), int(pos)
    if head_dim == 0 or head_dim % 2:
        raise ValueError(f"rope needs an even head_dim > 0, got {head_dim} "
                         f"(tensor shape {t.shape})")
    with np.errstate(over="ignore"):
        theta32 = np.float32(theta) if isinstance(theta, (int, float, np.number)) else None
    if theta32 is None or not np.isfinite(theta32) or not theta32 > 0:
        raise ValueError(f"theta must be a positive finite number, got {theta} (the kernel "
                         f"takes it as float32: {theta32})")
    for name, value in (("interleaved", interleaved), ("inverse", inverse)):
        if not isinstance(value, (bool, np.bool_)):
            raise TypeError(f"{name} must be a bool, got {value!r}")
    if rotary_dim is None:
        return head_dim, pos, None
    if isinstance(rotary_dim, bool) or not isinstance(rotary_dim, (int, np.integer)):
        raise TypeError(f"rotary_dim must be an int or None, got {rotary_dim!r}")
    if not (0 < rotary_dim <= head_dim and rotary_dim % 2 == 0):
        raise ValueError(f"rotary_dim must be even and in [2, head_dim = {head_dim}], got "
                         f"{rotary_dim} (tensor shape {t.shape})")
    return head_dim, pos, int(rotary_dim)


def _check_positions(ps, t, pos: int, batch: int, seq_len: int) -> int:
    """positions: int32 or int64, `[seq_len]` or `[batch, seq_len]` (`[1, seq_len]` shared by
    every batch entry), its last dimension contiguous, with pos 0. Returns its batch stride (in
    elements; any, an expanded row's 0 included). Its values are not read: any integer is a
    position (negative ones too)."""
    if ps.dtype not in POSITION_DTYPES:
        raise TypeError(f"positions has dtype {ps.dtype} (shape {ps.shape}); it must be int32 "
                        f"or int64")
    if pos:
        raise ValueError(f"pass pos or positions, not both: pos = {pos} with positions of shape "
                         f"{ps.shape}")
    if ps.shape not in ((seq_len,), (1, seq_len), (batch, seq_len)):
        raise ValueError(f"positions shape {ps.shape} must be [seq_len] = [{seq_len}] or "
                         f"[batch, seq_len] = [{batch}, {seq_len}] (tensor shape {t.shape}, read "
                         f"as [batch, seq_len, ...] from rank 3 on, [seq_len, ...] at rank 2)")
    strides = ps.strides
    if any(not isinstance(st, int) or st < 0 for st in strides) or (
            seq_len > 1 and strides[-1] != 1):
        raise ValueError(f"positions (shape {ps.shape}, element strides {strides}) must have a "
                         f"contiguous last dimension (stride 1) and a non-negative batch stride")
    return strides[0] if len(ps.shape) == 2 and ps.shape[0] > 1 else 0


def _head_view(name: str, x, heads: int, head_dim: int) -> tuple[int, int, int]:
    """Element strides (batch, seq, head) of `x` viewed as `[batch, seq_len, heads, head_dim]`
    with head_dim contiguous, without a copy; 0 for a dimension of size 1. ValueError naming
    `name`, its shape and strides where no such view exists."""
    shape, strides = x.shape, x.strides
    if x.numel == 0:
        return 0, 0, 0
    if any(not isinstance(s, int) or s < 0 for s in strides):
        raise ValueError(f"{name} (shape {shape}) has strides {strides} (in elements): each must "
                         f"be a non-negative whole number of elements")
    lead = 2 if len(shape) >= 3 else len(shape) - 1 if len(shape) == 2 else 0  # token dims
    rest = _view_strides(shape[lead:], strides[lead:], (heads, head_dim))
    if rest is None or rest[1] != 1:
        raise ValueError(f"{name} (shape {shape}, element strides {strides}) cannot be read as "
                         f"[batch, seq_len, heads = {heads}, head_dim = {head_dim}] without a "
                         f"copy: its head_dim elements must be contiguous (stride 1) and its "
                         f"heads evenly spaced; its batch and sequence dimensions may have any "
                         f"stride")
    if lead == 2:
        b, s = strides[0], strides[1]
    elif lead == 1:
        b, s = 0, strides[0]
    else:
        b, s = 0, 0
    batch, seq_len = rope_dims(shape)
    return (b if batch > 1 else 0, s if seq_len > 1 else 0, rest[0] if heads > 1 else 0)


def _view_strides(shape, strides, new_shape):
    """The strides of `shape`/`strides` viewed as `new_shape` (same element count) without a
    copy, or None where the view needs one (PyTorch's rule for `Tensor.view`)."""
    shape, strides = list(shape), list(strides)
    if not shape:  # a scalar: one element
        shape, strides = [1], [1]
    new = [0] * len(new_shape)
    view_d = len(new_shape) - 1
    base = strides[-1]
    tensor_numel, view_numel = 1, 1
    for d in range(len(shape) - 1, -1, -1):
        tensor_numel *= shape[d]
        # a chunk ends where the next outer dimension does not continue it contiguously
        if d == 0 or (shape[d - 1] != 1 and strides[d - 1] != tensor_numel * base):
            while view_d >= 0 and (view_numel < tensor_numel or new_shape[view_d] == 1):
                new[view_d] = view_numel * base
                view_numel *= new_shape[view_d]
                view_d -= 1
            if view_numel != tensor_numel:
                return None
            if d > 0:
                base, tensor_numel, view_numel = strides[d - 1], 1, 1
    return None if view_d != -1 else tuple(new)


def check_buffers(t, o, ps) -> bool:
    """The checks that can differ between calls of the same metadata: the written tensor is
    writable; `out`, when given, is either `tensor`'s very view (in place) or shares no memory
    with it, nor with positions. Returns whether the call is in place."""

    written, name = (t, "tensor") if o is None else (o, "out")
    buf = written.buffer()
    if isinstance(buf, np.ndarray) and not buf.flags.writeable:
        what = "rope writes it in place" if o is None else "rope writes its result there"
        raise ValueError(f"{name} (shape {written.shape}) is read-only; {what}")
    if written.numel == 0:
        return o is None
    lo, hi = memory_range(buf)
    others = [] if ps is None or ps.numel == 0 else [("positions", ps, memory_range(ps.buffer()))]
    same = o is None
    if not same:
        span = memory_range(t.buffer())
        same = span == (lo, hi) and t.strides == o.strides
        if not same and t.numel:
            others.append(("tensor", t, span))
    for other_name, other, (olo, ohi) in others:
        if lo < ohi and olo < hi:
            raise ValueError(f"{name} (shape {written.shape}) shares memory with {other_name} "
                             f"(shape {other.shape}); pass out=None for in place, or a "
                             f"separate output tensor")
    return same
