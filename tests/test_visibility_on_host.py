"""The kernels' visibility rule on the CPU: ferro_visibility.cuh, ferro_score.cuh's spans and
ferro_params.cuh's `attn_shape` / `for_batch` / `key_reach`, compiled with g++ (CUDA's
qualifiers stubbed), against SPEC's rule written out here. Every attention kernel family decides
which keys a row sees through these functions (per element, per tile, per block, and which keys
are loaded at all), so CI checks them on every change, for the options the kernels take today
(causal with a non-negative offset, a symmetric window, kv_lens) and for those SPEC adds
(a negative offset, asymmetric windows), which the kernels get through the same functions.

SPEC's rule: row i of a batch sits at a = i + causal_offset (+ kv_lens[b] - seq_k with kv_lens);
key j < kv_len is visible iff a - window_left <= j <= a + window_right (-1: that side unbounded)
and, under causal, j <= a. The symmetric `window = w > 0` is window_left = window_right = w - 1."""

from __future__ import annotations

import ctypes

import pytest

hypothesis = pytest.importorskip("hypothesis", reason="hypothesis is not installed")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from cuda_on_host import build  # noqa: E402

SHIM = r"""
#include "ferro_score.cuh"

// One call's options, as the test passes them; left/right < -1: the seed's symmetric `window`,
// which AttnExtras restates (params.py's seed_extras), else SPEC's window_left/right.
struct Opt { int causal, window, offset, seq_q, seq_k, kv_len, left, right; };

static AttnShape shape(const Opt& o) {
    FlashV2Params p;
    std::memset(&p, 0, sizeof p);
    p.batch = p.heads = p.kv_heads = 1;
    p.head_dim = 8;
    p.scale = 1.f;
    p.seq_q = o.seq_q;
    p.seq_k = o.seq_k;
    p.causal = o.causal;
    p.window = o.window;
    p.causal_offset = (u32)o.offset;  // the struct word holds the int32's bits
    AttnExtras ex;
    std::memset(&ex, 0, sizeof ex);
    if (o.left >= -1) {
        ex.window_left = o.left;
        ex.window_right = o.right;
    } else {
        ex.window_left = ex.window_right = o.window ? o.window - 1 : -1;
    }
    AttnShape s = attn_shape(p, ex, MASK_F32);
    if (o.kv_len >= 0) {
        const int lens[1] = {o.kv_len};
        for_batch(s, lens, 0);
    }
    return s;
}

extern "C" {
int vis(const Opt* o, long long a, long long j) { return visible(shape(*o), a, j); }
void key_range(const Opt* o, long long a_lo, long long a_hi, long long* r) {
    visible_key_range(shape(*o), a_lo, a_hi, r[0], r[1]);
}
void row_range(const Opt* o, long long j_lo, long long j_hi, long long* r) {
    visible_row_range(shape(*o), j_lo, j_hi, r[0], r[1]);
}
void cols(const Opt* o, long long i, long long j0, int n, int* r) {
    visible_cols(shape(*o), i, j0, n, r[0], r[1]);
}
void rows(const Opt* o, long long j, long long i0, int n, int* r) {
    const KeySpan k = row_span(shape(*o), j, i0, n);
    r[0] = k.lo;
    r[1] = k.hi;
}
int whole(const Opt* o, long long i_lo, long long i_hi, long long j_lo, long long j_hi) {
    return wholly_visible(shape(*o), i_lo, i_hi, j_lo, j_hi);
}
long long reach(const Opt* o) { return shape(*o).kv_reach; }
}
"""


