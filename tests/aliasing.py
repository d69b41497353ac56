"""Attention calls whose tensors are all carved from one buffer, in every way views allow: each
tensor at its own offset with its own padded strides, some far apart, some at nearby offsets
(same buffer, offset), some interleaved with another (same strides, shifted by a head: two
halves of one [.., 2, H, D] buffer, as packed QKV is). A hypothesis strategy draws them;
`check` makes the call cold or warm (after a valid call with the same shapes and strides from
separate buffers) and checks the rule: an output whose span (first to last byte it can touch)
meets any other argument's span is refused with a ValueError and the buffer is left as it was; otherwise
the call runs and its outputs equal the reference's on contiguous copies.

Also the two cases of issue 27 that a fuzzer found refused cold but not warm. Used by
tests/test_plans.py (reference backend) and tests/test_cuda_plans.py (CUDA)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from hypothesis import strategies as st

from ferrocupy import AttentionOptions, ComputeEngine
from ferrocupy.dtypes import BFLOAT16

FWD_NAMES = ("q", "k", "v", "out", "mask", "lse", "alibi_slopes", "sinks")
BWD_NAMES = ("q", "k", "v", "out", "grad_out", "grad_q", "grad_k", "grad_v", "mask", "lse",
             "alibi_slopes", "sinks", "grad_sinks")
WRITTEN = {"forward": ("out", "lse"), "backward": ("grad_q", "grad_k", "grad_v", "grad_sinks")}
_KEYWORDS = ("lse", "alibi_slopes", "sinks", "grad_sinks")


@dataclass
class Call:
    op: str
    shapes: dict  # name -> shape (absent: not in the call)
    places: dict  # name -> (element offset, element strides)
    size: int  # elements of the shared buffer
    opts: AttentionOptions

    def spans(self) -> dict:
        return {n: (off, off + sum((d - 1) * s for d, s in zip(self.shapes[n], st)) + 1)
                for n, (off, st) in self.places.items() if np.prod(self.shapes[n])}

    def expect_error(self) -> bool:
        spans = self.spans()
        return any(lo < ohi and olo < hi
                   for out in WRITTEN[self.op] if out in spans
                   for other, (olo, ohi) in spans.items() if other != out
                   for lo, hi in [spans[out]])


def _padded_strides(shape, pads):
    """Element strides of a C-order layout whose dimensions 0..2 carry extra padding."""
    strides, step = [], 1
    for i in reversed(range(len(shape))):
        strides.append(step)
        step = step * shape[i] + (pads[i - 1] if i >= 1 and i - 1 < len(pads) else 0)
    return tuple(reversed(strides))


@st.composite
def calls(draw, op: str | None = None, extras: bool = False):
    """`extras`: also draw `alibi_slopes`, `sinks` and `grad_sinks` (the reference backend's
    tensors for now)."""
    op = op or draw(st.sampled_from(["forward", "backward"]))
    b = draw(st.integers(1, 2))
    sq, sk = draw(st.integers(1, 4)), draw(st.integers(1, 6))
    hkv = draw(st.sampled_from([1, 2]))
    h = hkv * draw(st.sampled_from([1, 2]))
    d = draw(st.sampled_from([4, 8, 16]))
    qs, ks = (b, sq, h, d), (b, sk, hkv, d)
    shapes = {"q": qs, "k": ks, "v": ks, "out": qs}
    if op == "backward":
        shapes.update(grad_out=qs, grad_q=qs, grad_k=ks, grad_v=ks)
    if draw(st.booleans()):
        shapes["mask"] = (1, 1, sq, sk)
    if draw(st.booleans()):
        shapes["lse"] = (b, h, sq)
    if extras and draw(st.booleans()):
        shapes["alibi_slopes"] = draw(st.sampled_from([(h,), (b, h)]))
    if extras and draw(st.booleans()):
        shapes["sinks"] = (h,)
        if op == "backward" and draw(st.booleans()):
            shapes["grad_sinks"] = (h,)
    names = [n for n in (FWD_NAMES if op == "forward" else BWD_NAMES) if n in shapes]
    places, end = {}, 0
    for n in names:
        shape = shapes[n]
        if len(shape) == 4 and n != "mask":
            pads = (draw(st.sampled_from([0, 1, 3])), draw(st.sampled_from([0, 5])),
                    draw(st.sampled_from([0, d])))  # batch, row, head padding
        else:
            pads = (0, 0, 0)  # mask, lse and the per-head tensors: C-contiguous
        strides = _padded_strides(shape, pads)
        how = draw(st.sampled_from(["apart", "near", "interleave"]))
        if n == "grad_sinks" and draw(st.booleans()):
            # onto sinks itself (the one input it can meet by length alone), a third of the
            # time: "near" reaches it too, but rarely among the other tensors' offsets
            places[n] = (places["sinks"][0] + draw(st.integers(0, shape[0] - 1)), strides)
            end = max(end, places[n][0] + shape[0])
            continue
        partners = [m for m in places if len(shapes[m]) == 4 and m != "mask"
                    and shapes[m] == shape and places[m][1][2] >= 2 * d]
        if how == "interleave" and len(shape) == 4 and n != "mask" and partners:
            partner = draw(st.sampled_from(partners))
            off = places[partner][0] + d  # the other half of each padded head
            strides = places[partner][1]
        elif how == "near" and places:  # anywhere before the end, or onto another's start
            off = draw(st.one_of(st.integers(0, end),
                                 st.sampled_from(sorted(o for o, _ in places.values()))))
        else:
            off = end + draw(st.integers(0, 3))
        places[n] = (off, strides)
        end = max(end, off + sum((x - 1) * s for x, s in zip(shape, strides)) + 1)
    opts = AttentionOptions(causal=draw(st.booleans()), causal_offset=draw(st.integers(0, 3)))
    return Call(op, shapes, places, end, opts)


class Memory:
    """Where a call's buffers live: NumPy (`Memory()`), CuPy or PyTorch CUDA tensors."""

    def __init__(self, kind: str = "numpy"):
        self.kind = kind

    def array(self, host: np.ndarray):
        if self.kind == "numpy":
            return host
        if self.kind == "cupy":
            import cupy

            return cupy.asarray(host)
        import torch

        return torch.from_numpy(host).cuda()

    def carve(self, base, off: int, shape, strides):
        """A view of 1-D `base` at element offset `off` with element `strides`."""
        reach = sum((n - 1) * s for n, s in zip(shape, strides)) + 1
        assert off + reach <= base.shape[0], (off, shape, strides, base.shape)
        if self.kind == "torch":
            import torch

            return torch.as_strided(base, shape, strides, off)
        lib = np if self.kind == "numpy" else __import__("cupy")
        size = base.dtype.itemsize
        return lib.lib.stride_tricks.as_strided(base[off:], shape=shape,
                                                strides=tuple(s * size for s in strides))

    def host(self, x) -> np.ndarray:
        if self.kind == "numpy":
            return np.array(x)
        if self.kind == "cupy":
            return x.get()
        return x.cpu().numpy()


