"""Strided layouts: every attention tensor may be any view whose last dimension is contiguous
(SDPA's `[B, H, S, D]` transposed to `[B, S, H, D]`, one part of a packed QKV buffer, rows padded
past head_dim), and the mask any strided view. Each is addressed as it is (AttnLayout), never
copied, and gives what the same call on contiguous copies gives: bit for bit where the copy width
is the same, to rounding where a layout's alignment forces a narrower copy (another kernel).

Outputs are views into NaN-poisoned buffers: every element of the view is written, and nothing
outside it (padding, the other parts of a packed buffer) is touched.

The reference backend runs here on the CPU; the CUDA kernels (each design: `kernels` and
`decoders` fixtures) under the `gpu` mark.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

from ferrocupy import AttentionOptions, UnifiedTensor
from ferrocupy.dtypes import BFLOAT16, FLOAT32
from gpu_helpers import decoders, gpu_pytestmark, kernels, reference_device  # noqa: F401
from helpers import poison

# Every tensor of a call in one layout, or (the mixes) each tensor in its own, so that a kernel or
# the reference reading one tensor through another's strides (v through k's, out through q's, a
# gradient through its input's) fails.
MIXES = {
    "mixed": dict(q="sdpa", k="packed", v="contiguous", out="packed", grad_out="contiguous",
                  grad_q="sdpa", grad_k="contiguous", grad_v="sdpa"),
    "mixed-padded": dict(q="contiguous", k="sdpa", v="padded", out="sdpa", grad_out="padded",
                         grad_q="packed", grad_k="padded", grad_v="contiguous"),
}
LAYOUTS = ("contiguous", "sdpa", "packed", "padded", *MIXES)
SAME_KERNEL = ("contiguous", "sdpa", "packed", "mixed")  # 16-byte aligned rows: the same kernel


def _layout(layout: str, name: str) -> str:
    """The layout of tensor `name` in `layout` (a mix names each tensor's)."""
    return MIXES[layout][name] if layout in MIXES else layout


def _gpu(test):
    return functools.reduce(lambda f, mark: mark(f), gpu_pytestmark(), test)


def _view(dev, a: np.ndarray, layout: str, fill=None):
    """A [B, S, H, D] view on `dev` holding `a` (or, for an output, filled with NaN: `fill`) in
    `layout`; returns (view, whole buffer)."""
    B, S, H, D = a.shape
    xp = dev.xp
    if layout == "contiguous":
        base = np.ascontiguousarray(a)
        pick = lambda x: x  # noqa: E731
    elif layout == "sdpa":  # torch SDPA's [B, H, S, D], transposed
        base = np.ascontiguousarray(a.transpose(0, 2, 1, 3))
        pick = lambda x: x.transpose(0, 2, 1, 3)  # noqa: E731
    elif layout == "packed":  # the middle third of a [B, S, 3, H, D] QKV buffer
        base = np.zeros((B, S, 3, H, D), a.dtype)
        base[:, :, 1] = a
        pick = lambda x: x[:, :, 1]  # noqa: E731
    else:  # "padded": rows of D + 1 elements (4-byte aligned at best: a narrower copy)
        base = np.zeros((B, S, H, D + 1), a.dtype)
        base[..., :D] = a
        pick = lambda x: x[..., :D]  # noqa: E731
    buf = UnifiedTensor.from_numpy(base, device=dev.where).buffer()
    if fill is not None:
        poison(buf)
    dev.sync()
    return UnifiedTensor(pick(buf)), buf


def _host(dev, t: UnifiedTensor) -> np.ndarray:
    dev.sync()
    return t.to_numpy()


def _inputs(rng, B, Sq, Sk, H, Hkv, D, dtype):
    f = lambda *s: rng.standard_normal(s).astype(np.float32).astype(dtype)  # noqa: E731
    return f(B, Sq, H, D), f(B, Sk, Hkv, D), f(B, Sk, Hkv, D), f(B, Sq, H, D)


def _mask(dev, rng, B, H, Sq, Sk, strided: bool):
    """An additive [B, 1, Sq, Sk] mask, contiguous or every other column of a wider buffer."""
    m = (rng.standard_normal((B, 1, Sq, Sk)) * 0.5).astype(np.float32)
    if not strided:
        return UnifiedTensor.from_numpy(m, device=dev.where), m
    wide = np.zeros((B, 1, Sq, 2 * Sk), np.float32)
    wide[..., ::2] = m
    buf = UnifiedTensor.from_numpy(wide, device=dev.where).buffer()
    return UnifiedTensor(buf[..., ::2]), m


def _forward(dev, q, k, v, layout, opts, mask=None, mask_strided=False, rng=None):
    """(out, lse) of the call with every tensor in `layout`; checks the output buffer outside
    the view is untouched."""
    qv, _ = _view(dev, q, _layout(layout, "q"))
    kv, _ = _view(dev, k, _layout(layout, "k"))
    vv, _ = _view(dev, v, _layout(layout, "v"))
    ov, obuf = _view(dev, q, _layout(layout, "out"), fill=np.nan)
    mt = None
    if mask is not None:
        mt = _mask(dev, rng, *mask, strided=mask_strided)[0]
    lse = UnifiedTensor.empty((q.shape[0], q.shape[2], q.shape[1]), np.float32, device=dev.where)
    poison(lse.buffer())
    dev.engine.flash_attention_v2_with(qv, kv, vv, ov, opts, mt, lse=lse)
    out = _host(dev, ov)
    whole = _host(dev, UnifiedTensor(obuf)).astype(np.float32)
    assert np.isnan(whole).sum() == whole.size - out.size, "wrote outside the view (or not all)"
    return out, _host(dev, lse)


def _mismatch(layout, got, want, dtype, what) -> str | None:
    """How `got` (a strided call's) fails to be `want` (the contiguous call's): bit for bit where
    the kernel is the same, to rounding otherwise; None when it is."""
    got, want = got.astype(np.float64), want.astype(np.float64)
    if np.isnan(got).any():
        return f"{what} ({layout}): NaN (an element not written)"
    if layout in SAME_KERNEL:
        differ = int((got != want).sum())
        return f"{what} ({layout}): {differ} elements differ" if differ else None
    tol = 1e-5 if dtype == FLOAT32 else 1e-2
    err = np.linalg.norm(got - want) / np.linalg.norm(want)
    return None if err < tol else f"{what} ({layout}): relative error {err:.2e} vs contiguous"


FORWARD_CASES = {
    "prefill": dict(B=2, Sq=70, Sk=70, H=4, Hkv=2, D=64, opts=AttentionOptions(causal=True)),
    "decode": dict(B=2, Sq=1, Sk=600, H=8, Hkv=2, D=128,
                   opts=AttentionOptions(causal=True, causal_offset=599)),
    "cross": dict(B=1, Sq=33, Sk=130, H=2, Hkv=1, D=128, opts=AttentionOptions(window=40)),
}


def _forward_case(dev, rng, case, layout, dtype, with_mask) -> list:
    """The mismatches of out and lse between the call in `layout` and the contiguous one."""
    c = FORWARD_CASES[case]
    q, k, v, _ = _inputs(rng, c["B"], c["Sq"], c["Sk"], c["H"], c["Hkv"], c["D"], dtype)
    mask = (c["B"], c["H"], c["Sq"], c["Sk"]) if with_mask else None
    seed = int(rng.integers(2**32))
    want = _forward(dev, q, k, v, "contiguous", c["opts"], mask, False,
                    np.random.default_rng(seed))
    got = _forward(dev, q, k, v, layout, c["opts"], mask, with_mask,
                   np.random.default_rng(seed))
    found = [_mismatch(layout, got[0], want[0], dtype, f"out, {case}"),
             _mismatch(layout, got[1], want[1], FLOAT32 if layout in SAME_KERNEL else dtype,
                       f"lse, {case}")]
    return [m for m in found if m]


def _backward(dev, q, k, v, do, layout, opts):
    """The three gradients with every tensor (inputs, out, grad_out, gradients) in `layout`."""
    out, _ = _forward(dev, q, k, v, "contiguous", opts)
    views = [_view(dev, x, _layout(layout, n))[0]
             for n, x in zip(("q", "k", "v", "out", "grad_out"), (q, k, v, out, do))]
    grads = [_view(dev, x, _layout(layout, n), fill=np.nan)
             for n, x in zip(("grad_q", "grad_k", "grad_v"), (q, k, v))]
    dev.engine.flash_attention_v2_backward_with(*views, *(g for g, _ in grads), opts)
    result = []
    for g, buf in grads:
        got = _host(dev, g)
        whole = _host(dev, UnifiedTensor(buf)).astype(np.float32)
        assert np.isnan(whole).sum() == whole.size - got.size, "wrote outside the view"
        result.append(got)
    return result


def _backward_case(dev, rng, layout, dtype) -> list:
    """The mismatches of the three gradients between the call in `layout` and the contiguous
    one."""
    q, k, v, do = _inputs(rng, B=2, Sq=50, Sk=70, H=4, Hkv=2, D=64, dtype=dtype)
    opts = AttentionOptions(causal=True, causal_offset=20, dropout_prob=0.1, seed=7)
    want = _backward(dev, q, k, v, do, "contiguous", opts)
    got = _backward(dev, q, k, v, do, layout, opts)
    found = [_mismatch(layout, g, w, dtype, name)
             for name, g, w in zip(("grad_q", "grad_k", "grad_v"), got, want)]
    return [m for m in found if m]


# --- the reference (CPU, CI) ----------------------------------------------------------------------
@pytest.mark.parametrize("layout", LAYOUTS[1:])
@pytest.mark.parametrize("case", list(FORWARD_CASES))
def test_reference_forward_layouts(rng, case, layout):
    ref = reference_device()
    problems = _forward_case(ref, rng, case, layout, FLOAT32, with_mask=(case == "prefill"))
    assert not problems, problems
    # the reference reads the same values whatever the layout: bit for bit, padded too
    if layout == "padded":
        c = FORWARD_CASES[case]
        q, k, v, _ = _inputs(rng, c["B"], c["Sq"], c["Sk"], c["H"], c["Hkv"], c["D"], BFLOAT16)
        a = _forward(ref, q, k, v, "contiguous", c["opts"])
        b = _forward(ref, q, k, v, layout, c["opts"])
        np.testing.assert_array_equal(a[0].astype(np.float32), b[0].astype(np.float32))


@pytest.mark.parametrize("layout", LAYOUTS[1:])
def test_reference_backward_layouts(rng, layout):
    problems = _backward_case(reference_device(), rng, layout, FLOAT32)
    assert not problems, problems


def test_reference_strided_mask_reads_through_its_strides(rng):
    """Every other column of a wider buffer: the struct carries the view's strides, and the
    reference gathers through them as a kernel does (a wrong stride reads the zeros between)."""
    ref = reference_device()
    c = FORWARD_CASES["prefill"]
    q, k, v, _ = _inputs(rng, c["B"], c["Sq"], c["Sk"], c["H"], c["Hkv"], c["D"], FLOAT32)
    mask = (c["B"], c["H"], c["Sq"], c["Sk"])
    seed = int(rng.integers(2**32))
    want = _forward(ref, q, k, v, "contiguous", c["opts"], mask, False, np.random.default_rng(seed))
    got = _forward(ref, q, k, v, "contiguous", c["opts"], mask, True, np.random.default_rng(seed))
    np.testing.assert_array_equal(got[0], want[0])
    none = _forward(ref, q, k, v, "contiguous", c["opts"])
    assert not np.array_equal(none[0], want[0])  # the mask does change the answer


# --- the CUDA kernels -----------------------------------------------------------------------------
@_gpu
@pytest.mark.parametrize("dtype", [FLOAT32, BFLOAT16], ids=["f32", "bf16"])
@pytest.mark.parametrize("layout", LAYOUTS[1:])
@pytest.mark.parametrize("case", ["prefill", "cross"])
def test_cuda_forward_layouts(kernels, rng, case, layout, dtype):
    problems = _forward_case(kernels, rng, case, layout, dtype, with_mask=(case == "prefill"))
    assert not problems, problems


@_gpu
@pytest.mark.parametrize("dtype", [FLOAT32, BFLOAT16], ids=["f32", "bf16"])
@pytest.mark.parametrize("layout", LAYOUTS[1:])
def test_cuda_decode_layouts(decoders, rng, layout, dtype):
    problems = _forward_case(decoders, rng, "decode", layout, dtype, with_mask=False)
    assert not problems, problems


@_gpu
@pytest.mark.parametrize("dtype", [FLOAT32, BFLOAT16], ids=["f32", "bf16"])
@pytest.mark.parametrize("layout", LAYOUTS[1:])
def test_cuda_backward_layouts(kernels, rng, layout, dtype):
    problems = _backward_case(kernels, rng, layout, dtype)
    assert not problems, problems


def test_empty_tensors_may_have_any_strides(rng):
    """An empty tensor (seq_k 0, batch 0) is neither read nor written, whatever its strides say
    (CuPy can give such an array zero strides): the call runs as the contiguous one does."""
    ref = reference_device()
    q, _, _, _ = _inputs(rng, 2, 5, 0, 4, 2, 32, FLOAT32)
    zero = np.lib.stride_tricks.as_strided(np.zeros(1, np.float32), shape=(2, 0, 2, 32),
                                           strides=(0, 0, 0, 0))
    out = np.full(q.shape, np.nan, np.float32)
    ref.engine.flash_attention_v2_with(q, zero, zero, out, AttentionOptions())
    assert (out == 0).all()  # no key: every row is 0
    empty_q = np.lib.stride_tricks.as_strided(np.zeros(1, np.float32), shape=(0, 5, 4, 32),
                                              strides=(0, 0, 0, 0))
    k = rng.standard_normal((0, 3, 2, 32)).astype(np.float32)
    ref.engine.flash_attention_v2_with(empty_q, k, k, np.zeros((0, 5, 4, 32), np.float32))
