"""RoPE on the GPU against the NumPy reference (issue 3; issue 27's options: positions, partial
rotary, interleaved pairs, the inverse rotation, the out-of-place form, strided views).

Both sides form the angle `f32(t) * inv_i` in float32 from the same float32 inverse frequencies
(SPEC "RoPE"), so they agree to float32 rounding even at positions near 1e5; in half precision
to one unit in the last place (each rounds once). Outputs start as NaN. Skipped unless
`ferrocupy.cuda_available()`; `FERRO_GPU_TESTS_ON_REFERENCE=1` runs it reference-vs-reference.
"""

from __future__ import annotations

import numpy as np
import pytest

# gpu_helpers is in tests/, which conftest puts on sys.path.
from ferrocupy import UnifiedTensor
from ferrocupy.dtypes import BFLOAT16, FLOAT16, FLOAT32
from gpu_helpers import (ROPE_TOL, assert_close, axis, covering, dev, gpu_pytestmark,
                         needs_real_gpu, ref)
from rope_formula import POSITION_KINDS, make_positions, option_params

__all__ = ["dev", "ref"]  # fixtures, imported for pytest (`rng` comes from conftest)

pytestmark = gpu_pytestmark()


def check_rope(dev, ref, x: np.ndarray, head_dim: int, pos: int, theta: float | None = None,
              nan_ok: bool = False) -> np.ndarray:
    """Run RoPE in place on copies of host `x` on both engines; compare; return the device's."""
    res = []
    for d in (ref, dev):
        t = d.put(x)
        if theta is None:
            d.engine.rope(t, head_dim, pos)
        else:
            d.engine.rope_theta(t, head_dim, pos, theta)
        res.append(d.get(t))
    what = f"[shape {list(x.shape)} head_dim {head_dim} pos {pos} theta {theta}]"
    assert_close("rope", res[1], res[0], ROPE_TOL, what, nan_ok=nan_ok)
    only_position_zero = pos == 0 and (x.ndim < 2 or x.shape[x.ndim > 2] == 1)
    if x.size and not only_position_zero:
        assert not np.array_equal(res[1], x), f"rope left the tensor unchanged {what}"
    return res[1]


def randn(rng, shape) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


RANKS = [
    pytest.param((64,), 64, 5, id="rank1-one-head"),
    pytest.param((4 * 32,), 32, 3, id="rank1-4heads"),
    pytest.param((37, 3 * 64), 64, 0, id="rank2-3heads"),
    pytest.param((129, 128), 128, 17, id="rank2-one-head-d128"),
    pytest.param((2, 33, 4 * 32), 32, 7, id="rank3-4heads"),
    pytest.param((2, 65, 8, 64), 64, 123, id="rank4-8heads"),
    pytest.param((3, 7, 2, 16), 16, 0, id="rank4-d16"),
    pytest.param((1, 5, 3, 2), 2, 9, id="rank4-d2"),
    pytest.param((2, 9, 3, 72), 72, 1, id="rank4-d72"),
    pytest.param((2, 9, 3, 80), 80, 1, id="rank4-d80"),
    pytest.param((2, 9, 3, 96), 96, 1, id="rank4-d96"),
    pytest.param((2, 3, 4, 5, 16), 16, 2, id="rank5"),
    pytest.param((1, 1, 1, 128), 128, 1, id="rank4-single-vector"),
    pytest.param((3, 1000, 2, 64), 64, 0, id="rank4-seq1000"),
]


@pytest.mark.parametrize("shape,head_dim,pos", RANKS)
def test_rope_ranks_and_heads(dev, ref, rng, shape, head_dim, pos):
    check_rope(dev, ref, randn(rng, shape), head_dim, pos)