class Opt(ctypes.Structure):
    _fields_ = [(n, ctypes.c_int) for n in
                ("causal", "window", "offset", "seq_q", "seq_k", "kv_len", "left", "right")]


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    lib = build(tmp_path_factory.mktemp("visibility_host"), SHIM, "the visibility headers' host build")
    ll, i32 = ctypes.c_longlong, ctypes.c_int
    lib.vis.argtypes = [ctypes.POINTER(Opt), ll, ll]
    lib.key_range.argtypes = [ctypes.POINTER(Opt), ll, ll, ctypes.POINTER(ll)]
    lib.row_range.argtypes = [ctypes.POINTER(Opt), ll, ll, ctypes.POINTER(ll)]
    lib.cols.argtypes = [ctypes.POINTER(Opt), ll, ll, i32, ctypes.POINTER(i32)]
    lib.rows.argtypes = [ctypes.POINTER(Opt), ll, ll, i32, ctypes.POINTER(i32)]
    lib.whole.argtypes = [ctypes.POINTER(Opt), ll, ll, ll, ll]
    lib.reach.argtypes = [ctypes.POINTER(Opt)]
    lib.reach.restype = ll
    return lib


class Call:
    """One call's options and SPEC's rule for them."""

    def __init__(self, causal, window, offset, seq_q, seq_k, kv_len, left, right):
        self.opt = Opt(causal, window, offset, seq_q, seq_k, kv_len, left, right)
        self.seq_q, self.causal = seq_q, causal
        self.kv_len = seq_k if kv_len < 0 else kv_len
        self.shift = offset + (0 if kv_len < 0 else kv_len - seq_k)
        if left >= -1:
            self.left, self.right = left, right
        else:
            self.left = self.right = window - 1 if window else -1

    def sees_at(self, a: int, j: int) -> bool:
        """Position a sees key j (whether j exists aside)."""
        if self.causal and j > a:
            return False
        if self.left >= 0 and j < a - self.left:
            return False
        return not (self.right >= 0 and j > a + self.right)

    def sees(self, i: int, j: int) -> bool:
        return 0 <= i < self.seq_q and 0 <= j < self.kv_len and self.sees_at(i + self.shift, j)

    def __repr__(self):
        o = self.opt
        return (f"causal={o.causal} window={o.window} offset={o.offset} seq_q={o.seq_q} "
                f"seq_k={o.seq_k} kv_len={o.kv_len} left={o.left} right={o.right}")


def _interval(xs) -> tuple[int, int] | None:
    xs = sorted(xs)
    if not xs:
        return None
    assert xs == list(range(xs[0], xs[-1] + 1)), f"not one interval: {xs}"
    return xs[0], xs[-1]


@st.composite
def calls(draw, extended: bool):
    """Calls of the options the kernels take today, or (`extended`) SPEC's whole rule."""
    seq_q, seq_k = draw(st.integers(0, 12)), draw(st.integers(0, 14))
    causal = draw(st.booleans())
    kv_len = draw(st.one_of(st.just(-1), st.integers(0, seq_k)))
    if extended:
        # (and int32's extremes: an unbounded side must reach every key from any row)
        offset = draw(st.one_of(st.integers(-16, 16),
                                st.sampled_from([-2**31, -2**31 + 9, 2**31 - 1, 2**31 - 12])))
        left, right = draw(st.integers(-1, 6)), draw(st.integers(-1, 6))
        return Call(causal, 0, offset, seq_q, seq_k, kv_len, left, right)
    offset = draw(st.integers(0, 16))
    window = draw(st.one_of(st.just(0), st.integers(1, 7)))
    return Call(causal, window, offset, seq_q, seq_k, kv_len, -2, -2)


