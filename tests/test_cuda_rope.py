"""RoPE (rotate-half, in place) on the GPU against the NumPy reference (issue 3).

Both sides form the angle `f32(pos + s) * f32(1 / theta^(2i/D))` in float32 (SPEC "RoPE"), so
they agree to float32 rounding even at positions near 1e5. Skipped unless
`ferrocupy.cuda_available()`; `FERRO_GPU_TESTS_ON_REFERENCE=1` runs it reference-vs-reference.
"""

from __future__ import annotations

import numpy as np
import pytest

# gpu_helpers is in tests/, which conftest puts on sys.path.
from gpu_helpers import ROPE_TOL, assert_close, dev, gpu_pytestmark, needs_real_gpu, ref

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
    strided = base.buffer()[:, ::2]  # non-contiguous view of the same memory
    with pytest.raises(ValueError, match="contiguous"):
        dev.engine.rope(strided, 32, 0)
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
