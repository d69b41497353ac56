"""A paged KV cache on the CUDA forward kernels (SPEC "Paged KV cache": prefill, more than
DECODE_ROWS = 16 query rows a KV group): the forward's paged builds (configs.py's `paged`,
FERRO_PAGED), mma.sync in every dtype and, on an H100/H200, the sm_90a wgmma kernel in half
precision (`kernels`: the engine's own pick, and mma.sync alone). Key j of batch b is row j %
page_size of block block_table[b, j // page_size].

Each call is made from one set of keys twice: as a contiguous `[B, capacity, Hkv, D]` cache with
kv_lens (the float64 oracle's input) and paged, its pages scattered over a larger pool in random
order (tests/test_cuda_paged.py's `paged`). NaN fills every slot the call must not read: blocks
no sequence owns, a sequence's slots past its length, and the table's entries past a sequence's
reach hold ids that are no blocks at all. Outputs are NaN-poisoned first. Pages 1, 16, 48 (not a
power of two), 64 (a key tile), 256 (several tiles a page); float32 against the oracle, halves by
SPEC's rule (tests/half_rule.py's); causal bottom-right (also with more rows than keys), windows,
GQA, kv_lens with an empty sequence, softcap / ALiBi / sinks, head_dims 40 to 256 and an odd one
(element copies); the paged answer equal, bit for bit, to the contiguous call's (the same
geometry and arithmetic: only the addresses differ); hypothesis over page sizes, lengths, heads
and visibility. Also flash_attn_with_kvcache with cache_batch_idx / cache_leftpad (a paged view
of a contiguous cache) and ferrocupy.torch.attention_with_kvcache, more than 16 rows a group.

Skipped unless `ferrocupy.cuda_available()`; `FERRO_GPU_TESTS_ON_REFERENCE=1` runs it on the
reference (see tests/gpu_helpers.py)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from ferrocupy import AttentionOptions
from ferrocupy.dtypes import FLOAT32
from gpu_helpers import axis, covering, dev, gpu_pytestmark, kernels, self_check  # noqa: F401
from test_cuda_model_options import check_f32, check_half, oracle, rounded
from test_cuda_paged import DTYPES, PAGES, contiguous_case, paged, paged_calls, run

pytestmark = gpu_pytestmark()
torch = pytest.importorskip("torch")

# (batch, seq_q, heads, kv_heads, head_dim, capacity, lens, options); every case has more than
# 16 query rows a KV group, a capacity of whole pages of every size in PAGES. "br":
# bottom-right (causal_offset = capacity - seq_q with kv_lens).
CASES = {
    "gqa4-d128-causal-br": (2, 200, 8, 2, 128, 1536, [1536, 333],
                            dict(causal=True, causal_offset=1536 - 200)),
    "mha-d64-window-br": (2, 130, 4, 4, 64, 768, [700, 768],
                          dict(causal=True, causal_offset=768 - 130, window=100)),
    "gqa2-d96-noncausal-empty": (3, 70, 4, 2, 96, 768, [768, 0, 65], dict()),
    "gqa4-d64-sides": (2, 64, 8, 2, 64, 768, [700, 768],
                       dict(causal_offset=400, window_left=300, window_right=40)),
    # bottom-right over kv_lens shorter than seq_q: the first rows see no key
    "gqa2-d128-more-rows-than-keys": (2, 300, 4, 2, 128, 768, [256, 100],
                                      dict(causal=True, causal_offset=768 - 300)),
    "gqa2-d40-causal-br": (2, 96, 4, 2, 40, 768, [500, 768],
                           dict(causal=True, causal_offset=768 - 96)),
}


def in_dtype(t: dict, dtype) -> dict:
    if dtype == FLOAT32:
        return t
    t = rounded(t | {"go": t["q"]}, dtype)
    del t["go"]
    return t


def check(dev, t: dict, page: int, rng, what: str) -> None:
    """The paged call against the oracle (float32) or the half rule, and bit for bit the
    contiguous call's answer on the device."""
    got = run(dev, paged(t, page, rng))
    if not self_check():  # a paged build served the call (no silent contiguous copy)
        assert _paged_build_chosen(dev, t), f"no paged build chosen {what}"
    if t["q"].dtype == FLOAT32:
        check_f32(got, oracle(t, backward=False), what)
    else:
        check_half(got, t, what)
    if not self_check():
        same = run(dev, t)
        for n in ("out", "lse"):
            assert np.array_equal(got[n], same[n], equal_nan=True), \
                f"{n}: paged != contiguous {what}"


