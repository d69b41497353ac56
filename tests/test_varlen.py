"""SPEC part 2's packed variable-length batches (varlen) on the reference backend: forward and
backward against a per-sequence loop of the independent dense float64 oracle
(tests/dense_options.py, autograd for the gradients), every option applied per sequence;
hypothesis over random splits; bad cu_seqlens values and shapes refused by name with nothing
written; the CUDA backend's plans (tests/test_cuda_varlen.py runs the kernels)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dense_options import dense, dense_grads, per_head_inputs
from ferrocupy import AttentionOptions, ComputeEngine
from ferrocupy import reference as ref
from ferrocupy.params import FLASH_V2_PARAMS
from helpers import poison
from test_model_options import _CudaRecorder, _close, check_grads

torch = pytest.importorskip("torch")


def _eng():
    return ComputeEngine("reference", quiet=True)


def packed(rng, lens_q, lens_k, h, hkv, d, *, alibi=None, sinks=False):
    """Packed q [total_q, h, d], k, v [total_k, hkv, d], cu_seqlens and the optional tensors."""
    tq, tk = sum(lens_q), sum(lens_k)
    t = dict(q=rng.standard_normal((tq, h, d), dtype=np.float32),
             k=rng.standard_normal((tk, hkv, d), dtype=np.float32),
             v=rng.standard_normal((tk, hkv, d), dtype=np.float32),
             cu_seqlens_q=np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32),
             cu_seqlens_k=np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32))
    return t | per_head_inputs(rng, len(lens_q), h, alibi=alibi, sinks=sinks)


def _oracle_args(t, opts, max_q, max_k, n):
    """Sequence n's dense call: its slices and options (row offset right-aligned in the
    [max_q, max_k] frame; dropout's batch index n; its ALiBi row)."""
    cq, ck = t["cu_seqlens_q"], t["cu_seqlens_k"]
    rq, rk = slice(int(cq[n]), int(cq[n + 1])), slice(int(ck[n]), int(ck[n + 1]))
    sq, sk = rq.stop - rq.start, rk.stop - rk.start
    left, right = opts.windows()
    slopes = t.get("alibi_slopes")
    if slopes is not None and slopes.ndim == 2:
        slopes = slopes[n]
    keep = None
    if opts.dropout_prob:
        p = np.zeros((), FLASH_V2_PARAMS)
        p["heads"], p["seed"], p["dropout_prob"] = t["q"].shape[1], opts.seed & 0xFFFFFFFF, \
            opts.dropout_prob
        keep = np.array([ref.dropout_keep(p, n, h, range(sq), range(sk))
                         for h in range(t["q"].shape[1])])[None]
    kw = dict(causal=opts.causal, causal_offset=opts.causal_offset + (sk - max_k) - (sq - max_q),
              window_left=left, window_right=right, softcap=float(np.float32(opts.softcap)),
              scale=None if opts.scale is None else float(np.float32(opts.scale)),
              alibi_slopes=slopes, keep=keep, dropout_prob=opts.dropout_prob)
    return rq, rk, kw


def oracle_forward(t, opts, max_q, max_k):
    """(out [total_q, H, D], lse [H, total_q]) by a loop of dense calls, one per sequence."""
    q, k, v = t["q"], t["k"], t["v"]
    out = np.zeros(q.shape)
    lse = np.zeros((q.shape[1], q.shape[0]))
    for n in range(len(t["cu_seqlens_q"]) - 1):
        rq, rk, kw = _oracle_args(t, opts, max_q, max_k, n)
        o, s = dense(q[None, rq], k[None, rk], v[None, rk], sinks=t.get("sinks"), **kw)
        out[rq], lse[:, rq] = o[0].numpy(), s[0].numpy()
    return out, lse


