"""Dropout's keep bits as each lane of a warp reads them (ferro_score.cuh's Dropout: `drop` in
the forwards, `keep_rows` in dQ, `keep_cols` in dK/dV), compiled with g++ and run as 32 threads,
one per lane, whose warp shuffles meet at a barrier: every lane's bits must be SPEC's for the
elements its accumulator fragment holds (row g / g + 8, keys 8 nt + 2t, + 1; dK/dV: keys as
rows), drawn here directly with `dropout_keep4` per element. Tiles starting on a Philox block of
four keys (j0 % 4 == 0) and between two (j0 % 4 == 2). A kernel that shares a Philox draw among
the lanes that read it (lab/candidates/dropout-shared-philox) must give the same bits."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cuda_on_host import LANES, build

SHIM = LANES + r"""
#include <thread>
#include <vector>

// A warp as 32 threads (cuda_on_host.LANES): a shuffle meets every lane.
typedef Lanes<32> Warp;
static thread_local Warp* tl_warp;
static thread_local int tl_lane;
static thread_local Dim tl_threadIdx;
template <class T> inline T warp_shfl_xor(unsigned, T x, int m) {
    return tl_warp->exchange(x, tl_lane, tl_lane ^ m);
}
template <class T> inline T warp_shfl(unsigned, T x, int src) {
    return tl_warp->exchange(x, tl_lane, src);
}
#define __shfl_xor_sync warp_shfl_xor
#define __shfl_sync warp_shfl
#define threadIdx tl_threadIdx
#include "ferro_score.cuh"

constexpr int NT = 8;

// out[lane][nt]: the lane's 4 bits for n-tile nt, element r at bit r, from each function:
// which 0: drop (a tile of ones, zeroed where dropped), 1: keep_rows, 2: keep_cols (query
// column i0 + nt * 8 + 2t, key rows key_base + g, + 8).
static void lane_run(int which, unsigned seed, float p, unsigned bh, unsigned i0, unsigned j0,
                     unsigned key_base, int lane, Warp* w, unsigned* out) {
    tl_warp = w;
    tl_lane = lane;
    tl_threadIdx = Dim{(unsigned)lane, 0, 0};
    FlashV2Params fp{};
    AttnExtras ex{};
    fp.dropout_prob = p;
    fp.seed = seed;
    AttnShape s = attn_shape(fp, ex, 0);
    const Dropout<true> drop(s);
    const Lane L{lane >> 2, lane & 3};
    if (which == 0) {
        float sc[NT][4];
        for (int nt = 0; nt < NT; ++nt) for (int r = 0; r < 4; ++r) sc[nt][r] = 1.f;
        const u32 b2[2] = {bh, bh + 7}, rows[2] = {i0 + L.g, i0 + L.g + 8};  // (heads differ)
        drop.template drop<NT, true>(sc, b2, rows, j0, L);
        for (int nt = 0; nt < NT; ++nt) {
            unsigned k = 0;
            for (int r = 0; r < 4; ++r) k |= (sc[nt][r] != 0.f) << r;
            out[lane * NT + nt] = k;
        }
    } else {
        for (int nt = 0; nt < NT; ++nt)
            out[lane * NT + nt] = which == 1
                ? drop.keep_rows(bh, i0 + L.g, i0 + L.g + 8, j0, nt, L)
                : drop.keep_cols(bh, i0 + nt * 8 + 2 * L.t, key_base + L.g);
    }
}

extern "C" int run(int which, unsigned seed, float p, unsigned bh, unsigned i0, unsigned j0,
                   unsigned key_base, unsigned* out) {
    Warp w;
    std::vector<std::thread> th;
    for (int lane = 0; lane < 32; ++lane)
        th.emplace_back(lane_run, which, seed, p, bh, i0, j0, key_base, lane, &w, out);
    for (auto& t : th) t.join();
    return w.broken;
}

extern "C" unsigned keep4(unsigned seed, float p, unsigned bh, unsigned i, unsigned j) {
    return dropout_keep4(seed, dropout_threshold(p), bh, i, j);
}
"""

NT = 8


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    lib = build(tmp_path_factory.mktemp("dropout_lanes_host"), SHIM, "dropout's lanes")
    u, f = ctypes.c_uint, ctypes.c_float
    lib.run.argtypes = [ctypes.c_int, u, f, u, u, u, u, ctypes.POINTER(u)]
    lib.run.restype = ctypes.c_int
    lib.keep4.argtypes = [u, f, u, u, u]
    lib.keep4.restype = u
    return lib


def kept(lib, seed, p, bh, i, j) -> int:
    """SPEC's keep bit of element (row i, key j)."""
    return (lib.keep4(seed, p, bh, i, j) >> (j & 3)) & 1


def lanes(lib, which, seed, p, bh, i0, j0, key_base=0) -> np.ndarray:
    out = np.zeros(32 * NT, np.uint32)
    broken = lib.run(which, seed, p, bh, i0, j0, key_base,
                     out.ctypes.data_as(ctypes.POINTER(ctypes.c_uint)))
    assert not broken, f"the warp diverged: a shuffle not every lane reached ({which=}, {j0=})"
    return out.reshape(32, NT)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), p=st.sampled_from([0.1, 0.5, 0.9]),
       bh=st.integers(0, 500), i0=st.integers(0, 5000), j4=st.integers(0, 3000),
       odd=st.booleans(), which=st.sampled_from([0, 1]))
def test_rows_lanes_read_their_own_keys(lib, seed, p, bh, i0, j4, odd, which):
    """drop and keep_rows: lane (g, t) holds rows i0 + g (r = 0, 1) and i0 + g + 8 (r = 2, 3),
    keys j0 + 8 nt + 2t (r even) and + 1 (r odd); drop's two rows of different heads (bh,
    bh + 7)."""
    j0 = 4 * j4 + (2 if odd else 0)
    got = lanes(lib, which, seed, p, bh, i0, j0)
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        for nt in range(NT):
            want = 0
            for r in range(4):
                i, j = i0 + g + 8 * (r >> 1), j0 + 8 * nt + 2 * t + (r & 1)
                head = bh + 7 * (r >> 1) if which == 0 else bh
                want |= kept(lib, seed, p, head, i, j) << r
            assert got[lane, nt] == want, (which, lane, nt, j0)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), p=st.sampled_from([0.1, 0.5, 0.9]),
       bh=st.integers(0, 500), i0=st.integers(0, 5000), k16=st.integers(0, 3000),
       koff=st.sampled_from([0, 0, 2, 5]))
def test_cols_lanes_read_their_own_keys(lib, seed, p, bh, i0, k16, koff):
    """keep_cols (dK/dV, keys as rows): lane (g, t) holds key rows key_base + g (r = 0, 1) and
    + 8 (r = 2, 3), query columns i0 + 8 nt + 2t (r even) and + 1 (r odd); key_base on a Philox
    block or not (koff)."""
    key_base = 16 * k16 + koff
    got = lanes(lib, 2, seed, p, bh, i0, 0, key_base)
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        for nt in range(NT):
            want = 0
            for r in range(4):
                i, j = i0 + 8 * nt + 2 * t + (r & 1), key_base + g + 8 * (r >> 1)
                want |= kept(lib, seed, p, bh, i, j) << r
            assert got[lane, nt] == want, (lane, nt, key_base)
