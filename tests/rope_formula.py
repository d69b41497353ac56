"""RoPE written out from SPEC, independent of ferrocupy.reference: scalar float32 arithmetic for
each inverse frequency and angle, float64 cos/sin and rotation, pair by pair. The oracle of the
RoPE tests (reference, kernel and torch op alike)."""

from __future__ import annotations

import numpy as np
import pytest

POSITION_KINDS = ("pos", "S-int32", "BS-int64", "1S-int64")


def option_params(head_dim: int, inverse: bool = True) -> list:
    """pytest params of the RoPE options for a head_dim (a multiple of 8): full, partial (half,
    and narrow), interleaved, both, (and with `inverse`, the inverse, and everything at once)."""
    d = head_dim
    params = [pytest.param({}, id="full"),
              pytest.param(dict(rotary_dim=d // 2), id="partial-half"),
              pytest.param(dict(rotary_dim=d // 8 * 2 if d > 8 else 2), id="partial-narrow"),
              pytest.param(dict(interleaved=True), id="interleaved"),
              pytest.param(dict(rotary_dim=d // 2, interleaved=True), id="partial-interleaved")]
    if inverse:
        params += [pytest.param(dict(inverse=True), id="inverse"),
                   pytest.param(dict(rotary_dim=d // 4, interleaved=True, inverse=True),
                                id="all")]
    return params


def make_positions(rng: np.random.Generator, kind: str, b: int, s: int):
    """(pos, positions) of one of POSITION_KINDS for b sequences of s tokens: `pos` near 1e5
    and no positions, or int32 `[S]`, int64 `[B, S]` or int64 `[1, S]` positions reaching 1e5
    and going negative (with pos 0)."""
    if kind == "pos":
        return 99_000, None
    shape = {"S-int32": (s,), "BS-int64": (b, s), "1S-int64": (1, s)}[kind]
    return 0, rng.integers(-500, 100_000, shape).astype(
        np.int32 if kind.endswith("int32") else np.int64)


def inverse_frequencies(rotary_dim: int, theta) -> list:
    """`inv_i = 1 / f32(pow(f64(f32(theta)), f64(f32(2i) / f32(r))))`, one float32 at a time."""
    out = []
    for i in range(rotary_dim // 2):
        e = np.float32(2 * i) / np.float32(rotary_dim)
        out.append(np.float32(1.0) / np.float32(float(np.float32(theta)) ** float(e)))
    return out


def positions_of(shape4, pos: int = 0, positions=None) -> np.ndarray:
    """`[B, S]` int64 positions of a `[B, S, H, D]` call: `pos + s`, or the given `[S]`,
    `[1, S]` or `[B, S]` positions broadcast."""
    b, s = shape4[:2]
    if positions is None:
        return np.broadcast_to(pos + np.arange(s, dtype=np.int64), (b, s))
    return np.broadcast_to(np.asarray(positions, dtype=np.int64).reshape(-1, s), (b, s))


def rope_formula(x4, t, theta, rotary_dim=None, interleaved=False, inverse=False) -> np.ndarray:
    """RoPE of `x4` (`[B, S, H, D]`, any float dtype) at positions `t` (`[B, S]`), in float64."""
    y = np.array(x4, dtype=np.float64)
    d = y.shape[-1]
    r = d if rotary_dim is None else rotary_dim
    inv = inverse_frequencies(r, theta)
    for b in range(y.shape[0]):
        for s in range(y.shape[1]):
            t32 = np.float32(int(t[b, s]))
            for i, f in enumerate(inv):
                angle = float(t32 * f)  # a float32 product
                c, sn = np.cos(angle), np.sin(angle) * (-1.0 if inverse else 1.0)
                j, k = (2 * i, 2 * i + 1) if interleaved else (i, i + r // 2)
                a, bb = y[b, s, :, j].copy(), y[b, s, :, k].copy()
                y[b, s, :, j], y[b, s, :, k] = a * c - bb * sn, bb * c + a * sn
    return y


def as_bshd(x, head_dim: int):
    """A `[B, S, H, D]` view (or copy) of a RoPE tensor under the seed's rank rule."""
    x = np.asarray(x)
    if x.ndim <= 1:
        return x.reshape(1, 1, -1, head_dim)
    if x.ndim == 2:
        return x.reshape(1, x.shape[0], -1, head_dim)
    return x.reshape(x.shape[0], x.shape[1], -1, head_dim)
