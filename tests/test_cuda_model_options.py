"""Softcap, ALiBi and attention sinks on the CUDA kernels (SPEC "Beyond the seed, part 2", issue
26), forward and backward (grad_sinks included), on every kernel path: the mma.sync forward and
backward (`kernels`' "mma"), the sm_90a wgmma ones in half precision at every head_dim up to 128
(`kernels`' "auto" on an H100/H200, checked to have been built), and the three decode designs
(`decoders`, forward only). Each option alone and with causal + offset, window, GQA, an additive
mask, dropout, kv_lens (forward), dead rows, lse given or not.

float32 against the independent float64 dense oracle (tests/dense_options.py, autograd for the
gradients); float16 / bfloat16 by SPEC's half rule (at most twice the error of the same formula
as plain PyTorch ops in that dtype, dense_options with `dtype`, plus what the stored out's
rounding alone moves a gradient by), the float64 side being ferrocupy's reference on the same
rounded inputs. Every output is NaN-poisoned before the call.

Skipped unless `ferrocupy.cuda_available()`; `FERRO_GPU_TESTS_ON_REFERENCE=1` runs it with the
reference standing in for the device (see tests/gpu_helpers.py)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ferrocupy.reference as reference
from ferrocupy import AttentionOptions
from ferrocupy.dtypes import BFLOAT16, FLOAT16, FLOAT32
from ferrocupy.params import AttentionDims, extras_params
from gpu_helpers import (axis, covering, decoders, dev, device_under_test,  # noqa: F401
                         gpu_pytestmark, kernels, restricted_device, self_check)

torch = pytest.importorskip("torch", reason="the dense oracle is written in PyTorch")
from dense_options import dense, dense_grads, per_head_inputs, uncancelled  # noqa: E402

pytestmark = gpu_pytestmark()

HALF = [pytest.param(FLOAT16, id="f16"), pytest.param(BFLOAT16, id="bf16")]
TORCH_DTYPE = {FLOAT16: torch.float16, BFLOAT16: torch.bfloat16}
FWD_TOL, BWD_TOL = 2e-5, 1e-4  # float32, relative to the output's largest magnitude

# name -> the call's options: AttentionOptions fields, and `alibi` ("h": [H], "bh": [B, H]),
# `sinks`, `mask` (standard normal, [1, H, Sq, Sk]), `dead` (the mask hides every key of some
# rows), `kv_lens` (forward only: the backward takes none).
CASES = {
    "softcap": dict(softcap=2.0),
    "softcap-causal-mask": dict(softcap=1.5, causal=True, mask=True),
    "softcap-window-dropout": dict(softcap=3.0, window=23, dropout_prob=0.2),
    "alibi-h": dict(alibi="h"),
    "alibi-h-causal-offset": dict(alibi="h", causal=True, causal_offset=9),
    "alibi-bh-window-mask": dict(alibi="bh", window=30, mask=True),
    "alibi-dropout": dict(alibi="bh", dropout_prob=0.15, causal=True),
    "sinks": dict(sinks=True),
    "sinks-causal-offset": dict(sinks=True, causal=True, causal_offset=4),
    "sinks-mask-dropout": dict(sinks=True, mask=True, dropout_prob=0.1),
    "sinks-dead-rows": dict(sinks=True, mask=True, dead=True, causal=True),
    "softcap-alibi": dict(softcap=2.5, alibi="h", causal=True),
    "all": dict(softcap=4.0, alibi="bh", sinks=True, causal=True, causal_offset=3, window=40,
                mask=True, dropout_prob=0.1),
    "all-dead-rows": dict(softcap=2.0, alibi="h", sinks=True, mask=True, dead=True),
}
KV_LENS_CASES = {
    "softcap-kv-lens": dict(softcap=2.0, causal=True, causal_offset=20),
    "alibi-kv-lens": dict(alibi="bh", window=25),
    "sinks-kv-lens-empty": dict(sinks=True, causal=True),  # a batch entry with no key
    "all-kv-lens": dict(softcap=3.0, alibi="h", sinks=True, mask=True, dropout_prob=0.1),
}
_OPTION_FIELDS = ("causal", "causal_offset", "window", "window_left", "window_right", "softcap",
                  "dropout_prob")


def make(rng, spec: dict, *, b=2, sq=77, sk=131, h=4, hkv=2, d=64, kv_lens=False) -> dict:
    """A call's host float32 inputs and options from a CASES entry."""
    t = dict(q=rng.standard_normal((b, sq, h, d), dtype=np.float32) * 1.3,
             k=rng.standard_normal((b, sk, hkv, d), dtype=np.float32) * 1.3,
             v=rng.standard_normal((b, sk, hkv, d), dtype=np.float32),
             go=rng.standard_normal((b, sq, h, d), dtype=np.float32))
    t |= per_head_inputs(rng, b, h, alibi=spec.get("alibi"), sinks=spec.get("sinks", False))
    if spec.get("mask"):
        t["mask"] = rng.standard_normal((1, h, sq, sk)).astype(np.float32)
        if spec.get("dead"):
            t["mask"][:, :, ::7] = -np.inf  # every 7th row sees no key
    if kv_lens:
        lens = rng.integers(1, sk + 1, b).astype(np.int32)
        lens[-1] = 0 if spec.get("sinks") else lens[-1]
        t["kv_lens"] = lens
        for i, n in enumerate(lens):  # keys past each length do not exist: NaN must not leak
            t["k"][i, n:], t["v"][i, n:] = np.nan, np.nan
    opts = AttentionOptions(seed=0xC0FFEE, **{k: spec[k] for k in _OPTION_FIELDS if k in spec})
    return t | {"opts": opts}


