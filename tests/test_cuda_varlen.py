"""Packed variable-length batches (varlen, SPEC "Beyond the seed, part 2", issue 26) on the CUDA
kernels: the forward and the backward (dQ, dK/dV, grad_sinks; the forward's lse given or not)
on every kernel path (`kernels`: the engine's own choice, the sm_90a wgmma
kernels in half precision at every head_dim up to 128 on an H100/H200 (without the lse, the
varlen forward first for it), and the mma.sync kernels alone;
`decoders`: each decode design, for calls of few query rows a KV group; the fused backward on
sm_90a),
one launch per kernel for the whole packed batch, against a per-sequence loop of the independent dense
float64 oracle (tests/dense_options.py through tests/test_varlen.py's oracle: each sequence
right-aligned in the [max_seqlen_q, max_seqlen_k] frame, dropout's batch index its number, its
ALiBi row). Sequences of length 0 and 1, longer than a tile, GQA, and causal / windows /
softcap / ALiBi / sinks / dropout inside each sequence; hypothesis over random packings.

float32 within 2e-5 (check_f32's FWD_TOL) of the oracle's largest magnitude; float16 / bfloat16 by SPEC's half
rule (at most twice the error of the same per-sequence formula as plain PyTorch ops in that
dtype, against ferrocupy's float64 reference on the same rounded inputs, the gradients also
allowed what rounding the stored out alone moves them by). Every output is
NaN-poisoned before the call, so a row or lse entry left unwritten fails.

Skipped unless `ferrocupy.cuda_available()`; `FERRO_GPU_TESTS_ON_REFERENCE=1` runs it with the
reference standing in for the device (see tests/gpu_helpers.py)."""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ferrocupy.reference as reference
from ferrocupy import AttentionOptions
from ferrocupy.dtypes import BFLOAT16, FLOAT16, FLOAT32
from ferrocupy.params import AttentionDims, extras_params
from gpu_helpers import (axis, count_launches, covering, decoders, dev,  # noqa: F401
                         gpu_pytestmark, kernels)

torch = pytest.importorskip("torch", reason="the dense oracle is written in PyTorch")
from dense_options import dense, dense_grads, uncancelled  # noqa: E402
from test_cuda_model_options import check_f32, half_rule  # noqa: E402
from test_varlen import CASES, _oracle_args, packed  # noqa: E402
from test_cuda_wgmma_dims import ON_SM90, launched  # noqa: E402, F401
from test_cuda_wgmma_dims import _on_hopper as on_hopper  # noqa: E402

pytestmark = gpu_pytestmark()

HALF = [pytest.param(FLOAT16, id="f16"), pytest.param(BFLOAT16, id="bf16")]
TORCH_DTYPE = {FLOAT16: torch.float16, BFLOAT16: torch.bfloat16}
# Lengths that cross the kernels' tiles (64 / 128 / 192 rows, 32-128 keys), with empty and
# one-row sequences among them.
LENS_Q = [130, 0, 1, 77, 200, 5]
LENS_K = [150, 40, 0, 77, 260, 1]


def make(rng, name: str, lens_q, lens_k, *, h=4, hkv=2, d=64, max_extra=(0, 0)) -> dict:
    """A call from test_varlen's CASES entry: host float32 tensors, options, the frame."""
    fields, named = CASES[name]
    t = packed(rng, lens_q, lens_k, h, hkv, d, **named)
    for n in ("q", "k"):
        t[n] *= np.float32(1.3)
    t["go"] = rng.standard_normal(t["q"].shape, dtype=np.float32)
    max_q = max(lens_q) + max_extra[0]
    max_k = max(lens_k) + max_extra[1]
    fields = dict(fields)
    if fields.get("causal_offset") == "br":
        fields["causal_offset"] = max_k - max_q
    return t | dict(opts=AttentionOptions(**fields), max_q=max_q, max_k=max_k)


def rounded(t: dict, dtype) -> dict:
    return t | {n: t[n].astype(dtype) for n in ("q", "k", "v", "go")}


