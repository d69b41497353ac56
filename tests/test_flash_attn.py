"""ferrocupy.flash_attn on CPU tensors (the reference backend) against tests/flash_oracle.py, a
float64 computation of flash-attn's semantics: the fixed-length functions (plain, qkv- and
kv-packed), their return values, gradients (autograd through the oracle), dropout's S_dmask,
flash_attn_with_kvcache over a contiguous cache without appending, the signatures against
flash-attn 2.x's, and what is refused. Varlen and appending: tests/test_flash_attn_varlen.py."""

from __future__ import annotations

import inspect
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import flash_oracle as oracle  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import ferrocupy.flash_attn as fa  # noqa: E402
import ferrocupy.torch as ft  # noqa: E402

TOL = 2e-5  # float32 data, float64 inside the reference: relative to max|x64|


@pytest.fixture
def gen(rng):
    return torch.Generator().manual_seed(int(rng.integers(2**62)))


def _close(name, got, want, tol=TOL):
    got, want = got.detach().double(), want.detach().double()
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    fin = torch.isfinite(want)
    assert torch.equal(got[~fin], want[~fin]), f"{name}: non-finite entries differ"
    err = (got[fin] - want[fin]).abs().max().item() if fin.any() else 0.0
    scale = want[fin].abs().max().item() if fin.any() else 1.0
    assert err <= tol * max(scale, 1.0), f"{name}: max error {err:.3e} (scale {scale:.3e})"


def _qkv(gen, B=2, Sq=6, Sk=5, H=4, Hkv=2, D=8):
    return (torch.randn(B, Sq, H, D, generator=gen), torch.randn(B, Sk, Hkv, D, generator=gen),
            torch.randn(B, Sk, Hkv, D, generator=gen))


def _slopes(gen, kind, B, H):
    if kind is None:
        return None
    return torch.rand((B, H) if kind == "bh" else (H,), generator=gen) * 0.5


def _grads(fn, leaves, go):
    leaves = [x.detach().clone().requires_grad_(True) for x in leaves]
    out = fn(*leaves)
    out = out[0] if isinstance(out, tuple) else out
    out.backward(go)
    return out.detach(), [x.grad for x in leaves]


# (Sq, Sk, H, Hkv, D, options): bottom-right causal with Sq > Sk and Sq < Sk, windows (one of
# them past Sk, which flash-attn treats as unbounded), softcap, ALiBi [H] and [B, H], MQA, scale.
CASES = {
    "causal-sq>sk": (7, 4, 4, 2, 8, dict(causal=True)),
    "causal-sq<sk": (3, 9, 4, 4, 16, dict(causal=True)),
    "window-2-0": (6, 8, 4, 2, 8, dict(window_size=(2, 0))),
    "window-right-only": (5, 5, 2, 1, 8, dict(window_size=(-1, 1))),
    "window-past-sk": (9, 3, 2, 1, 8, dict(window_size=(1, 3))),
    "causal-window-softcap": (6, 6, 4, 2, 8, dict(causal=True, window_size=(3, 2), softcap=1.5)),
    "alibi-h-scale": (5, 7, 4, 2, 8, dict(alibi="h", softmax_scale=0.3)),
    "alibi-bh-causal-mqa": (8, 5, 6, 1, 8, dict(alibi="bh", causal=True)),
    "softcap-negative-is-off": (4, 4, 2, 2, 8, dict(softcap=-1.0)),
}


def _split_options(gen, opts, B, H):
    opts = dict(opts)
    alibi = _slopes(gen, opts.pop("alibi", None), B, H)
    return opts, alibi


def _oracle_of(opts, alibi):
    return dict(causal=opts.get("causal", False), window=opts.get("window_size", (-1, -1)),
                softcap=opts.get("softcap", 0.0), alibi=alibi,
                softmax_scale=opts.get("softmax_scale"))