def rounded(t: dict, dtype) -> dict:
    """The call with q, k, v, grad_out (and the mask) in `dtype`."""
    return t | {n: t[n].astype(dtype) for n in ("q", "k", "v", "go", "mask") if n in t}


def run(d, t: dict, *, backward=True, give_lse=True) -> dict:
    """Forward (with lse) and, with `backward`, the backward (grad_sinks with sinks) given the
    device's own out, every output NaN-poisoned first. Host float64 arrays."""
    dt = t["q"].dtype
    put = {n: d.put(t.get(n)) for n in ("q", "k", "v", "go", "mask", "kv_lens", "alibi_slopes",
                                        "sinks")}
    b, sq, h, _ = t["q"].shape
    out, lse = d.poisoned(t["q"].shape, dtype=dt), d.poisoned((b, h, sq))
    extra = dict(alibi_slopes=put["alibi_slopes"], sinks=put["sinks"])
    d.engine.flash_attention_v2_with(put["q"], put["k"], put["v"], out, t["opts"], put["mask"],
                                     lse=lse, kv_lens=put["kv_lens"], **extra)
    res = {"out": d.get(out), "lse": d.get(lse)}
    if backward:
        grads = [d.poisoned(t[n].shape, dtype=dt) for n in ("q", "k", "v")]
        gs = None if t.get("sinks") is None else d.poisoned((h,))
        d.engine.flash_attention_v2_backward_with(
            put["q"], put["k"], put["v"], out, put["go"], *grads, t["opts"], put["mask"],
            lse=lse if give_lse else None, grad_sinks=gs, **extra)
        res |= {n: d.get(g) for n, g in zip(("grad_q", "grad_k", "grad_v"), grads)}
        if gs is not None:
            res["grad_sinks"] = d.get(gs)
    return {n: np.asarray(x).astype(np.float64) for n, x in res.items()}


def _keep(t: dict):
    opts = t["opts"]
    if not opts.dropout_prob:
        return None
    p = AttentionDims.new(t["q"], t["k"]).params(opts)
    b, sq, h, _ = t["q"].shape
    return np.array([[reference.dropout_keep(p, i, j, range(sq), range(t["k"].shape[1]))
                      for j in range(h)] for i in range(b)])


def _dense_options(t: dict) -> dict:
    o = t["opts"]
    left, right = o.windows()
    return dict(causal=o.causal, causal_offset=o.causal_offset, window_left=left,
                window_right=right, softcap=float(np.float32(o.softcap)),
                scale=None if o.scale is None else float(np.float32(o.scale)),
                alibi_slopes=t.get("alibi_slopes"), kv_lens=t.get("kv_lens"),
                mask=None if t.get("mask") is None else np.asarray(t["mask"], np.float64),
                keep=_keep(t), dropout_prob=o.dropout_prob)