def run(d, t: dict, *, backward=False, give_lse=True) -> dict:
    """The forward (with lse) and, with `backward`, the backward given the device's own out
    (grad_sinks with sinks), every output NaN-poisoned first; host float64 arrays."""
    put = {n: d.put(t.get(n)) for n in ("q", "k", "v", "go", "cu_seqlens_q", "cu_seqlens_k",
                                        "alibi_slopes", "sinks")}
    total_q, h, _ = t["q"].shape
    dt = t["q"].dtype
    named = dict(cu_seqlens_q=put["cu_seqlens_q"], cu_seqlens_k=put["cu_seqlens_k"],
                 alibi_slopes=put["alibi_slopes"], sinks=put["sinks"], max_seqlen_q=t["max_q"],
                 max_seqlen_k=t["max_k"])
    out, lse = d.poisoned(t["q"].shape, dtype=dt), d.poisoned((h, total_q))
    d.engine.flash_attention_v2_with(put["q"], put["k"], put["v"], out, t["opts"], lse=lse,
                                     **named)
    res = {"out": d.get(out), "lse": d.get(lse)}
    if backward:
        grads = [d.poisoned(t[n].shape, dtype=dt) for n in ("q", "k", "v")]
        gs = None if t.get("sinks") is None else d.poisoned((h,))
        d.engine.flash_attention_v2_backward_with(
            put["q"], put["k"], put["v"], out, put["go"], *grads, t["opts"],
            lse=lse if give_lse else None, grad_sinks=gs, **named)
        res |= {n: d.get(g) for n, g in zip(("grad_q", "grad_k", "grad_v"), grads)}
        if gs is not None:
            res["grad_sinks"] = d.get(gs)
    return {n: np.asarray(x).astype(np.float64) for n, x in res.items()}


def oracle(t: dict, *, backward=False, dtype=torch.float64) -> dict:
    """The per-sequence dense formula in `dtype` (float64: the oracle; a half dtype: plain
    PyTorch) on the call's inputs as they are (rounded ones for a half call); the gradients by
    autograd."""
    q, k, v, go = (np.asarray(t[n], np.float64) for n in ("q", "k", "v", "go"))
    res = {"out": np.zeros(q.shape), "lse": np.zeros((q.shape[1], q.shape[0]))}
    if backward:
        res |= {"grad_q": np.zeros(q.shape), "grad_k": np.zeros(k.shape),
                "grad_v": np.zeros(k.shape)}
        if t.get("sinks") is not None:
            res["grad_sinks"] = np.zeros(t["sinks"].shape)
        if dtype == torch.float64:  # what check_f32 / half_rule measure cancellation against
            res |= {"|grad_q|": np.zeros(q.shape), "|grad_k|": np.zeros(k.shape),
                    "|grad_v|": np.zeros(k.shape)}
    f = dict(t, q=q, k=k, v=v)
    for n in range(len(t["cu_seqlens_q"]) - 1):
        rq, rk, kw = _oracle_args(f, t["opts"], t["max_q"], t["max_k"], n)
        o, s = dense(q[None, rq], k[None, rk], v[None, rk], sinks=t.get("sinks"), dtype=dtype,
                     **kw)
        res["out"][rq], res["lse"][:, rq] = o[0].double().numpy(), s[0].double().numpy()
        if backward:
            g = dense_grads(q[None, rq], k[None, rk], v[None, rk], go[None, rq], dtype=dtype,
                            sinks=t.get("sinks"), **kw)
            res["grad_q"][rq], res["grad_k"][rk], res["grad_v"][rk] = g[0][0], g[1][0], g[2][0]
            if g[3] is not None:
                res["grad_sinks"] += g[3]
            if dtype == torch.float64:
                u = uncancelled(q[None, rq], k[None, rk], v[None, rk], go[None, rq],
                                sinks=t.get("sinks"), **kw)
                for name, rows in (("grad_q", rq), ("grad_k", rk), ("grad_v", rk)):
                    res[f"|{name}|"][rows] = u[name][0]
    return res


def reference64(t: dict, *, backward=False, out_given=None) -> dict:
    """ferrocupy's float64 reference (its varlen frame) on the call's (rounded) inputs: out,
    lse and, with `backward`, the gradients given `out_given` (None: its own float64 out)."""
    q, k, v, go = (np.asarray(t[n], np.float64) for n in ("q", "k", "v", "go"))
    n = len(t["cu_seqlens_q"]) - 1
    dims = AttentionDims.packed(q, k, n, t["max_q"], t["max_k"])
    opts, alibi, sinks = t["opts"], t.get("alibi_slopes"), t.get("sinks")
    extras = extras_params(opts, alibi, sinks, varlen=True)
    cu = dict(cu_seqlens_q=t["cu_seqlens_q"], cu_seqlens_k=t["cu_seqlens_k"])
    out = np.full_like(q, np.nan)
    lse = np.full((dims.heads, q.shape[0]), np.nan)
    reference.flash_attn_v2(q, k, v, out, None, dims.params(opts), lse=lse, alibi_slopes=alibi,
                            sinks=sinks, extras=extras, **cu)
    res = {"out": out, "lse": lse}
    if not backward:
        return res
    given = out if out_given is None else out_given
    gq, gk, gv = (np.full_like(x, np.nan) for x in (q, k, v))
    gs = None if sinks is None else np.full(dims.heads, np.nan)
    stats = np.empty((dims.heads * q.shape[0], 2))
    pb = dims.params_bwd(opts)
    reference.flash_attn_v2_bw_dq(q, k, v, given, go, gq, None, stats, pb, alibi_slopes=alibi,
                                  sinks=sinks, grad_sinks=gs, extras=extras, **cu)
    reference.flash_attn_v2_bw_dkdv(q, k, v, go, gk, gv, None, stats, pb, alibi_slopes=alibi,
                                    extras=extras, **cu)
    res |= dict(grad_q=gq, grad_k=gk, grad_v=gv)
    if gs is not None:
        res["grad_sinks"] = gs
    return res


