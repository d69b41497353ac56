"""A paged KV cache on the CUDA decode kernels (SPEC "Paged KV cache"): key j of batch b is row
j % page_size of block block_table[b, j // page_size]. Each call is made twice from one set of
keys: as a contiguous `[B, capacity, Hkv, D]` cache with kv_lens (the float64 oracle's input)
and paged, its pages scattered over a larger pool in random order. NaN fills every slot the call
must not read: blocks no sequence owns, the slots of a sequence's last page past its length, and
the block-table entries past a sequence's reach hold ids that are not blocks at all. Outputs are
NaN-poisoned first. Page sizes 1, 16, 48 (not a power of two), 64, 256, GQA, causal and
windows, each dtype (float32 against the oracle, halves by SPEC's rule, tests/half_rule.py's),
each decode design (`decoders`: the engine's pick, streams, tiles), splits that cut pages, and
the paged result equal, bit for bit, to the contiguous one on the same kernel; hypothesis over
page sizes, lengths, heads and visibility. Also through
ferrocupy.torch.attention_with_kvcache and ferrocupy.flash_attn.flash_attn_with_kvcache on CUDA
tensors.

Skipped unless `ferrocupy.cuda_available()`; `FERRO_GPU_TESTS_ON_REFERENCE=1` runs it on the
reference (see tests/gpu_helpers.py)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ferrocupy import AttentionOptions
from ferrocupy.dtypes import BFLOAT16, FLOAT16, FLOAT32
from gpu_helpers import axis, covering, decoders, gpu_pytestmark, self_check  # noqa: F401
from test_cuda_model_options import check_f32, check_half, oracle, rounded

pytestmark = gpu_pytestmark()
torch = pytest.importorskip("torch")

DTYPES = [pytest.param(FLOAT32, id="f32"), pytest.param(FLOAT16, id="f16"),
          pytest.param(BFLOAT16, id="bf16")]
PAGES = [1, 16, 48, 64, 256]


def contiguous_case(rng, *, b, sq, h, hkv, d, capacity, lens, opts, alibi=None) -> dict:
    """Host float32 inputs: a contiguous cache with NaN past each kv_lens entry."""
    t = dict(q=rng.standard_normal((b, sq, h, d), dtype=np.float32),
             k=rng.standard_normal((b, capacity, hkv, d), dtype=np.float32),
             v=rng.standard_normal((b, capacity, hkv, d), dtype=np.float32),
             kv_lens=np.array(lens, np.int32), opts=opts)
    for i, n in enumerate(lens):
        t["k"][i, n:], t["v"][i, n:] = np.nan, np.nan
    if alibi:
        t["alibi_slopes"] = rng.uniform(0.01, 0.3, h).astype(np.float32)
    return t


def paged(t: dict, page: int, rng, spare: int = 3) -> dict:
    """`t`'s cache as pages: sequence b's blocks (as many as its length needs) scattered in
    random order over a pool with `spare` blocks nobody owns (NaN); the table's entries past a
    sequence's blocks are not block ids (never read); the slots past its length are NaN."""
    k, v, lens = t["k"], t["v"], t["kv_lens"]
    b, cap, hkv, d = k.shape
    assert cap % page == 0, "capacity is whole pages"
    used = [-(-int(n) // page) for n in lens]
    pool = sum(used) + spare
    order = rng.permutation(pool)
    kp = np.full((pool, page, hkv, d), np.nan, k.dtype)
    vp = np.full_like(kp, np.nan)
    table = rng.choice(np.array([-1, pool, 2**31 - 1, -2**31], np.int32), (b, cap // page))
    at = 0
    for i, n in enumerate(used):
        table[i, :n] = order[at:at + n]
        at += n
        for blk in range(n):
            kp[table[i, blk]] = k[i, blk * page:(blk + 1) * page]
            vp[table[i, blk]] = v[i, blk * page:(blk + 1) * page]
    return t | dict(k=kp, v=vp, block_table=table.astype(np.int32))


def run(dev, t: dict) -> dict:
    """The engine's out and lse (poisoned first) for `t` (paged when it has a block_table)."""
    put = {n: dev.put(t.get(n)) for n in ("q", "k", "v", "kv_lens", "block_table",
                                          "alibi_slopes", "sinks")}
    b, sq, h, _ = t["q"].shape
    out, lse = dev.poisoned(t["q"].shape, dtype=t["q"].dtype), dev.poisoned((b, h, sq))
    dev.engine.flash_attention_v2_with(put["q"], put["k"], put["v"], out, t["opts"], lse=lse,
                                       kv_lens=put["kv_lens"], block_table=put["block_table"],
                                       alibi_slopes=put["alibi_slopes"], sinks=put["sinks"])
    return {"out": dev.get(out).astype(np.float64), "lse": dev.get(lse).astype(np.float64)}


# (batch, seq_q, heads, kv_heads, head_dim, capacity, lens, options)
CASES = {
    "sq1-gqa4-d128-causal": (3, 1, 8, 2, 128, 3072, [3072, 1000, 17],
                             dict(causal=True, causal_offset=3071)),
    "sq2-gqa4-d128-window": (2, 2, 8, 2, 128, 3072, [2999, 1536],
                             dict(causal=True, causal_offset=3070, window=777)),
    "sq4-gqa4-d64-noncausal-empty": (3, 4, 8, 2, 64, 1536, [1536, 0, 1], dict()),
    "sq1-mha-d96-window-right": (2, 1, 4, 4, 96, 1536, [1500, 700],
                                 dict(causal_offset=1000, window_left=300, window_right=50)),
    "sq3-gqa4-d128-16rows": (2, 3, 8, 2, 128, 1536, [1536, 1111],
                             dict(causal=True, causal_offset=1533)),
}


def _case(rng, name, page, dtype, alibi=False):
    b, sq, h, hkv, d, cap, lens, o = CASES[name]
    t = contiguous_case(rng, b=b, sq=sq, h=h, hkv=hkv, d=d, capacity=cap, lens=lens,
                        opts=AttentionOptions(**o), alibi=alibi)
    if dtype != FLOAT32:
        t = rounded(t | {"go": t["q"]}, dtype)
        del t["go"]
    return t, paged(t, page, rng)


@pytest.mark.parametrize("dtype,name,page", covering({
    "dtype": axis(DTYPES),
    "name": axis(list(CASES)),
    "page": axis(PAGES, ids=lambda p: f"page{p}"),
}))
def test_paged_decode_against_the_oracle(decoders, rng, dtype, name, page):
    t, tp = _case(rng, name, page, dtype)
    got = run(decoders, tp)
    what = f"[{name} page {page} {dtype}]"
    if dtype == FLOAT32:
        check_f32(got, oracle(t, backward=False), what)
    else:
        check_half(got, t, what)
    if not self_check():  # the same kernel, the same splits: the same bits
        same = run(decoders, t)
        for n in ("out", "lse"):
            assert np.array_equal(got[n], same[n], equal_nan=True), f"{n}: paged != contiguous {what}"


@pytest.mark.parametrize("page", [16, 48], ids=lambda p: f"page{p}")
def test_paged_decode_with_alibi_and_many_pairs(decoders, rng, page):
    """The model-option build (mods) reads the pages too; 40 pairs, one split each."""
    b = 20
    lens = [960 - 47 * i for i in range(b)]
    t = contiguous_case(rng, b=b, sq=1, h=8, hkv=2, d=128, capacity=960, lens=lens,
                        opts=AttentionOptions(causal=True, causal_offset=959, softcap=5.0),
                        alibi=True)
    t = rounded(t | {"go": t["q"]}, BFLOAT16)
    del t["go"]
    check_half(run(decoders, paged(t, page, rng)), t, f"[alibi page {page}]")


@pytest.mark.parametrize("dtype", DTYPES)
def test_unaligned_paged_rows_take_the_element_copies(decoders, rng, dtype):
    """head_dim 7 (half: no 16-byte copy): the tiles design's per-row path."""
    t = contiguous_case(rng, b=2, sq=1, h=4, hkv=2, d=7, capacity=480, lens=[480, 100],
                        opts=AttentionOptions(causal=True, causal_offset=479))
    if dtype != FLOAT32:
        t = rounded(t | {"go": t["q"]}, dtype)
        del t["go"]
    got = run(decoders, paged(t, 48, rng))
    if dtype == FLOAT32:
        check_f32(got, oracle(t, backward=False))
    else:
        check_half(got, t)


@st.composite
def paged_calls(draw, prefill: bool = False):
    """A decode call (at most 16 rows a KV group) over a paged cache of any page size; with
    `prefill`, more rows (the forward kernels' call: tests/test_cuda_paged_prefill.py) in
    float32 or bfloat16."""
    page = draw(st.integers(1, 300))
    blocks = draw(st.integers(1, max(1, (1500 if prefill else 2000) // page)))
    cap = blocks * page
    b = draw(st.integers(1, 3))
    hkv = draw(st.sampled_from([1, 2]))
    group = draw(st.sampled_from([1, 2, 4]))
    sq = draw(st.integers(16 // group + 1, 200) if prefill else st.integers(1, 16 // group))
    lens = draw(st.lists(st.integers(0, cap), min_size=b, max_size=b))
    kind = draw(st.sampled_from(["causal", "window", "sides", "none"]))
    off = draw(st.integers(-sq if prefill else -5, cap))
    opts = {"causal": dict(causal=True, causal_offset=cap - sq),
            "window": dict(causal=True, causal_offset=off, window=draw(st.integers(1, 400))),
            "sides": dict(causal_offset=off, window_left=draw(st.integers(-1, 300)),
                          window_right=draw(st.integers(-1, 50))),
            "none": dict()}[kind]
    d = draw(st.sampled_from([32, 64, 128]))
    dtype = draw(st.sampled_from([FLOAT32, BFLOAT16])) if prefill else FLOAT32
    return dict(page=page, b=b, sq=sq, h=hkv * group, hkv=hkv, d=d, capacity=cap, lens=lens,
                opts=AttentionOptions(**opts), dtype=dtype, seed=draw(st.integers(0, 2**32 - 1)))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(call=paged_calls())
def test_random_paged_decode_calls(call):
    """Any page size, table order, lengths (0 and full included), GQA and visibility: float32
    against the oracle, and bit for bit the contiguous call's answer on the device."""
    from gpu_helpers import device_under_test

    dev = device_under_test()
    rng = np.random.default_rng(call["seed"])
    t = contiguous_case(rng, b=call["b"], sq=call["sq"], h=call["h"], hkv=call["hkv"],
                        d=call["d"], capacity=call["capacity"], lens=call["lens"],
                        opts=call["opts"])
    got = run(dev, paged(t, call["page"], rng))
    check_f32(got, oracle(t, backward=False), str({k: v for k, v in call.items()}))
    if not self_check():
        same = run(dev, t)
        for n in ("out", "lse"):
            assert np.array_equal(got[n], same[n], equal_nan=True), n


def _torch_case(rng, page):
    t = contiguous_case(rng, b=2, sq=1, h=8, hkv=2, d=64, capacity=1024, lens=[1024, 333],
                        opts=AttentionOptions(causal=True, causal_offset=1023))
    return t, paged(t, page, rng)


@pytest.mark.parametrize("page", [16, 256], ids=lambda p: f"page{p}")
def test_through_torch_and_flash_attn_on_cuda_tensors(rng, page):
    if self_check():
        pytest.skip("CUDA tensors")
    import ferrocupy.flash_attn as fa
    import ferrocupy.torch as ft

    t, tp = _torch_case(rng, page)
    want = oracle(t, backward=False)
    cu = {n: torch.from_numpy(np.asarray(tp[n])).cuda() for n in ("q", "k", "v", "kv_lens",
                                                                    "block_table")}
    # bottom-right (flash-attn's) over cache_seqlens keys: the oracle's causal_offset
    # capacity - seq_q with kv_lens
    out, lse = ft.attention_with_kvcache(cu["q"], cu["k"], cu["v"], cache_seqlens=cu["kv_lens"],
                                         block_table=cu["block_table"], causal=True,
                                         return_lse=True)
    got = {"out": out.double().cpu().numpy(), "lse": lse.double().cpu().numpy()}
    check_f32(got, want, f"[torch page {page}]")
    out, lse = fa.flash_attn_with_kvcache(cu["q"], cu["k"], cu["v"], cache_seqlens=cu["kv_lens"],
                                          block_table=cu["block_table"], causal=True,
                                          return_softmax_lse=True)
    got = {"out": out.double().cpu().numpy(), "lse": lse.double().cpu().numpy()}
    check_f32(got, want, f"[flash_attn page {page}]")