def carve(mem: Memory, base, call: Call) -> dict:
    """Each tensor of `call` as a strided view of `base` (element offsets and strides)."""
    return {n: mem.carve(base, off, call.shapes[n], strides)
            for n, (off, strides) in call.places.items()}


def _invoke(engine: ComputeEngine, call: Call, t: dict) -> None:
    named = {n: t[n] for n in _KEYWORDS if n in t}
    if call.op == "forward":
        engine.flash_attention_v2_with(t["q"], t["k"], t["v"], t["out"], call.opts, t.get("mask"),
                                       **named)
    else:
        engine.flash_attention_v2_backward_with(
            t["q"], t["k"], t["v"], t["out"], t["grad_out"], t["grad_q"], t["grad_k"],
            t["grad_v"], call.opts, t.get("mask"), **named)


def _reference(call: Call, host: dict) -> dict:
    """The outputs on contiguous copies of the inputs, by the reference backend."""
    ref = ComputeEngine("reference", quiet=True)
    t = {n: np.ascontiguousarray(a) for n, a in host.items()}
    for n in WRITTEN[call.op]:
        if n in t:
            t[n] = np.full_like(t[n], np.nan)
    _invoke(ref, call, t)
    return {n: t[n] for n in WRITTEN[call.op] if n in t}