@pytest.mark.parametrize("case", list(CASES))
def test_func_matches_flash_attn_semantics(gen, case):
    Sq, Sk, H, Hkv, D, opts = CASES[case]
    q, k, v = _qkv(gen, 2, Sq, Sk, H, Hkv, D)
    opts, alibi = _split_options(gen, opts, 2, H)
    out, lse, s_dmask = fa.flash_attn_func(q, k, v, alibi_slopes=alibi, return_attn_probs=True,
                                           **opts)
    want_out, want_lse, want_p = oracle.attention(q, k, v, **_oracle_of(opts, alibi))
    _close("out", out, want_out)
    _close("softmax_lse", lse, want_lse)
    _close("S_dmask", s_dmask, want_p)
    assert out.dtype == q.dtype and lse.dtype == torch.float32 and s_dmask.dtype == q.dtype
    go = torch.randn(out.shape, generator=gen)
    _, got = _grads(lambda *x: fa.flash_attn_func(*x, alibi_slopes=alibi, **opts), (q, k, v), go)
    _, want = _grads(lambda *x: oracle.attention(*x, **_oracle_of(opts, alibi))[0], (q, k, v),
                     go.double())
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        _close(name, g, w)


def test_dead_rows_give_zero_and_flash_attn_lse(gen):
    """Bottom-right causal with Sq > Sk: the first Sq - Sk rows see no key: out 0, lse +inf."""
    q, k, v = _qkv(gen, 1, 5, 2, 2, 2, 8)
    out, lse, s_dmask = fa.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert torch.equal(out[:, :3], torch.zeros_like(out[:, :3]))
    assert torch.isposinf(lse[..., :3]).all() and torch.isfinite(lse[..., 3:]).all()
    assert not s_dmask[:, :, :3].any()
    # and it matches flash-attn's documented mask for seqlen_q = 5, seqlen_k = 2
    seen = s_dmask[0, 0] > 0
    assert seen.tolist() == [[False, False]] * 3 + [[True, False], [True, True]]


def test_return_values(gen):
    q, k, v = _qkv(gen, 2, 3, 5, 4, 2, 8)
    out = fa.flash_attn_func(q, k, v)
    assert isinstance(out, torch.Tensor) and out.shape == q.shape
    res = fa.flash_attn_func(q, k, v, return_attn_probs=True)
    assert isinstance(res, tuple) and len(res) == 3
    assert [tuple(x.shape) for x in res] == [(2, 3, 4, 8), (2, 4, 3), (2, 4, 3, 5)]
    assert not res[1].requires_grad and not res[2].requires_grad


def test_torch_attention_return_lse(gen):
    """The keyword this module builds on: (out, lse) with lse float32 [B, H, Sq] (SPEC's: -inf
    for a dead row), detached; out and its gradient as without it."""
    q, k, v = _qkv(gen, 2, 5, 3, 4, 2, 8)
    go = torch.randn(q.shape, generator=gen)
    kw = dict(causal=True, causal_offset=3 - 5, softcap=3.0)  # bottom-right
    out, lse = ft.attention(q, k, v, return_lse=True, **kw)
    want_lse = oracle.attention(q, k, v, causal=True, softcap=3.0)[1]
    assert lse.dtype == torch.float32 and lse.shape == (2, 4, 5)
    assert torch.isneginf(lse[..., :2]).all()  # rows 0, 1 sit below position 0 (-inf: SPEC's)
    _close("lse", lse[..., 2:], want_lse[..., 2:])
    with_lse, g1 = _grads(lambda *x: ft.attention(*x, return_lse=True, **kw), (q, k, v), go)
    plain, g2 = _grads(lambda *x: ft.attention(*x, **kw), (q, k, v), go)
    assert torch.equal(with_lse, plain) and all(torch.equal(a, b) for a, b in zip(g1, g2))
    leaf = q.clone().requires_grad_(True)
    assert not ft.attention(leaf, k, v, return_lse=True)[1].requires_grad
    # through the custom op (torch.compile): the same values, and lse still takes no gradient
    compiled = torch.compile(lambda *x: ft.attention(*x, return_lse=True, **kw), backend="eager",
                             fullgraph=True)
    c_out, c_lse = compiled(leaf, k, v)
    assert torch.equal(c_out, out) and torch.equal(c_lse, lse) and not c_lse.requires_grad