@pytest.mark.parametrize("shape,head_dim,pos,theta", [
    pytest.param((1, 16, 2, 128), 128, 100000, 100000.0, id="pos1e5-theta1e5-d128"),
    pytest.param((2, 300, 4, 64), 64, 100000, 100000.0, id="pos1e5-theta1e5-seq300"),
    pytest.param((4, 96), 96, 99999, 100000.0, id="rank2-pos1e5"),
    pytest.param((2, 64, 2, 64), 64, 2**20, 10000.0, id="pos2e20"),
    pytest.param((2, 64, 2, 64), 64, 31, 500000.0, id="theta5e5"),
    pytest.param((2, 64, 2, 32), 32, 31, 10.0, id="theta10"),
])
def test_rope_theta_and_large_positions(dev, ref, rng, shape, head_dim, pos, theta):
    check_rope(dev, ref, randn(rng, shape), head_dim, pos, theta)


def test_rope_large_tensor(dev, ref, rng):
    """[4, 1024, 8, 128]: 4M elements, many blocks; positions up to 4096 + 1023."""
    check_rope(dev, ref, randn(rng, (4, 1024, 8, 128)), 128, 4096)


def test_rope_is_rope_theta_10000(dev, rng):
    x = randn(rng, (2, 50, 4, 64))
    a, b = dev.put(x), dev.put(x)
    dev.engine.rope(a, 64, 11)
    dev.engine.rope_theta(b, 64, 11, 10000.0)
    assert dev.array_equal(a, b)


def test_rope_views_of_one_layout_agree(dev, rng):
    """[B, S, H*D] and its [B, S, H, D] view hold the same head vectors: same result, bit for
    bit, and a rope on a reshaped view writes through to the original."""
    x = randn(rng, (2, 40, 6 * 32))
    a = dev.put(x)
    b = dev.put(x)
    dev.engine.rope(a, 32, 5)
    dev.engine.rope(b.reshaped((2, 40, 6, 32)), 32, 5)
    assert dev.array_equal(a, b)


def test_rope_is_deterministic(dev, rng):
    x = randn(rng, (2, 129, 4, 96))
    a, b = dev.put(x), dev.put(x)
    dev.engine.rope_theta(a, 96, 100000, 100000.0)
    dev.engine.rope_theta(b, 96, 100000, 100000.0)
    assert dev.array_equal(a, b)


def test_rope_nan_stays_in_its_pair(dev, ref, rng):
    x = randn(rng, (2, 9, 3, 32))
    x[1, 4, 2, 3] = np.nan
    got = check_rope(dev, ref, x, 32, 8, nan_ok=True)
    nan = np.isnan(got)
    assert nan[1, 4, 2, 3] and nan[1, 4, 2, 3 + 16] and nan.sum() == 2


def test_rope_empty_tensor(dev, rng):
    t = dev.put(np.zeros((2, 0, 4, 64), dtype=np.float32))
    dev.engine.rope(t, 64, 0)
    assert dev.get(t).shape == (2, 0, 4, 64)


# --- errors on the GPU path -----------------------------------------------------------------------

def test_rope_host_tensor_is_a_clear_error(dev, rng):
    needs_real_gpu()
    from ferrocupy import UnifiedTensor

    host = UnifiedTensor(randn(rng, (2, 8, 2, 32)))
    before = host.to_numpy()
    with pytest.raises(ValueError) as e:
        dev.engine.rope(host, 32, 0)
    msg = str(e.value)
    assert "tensor" in msg and "cpu" in msg and "cuda" in msg, msg
    np.testing.assert_array_equal(host.to_numpy(), before)


@pytest.mark.parametrize("shape,head_dim", [
    pytest.param((2, 8, 2, 32), 31, id="odd-head_dim"),
    pytest.param((2, 8, 2, 32), 0, id="head_dim-0"),
    pytest.param((2, 8, 96), 64, id="not-whole-heads"),
    pytest.param((2, 8, 2, 32), -2, id="negative-head_dim"),
])
def test_rope_bad_arguments_raise_before_writing(dev, rng, shape, head_dim):
    x = randn(rng, shape)
    t = dev.put(x)
    with pytest.raises(ValueError):
        dev.engine.rope(t, head_dim, 0)
    np.testing.assert_array_equal(dev.get(t), x)