def check_half(got: dict, t: dict, what: str = "") -> None:
    """SPEC's half rule on every output: max|x - x64| <= 2 max|x_torch - x64| + 1e-3 max|x64|,
    plus (gradients) what rounding the stored out to the dtype alone moves them by."""
    backward = "grad_q" in got
    want = reference64(t, backward=backward)
    plain = oracle(t, backward=backward, dtype=TORCH_DTYPE[np.dtype(t["q"].dtype)])
    inherited = {}
    if backward:
        given = reference64(t, backward=True,
                            out_given=want["out"].astype(t["q"].dtype).astype(np.float64))
        inherited = {n: float(np.nanmax(np.abs(given[n] - want[n]), initial=0.0))
                     for n in given if n.startswith("grad")}
    sums = oracle(t, backward=True) if backward else None
    half_rule(got, want, plain, inherited, what, sums)


def check(d, t: dict, *, backward=True, give_lse=True, what="") -> None:
    """The call on device `d` against the oracle (float32) or by the half rule."""
    got = run(d, t, backward=backward, give_lse=give_lse)
    if np.dtype(t["q"].dtype) == FLOAT32:
        check_f32(got, oracle(t, backward=backward), what)
    else:
        check_half(got, t, what)


# --- named cases: every option inside each sequence -------------------------------------------
@pytest.mark.parametrize("name,give_lse,d", covering({
    "name": axis(list(CASES)),
    "give_lse": axis([True, False], ids=["lse", "no-lse"]),
    "d": axis([40, 64, 128], ids=lambda d: f"d{d}"),
}))
def test_float32_against_the_oracle(kernels, rng, name, give_lse, d):
    t = make(rng, name, LENS_Q, LENS_K, d=d)
    check(kernels, t, give_lse=give_lse, what=f"[{name} d{d}]")


@pytest.mark.parametrize("name,d,dtype", covering({
    "name": axis(list(CASES)),
    "d": axis([64, 128], ids=lambda d: f"d{d}"),
    "dtype": axis(HALF),
}))
def test_half_by_the_half_rule(kernels, rng, name, d, dtype):
    t = rounded(make(rng, name, LENS_Q, LENS_K, d=d), dtype)
    check(kernels, t, what=f"[{name} d{d}]")


@pytest.mark.parametrize("dtype", [FLOAT32, *HALF])
def test_a_frame_wider_than_every_sequence_and_gqa(kernels, rng, dtype):
    """max_seqlen_q / max_seqlen_k above every length (the grid's spare tiles write nothing,
    its spare key blocks no dK/dV), six query heads on one KV head, bottom-right causal in the
    frame, the backward without the forward's lse."""
    t = make(rng, "bottom-right", [3, 60, 0, 33], [70, 2, 5, 33], h=6, hkv=1, d=32,
             max_extra=(70, 9))
    check(kernels, rounded(t, dtype), give_lse=False)


def test_one_run_for_the_packed_batch(dev, rng, monkeypatch):
    """One plan run (its launches, one per kernel: tests/test_varlen_plan.py) for every
    sequence, forward and backward: no loop over them."""
    t = make(rng, "sinks", LENS_Q, LENS_K)
    runs = count_launches(monkeypatch, dev.engine)
    run(dev, t, backward=True)
    assert len(runs) == 2