def test_packed_layouts_match_unpacked(gen):
    B, S, H, D = 2, 5, 4, 8
    qkv = torch.randn(B, S, 3, H, D, generator=gen)
    go = torch.randn(B, S, H, D, generator=gen)
    kw = dict(causal=True, window_size=(2, 1), return_attn_probs=True)
    want = fa.flash_attn_func(*qkv.unbind(2), **kw)
    for got in (fa.flash_attn_qkvpacked_func(qkv, **kw),
                fa.flash_attn_kvpacked_func(qkv[:, :, 0], qkv[:, :, 1:], **kw)):
        for g, w in zip(got, want):
            assert torch.equal(g, w)
    _, (dqkv,) = _grads(lambda x: fa.flash_attn_qkvpacked_func(x, causal=True), (qkv,), go)
    _, (dq, dkv) = _grads(lambda x, y: fa.flash_attn_kvpacked_func(x, y, causal=True),
                          (qkv[:, :, 0], qkv[:, :, 1:]), go)
    _, want_g = _grads(lambda *x: oracle.attention(*x, causal=True)[0], qkv.unbind(2),
                       go.double())
    assert dqkv.shape == qkv.shape and dkv.shape == (B, S, 2, H, D)
    _close("dqkv", dqkv, torch.stack(want_g, dim=2))
    _close("dq", dq, want_g[0])
    _close("dkv", dkv, torch.stack(want_g[1:], dim=2))


def test_kvpacked_gqa(gen):
    q, k, v = _qkv(gen, 2, 4, 6, 6, 2, 8)
    out = fa.flash_attn_kvpacked_func(q, torch.stack((k, v), dim=2), causal=True)
    _close("out", out, oracle.attention(q, k, v, causal=True)[0])


# --- dropout ------------------------------------------------------------------------------------
def test_dropout_s_dmask_is_the_dropout_the_output_used(gen):
    """out == (S_dmask clipped at 0, scaled by 1/(1-p)) @ v; the kept/dropped signs, given to the
    oracle as its keep mask, reproduce out and every gradient; about p of the entries drop."""
    p = 0.3
    q, k, v = _qkv(gen, 2, 16, 24, 4, 2, 8)
    seed = int(torch.randint(2**62, (), generator=gen))
    torch.manual_seed(seed)
    out, lse, s_dmask = fa.flash_attn_func(q, k, v, dropout_p=p, causal=True,
                                           return_attn_probs=True)
    keep = ~torch.signbit(s_dmask)
    scale = float(np.float32(1) / (np.float32(1) - np.float32(p)))
    rebuilt = torch.einsum("bhij,bjhd->bihd", s_dmask.clamp(min=0).double() * scale,
                           v.double().repeat_interleave(2, dim=2))
    _close("out vs S_dmask @ v", out, rebuilt)
    want_out, want_lse, want_p = oracle.attention(q, k, v, causal=True, keep=keep, dropout_p=p)
    _close("out", out, want_out)
    _close("lse", lse, want_lse)
    _close("|S_dmask|", s_dmask.abs(), want_p)
    vis, _ = oracle.visible(16, 24, True)
    dropped = (~keep)[:, :, vis].float().mean().item()
    assert abs(dropped - p) < 0.08, dropped
    go = torch.randn(out.shape, generator=gen)
    torch.manual_seed(seed)
    _, got = _grads(lambda *x: fa.flash_attn_func(*x, dropout_p=p, causal=True), (q, k, v), go)
    _, want = _grads(lambda *x: oracle.attention(*x, causal=True, keep=keep, dropout_p=p)[0],
                     (q, k, v), go.double())
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        _close(name, g, w)


def test_dropout_is_seeded_from_torch_generator(gen):
    q, k, v = _qkv(gen, 1, 8, 8, 2, 2, 8)
    torch.manual_seed(7)
    a = fa.flash_attn_func(q, k, v, dropout_p=0.5)
    torch.manual_seed(7)
    b = fa.flash_attn_func(q, k, v, dropout_p=0.5)
    c = fa.flash_attn_func(q, k, v, dropout_p=0.5)
    torch.manual_seed(7)
    d = ft.attention(q, k, v, dropout_p=0.5)  # the same draw as ferrocupy.torch's seed=None
    assert torch.equal(a, b) and not torch.equal(b, c) and torch.equal(a, d)


