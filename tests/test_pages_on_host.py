"""ferro_pages.cuh on the CPU (compiled with g++, CUDA's qualifiers stubbed: tests/cuda_on_host.py):
the page translation every paged kernel reads K and V through (the decode kernels' TileKeys and
the forward's paged builds' tile copies, PagedRows). For a tile of keys [jt, jt + rows) of which
those below n_rows exist, each existing key's row offset must be block_table[b, j // page] *
block_stride + (j % page) * row_stride; the table is read only at entries of pages those keys
lie in (a block the sequence does not reach is never read), and once for the whole tile where
one page holds its existing keys. Every page size from 1 (powers of two take the shift), table
rows of any batch entry, tiles at any offset."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis", reason="hypothesis is not installed")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from cuda_on_host import build  # noqa: E402

MAX_READS = 4096

SHIM = r"""
#include <cstdint>
inline int __ffs(int x) { return __builtin_ffs(x); }
// Table reads, recorded: which entries (from the table's start) a translation reads.
static const int* g_table = nullptr;
static long long g_reads[4096];
static int g_n_reads = 0;
template <class T> inline T __ldg(const T* p) {
    if (g_n_reads < 4096) g_reads[g_n_reads] = (long long)(p - g_table);
    ++g_n_reads;
    return *p;
}
#define FERRO_PAGED 1  // (a paged build: configs.py's `paged` variants)
#include "ferro_pages.cuh"

// Offsets of keys [jt, min(jt + rows, n_rows)) of batch entry b through PagedRows (out), the
// table entries read (reads, at most 4096) and their count (returned); one_page: the tile's.
extern "C" int tile_rows(const int* table, unsigned page, unsigned seq_k, unsigned b,
                         unsigned long long block_stride, unsigned long long row_stride,
                         long long jt, long long rows, long long n_rows,
                         unsigned long long* out, long long* reads, int* one_page) {
    g_table = table, g_n_reads = 0;
    const KeyPages pg = key_pages(table, page, seq_k, b);
    const Strides t{block_stride, row_stride, 1};
    const PagedRows at(pg, t, jt, rows, n_rows);
    *one_page = at.tile.one_page;
    for (long long j = jt; j < jt + rows && j < n_rows; ++j) out[j - jt] = at(j);
    for (int i = 0; i < g_n_reads && i < 4096; ++i) reads[i] = g_reads[i];
    return g_n_reads;
}

// A contiguous cache (no table): row j of the one page.
extern "C" unsigned long long contiguous_row(long long j) {
    const KeyPages pg = contiguous_pages();
    unsigned long long block, row;
    key_slot(pg, j, block, row);
    return block * 1000000 + row;
}
"""


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    lib = build(tmp_path_factory.mktemp("pages_host"), SHIM, "the page translation's host build")
    p, u32, u64, i64 = ctypes.c_void_p, ctypes.c_uint, ctypes.c_ulonglong, ctypes.c_longlong
    lib.tile_rows.argtypes = [p, u32, u32, u32, u64, u64, i64, i64, i64, p, p, p]
    lib.tile_rows.restype = ctypes.c_int
    lib.contiguous_row.argtypes = [i64]
    lib.contiguous_row.restype = u64
    return lib


def translate(lib, table, page, b, jt, rows, n_rows, block_stride=1 << 20, row_stride=1 << 8):
    """(offsets of the tile's existing keys, table entries read (flat), whether one page)."""
    table = np.ascontiguousarray(table, np.int32)
    n = max(0, min(jt + rows, n_rows) - jt)
    out = np.zeros(max(n, 1), np.uint64)
    reads = np.zeros(MAX_READS, np.int64)
    one = ctypes.c_int(0)
    count = lib.tile_rows(table.ctypes.data, page, table.shape[1] * page, b, block_stride,
                          row_stride, jt, rows, n_rows, out.ctypes.data, reads.ctypes.data,
                          ctypes.byref(one))
    return out[:n], reads[:min(count, MAX_READS)], bool(one.value), count


def expected(table, page, b, jt, rows, n_rows, block_stride=1 << 20, row_stride=1 << 8):
    js = np.arange(jt, min(jt + rows, n_rows))
    return (table[b, js // page].astype(np.uint64) * np.uint64(block_stride)
            + (js % page).astype(np.uint64) * np.uint64(row_stride))


def _table(rng, batch, max_blocks, n_rows, page):
    """A shuffled table; entries past the pages n_rows reaches are not block ids."""
    table = rng.permutation(batch * max_blocks).reshape(batch, max_blocks).astype(np.int32)
    table[:, -(-n_rows // page):] = -2**31
    return table


@pytest.mark.parametrize("page", [1, 16, 48, 63, 64, 256])
@pytest.mark.parametrize("rows", [64, 128])
def test_every_tile_of_a_sequence(lib, rng, page, rows):
    """Every tile of a 1000-key sequence (batch entry 1 of 3) through pages of each size (63:
    a tile's last key one past its first page)."""
    n_rows = 1000
    max_blocks = -(-1024 // page)
    table = _table(rng, 3, max_blocks, n_rows, page)
    for jt in range(0, n_rows, rows):
        got, reads, one, count = translate(lib, table, page, 1, jt, rows, n_rows)
        np.testing.assert_array_equal(got, expected(table, page, 1, jt, rows, n_rows))
        entries = set((reads - max_blocks).tolist())  # entries of row 1
        reached = set(range(jt // page, (min(jt + rows, n_rows) - 1) // page + 1))
        assert entries <= reached, f"tile {jt}: reads entries {sorted(entries - reached)}"
        last = min(jt + rows, n_rows) - 1
        assert one == (jt // page == last // page)
        if one:
            assert count == 1, f"tile {jt} in one page read the table {count} times"


def test_a_tile_in_one_page_translates_once_even_when_the_page_is_larger(lib, rng):
    """Pages of 256 hold whole tiles of 64: one table read a tile; the last tile, cut by
    n_rows, too."""
    table = _table(rng, 2, 4, 1000, 256)
    for jt in range(0, 1000, 64):
        _, _, one, count = translate(lib, table, 256, 0, jt, 64, 1000)
        assert one and count == 1


def test_a_contiguous_cache_is_one_page(lib):
    assert [lib.contiguous_row(j) for j in (0, 5, 70000)] == [0, 5, 70000]


@settings(max_examples=200, deadline=None)
@given(page=st.integers(1, 300), rows=st.sampled_from([16, 32, 64, 128]),
       n_rows=st.integers(1, 2000), tile=st.integers(0, 200), b=st.integers(0, 2),
       seed=st.integers(0, 2**32 - 1))
def test_random_pages_and_tiles(lib, page, rows, n_rows, tile, b, seed):
    jt = (tile * rows) % (-(-n_rows // rows) * rows)  # a tile holding an existing key
    rng = np.random.default_rng(seed)
    max_blocks = -(-n_rows // page) + int(rng.integers(0, 3))
    table = _table(rng, 3, max_blocks, n_rows, page)
    got, reads, one, count = translate(lib, table, page, b, jt, rows, n_rows, 3 * 1024 + 7, 24)
    np.testing.assert_array_equal(got, expected(table, page, b, jt, rows, n_rows, 3 * 1024 + 7,
                                                24))
    row = reads - b * max_blocks
    assert ((row >= jt // page) & (row <= (min(jt + rows, n_rows) - 1) // page)).all()
    assert not one or count == 1