def oracle_grads(t, opts, max_q, max_k, go):
    gq, gk, gv = np.zeros(t["q"].shape), np.zeros(t["k"].shape), np.zeros(t["v"].shape)
    gs = None if t.get("sinks") is None else np.zeros(t["sinks"].shape)
    for n in range(len(t["cu_seqlens_q"]) - 1):
        rq, rk, kw = _oracle_args(t, opts, max_q, max_k, n)
        g = dense_grads(t["q"][None, rq], t["k"][None, rk], t["v"][None, rk], go[None, rq],
                        sinks=t.get("sinks"), **kw)
        gq[rq], gk[rk], gv[rk] = g[0][0], g[1][0], g[2][0]
        if gs is not None:
            gs += g[3]
    return gq, gk, gv, gs


def _named(t, max_q, max_k):
    return dict(cu_seqlens_q=t["cu_seqlens_q"], cu_seqlens_k=t["cu_seqlens_k"],
                max_seqlen_q=max_q, max_seqlen_k=max_k, alibi_slopes=t.get("alibi_slopes"),
                sinks=t.get("sinks"))


def forward(eng, t, opts, max_q, max_k):
    out = poison(np.empty_like(t["q"]))
    lse = poison(np.empty((t["q"].shape[1], t["q"].shape[0]), np.float32))
    eng.flash_attention_v2_with(t["q"], t["k"], t["v"], out, opts, lse=lse,
                                **_named(t, max_q, max_k))
    return out, lse


def backward(eng, t, opts, max_q, max_k, out, go, lse=None):
    gq, gk, gv = (poison(np.empty_like(t[n])) for n in ("q", "k", "v"))
    gs = None if t.get("sinks") is None else poison(np.empty_like(t["sinks"]))
    eng.flash_attention_v2_backward_with(t["q"], t["k"], t["v"], out, go, gq, gk, gv, opts,
                                         lse=lse, grad_sinks=gs, **_named(t, max_q, max_k))
    return gq, gk, gv, gs


def check(t, opts, max_q=None, max_k=None, *, lse_given=False, rng=None):
    lens_q, lens_k = np.diff(t["cu_seqlens_q"]), np.diff(t["cu_seqlens_k"])
    max_q = int(lens_q.max(initial=0)) if max_q is None else max_q
    max_k = int(lens_k.max(initial=0)) if max_k is None else max_k
    eng = _eng()
    out, lse = forward(eng, t, opts, max_q, max_k)
    want_out, want_lse = oracle_forward(t, opts, max_q, max_k)
    _close(out, want_out, what="out")
    _close(lse, want_lse, what="lse")
    rng = rng or np.random.default_rng(0)
    go = rng.standard_normal(t["q"].shape).astype(np.float32)
    got = backward(eng, t, opts, max_q, max_k, out, go, lse if lse_given else None)
    check_grads(got, oracle_grads(t, opts, max_q, max_k, go))


# --- named cases ---------------------------------------------------------------------------------
CASES = {
    "plain": (dict(), {}),
    "causal-self": (dict(causal=True), {}),
    "bottom-right": (dict(causal=True, causal_offset="br"), {}),
    "top-left-negative": (dict(causal=True, causal_offset=-2), {}),
    "windows": (dict(window_left=2, window_right=1), {}),
    "softcap-alibi-h": (dict(causal=True, softcap=1.5), dict(alibi="h")),
    "alibi-per-sequence": (dict(causal=True, causal_offset="br"), dict(alibi="bh")),
    "sinks": (dict(causal=True), dict(sinks=True)),
    "dropout": (dict(dropout_prob=0.3, seed=11), {}),
    "everything": (dict(causal=True, causal_offset="br", window_left=3, window_right=1,
                        softcap=2.0, dropout_prob=0.25, seed=2**40 + 5),
                   dict(alibi="bh", sinks=True)),
}
LENS = ([3, 0, 5, 1], [4, 2, 5, 3])  # an empty query sequence, Sq > Sk and Sq < Sk


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("lse_given", [False, True])
def test_options_per_sequence_against_the_dense_oracle(rng, name, lse_given):
    o, tensors = CASES[name]
    lens_q, lens_k = LENS if name != "causal-self" else (LENS[0], LENS[0])
    t = packed(rng, lens_q, lens_k, 4, 2, 8, **tensors)
    max_q, max_k = max(lens_q), max(lens_k)
    if o.get("causal_offset") == "br":
        o = o | dict(causal_offset=max_k - max_q)
    check(t, AttentionOptions(**o), max_q, max_k, lse_given=lse_given, rng=rng)