def test_no_dropout_leaves_torch_rng_alone(gen):
    q, k, v = _qkv(gen)
    torch.manual_seed(3)
    fa.flash_attn_func(q, k, v, return_attn_probs=True, deterministic=True)
    after = torch.rand(())
    torch.manual_seed(3)
    assert torch.equal(after, torch.rand(()))


# --- flash_attn_with_kvcache over a contiguous cache (no appending) -----------------------------
KV_CASES = {
    "decode-causal": (1, dict(causal=True)),
    "prefill-causal-window": (3, dict(causal=True, window_size=(2, 0))),
    "alibi-softcap": (2, dict(alibi="bh", softcap=2.0)),
    "plain-mqa": (4, dict()),
}


@pytest.mark.parametrize("case", list(KV_CASES))
@pytest.mark.parametrize("lens_kind", ["tensor", "int", "none"])
def test_kvcache_matches_flash_attn_semantics(gen, case, lens_kind):
    sq, opts = KV_CASES[case]
    B, cap, H, Hkv, D = 3, 10, 4, (1 if case == "plain-mqa" else 2), 8
    q = torch.randn(B, sq, H, D, generator=gen).requires_grad_(True)
    k_cache = torch.randn(B, cap, Hkv, D, generator=gen)
    v_cache = torch.randn(B, cap, Hkv, D, generator=gen)
    lens = {"tensor": torch.tensor([4, 10, 7], dtype=torch.int32), "int": 6, "none": None}[
        lens_kind]
    filled = lens if isinstance(lens, torch.Tensor) else [cap if lens is None else lens] * B
    for b in range(B):  # slots past each length hold garbage the call must never read
        k_cache[b, int(filled[b]):] = math.nan
        v_cache[b, int(filled[b]):] = math.nan
    opts, alibi = _split_options(gen, opts, B, H)
    out, lse = fa.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens,
                                          alibi_slopes=alibi, return_softmax_lse=True, **opts)
    want_out, want_lse = oracle.kvcache(q.detach(), k_cache, v_cache, filled,
                                        **_oracle_of(opts, alibi))
    _close("out", out, want_out)
    _close("softmax_lse", lse, want_lse)
    assert not out.requires_grad  # flash-attn's KV-cache call has no backward
    plain = fa.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens,
                                       alibi_slopes=alibi, num_splits=3, **opts)
    assert torch.equal(plain, out)


@pytest.mark.parametrize("causal, sides, want", [
    (True, (3, 0), {"window": 4}), (True, (3, 7), {"window": 4}), (True, (-1, 2), {}),
    (False, (2, 2), {"window": 3}), (False, (2, 1), {"window_left": 2, "window_right": 1}),
    (False, (-1, -1), {})])
def test_windows_take_the_symmetric_form_where_it_is_the_same(causal, sides, want):
    """Mistral's causal sliding window (left, 0) is ferrocupy's symmetric `window`, which every
    kernel path takes (the asymmetric sides are not on all of them)."""
    assert fa._window_keywords(causal, *sides) == want


def test_kvcache_window_is_normalized_by_the_cache_capacity(gen):
    """A window side of at least the capacity is unbounded (flash-attn's rule), even where the
    literal bound would hide keys: 6 queries over 1 of 4 keys sit at -5 .. 0, window (-1, 4)."""
    q = torch.randn(1, 6, 2, 8, generator=gen)
    kc, vc = torch.randn(1, 4, 2, 8, generator=gen), torch.randn(1, 4, 2, 8, generator=gen)
    lens = torch.tensor([1], dtype=torch.int32)
    got = fa.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, window_size=(-1, 4))
    _close("out", got, oracle.kvcache(q, kc, vc, lens)[0])
    literal = oracle.attention(q, kc[:, :1], vc[:, :1], window=(-1, 4), seqlen_k=99)[0]
    assert not torch.allclose(got.double(), literal)  # the rule matters here