def _paged_build_chosen(dev, t: dict) -> bool:
    """Whether the device's backend has chosen a paged forward build at the call's dtype and
    head_dim (its kernel cache's keys: (op, dtype, head_dim, ..., paged); a contiguous call
    never makes one)."""
    d, dtype = t["q"].shape[-1], np.dtype(t["q"].dtype)
    return any(isinstance(key, tuple) and key[0] == "forward" and key[-1] and key[1] == dtype
               and key[2] == d for key in dev.engine.backend._kernels)


def _case(rng, name, dtype, *, alibi=False):
    b, sq, h, hkv, d, cap, lens, o = CASES[name]
    assert h // hkv * sq > 16, "prefill: the forward kernels' call"
    t = contiguous_case(rng, b=b, sq=sq, h=h, hkv=hkv, d=d, capacity=cap, lens=lens,
                        opts=AttentionOptions(**o), alibi=alibi)
    return in_dtype(t, dtype)


@pytest.mark.parametrize("dtype,name,page", covering({
    "dtype": axis(DTYPES),
    "name": axis(list(CASES)),
    "page": axis(PAGES, ids=lambda p: f"page{p}"),
}))
def test_paged_prefill_against_the_oracle(kernels, rng, dtype, name, page):
    check(kernels, _case(rng, name, dtype), page, rng, f"[{name} page {page} {dtype}]")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("page", [16, 48, 256], ids=lambda p: f"page{p}")
def test_paged_prefill_with_softcap_alibi_and_sinks(kernels, rng, dtype, page):
    """The model-option builds (FERRO_MODS, and the wgmma general build) read the pages too."""
    t = contiguous_case(rng, b=2, sq=150, h=8, hkv=2, d=128, capacity=768, lens=[768, 400],
                        opts=AttentionOptions(causal=True, causal_offset=768 - 150, softcap=5.0),
                        alibi=True)
    t["sinks"] = rng.uniform(-1.0, 2.0, 8).astype(np.float32)
    check(kernels, in_dtype(t, dtype), page, rng, f"[mods page {page} {dtype}]")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [192, 256])
def test_paged_prefill_above_head_dim_128(dev, rng, dtype, d):
    t = contiguous_case(rng, b=2, sq=80, h=4, hkv=2, d=d, capacity=768, lens=[768, 200],
                        opts=AttentionOptions(causal=True, causal_offset=768 - 80))
    check(dev, in_dtype(t, dtype), 48, rng, f"[d{d} {dtype}]")


@pytest.mark.parametrize("dtype", DTYPES)
def test_unaligned_paged_rows_take_the_element_copies(dev, rng, dtype):
    """head_dim 7 (no 16-byte copy, and none of 4 bytes in half precision): the mma.sync
    build's narrow copies through the pages."""
    t = contiguous_case(rng, b=2, sq=40, h=4, hkv=2, d=7, capacity=480, lens=[480, 100],
                        opts=AttentionOptions(causal=True, causal_offset=480 - 40))
    check(dev, in_dtype(t, dtype), 48, rng, f"[d7 {dtype}]")


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(call=paged_calls(prefill=True))
def test_random_paged_prefill_calls(call):
    """Any page size, table order, lengths (0 and full included), GQA and visibility: float32
    against the oracle, bfloat16 by the half rule; bit for bit the contiguous call's answer."""
    from gpu_helpers import device_under_test

    rng = np.random.default_rng(call["seed"])
    t = contiguous_case(rng, b=call["b"], sq=call["sq"], h=call["h"], hkv=call["hkv"],
                        d=call["d"], capacity=call["capacity"], lens=call["lens"],
                        opts=call["opts"])
    check(device_under_test(), in_dtype(t, call["dtype"]), call["page"], rng, str(call))


def _device() -> str:
    """Where the torch-level calls' tensors live: CUDA (the kernels), the CPU in self-check
    mode (the reference, proving the test code)."""
    return "cpu" if self_check() else "cuda"


def _cuda(tp: dict, *names) -> list:
    return [torch.from_numpy(np.ascontiguousarray(tp[n])).to(_device()) for n in names]