def test_bottom_right_is_per_sequence(rng):
    """causal_offset = max_seqlen_k - max_seqlen_q puts every sequence's last row on its last
    key, also with max_seqlen larger than any sequence: the last row of each sequence sees
    all its keys, its first row Sk_n - Sq_n + 1 of them."""
    t = packed(rng, [2, 5, 3], [6, 5, 9], 2, 2, 8)
    eng = _eng()
    max_q, max_k = 7, 12  # larger than needed: allowed, and the alignment is unchanged
    opts = AttentionOptions(causal=True, causal_offset=max_k - max_q)
    out, lse = forward(eng, t, opts, max_q, max_k)
    want_out, want_lse = oracle_forward(t, opts, max_q, max_k)
    _close(out, want_out, what="out")
    for n, (sq, sk) in enumerate(zip([2, 5, 3], [6, 5, 9])):
        r0, k0 = int(t["cu_seqlens_q"][n]), int(t["cu_seqlens_k"][n])
        for i in (0, sq - 1):
            _, s = dense(t["q"][None, r0 + i:r0 + i + 1], t["k"][None, k0:k0 + sk - sq + i + 1],
                         t["v"][None, k0:k0 + sk - sq + i + 1])
            np.testing.assert_allclose(lse[:, r0 + i], s[0, :, 0].numpy(), rtol=1e-5)


def test_one_sequence_is_the_dense_call(rng):
    """A varlen call of one sequence equals the dense call on the same rows, every option on."""
    t = packed(rng, [6], [9], 4, 2, 8, alibi="bh", sinks=True)
    opts = AttentionOptions(causal=True, causal_offset=1, window_left=4, softcap=3.0,
                            dropout_prob=0.2, seed=5)
    eng = _eng()
    out, lse = forward(eng, t, opts, 6, 9)
    dense_out = np.empty((1,) + t["q"].shape, np.float32)
    dense_lse = np.empty((1, 4, 6), np.float32)
    eng.flash_attention_v2_with(t["q"][None], t["k"][None], t["v"][None], dense_out, opts,
                                lse=dense_lse, alibi_slopes=t["alibi_slopes"], sinks=t["sinks"])
    np.testing.assert_array_equal(out, dense_out[0])
    np.testing.assert_array_equal(lse, dense_lse[0])


def test_strided_packed_views(rng):
    """q, k, v as views of packed QKV rows (a contiguous last dimension, other strides free)."""
    lens = [3, 4]
    qkv = rng.standard_normal((7, 3, 2, 8), dtype=np.float32)
    t = packed(rng, lens, lens, 2, 2, 8)
    t["q"], t["k"], t["v"] = qkv[:, 0], qkv[:, 1], qkv[:, 2]
    check(t, AttentionOptions(causal=True), rng=rng)


# --- hypothesis over random splits and options --------------------------------------------------
@st.composite
def varlen_calls(draw):
    n = draw(st.integers(1, 4))
    lens_q = draw(st.lists(st.integers(0, 6), min_size=n, max_size=n))
    self_attention = draw(st.booleans())
    lens_k = lens_q if self_attention else draw(st.lists(st.integers(0, 6), min_size=n,
                                                         max_size=n))
    extra_q, extra_k = draw(st.integers(0, 2)), draw(st.integers(0, 2))
    hkv = draw(st.sampled_from([1, 2]))
    h, d = hkv * draw(st.sampled_from([1, 2])), draw(st.sampled_from([4, 8]))
    o = dict(causal=draw(st.booleans()), causal_offset=draw(st.integers(-4, 4)))
    if draw(st.booleans()):
        o["window_left"] = draw(st.sampled_from([None, 0, 2]))
        o["window_right"] = draw(st.sampled_from([None, -1, 1]))
    o["softcap"] = draw(st.sampled_from([0.0, 2.0]))
    if draw(st.booleans()):
        o.update(dropout_prob=0.3, seed=draw(st.integers(0, 2**40)))
    tensors = dict(alibi=draw(st.sampled_from([None, "h", "bh"])), sinks=draw(st.booleans()))
    return (lens_q, lens_k, extra_q, extra_k, h, hkv, d, o, tensors, draw(st.booleans()),
            draw(st.integers(0, 2**32 - 1)))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(varlen_calls())