def test_rope_wrong_dtype_and_layout_raise(dev, rng):
    x = randn(rng, (2, 8, 2, 32))
    t64 = dev.put(x.astype(np.float64))
    with pytest.raises((TypeError, ValueError)):
        dev.engine.rope(t64, 32, 0)
    np.testing.assert_array_equal(dev.get(t64), x.astype(np.float64))
    base = dev.put(x)
    strided = base.buffer()[..., ::2]  # head_dim elements not contiguous
    with pytest.raises(ValueError, match="without a copy"):
        dev.engine.rope(strided, 16, 0)
    np.testing.assert_array_equal(dev.get(base), x)


def test_rope_bad_theta_and_pos_raise(dev, rng):
    x = randn(rng, (2, 8, 2, 32))
    t = dev.put(x)
    for theta in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError):
            dev.engine.rope_theta(t, 32, 0, theta)
    with pytest.raises(ValueError):
        dev.engine.rope(t, 32, -1)
    np.testing.assert_array_equal(dev.get(t), x)


# --- issue 27: positions, partial rotary, interleaved, inverse, out of place, layouts -------------
DTYPES = [pytest.param(FLOAT32, id="f32"), pytest.param(FLOAT16, id="f16"),
          pytest.param(BFLOAT16, id="bf16")]
ULP = {FLOAT16: 2.0**-10, BFLOAT16: 2.0**-7}  # relative spacing of the mantissa
OPTIONS = option_params(64)


def assert_matches(got: np.ndarray, want: np.ndarray, what: str) -> None:
    """float32 to ROPE_TOL; half precision within one ulp of the largest value."""
    if got.dtype == FLOAT32:
        assert_close("rope", got, want, ROPE_TOL, what)
        return
    g, w = got.astype(np.float64), want.astype(np.float64)
    assert not np.isnan(g).any(), f"NaN in the device output {what}"
    err = np.abs(g - w).max()
    assert err <= ULP[got.dtype] * np.abs(w).max(), f"{err:.3e}: more than 1 ulp away {what}"


def run_call(d, base: np.ndarray, cut, head_dim: int, pos: int, positions, out_of_place: bool,
             out_cut=None, theta: float = 10000.0, **kw):
    """RoPE on `d` of `cut(base)` (a view of the device copy of host `base`): out of place into a
    NaN-poisoned output (`out_cut` of a poisoned buffer, default a fresh contiguous one), or in
    place. Returns (result, the whole base afterwards) on the host."""
    b = d.put(base)
    x = UnifiedTensor(cut(b.buffer()))
    ps = d.put(positions)
    if out_of_place:
        if out_cut is None:
            out_base = d.poisoned(x.shape, dtype=base.dtype)
            out = out_base
        else:
            out_base = d.poisoned(out_cut[0], dtype=base.dtype)
            out = UnifiedTensor(out_cut[1](out_base.buffer()))
        d.engine.rope_theta(x, head_dim, pos, theta, positions=ps, out=out, **kw)
        d.sync()
        return out.to_numpy(), d.get(b)
    d.engine.rope_theta(x, head_dim, pos, theta, positions=ps, **kw)
    d.sync()
    return x.to_numpy(), d.get(b)


def check_call(dev, ref, base, cut, head_dim, pos, positions, out_of_place, what, **kw):
    """The device's result equals the reference's; the input is left as it was out of place."""
    got, got_base = run_call(dev, base, cut, head_dim, pos, positions, out_of_place, **kw)
    want, _ = run_call(ref, base, cut, head_dim, pos, positions, out_of_place, **kw)
    what = f"[{what} shape {list(base.shape)} head_dim {head_dim} pos {pos} {kw}]"
    assert_matches(got, want, what)
    def bits(a):
        return a.view(f"u{a.dtype.itemsize}")

    if out_of_place:
        assert np.array_equal(bits(got_base), bits(base)), f"input written {what}"
    else:  # in place: the view's elements rotated, every other element of the base as it was
        outside = np.ones(base.shape, bool)
        cut(outside)[...] = False
        assert np.array_equal(bits(got_base)[outside], bits(base)[outside]), \
            f"wrote past the view {what}"
    return got