@pytest.mark.parametrize("page", [16, 256], ids=lambda p: f"page{p}")
def test_paged_prefill_through_torch_and_flash_attn(rng, page):
    """ferrocupy.torch.attention_with_kvcache and flash_attn_with_kvcache over a block table,
    40 rows a KV group, bottom-right over cache_seqlens keys."""
    import ferrocupy.flash_attn as fa
    import ferrocupy.torch as ft

    t = contiguous_case(rng, b=2, sq=20, h=4, hkv=2, d=64, capacity=1024, lens=[1024, 333],
                        opts=AttentionOptions(causal=True, causal_offset=1024 - 20))
    want = oracle(t, backward=False)
    q, k, v, lens, table = _cuda(paged(t, page, rng), "q", "k", "v", "kv_lens", "block_table")
    out, lse = ft.attention_with_kvcache(q, k, v, cache_seqlens=lens, block_table=table,
                                         causal=True, return_lse=True)
    check_f32({"out": out.double().cpu().numpy(), "lse": lse.double().cpu().numpy()}, want,
              f"[torch page {page}]")
    out, lse = fa.flash_attn_with_kvcache(q, k, v, cache_seqlens=lens, block_table=table,
                                          causal=True, return_softmax_lse=True)
    check_f32({"out": out.double().cpu().numpy(), "lse": lse.double().cpu().numpy()}, want,
              f"[flash_attn page {page}]")


@pytest.mark.parametrize("leftpad", [False, True], ids=["batch-idx", "batch-idx-leftpad"])
def test_flash_attn_with_kvcache_cache_rows_in_prefill(rng, leftpad):
    """cache_batch_idx (and cache_leftpad) with an append: flash-attn's rows of a contiguous
    cache, read as a paged view of it (flash_attn._CacheRows: pages of gcd(S_cache, pads) rows)
    with 3 x 24 = 72 query rows a KV group: the append, then the forward's paged build. Against
    the oracle on each sequence's own keys and new keys, bottom-right; NaN elsewhere in the
    cache (rows no sequence names, slots before a left pad, after a length) never read; the new
    keys land at cache_seqlens[b] in row cache_batch_idx[b]."""
    import ferrocupy.flash_attn as fa

    B, rows, cap, sq, new, h, hkv, d = 2, 4, 512, 24, 8, 6, 2, 64
    idx = np.array([3, 1], np.int32)
    pad = np.array([64, 128], np.int32) if leftpad else np.zeros(B, np.int32)
    lens = np.array([400, 500], np.int32)
    cache_k = np.full((rows, cap, hkv, d), np.nan, np.float32)
    cache_v = np.full_like(cache_k, np.nan)
    q = rng.standard_normal((B, sq, h, d), dtype=np.float32)
    k_new = rng.standard_normal((B, new, hkv, d), dtype=np.float32)
    v_new = rng.standard_normal((B, new, hkv, d), dtype=np.float32)
    seq_k, seq_v = [], []
    for b in range(B):
        n = int(lens[b] - pad[b])
        seq_k.append(rng.standard_normal((n, hkv, d), dtype=np.float32))
        seq_v.append(rng.standard_normal((n, hkv, d), dtype=np.float32))
        cache_k[idx[b], pad[b]:lens[b]], cache_v[idx[b], pad[b]:lens[b]] = seq_k[b], seq_v[b]
    at = lambda x: torch.from_numpy(x).to(_device())  # noqa: E731
    kc, vc = at(cache_k), at(cache_v)
    kw = dict(cache_seqlens=at(lens), cache_batch_idx=at(idx), causal=True,
              return_softmax_lse=True)
    if leftpad:
        kw["cache_leftpad"] = at(pad)
    out, lse = fa.flash_attn_with_kvcache(at(q), kc, vc, k=at(k_new), v=at(v_new), **kw)
    for b in range(B):  # each sequence alone: its keys then the new ones, bottom-right
        keys = np.concatenate([seq_k[b], k_new[b]])[None]
        values = np.concatenate([seq_v[b], v_new[b]])[None]
        n = keys.shape[1]
        t = dict(q=q[b:b + 1], k=keys, v=values, kv_lens=np.array([n], np.int32),
                 opts=AttentionOptions(causal=True, causal_offset=n - sq))
        got = {"out": out[b:b + 1].double().cpu().numpy(),
               "lse": lse[b:b + 1].double().cpu().numpy()}
        check_f32(got, oracle(t, backward=False), f"[sequence {b}]")
        row = kc[int(idx[b])].cpu().numpy()
        np.testing.assert_array_equal(row[lens[b]:lens[b] + new], k_new[b])
