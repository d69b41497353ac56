"""SPEC "Errors", one test per row, through ComputeEngine("reference"): the exception type, a
message naming the argument and the shapes/values, and no output written (every output starts
as a sentinel and must still hold it, bit for bit)."""

from __future__ import annotations

import re
import sys
from types import SimpleNamespace

import numpy as np
import pytest

from ferrocupy import AttentionOptions, ComputeEngine, UnifiedTensor, cuda_available
from ferrocupy.dtypes import BFLOAT16

SENTINEL = -12345.5
B, SQ, SK, H, HKV, D = 2, 3, 4, 4, 2, 8


@pytest.fixture(scope="module")
def eng():
    return ComputeEngine("reference")


def sentinel(shape, dtype=np.float32):
    return np.full(shape, SENTINEL, dtype)


def untouched(*arrays) -> bool:
    return all(a.tobytes() == sentinel(a.shape, a.dtype).tobytes() for a in arrays)


def fwd_args(rng, q_shape=(B, SQ, H, D), k_shape=(B, SK, HKV, D), dtype=np.float32):
    q = rng.standard_normal(q_shape).astype(dtype)
    k = rng.standard_normal(k_shape).astype(dtype)
    v = rng.standard_normal(k_shape).astype(dtype)
    return q, k, v, sentinel(q_shape, dtype)


def bwd_args(rng, **kw):
    """q, k, v, out, grad_out, grad_q, grad_k, grad_v: gradients start as sentinels."""
    q, k, v, _ = fwd_args(rng, **kw)
    out = rng.standard_normal(q.shape).astype(q.dtype)
    go = rng.standard_normal(q.shape).astype(q.dtype)
    return [q, k, v, out, go, sentinel(q.shape, q.dtype), sentinel(k.shape, k.dtype),
            sentinel(v.shape, v.dtype)]


def esc(shape) -> str:
    return re.escape(str(tuple(shape)))


# --- wrong rank -----------------------------------------------------------------------------------
@pytest.mark.parametrize("which,shape,match", [
    ("q", (B, SQ, H * D),
     r"q must be \[batch, seq, heads, head_dim\], got shape " + esc((B, SQ, H * D))),
    ("k", (B, SK, HKV, D, 1), r"k must be \[batch, seq, kv_heads, head_dim\], got shape "
     + esc((B, SK, HKV, D, 1)))])
def test_wrong_rank(eng, rng, which, shape, match):
    q, k, v, out = fwd_args(rng)
    args = dict(q=q, k=k, v=v)
    args[which] = rng.standard_normal(shape).astype(np.float32)
    if which == "k":
        args["v"] = rng.standard_normal(shape).astype(np.float32)
    with pytest.raises(ValueError, match=match):
        eng.flash_attention_v2(args["q"], args["k"], args["v"], out)
    assert untouched(out)