# --- signatures and refusals ---------------------------------------------------------------------
FLASH_ATTN_2_SIGNATURES = {  # flash-attn 2.x's flash_attn_interface, argument names and defaults
    "flash_attn_func": "q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, "
                       "window_size=(-1, -1), softcap=0.0, alibi_slopes=None, "
                       "deterministic=False, return_attn_probs=False",
    "flash_attn_qkvpacked_func": "qkv, dropout_p=0.0, softmax_scale=None, causal=False, "
                                 "window_size=(-1, -1), softcap=0.0, alibi_slopes=None, "
                                 "deterministic=False, return_attn_probs=False",
    "flash_attn_kvpacked_func": "q, kv, dropout_p=0.0, softmax_scale=None, causal=False, "
                                "window_size=(-1, -1), softcap=0.0, alibi_slopes=None, "
                                "deterministic=False, return_attn_probs=False",
    "flash_attn_varlen_func": "q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, "
                              "dropout_p=0.0, softmax_scale=None, causal=False, "
                              "window_size=(-1, -1), softcap=0.0, alibi_slopes=None, "
                              "deterministic=False, return_attn_probs=False, block_table=None",
    "flash_attn_varlen_qkvpacked_func": "qkv, cu_seqlens, max_seqlen, dropout_p=0.0, "
                                        "softmax_scale=None, causal=False, window_size=(-1, -1), "
                                        "softcap=0.0, alibi_slopes=None, deterministic=False, "
                                        "return_attn_probs=False",
    "flash_attn_varlen_kvpacked_func": "q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, "
                                       "max_seqlen_k, dropout_p=0.0, softmax_scale=None, "
                                       "causal=False, window_size=(-1, -1), softcap=0.0, "
                                       "alibi_slopes=None, deterministic=False, "
                                       "return_attn_probs=False",
    "flash_attn_with_kvcache": "q, k_cache, v_cache, k=None, v=None, rotary_cos=None, "
                               "rotary_sin=None, cache_seqlens=None, cache_batch_idx=None, "
                               "cache_leftpad=None, block_table=None, softmax_scale=None, "
                               "causal=False, window_size=(-1, -1), softcap=0.0, "
                               "rotary_interleaved=True, alibi_slopes=None, num_splits=0, "
                               "return_softmax_lse=False",
}


@pytest.mark.parametrize("name", list(FLASH_ATTN_2_SIGNATURES))
def test_signature_is_flash_attn_2(name):
    params = inspect.signature(getattr(fa, name)).parameters.values()
    got = ", ".join(p.name if p.default is inspect.Parameter.empty else f"{p.name}={p.default!r}"
                    for p in params)
    assert got == FLASH_ATTN_2_SIGNATURES[name]
    assert all(p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for p in params)


def test_all_lists_the_seven_functions():
    assert sorted(fa.__all__) == sorted(FLASH_ATTN_2_SIGNATURES)


def test_kvcache_append_needs_the_new_interface(gen, monkeypatch):
    """Appending (and paging, rotary) runs on ferrocupy.torch.attention_with_kvcache; without it
    the call is refused by name, before anything is written."""
    monkeypatch.delattr(ft, "attention_with_kvcache", raising=False)
    q, kc, vc = _qkv(gen, 2, 1, 6, 2, 2, 8)
    before = kc.clone()
    kn, vn = torch.randn(2, 1, 2, 8, generator=gen), torch.randn(2, 1, 2, 8, generator=gen)
    with pytest.raises(NotImplementedError, match="k/v to append"):
        fa.flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=3)
    with pytest.raises(NotImplementedError, match="block_table"):
        fa.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=3,
                                   block_table=torch.zeros(2, 1, dtype=torch.int32))
    assert torch.equal(kc, before)


def test_varlen_needs_the_new_interface(gen, monkeypatch):
    monkeypatch.setattr(ft, "attention", lambda q, k, v, **kw: None)  # no varlen keywords
    q = torch.randn(5, 2, 8, generator=gen)
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    for call in (lambda: fa.flash_attn_varlen_func(q, q, q, cu, cu, 3, 3),
                 lambda: fa.flash_attn_varlen_qkvpacked_func(torch.stack((q, q, q), 1), cu, 3),
                 lambda: fa.flash_attn_varlen_kvpacked_func(q, torch.stack((q, q), 1), cu, cu,
                                                            3, 3)):
        with pytest.raises(NotImplementedError, match="varlen"):
            call()