def same(a):
    return a


@pytest.mark.parametrize("out_of_place,kind,kw,dtype", covering({
    "out_of_place": axis([False, True], ids=["in-place", "out"]),
    "kind": axis(POSITION_KINDS),
    "kw": axis(OPTIONS),
    "dtype": axis(DTYPES),
}))
def test_rope_options(dev, ref, rng, dtype, kw, kind, out_of_place):
    x = (2 * rng.standard_normal((2, 37, 3, 64))).astype(dtype)
    pos, positions = make_positions(rng, kind, 2, 37)
    check_call(dev, ref, x, same, 64, pos, positions, out_of_place, kind, **kw)


# (name, base shape, cut) for b, s, h, d = 2, 33, 4, 64: the layouts a model hands RoPE
LAYOUTS = [
    pytest.param((2, 33, 3, 4, 64), lambda a: a[:, :, 1], id="qkv-slice"),
    pytest.param((2, 4, 33, 64), lambda a: a.transpose(0, 2, 1, 3), id="bhsd-transposed"),
    pytest.param((2, 33, 4, 72), lambda a: a[..., 8:72], id="padded-rows"),
    pytest.param((33, 2, 3 * 4 * 64), lambda a: a.transpose(1, 0, 2)[..., 256:512],
                 id="seq-first-fused-3d"),
    pytest.param((2, 33, 4, 65), lambda a: a[..., 1:], id="rows-one-element-off"),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("base_shape,cut", LAYOUTS)
@pytest.mark.parametrize("out_of_place", [False, True], ids=["in-place", "out"])
def test_rope_strided_views(dev, ref, rng, dtype, base_shape, cut, out_of_place):
    """Views read (and written) where they lie, every access width; in place, nothing past the
    view changes (the whole base is compared)."""
    base = rng.standard_normal(base_shape).astype(dtype)
    _, positions = make_positions(rng, "BS-int64", 2, 33)
    check_call(dev, ref, base, cut, 64, 0, positions, out_of_place, "strided", rotary_dim=32,
               interleaved=True)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_strided_output(dev, ref, rng, dtype):
    """A transposed output ([B, H, S, D] memory) is written where it lies, rows padded."""
    x = rng.standard_normal((2, 33, 4, 64)).astype(dtype)
    out_cut = ((2, 4, 33, 80), lambda a: a[..., 8:72].transpose(0, 2, 1, 3))
    got, want = (run_call(d, x, same, 64, 5, None, True, out_cut=out_cut, rotary_dim=48)[0]
                 for d in (dev, ref))
    assert_matches(got, want, "strided output")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,head_dim,kw", [
    pytest.param((2, 9, 3, 6), 6, {}, id="d6-half3-one-element"),
    pytest.param((2, 9, 3, 12), 12, dict(interleaved=True), id="d12-interleaved"),
    pytest.param((2, 9, 3, 20), 20, dict(rotary_dim=4), id="d20-rotary4"),
    pytest.param((2, 9, 3, 16), 16, dict(rotary_dim=14), id="d16-rotary14-pass2"),
    pytest.param((2, 9, 3, 256), 256, dict(rotary_dim=64, interleaved=True), id="gptj-d256"),
    pytest.param((1, 3, 2, 512), 512, {}, id="d512"),
])
@pytest.mark.parametrize("out_of_place", [False, True], ids=["in-place", "out"])
def test_rope_access_widths(dev, ref, rng, dtype, shape, head_dim, kw, out_of_place):
    """Head dims and rotary widths whose halves are not whole 16-byte accesses run the
    narrower variants (4 bytes, one element); any even head_dim."""
    x = rng.standard_normal(shape).astype(dtype)
    _, positions = make_positions(rng, "S-int32", shape[0], shape[1])
    check_call(dev, ref, x, same, head_dim, 0, positions, out_of_place, "widths", **kw)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1, 64, 128), (3, 2, 40, 64), (1, 5, 1, 64)],
                         ids=["one-token-64-heads", "six-tokens-40-heads", "one-head"])
