"""ferro_visibility.cuh's split_keys_range (the decode kernels') on the CPU (g++, tests/cuda_on_host.py): how a decode
block's split of a batch entry's keys is chosen. Over every split of an entry, the ranges must
cover exactly the keys some row of the entry can see ([lo, hi): its kv_lens entry, its window,
clipped to the reach), each once, in runs of whole tiles of the kernel's step from lo (the last
run cut at hi), with no split longer than its share: ceil(tiles / splits) tiles. A cache far
longer than its sequences (kv_lens) or a sliding window therefore gives every split work rather
than leaving most of them empty (the lab/reviews/2026-12-07-decode.md finding 2)."""

from __future__ import annotations

import ctypes

import pytest

hypothesis = pytest.importorskip("hypothesis", reason="hypothesis is not installed")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from cuda_on_host import build  # noqa: E402

SHIM = r"""
#include "ferro_params.cuh"
#include "ferro_visibility.cuh"

extern "C" void split_range(long long kv_len, long long kv_reach, unsigned left, unsigned right,
                            long long offset, unsigned seq_q, unsigned split, unsigned splits,
                            unsigned step, long long* lo, long long* hi) {
    AttnShape s{};
    s.kv_len = kv_len, s.kv_reach = kv_reach, s.left = left, s.right = right;
    s.offset = offset, s.seq_q = seq_q;
    split_keys_range(s, split, splits, step, *lo, *hi);
}
"""


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    lib = build(tmp_path_factory.mktemp("decode_splits_host"), SHIM,
                "the decode splits' host build")
    i64, u32, p = ctypes.c_longlong, ctypes.c_uint, ctypes.c_void_p
    lib.split_range.argtypes = [i64, i64, u32, u32, i64, u32, u32, u32, u32, p, p]
    lib.split_range.restype = None
    return lib


UNBOUNDED = 0xFFFFFFFF


def ranges(lib, splits, step, *, kv_len, kv_reach, left=UNBOUNDED, right=0, offset, seq_q=1):
    out = []
    for split in range(splits):
        lo, hi = ctypes.c_longlong(), ctypes.c_longlong()
        lib.split_range(kv_len, kv_reach, left, right, offset, seq_q, split, splits, step,
                        ctypes.byref(lo), ctypes.byref(hi))
        out.append((lo.value, hi.value))
    return out


def visible(kv_len, kv_reach, left, right, offset, seq_q):
    """[lo, hi): the keys some row (positions offset .. offset + seq_q - 1) sees."""
    lo = 0 if left == UNBOUNDED else max(0, offset - left)
    hi = kv_len if right == UNBOUNDED else min(kv_len, offset + seq_q - 1 + right + 1)
    hi = min(hi, kv_reach)
    return lo, max(lo, hi)


def check(lib, splits, step, **shape):
    got = ranges(lib, splits, step, **shape)
    lo, hi = visible(shape["kv_len"], shape["kv_reach"], shape.get("left", UNBOUNDED),
                     shape.get("right", 0), shape["offset"], shape.get("seq_q", 1))
    keys = [j for a, b in got for j in range(a, b)]
    assert keys == list(range(lo, hi)), f"splits {got} do not cover [{lo}, {hi}) once, in order"
    share = -(-(-(-(hi - lo) // step)) // splits) * step  # ceil(tiles / splits) tiles
    for a, b in got:
        assert b - a <= share, f"split {a, b} longer than its share {share}"
        assert a == b or (a - lo) % step == 0, f"split {a, b} not on a tile from {lo}"
    return got


def test_a_short_sequence_in_a_long_cache_uses_every_split(lib):
    """The review's case: 2048 keys (kv_lens) of a 32768-key cache, 32 splits of 64-key tiles:
    every split gets 64 keys (the capacity's division gave two splits 1024 each)."""
    got = check(lib, 32, 64, kv_len=2048, kv_reach=2048, offset=2047)
    assert [b - a for a, b in got] == [64] * 32


def test_a_sliding_window_is_divided_from_its_first_key(lib):
    got = check(lib, 13, 64, kv_len=131072, kv_reach=131072, left=4095, offset=131071)
    assert got[0][0] == 131072 - 4096 and all(b > a for a, b in got)


def test_no_keys_gives_empty_splits(lib):
    assert all(a == b for a, b in check(lib, 8, 64, kv_len=0, kv_reach=0, offset=-1))


@settings(max_examples=400, deadline=None)
@given(kv_len=st.integers(0, 5000), reach_cut=st.integers(0, 300), splits=st.integers(1, 40),
       step=st.sampled_from([16, 32, 64, 128]), seq_q=st.integers(1, 16),
       left=st.one_of(st.just(UNBOUNDED), st.integers(0, 3000)),
       right=st.one_of(st.just(UNBOUNDED), st.integers(0, 40)), back=st.integers(-20, 20))
def test_random_entries(lib, kv_len, reach_cut, splits, step, seq_q, left, right, back):
    """Any entry: kv_lens, a reach short of it, windows of either side, rows before the keys
    (negative offsets) or past them."""
    check(lib, splits, step, kv_len=kv_len, kv_reach=max(0, kv_len - reach_cut), left=left,
          right=right, offset=kv_len - seq_q + back, seq_q=seq_q)