def _check(lib, c: Call) -> None:
    o = ctypes.byref(c.opt)
    ll2, i2 = (ctypes.c_longlong * 2)(), (ctypes.c_int * 2)()
    for a in range(-20, 30):
        for j in range(0, 16):
            assert bool(lib.vis(o, a, j)) == c.sees_at(a, j), (c, "visible", a, j)
    # the keys a range of positions may see: exactly their union (within the keys that exist)
    for a_lo in range(-18, 28, 3):
        for a_hi in range(a_lo, a_lo + 7):
            lib.key_range(o, a_lo, a_hi, ll2)
            got = range(ll2[0], max(ll2[0], ll2[1]))
            want = _interval(j for j in range(c.kv_len)
                             if any(c.sees_at(a, j) for a in range(a_lo, a_hi + 1)))
            assert (got.start, got.stop - 1) == want if want else len(got) == 0, \
                (c, "visible_key_range", a_lo, a_hi, tuple(ll2))
    # the rows that may see a range of keys: their union, a superset being allowed past kv_len
    for j_lo in range(0, 16, 2):
        for j_hi in range(j_lo, j_lo + 5):
            lib.row_range(o, j_lo, j_hi, ll2)
            got = set(range(ll2[0], ll2[1]))
            want = {i for i in range(c.seq_q)
                    if any(c.sees_at(i + c.shift, j) for j in range(j_lo, j_hi + 1))}
            assert want <= got, (c, "visible_row_range", j_lo, j_hi, tuple(ll2))
            assert got <= set(range(c.seq_q)), (c, "visible_row_range", j_lo, j_hi, tuple(ll2))
    # one row's keys among a tile, and one key's rows among a tile: exact intervals
    for start in range(-4, 16, 3):
        for n in (1, 4, 8):
            for i in range(-2, c.seq_q + 2):
                lib.cols(o, i, start, n, i2)
                want = _interval(t for t in range(n) if c.sees(i, start + t))
                assert (i2[0], i2[1]) == want if want else i2[0] > i2[1], \
                    (c, "visible_cols", i, start, n, tuple(i2))
            if start >= 0:
                for j in range(0, 16):
                    lib.rows(o, j, start, n, i2)
                    want = _interval(t for t in range(n) if c.sees(start + t, j))
                    assert (i2[0], i2[1]) == want if want else i2[0] > i2[1], \
                        (c, "row_span", j, start, n, tuple(i2))
    # whole tiles: exactly those whose every (row, key) is visible and exists
    for i_lo in range(0, c.seq_q, 2):
        for i_hi in range(i_lo, min(c.seq_q + 1, i_lo + 4)):
            for j_lo in range(0, 16, 3):
                for j_hi in range(j_lo, j_lo + 4):
                    want = all(c.sees(i, j) for i in range(i_lo, i_hi + 1)
                               for j in range(j_lo, j_hi + 1))
                    assert bool(lib.whole(o, i_lo, i_hi, j_lo, j_hi)) == want, \
                        (c, "wholly_visible", i_lo, i_hi, j_lo, j_hi)
    # the keys loaded: every visible one (none past kv_len)
    r = lib.reach(o)
    assert 0 <= r <= c.kv_len, (c, "key_reach", r)
    seen = [j for j in range(c.kv_len) if any(c.sees(i, j) for i in range(c.seq_q))]
    assert not seen or max(seen) < r, (c, "key_reach", r, max(seen))


@settings(max_examples=120, deadline=None)
@given(calls(extended=False))
def test_the_kernels_rule_for_todays_options(lib, c):
    _check(lib, c)


@settings(max_examples=120, deadline=None)
@given(calls(extended=True))
def test_the_kernels_rule_for_negative_offsets_and_asymmetric_windows(lib, c):
    _check(lib, c)


@pytest.mark.parametrize("offset", [-2**31, -2**31 + 9, 2**31 - 1, 2**31 - 12])
@pytest.mark.parametrize("left, right", [(-1, -1), (-1, 0), (0, -1), (-1, 4)])
@pytest.mark.parametrize("causal", [0, 1])
def test_an_unbounded_side_reaches_every_key_from_int32_extreme_offsets(lib, offset, left, right,
                                                                       causal):
    """No constant standing for an unbounded side may hide a key: rows at int32's extremes lie
    more than 2^31 positions from the keys."""
    for kv_len in (-1, 2):
        _check(lib, Call(causal, 0, offset, 3, 5, kv_len, left, right))