def oracle(t: dict, *, backward=True, dtype=torch.float64) -> dict:
    """The dense formula in `dtype` (float64: the oracle; a half dtype: plain PyTorch), on the
    call's inputs as they are (rounded ones for a half call). Float64 arrays."""
    opts = _dense_options(t)
    # (the NaN past each kv_lens entry, never read by the kernels, out of the dense products)
    out, lse = dense(*(np.nan_to_num(np.asarray(t[n], np.float64)) for n in ("q", "k", "v")),
                     sinks=t.get("sinks"), dtype=dtype, **opts)
    res = {"out": out.double().numpy(), "lse": lse.double().numpy()}
    if backward:
        opts.pop("kv_lens")
        grads = dense_grads(t["q"], t["k"], t["v"], t["go"], dtype=dtype, sinks=t.get("sinks"),
                            **opts)
        res |= dict(zip(("grad_q", "grad_k", "grad_v", "grad_sinks"), grads))
        if res["grad_sinks"] is None:
            del res["grad_sinks"]
        if dtype == torch.float64:  # what check_f32 measures a cancelling gradient against
            u = uncancelled(t["q"], t["k"], t["v"], t["go"], sinks=t.get("sinks"), **opts)
            res |= {f"|{n}|": x for n, x in u.items()}
    return res


def reference64(t: dict, out_given=None, backward=True) -> dict:
    """ferrocupy's float64 reference on the call's (rounded) inputs: out, lse and, with
    `backward`, the gradients from the backward given `out_given` (None: its own float64 out)."""
    f = {n: None if t.get(n) is None else np.asarray(t[n], np.float64)
         for n in ("q", "k", "v", "go", "mask")}
    dims = AttentionDims.new(f["q"], f["k"])
    opts, alibi, sinks = t["opts"], t.get("alibi_slopes"), t.get("sinks")
    extras = extras_params(opts, alibi, sinks)
    p, pb = dims.params(opts, f["mask"]), dims.params_bwd(opts, f["mask"])
    out = np.full_like(f["q"], np.nan)
    lse = np.full((dims.batch, dims.heads, dims.seq_q), np.nan)
    reference.flash_attn_v2(f["q"], f["k"], f["v"], out, f["mask"], p, lse=lse,
                            kv_lens=t.get("kv_lens"), alibi_slopes=alibi, sinks=sinks,
                            extras=extras)
    if not backward:
        return dict(out=out, lse=lse)
    given = out if out_given is None else out_given
    gq, gk, gv = (np.full_like(f[n], np.nan) for n in ("q", "k", "v"))
    gs = None if sinks is None else np.full(dims.heads, np.nan)
    stats = np.empty((dims.batch * dims.heads * dims.seq_q, 2))
    reference.flash_attn_v2_bw_dq(f["q"], f["k"], f["v"], given, f["go"], gq, f["mask"], stats,
                                  pb, alibi_slopes=alibi, sinks=sinks, grad_sinks=gs,
                                  extras=extras)
    reference.flash_attn_v2_bw_dkdv(f["q"], f["k"], f["v"], f["go"], gk, gv, f["mask"], stats, pb,
                                    alibi_slopes=alibi, extras=extras)
    res = dict(out=out, lse=lse, grad_q=gq, grad_k=gk, grad_v=gv)
    if gs is not None:
        res["grad_sinks"] = gs
    return res


UNCANCELLED_TOL = 2.0**-20  # 16 float32 ulps of a gradient's uncancelled sum, per element


def check_f32(got: dict, want: dict, what: str = "") -> None:
    """Each output within FWD_TOL / BWD_TOL of the oracle's largest magnitude (at least 0.1);
    a gradient also gets UNCANCELLED_TOL of the sum of its terms' magnitudes (the oracle's
    `|grad_k|` etc.: where dS = P (dP - Delta) cancels, as in grad_k of a lone key, float32
    rounds a sum of that size to ~0, and its error is measured against that sum); non-finite
    entries (a dead row's lse without a sink) equal; no NaN anywhere."""
    for name, w in want.items():
        if name.startswith("|"):
            continue
        g = got[name]
        assert g.shape == w.shape, f"{name}: shape {g.shape} != {w.shape} {what}"
        assert not np.isnan(g).any(), f"{name}: NaN (an output left unwritten?) {what}"
        fin = np.isfinite(w)
        assert (g[~fin] == w[~fin]).all(), f"{name}: non-finite entries differ {what}"
        scale = max(float(np.abs(w[fin]).max(initial=0.0)), 0.1)
        tol = FWD_TOL if name in ("out", "lse") else BWD_TOL
        allowed = tol * scale + UNCANCELLED_TOL * want.get(f"|{name}|", np.zeros_like(w))[fin]
        excess = np.abs(g[fin] - w[fin]) - allowed
        if excess.size and excess.max() > 0:
            i = int(np.argmax(excess))
            err = float(np.abs(g[fin] - w[fin])[i])
            raise AssertionError(f"{name}: error {err:.2e} (relative {err / scale:.2e}, tol "
                                 f"{tol:.0e}) > {float(allowed[i]):.2e} allowed there {what}")


