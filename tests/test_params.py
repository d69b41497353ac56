"""Packed parameter structs: word for word what the seed's uniforms held (SPEC "Packed parameter
structs"), compared with a transcription of seed lines 26-44, 312-381 and 406-428."""

from __future__ import annotations

import numpy as np
import pytest

from ferrocupy import AttentionDims, AttentionOptions, rope_params
from ferrocupy.params import FLASH_BWD_PARAMS, FLASH_V2_PARAMS, ROPE_PARAMS, mask_strides, words


class Shape:
    """Any object with `.shape` is accepted by AttentionDims/params (SPEC "Objects")."""

    def __init__(self, *shape):
        self.shape = tuple(shape)


def f32_bits(x) -> int:
    return int(np.float32(x).view(np.uint32))


def seed_mask_strides(shape):
    """Seed lines 406-428, including its rank != 4 quirk (which ferrocupy rejects instead)."""
    if shape is None:
        return 0, [0, 0, 0, 0]
    if len(shape) != 4:
        return 1, [0, 0, 0, 0]
    b, h, q, k = shape
    s = lambda dim, stride: stride if dim > 1 else 0  # noqa: E731
    return 1, [s(b, k * q * h), s(h, k * q), s(q, k), s(k, 1)]


def seed_words(B, Sq, Sk, H, Hkv, D, opts, mask_shape, bwd):
    """Seed lines 317-381: the 20 u32 words of FlashV2Params / FlashBwdParams."""
    has_mask, s = seed_mask_strides(mask_shape)
    scale = f32_bits(np.float32(1.0) / np.sqrt(np.float32(D)))  # `1.0 / (D as f32).sqrt()`
    drop, seed = f32_bits(opts.dropout_prob), opts.seed % 2**32  # `seed as u32`
    if bwd:
        head = [B, H, Sq, Sk, D, Hkv, scale, drop, seed, int(opts.causal)]
    else:
        head = [B, H, Sq, Sk, D, int(opts.causal), scale, Hkv, drop, seed]
    return head + [has_mask, opts.causal_offset, *s, opts.window, 0, 0, 0]


B, SQ, SK, H, HKV, D = 2, 5, 7, 6, 3, 16
MASKS = [None, (1, 1, 1, 1), (B, 1, 1, SK), (1, H, SQ, SK), (B, H, SQ, SK), (1, 1, SQ, 1),
         (B, H, 1, 1), (1, 1, SQ, SK), (B, 1, SQ, 1)]
OPTS = [AttentionOptions(),
        AttentionOptions(causal=True),
        AttentionOptions(causal=True, causal_offset=299, window=17, dropout_prob=0.1, seed=42),
        AttentionOptions(window=3, dropout_prob=0.5, seed=2**40 + 12345)]


@pytest.mark.parametrize("bwd", [False, True], ids=["fwd", "bwd"])
@pytest.mark.parametrize("opts", OPTS, ids=["default", "causal", "all", "window-dropout"])
@pytest.mark.parametrize("mask", MASKS, ids=str)
def test_attention_words_match_seed(mask, opts, bwd):
    dims = AttentionDims.new(Shape(B, SQ, H, D), Shape(B, SK, HKV, D))
    m = None if mask is None else Shape(*mask)
    p = dims.params_bwd(opts, m) if bwd else dims.params(opts, m)
    assert p.dtype == (FLASH_BWD_PARAMS if bwd else FLASH_V2_PARAMS)
    assert len(p.tobytes()) == 80
    assert words(p).tolist() == seed_words(B, SQ, SK, H, HKV, D, opts, mask, bwd)


@pytest.mark.parametrize("dims", [(1, 1, 1, 1, 1, 1), (3, 128, 1, 8, 1, 128),
                                  (1, 1, 300, 32, 8, 64), (4, 33, 65, 12, 4, 80)])
def test_attention_words_for_several_dims(dims):
    b, sq, sk, h, hkv, d = dims
    opts = AttentionOptions(causal=True, causal_offset=sk - 1, dropout_prob=0.25, seed=7)
    mask = (b, 1, sq, sk)
    ad = AttentionDims.new(Shape(b, sq, h, d), Shape(b, sk, hkv, d))
    for bwd, pack in ((False, ad.params), (True, ad.params_bwd)):
        got = words(pack(opts, Shape(*mask))).tolist()
        assert got == seed_words(b, sq, sk, h, hkv, d, opts, mask, bwd)


@pytest.mark.parametrize("shape,strides", [
    ((2, 3, 5, 7), (105, 35, 7, 1)), ((1, 3, 5, 7), (0, 35, 7, 1)), ((2, 1, 1, 7), (7, 0, 0, 1)),
    ((1, 1, 5, 1), (0, 0, 1, 0)), ((1, 1, 1, 1), (0, 0, 0, 0)), ((2, 3, 1, 1), (3, 1, 0, 0)),
    ((2, 1, 5, 7), (35, 0, 7, 1))])
