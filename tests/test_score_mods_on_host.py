"""The kernels' model options on the CPU: ferro_score.cuh's score modifier (softcap, ALiBi, the
mask, as one score and as a whole accumulator tile with its fast path), its softcap derivative,
and ferro_epilogue.cuh's row end with an attention sink, compiled with g++ (CUDA's qualifiers
and warp intrinsics stubbed), against SPEC "Beyond the seed, part 2" written out here in float64.
Every attention kernel (mma.sync, wgmma, decode) computes these options through these functions
alone, so CI checks their arithmetic without a GPU.

SPEC: for a visible key, s = softcap * tanh(x / softcap) (x the scaled product; softcap 0: none),
then - slope[b, h] * |a - j| (a = i + offset), then + mask; the backward multiplies dS by
1 - tanh^2. A sink joins the denominator: P = exp(s - lse), lse = log(exp(sink) + sum exp(s)); a
row that sees no key has out 0 and lse = sink (-inf without a sink)."""

from __future__ import annotations

import ctypes
import math

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis", reason="hypothesis is not installed")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from cuda_on_host import build  # noqa: E402

SHIM = r"""
#include "ferro_score.cuh"
#include "ferro_epilogue.cuh"

// One call's model options, as the test passes them.
struct Call {
    int seq_q, seq_k, causal, window, offset, per_batch, heads, has_mask, mask_bf16;
    float scale, softcap;
    const float* alibi;  // null: none
    const void* mask;    // [seq_q][seq_k], float32 or (mask_bf16) bfloat16, every (b, h); null: none
};

static AttnShape shape(const Call& c) {
    FlashV2Params p;
    std::memset(&p, 0, sizeof p);
    p.batch = 2;
    p.heads = p.kv_heads = c.heads;
    p.head_dim = 8;
    p.seq_q = c.seq_q;
    p.seq_k = c.seq_k;
    p.causal = c.causal;
    p.window = c.window;
    p.causal_offset = (u32)c.offset;
    p.scale = c.scale;
    p.has_mask = c.has_mask;
    p.mask_stride_q = c.seq_k;
    p.mask_stride_k = 1;
    AttnExtras ex;
    std::memset(&ex, 0, sizeof ex);
    ex.window_left = ex.window_right = c.window ? c.window - 1 : -1;  // params.py's seed_extras
    ex.softcap = c.softcap;
    ex.flags = (c.alibi ? EXTRAS_ALIBI : 0u) | (c.per_batch ? EXTRAS_ALIBI_PER_BATCH : 0u);
    AttnShape s = attn_shape(p, ex, c.mask_bf16 ? MASK_BF16 : MASK_F32);
    with_extras(s, ex, c.alibi, nullptr);
    return s;
}

typedef Options<true, true, true> All;

extern "C" {
float score(const Call* c, unsigned b, unsigned h, long long i, long long j, float x) {
    const AttnShape s = shape(*c);
    return modified_score<true, true>(s, c->mask, b, h, i, j, true, alibi_slope(s, b, h), x);
}
float cap_grad(const Call* c, unsigned b, unsigned h, long long i, long long j, float sc) {
    const AttnShape s = shape(*c);
    return softcap_grad<true, true>(s, c->mask, b, h, i, j, alibi_slope(s, b, h), sc);
}
// The float-only path (no mask): capped_alibi's score and 1 - t^2, and capped_grad from a score.
float score_fast(const Call* c, unsigned b, unsigned h, long long i, long long j, float x,
                 float* dcap) {
    const AttnShape s = shape(*c);
    const long long d = i + s.offset - j;
    float t;
    const float y = capped_alibi(s, alibi_slope(s, b, h), x, (float)(d < 0 ? -d : d), t);
    *dcap = 1.f - t * t;
    return y;
}
float cap_grad_fast(const Call* c, unsigned b, unsigned h, long long i, long long j, float sc) {
    const AttnShape s = shape(*c);
    const long long d = i + s.offset - j;
    return capped_grad(s, fmaf(alibi_slope(s, b, h), (float)(d < 0 ? -d : d), sc));
}
// An accumulator tile of 16 rows from i0 x 16 keys from j0, every lane's part gathered into
// out[16][16]: `raw` products in, scores out (score_tile, scaled units).
void tile(const Call* c, unsigned b, unsigned h, long long i0, long long j0, int whole,
          const float* raw, float* out) {
    const AttnShape s = shape(*c);
    for (int lane = 0; lane < 32; ++lane) {
        const Lane L{lane >> 2, lane & 3};
        float sc[2][4];
        for (int nt = 0; nt < 2; ++nt)
            for (int r = 0; r < 4; ++r)
                sc[nt][r] = raw[(L.g + 8 * (r >> 1)) * 16 + nt * 8 + 2 * L.t + (r & 1)];
        score_tile<All, 2>(s, c->mask, b, h, alibi_slope(s, b, h), i0 + L.g, i0 + L.g + 8, j0,
                           whole != 0, L, sc);
        for (int nt = 0; nt < 2; ++nt)
            for (int r = 0; r < 4; ++r)
                out[(L.g + 8 * (r >> 1)) * 16 + nt * 8 + 2 * L.t + (r & 1)] = sc[nt][r];
    }
}
void row_end_sink(float m, float l, float keep_scale, float sink, int sinks, float* res) {
    if (sinks) row_end<true>(m, l, keep_scale, sink, res[0], res[1]);
    else row_end<false>(m, l, keep_scale, sink, res[0], res[1]);
}
}
"""