def test_random_splits(call):
    lens_q, lens_k, extra_q, extra_k, h, hkv, d, o, tensors, lse_given, seed = call
    rng = np.random.default_rng(seed)
    t = packed(rng, lens_q, lens_k, h, hkv, d, **tensors)
    check(t, AttentionOptions(**o), max(lens_q) + extra_q, max(lens_k) + extra_k,
          lse_given=lse_given, rng=rng)


# --- plans ---------------------------------------------------------------------------------------
def test_plans_are_kept_by_max_seqlen_too(rng):
    t = packed(rng, [2, 3], [2, 3], 2, 1, 8)
    eng = _eng()
    out = np.empty_like(t["q"])
    args = (t["q"], t["k"], t["v"], out, AttentionOptions(causal=True))
    cu = dict(cu_seqlens_q=t["cu_seqlens_q"], cu_seqlens_k=t["cu_seqlens_k"])
    plan = eng.plan_attention(*args, **cu, max_seqlen_q=3, max_seqlen_k=3)
    assert eng.plan_attention(*args, **cu, max_seqlen_q=3, max_seqlen_k=3) is plan
    other = eng.plan_attention(*args, **cu, max_seqlen_q=4, max_seqlen_k=3)
    assert other is not plan and int(other.params["seq_q"]) == 4
    assert int(plan.params["batch"]) == 2 and int(plan.extras["flags"]) == 8
    with pytest.raises(TypeError, match="max_seqlen_q must be an int, got True"):
        eng.plan_attention(*args, **cu, max_seqlen_q=True, max_seqlen_k=3)


# --- bad inputs ----------------------------------------------------------------------------------
def _bad_calls(rng):
    t = packed(rng, [2, 3], [4, 1], 4, 2, 8)
    i32 = lambda *x: np.array(x, np.int32)  # noqa: E731
    return t, [
        (dict(cu_seqlens_q=i32(1, 2, 5)), ValueError, r"cu_seqlens_q\[0\] = 1 must be 0"),
        (dict(cu_seqlens_k=i32(0, 4, 4)), ValueError,
         r"cu_seqlens_k\[-1\] = 4 must equal the packed tensor's rows \(5\)"),
        (dict(cu_seqlens_q=i32(0, 6, 5), max_seqlen_q=7), ValueError,
         r"cu_seqlens_q\[2\] - cu_seqlens_q\[1\] = 5 - 6 = -1: sequence 1's length decreases"),
        (dict(max_seqlen_k=3), ValueError,
         r"cu_seqlens_k\[1\] - cu_seqlens_k\[0\] = 4 - 0 = 4: sequence 0's length exceeds "
         r"max_seqlen_k = 3"),
        (dict(cu_seqlens_q=i32(0, 5)), ValueError,
         r"cu_seqlens_q shape \(2,\) and cu_seqlens_k shape \(3,\) must be equal"),
        (dict(cu_seqlens_q=np.array([0, 2, 5], np.int64)), TypeError,
         r"cu_seqlens_q has dtype int64 \(shape \(3,\)\); it must be int32"),
        (dict(cu_seqlens_k=None), ValueError,
         r"varlen needs cu_seqlens_q and cu_seqlens_k: cu_seqlens_q \(shape \(3,\)\) is given "
         r"without cu_seqlens_k"),
        (dict(max_seqlen_q=None), TypeError, r"max_seqlen_q is required with cu_seqlens"),
        (dict(max_seqlen_k=-1), ValueError, r"max_seqlen_k must be in \[0, 2\*\*31\), got -1"),
        (dict(mask=np.zeros((1, 1, 3, 4), np.float32)), ValueError,
         r"mask \(shape \(1, 1, 3, 4\)\) cannot be combined with cu_seqlens_q/cu_seqlens_k"),
        (dict(kv_lens=i32(1, 1)), ValueError, r"kv_lens \(shape \(2,\)\) cannot be combined"),
        (dict(q=t["q"][None]), ValueError,
         r"with cu_seqlens, q must be \[total_q, heads, head_dim\], got shape \(1, 5, 4, 8\)"),
        (dict(lse=np.zeros((2, 4, 3), np.float32)), ValueError,
         r"lse shape \(2, 4, 3\) must be \[heads, total_q\] = \[4, 5\]"),
        (dict(alibi_slopes=np.ones((3, 4), np.float32)), ValueError,
         r"alibi_slopes shape \(3, 4\) must be \[heads\] = \[4\] or \[batch, heads\] = \[2, 4\]"),
    ]


