"""The kernels' varlen seam on the CPU: ferro_params.cuh's `with_varlen` / `for_sequence` /
`q_rows` / `k_rows` / `row_index` and ferro_tiles.cuh's `query_tile_at` / `key_tiles`, compiled
with g++ (CUDA's qualifiers stubbed), against the reference backend's `_Frame` (the one
definition of where a packed sequence lies and how it sits in the [max_seqlen_q, max_seqlen_k]
frame). Every varlen kernel takes its sequence's rows, keys, row positions and per-row indices
from these functions, so a packed batch is checked here tile by tile: the grid's tiles of each
(sequence, head) cover its rows exactly once (tiles past its rows are empty and visit no key),
each row sees exactly the keys the reference's rule gives it, and its addresses are the packed
tensors' rows of that sequence."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis", reason="hypothesis is not installed")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from cuda_on_host import build  # noqa: E402
from ferrocupy import AttentionOptions  # noqa: E402
from ferrocupy import reference as ref  # noqa: E402
from ferrocupy.params import (ATTN_EXTRAS, ATTN_LAYOUT, FLASH_V2_PARAMS, AttentionDims,  # noqa: E402
                              extras_params, layout_params)

BN = 16  # key tile of the shim's key_tiles
HEADER = 14  # words a tile writes before its rows' key intervals

SHIM = r"""
#define FERRO_VARLEN 1  // (a varlen build: configs.py's `varlen` variants)
#include "ferro_tiles.cuh"

template <int BM>
static void tile_of(unsigned x, int from_end, const FlashV2Params* p, const AttnExtras* ex,
                    const AttnLayout* lay, const int* cu_q, const int* cu_k, long long* r) {
    AttnShape s = attn_shape(*p, *ex, MASK_F32);
    with_varlen(s, *ex, cu_q, cu_k);
    const Lane L{0, 0};
    const QueryTile t = query_tile_at<BM, 1>(x, s, *lay, L, from_end != 0);
    long long j_first;
    const int n_tiles = key_tiles<16>(s, t, j_first);
    const long long head[14] = {t.b, t.h, t.m0, t.m_last, t.empty(), (long long)t.q.off,
                                (long long)t.o.off, (long long)t.k.off, (long long)t.v.off,
                                (long long)row_index(s, t.b, t.h), j_first, n_tiles,
                                s.kv_reach, (long long)s.seq_q};
    for (int n = 0; n < 14; ++n) r[n] = head[n];
    for (int i = 0; i < BM; ++i) {
        int lo, hi;
        visible_cols(s, t.m0 + i, 0, 1 << 20, lo, hi);
        r[14 + 2 * i] = lo;
        r[15 + 2 * i] = hi;
    }
}

