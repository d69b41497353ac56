"""RoPE's options on the reference backend (SPEC "RoPE for training"): explicit positions, partial
rotary, interleaved pairs, the inverse rotation, the out-of-place form and strided layouts,
against tests/rope_formula.py (scalar float32 angles, float64 rotation, independent of
ferrocupy.reference); the packed words; every bad input refused by name, nothing written.
Randomised with hypothesis over shapes, layouts and options."""

from __future__ import annotations

import re

import numpy as np
import pytest

from ferrocupy import ComputeEngine, rope_params
from ferrocupy import reference as ref
from ferrocupy.dtypes import BFLOAT16, FLOAT16
from ferrocupy.params import contiguous_rope_layout, rope_layout, words
from rope_formula import (POSITION_KINDS, as_bshd, make_positions, option_params,
                          positions_of, rope_formula)
from test_reference_dtypes import assert_rounded_once

hypothesis = pytest.importorskip("hypothesis", reason="hypothesis is not installed")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

SENTINEL = -12345.5
SETTINGS = settings(max_examples=60, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def eng():
    return ComputeEngine("reference", quiet=True)


def f32_bits(x: float) -> int:
    return int(np.float32(x).view(np.uint32))


# --- the packed words -----------------------------------------------------------------------------
def test_seed_call_packs_the_seeds_words():
    p = rope_params((2, 5, 3, 8), 8, 7, 500000.0)
    assert words(p).tolist() == [8, 5, 7, 3, f32_bits(500000.0), 0, 0, 0]
    same = rope_params((2, 5, 3, 8), 8, 7, 500000.0, rotary_dim=8, interleaved=False,
                       inverse=False)
    assert same.tobytes() == p.tobytes()  # rotary_dim = head_dim is the full rotation


@pytest.mark.parametrize("kw,word5,word6", [
    (dict(rotary_dim=4), 4, 0), (dict(interleaved=True), 0, 1), (dict(inverse=True), 0, 2),
    (dict(positions_dtype=np.int32), 0, 4), (dict(positions_dtype=np.int64), 0, 12),
    (dict(rotary_dim=2, interleaved=True, inverse=True, positions_dtype=np.int64), 2, 15)])
def test_option_words(kw, word5, word6):
    w = words(rope_params((2, 5, 3, 8), 8, 0, 10000.0, **kw)).tolist()
    assert w[5:] == [word5, word6, 0] and w[:5] == [8, 5, 0, 3, f32_bits(10000.0)]


# --- the reference kernel against the formula ---------------------------------------------------
OPTIONS = option_params(16)


@pytest.mark.parametrize("kw", OPTIONS)
@pytest.mark.parametrize("kind", POSITION_KINDS)
def test_reference_kernel_matches_the_formula(rng, kw, kind):
    """float64 in, float64 out: the reference is the formula to float64 rounding."""
    x = rng.standard_normal((3, 5, 2, 16))
    pos, positions = make_positions(rng, kind, 3, 5)
    want = rope_formula(x, positions_of(x.shape, pos, positions), 500000.0, **kw)
    p = rope_params(x.shape, 16, pos, 500000.0, **kw,
                    positions_dtype=None if positions is None else positions.dtype)
    layout = rope_layout((160, 32, 16), (160, 32, 16), 5 if kind == "BS-int64" else 0)
    out = np.full_like(x, np.nan)
    ref.rope(x.copy(), p, out=out, positions=positions, layout=layout)
    assert np.abs(out - want).max() <= 1e-12
    ref.rope(x, p, positions=positions, layout=layout)  # in place
    assert np.abs(x - want).max() <= 1e-12


def test_contiguous_layout_is_the_default(rng):
    x = rng.standard_normal((2, 3, 4, 8))
    p = rope_params(x.shape, 8, 3, 10000.0)
    a, b = x.copy(), x.copy()
    ref.rope(a, p)
    ref.rope(b, p, layout=contiguous_rope_layout(p))
    assert np.array_equal(a, b)


# --- the engine: options, forms and layouts -------------------------------------------------------
def engine_call(eng, x, head_dim, pos, theta, out_of_place, **kw):
    """The engine's result (float64) and the formula's for one call on float32 `x` (a view)."""
    before = np.array(x)
    t = positions_of(as_bshd(before, head_dim).shape, pos, kw.get("positions"))
    want = rope_formula(as_bshd(before, head_dim), t, theta, kw.get("rotary_dim"),
                        kw.get("interleaved", False), kw.get("inverse", False))
    if out_of_place:
        out = np.full(x.shape, np.nan, x.dtype)
        eng.rope_theta(x, head_dim, pos, theta, out=out, **kw)
        assert np.array_equal(x, before), "the input was written"
        got = out
    else:
        eng.rope_theta(x, head_dim, pos, theta, **kw)
        got = np.array(x)
    return as_bshd(got, head_dim).astype(np.float64), want


def assert_f32_close(got, want, what=""):
    assert not np.isnan(got).any(), f"NaN in the output {what}"
    err = np.abs(got - want).max() / np.abs(want).max()
    assert err < 1e-6, f"relative error {err:.2e} {what}"


@pytest.mark.parametrize("kw", OPTIONS)
@pytest.mark.parametrize("kind", POSITION_KINDS)
@pytest.mark.parametrize("out_of_place", [False, True], ids=["in-place", "out"])
def test_engine_options(eng, rng, kw, kind, out_of_place):
    x = rng.standard_normal((3, 5, 2, 16)).astype(np.float32)
    pos, positions = make_positions(rng, kind, 3, 5)
    got, want = engine_call(eng, x, 16, pos, 500000.0, out_of_place, positions=positions, **kw)
    assert_f32_close(got, want, f"{kw} {kind}")


@pytest.mark.parametrize("shape,kind", [((7, 3 * 16), "S-int32"), ((2, 7, 3 * 16), "BS-int64"),
                                        ((2, 7, 3 * 16), "1S-int64"), ((16,), "S-int32")],
                         ids=["S-HD", "B-S-HD", "B-S-HD-shared", "one-token"])
def test_engine_ranks_with_positions(eng, rng, shape, kind):
    x = rng.standard_normal(shape).astype(np.float32)
    b, s = as_bshd(x, 16).shape[:2]
    _, positions = make_positions(rng, kind, b, s)
    got, want = engine_call(eng, x, 16, 0, 10000.0, True, positions=positions, rotary_dim=8,
                            interleaved=True)
    assert_f32_close(got, want)


def test_expanded_positions_are_read_where_they_lie(eng, rng):
    """transformers' `position_ids.expand(batch, -1)`: batch stride 0, no copy needed."""
    x = rng.standard_normal((3, 7, 2, 16)).astype(np.float32)
    row = rng.integers(0, 5000, (1, 7))
    a, b = x.copy(), x.copy()
    eng.rope(a, 16, 0, positions=np.broadcast_to(row, (3, 7)))
    eng.rope(b, 16, 0, positions=row)
    assert np.array_equal(a, b)
    wide = np.zeros((3, 20), np.int64)
    wide[:, 3:10] = rng.integers(0, 5000, (3, 7))
    got, want = engine_call(eng, x, 16, 0, 10000.0, True, positions=wide[:, 3:10])
    assert_f32_close(got, want, "positions cut from a wider buffer")


def test_positions_equal_to_pos_plus_s_give_the_same_bits(eng, rng):
    x = rng.standard_normal((2, 9, 3, 32)).astype(np.float32)
    a, b = x.copy(), x.copy()
    eng.rope_theta(a, 32, 1000, 10000.0)
    eng.rope_theta(b, 32, 0, 10000.0, positions=np.arange(1000, 1009, dtype=np.int64))
    assert np.array_equal(a, b)


def test_rotary_dim_equal_to_head_dim_is_the_full_rotation(eng, rng):
    x = rng.standard_normal((2, 9, 3, 32)).astype(np.float32)
    a, b = x.copy(), x.copy()
    eng.rope(a, 32, 5)
    eng.rope(b, 32, 5, rotary_dim=32)
    assert np.array_equal(a, b)


@pytest.mark.parametrize("kw", OPTIONS[:5])
def test_inverse_undoes_the_rotation(eng, rng, kw):
    x = rng.standard_normal((2, 9, 3, 16)).astype(np.float32)
    y = np.empty_like(x)
    eng.rope(x, 16, 70000, out=y, **kw)
    eng.rope(y, 16, 70000, inverse=True, **kw)
    assert np.abs(y - x).max() < 1e-5 * np.abs(x).max()


def test_partial_rotary_passes_the_rest_through_bit_for_bit(eng, rng):
    x = rng.standard_normal((2, 9, 3, 16)).astype(np.float32)
    for out in (None, np.full_like(x, np.nan)):
        y = x.copy()
        eng.rope(y, 16, 3, rotary_dim=6, interleaved=True, out=out)
        got = y if out is None else out
        assert np.array_equal(got[..., 6:], x[..., 6:])
        assert not np.array_equal(got[..., :6], x[..., :6])


@pytest.mark.parametrize("out_is", ["the-same-array", "a-second-view"])
def test_out_may_be_the_tensor_itself(eng, rng, out_is):
    x = rng.standard_normal((2, 9, 3, 16)).astype(np.float32)
    want = x.copy()
    eng.rope(want, 16, 4)
    out = x if out_is == "the-same-array" else x[...]
    eng.rope(x, 16, 4, out=out)
    assert np.array_equal(x, want)


def strided_views(rng, b, s, h, d, dtype=np.float32):
    """(name, base array, cut) of the layouts a model hands RoPE, `cut(base)` the view:
    `[B, S, H, D]` views, and `[B, S, H*D]` out of a sequence-first fused QKV projection."""
    return [("qkv-slice", rng.standard_normal((b, s, 3, h, d)).astype(dtype),
             lambda a: a[:, :, 1]),
            ("bhsd-transposed", rng.standard_normal((b, h, s, d)).astype(dtype),
             lambda a: a.transpose(0, 2, 1, 3)),
            ("padded-rows", rng.standard_normal((b, s, h, d + 8)).astype(dtype),
             lambda a: a[..., 4:4 + d]),
            ("seq-first-fused", rng.standard_normal((s, b, 3 * h * d)).astype(dtype),
             lambda a: a.transpose(1, 0, 2)[..., h * d:2 * h * d])]


@pytest.mark.parametrize("out_of_place", [False, True], ids=["in-place", "out"])
def test_strided_views_are_read_and_written_where_they_lie(eng, rng, out_of_place):
    for name, base, cut in strided_views(rng, 2, 5, 3, 16):
        before = base.copy()
        got, want = engine_call(eng, cut(base), 16, 11, 10000.0, out_of_place, rotary_dim=8)
        assert_f32_close(got, want, name)
        outside = np.ones(base.shape, bool)
        cut(outside)[...] = False
        assert np.array_equal(base[outside], before[outside]), f"{name}: wrote past the view"


def test_strided_output(eng, rng):
    x = rng.standard_normal((2, 5, 3, 16)).astype(np.float32)
    big = np.full((2, 3, 5, 16), SENTINEL, np.float32)
    out = big.transpose(0, 2, 1, 3)
    eng.rope(x, 16, 2, out=out, interleaved=True)
    want = x.copy()
    eng.rope(want, 16, 2, interleaved=True)
    assert np.array_equal(out, want)


@pytest.mark.parametrize("dtype", [FLOAT16, BFLOAT16], ids=str)
@pytest.mark.parametrize("kw", OPTIONS)
def test_half_dtypes_rounded_once(eng, rng, dtype, kw):
    x = (3 * rng.standard_normal((2, 5, 3, 16))).astype(dtype)
    _, positions = make_positions(rng, "BS-int64", 2, 5)
    want = rope_formula(x, positions_of(x.shape, 0, positions), 10000.0, **kw)
    out = np.full(x.shape, np.nan, dtype)
    eng.rope(x, 16, 0, positions=positions, out=out, **kw)
    assert_rounded_once(out, want, dtype, f"rope {kw}")


# --- hypothesis: shapes, layouts and options ------------------------------------------------------
@st.composite
def calls(draw):
    """A random call: rank-2/3/4 tensors (possibly a strided view), options, positions."""
    d = draw(st.sampled_from([2, 4, 6, 8, 12, 16]))
    r = draw(st.sampled_from([None, *range(2, d + 1, 2)]))
    b, s, h = draw(st.integers(1, 3)), draw(st.integers(1, 6)), draw(st.integers(1, 3))
    rank = draw(st.sampled_from([2, 3, 4]))
    layout = draw(st.sampled_from(["contiguous", "strided-seq", "padded-heads"]))
    kind = draw(st.sampled_from(["pos", "S", "BS"]))
    return dict(d=d, r=r, b=1 if rank == 2 else b, s=s, h=h, rank=rank, layout=layout,
                kind=kind, interleaved=draw(st.booleans()), inverse=draw(st.booleans()),
                out_of_place=draw(st.booleans()), pos=draw(st.integers(0, 2**20)),
                theta=draw(st.sampled_from([10.0, 10000.0, 1e6])),
                seed=draw(st.integers(0, 2**32 - 1)))


def build(c):
    """The call's tensor, a view of its base where the layout makes one (None where the rank
    asked for cannot view that layout without a copy)."""
    rng = np.random.default_rng(c["seed"])
    b, s, h, d = c["b"], c["s"], c["h"], c["d"]
    pad = 2 if c["layout"] == "padded-heads" else 0
    base = rng.standard_normal((b, 2 * s if c["layout"] == "strided-seq" else s, h,
                                d + pad)).astype(np.float32)
    x4 = base[:, ::2] if c["layout"] == "strided-seq" else base[..., :d] if pad else base
    rank = c["rank"]
    x = x4 if rank == 4 else x4.reshape(b, s, h * d) if rank == 3 else x4.reshape(s, h * d)
    return x if np.shares_memory(x, base) else None


@given(calls())
@SETTINGS
def test_random_calls_match_the_formula(eng, c):
    x = build(c)
    if x is None:  # a rank the layout cannot take without a copy: see the error test below
        x = build(dict(c, layout="contiguous"))
    b, s = as_bshd(x, c["d"]).shape[:2]
    rng = np.random.default_rng(c["seed"] + 1)
    positions = None if c["kind"] == "pos" else rng.integers(
        -1000, 2**20, (s,) if c["kind"] == "S" else (b, s)).astype(np.int64)
    pos = c["pos"] if positions is None else 0
    got, want = engine_call(eng, x, c["d"], pos, c["theta"], c["out_of_place"],
                            positions=positions, rotary_dim=c["r"],
                            interleaved=c["interleaved"], inverse=c["inverse"])
    assert_f32_close(got, want, str(c))


# --- bad inputs: refused by name, nothing written -------------------------------------------------
def _bad_calls(b, s, h, d):
    """(what, kwargs for rope_theta besides the tensor, exception, message regex) of one bad
    argument each, for a [b, s, h, d] float32 tensor; `x` is the tensor, `out` a second one."""
    shape = re.escape(str((b, s, h, d)))
    n = d + 1 if d % 2 else d + 3  # an odd rotary_dim
    return [
        ("odd head_dim", dict(head_dim=d - 1), ValueError,
         rf"rope needs an even head_dim > 0, got {d - 1} \(tensor shape {shape}\)"),
        ("negative pos", dict(pos=-3), ValueError, r"pos must be a non-negative int, got -3"),
        ("theta 0", dict(theta=0.0), ValueError, r"theta must be a positive finite number"),
        ("odd rotary_dim", dict(rotary_dim=d - 1), ValueError,
         rf"rotary_dim must be even and in \[2, head_dim = {d}\], got {d - 1} "
         rf"\(tensor shape {shape}\)"),
        ("rotary_dim too wide", dict(rotary_dim=d + 2), ValueError,
         rf"rotary_dim must be even and in \[2, head_dim = {d}\], got {d + 2}"),
        ("rotary_dim 0", dict(rotary_dim=0), ValueError, r"rotary_dim must be even"),
        ("rotary_dim float", dict(rotary_dim=float(d)), TypeError,
         r"rotary_dim must be an int or None, got"),
        ("interleaved not bool", dict(interleaved=1), TypeError,
         r"interleaved must be a bool, got 1"),
        ("inverse not bool", dict(inverse="yes"), TypeError, r"inverse must be a bool"),
        ("float positions", dict(positions=np.zeros(s, np.float32)), TypeError,
         rf"positions has dtype float32 \(shape \({s},\)\); it must be int32 or int64"),
        ("positions too long", dict(positions=np.zeros(s + 1, np.int32)), ValueError,
         rf"positions shape \({s + 1},\) must be \[seq_len\] = \[{s}\] or \[batch, "
         rf"seq_len\] = \[{b}, {s}\] \(tensor shape {shape}"),
        ("positions [S, B]", dict(positions=np.zeros((s, b + 1), np.int64)), ValueError,
         rf"positions shape \({s}, {b + 1}\) must be"),
        ("positions and pos", dict(positions=np.zeros(s, np.int64), pos=2), ValueError,
         rf"pass pos or positions, not both: pos = 2 with positions of shape \({s},\)"),
        ("strided positions", dict(positions=np.zeros((b, 2 * s), np.int64)[:, ::2]),
         ValueError, rf"positions \(shape \({b}, {s}\), element strides \({2 * s}, 2\)\) "
                     rf"must have a contiguous last dimension"),
        ("out of another shape", dict(out=np.zeros((b, s, h, d + 2), np.float32)), ValueError,
         rf"out shape \({b}, {s}, {h}, {d + 2}\) must equal tensor shape {shape}"),
        ("out of another dtype", dict(out=np.zeros((b, s, h, d), np.float16)), TypeError,
         r"inputs and outputs must share one dtype, got tensor: float32, out: float16"),
        ("out of float64", dict(out=np.zeros((b, s, h, d), np.float64)), TypeError,
         r"out has dtype float64"),
        ("out overlapping itself", dict(out=np.lib.stride_tricks.as_strided(  # heads overlap
            np.zeros(h * d, np.float32), (b, s, h, d), (0, 0, 4 * (d // 2), 4))), ValueError,
         rf"out \(shape {shape}, element strides \(0, 0, {d // 2}, 1\)\) has elements that "
         rf"share memory"),
        ("out with a strided head_dim", dict(out=np.zeros((b, s, h, 2 * d), np.float32)[..., ::2]),
         ValueError, rf"out \(shape {shape}, element strides .*\) cannot be read as \[batch, "
                     rf"seq_len, heads = {h}, head_dim = {d}\] without a copy"),
        ("positions shape with 2-d rank", dict(positions=np.zeros((2, b, s), np.int64)),
         ValueError, r"positions shape"),
        ("rotary_dim odd and wide", dict(rotary_dim=n), ValueError, r"rotary_dim must be even"),
    ]


BAD_CALLS = len(_bad_calls(1, 2, 2, 2))


@pytest.mark.parametrize("which", range(BAD_CALLS), ids=[c[0].replace(" ", "-")
                                                         for c in _bad_calls(1, 2, 2, 2)])
@given(st.integers(1, 3), st.integers(2, 5), st.integers(2, 3), st.sampled_from([2, 4, 8, 16]))
@settings(max_examples=12, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_bad_arguments_are_refused_by_name_and_nothing_is_written(eng, which, b, s, h, d):
    what, kw, exc, match = _bad_calls(b, s, h, d)[which]
    args = dict(head_dim=d, pos=0, theta=10000.0) | kw
    x = np.full((b, s, h, d), SENTINEL, np.float32)
    out = args.get("out")
    out_before = None if out is None else np.array(out)
    with pytest.raises(exc, match=match):
        eng.rope_theta(x, args.pop("head_dim"), args.pop("pos"), args.pop("theta"), **args)
    assert (x == SENTINEL).all(), f"{what}: the tensor was written"
    if out is not None:
        assert np.array_equal(np.asarray(out), out_before, equal_nan=True), \
            f"{what}: out was written"


def test_out_sharing_the_tensors_memory_is_refused(eng):
    """out may be the tensor's very view (in place: test_out_may_be_the_tensor_itself) but no
    other view of its memory."""
    big = np.full((4, 7, 2, 8), SENTINEL, np.float32)
    with pytest.raises(ValueError, match=r"out \(shape \(4, 6, 2, 8\)\) shares memory with "
                                         r"tensor \(shape \(4, 6, 2, 8\)\)"):
        eng.rope(big[:, :6], 8, 0, out=big[:, 1:])
    assert (big == SENTINEL).all()


def test_out_sharing_the_positions_memory_is_refused(eng):
    raw = np.zeros(64, np.int32)
    positions, out = raw[:8], raw.view(np.float32).reshape(8, 8)
    x = np.ones((8, 8), np.float32)
    with pytest.raises(ValueError, match=r"out \(shape \(8, 8\)\) shares memory with "
                                         r"positions \(shape \(8,\)\)"):
        eng.rope(x, 8, 0, positions=positions, out=out)
    assert not raw.any()


@pytest.mark.parametrize("out", [False, True], ids=["in-place", "out"])
def test_read_only_written_tensor_is_refused(eng, rng, out):
    x = rng.standard_normal((2, 3, 2, 8)).astype(np.float32)
    o = np.zeros_like(x)
    (o if out else x).flags.writeable = False
    name, what = ("out", "rope writes its result there") if out else ("tensor",
                                                                       "rope writes it in place")
    with pytest.raises(ValueError, match=rf"^{name} \(shape \(2, 3, 2, 8\)\) is read-only; "
                                         rf"{what}$"):
        eng.rope(x, 8, 0, out=o if out else None)


def test_in_place_on_a_tensor_overlapping_itself_is_refused(eng):
    raw = np.full(8, SENTINEL, np.float32)
    x = np.lib.stride_tricks.as_strided(raw, (2, 3, 8), (0, 0, 4))
    with pytest.raises(ValueError, match=r"tensor \(shape \(2, 3, 8\), element strides "
                                         r"\(0, 0, 1\)\) has elements that share memory"):
        eng.rope(x, 8, 0)
    assert (raw == SENTINEL).all()