def test_bad_inputs_raise_naming_the_argument_and_write_nothing(rng):
    t, cases = _bad_calls(rng)
    eng = _eng()
    for change, err, match in cases:
        args = dict(cu_seqlens_q=t["cu_seqlens_q"], cu_seqlens_k=t["cu_seqlens_k"],
                    max_seqlen_q=3, max_seqlen_k=4, lse=np.zeros((4, 5), np.float32)) | change
        q = args.pop("q", t["q"])
        out = np.zeros(q.shape, np.float32)
        mask = args.pop("mask", None)
        with pytest.raises(err, match=match):
            eng.flash_attention_v2_with(q, t["k"], t["v"], out, AttentionOptions(), mask, **args)
        assert not out.any() and not args["lse"].any()
        if "kv_lens" in args:
            continue  # the backward refuses kv_lens on its own
        grads = [np.zeros(x.shape, np.float32) for x in (q, t["k"], t["v"])]
        with pytest.raises(err, match=match):
            eng.flash_attention_v2_backward_with(q, t["k"], t["v"], out, out, *grads,
                                                 AttentionOptions(), mask, **args)
        assert not any(g.any() for g in grads)


def test_overlapping_outputs_are_refused(rng):
    t = packed(rng, [2, 3], [4, 1], 2, 2, 8)
    eng = _eng()
    cu = dict(cu_seqlens_q=t["cu_seqlens_q"], cu_seqlens_k=t["cu_seqlens_k"], max_seqlen_q=3,
              max_seqlen_k=4)
    with pytest.raises(ValueError, match=r"out \(shape \(5, 2, 8\)\) shares memory with q"):
        eng.flash_attention_v2_with(t["q"], t["k"], t["v"], t["q"], **cu)
    lse = np.zeros((2, 5), np.float32)
    with pytest.raises(ValueError, match=r"lse \(shape \(2, 5\)\) shares memory with "
                                         r"cu_seqlens_q"):
        eng.flash_attention_v2_with(t["q"], t["k"], t["v"], np.zeros_like(t["q"]),
                                    lse=lse, **cu | dict(cu_seqlens_q=lse.reshape(-1)[:3].view(
                                        np.int32)))
    assert not lse.any()


# --- CUDA: both plans are made (tests/test_cuda_varlen.py runs them) ---------------------------
def test_cuda_backend_plans_varlen_forward_and_backward(rng):
    eng = _eng()
    eng.backend = rec = _CudaRecorder()
    t = packed(rng, [2, 3], [4, 1], 2, 2, 8, sinks=True)
    cu = dict(cu_seqlens_q=t["cu_seqlens_q"], cu_seqlens_k=t["cu_seqlens_k"], max_seqlen_q=3,
              max_seqlen_k=4)
    out = np.zeros_like(t["q"])
    eng.plan_attention(t["q"], t["k"], t["v"], out, sinks=t["sinks"], **cu)
    grads = [np.zeros_like(t[n]) for n in ("q", "k", "v")]
    eng.plan_attention_backward(t["q"], t["k"], t["v"], out, out, *grads, sinks=t["sinks"],
                                grad_sinks=np.zeros_like(t["sinks"]), **cu)
    assert rec.plans == []  # (a plan's launches are made at its first run)