@pytest.mark.parametrize("call, match", [
    (lambda q: fa.flash_attn_func(q, q, q, window_size=(1, 2, 3)), "window_size"),
    (lambda q: fa.flash_attn_func(q[0], q[0], q[0]), r"q must be \[B, Sq, H, D\].*\(4, 2, 8\)"),
    (lambda q: fa.flash_attn_qkvpacked_func(torch.stack((q, q), 2)), r"qkv .*\(1, 4, 2, 2, 8\)"),
    (lambda q: fa.flash_attn_kvpacked_func(q, q), r"kv must be"),
    (lambda q: fa.flash_attn_with_kvcache(q, q, q, k=q), "both k and v"),
    (lambda q: fa.flash_attn_with_kvcache(q, q, q, rotary_cos=q), "rotary_sin"),
    (lambda q: fa.flash_attn_with_kvcache(q, q, q, rotary_cos=q, rotary_sin=q), "need k and v"),
])
def test_bad_arguments_are_named(call, match):
    q = torch.randn(1, 4, 2, 8)
    with pytest.raises(ValueError, match=match):
        call(q)


def test_engine_errors_pass_through(gen):
    q, k, v = _qkv(gen, 2, 4, 4, 3, 2, 8)  # 3 query heads over 2 KV heads
    with pytest.raises(ValueError):
        fa.flash_attn_func(q, k, v)


# --- randomized ---------------------------------------------------------------------------------
@st.composite
def _problems(draw):
    hkv = draw(st.integers(1, 2))
    return dict(B=draw(st.integers(1, 2)), Sq=draw(st.integers(1, 9)), Sk=draw(st.integers(1, 9)),
                Hkv=hkv, H=hkv * draw(st.integers(1, 3)), D=draw(st.sampled_from([4, 8, 16])),
                causal=draw(st.booleans()),
                window=(draw(st.integers(-2, 10)), draw(st.integers(-2, 10))),
                softcap=draw(st.sampled_from([0.0, 0.0, 1.0, 4.0])),
                alibi=draw(st.sampled_from([None, "h", "bh"])),
                scale=draw(st.sampled_from([None, 0.2])),
                layout=draw(st.sampled_from(["func", "kvpacked", "qkvpacked"])),
                seed=draw(st.integers(0, 2**31)))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_problems())
def test_randomized_against_the_oracle(pr):
    gen = torch.Generator().manual_seed(pr["seed"])
    if pr["layout"] == "qkvpacked":
        pr.update(Sk=pr["Sq"], Hkv=pr["H"])
    q, k, v = _qkv(gen, pr["B"], pr["Sq"], pr["Sk"], pr["H"], pr["Hkv"], pr["D"])
    alibi = _slopes(gen, pr["alibi"], pr["B"], pr["H"])
    kw = dict(causal=pr["causal"], window_size=pr["window"], softcap=pr["softcap"],
              alibi_slopes=alibi, softmax_scale=pr["scale"], return_attn_probs=True)
    call = {"func": lambda *x: fa.flash_attn_func(*x, **kw),
            "kvpacked": lambda a, b, c: fa.flash_attn_kvpacked_func(a, torch.stack((b, c), 2),
                                                                    **kw),
            "qkvpacked": lambda a, b, c: fa.flash_attn_qkvpacked_func(torch.stack((a, b, c), 2),
                                                                      **kw)}[pr["layout"]]
    out, lse, s_dmask = call(q, k, v)
    want = oracle.attention(q, k, v, causal=pr["causal"], window=pr["window"],
                            softcap=pr["softcap"], alibi=alibi, softmax_scale=pr["scale"])
    for name, g, w in zip(("out", "lse", "S_dmask"), (out, lse, s_dmask), want):
        _close(name, g, w)
    go = torch.randn(out.shape, generator=gen)
    _, got = _grads(lambda *x: call(*x)[0], (q, k, v), go)
    _, want_g = _grads(lambda *x: oracle.attention(
        *x, causal=pr["causal"], window=pr["window"], softcap=pr["softcap"], alibi=alibi,
        softmax_scale=pr["scale"])[0], (q, k, v), go.double())
    for name, g, w in zip(("dq", "dk", "dv"), got, want_g):
        _close(name, g, w)
