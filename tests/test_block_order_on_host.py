"""The order in which blocks take (batch, head) pairs and tiles (ferro_tiles.cuh's block_coords)
on the CPU, built with g++ (tests/cuda_on_host.py), over random grids (hypothesis).

Every kernel that orders its blocks so (the query-tile kernels, both dK/dV kernels) relies on it
being a bijection from block numbers onto (pair, tile rank); the fused backward's add order also
relies on each pair's tiles keeping their turn (rank 0 dispatched first). Where the call's mask is
shared by its batch entries (batch stride 0), the pairs go batch entry fastest: the entries of one
head run side by side."""

from __future__ import annotations

import ctypes

import pytest

hypothesis = pytest.importorskip("hypothesis", reason="hypothesis is not installed")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from cuda_on_host import build  # noqa: E402

SHIM = r"""
#include "ferro_tiles.cuh"
extern "C" {
// Block x's pair and rank for a call of `batch` entries, `heads` heads, a mask (has_mask) of
// batch stride sb.
void coords(unsigned x, unsigned tiles, unsigned batch, unsigned heads, unsigned has_mask,
            unsigned sb, unsigned* r) {
    AttnShape s;
    std::memset(&s, 0, sizeof s);
    s.batch = batch;
    s.has_mask = has_mask;
    s.sb = sb;
    block_coords(x, tiles, s, heads, r[0], r[1]);
}
}
"""


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    lib = build(tmp_path_factory.mktemp("block_order_host"), SHIM, "the block order")
    u = ctypes.c_uint
    lib.coords.argtypes = [u, u, u, u, u, u, ctypes.POINTER(u)]
    return lib


@settings(max_examples=200, deadline=None)
@given(batch=st.integers(1, 7), heads=st.integers(1, 40), tiles=st.integers(1, 9),
       has_mask=st.booleans(), sb=st.sampled_from([0, 1, 4096]))
def test_block_order(lib, batch, heads, tiles, has_mask, sb):
    r = (ctypes.c_uint * 2)()
    seen = []
    for x in range(batch * heads * tiles):
        lib.coords(x, tiles, batch, heads, int(has_mask), sb, r)
        seen.append((r[0], r[1]))
    # a bijection onto the (pair, rank) grid
    assert sorted(seen) == [(p, t) for p in range(batch * heads) for t in range(tiles)]
    # each pair's ranks in turn
    for p in range(batch * heads):
        assert [t for q, t in seen if q == p] == list(range(tiles))
    if has_mask and sb == 0 and batch > 1:  # a shared mask: the first pairs are one head's entries
        first = [q for q, t in seen[:min(batch, 16)] if t == 0]
        assert [q // heads for q in first] == list(range(len(first)))
        assert len({q % heads for q in first}) == 1
    elif not has_mask or sb:  # otherwise batch entry 0's heads come first
        first = [q for q, t in seen[:min(heads, 16)] if t == 0]
        assert all(q // heads == 0 for q in first)