extern "C" void tile(unsigned x, int bm, int from_end, const FlashV2Params* p,
                     const AttnExtras* ex, const AttnLayout* lay, const int* cu_q,
                     const int* cu_k, long long* r) {
    if (bm == 16) tile_of<16>(x, from_end, p, ex, lay, cu_q, cu_k, r);
    else tile_of<32>(x, from_end, p, ex, lay, cu_q, cu_k, r);
}
"""


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    lib = build(tmp_path_factory.mktemp("varlen_host"), SHIM, "the varlen seam's host build")
    ptr = ctypes.c_void_p
    lib.tile.argtypes = [ctypes.c_uint, ctypes.c_int, ctypes.c_int, ptr, ptr, ptr, ptr, ptr, ptr]
    return lib


def _cu(lens) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)


class Packed:
    """A varlen call's structs, packed by params.py as the engine packs them, and its
    reference frame."""

    def __init__(self, lens_q, lens_k, max_q, max_k, heads, kv_heads, opts, alibi=False):
        self.cu_q, self.cu_k = _cu(lens_q), _cu(lens_k)
        d = 8
        self.q = np.zeros((int(self.cu_q[-1]), heads, d), np.float32)
        self.k = np.zeros((int(self.cu_k[-1]), kv_heads, d), np.float32)
        dims = AttentionDims.packed(self.q, self.k, len(lens_q), max_q, max_k)
        self.dims = dims
        self.p = dims.params(opts)
        slopes = np.zeros(heads, np.float32) if alibi else None
        self.ex = extras_params(opts, slopes, None, varlen=True)
        self.lay = layout_params({"q": self.q, "out": self.q, "k": self.k, "v": self.k})
        fields = ref._fields(self.p, self.ex)
        self.entries = list(ref._Frame(fields, self.q, self.k, self.cu_q, self.cu_k).entries())

    def kernel_tiles(self, lib, bm: int, from_end: bool):
        """Every grid tile's header and per-row key intervals, as the kernels compute them."""
        p = np.array(self.p, FLASH_V2_PARAMS)
        ex = np.array(self.ex, ATTN_EXTRAS)
        lay = np.array(self.lay, ATTN_LAYOUT)
        n_tiles = -(-self.dims.seq_q // bm) * self.dims.batch * self.dims.heads
        out = np.zeros((n_tiles, HEADER + 2 * bm), np.int64)
        for x in range(n_tiles):
            lib.tile(x, bm, int(from_end), p.ctypes.data, ex.ctypes.data, lay.ctypes.data,
                     self.cu_q.ctypes.data, self.cu_k.ctypes.data, out[x].ctypes.data)
        return out


def check(lib, c: Packed, bm: int, from_end: bool) -> None:
    tiles = c.kernel_tiles(lib, bm, from_end)
    H, Hkv = c.dims.heads, c.dims.kv_heads
    total_q = int(c.cu_q[-1])
    lay = c.lay
    covered = {}
    for t in tiles:
        b, h, m0, m_last, empty, q_off, o_off, k_off, v_off, row0, j_first, n_kt, reach, sq = \
            (int(x) for x in t[:HEADER])
        e = c.entries[b]
        pn = e.p
        sq_n, sk_n = int(pn["seq_q"]), int(pn["seq_k"])
        assert sq == sq_n, ("the tile's seq_q is its sequence's", b, sq, sq_n)
        rows = list(range(max(m0, 0), m_last + 1))
        assert bool(empty) == (not rows), ("empty() is 'no row'", b, h, m0, m_last)
        if empty:
            assert n_kt == 0, ("an empty tile visits no key tile", b, h, m0)
            continue
        hk = h // (H // Hkv)
        r0, k0 = int(c.cu_q[b]), int(c.cu_k[b])
        assert q_off == r0 * lay["q_s"] + h * lay["q_h"], ("q rows", b, h)
        assert o_off == r0 * lay["out_s"] + h * lay["out_h"], ("out rows", b, h)
        assert k_off == k0 * lay["k_s"] + hk * lay["k_h"], ("k rows", b, hk)
        assert v_off == k0 * lay["v_s"] + hk * lay["v_h"], ("v rows", b, hk)
        assert row0 == h * total_q + r0, ("lse / stats row [heads, total_q]", b, h)
        vis = ref.visible(pn, rows, np.arange(sk_n))  # the reference's rule, its frame
        seen = []
        for i in rows:
            assert (b, h, i) not in covered, ("row in two tiles", b, h, i)
            covered[b, h, i] = True
            lo, hi = (int(x) for x in t[HEADER + 2 * (i - m0):HEADER + 2 * (i - m0) + 2])
            got = np.zeros(sk_n, bool)
            got[lo:hi + 1] = True
            want = vis[i - rows[0]]
            assert np.array_equal(got, want), ("visible keys", b, h, i, lo, hi,
                                               np.flatnonzero(want))
            seen.extend(np.flatnonzero(want))
        if seen:
            assert j_first <= min(seen) and j_first + BN * n_kt > max(seen), \
                ("key tiles cover the visible keys", b, h, m0, j_first, n_kt)
            assert max(seen) < reach <= sk_n, ("kv_reach", b, reach, sk_n)
    want = {(n, h, i) for n, e in enumerate(c.entries) for h in range(H)
            for i in range(int(e.p["seq_q"]))}
    assert set(covered) == want, "every row of every (sequence, head) in one tile"


def test_packed_sequences_bottom_right_causal(lib):
    opts = AttentionOptions(causal=True, causal_offset=5 - 4)  # bottom-right in the frame
    c = Packed([3, 0, 4, 1], [5, 2, 0, 1], 4, 5, 4, 2, opts)
    for bm in (16, 32):
        for from_end in (False, True):
            check(lib, c, bm, from_end)


def test_sequences_longer_than_a_tile_with_a_window(lib):
    opts = AttentionOptions(window_left=3, window_right=2, causal_offset=-2)
    c = Packed([40, 17, 33], [35, 50, 0], 45, 50, 3, 1, opts)
    for from_end in (False, True):
        check(lib, c, 16, from_end)


@st.composite
def calls(draw):
    n = draw(st.integers(1, 5))
    lens_q = draw(st.lists(st.sampled_from([0, 1, 2, 5, 16, 17, 31, 40]), min_size=n,
                           max_size=n))
    lens_k = draw(st.lists(st.sampled_from([0, 1, 3, 16, 20, 33]), min_size=n, max_size=n))
    max_q = max(lens_q) + draw(st.integers(0, 3))
    max_k = max(lens_k) + draw(st.integers(0, 3))
    kv_heads = draw(st.sampled_from([1, 2]))
    heads = kv_heads * draw(st.sampled_from([1, 3]))
    opts = AttentionOptions(causal=draw(st.booleans()), causal_offset=draw(st.integers(-6, 6)),
                            window_left=draw(st.integers(-1, 9)),
                            window_right=draw(st.integers(-1, 9)))
    return Packed(lens_q, lens_k, max_q, max_k, heads, kv_heads, opts), \
        draw(st.sampled_from([16, 32])), draw(st.booleans())


@settings(max_examples=60, deadline=None)
@given(calls())
def test_random_packings(lib, call):
    c, bm, from_end = call
    check(lib, c, bm, from_end)