@pytest.mark.parametrize("dtype", [FLOAT32, *HALF])
def test_few_query_rows_a_sequence(kernels, rng, dtype):
    """A packed decode step (one or no query row a sequence, long keys), with its backward."""
    t = rounded(make(rng, "everything", [1, 1, 0, 1], [300, 0, 17, 129]), dtype)
    check(kernels, t)


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("d", [40, 96], ids=lambda d: f"d{d}")
@pytest.mark.parametrize("name", ["bottom-right", "sinks", "everything"])
def test_half_without_lse_at_padded_head_dims(launched, dev, rng, name, d, dtype):
    """The backward not given the lse at head_dims the wgmma builds pad (64 and 128 wide): on
    sm_90a the varlen forward runs first for the lse ([heads, total_q], through cu_seqlens),
    then the wgmma backward; every launch a warpgroup kernel."""
    t = rounded(make(rng, name, LENS_Q, LENS_K, d=d), dtype)
    check(dev, t, give_lse=False, what=f"[no-lse {name} d{d}]")
    if on_hopper():
        assert launched and set(launched) <= ON_SM90, launched
        assert launched.count("flash_fwd_wgmma") == 2, launched  # the call's, the lse pass's


# --- the fused backward (sm_90a, halves, the forward's lse given) -------------------------------
@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("d", [64, 128], ids=lambda d: f"d{d}")
@pytest.mark.parametrize("name", ["bottom-right", "windows", "alibi-per-sequence", "sinks",
                                  "everything"])
def test_fused_backward(rng, name, d, dtype):
    """The fused backward over a packed batch (its dQ workspace and ordered adds over the
    frame's rows; query tiles of one sequence visited by that sequence's key blocks only) by
    the half rule, and bit-identical run after run."""
    fb = pytest.importorskip("test_cuda_fused_backward")
    fused = fb.engine_with(True)
    t = rounded(make(rng, name, LENS_Q, LENS_K, h=8, hkv=2, d=d, max_extra=(5, 3)), dtype)
    check(fused, t, give_lse=True, what=f"[fused {name} d{d}]")
    fb.assert_fused_ran(fused)
    first, again = run(fused, t, backward=True), run(fused, t, backward=True)
    for n in ("grad_q", "grad_k", "grad_v"):
        assert np.array_equal(first[n], again[n]), f"{n}: runs differ"


# --- decode: few query rows a KV group, on each decode design ---------------------------------
@pytest.mark.parametrize("name,dtype,extra", covering({
    "name": axis(["everything", "sinks", "alibi-per-sequence", "windows", "bottom-right",
                  "dropout"]),
    "dtype": axis([pytest.param(FLOAT32, id="f32"), *HALF]),
    "extra": axis([0, 2], ids=["frame-tight", "frame-wider"]),
}))
def test_decode_designs(decoders, rng, name, dtype, extra):
    """Packed decode steps (0-2 query rows a sequence, 4 heads a KV head: at most 16 rows a
    KV group, the frame's up to 4) on each decode design (the tensor-core / streams kernels
    merging their key splits in the kernel, the tiles kernel with its combine launch), long
    keys split across blocks, a sequence with no key and one with no row."""
    t = rounded(make(rng, name, [2, 0, 1, 2, 1], [1500, 40, 0, 2100, 1], h=8, hkv=2, d=64,
                     max_extra=(extra, 0)), dtype)
    check(decoders, t, backward=False, what=f"[{name}]")


# --- hypothesis: random packings ----------------------------------------------------------------
@st.composite
def calls(draw):
    n = draw(st.integers(1, 6))
    lens = st.one_of(st.sampled_from([0, 1, 2]), st.integers(0, 220))
    lens_q = draw(st.lists(lens, min_size=n, max_size=n))
    lens_k = draw(st.lists(lens, min_size=n, max_size=n))
    kv_heads = draw(st.sampled_from([1, 2]))
    heads = kv_heads * draw(st.sampled_from([1, 2, 3]))
    name = draw(st.sampled_from(sorted(CASES)))
    d = draw(st.sampled_from([16, 64, 80, 128]))
    extra = (draw(st.integers(0, 40)), draw(st.integers(0, 40)))
    run = dict(dtype=draw(st.sampled_from([FLOAT32, FLOAT16, BFLOAT16])),
               backward=draw(st.booleans()), give_lse=draw(st.booleans()))
    return dict(name=name, lens_q=lens_q, lens_k=lens_k, h=heads, hkv=kv_heads, d=d,
                max_extra=extra), run, draw(st.integers(0, 2**32 - 1))


@settings(max_examples=int(os.environ.get("FERRO_VARLEN_EXAMPLES", "40")), deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(calls())
def test_random_packings(kernels, call):
    spec, how, seed = call
    t = rounded(make(np.random.default_rng(seed), **spec), how["dtype"])
    check(kernels, t, backward=how["backward"], give_lse=how["give_lse"],
          what=f"[{spec} {how}]")
