"""The forwards' whole per-row pipeline on the CPU against the float64 reference: the block's
tile (query_tile_at, for_sequence, for_batch, key_tiles), the scores (score_tile / raw_scores,
or the plain wgmma kernel's spans and hide_outside), the online softmax, dropout, and the
epilogue (finish_forward: normaliser, sink, lse, store), each the kernel headers' own code
compiled with g++, in the order flash_fwd.cu and flash_fwd_wgmma.cu call them. Only the matrix
products are computed here (float32 dot products in place of mma / wgmma, keys past kv_reach
zero-filled as the loads leave them), and a quad of lanes runs as four threads whose shuffles
meet at a barrier, so the row reductions are the kernels'. Checked over causal, signed offsets,
window sides, kv_lens, varlen, mask, dropout, softcap, ALiBi and sinks."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from cuda_on_host import LANES, build
from ferrocupy import AttentionOptions
from ferrocupy import reference as ref
from ferrocupy.params import AttentionDims, extras_params, layout_params

SHIM = LANES + r"""
#include <thread>
#include <vector>

// A quad of lanes as four threads (cuda_on_host.LANES). (Lanes of different quads never exchange
// values in the code under test; the warp's __any_sync only skips multiplies by exactly 1.)
typedef Lanes<4> Quad;
static thread_local Quad* tl_quad;
static thread_local int tl_t;
static thread_local Dim tl_threadIdx;
template <class T> inline T quad_shfl(unsigned, T x, int m) {
    return tl_quad->exchange(x, tl_t, tl_t ^ m);
}
inline bool quad_any(unsigned, bool x) {
    float a = x ? 1.f : 0.f;
    a = fmaxf(a, quad_shfl(0, a, 1));
    a = fmaxf(a, quad_shfl(0, a, 2));
    return a != 0.f;
}
#define __shfl_xor_sync quad_shfl
#define __any_sync quad_any
#define threadIdx tl_threadIdx
#define FERRO_VARLEN 1
#include "ferro_score.cuh"
#include "ferro_tiles.cuh"
#include "ferro_epilogue.cuh"

struct Call {
    const FlashV2Params* p;
    const AttnExtras* ex;
    const AttnLayout* lay;
    const float *q, *k, *v;
    float *out, *lse;
    const float* mask;
    const int* kv_lens;
    const float *alibi, *sinks;
    const int *cu_q, *cu_k;
    int mode;  // 0: mma.sync float32 (scaled scores), 1: mma.sync half (raw), 2: wgmma general,
               // 3: wgmma plain
};

typedef Options<true, true, true> All;