# --- mismatched batch, head_dim, k/v shapes -------------------------------------------------------
@pytest.mark.parametrize("k_shape,match", [
    ((B + 1, SK, HKV, D),
     rf"batch of q {esc((B, SQ, H, D))} and k {esc((B + 1, SK, HKV, D))} differ"),
    ((B, SK, HKV, D // 2),
     rf"head_dim of q {esc((B, SQ, H, D))} and k {esc((B, SK, HKV, D // 2))} differ")])
def test_mismatched_batch_or_head_dim(eng, rng, k_shape, match):
    q, _, _, out = fwd_args(rng)
    k = rng.standard_normal(k_shape).astype(np.float32)
    with pytest.raises(ValueError, match=match):
        eng.flash_attention_v2(q, k, k.copy(), out)
    assert untouched(out)


def test_mismatched_k_v_shapes(eng, rng):
    q, k, _, out = fwd_args(rng)
    v = rng.standard_normal((B, SK + 1, HKV, D)).astype(np.float32)
    with pytest.raises(ValueError,
                       match=rf"v shape {esc(v.shape)} must equal k shape {esc(k.shape)}"):
        eng.flash_attention_v2(q, k, v, out)
    assert untouched(out)


# --- out / grad shapes ----------------------------------------------------------------------------
def test_out_shape_differs(eng, rng):
    q, k, v, _ = fwd_args(rng)
    out = sentinel((B, SQ, H, D + 1))
    with pytest.raises(ValueError, match=rf"out shape {esc(out.shape)} must equal q shape "
                                         rf"{esc(q.shape)}"):
        eng.flash_attention_v2(q, k, v, out)
    assert untouched(out)


@pytest.mark.parametrize("index,name,like", [(3, "out", "q"), (4, "grad_out", "q"),
                                             (5, "grad_q", "q"), (6, "grad_k", "k"),
                                             (7, "grad_v", "k")])
def test_backward_shape_differs(eng, rng, index, name, like):
    args = bwd_args(rng)
    bad = list(args[index].shape)
    bad[1] += 1
    args[index] = (sentinel(bad) if index >= 5 else
                   rng.standard_normal(bad).astype(np.float32))
    want = args[0].shape if like == "q" else args[1].shape
    with pytest.raises(ValueError, match=rf"{name} shape {esc(bad)} must equal {like} shape "
                                         rf"{esc(want)}"):
        eng.flash_attention_v2_backward(*args)
    assert untouched(*args[5:])


# --- heads ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("h,hkv", [(6, 4), (3, 2), (1, 2), (4, 0)])
def test_heads_not_multiple_of_kv_heads(eng, rng, h, hkv):
    q, k, v, out = fwd_args(rng, q_shape=(B, SQ, h, D), k_shape=(B, SK, hkv, D))
    with pytest.raises(ValueError, match=rf"num_heads \({h}, q shape {esc(q.shape)}\) must be a "
                                         rf"multiple of num_kv_heads \({hkv}, k shape "
                                         rf"{esc(k.shape)}\)"):
        eng.flash_attention_v2(q, k, v, out)
    assert untouched(out)


# --- head_dim -------------------------------------------------------------------------------------
def test_head_dim_over_256(eng, rng):
    q, k, v, out = fwd_args(rng, q_shape=(1, 2, 1, 264), k_shape=(1, 2, 1, 264))
    with pytest.raises(ValueError, match=r"head_dim <= 256, got 264 \(q shape \(1, 2, 1, 264\)\)"):
        eng.flash_attention_v2(q, k, v, out)
    assert untouched(out)


@pytest.mark.parametrize("head_dim,shape", [(7, (3, 14)), (0, (3, 8))])
def test_rope_odd_or_zero_head_dim(eng, head_dim, shape):
    x = sentinel(shape)
    with pytest.raises(ValueError, match=rf"rope needs an even head_dim > 0, got {head_dim} "
                                         rf"\(tensor shape {esc(shape)}\)"):
        eng.rope(x, head_dim, 0)
    assert untouched(x)


def test_rope_element_count_not_whole_tokens(eng):
    x = sentinel((2, 3, 12))  # 12 is not a multiple of head_dim 8
    with pytest.raises(ValueError, match=r"tensor of shape \(2, 3, 12\) \(72 elements\) is not a "
                                         r"whole number of 6 tokens x head_dim 8"):
        eng.rope(x, 8, 0)
    assert untouched(x)


@pytest.mark.parametrize("kw,match", [
    (dict(pos=-1), r"pos must be a non-negative int, got -1"),
    (dict(pos=2**32 - 2), r"pos 4294967294 \+ seq_len 3 overflows 32 bits"),
    (dict(theta=0.0), r"theta must be a positive finite number, got 0.0"),
    (dict(theta=float("nan")), r"theta must be a positive finite number, got nan")])
def test_rope_bad_pos_or_theta(eng, kw, match):
    x = sentinel((3, 16))
    args = dict(pos=5, theta=10000.0) | kw
    with pytest.raises(ValueError, match=match):
        eng.rope_theta(x, 8, args["pos"], args["theta"])
    assert untouched(x)


# --- options --------------------------------------------------------------------------------------
@pytest.mark.parametrize("prob", [-0.1, 1.0, float("nan"), 1.5, 0.99999999])
def test_dropout_prob_outside_unit_interval(eng, rng, prob):
    q, k, v, out = fwd_args(rng)
    with pytest.raises(ValueError, match=rf"dropout_prob must lie in \[0, 1\), got {prob}"):
        eng.flash_attention_v2(q, k, v, out, dropout_prob=prob, seed=1)
    assert untouched(out)
    args = bwd_args(rng)
    with pytest.raises(ValueError, match=r"dropout_prob must lie in \[0, 1\)"):
        eng.flash_attention_v2_backward_with(*args, AttentionOptions(dropout_prob=prob))
    assert untouched(*args[5:])


@pytest.mark.parametrize("field, value, rule", [
    ("window", -1, r"\[0, 2\*\*32\)"), ("window", -(2**31), r"\[0, 2\*\*32\)"),
    ("causal_offset", 2**31, r"\[-2\*\*31, 2\*\*31\)"),
    ("causal_offset", -(2**31) - 1, r"\[-2\*\*31, 2\*\*31\)"),
    ("window_left", -2, r"\[-1, 2\*\*31\)"), ("window_right", 2**31, r"\[-1, 2\*\*31\)")])
def test_offset_or_window_out_of_range(eng, rng, field, value, rule):
    """causal_offset is a signed 32-bit word, window an unsigned one, window_left/right int32
    with -1 for unbounded."""
    q, k, v, out = fwd_args(rng)
    with pytest.raises(ValueError, match=rf"{field} must be in {rule}, got {value}"):
        eng.flash_attention_v2_with(q, k, v, out, AttentionOptions(**{field: value}))
    assert untouched(out)


def test_non_int_offset_and_bad_seed_and_opts_type(eng, rng):
    q, k, v, out = fwd_args(rng)
    with pytest.raises(TypeError, match=r"window must be an int, got float"):
        eng.flash_attention_v2_with(q, k, v, out, AttentionOptions(window=2.0))
    with pytest.raises(ValueError, match=r"seed must be an int in \[0, 2\*\*64\), got -3"):
        eng.flash_attention_v2(q, k, v, out, seed=-3)
    with pytest.raises(TypeError, match=r"opts must be AttentionOptions, got dict"):
        eng.flash_attention_v2_with(q, k, v, out, {"causal": True})
    assert untouched(out)


# --- dtype ----------------------------------------------------------------------------------------
TAKES = r"the reference kernels take float32, float16, bfloat16"


@pytest.mark.parametrize("dtype", [np.float64, np.int32, np.complex64])
def test_wrong_dtype(eng, rng, dtype):
    q, k, v, out = fwd_args(rng, dtype=dtype)
    with pytest.raises(TypeError, match=rf"q has dtype {np.dtype(dtype)} \(shape "
                                        rf"{esc(q.shape)}\); {TAKES}"):
        eng.flash_attention_v2(q, k, v, out)
    assert untouched(out)
    x = sentinel((3, 16), dtype)
    with pytest.raises(TypeError, match=rf"tensor has dtype {np.dtype(dtype)} \(shape \(3, 16\)\); "
                                        rf"{TAKES}"):
        eng.rope(x, 8, 0)
    assert untouched(x)


def test_mixed_dtypes(eng, rng):
    q, k, v, _ = fwd_args(rng)
    out = sentinel(q.shape, np.float64)
    # float64 is refused on its own first; the message names the offending argument.
    with pytest.raises(TypeError, match=r"out has dtype float64 \(shape \(2, 3, 4, 8\)\)"):
        eng.flash_attention_v2(q, k, v, out)
    assert untouched(out)


def test_mixed_half_and_float32(eng, rng):
    q, k, v, out = fwd_args(rng, dtype=np.float16)
    with pytest.raises(TypeError, match=r"inputs and outputs must share one dtype, got q: "
                                        r"float16, k: float32, v: float16, out: float16"):
        eng.flash_attention_v2(q, k.astype(np.float32), v, out)
    assert untouched(out)
    args = bwd_args(rng, dtype=np.float16)
    args[6] = sentinel(args[6].shape, BFLOAT16)
    with pytest.raises(TypeError, match=r"must share one dtype, got .*grad_q: float16, "
                                        r"grad_k: bfloat16, grad_v: float16"):
        eng.flash_attention_v2_backward(*args)
    assert untouched(*args[5:])


def test_mixed_dtypes_when_backend_takes_two(rng, monkeypatch):
    # With a backend taking float32 and float64, mixing them is its own error.
    eng = ComputeEngine("reference")
    monkeypatch.setattr(eng.backend, "dtypes", (np.dtype(np.float32), np.dtype(np.float64)))
    q, k, v, out = fwd_args(rng)
    with pytest.raises(TypeError, match=r"inputs and outputs must share one dtype, got q: "
                                        r"float32, k: float64"):
        eng.flash_attention_v2(q, k.astype(np.float64), v, out)
    assert untouched(out)


def test_mask_wrong_dtype(eng, rng):
    q, k, v, out = fwd_args(rng)
    mask = np.zeros((1, 1, SQ, SK), np.float64)
    with pytest.raises(TypeError, match=r"mask has dtype float64 \(shape \(1, 1, 3, 4\)\)"):
        eng.flash_attention_v2(q, k, v, out, mask=mask)
    assert untouched(out)


@pytest.mark.parametrize("data,mask_dtype,allowed", [
    (np.float16, np.float64, "float32 or float16"), (np.float16, BFLOAT16, "float32 or float16"),
    (BFLOAT16, np.float16, "float32 or bfloat16"), (np.float32, np.float16, "float32")])
def test_mask_of_a_third_dtype(eng, rng, data, mask_dtype, allowed):
    q, k, v, out = fwd_args(rng, dtype=data)
    mask = np.zeros((1, H, SQ, SK), mask_dtype)
    with pytest.raises(TypeError, match=rf"mask has dtype {np.dtype(mask_dtype)} \(shape "
                                        rf"\(1, 4, 3, 4\)\); with {np.dtype(data)} inputs it "
                                        rf"must be {allowed}$"):
        eng.flash_attention_v2(q, k, v, out, mask=mask)
    assert untouched(out)
    args = bwd_args(rng, dtype=data)
    with pytest.raises(TypeError, match=r"mask has dtype"):
        eng.flash_attention_v2_backward_with(*args, AttentionOptions(), mask)
    assert untouched(*args[5:])


# --- lse ------------------------------------------------------------------------------------------
LSE_SHAPE = (B, H, SQ)


@pytest.mark.parametrize("data", [np.float32, np.float16, BFLOAT16], ids=str)
@pytest.mark.parametrize("lse_dtype", [np.float16, np.float64, BFLOAT16], ids=str)
def test_lse_wrong_dtype(eng, rng, data, lse_dtype):
    q, k, v, out = fwd_args(rng, dtype=data)
    lse = sentinel(LSE_SHAPE, lse_dtype)
    with pytest.raises(TypeError, match=rf"lse has dtype {np.dtype(lse_dtype)} \(shape "
                                        rf"{esc(LSE_SHAPE)}\); it is float32 for every input"):
        eng.flash_attention_v2_with(q, k, v, out, lse=lse)
    assert untouched(out, lse)
    args = bwd_args(rng, dtype=data)
    with pytest.raises(TypeError, match=r"lse has dtype"):
        eng.flash_attention_v2_backward_with(*args, lse=lse)
    assert untouched(*args[5:])


@pytest.mark.parametrize("shape", [(B, SQ, H), (B, H, SQ, 1), (H, SQ), (B, H, SK), (B, HKV, SQ)])
def test_lse_wrong_shape(eng, rng, shape):
    q, k, v, out = fwd_args(rng)
    lse = sentinel(shape)
    match = (rf"lse shape {esc(shape)} must be \[batch, heads, seq_q\] = \[{B}, {H}, {SQ}\] "
             rf"\(q shape {esc(q.shape)}\)")
    with pytest.raises(ValueError, match=match):
        eng.flash_attention_v2_with(q, k, v, out, lse=lse)
    assert untouched(out, lse)
    args = bwd_args(rng)
    with pytest.raises(ValueError, match=match):
        eng.flash_attention_v2_backward_with(*args, lse=lse)
    assert untouched(*args[5:])


def test_lse_sharing_memory_with_out(eng, rng):
    q, k, v, out = fwd_args(rng)
    lse = out.reshape(-1)[: B * H * SQ].reshape(LSE_SHAPE)
    with pytest.raises(ValueError, match=r"(out|lse) \(shape .*\) shares memory with (lse|out)"):
        eng.flash_attention_v2_with(q, k, v, out, lse=lse)
    assert untouched(out)
    # Given to the backward, lse is an input: a gradient written over it is refused too.
    args = bwd_args(rng)
    lse = args[5].reshape(-1)[: B * H * SQ].reshape(LSE_SHAPE)
    with pytest.raises(ValueError, match=r"grad_q \(shape .*\) shares memory with lse"):
        eng.flash_attention_v2_backward_with(*args, lse=lse)
    assert untouched(*args[5:])


def test_read_only_lse_output(eng, rng):
    q, k, v, out = fwd_args(rng)
    lse = sentinel(LSE_SHAPE)
    lse.flags.writeable = False
    with pytest.raises(ValueError, match=rf"lse \(shape {esc(LSE_SHAPE)}\) is read-only"):
        eng.flash_attention_v2_with(q, k, v, out, lse=lse)
    assert untouched(out, lse)


# --- scale ----------------------------------------------------------------------------------------
SCALE_RULE = r"scale must be finite and > 0, in \[2\*\*-126, 2\*\*126\]"


@pytest.mark.parametrize("scale,exc,match", [
    (0.0, ValueError, SCALE_RULE + r" .*got 0.0$"),
    (0, ValueError, SCALE_RULE + r" .*got 0$"),
    (-0.5, ValueError, SCALE_RULE + r" .*got -0.5$"),
    (float("inf"), ValueError, SCALE_RULE + r" .*got inf$"),
    (float("nan"), ValueError, SCALE_RULE + r" .*got nan$"),
    (1e39, ValueError, SCALE_RULE + r" \(as float32, .*: inf\), got 1e\+39$"),
    (1e-46, ValueError, SCALE_RULE + r" \(as float32, .*: 0.0\), got 1e-46$"),
    # subnormal (the kernels flush it to 0; 1 / scale overflows), or with a subnormal reciprocal
    (1e-39, ValueError, SCALE_RULE + r" .*got 1e-39$"),
    (2.0**-127, ValueError, r"scale must be .*got 5.877471754111438e-39$"),
    (2.0**127, ValueError, r"scale must be .*got 1.7014118346046923e\+38$"),
    (True, TypeError, r"scale must be a number or None, got True"),
    (np.bool_(True), TypeError, r"scale must be a number or None, got "),
    ("0.5", TypeError, r"scale must be a number or None, got '0.5'"),
    ([0.5], TypeError, r"scale must be a number or None, got \[0.5\]")])
def test_bad_scale(eng, rng, scale, exc, match):
    q, k, v, out = fwd_args(rng)
    lse = sentinel(LSE_SHAPE)
    with pytest.raises(exc, match=match):
        eng.flash_attention_v2_with(q, k, v, out, AttentionOptions(scale=scale), lse=lse)
    assert untouched(out, lse)
    args = bwd_args(rng, dtype=np.float16)
    with pytest.raises(exc, match=match):
        eng.flash_attention_v2_backward_with(*args, AttentionOptions(scale=scale))
    assert untouched(*args[5:])


@pytest.mark.parametrize("scale", [2**64, 10**400])
def test_huge_int_scale(eng, rng, scale):
    # 2**64 is finite as float32 (accepted); 10**400 is not (a ValueError naming scale).
    q, k, v, out = fwd_args(rng)
    if scale == 2**64:
        eng.flash_attention_v2_with(q, k, v, out, AttentionOptions(scale=scale))
        assert np.isfinite(out).all()
    else:
        with pytest.raises(ValueError, match=r"scale must be finite and > 0"):
            eng.flash_attention_v2_with(q, k, v, out, AttentionOptions(scale=scale))


# --- device ---------------------------------------------------------------------------------------
class FakeCudaArray:
    """Stands in for a cupy.ndarray (CuPy is not installed here): a tensor on cuda:0."""

    __module__ = "cupy.fake"

    def __init__(self, a):
        self.shape, self.dtype, self.strides, self.flags = a.shape, a.dtype, a.strides, a.flags
        self.device = SimpleNamespace(id=0)


@pytest.mark.parametrize("which", ["q", "v", "out"])
def test_tensor_on_wrong_device(eng, rng, which):
    args = dict(zip(("q", "k", "v", "out"), fwd_args(rng)))
    real_out, shape = args["out"], args[which].shape
    args[which] = FakeCudaArray(args[which])
    with pytest.raises(ValueError, match=rf"{which} \(shape {esc(shape)}\) is on cuda:0, but "
                                         r"this engine's reference backend runs on cpu"):
        eng.flash_attention_v2(args["q"], args["k"], args["v"], args["out"])
    assert untouched(real_out)


def test_not_an_array(eng, rng):
    q, k, v, out = fwd_args(rng)
    with pytest.raises(TypeError, match=r"k: cannot wrap list"):
        eng.flash_attention_v2(q, k.tolist(), v, out)
    assert untouched(out)


@pytest.mark.parametrize("mshape", [(SQ, SK), (B, H, SQ), (1, 1, SQ, SK + 1), (3, 1, 1, 1),
                                    (1, H, SK, SQ)])
def test_bad_mask_shape(eng, rng, mshape):
    q, k, v, out = fwd_args(rng)
    mask = np.zeros(mshape, np.float32)
    with pytest.raises(ValueError, match=rf"mask of shape {esc(mshape)} does not broadcast to "
                                         rf"\[batch, heads, seq_q, seq_k\] = \[{B}, {H}, {SQ}, "
                                         rf"{SK}\]"):
        eng.flash_attention_v2(q, k, v, out, mask=mask)
    assert untouched(out)
    args = bwd_args(rng)
    with pytest.raises(ValueError, match=r"mask of shape"):
        eng.flash_attention_v2_backward_with(*args, AttentionOptions(), mask)
    assert untouched(*args[5:])


# --- layout: a contiguous last dimension, any other strides; outputs one place per element -------
@pytest.mark.parametrize("which", ["q", "k", "out"])
def test_strided_last_dimension(eng, rng, which):
    q, k, v, out = fwd_args(rng)
    args = dict(q=q, k=k, v=v, out=out)
    wide = sentinel(args[which].shape[:-1] + (2 * args[which].shape[-1],))
    view = wide[..., ::2]
    view[...] = args[which] if which != "out" else SENTINEL
    args[which] = view
    with pytest.raises(ValueError, match=rf"{which} \(shape {esc(view.shape)}, element strides "
                                         r"\(\d+, \d+, \d+, 2\)\) must have a contiguous last "
                                         r"dimension"):
        eng.flash_attention_v2(args["q"], args["k"], args["v"], args["out"])
    assert untouched(out) and (which != "out" or untouched(wide))


@pytest.mark.parametrize("which", ["out", "grad_q", "grad_k"])
def test_output_that_overlaps_itself(eng, rng, which):
    """A broadcast (stride 0) output would have two elements in one place."""
    args = dict(zip(("q", "k", "v", "out", "grad_out", "grad_q", "grad_k", "grad_v"),
                    bwd_args(rng)))
    one = sentinel((1,) + args[which].shape[1:])
    view = np.lib.stride_tricks.as_strided(one, shape=args[which].shape,
                                           strides=(0,) + one.strides[1:])
    args[which] = view
    with pytest.raises(ValueError, match=rf"{which} \(shape {esc(view.shape)}, element strides "
                                         r"\(0, \d+, \d+, 1\)\) has elements that share memory"):
        if which == "out":
            eng.flash_attention_v2(args["q"], args["k"], args["v"], args["out"])
        else:
            eng.flash_attention_v2_backward(*(args[n] for n in (
                "q", "k", "v", "out", "grad_out", "grad_q", "grad_k", "grad_v")))
    assert untouched(one)


def test_lse_must_be_contiguous(eng, rng):
    q, k, v, out = fwd_args(rng)
    wide = sentinel((B, H, 2 * SQ))
    with pytest.raises(ValueError, match=r"lse \(shape .*\) is not C-contiguous"):
        eng.flash_attention_v2_with(q, k, v, out, AttentionOptions(), lse=wide[..., ::2])
    assert untouched(out, wide)


def test_rope_strided_head_dim(eng):
    """A view whose head_dim elements are not contiguous is refused (any other stride is read
    where it lies: tests/test_rope_layouts.py)."""
    x = sentinel((16, 6))
    with pytest.raises(ValueError, match=r"tensor \(shape \(6, 16\), element strides \(1, 6\)\) "
                                         r"cannot be read as \[batch, seq_len, heads = 2, "
                                         r"head_dim = 8\] without a copy"):
        eng.rope(x.T, 8, 0)
    assert untouched(x)


@pytest.mark.parametrize("wrap", [False, True])
@pytest.mark.parametrize("call", ["rope", "rope_theta"])
def test_rope_read_only(eng, rng, call, wrap):
    """rope writes in place: a read-only array is refused by name, before NumPy's own
    "assignment destination is read-only", and left as it was."""
    x = rng.standard_normal((2, 3, 2, 8)).astype(np.float32)
    before = x.copy()
    x.flags.writeable = False
    arg = UnifiedTensor(x) if wrap else x
    with pytest.raises(ValueError, match=r"^tensor \(shape \(2, 3, 2, 8\)\) is read-only; "
                                         r"rope writes it in place$"):
        if call == "rope":
            eng.rope(arg, 8, 0)
        else:
            eng.rope_theta(arg, 8, 3, 500000.0)
    assert x.tobytes() == before.tobytes() and not x.flags.writeable


# --- single-head forms ----------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(SQ,), (1, SQ, D), (1, SQ, 1, D)])
def test_single_head_wrong_rank(eng, rng, shape):
    k = rng.standard_normal((SK, D)).astype(np.float32)
    q = rng.standard_normal(shape).astype(np.float32)
    out = sentinel((SQ, D))
    with pytest.raises(ValueError, match=rf"q must be a \[seq_len, head_dim\] tensor, got shape "
                                         rf"{esc(shape)}"):
        eng.flash_attention(q, k, k.copy(), out)
    assert untouched(out)


def test_single_head_backward_wrong_rank(eng, rng):
    q, k, v, out, go = (rng.standard_normal((n, D)).astype(np.float32)
                        for n in (SQ, SK, SK, SQ, SQ))
    gq, gk = sentinel((SQ, D)), sentinel((SK, D))
    gv = sentinel((1, SK, D))
    with pytest.raises(ValueError, match=r"grad_v must be a \[seq_len, head_dim\] tensor, got "
                                         r"shape \(1, 4, 8\)"):
        eng.flash_attention_backward(q, k, v, out, go, gq, gk, gv)
    assert untouched(gq, gk, gv)


# --- outputs that share memory with another argument, or cannot be written ---------------------
@pytest.mark.parametrize("alias", ["q", "k_view", "mask"])
def test_forward_out_sharing_memory(eng, rng, alias):
    q, k, v, out = fwd_args(rng, k_shape=(B, SQ, H, D))
    mask = None
    if alias == "q":
        out = q
    elif alias == "k_view":  # a view over part of k's memory, as .reshaped() can make
        out = k.reshape(-1)[: out.size].reshape(out.shape)
    else:
        mask = out.reshape(-1)[: B * H * SQ * SQ].reshape(B, H, SQ, SQ)
    before = [a.copy() for a in (q, k, v, out)]
    with pytest.raises(ValueError, match=rf"out \(shape .*\) shares memory with {alias[0]}"):
        eng.flash_attention_v2(q, k, v, out, mask=mask)
    assert all(a.tobytes() == b.tobytes() for a, b in zip((q, k, v, out), before))


@pytest.mark.parametrize("grad,other", [("grad_q", "q"), ("grad_q", "grad_out"),
                                        ("grad_k", "grad_v"), ("grad_v", "v")])
def test_backward_grad_sharing_memory(eng, rng, grad, other):
    names = ["q", "k", "v", "out", "grad_out", "grad_q", "grad_k", "grad_v"]
    args = dict(zip(names, bwd_args(rng, k_shape=(B, SQ, H, D))))
    before = {n: a.copy() for n, a in args.items()}
    args[grad] = args[other]
    with pytest.raises(ValueError, match=rf"(({grad})|({other})) \(shape .*\) shares memory"):
        eng.flash_attention_v2_backward(**args)
    for n in names:  # nothing written anywhere
        if n not in (grad, other):
            assert args[n].tobytes() == before[n].tobytes(), n
    assert args[other].tobytes() == before[other].tobytes()


def test_read_only_grad_raises_before_anything_is_written(eng, rng):
    q, k, v, out, go, gq, gk, gv = bwd_args(rng)
    gk.flags.writeable = False
    with pytest.raises(ValueError, match=r"grad_k \(shape .*\) is read-only"):
        eng.flash_attention_v2_backward(q, k, v, out, go, gq, gk, gv)
    assert untouched(gq, gv)


@pytest.mark.parametrize("opts,exc,match", [
    (dict(causal="False"), TypeError, r"causal must be a bool, got 'False'"),
    (dict(causal=1), TypeError, r"causal must be a bool, got 1"),
    (dict(dropout_prob="0.5"), TypeError, r"dropout_prob must be a number, got '0.5'"),
    (dict(seed=True), ValueError, r"seed must be an int in \[0, 2\*\*64\), got True"),
])
def test_option_types(eng, rng, opts, exc, match):
    q, k, v, out = fwd_args(rng)
    with pytest.raises(exc, match=match):
        eng.flash_attention_v2_with(q, k, v, out, AttentionOptions(**opts))
    assert untouched(out)


@pytest.mark.parametrize("theta", [1e-46, 1e39, float("nan")])
def test_rope_theta_not_finite_in_float32(eng, theta):
    x = sentinel((2, 3, 2, 8))
    with pytest.raises(ValueError, match=r"theta must be a positive finite number"):
        eng.rope_theta(x, 8, 0, theta)
    assert untouched(x)


@pytest.mark.parametrize("field", ["seq_q", "seq_k"])
def test_sequence_of_2_31_rejected(field):
    from ferrocupy import AttentionDims
    big = 2**31
    q = SimpleNamespace(shape=(1, big if field == "seq_q" else 4, 1, 8))
    k = SimpleNamespace(shape=(1, big if field == "seq_k" else 4, 1, 8))
    with pytest.raises(ValueError, match=rf"{field} = {big} must be below 2\*\*31"):
        AttentionDims.new(q, k)


# --- a backend that cannot start ------------------------------------------------------------------
def _says_what_to_install(message: str) -> None:
    for part in ("backend='cuda' needs CuPy, an NVIDIA driver and a CUDA GPU",
                 "pip install 'ferrocupy[cuda13]'", "'ferrocupy[cuda12]'",
                 "NVIDIA GPU and its driver", "backend='reference'"):
        assert part in message, (part, message)


@pytest.mark.skipif(cuda_available(), reason="a CUDA GPU is usable here")
def test_cuda_backend_without_a_gpu():
    """CuPy installed, no driver or no GPU (this machine, CI's): a plain RuntimeError saying
    what is missing and what to install, not CuPy's raw CUDARuntimeError."""
    cupy = pytest.importorskip("cupy", reason="CuPy is not installed (the no-CuPy case is below)")
    with pytest.raises(RuntimeError) as err:
        ComputeEngine(backend="cuda")
    assert type(err.value) is RuntimeError, type(err.value)  # CUDARuntimeError subclasses it
    assert not isinstance(err.value, cupy.cuda.runtime.CUDARuntimeError)
    message = str(err.value)
    _says_what_to_install(message)
    assert "no usable NVIDIA driver or GPU (CUDARuntimeError: " in message \
        or "CuPy sees no CUDA GPU" in message


def test_cuda_backend_without_cupy(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # `import cupy` now fails as if not installed
    with pytest.raises(RuntimeError) as err:
        ComputeEngine(backend="cuda")
    assert type(err.value) is RuntimeError
    assert isinstance(err.value.__cause__, ModuleNotFoundError)
    _says_what_to_install(str(err.value))
    assert "CuPy is not installed (ModuleNotFoundError: " in str(err.value)


@pytest.mark.parametrize("runtime", ["no device", "no driver"])
def test_cuda_backend_with_cupy_but_no_usable_gpu(monkeypatch, runtime):
    """The same message wherever it runs (a GPU machine too): a stand-in CuPy whose runtime
    counts no device, or fails as it does without a driver."""
    class CUDARuntimeError(RuntimeError):
        pass

    def count():
        if runtime == "no driver":
            raise CUDARuntimeError("cudaErrorNoDevice: no CUDA-capable device is detected")
        return 0

    fake = SimpleNamespace(cuda=SimpleNamespace(runtime=SimpleNamespace(getDeviceCount=count)))
    monkeypatch.setitem(sys.modules, "cupy", fake)
    with pytest.raises(RuntimeError) as err:
        ComputeEngine(backend="cuda")
    assert type(err.value) is RuntimeError
    _says_what_to_install(str(err.value))
    assert ("CuPy sees no CUDA GPU" if runtime == "no device" else
            "(CUDARuntimeError: cudaErrorNoDevice: no CUDA-capable device is detected)"
            ) in str(err.value)


def test_unknown_backend_name():
    with pytest.raises(ValueError, match=r"backend must be 'cuda' or 'reference', got 'gpu'"):
        ComputeEngine(backend="gpu")


@pytest.mark.parametrize("kv_lens, exc, match", [
    (np.array([1, 2], np.int64), TypeError, r"kv_lens has dtype int64 .*int32"),
    (np.array([1.0, 2.0], np.float32), TypeError, r"kv_lens has dtype float32"),
    (np.array([1, 2, 3], np.int32), ValueError, r"kv_lens shape \(3,\) must be \[batch\] = \[2\]"),
    (np.array([[1, 2]], np.int32), ValueError, r"kv_lens shape \(1, 2\)"),
    (np.array([1, -1], np.int32), ValueError, r"kv_lens\[1\] = -1 is outside \[0, seq_k = 4\]"),
    (np.array([5, 4], np.int32), ValueError, r"kv_lens\[0\] = 5 is outside \[0, seq_k = 4\]"),
])
def test_bad_kv_lens(eng, rng, kv_lens, exc, match):
    q, k, v, out = fwd_args(rng)
    lse = sentinel((B, H, SQ))
    with pytest.raises(exc, match=match):
        eng.flash_attention_v2_with(q, k, v, out, AttentionOptions(causal=True), lse=lse,
                                    kv_lens=kv_lens)
    assert untouched(out, lse)


def test_kv_lens_sharing_memory_with_out(eng, rng):
    q, k, v, out = fwd_args(rng)
    lens = out.reshape(-1)[:B].view(np.int32)  # int32 words inside `out`
    lens[:] = 1  # valid values: the aliasing is what must be refused
    with pytest.raises(ValueError, match="out .* shares memory with kv_lens"):
        eng.flash_attention_v2_with(q, k, v, out, kv_lens=lens)


def test_backward_rejects_kv_lens(eng, rng):
    q, k, v, out = fwd_args(rng)
    grads = [sentinel(x.shape) for x in (q, k, v)]
    with pytest.raises(ValueError, match="backward_with does not take kv_lens"):
        eng.flash_attention_v2_backward_with(q, k, v, q.copy(), q.copy(), *grads,
                                             kv_lens=np.array([1, 2], np.int32))
    assert untouched(*grads)


def test_checks_that_can_change_between_calls_run_on_every_call(eng, rng, monkeypatch):
    """The engine remembers what it checked and packed for a call's shapes, dtypes and options
    (issue 10: cost per call), but aliasing, read-only outputs and kv_lens values are checked
    on every call, and an option of the wrong type is not let through by an equal valid one."""
    from ferrocupy import params as params_mod

    q, k, v, out = fwd_args(rng)
    opts = AttentionOptions(causal=True, seed=1)
    eng.flash_attention_v2_with(q, k, v, out, opts)
    packs = []
    real = params_mod.AttentionDims.params
    monkeypatch.setattr(params_mod.AttentionDims, "params",
                        lambda self, *a, **kw: packs.append(1) or real(self, *a, **kw))
    out2 = sentinel(q.shape)
    eng.flash_attention_v2_with(q, k, v, out2, opts)
    assert packs == [] and not untouched(out2)  # packed once, ran again
    with pytest.raises(ValueError, match="shares memory with q"):
        eng.flash_attention_v2_with(q, k, v, q, opts)
    ro = sentinel(q.shape)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        eng.flash_attention_v2_with(q, k, v, ro, opts)
    for bad in (AttentionOptions(causal=1, seed=1), AttentionOptions(causal=True, seed=True)):
        with pytest.raises((TypeError, ValueError)):
            eng.flash_attention_v2_with(q, k, v, sentinel(q.shape), bad)
    lens = np.array([4, 4], np.int32)
    eng.flash_attention_v2_with(q, k, v, out2, opts, kv_lens=lens)
    lens[1] = 5
    with pytest.raises(ValueError, match=r"kv_lens\[1\] = 5"):
        eng.flash_attention_v2_with(q, k, v, out2, opts, kv_lens=lens)