def test_rope_few_tokens_many_heads(dev, ref, rng, dtype, shape):
    """Few tokens: the heads are split into groups across threads (decode steps)."""
    x = rng.standard_normal(shape).astype(dtype)
    _, positions = make_positions(rng, "BS-int64", shape[0], shape[1])
    check_call(dev, ref, x, same, shape[-1], 0, positions, True, "groups", rotary_dim=32)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_large_positions(dev, ref, rng, dtype):
    """int32 and int64 positions past 2^24 (f32(t) rounds, as Hugging Face's), and negative."""
    x = rng.standard_normal((2, 16, 2, 64)).astype(dtype)
    for positions in (np.array([-(2**31), 2**31 - 1, 2**24 + 1, -5] * 4, np.int32),
                      np.array([[2**40 + 3, -(2**50)] * 8, [7, 2**33] * 8], np.int64)):
        check_call(dev, ref, x, same, 64, 0, positions, True, "large")


def test_rope_large_tensor_out_of_place(dev, ref, rng):
    """[4, 1024, 8, 128]: many blocks, every option at once, positions per batch entry."""
    x = randn(rng, (4, 1024, 8, 128))
    _, positions = make_positions(rng, "BS-int64", 4, 1024)
    check_call(dev, ref, x, same, 128, 0, positions, True, "large", rotary_dim=64,
               interleaved=True, inverse=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kw", OPTIONS[:5])
def test_rope_inverse_undoes_the_rotation(dev, rng, dtype, kw):
    x = rng.standard_normal((2, 33, 4, 64)).astype(np.float32)
    t = dev.put(x.astype(dtype))
    y = dev.poisoned(x.shape, dtype=dtype)
    dev.engine.rope(t, 64, 50_000, out=y, **kw)
    dev.engine.rope(y, 64, 50_000, inverse=True, **kw)
    back = dev.get(y).astype(np.float64)
    tol = 1e-5 if dtype == FLOAT32 else 3 * ULP[dtype]
    assert np.abs(back - x.astype(dtype).astype(np.float64)).max() <= tol * np.abs(x).max()


def test_rope_positions_equal_to_pos_plus_s_give_the_same_bits(dev, rng):
    x = randn(rng, (2, 40, 4, 64))
    a, b = dev.put(x), dev.put(x)
    dev.engine.rope(a, 64, 1000)
    dev.engine.rope(b, 64, 0, positions=dev.put(np.arange(1000, 1040, dtype=np.int32)))
    assert dev.array_equal(a, b)


def test_rope_positions_on_the_host_are_refused(dev, rng):
    needs_real_gpu()
    x = randn(rng, (2, 8, 2, 32))
    t = dev.put(x)
    with pytest.raises(ValueError, match=r"positions \(shape \(8,\)\) is on cpu"):
        dev.engine.rope(t, 32, 0, positions=np.arange(8, dtype=np.int32))
    np.testing.assert_array_equal(dev.get(t), x)


def test_rope_bad_options_raise_before_writing(dev, rng):
    x = randn(rng, (2, 8, 2, 32))
    t = dev.put(x)
    out = dev.poisoned(x.shape)
    for kw in (dict(rotary_dim=31), dict(rotary_dim=34), dict(interleaved=1),
               dict(positions=dev.put(np.arange(9, dtype=np.int64))),
               dict(positions=dev.put(np.arange(8.0, dtype=np.float32))),
               dict(out=dev.poisoned((2, 8, 2, 16)))):
        with pytest.raises((TypeError, ValueError)):
            dev.engine.rope(t, 32, 0, **(dict(out=out) | kw))
    np.testing.assert_array_equal(dev.get(t), x)
    assert np.isnan(dev.get(out)).all()
