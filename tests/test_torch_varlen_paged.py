"""ferrocupy.torch's varlen (`cu_seqlens_q`, `cu_seqlens_k`, `max_seqlen_q`, `max_seqlen_k`),
paged KV (`block_table`) and `attention_with_kvcache` on CPU tensors: forward and gradients
(q, k, v, sinks) against the per-sequence dense oracle of tests/test_varlen.py, eager and under
torch.compile; opcheck of the ops with the new arguments; paged and the append against their
oracles (inference only, refused with a gradient); the CUDA backend's refusal through the torch
path."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import ferrocupy.torch as ft  # noqa: E402
import test_kvcache_append as append  # noqa: E402
import test_paged_kv as paged  # noqa: E402
import test_varlen as varlen  # noqa: E402
from ferrocupy import AttentionOptions, ComputeEngine  # noqa: E402

FWD = torch.ops.ferrocupy.attention_fwd.default
BWD = torch.ops.ferrocupy.attention_bwd.default
TOL = 5e-5


def _close(got, want, what):
    got = got.detach().double().numpy() if isinstance(got, torch.Tensor) else np.asarray(got)
    want = np.asarray(want, np.float64)
    err = np.abs(got - want).max(initial=0.0) / max(np.abs(want).max(initial=0.0), 1.0)
    assert err <= TOL, f"{what}: {err:.2e}"


LENS_Q, LENS_K = [3, 0, 5, 2], [4, 2, 5, 6]
KW = {
    "causal-bottom-right": dict(causal=True, causal_offset=6 - 5, softcap=1.5),
    "window-dropout": dict(window_left=2, window_right=1, dropout_p=0.3, seed=7),
    "plain": dict(),
}


def _case(rng, alibi="bh"):
    t = varlen.packed(rng, LENS_Q, LENS_K, 4, 2, 8, alibi=alibi, sinks=True)
    return {n: torch.from_numpy(a) for n, a in t.items()}, t


@pytest.mark.parametrize("name", list(KW))
@pytest.mark.parametrize("compiled", [False, True])
def test_varlen_forward_and_gradients_against_the_oracle(rng, name, compiled):
    kw = KW[name]
    tt, t = _case(rng)
    go = rng.standard_normal(t["q"].shape).astype(np.float32)

    def call(q, k, v, sinks):
        return ft.attention(q, k, v, cu_seqlens_q=tt["cu_seqlens_q"],
                            cu_seqlens_k=tt["cu_seqlens_k"], max_seqlen_q=5, max_seqlen_k=6,
                            alibi_slopes=tt["alibi_slopes"], sinks=sinks, **kw)

    if compiled:
        torch.compiler.reset()
    fn = torch.compile(call, fullgraph=True, backend="aot_eager") if compiled else call
    leaves = [tt[n].clone().requires_grad_(True) for n in ("q", "k", "v", "sinks")]
    out = fn(*leaves)
    out.backward(torch.from_numpy(go))
    opts = AttentionOptions(causal=kw.get("causal", False),
                            causal_offset=kw.get("causal_offset", 0),
                            window_left=kw.get("window_left"), window_right=kw.get("window_right"),
                            softcap=kw.get("softcap", 0.0), dropout_prob=kw.get("dropout_p", 0.0),
                            seed=kw.get("seed", 0))
    want_out, _ = varlen.oracle_forward(t, opts, 5, 6)
    _close(out, want_out, "out")
    want = varlen.oracle_grads(t, opts, 5, 6, go)
    for leaf, w, what in zip(leaves, want, ("grad_q", "grad_k", "grad_v", "grad_sinks")):
        _close(leaf.grad, w, what)


def test_opcheck_with_varlen(rng):
    tt, _ = _case(rng, alibi="h")
    seed = torch.tensor(0, dtype=torch.int64)
    tail = (tt["cu_seqlens_q"], tt["cu_seqlens_k"], 5, 6, None)
    args = (tt["q"], tt["k"], tt["v"], None, True, 1, 0, 0.0, seed, None, None, None, None, 0.0,
            tt["alibi_slopes"], tt["sinks"]) + tail
    torch.library.opcheck(FWD, args)
    grad_args = tuple(x.clone().requires_grad_(True) for x in args[:3]) + args[3:15] + (
        tt["sinks"].clone().requires_grad_(True),) + tail
    torch.library.opcheck(FWD, grad_args)
    out, lse = FWD(*args)
    assert lse.shape == (4, sum(LENS_Q))
    go = torch.randn(out.shape)
    bwd = (go, *args[:3], out, lse, *args[3:10], None, None, 0.0, tt["alibi_slopes"],
           tt["sinks"], *tail[:4])
    torch.library.opcheck(BWD, bwd)


def test_paged_forward_and_no_gradient(rng):
    t = paged.paged_case(rng, 2, 3, 4, 2, 8, 4, 3, [9, 5], alibi="h")
    tt = {n: torch.from_numpy(a) for n, a in t.items()}
    opts = AttentionOptions(causal=True, causal_offset=12 - 3)
    kw = dict(kv_lens=tt["kv_lens"], block_table=tt["block_table"],
              alibi_slopes=tt["alibi_slopes"], causal=True, causal_offset=9)
    out = ft.attention(tt["q"], tt["k"], tt["v"], **kw)
    want, _ = paged.forward(ComputeEngine("reference", quiet=True), t, opts)
    assert torch.equal(out, torch.from_numpy(want))
    paged.check(t, opts)  # the engine's answer is the oracle's
    q = tt["q"].clone().requires_grad_(True)
    with pytest.raises(ValueError, match="no backward with kv_lens or block_table"):
        ft.attention(q, tt["k"], tt["v"], **kw)
    with torch.no_grad():
        assert torch.equal(ft.attention(q, tt["k"], tt["v"], **kw), out)
    without_lens = dict(kw, kv_lens=None, causal=False)
    with pytest.raises(ValueError, match="no backward with kv_lens or block_table"):
        ft.attention(q, tt["k"], tt["v"], **without_lens)


@pytest.mark.parametrize("layout", [None, 3])
@pytest.mark.parametrize("interleaved", [False, True])
def test_attention_with_kvcache(rng, layout, interleaved):
    t = append.case(rng, 2, 2, 2, 4, 2, 8, [5, 1], capacity=9, page_size=layout, rotary_dim=8,
                    alibi="bh")
    tt = {n: torch.from_numpy(a.copy()) for n, a in t.items()}
    opts = AttentionOptions(causal=True)
    out, lse = ft.attention_with_kvcache(
        tt["q"], tt["k_cache"], tt["v_cache"], tt["k_new"], tt["v_new"],
        cache_seqlens=tt["cache_seqlens"], block_table=tt.get("block_table"),
        rotary_cos=tt["rotary_cos"], rotary_sin=tt["rotary_sin"], rotary_interleaved=interleaved,
        causal=True, alibi_slopes=tt["alibi_slopes"], return_lse=True)
    want = append.oracle(t, opts, interleaved)
    _close(out, want[0], "out")
    _close(lse, want[1], "lse")
    for got, w in zip((tt["k_cache"], tt["v_cache"]), want[2:]):  # written in place
        np.testing.assert_allclose(got.numpy(), w, rtol=1e-6, atol=1e-6, equal_nan=True)


def test_attention_with_kvcache_takes_flash_attn_arguments(rng):
    """An int cache_seqlens, int64 tensors, no new keys, window sides of -1; no gradient."""
    t = append.case(rng, 2, 1, 1, 2, 1, 8, [3, 3], capacity=6)
    tt = {n: torch.from_numpy(a.copy()) for n, a in t.items()}
    a = ft.attention_with_kvcache(tt["q"], tt["k_cache"].clone(), tt["v_cache"].clone(),
                                  tt["k_new"], tt["v_new"], cache_seqlens=3, causal=True,
                                  window_left=-1, window_right=-1)
    b = ft.attention_with_kvcache(tt["q"], tt["k_cache"].clone(), tt["v_cache"].clone(),
                                  tt["k_new"], tt["v_new"],
                                  cache_seqlens=torch.tensor([3, 3]), causal=True)
    assert torch.equal(a, b)
    want = append.oracle(t, AttentionOptions(causal=True))
    _close(a, want[0], "out")
    c = ft.attention_with_kvcache(tt["q"], tt["k_cache"], tt["v_cache"], cache_seqlens=3)
    assert torch.isfinite(c).all()
    with pytest.raises(ValueError, match="attention_with_kvcache has no backward"):
        ft.attention_with_kvcache(tt["q"].clone().requires_grad_(True), tt["k_cache"],
                                  tt["v_cache"], cache_seqlens=3)
    with pytest.raises(ValueError, match=r"cache_seqlens\[0\] = 6 plus 1 new keys"):
        ft.attention_with_kvcache(tt["q"], tt["k_cache"], tt["v_cache"], tt["k_new"],
                                  tt["v_new"], cache_seqlens=6)


def test_attention_with_kvcache_op_under_opcheck_and_compile(rng):
    """The append is the op `ferrocupy::attention_with_kvcache` (mutating the cache): opcheck
    passes, and torch.compile(fullgraph=True) gives the eager answer and cache."""
    t = append.case(rng, 2, 2, 2, 4, 2, 8, [3, 5], capacity=9, page_size=4, rotary_dim=8,
                    alibi="bh")
    tt = {n: torch.from_numpy(np.nan_to_num(a)) for n, a in t.items()}
    args = (tt["q"], tt["k_cache"].clone(), tt["v_cache"].clone(), tt["k_new"], tt["v_new"],
            tt["cache_seqlens"], tt["block_table"], tt["rotary_cos"], tt["rotary_sin"], True,
            True, -1, -1, 0.0, tt["alibi_slopes"], None, True)
    torch.library.opcheck(torch.ops.ferrocupy.attention_with_kvcache.default, args)

    def call(q, k_cache, v_cache):
        return ft.attention_with_kvcache(
            q, k_cache, v_cache, tt["k_new"], tt["v_new"], cache_seqlens=tt["cache_seqlens"],
            block_table=tt["block_table"], rotary_cos=tt["rotary_cos"],
            rotary_sin=tt["rotary_sin"], rotary_interleaved=True, causal=True,
            alibi_slopes=tt["alibi_slopes"], return_lse=True)

    eager_cache = (tt["k_cache"].clone(), tt["v_cache"].clone())
    want = call(tt["q"], *eager_cache)
    torch.compiler.reset()
    compiled_cache = (tt["k_cache"].clone(), tt["v_cache"].clone())
    got = torch.compile(call, fullgraph=True, backend="aot_eager")(tt["q"], *compiled_cache)
    for g, w in zip(got + compiled_cache, want + eager_cache):
        assert torch.equal(g, w)


def test_cuda_backend_plans_and_runs_paged_prefill_through_torch(rng, monkeypatch):
    """A stand-in CUDA backend (host memory, runs recorded): paged prefill (18 rows a KV group,
    the forward's paged build) is planned and run through ferrocupy.torch; a bad table is
    refused by name before any run."""
    engine = ComputeEngine("reference", quiet=True)
    engine.backend = paged._CudaRunner()
    monkeypatch.setattr(ft, "_engine", lambda device: engine)
    p = {n: torch.from_numpy(a) for n, a in
         paged.paged_case(rng, 2, 9, 2, 1, 8, 4, 3, [9, 2]).items()}  # prefill: 18 rows
    bad = p["block_table"].clone()
    bad[0, 2] = 99
    with pytest.raises(ValueError, match=r"block_table\[0, 2\] = 99 is not a block"):
        ft.attention(p["q"], p["k"], p["v"], kv_lens=p["kv_lens"], block_table=bad)
    assert engine.backend.runs == []
    ft.attention(p["q"], p["k"], p["v"], kv_lens=p["kv_lens"], block_table=p["block_table"])
    assert engine.backend.plans == engine.backend.runs == ["forward"]
