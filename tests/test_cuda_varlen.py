"""Packed variable-length batches (varlen, SPEC "Beyond the seed, part 2", issue 26) on the CUDA
kernels: the forward on every kernel path (`kernels`: the engine's own choice, the sm_90a wgmma
kernel in half precision at head_dim 64 / 128 on an H100/H200, and the mma.sync kernels alone),
one launch for the whole packed batch, against a per-sequence loop of the independent dense
float64 oracle (tests/dense_options.py through tests/test_varlen.py's oracle: each sequence
right-aligned in the [max_seqlen_q, max_seqlen_k] frame, dropout's batch index its number, its
ALiBi row). Sequences of length 0 and 1, longer than a tile, GQA, and causal / windows /
softcap / ALiBi / sinks / dropout inside each sequence; hypothesis over random packings.

float32 within 2e-5 (check_f32's FWD_TOL) of the oracle's largest magnitude; float16 / bfloat16 by SPEC's half
rule (at most twice the error of the same per-sequence formula as plain PyTorch ops in that
dtype, against ferrocupy's float64 reference on the same rounded inputs). Every output is
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
from gpu_helpers import count_launches, dev, gpu_pytestmark, kernels  # noqa: F401

torch = pytest.importorskip("torch", reason="the dense oracle is written in PyTorch")
from dense_options import dense  # noqa: E402
from test_cuda_model_options import check_f32, half_rule  # noqa: E402
from test_varlen import CASES, _oracle_args, packed  # noqa: E402

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
    max_q = max(lens_q) + max_extra[0]
    max_k = max(lens_k) + max_extra[1]
    fields = dict(fields)
    if fields.get("causal_offset") == "br":
        fields["causal_offset"] = max_k - max_q
    return t | dict(opts=AttentionOptions(**fields), max_q=max_q, max_k=max_k)


def rounded(t: dict, dtype) -> dict:
    return t | {n: t[n].astype(dtype) for n in ("q", "k", "v")}


def _varlen(t: dict) -> dict:
    return dict(max_seqlen_q=t["max_q"], max_seqlen_k=t["max_k"])


def run(d, t: dict) -> dict:
    """The forward on device `d` (out and lse NaN-poisoned first), as host float64 arrays."""
    put = {n: d.put(t.get(n)) for n in ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k",
                                        "alibi_slopes", "sinks")}
    total_q, h, _ = t["q"].shape
    out, lse = d.poisoned(t["q"].shape, dtype=t["q"].dtype), d.poisoned((h, total_q))
    d.engine.flash_attention_v2_with(put["q"], put["k"], put["v"], out, t["opts"], lse=lse,
                                     cu_seqlens_q=put["cu_seqlens_q"],
                                     cu_seqlens_k=put["cu_seqlens_k"],
                                     alibi_slopes=put["alibi_slopes"], sinks=put["sinks"],
                                     **_varlen(t))
    return {"out": np.asarray(d.get(out), np.float64), "lse": np.asarray(d.get(lse), np.float64)}


def oracle(t: dict, dtype=torch.float64) -> dict:
    """The per-sequence dense formula in `dtype` (float64: the oracle; a half dtype: plain
    PyTorch) on the call's inputs as they are (rounded ones for a half call)."""
    q, k, v = (np.asarray(t[n], np.float64) for n in ("q", "k", "v"))
    out = np.zeros(q.shape)
    lse = np.zeros((q.shape[1], q.shape[0]))
    f = dict(t, q=q, k=k, v=v)
    for n in range(len(t["cu_seqlens_q"]) - 1):
        rq, rk, kw = _oracle_args(f, t["opts"], t["max_q"], t["max_k"], n)
        o, s = dense(q[None, rq], k[None, rk], v[None, rk], sinks=t.get("sinks"), dtype=dtype,
                     **kw)
        out[rq], lse[:, rq] = o[0].double().numpy(), s[0].double().numpy()
    return {"out": out, "lse": lse}