template <int WARPS, int MT, int BN, int DP>
static void lane(const Call& c, unsigned x, int warp, int g, int t, Quad* quad, float* pshare) {
    tl_quad = quad;
    tl_t = t;
    tl_threadIdx.x = warp * 32 + g * 4 + t;
    constexpr int BM = 16 * MT * WARPS, NT = BN / 8, DT = DP / 8;
    const bool wg = c.mode >= 2, raw_kernel = c.mode >= 1, plain = c.mode == 3;
    const Lane L{g, t};
    AttnShape s = attn_shape(*c.p, *c.ex, MASK_F32);
    with_extras(s, *c.ex, c.alibi, c.sinks);
    with_varlen(s, *c.ex, c.cu_q, c.cu_k);
    QueryTile T = query_tile_at<BM, MT>(x, s, *c.lay, L, wg && s.causal);
    if (!wg && T.empty()) return;
    for_batch(s, c.kv_lens, T.b);
    const int D = s.head_dim;
    long long j_first;
    const int n_tiles = key_tiles<BN>(s, T, j_first);
    int t_lo = 0, t_hi = n_tiles;
    long long wm0 = 0, wm_last = 0;
    KeySpan span[2];
    if (wg) {  // flash_fwd_wgmma.cu: the warpgroup's rows and key tiles
        const int w = warp / 4;
        wm0 = std::max(T.m0 + w * 64, 0ll);
        wm_last = std::min(T.m_last, T.m0 + w * 64 + 63);
        rows_key_tiles<BN>(s, wm0, wm_last, j_first, n_tiles, t_lo, t_hi);
        for (int rr = 0; rr < 2; ++rr) span[rr] = key_span(s, T.row(0, rr), j_first, n_tiles * BN);
    }
    const Dropout<true> drop(s);
    const float slope = alibi_slope(s, T.b, T.h);
    const bool raw = raw_kernel && raw_units<All>(s);
    const float sl2 = raw ? s.scale * FERRO_LOG2E : FERRO_LOG2E;
    float o[MT][DT][4] = {};
    float m_run[MT][2], l_run[MT][2];
    for (int mt = 0; mt < MT; ++mt)
        for (int rr = 0; rr < 2; ++rr) m_run[mt][rr] = neg_inf(), l_run[mt][rr] = 0.f;
    for (int it = t_lo; it < t_hi; ++it) {
        const long long j0 = j_first + (long long)it * BN;
        float sc[MT][NT][4];
        for (int mt = 0; mt < MT; ++mt)
            for (int nt = 0; nt < NT; ++nt)
                for (int r = 0; r < 4; ++r) {
                    const long long i = T.row(mt, r >> 1), j = j0 + nt * 8 + 2 * t + (r & 1);
                    float acc = 0.f;
                    if (i >= 0 && i < s.seq_q && j < s.kv_reach)
                        for (int d = 0; d < D; ++d)
                            acc += c.q[T.q.off + i * T.q.stride + d] * c.k[T.k.off + j * T.k.stride + d];
                    sc[mt][nt][r] = acc;
                }
        for (int mt = 0; mt < MT; ++mt) {
            const long long i0 = T.row(mt, 0), i1 = T.row(mt, 1);
            if (plain) {
                const KeySpan tile[2] = {span[0].from((it) * BN), span[1].from((it) * BN)};
                if (!(tile[0].covers(BN) && tile[1].covers(BN))) hide_outside<NT>(tile, L, sc[mt]);
            } else if (wg) {
                const bool whole = keys_visible_to_rows(s, wm0, wm_last, j0, j0 + BN - 1);
                raw_scores<All, NT>(s, c.mask, T.b, T.h, slope, i0, i1, j0, whole, L, sc[mt]);
            } else {
                const bool whole = keys_wholly_visible<BN>(s, T, j0);
                if (raw_kernel) raw_scores<All, NT>(s, c.mask, T.b, T.h, slope, i0, i1, j0, whole, L, sc[mt]);
                else score_tile<All, NT>(s, c.mask, T.b, T.h, slope, i0, i1, j0, whole, L, sc[mt]);
            }
            float alpha[2];
            for (int rr = 0; rr < 2; ++rr)
                alpha[rr] = online_softmax_raw<NT, All::MASK>(sc[mt], rr, m_run[mt][rr], l_run[mt][rr], sl2, s.has_mask);
            rescale_rows<DT>(o[mt], alpha);
            const u32 bh[2] = {T.bh, T.bh}, rows[2] = {(u32)i0, (u32)i1};
            drop.template drop<NT, true>(sc[mt], bh, rows, (u32)j0, L);
        }
        // O += P V: the quad's P rows gathered (what the mma's A fragments carry)
        for (int mt = 0; mt < MT; ++mt)
            for (int nt = 0; nt < NT; ++nt)
                for (int r = 0; r < 4; ++r)
                    pshare[(mt * 2 + (r >> 1)) * BN + nt * 8 + 2 * t + (r & 1)] = sc[mt][nt][r];
        quad->meet();
        for (int mt = 0; mt < MT; ++mt)
            for (int nd = 0; nd < DT; ++nd)
                for (int r = 0; r < 4; ++r) {
                    const int d = nd * 8 + 2 * t + (r & 1);
                    float acc = o[mt][nd][r];
                    for (int jj = 0; jj < BN; ++jj) {
                        const long long j = j0 + jj;
                        const float vv = (j < s.kv_reach && d < D) ? c.v[T.v.off + j * T.v.stride + d] : 0.f;
                        acc += pshare[(mt * 2 + (r >> 1)) * BN + jj] * vv;
                    }
                    o[mt][nd][r] = acc;
                }
        quad->meet();
    }
    const float sink = sink_logit(s, T.h);
    for (int mt = 0; mt < MT; ++mt)
        finish_forward<float, DT, true>(o[mt], m_run[mt], l_run[mt], raw ? s.scale : 1.f,
                                        drop.keep_scale(), sink, T.row(mt, 0), s.seq_q,
                                        row_index(s, T.b, T.h), c.out, T.o, c.lse, L, D, false);
}

template <int WARPS, int MT, int BN, int DP>
static void run(const Call& c, unsigned blocks) {
    for (unsigned x = 0; x < blocks; ++x)
        for (int warp = 0; warp < WARPS; ++warp)
            for (int g = 0; g < 8; ++g) {
                Quad quad;
                std::vector<float> pshare(MT * 2 * BN);
                std::vector<std::thread> th;
                for (int t = 0; t < 4; ++t)
                    th.emplace_back(lane<WARPS, MT, BN, DP>, std::cref(c), x, warp, g, t, &quad,
                                    pshare.data());
                for (auto& h : th) h.join();
            }
}