class Call(ctypes.Structure):
    _fields_ = ([(n, ctypes.c_int) for n in ("seq_q", "seq_k", "causal", "window", "offset",
                                            "per_batch", "heads", "has_mask", "mask_bf16")]
                + [("scale", ctypes.c_float), ("softcap", ctypes.c_float),
                   ("alibi", ctypes.POINTER(ctypes.c_float)),
                   ("mask", ctypes.c_void_p)])


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    lib = build(tmp_path_factory.mktemp("score_mods_host"), SHIM,
                "the score modifier's host build")
    P, u, ll, f, i = ctypes.POINTER(Call), ctypes.c_uint, ctypes.c_longlong, ctypes.c_float, \
        ctypes.c_int
    fp = ctypes.POINTER(ctypes.c_float)
    for name in ("score", "cap_grad"):
        getattr(lib, name).argtypes = [P, u, u, ll, ll, f]
        getattr(lib, name).restype = f
    lib.tile.argtypes = [P, u, u, ll, ll, i, fp, fp]
    lib.score_fast.argtypes = [P, u, u, ll, ll, f, fp]
    lib.score_fast.restype = f
    lib.cap_grad_fast.argtypes = [P, u, u, ll, ll, f]
    lib.cap_grad_fast.restype = f
    lib.row_end_sink.argtypes = [f, f, f, f, i, fp]
    return lib


def _ptr(a):
    return None if a is None else a.ctypes.data_as(ctypes.POINTER(ctypes.c_float))


class Case:
    """One call's options, its C struct (keeping its arrays alive) and SPEC's formulas."""

    def __init__(self, rng, *, seq_q=40, seq_k=50, causal=0, window=0, offset=0, softcap=0.0,
                 alibi=None, mask=False, heads=3, mask_bf16=False):
        self.alibi = None if alibi is None else rng.uniform(0, 0.7, (2, heads) if alibi == "bh"
                                                            else heads).astype(np.float32)
        self.mask = rng.standard_normal((seq_q, seq_k)).astype(np.float32) if mask else None
        self.mask_data = self.mask  # what the kernel reads: float32, or bfloat16's bits
        if mask and mask_bf16:  # (rounded toward zero: the values are bfloat16's either way)
            self.mask_data = (self.mask.view(np.uint32) >> 16).astype(np.uint16)
            self.mask = (self.mask_data.astype(np.uint32) << 16).view(np.float32)
        self.softcap, self.offset, self.window, self.causal = softcap, offset, window, causal
        self.c = Call(seq_q, seq_k, causal, window, offset, int(alibi == "bh"), heads,
                      int(mask), int(mask_bf16), np.float32(0.125), np.float32(softcap),
                      _ptr(self.alibi),
                      None if self.mask_data is None else self.mask_data.ctypes.data)

    def slope(self, b, h):
        if self.alibi is None:
            return 0.0
        return float(self.alibi[b, h] if self.alibi.ndim == 2 else self.alibi[h])

    def score(self, b, h, i, j, x):
        """SPEC's score of scaled product x (b, h = 0 for the mask, which is [Sq, Sk])."""
        s, t = float(x), None
        if self.softcap:
            t = math.tanh(s / float(np.float32(self.softcap)))
            s = float(np.float32(self.softcap)) * t
        s -= self.slope(b, h) * abs(i + self.offset - j)
        if self.mask is not None:
            s += float(self.mask[i, j])
        return s, (1.0 if t is None else 1.0 - t * t)

    def visible(self, i, j):
        a = i + self.offset
        return (0 <= i < self.c.seq_q and j < self.c.seq_k and (not self.causal or j <= a)
                and (not self.window or abs(a - j) < self.window))