def check_half(got: dict, t: dict, what: str = "") -> None:
    """SPEC's half rule on every output: max|x - x64| <= 2 max|x_torch - x64| + 1e-3 max|x64|,
    plus (gradients) what rounding the stored out to the dtype alone moves them by."""
    want = reference64(t, backward="grad_q" in got)
    plain = oracle(t, backward="grad_q" in got, dtype=TORCH_DTYPE[np.dtype(t["q"].dtype)])
    inherited = {}
    if "grad_q" in got:
        given = reference64(t, want["out"].astype(t["q"].dtype).astype(np.float64))
        inherited = {n: float(np.nanmax(np.abs(given[n] - want[n]))) for n in given
                     if n.startswith("grad")}
        sums = {f"|{n}|": x for n, x in uncancelled(
            t["q"], t["k"], t["v"], t["go"], sinks=t.get("sinks"),
            **{o: x for o, x in _dense_options(t).items() if o != "kv_lens"}).items()}
    half_rule(got, want, plain, inherited, what, sums if "grad_q" in got else None)


def half_rule(got: dict, want: dict, plain: dict, inherited: dict, what: str = "",
              sums: dict | None = None) -> None:
    """The rule on each output of `got` against float64 `want` and plain PyTorch's `plain`
    (`inherited`: a gradient's allowance for the stored out's rounding, by name; `sums`: the
    oracle's `|grad_k|` etc., whose UNCANCELLED_TOL a gradient gets per element as in
    check_f32: the kernels accumulate in float32, and where dS cancels, as for a lone key,
    plain PyTorch may round to exactly 0 and leave the rule no room)."""
    sums = sums or {}
    for name, g in got.items():
        w = want[name]
        assert not np.isnan(g).any(), f"{name}: NaN (an output left unwritten?) {what}"
        fin = np.isfinite(w)
        assert (g[~fin] == w[~fin]).all(), f"{name}: non-finite entries differ {what}"
        err = np.abs(g[fin] - w[fin])
        assert not np.isnan(plain[name][fin]).any(), f"{name}: plain PyTorch gave NaN {what}"
        terr = float(np.abs(plain[name][fin] - w[fin]).max(initial=0.0))
        bound = 2 * terr + 1e-3 * float(np.abs(w[fin]).max(initial=0.0)) + inherited.get(name, 0)
        allowed = bound + UNCANCELLED_TOL * sums.get(f"|{name}|", np.zeros_like(w))[fin]
        if err.size and (err > allowed).any():
            i = int(np.argmax(err - allowed))
            raise AssertionError(f"{name}: error {float(err[i]):.3e} > bound {bound:.3e} (torch "
                                 f"{terr:.3e}; {float(allowed[i]):.3e} there) {what}")


def built(d) -> set:
    """(op, isa, plain) of every variant the device's backend has built."""
    return {(hit[0].op, hit[0].isa, hit[0].plain) for hit in d.engine.backend._kernels.values()
            if isinstance(hit, tuple)}


def _on_hopper(d) -> bool:
    return not self_check() and d.engine.backend.capability == 90


# --- float32: the mma.sync kernels (no wgmma kernel takes float32) ---------------------------------
@pytest.mark.parametrize("name,give_lse,d", covering({
    "name": axis(list(CASES)),
    "give_lse": axis([True, False], ids=["lse", "no-lse"]),
    "d": axis([40, 64, 96, 128], ids=lambda d: f"d{d}"),
}))
def test_float32_against_the_dense_oracle(dev, rng, name, give_lse, d):
    t = make(rng, CASES[name], d=d)
    check_f32(run(dev, t, give_lse=give_lse), oracle(t), f"[{name} d{d}]")


@pytest.mark.parametrize("name", list(KV_LENS_CASES))
def test_float32_forward_with_kv_lens(dev, rng, name):
    t = make(rng, KV_LENS_CASES[name], kv_lens=True, d=48)
    check_f32(run(dev, t, backward=False), oracle(t, backward=False), f"[{name}]")


def test_float32_gqa_one_kv_head_and_a_scale(dev, rng):
    t = make(rng, CASES["all"], h=6, hkv=1, d=32)
    t["opts"] = replace(t["opts"], scale=0.3)
    check_f32(run(dev, t), oracle(t))