def test_broadcast_stride_rule(shape, strides):
    # Strides are the mask's own row-major strides, zeroed where its dimension is 1.
    assert mask_strides(Shape(*shape)) == (1, strides)


def test_no_mask_packs_zero_strides():
    p = AttentionDims.new(Shape(1, 2, 1, 4), Shape(1, 2, 1, 4)).params(AttentionOptions())
    assert [int(p[f]) for f in ("has_mask", "mask_stride_b", "mask_stride_h",
                                "mask_stride_q", "mask_stride_k")] == [0, 0, 0, 0, 0]


@pytest.mark.parametrize("shape,head_dim,seq_len,heads", [
    ((), 8, 1, 0), ((16,), 8, 1, 2), ((5, 16), 8, 5, 2), ((2, 5, 16), 8, 5, 2),
    ((2, 5, 3, 8), 8, 5, 3), ((3, 4, 2, 2, 8), 8, 4, 4), ((0, 16), 8, 0, 0)])
def test_rope_params_words(shape, head_dim, seq_len, heads):
    p = rope_params(shape, head_dim, 123, 100000.0)
    assert p.dtype == ROPE_PARAMS and len(p.tobytes()) == 32
    assert words(p).tolist() == [head_dim, seq_len, 123, heads, f32_bits(100000.0), 0, 0, 0]


@pytest.mark.parametrize("seed,low", [(0, 0), (2**32 - 1, 2**32 - 1), (2**32, 0),
                                      (2**40 + 7, 7), (2**64 - 1, 2**32 - 1)])
def test_seed_keeps_low_32_bits(seed, low):
    dims = AttentionDims.new(Shape(1, 1, 1, 4), Shape(1, 1, 1, 4))
    for p in (dims.params(AttentionOptions(seed=seed)),
              dims.params_bwd(AttentionOptions(seed=seed))):
        assert int(p["seed"]) == low


@pytest.mark.parametrize("d", [1, 6, 7, 16, 17, 64, 80, 96, 128])
def test_scale_bits(d):
    dims = AttentionDims.new(Shape(1, 1, 1, d), Shape(1, 1, 1, d))
    p = dims.params(AttentionOptions())
    # The seed's float32 arithmetic: sqrt then divide, each rounded to float32.
    assert words(p)[6] == f32_bits(np.float32(1.0) / np.sqrt(np.float32(d)))
    assert abs(float(p["scale"]) - 1 / np.sqrt(d)) <= 1e-7 / np.sqrt(d)
    if d in (1, 16, 64):  # exact powers of 4: every rounding agrees
        assert words(p)[6] == f32_bits(1 / np.sqrt(d))


def test_dropout_prob_is_f32_bits():
    dims = AttentionDims.new(Shape(1, 1, 1, 4), Shape(1, 1, 1, 4))
    p = dims.params(AttentionOptions(dropout_prob=0.1))
    assert words(p)[8] == f32_bits(0.1)
    assert words(dims.params_bwd(AttentionOptions(dropout_prob=0.1)))[7] == f32_bits(0.1)


@pytest.mark.parametrize("mask", [(SQ, SK), (H, SQ, SK), (1, B, H, SQ, SK), (B, H, SQ, 3),
                                  (3, 1, 1, 1), (1, H + 1, 1, 1), (1, 1, SQ - 1, SK),
                                  (B, H, SK, SQ)])
def test_bad_mask_rejected_naming_shapes(mask):
    # The seed packed rank != 4 as "mask[0] everywhere"; ferrocupy refuses it (SPEC deviation).
    dims = AttentionDims.new(Shape(B, SQ, H, D), Shape(B, SK, HKV, D))
    for pack in (dims.params, dims.params_bwd):
        with pytest.raises(ValueError, match=rf"mask of shape \({', '.join(map(str, mask))},?\)"
                                             rf".*\[{B}, {H}, {SQ}, {SK}\]"):
            pack(AttentionOptions(), Shape(*mask))


@pytest.mark.parametrize("field, value, match", [
    ("window", 2**32, "does not fit in 32 bits"),
    ("causal_offset", 2**31, "does not fit in a signed 32-bit word"),
    ("causal_offset", -(2**31) - 1, "does not fit in a signed 32-bit word")])
def test_values_over_32_bits_rejected(field, value, match):
    dims = AttentionDims.new(Shape(1, 1, 1, 4), Shape(1, 1, 1, 4))
    with pytest.raises(ValueError, match=rf"{field} = {value} {match}"):
        dims.params(AttentionOptions(**{field: value}))


@pytest.mark.parametrize("offset", [-1, -7, -(2**31), 2**31 - 1, 5])
def test_causal_offset_packs_as_int32_twos_complement(offset):
    """A signed offset packs in the seed's word as two's complement; a seed (non-negative)
    value keeps its bytes."""
    dims = AttentionDims.new(Shape(1, 1, 1, 4), Shape(1, 1, 1, 4))
    for pack in (dims.params, dims.params_bwd):  # word 11 in both structs
        assert int(words(pack(AttentionOptions(causal_offset=offset)))[11]) == offset % 2**32
        assert int(pack(AttentionOptions(causal_offset=offset))["causal_offset"]) == offset