def reference64(t: dict) -> dict:
    """ferrocupy's float64 reference (its varlen frame) on the call's (rounded) inputs."""
    q, k, v = (np.asarray(t[n], np.float64) for n in ("q", "k", "v"))
    n = len(t["cu_seqlens_q"]) - 1
    dims = AttentionDims.packed(q, k, n, t["max_q"], t["max_k"])
    opts, alibi, sinks = t["opts"], t.get("alibi_slopes"), t.get("sinks")
    out = np.full_like(q, np.nan)
    lse = np.full((dims.heads, q.shape[0]), np.nan)
    reference.flash_attn_v2(q, k, v, out, None, dims.params(opts), lse=lse, alibi_slopes=alibi,
                            sinks=sinks, extras=extras_params(opts, alibi, sinks, varlen=True),
                            cu_seqlens_q=t["cu_seqlens_q"], cu_seqlens_k=t["cu_seqlens_k"])
    return {"out": out, "lse": lse}


def check_half(got: dict, t: dict, what: str = "") -> None:
    """SPEC's half rule on out and lse: max|x - x64| <= 2 max|x_torch - x64| + 1e-3 max|x64|."""
    half_rule(got, reference64(t), oracle(t, dtype=TORCH_DTYPE[np.dtype(t["q"].dtype)]), {},
              what)


# --- named cases: every option inside each sequence -------------------------------------------
@pytest.mark.parametrize("d", [40, 64, 128], ids=lambda d: f"d{d}")
@pytest.mark.parametrize("name", list(CASES))
def test_float32_forward_against_the_oracle(kernels, rng, name, d):
    t = make(rng, name, LENS_Q, LENS_K, d=d)
    check_f32(run(kernels, t), oracle(t), f"[{name} d{d}]")


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("d", [64, 128], ids=lambda d: f"d{d}")
@pytest.mark.parametrize("name", list(CASES))
def test_half_forward_by_the_half_rule(kernels, rng, name, d, dtype):
    t = rounded(make(rng, name, LENS_Q, LENS_K, d=d), dtype)
    check_half(run(kernels, t), t, f"[{name} d{d}]")


def test_a_frame_wider_than_every_sequence_and_gqa(kernels, rng):
    """max_seqlen_q / max_seqlen_k above every length (the grid's spare tiles write nothing),
    six query heads on one KV head, bottom-right causal in the frame."""
    t = make(rng, "bottom-right", [3, 60, 0, 33], [70, 2, 5, 33], h=6, hkv=1, d=32,
             max_extra=(70, 9))
    check_f32(run(kernels, t), oracle(t))


def test_one_launch_for_the_packed_batch(dev, rng, monkeypatch):
    """One kernel run for every sequence (no loop over them)."""
    t = make(rng, "causal-self", LENS_Q, LENS_K)
    runs = count_launches(monkeypatch, dev.engine)
    run(dev, t)
    assert len(runs) == 1


def test_few_query_rows_a_sequence(kernels, rng):
    """A packed decode step (one or no query row a sequence, long keys)."""
    for dtype in (FLOAT32, BFLOAT16):
        t = rounded(make(rng, "everything", [1, 1, 0, 1], [300, 0, 17, 129]), dtype)
        got = run(kernels, t)
        if dtype == FLOAT32:
            check_f32(got, oracle(t))
        else:
            check_half(got, t)


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
    dtype = draw(st.sampled_from([FLOAT32, FLOAT16, BFLOAT16]))
    return dict(name=name, lens_q=lens_q, lens_k=lens_k, h=heads, hkv=kv_heads, d=d,
                max_extra=extra), dtype, draw(st.integers(0, 2**32 - 1))


@settings(max_examples=int(os.environ.get("FERRO_VARLEN_EXAMPLES", "40")), deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(calls())
def test_random_packings(kernels, call):
    spec, dtype, seed = call
    name = spec.pop("name")
    t = make(np.random.default_rng(seed), name, **spec)
    if dtype == FLOAT32:
        check_f32(run(kernels, t), oracle(t), f"[{name} {spec}]")
    else:
        t = rounded(t, dtype)
        check_half(run(kernels, t), t, f"[{name} {spec} {dtype}]")