# --- half precision: wgmma (sm_90a, head_dim <= 128) and mma.sync ----------------------------------
@pytest.mark.parametrize("name,give_lse,d,dtype", covering({
    "name": axis(list(CASES)),
    "give_lse": axis([True, False], ids=["lse", "no-lse"]),
    "d": axis([64, 128, 40, 96], ids=lambda d: f"d{d}"),
    "dtype": axis(HALF),
}))
def test_half_rule(kernels, rng, name, give_lse, d, dtype):
    t = rounded(make(rng, CASES[name], sq=150, sk=211, d=d), dtype)
    check_half(run(kernels, t, give_lse=give_lse), t, f"[{name} d{d}]")
    if kernels is device_under_test() and _on_hopper(kernels):
        # the wgmma kernels built with the options (dQ given the forward's lse, or the
        # forward run first for it)
        assert ("forward", "wgmma", False) in built(kernels)
        assert ("backward_dkdv", "wgmma", False) in built(kernels) or not _needs_full_dkdv(name)
        assert ("backward_dq", "wgmma", False) in built(kernels) or not _needs_full_dkdv(name)


def _needs_full_dkdv(name: str) -> bool:
    """Whether the dK/dV kernel computes an option of the case (sinks alone: only the lse)."""
    spec = CASES[name]
    return any(spec.get(k) for k in ("softcap", "alibi", "mask", "dropout_prob"))


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("name", list(KV_LENS_CASES))
def test_half_forward_with_kv_lens(kernels, rng, name, dtype):
    t = rounded(make(rng, KV_LENS_CASES[name], kv_lens=True, sq=100, sk=300, d=64), dtype)
    check_half(run(kernels, t, backward=False), t, f"[{name}]")


# --- decode: the three designs, forward only --------------------------------------------------------
DECODE_SHAPES = [pytest.param(dict(sq=1, h=8, hkv=2), id="rows4"),
                 pytest.param(dict(sq=2, h=16, hkv=4), id="rows8"),
                 pytest.param(dict(sq=3, h=10, hkv=2), id="rows15")]


@pytest.mark.parametrize("name,shape,d,dtype", covering({
    "name": axis(["softcap-causal-mask", "alibi-h-causal-offset",
                                  "alibi-bh-window-mask", "sinks-mask-dropout", "all"]),
    "shape": axis(DECODE_SHAPES),
    "d": axis([64, 128], ids=lambda d: f"d{d}"),
    "dtype": axis([pytest.param(FLOAT32, id="f32"), *HALF]),
}))
def test_decode(decoders, rng, name, shape, d, dtype):
    spec = dict(CASES[name])
    if spec.get("causal"):
        spec["causal_offset"] = 2000  # a decode step: the rows at the end of a long cache
    t = make(rng, spec, sk=2003, d=d, **shape)
    t = rounded(t, dtype) if dtype != FLOAT32 else t
    got = run(decoders, t, backward=False)
    if dtype == FLOAT32:
        check_f32(got, oracle(t, backward=False), f"[{name}]")
    else:
        check_half(got, t, f"[{name}]")


@pytest.mark.parametrize("dtype", [pytest.param(FLOAT32, id="f32"), *HALF])
@pytest.mark.parametrize("shape", DECODE_SHAPES)
def test_decode_head_dim_40(decoders, rng, shape, dtype):
    """A head_dim that is no multiple of 64 (the tensor design's padded rows, 80-byte rows)."""
    t = make(rng, dict(CASES["all"], causal_offset=900), sk=903, d=40, **shape)
    t = rounded(t, dtype) if dtype != FLOAT32 else t
    got = run(decoders, t, backward=False)
    if dtype == FLOAT32:
        check_f32(got, oracle(t, backward=False))
    else:
        check_half(got, t)


@pytest.mark.parametrize("name", ["sinks-kv-lens-empty", "all-kv-lens"])
def test_decode_with_kv_lens(decoders, rng, name):
    t = make(rng, KV_LENS_CASES[name], kv_lens=True, sq=1, h=8, hkv=2, sk=1500, d=64)
    check_f32(run(decoders, t, backward=False), oracle(t, backward=False), f"[{name}]")


# --- sinks' gradient: written, deterministic --------------------------------------------------------
@pytest.mark.parametrize("dtype", [pytest.param(FLOAT32, id="f32"), *HALF])
def test_grad_sinks_is_deterministic(dev, rng, dtype):
    """Two runs give the same bits for every gradient, grad_sinks included (no atomics)."""
    t = make(rng, CASES["all"], b=3, sq=700, sk=650, d=64)
    t = rounded(t, dtype) if dtype != FLOAT32 else t
    a, b = run(dev, t), run(dev, t)
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