@st.composite
def cases(draw):
    return dict(softcap=draw(st.sampled_from([0.0, 0.5, 3.0, 30.0])),
                alibi=draw(st.sampled_from([None, "h", "bh"])), mask=draw(st.booleans()),
                causal=int(draw(st.booleans())), window=draw(st.sampled_from([0, 1, 5, 30])),
                offset=draw(st.integers(0, 20)))


@settings(max_examples=150, deadline=None)
@given(opts=cases(), seed=st.integers(0, 2**32 - 1))
def test_score_and_its_softcap_derivative(lib, opts, seed):
    rng = np.random.default_rng(seed)
    case = Case(rng, **opts)
    for _ in range(40):
        b, h = int(rng.integers(2)), 0
        i, j = int(rng.integers(case.c.seq_q)), int(rng.integers(case.c.seq_k))
        x = np.float32(rng.normal(0, 4))
        want, dcap = case.score(b, h, i, j, x)
        got = lib.score(ctypes.byref(case.c), b, h, i, j, x)
        assert abs(got - want) <= 2e-6 * max(1.0, abs(want)), (opts, b, i, j, x, got, want)
        g = lib.cap_grad(ctypes.byref(case.c), b, h, i, j, got)
        # (recovered from the rounded score: float32 rounding of |score| over the softcap)
        tol = 1e-6 + 4e-7 * (abs(want) + abs(case.slope(b, h)) * 100) / max(opts["softcap"], 0.5)
        assert abs(g - dcap) <= tol, (opts, x, g, dcap)
        if opts["mask"]:
            continue  # (the float-only path serves calls without a mask)
        fast_dcap = np.zeros(1, np.float32)
        fast = lib.score_fast(ctypes.byref(case.c), b, h, i, j, x, _ptr(fast_dcap))
        assert abs(fast - want) <= 2e-6 * max(1.0, abs(want)), (opts, b, i, j, x, fast, want)
        assert abs(fast_dcap[0] - dcap) <= 1e-6, (opts, x, fast_dcap[0], dcap)
        if opts["softcap"]:
            g = lib.cap_grad_fast(ctypes.byref(case.c), b, h, i, j, got)
            assert abs(g - dcap) <= tol, (opts, x, g, dcap)


@settings(max_examples=150, deadline=None)
@given(opts=cases(), seed=st.integers(0, 2**32 - 1), whole=st.booleans(),
       seq_k=st.sampled_from([64, 63]), mask_bf16=st.booleans())
def test_score_tile(lib, opts, seed, whole, seq_k, mask_bf16):
    """A 16 x 16 accumulator tile: every element is SPEC's score where visible and -inf where
    not; a tile called `whole` (every key visible) still gets softcap, ALiBi and the mask (the
    mask alone: add_mask_row's rows, float32 or bfloat16, their pairs aligned (seq_k 64) or
    not in odd rows (63))."""
    check_score_tile(lib, opts, seed, whole, seq_k, mask_bf16)


@settings(max_examples=60, deadline=None)
@given(offset=st.integers(0, 20), seed=st.integers(0, 2**32 - 1), seq_k=st.sampled_from([64, 63]),
       mask_bf16=st.booleans())
