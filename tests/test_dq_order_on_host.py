"""The fused backward's add order (ferro_dq_order.cuh) on the CPU: ferro_visibility.cuh's
`first_key_block` built with g++ (tests/cuda_on_host.py), against the dK/dV kernel's own rule for
which query tiles a key block visits, over random shapes, offsets and windows (hypothesis).

The order is deadlock-free and complete only if, for every query tile that exists, the key
blocks that visit it are consecutive (so the counter passes through each of their ranks) and
every visitor computes the same first block (so their ranks are 0, 1, ... with no gap or repeat).
A wrong first block either hangs the GPU (a rank never reached) or adds out of order."""

from __future__ import annotations

import ctypes

import pytest

hypothesis = pytest.importorskip("hypothesis", reason="hypothesis is not installed")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from cuda_on_host import build  # noqa: E402
from test_visibility_on_host import SHIM as VISIBILITY_SHIM  # noqa: E402
from test_visibility_on_host import Opt  # noqa: E402

BK, BQ = 128, 64  # the fused kernel's geometry (configs.py: 8 warps of 16 keys, 64-row steps)

# test_visibility_on_host.py's shim (its Opt and shape(): one call's options as an AttnShape),
# then the dK/dV kernel's rule for the tiles a key block visits, and first_key_block.
SHIM = VISIBILITY_SHIM + r"""
extern "C" {
// The query tiles [first, first + count) key block n visits: flash_bwd_dkdv_wgmma.cu's rule.
void visits(const Opt* o, unsigned n, long long* r) {
    const AttnShape s = shape(*o);
    const long long k0 = (long long)n * BK;
    const long long k_last = min((long long)s.seq_k, k0 + BK) - 1;
    long long q_lo, q_hi;
    visible_row_range(s, k0, k_last, q_lo, q_hi);
    const long long i_first = q_lo / BQ * BQ;
    r[0] = i_first / BQ;
    r[1] = q_hi > i_first ? (q_hi - i_first + BQ - 1) / BQ : 0;
}
unsigned first(const Opt* o, long long m0, unsigned n) {
    return first_key_block<BK>(shape(*o), m0, n);
}
}
"""


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    shim = f"constexpr int BK = {BK}, BQ = {BQ};\n" + SHIM
    lib = build(tmp_path_factory.mktemp("dq_order_host"), shim, "the fused backward's add order")
    lib.visits.argtypes = [ctypes.POINTER(Opt), ctypes.c_uint, ctypes.POINTER(ctypes.c_longlong)]
    lib.first.argtypes = [ctypes.POINTER(Opt), ctypes.c_longlong, ctypes.c_uint]
    lib.first.restype = ctypes.c_uint
    return lib


def options(causal, offset, seq_q, seq_k, left, right) -> Opt:
    """A call of SPEC's window_left / window_right (no seed window, no kv_lens)."""
    return Opt(causal, 0, offset, seq_q, seq_k, -1, left, right)


def check_order(lib, opt: Opt) -> None:
    """Every existing query tile: its visitors consecutive, each computing the least of them."""
    q_tiles = -(-opt.seq_q // BQ)
    visitors: dict = {}
    r = (ctypes.c_longlong * 2)()
    for n in range(-(-opt.seq_k // BK)):
        lib.visits(ctypes.byref(opt), n, r)
        for m in range(r[0], r[0] + r[1]):
            if m < q_tiles:  # (a tile past seq_q: the kernel adds nothing there)
                visitors.setdefault(m, []).append(n)
    what = {f: getattr(opt, f) for f, _ in Opt._fields_}
    for m, ns in visitors.items():
        assert ns == list(range(ns[0], ns[0] + len(ns))), (what, m, ns)
        for n in ns:
            assert lib.first(ctypes.byref(opt), m * BQ, n) == ns[0], (what, m, n, ns)


SIDES = st.one_of(st.just(-1), st.integers(0, 600))


@settings(max_examples=400, deadline=None)
@given(causal=st.booleans(), offset=st.integers(-2500, 2500), seq_q=st.integers(1, 1500),
       seq_k=st.integers(1, 2000), left=SIDES, right=SIDES)
def test_visitors_are_consecutive_and_agree_on_the_first(lib, causal, offset, seq_q, seq_k, left,
                                                          right):
    check_order(lib, options(int(causal), offset, seq_q, seq_k, left, right))


@pytest.mark.parametrize("case", [
    (0, 0, 333, 461, -1, -1), (1, 0, 333, 461, -1, -1), (1, 30, 333, 461, -1, -1),
    (1, -40, 333, 461, -1, -1), (0, 0, 333, 461, 99, 99), (1, 5, 333, 461, 69, 0),
    (1, 0, 4096, 4096, -1, -1), (0, 0, 1000, 1000, 299, 0), (1, 2**31 - 1, 100, 300, -1, -1),
    (0, -(2**31), 100, 300, -1, -1)])
def test_the_gpu_suites_shapes(lib, case):
    check_order(lib, options(*case))