extern "C" void forward(const Call* c, unsigned blocks, int geometry) {
    switch (geometry) {
        case 0: run<1, 1, 16, 16>(*c, blocks); break;  // 16 rows, 16 keys a tile
        case 1: run<2, 2, 32, 16>(*c, blocks); break;  // 64 rows, 32 keys
        case 2: run<4, 1, 16, 16>(*c, blocks); break;  // one warpgroup (wgmma modes)
        case 3: run<8, 1, 32, 16>(*c, blocks); break;  // two warpgroups
    }
}
"""

GEOMETRIES = {0: (16, 16), 1: (64, 32), 2: (64, 16), 3: (128, 32)}  # (BM, BN)


class Call(ctypes.Structure):
    _fields_ = [(n, ctypes.c_void_p) for n in ("p", "ex", "lay", "q", "k", "v", "out", "lse",
                                               "mask", "kv_lens", "alibi", "sinks", "cu_q",
                                               "cu_k")] + [("mode", ctypes.c_int)]


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    lib = build(tmp_path_factory.mktemp("forward_seam_host"), SHIM,
                "the forward pipeline's host build")
    lib.forward.argtypes = [ctypes.POINTER(Call), ctypes.c_uint, ctypes.c_int]
    return lib


def _addr(a):
    return None if a is None else a.ctypes.data


def run_case(lib, rng, *, mode, geometry, B=2, H=2, Hkv=1, D=12, Sq=21, Sk=27, causal=False,
             offset=0, window_left=None, window_right=None, kv_lens=None, varlen=None,
             mask=False, dropout=0.0, softcap=0.0, alibi=None, sinks=False, scale=None,
             lowest_rows=0):
    """Runs one call through the emulated kernel and the reference; returns (out, lse, want_out,
    want_lse). `varlen`: the sequences' (Sq_n, Sk_n) (B, Sq, Sk then the counts and maxima).
    `lowest_rows`: the mask's first rows hold float32's lowest value on every key (no -inf)."""
    opts = AttentionOptions(causal=causal, causal_offset=offset, window_left=window_left,
                            window_right=window_right, dropout_prob=dropout,
                            seed=int(rng.integers(2**32)), softcap=softcap, scale=scale)
    if varlen is not None:
        sq_n = np.array([a for a, _ in varlen]), np.array([b for _, b in varlen])
        cu_q = np.concatenate([[0], np.cumsum(sq_n[0])]).astype(np.int32)
        cu_k = np.concatenate([[0], np.cumsum(sq_n[1])]).astype(np.int32)
        B, Sq, Sk = len(varlen), int(max(sq_n[0].max(), 1)), int(max(sq_n[1].max(), 1))
        q = rng.standard_normal((int(cu_q[-1]), H, D)).astype(np.float32)
        k = rng.standard_normal((int(cu_k[-1]), Hkv, D)).astype(np.float32)
        v = rng.standard_normal((int(cu_k[-1]), Hkv, D)).astype(np.float32)
        dims = AttentionDims.packed(q, k, B, Sq, Sk)
        lse = np.full((H, int(cu_q[-1])), np.nan, np.float32)
        m = None
    else:
        cu_q = cu_k = None
        q = rng.standard_normal((B, Sq, H, D)).astype(np.float32)
        k = rng.standard_normal((B, Sk, Hkv, D)).astype(np.float32)
        v = rng.standard_normal((B, Sk, Hkv, D)).astype(np.float32)
        dims = AttentionDims.new(q, k)
        lse = np.full((B, H, Sq), np.nan, np.float32)
        m = None
        if mask:
            m = rng.standard_normal((B if rng.integers(2) else 1, H if rng.integers(2) else 1,
                                     Sq, Sk)).astype(np.float32)
            if lowest_rows:
                m[:, :, :lowest_rows] = np.finfo(np.float32).min
            else:
                m[rng.random(m.shape) < 0.2] = -np.inf
    al = None if alibi is None else rng.uniform(0, 0.5, (B, H) if alibi == "bh" else (H,)
                                                ).astype(np.float32)
    sk_ = rng.normal(0, 2, H).astype(np.float32) if sinks else None
    out = np.full(q.shape, np.nan, np.float32)
    p = dims.params(opts, m)
    ex = extras_params(opts, al, sk_, varlen=varlen is not None)
    lay = layout_params({"q": q, "k": k, "v": v, "out": out})
    lay = np.array(lay)  # (strides in bytes there: the layout wants elements)
    for name, x in (("q", q), ("k", k), ("v", v), ("out", out)):
        shape = x.shape if x.ndim == 4 else (1,) + x.shape
        strides = ((0,) + x.strides) if x.ndim == 3 else x.strides
        for c, n, st in zip("bsh", shape[:3], strides[:3]):
            lay[f"{name}_{c}"] = st // 4 if n > 1 else 0
    kl = None if kv_lens is None else np.asarray(kv_lens, np.int32)
    p_arr, ex_arr = np.array(p), np.array(ex)
    c = Call(_addr(p_arr), _addr(ex_arr), _addr(lay), _addr(q), _addr(k), _addr(v), _addr(out),
             _addr(lse), _addr(m), _addr(kl), _addr(al), _addr(sk_), _addr(cu_q), _addr(cu_k),
             mode)
    bm = GEOMETRIES[geometry][0]
    lib.forward(ctypes.byref(c), -(-Sq // bm) * B * H, geometry)
    want = np.full(q.shape, np.nan)
    want_lse = np.full(lse.shape, np.nan)
    ref.flash_attn_v2(q, k, v, want, m, p, lse=want_lse, kv_lens=kl, alibi_slopes=al,
                      sinks=sk_, extras=ex, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    return out, lse, want, want_lse


def check(out, lse, want, want_lse, what):
    assert not np.isnan(out).any(), f"{what}: rows left unwritten or NaN"
    np.testing.assert_allclose(out, want, rtol=2e-4, atol=2e-5, err_msg=what)
    same_inf = np.isinf(want_lse) == np.isinf(lse)
    assert same_inf.all(), f"{what}: lse -inf at {np.argwhere(~same_inf)[:5]}"
    fin = np.isfinite(want_lse)
    np.testing.assert_allclose(lse[fin], want_lse[fin], rtol=2e-5, atol=2e-5, err_msg=what)


def _draw(rng, mode):
    """Random options for an emulated kernel mode (the plain wgmma kernel takes none of mask,
    dropout, softcap, ALiBi or sinks)."""
    wl = [None, -1, 0, 3, 9][rng.integers(5)]
    wr = [None, -1, 0, 2, 11][rng.integers(5)]
    kw = dict(causal=bool(rng.integers(2)), offset=int(rng.integers(-12, 15)),
              window_left=wl, window_right=wr, D=int(rng.choice([8, 12, 16])),
              Sq=int(rng.integers(1, 40)), Sk=int(rng.integers(1, 50)),
              Hkv=int(rng.choice([1, 2])))
    if mode != 3:
        kw.update(softcap=float(rng.choice([0.0, 0.7, 5.0])),
                  alibi=[None, "h", "bh"][rng.integers(3)], sinks=bool(rng.integers(2)),
                  dropout=float(rng.choice([0.0, 0.0, 0.3])), scale=[None, 0.7][rng.integers(2)])
    layout = rng.integers(3)
    if layout == 1:
        kw["kv_lens"] = [int(rng.integers(0, kw["Sk"] + 1)) for _ in range(2)]
    elif layout == 2:
        kw["varlen"] = [(int(rng.integers(0, kw["Sq"] + 1)), int(rng.integers(0, kw["Sk"] + 1)))
                        for _ in range(int(rng.integers(1, 4)))]
    if mode != 3 and layout == 0:
        kw["mask"] = bool(rng.integers(2))
    return kw


@pytest.mark.parametrize("mode,geometry", [(0, 0), (0, 1), (1, 0), (1, 1), (2, 2), (2, 3),
                                           (3, 2), (3, 3)])
def test_forward_pipeline_matches_reference(lib, mode, geometry):
    rng = np.random.default_rng(1000 + 10 * mode + geometry)
    for n in range(40):
        kw = _draw(rng, mode)
        out, lse, want, want_lse = run_case(lib, rng, mode=mode, geometry=geometry, **kw)
        check(out, lse, want, want_lse, f"case {n}: mode {mode} geometry {geometry} {kw}")


@pytest.mark.parametrize("mode,scale", [(0, None), (0, 1.0), (1, None), (1, 1.0), (1, 2.0),
                                        (2, 0.5), (2, 1.0)])
def test_rows_whose_every_score_is_float32s_lowest(lib, mode, scale):
    """A row whose visible scores are all finite but near -FLT_MAX (an additive mask of float32's
    lowest value on every key, as Hugging Face builds for padding) is a softmax of equal scores:
    the mean of its values, its lse about the mask value (SPEC: only a row of -inf scores is
    dead). The exponent fused as fma(s, sl2, -max * sl2) overflowed max * sl2 and gave NaN; raw
    units (the half forwards) overflowed such a score to -inf (a dead row) below -FLT_MAX *
    scale, so a masked call's scores are scaled (raw_units)."""
    rng = np.random.default_rng(3)
    out, lse, want, want_lse = run_case(lib, rng, mode=mode, geometry=0, mask=True, Sq=8, Sk=10,
                                        scale=scale, lowest_rows=3)
    check(out, lse, want, want_lse, f"mode {mode} scale {scale}")