def test_score_tile_mask_alone(lib, offset, seed, seq_k, mask_bf16):
    """The wholly visible tile with the mask alone (add_mask_row: a lane's two keys in one load
    where aligned, else two; bfloat16 or float32), which the draws above reach about once in
    100: a planted swap of a bfloat16 pair's halves fails here and passed test_score_tile."""
    opts = dict(softcap=0.0, alibi=None, mask=True, causal=0, window=0, offset=offset)
    check_score_tile(lib, opts, seed, True, seq_k, mask_bf16)


def check_score_tile(lib, opts, seed, whole, seq_k, mask_bf16):
    rng = np.random.default_rng(seed)
    case = Case(rng, seq_q=48, seq_k=seq_k, mask_bf16=mask_bf16, **opts)
    i0, j0 = int(rng.integers(0, 40)), 8 * int(rng.integers(0, 7))
    if whole:  # options under which every key of the tile is visible
        case.causal, case.window = 0, 0
        case.c.causal = case.c.window = 0
        i0 = min(i0, 48 - 16)
        j0 = min(j0, (seq_k - 16) // 8 * 8)
    raw = rng.standard_normal((16, 16)).astype(np.float32) * 8
    out = np.empty((16, 16), np.float32)
    lib.tile(ctypes.byref(case.c), 1, 2, i0, j0, int(whole), _ptr(raw), _ptr(out))
    scale = float(np.float32(0.125))
    for r in range(16):
        for c in range(16):
            i, j = i0 + r, j0 + c
            if not case.visible(i, j):
                assert out[r, c] == -np.inf, (opts, whole, i, j, out[r, c])
                continue
            want, _ = case.score(1, 2, i, j, np.float32(raw[r, c] * np.float32(scale)))
            assert abs(out[r, c] - want) <= 2e-6 * max(1.0, abs(want)), (opts, whole, i, j)


def _row_end64(m, l, keep, sink):
    """(O's factor, lse) of a row of running max m and sum l relative to it, with a sink."""
    total = (l * math.exp(m) if m != -math.inf else 0.0) + (math.exp(sink) if sink > -math.inf
                                                            else 0.0)
    if total == 0.0:
        return 0.0, -math.inf
    return (keep * math.exp(m) / total if m != -math.inf else 0.0), math.log(total)


@settings(max_examples=300, deadline=None)
@given(m=st.one_of(st.just(-math.inf), st.floats(-80, 80)), l=st.floats(1.0, 500.0),
       sink=st.one_of(st.just(-math.inf), st.floats(-80, 80)), keep=st.sampled_from([1.0, 1.25]))
def test_row_end_with_a_sink(lib, m, l, sink, keep):
    """O's factor keep / (l + exp(sink - m)) and lse = log(exp(sink) + l exp(m)), without
    overflow for a sink far above the row's max; a row that saw no key (m = -inf, l = 0): 0
    and lse = sink. Without SINKS, the sink is ignored."""
    l = 0.0 if m == -math.inf else l
    res = (ctypes.c_float * 2)()
    m32, l32, s32 = (float(np.float32(x)) for x in (m, l, sink))
    lib.row_end_sink(m32, l32, keep, s32, 1, res)
    inv, lse = _row_end64(m32, l32, keep, s32)
    # (exp of the float32 difference m - max(m, sink): its rounding, relative, grows with it)
    gap = abs(m32 - s32) if math.isfinite(m32 - s32) else 0.0
    assert abs(res[0] - inv) <= (1e-6 + 1.2e-7 * gap) * abs(inv) + 1e-38, (m, l, sink, res[0], inv)
    assert (res[1] == lse) if math.isinf(lse) else abs(res[1] - lse) <= 2e-6 * max(1, abs(lse))
    lib.row_end_sink(m32, l32, keep, s32, 0, res)
    inv, lse = _row_end64(m32, l32, keep, -math.inf)
    assert abs(res[0] - inv) <= 1e-6 * abs(inv) + 1e-38
    assert (res[1] == lse) if math.isinf(lse) else abs(res[1] - lse) <= 2e-6 * max(1, abs(lse))