@pytest.mark.parametrize("q,k,match", [
    ((1, 2, 4), (1, 2, 1, 4), r"q must be \[batch, seq, heads, head_dim\], got shape \(1, 2, 4\)"),
    ((1, 2, 1, 4), (2, 4), r"k must be .*got shape \(2, 4\)"),
    ((2, 2, 1, 4), (1, 2, 1, 4), r"batch of q \(2, 2, 1, 4\) and k \(1, 2, 1, 4\) differ"),
    ((1, 2, 1, 4), (1, 2, 1, 8), r"head_dim of q \(1, 2, 1, 4\) and k \(1, 2, 1, 8\) differ"),
    ((1, 2, 1, 264), (1, 2, 1, 264), r"head_dim <= 256, got 264"),
    ((1, 2, 6, 4), (1, 2, 4, 4), r"num_heads \(6.*multiple of num_kv_heads \(4"),
    ((1, 2, 6, 4), (1, 2, 0, 4), r"num_heads \(6.*multiple of num_kv_heads \(0")])
def test_dims_validation(q, k, match):
    with pytest.raises(ValueError, match=match):
        AttentionDims.new(Shape(*q), Shape(*k))


@pytest.mark.parametrize("scale", [None, 0.125, 0.1, 2, 1e-3, np.float32(0.3), np.float64(7.7),
                                   3e38])
@pytest.mark.parametrize("d", [8, 80])
def test_scale_option_word(scale, d):
    # `AttentionOptions.scale`: float32(scale) in the scale word; None is the seed's 1/sqrt(D).
    # Every other word is what the seed packs.
    dims = AttentionDims.new(Shape(2, 3, 4, d), Shape(2, 5, 2, d))
    opts = AttentionOptions(causal=True, window=2, scale=scale)
    want = f32_bits(np.float32(1.0) / np.sqrt(np.float32(d)) if scale is None else scale)
    for bwd, pack in ((False, dims.params), (True, dims.params_bwd)):
        w = words(pack(opts, Shape(1, 4, 3, 5))).tolist()
        seed = seed_words(2, 3, 5, 4, 2, d, opts, (1, 4, 3, 5), bwd)
        assert w[6] == want
        assert w[:6] + w[7:] == seed[:6] + seed[7:]
        if scale is None:
            assert w == seed


def test_layout_struct_is_the_headers_and_contiguous_layout_is_c_order():
    """AttnLayout: 24 u64 words, (b, s, h) of q, k, v, out, grad_out, grad_q, grad_k, grad_v,
    in ferro_params.cuh's order; a C-contiguous call's layout from the params alone equals the
    one read off the tensors' strides (size-1 dims aside, which take 0)."""
    from pathlib import Path

    from ferrocupy import UnifiedTensor
    from ferrocupy.params import ATTN_LAYOUT, LAYOUT_TENSORS, AttentionDims, contiguous_layout, \
        layout_params

    header = (Path(__file__).parents[1] / "ferrocupy/cuda/ferro_params.cuh").read_text()
    assert "struct AttnLayout { Strides " + ", ".join(LAYOUT_TENSORS) + "; };" in header
    assert ATTN_LAYOUT.itemsize == 192 and ATTN_LAYOUT.names[:3] == ("q_b", "q_s", "q_h")
    B, Sq, Sk, H, Hkv, D = 2, 5, 7, 6, 3, 16
    q = UnifiedTensor(np.zeros((B, Sq, H, D), np.float32))
    k = UnifiedTensor(np.zeros((B, Sk, Hkv, D), np.float32))
    tensors = dict(q=q, k=k, v=k, out=q, grad_out=q, grad_q=q, grad_k=k, grad_v=k)
    dims = AttentionDims.new(q, k)
    from ferrocupy import AttentionOptions

    for p in (dims.params(AttentionOptions()), dims.params_bwd(AttentionOptions())):
        assert contiguous_layout(p).tobytes() == layout_params(tensors).tobytes()
    t = UnifiedTensor(np.zeros((B, H, Sq, D), np.float32).transpose(0, 2, 1, 3))
    lay = layout_params({"q": t})
    assert (int(lay["q_b"]), int(lay["q_s"]), int(lay["q_h"])) == (H * Sq * D, D, Sq * D)
    assert int(lay["k_b"]) == 0  # absent


def test_mask_strides_of_an_array_are_its_own():
    """A NumPy (or CuPy) mask in another order: its byte strides over the item size, not the
    seed's C-order rule (the reference reads memory through them)."""
    m = np.asfortranarray(np.arange(2 * 3 * 4 * 5, dtype=np.float32).reshape(2, 3, 4, 5))
    assert mask_strides(m) == (1, (1, 2, 6, 24))
    assert mask_strides(np.zeros((1, 3, 1, 5), np.float32)) == (1, (0, 5, 0, 1))