# --- plain calls keep the plain variants --------------------------------------------------------------
def test_plain_calls_keep_the_plain_variants(rng):
    """On sm_90a a call without any option runs the `plain` wgmma kernels; one with a model
    option the general ones (a fresh engine, so `built` shows this test's kernels alone)."""
    d = restricted_device("wgmma") if not self_check() else device_under_test()
    if not _on_hopper(d):
        pytest.skip("the wgmma kernels run on compute capability 9.0 only")
    plain = rounded(make(rng, {}, sq=300, sk=300, d=64), BFLOAT16)
    run(d, plain)
    assert built(d) >= {("forward", "wgmma", True), ("backward_dq", "wgmma", True),
                        ("backward_dkdv", "wgmma", True)}
    assert not {x for x in built(d) if x[1] == "wgmma" and not x[2]}
    run(d, rounded(make(rng, CASES["softcap"], sq=300, sk=300, d=64), BFLOAT16))
    assert ("forward", "wgmma", False) in built(d)


# --- a randomized walk over the options -----------------------------------------------------------------
@st.composite
def option_calls(draw):
    spec = {}
    if draw(st.booleans()):
        spec["softcap"] = draw(st.sampled_from([0.5, 2.0, 10.0]))
    spec["alibi"] = draw(st.sampled_from([None, "h", "bh"]))
    spec["sinks"] = draw(st.booleans())
    spec["causal"] = draw(st.booleans())
    if spec["causal"]:
        spec["causal_offset"] = draw(st.integers(0, 40))
    if draw(st.booleans()):
        spec["window"] = draw(st.integers(1, 60))
    spec["mask"] = draw(st.booleans())
    spec["dead"] = spec["mask"] and draw(st.booleans())
    if draw(st.booleans()):
        spec["dropout_prob"] = draw(st.sampled_from([0.1, 0.5]))
    hkv = draw(st.sampled_from([1, 2, 4]))
    shape = dict(b=draw(st.integers(1, 3)), sq=draw(st.integers(1, 90)),
                 sk=draw(st.integers(1, 140)), h=4, hkv=hkv,
                 d=draw(st.sampled_from([16, 24, 40, 64, 96, 128])))
    return spec, shape, draw(st.booleans()), draw(st.integers(0, 2**32 - 1))


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(call=option_calls())
def test_option_combinations(dev, call):
    spec, shape, give_lse, seed = call
    t = make(np.random.default_rng(seed), spec, **shape)
    check_f32(run(dev, t, give_lse=give_lse), oracle(t), f"[{spec} {shape}]")


# --- through ferrocupy.torch: autograd on CUDA tensors (sinks' gradient included) --------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_torch_attention_on_cuda_tensors(rng, dtype):
    """ferrocupy.torch.attention with softcap, ALiBi and sinks on CUDA tensors, forward and
    backward by autograd (sinks.grad), against the same call on CPU tensors (the reference)."""
    import ferrocupy.torch as ft

    if self_check() or not torch.cuda.is_available():
        pytest.skip("needs PyTorch with a CUDA device")
    t = make(rng, dict(alibi="bh", sinks=True), sq=130, sk=150, d=64)
    kw = dict(causal=True, causal_offset=20, softcap=3.0)

    def call(device):
        leaves = [torch.from_numpy(t[n]).to(device, dtype).requires_grad_(True)
                  for n in ("q", "k", "v")]
        sinks = torch.from_numpy(t["sinks"]).to(device).requires_grad_(True)
        slopes = torch.from_numpy(t["alibi_slopes"]).to(device)
        out = ft.attention(*leaves, alibi_slopes=slopes, sinks=sinks, **kw)
        out.backward(torch.from_numpy(t["go"]).to(device, dtype))
        return [x.detach().to("cpu", torch.float64).numpy()
                for x in (out, *(x.grad for x in leaves), sinks.grad)]

    tol = 1e-4 if dtype == torch.float32 else 3e-2
    for name, g, w in zip(("out", "grad_q", "grad_k", "grad_v", "grad_sinks"), call("cuda"),
                          call("cpu")):
        err = float(np.abs(g - w).max()) / max(float(np.abs(w).max()), 0.1)
        assert err <= tol, f"{name}: relative error {err:.2e} > {tol:.0e}"