def check(engine: ComputeEngine, mem: Memory, call: Call, rng, warm: bool, tol: float) -> None:
    """Check `call` on `engine` with its buffers in `mem`."""
    if warm:  # the same shapes and strides, every tensor in a buffer of its own: valid
        own = {n: carve(mem, mem.array(rng.standard_normal(call.size, dtype=np.float32)),
                        Call(call.op, {n: call.shapes[n]}, {n: call.places[n]}, call.size,
                             call.opts))[n] for n in call.places}
        _invoke(engine, call, own)
    base = mem.array(rng.standard_normal(call.size, dtype=np.float32))
    t = carve(mem, base, call)
    before = mem.host(base).copy()
    host_inputs = {n: mem.host(a).copy() for n, a in t.items()}
    if call.expect_error():
        try:
            _invoke(engine, call, t)
        except ValueError as e:
            assert "shares memory" in str(e), e
        else:
            raise AssertionError(f"no error for {call}")
        assert np.array_equal(mem.host(base), before), "memory written before the error"
        return
    for n in WRITTEN[call.op]:  # poisoned: an element left unwritten shows
        if n in t:
            t[n][...] = float("nan")
    _invoke(engine, call, t)
    want = _reference(call, host_inputs)
    for n, w in want.items():
        got = mem.host(t[n]).astype(np.float64)
        finite = np.isfinite(w)
        assert np.array_equal(got[~finite], w[~finite]), f"{n}: non-finite entries differ"
        err = np.linalg.norm((got - w)[finite]) / max(np.linalg.norm(w[finite]), 1e-30)
        assert err <= tol, f"{n}: relative error {err:.2e} for {call}"


# --- the two aliasing holes found by fuzzing (issue 27) ---------------------------------------
def issue_case_lse_in_q(rng, put=np.asarray):
    """float32, B3 Sq3 Sk403 H4 Hkv1 D96, causal, offset 1, window 2, mask [1, 4, 3, 403];
    q, out and v are views with padded heads, k and v one packed buffer. Returns the call's
    (valid) tensors, and an lse that is a view into q's memory."""
    B, Sq, Sk, H, D = 3, 3, 403, 4, 96

    def padded(shape):
        full = put(rng.standard_normal(shape[:3] + (shape[3] + 8,)).astype(np.float32))
        return full, full[..., :D]

    qbuf, q = padded((B, Sq, H, D))
    _, out = padded((B, Sq, H, D))
    kv = put(rng.standard_normal((B, Sk, 2, 1, D)).astype(np.float32))
    _, v_padded = padded((B, Sk, 1, D))
    mask = put(rng.standard_normal((1, H, Sq, Sk)).astype(np.float32))
    tensors = dict(q=q, k=kv[:, :, 0], v=v_padded, out=out, mask=mask,
                   lse=put(np.empty((B, H, Sq), np.float32)))
    bad_lse = qbuf.reshape(-1)[7:7 + B * H * Sq].reshape(B, H, Sq)
    opts = AttentionOptions(causal=True, causal_offset=1, window=2)
    return tensors, bad_lse, qbuf, opts


def issue_case_decode_out_in_q(rng, dtype=BFLOAT16, put=np.asarray):
    """bfloat16 decode, B1 Sq1 Sk3178 H8 Hkv1 D127, kv_lens, dropout 0.9, mask [1, 1, 1, 1].
    Returns the call's (valid) tensors, and an out interleaved with q in one buffer."""
    B, Sk, H, D = 1, 3178, 8, 127
    mk = lambda *s: put(rng.standard_normal(s).astype(np.float32).astype(dtype))  # noqa: E731
    both = mk(B, 1, H, 2, D)
    tensors = dict(q=both[:, :, :, 0], k=mk(B, Sk, 1, D), v=mk(B, Sk, 1, D),
                   out=mk(B, 1, H, 2, D)[:, :, :, 1], mask=mk(1, 1, 1, 1),
                   kv_lens=put(np.array([2000], np.int32)))
    opts = AttentionOptions(causal=True, causal_offset=Sk - 1, dropout_prob=0.9, seed=7)
    return tensors, both[:, :, :, 1], both, opts


def call_with(eng, t, opts, **over):
    """The forward on tensors `t` with some replaced."""
    t = dict(t, **over)
    eng.flash_attention_v2_with(t["q"], t["k"], t["v"], t["out"], opts, t.get("mask"),
                                lse=t.get("lse"), kv_lens=t.get("kv_lens"))
