"""The KV-cache append on the CUDA backend (SPEC "Appending to a KV cache"): append_kv.cu writes
k_new (rotated: rotate-half or interleaved, full or partial rotary_dim) and v_new into the cache,
contiguous or paged (page sizes 1, 3, 16, 64), at cache_seqlens[b]..; q rotated into the plan's
workspace; then the attention (decode or prefill kernels) over cache_seqlens[b] + new keys,
bottom-right. Against tests/test_kvcache_append.py's independent oracle (flash-attn's rotation
formula, the dense float64 attention): float32 out and lse by the float32 tolerance; the cache
after the call: the appended slots to float32 rounding, every other slot (NaN where no key is)
unchanged bit for bit. Half precision: the appended slots within one unit in the last place of
the oracle's rotation of the rounded inputs, the attention against the float64 reference backend
on the same half inputs (which rounds the rotated q to the dtype as the kernels do). Also through
ferrocupy.torch.attention_with_kvcache and ferrocupy.flash_attn.flash_attn_with_kvcache on CUDA
tensors; hypothesis over test_kvcache_append's random calls. Outputs are NaN-poisoned first.

Skipped unless `ferrocupy.cuda_available()`; `FERRO_GPU_TESTS_ON_REFERENCE=1` runs it on the
reference (see tests/gpu_helpers.py)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from ferrocupy import AttentionOptions
from ferrocupy.dtypes import BFLOAT16, FLOAT16
from gpu_helpers import (FWD_TOL_BY_DTYPE, dev, gpu_pytestmark, ref,  # noqa: F401
                         self_check)
from test_cuda_model_options import check_f32

pytestmark = gpu_pytestmark()
torch = pytest.importorskip("torch")
import test_kvcache_append as append  # noqa: E402

LAYOUTS = {"contiguous": None, "page-1": 1, "page-3": 3, "page-16": 16, "page-64": 64}
ROTARY = {"none": (0, False), "rotate-half": (64, False), "interleaved": (64, True),
          "partial-half": (24, False), "partial-interleaved": (16, True)}
OPTIONS = {"causal": AttentionOptions(causal=True), "plain": AttentionOptions(),
           "window-softcap": AttentionOptions(window_left=40, softcap=5.0)}
ULP = {FLOAT16: 2.0**-10, BFLOAT16: 2.0**-7}


def run(d, t: dict, opts, interleaved=False) -> dict:
    """out, lse and the cache after the call on device `d` (outputs poisoned first)."""
    put = {n: d.put(a) for n, a in t.items()}
    q = t["q"]
    out = d.poisoned(q.shape, dtype=q.dtype)
    lse = d.poisoned((q.shape[0], q.shape[2], q.shape[1]))
    names = ("k_new", "v_new", "block_table", "rotary_cos", "rotary_sin", "alibi_slopes")
    d.engine.attention_with_kvcache(put["q"], put["k_cache"], put["v_cache"], out, opts, lse=lse,
                                    cache_seqlens=put["cache_seqlens"],
                                    rotary_interleaved=interleaved,
                                    **{n: put[n] for n in names if n in put})
    return {"out": d.get(out), "lse": d.get(lse), "k_cache": d.get(put["k_cache"]),
            "v_cache": d.get(put["v_cache"])}


def check_cache(t: dict, got: dict, want_k, want_v, dtype=None):
    """Appended slots as the oracle's (float32 rounding, or one unit in the last place of a half
    dtype); every slot the append does not write unchanged, bit for bit."""
    for name, w in (("k_cache", want_k), ("v_cache", want_v)):
        g = np.asarray(got[name], np.float64)
        w = np.asarray(w, np.float64)
        if dtype is None:
            np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6, equal_nan=True, err_msg=name)
        else:
            fin = np.isfinite(w)
            assert np.array_equal(np.isnan(g), np.isnan(w)), f"{name}: NaN where the oracle has none"
            bad = np.abs(g[fin] - w[fin]) > ULP[dtype] * np.abs(w[fin]) + 1e-6
            assert not bad.any(), f"{name}: {int(bad.sum())} slots beyond one ulp"
        before = np.asarray(t[name])
        untouched = np.isnan(before) == np.isnan(w)
        assert np.array_equal(np.asarray(got[name])[untouched], before[untouched],
                              equal_nan=True), f"{name}: a slot the append does not own changed"


@pytest.mark.parametrize("opts", list(OPTIONS))
@pytest.mark.parametrize("rotary", list(ROTARY))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_float32_append_against_the_oracle(dev, rng, layout, rotary, opts):
    rd, inter = ROTARY[rotary]
    # 2 new keys; 4 query rows a sequence (decode: 4 heads / 2 KV heads x 4 = 8 rows a group)
    t = append.case(rng, 3, 4, 2, 4, 2, 64, [0, 77, 190], capacity=192, page_size=LAYOUTS[layout],
                    rotary_dim=rd, alibi="h")
    o = OPTIONS[opts]
    got = run(dev, t, o, inter)
    want = append.oracle(t, o, inter)
    check_f32({"out": got["out"].astype(np.float64), "lse": got["lse"].astype(np.float64)},
              {"out": np.asarray(want[0], np.float64), "lse": np.asarray(want[1], np.float64)},
              f"[{layout} {rotary} {opts}]")
    check_cache(t, got, want[2], want[3])


@pytest.mark.parametrize("rotary", ["rotate-half", "partial-interleaved"])
def test_float32_append_then_prefill(dev, rng, rotary):
    """40 query rows a sequence (a KV group of 80: the forward kernels), contiguous cache."""
    rd, inter = ROTARY[rotary]
    t = append.case(rng, 2, 40, 40, 4, 2, 64, [100, 0], capacity=160, rotary_dim=rd)
    o = AttentionOptions(causal=True)
    got = run(dev, t, o, inter)
    want = append.oracle(t, o, inter)
    check_f32({"out": got["out"].astype(np.float64), "lse": got["lse"].astype(np.float64)},
              {"out": np.asarray(want[0], np.float64), "lse": np.asarray(want[1], np.float64)})
    check_cache(t, got, want[2], want[3])


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(append.append_calls())
def test_random_appends(call):
    """tests/test_kvcache_append.py's random calls (no query row or no new key included, sinks,
    pages of 1, 2, 5, windows, softcap) on the device, float32, against the oracle."""
    from gpu_helpers import device_under_test

    b, sq, sn, h, hkv, d, lens, capacity, page, rd, interleaved, o, sinks, seed = call
    t = append.case(np.random.default_rng(seed), b, sq, sn, h, hkv, d, lens, capacity=capacity,
                    page_size=page, rotary_dim=rd, sinks=sinks)
    opts = AttentionOptions(**o)
    d_ = device_under_test()
    put = {n: d_.put(a) for n, a in t.items()}
    out = d_.poisoned(t["q"].shape)
    lse = d_.poisoned((b, h, sq))
    names = ("k_new", "v_new", "block_table", "rotary_cos", "rotary_sin", "sinks")
    d_.engine.attention_with_kvcache(put["q"], put["k_cache"], put["v_cache"], out, opts,
                                     lse=lse, cache_seqlens=put["cache_seqlens"],
                                     rotary_interleaved=interleaved,
                                     **{n: put[n] for n in names if n in put})
    want = append.oracle(t, opts, interleaved)
    check_f32({"out": d_.get(out).astype(np.float64), "lse": d_.get(lse).astype(np.float64)},
              {"out": np.asarray(want[0], np.float64), "lse": np.asarray(want[1], np.float64)},
              str(call))
    check_cache(t, {n: d_.get(put[n]) for n in ("k_cache", "v_cache")}, want[2], want[3])


def _half(t: dict, dtype, tables_in_dtype: bool) -> dict:
    h = {n: (a.astype(dtype) if n in ("q", "k_new", "v_new", "k_cache", "v_cache") else a)
         for n, a in t.items()}
    if tables_in_dtype and "rotary_cos" in h:
        h["rotary_cos"], h["rotary_sin"] = (h[n].astype(dtype) for n in ("rotary_cos",
                                                                         "rotary_sin"))
    return h


@pytest.mark.parametrize("dtype", [FLOAT16, BFLOAT16], ids=["f16", "bf16"])
@pytest.mark.parametrize("layout", ["contiguous", "page-16", "page-3"])
@pytest.mark.parametrize("rotary, tables_in_dtype", [("none", False), ("rotate-half", False),
                                                     ("interleaved", True),
                                                     ("partial-half", True)])
def test_half_append(dev, ref, rng, dtype, layout, rotary, tables_in_dtype):
    rd, inter = ROTARY[rotary]
    t = _half(append.case(rng, 2, 1, 3, 8, 2, 128, [500, 33], capacity=768,
                          page_size=LAYOUTS[layout], rotary_dim=rd), dtype, tables_in_dtype)
    o = AttentionOptions(causal=True)
    got, want = run(dev, t, o, inter), run(ref, t, o, inter)
    for n in ("out", "lse"):
        g, w = (np.asarray(x, np.float64) for x in (got[n], want[n]))
        assert not np.isnan(g).any(), f"{n}: NaN"
        fin = np.isfinite(w)
        assert (g[~fin] == w[~fin]).all()
        err = np.linalg.norm(g[fin] - w[fin]) / np.linalg.norm(w[fin])
        assert err < FWD_TOL_BY_DTYPE[dtype], f"{n}: relative error {err:.2e}"
    check_cache(t, got, want["k_cache"], want["v_cache"], dtype)


@pytest.mark.parametrize("page", [None, 16], ids=["contiguous", "page16"])
def test_through_torch_and_flash_attn_on_cuda_tensors(rng, page):
    if self_check():
        pytest.skip("CUDA tensors")
    import ferrocupy.flash_attn as fa
    import ferrocupy.torch as ft

    t = append.case(rng, 2, 1, 2, 8, 2, 64, [40, 3], capacity=64, page_size=page, rotary_dim=32)
    want = append.oracle(t, AttentionOptions(causal=True), True)
    for call in ("torch", "flash_attn"):
        tt = {n: torch.from_numpy(a.copy()).cuda() for n, a in t.items()}
        common = dict(cache_seqlens=tt["cache_seqlens"], block_table=tt.get("block_table"),
                      rotary_cos=tt["rotary_cos"], rotary_sin=tt["rotary_sin"],
                      rotary_interleaved=True, causal=True)
        if call == "torch":
            out, lse = ft.attention_with_kvcache(tt["q"], tt["k_cache"], tt["v_cache"],
                                                 tt["k_new"], tt["v_new"], return_lse=True,
                                                 **common)
        else:
            out, lse = fa.flash_attn_with_kvcache(tt["q"], tt["k_cache"], tt["v_cache"],
                                                  tt["k_new"], tt["v_new"],
                                                  return_softmax_lse=True, **common)
        check_f32({"out": out.double().cpu().numpy(), "lse": lse.double().cpu().numpy()},
                  {"out": np.asarray(want[0], np.float64), "lse": np.asarray(want[1], np.float64)},
                  f"[{call}]")
        got = {n: tt[n].cpu().numpy() for n in ("k_cache", "v_cache")}
        check_cache(t, got, want[2], want[3])
