"""Issue 26's visibility rule on the CUDA kernels (SPEC "Beyond the seed, part 2"): a negative
`causal_offset` (bottom-right alignment with Sq > Sk: the first rows are dead) and the window's
two sides (`window_left`, `window_right`, either unbounded), forward and backward, on every
kernel path: the mma.sync forward and backward (`kernels`' "mma"), the sm_90a wgmma ones in half
precision at head_dim up to 128 (`kernels`' "auto" on an H100/H200, checked to have been
built), and the three decode designs (`decoders`, forward only); with causal, a mask, dropout,
kv_lens (forward), GQA, the model options, lse given or not. Every kernel reads visibility
through the headers that tests/test_visibility_on_host.py checks on the CPU; these check the
kernels use them right.

float32 against the float64 dense oracle (tests/dense_options.py), half precision by SPEC's rule,
outputs NaN-poisoned: the helpers of tests/test_cuda_model_options.py.

Skipped unless `ferrocupy.cuda_available()`; `FERRO_GPU_TESTS_ON_REFERENCE=1` runs it with the
reference standing in for the device (see tests/gpu_helpers.py)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ferrocupy.dtypes import FLOAT32
from gpu_helpers import (axis, covering, decoders, dev, device_under_test,  # noqa: F401
                         gpu_pytestmark, kernels)
from test_cuda_model_options import (DECODE_SHAPES, HALF, _on_hopper, built, check_f32,
                                     check_half, make, oracle, rounded, run)

pytestmark = gpu_pytestmark()

# name -> (the call's options as test_cuda_model_options.make takes them, its sizes). Sizes whose
# Sq > Sk make a bottom-right causal call's offset Sk - Sq negative.
CASES = {
    "causal-negative-offset": (dict(causal=True, causal_offset=-30), {}),
    "bottom-right-sq-over-sk": (dict(causal=True, causal_offset=90 - 170), dict(sq=170, sk=90)),
    "every-row-dead": (dict(causal=True, causal_offset=-400), {}),
    "left-only": (dict(window_left=9), {}),
    "left-zero": (dict(window_left=0, causal_offset=20), {}),
    "right-only": (dict(window_right=3, causal_offset=10), {}),
    "right-zero-negative-offset": (dict(window_right=0, causal_offset=-12), {}),
    "asymmetric": (dict(window_left=17, window_right=5), {}),
    "asymmetric-negative-offset": (dict(window_left=6, window_right=40, causal_offset=-25), {}),
    "asymmetric-causal": (dict(causal=True, window_left=12, window_right=7, causal_offset=-5), {}),
    "asymmetric-mask-dropout": (dict(window_left=33, window_right=4, causal_offset=-8, mask=True,
                                     dropout_prob=0.2), {}),
    "causal-negative-dead-mask": (dict(causal=True, causal_offset=-3, mask=True, dead=True), {}),
    "asymmetric-model-options": (dict(window_left=6, window_right=11, causal_offset=-15,
                                      softcap=2.0, alibi="bh", sinks=True), {}),
    "bottom-right-model-options": (dict(causal=True, causal_offset=64 - 150, window_left=20,
                                        softcap=3.0, alibi="h", sinks=True, mask=True,
                                        dropout_prob=0.1), dict(sq=150, sk=64)),
}
KV_LENS_CASES = {
    "causal-negative-offset-kv-lens": dict(causal=True, causal_offset=-20),
    "asymmetric-kv-lens": dict(window_left=10, window_right=30, causal_offset=-7),
    "right-only-kv-lens-sinks": dict(window_right=0, sinks=True),  # a batch entry with no key
}


def _hopper_kernels_built(d) -> None:
    """On sm_90a (head_dim <= 128) the wgmma kernels ran (plain or general variants), dQ's
    too: given the forward's lse, or the forward run first for it."""
    ops = {op for op, isa, _ in built(d) if isa == "wgmma"}
    assert {"forward", "backward_dkdv", "backward_dq"} <= ops, ops


# --- float32: the mma.sync kernels --------------------------------------------------------------
@pytest.mark.parametrize("name,give_lse,d", covering({
    "name": axis(list(CASES)),
    "give_lse": axis([True, False], ids=["lse", "no-lse"]),
    "d": axis([40, 64, 128], ids=lambda d: f"d{d}"),
}))
def test_float32_against_the_dense_oracle(dev, rng, name, give_lse, d):
    spec, size = CASES[name]
    t = make(rng, spec, d=d, **size)
    check_f32(run(dev, t, give_lse=give_lse), oracle(t), f"[{name} d{d}]")


@pytest.mark.parametrize("name", list(KV_LENS_CASES))
def test_float32_forward_with_kv_lens(dev, rng, name):
    t = make(rng, KV_LENS_CASES[name], kv_lens=True, d=48)
    check_f32(run(dev, t, backward=False), oracle(t, backward=False), f"[{name}]")


def test_float32_gqa_one_kv_head(dev, rng):
    spec, size = CASES["asymmetric-causal"]
    t = make(rng, spec, h=6, hkv=1, d=32, **size)
    check_f32(run(dev, t), oracle(t))


# --- half precision: wgmma (sm_90a, head_dim <= 128) and mma.sync ------------------------------
@pytest.mark.parametrize("name,give_lse,d,dtype", covering({
    "name": axis(list(CASES)),
    "give_lse": axis([True, False], ids=["lse", "no-lse"]),
    "d": axis([64, 128, 96], ids=lambda d: f"d{d}"),
    "dtype": axis(HALF),
}))
def test_half_rule(kernels, rng, name, give_lse, d, dtype):
    spec, size = CASES[name]
    size = dict(dict(sq=150, sk=211), **size)
    if name == "causal-negative-offset" or name == "bottom-right-sq-over-sk":
        size = dict(sq=300, sk=200)  # several wgmma row blocks, the first ones dead
    t = rounded(make(rng, spec, d=d, **size), dtype)
    check_half(run(kernels, t, give_lse=give_lse), t, f"[{name} d{d}]")
    if kernels is device_under_test() and _on_hopper(kernels):
        _hopper_kernels_built(kernels)


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("name", list(KV_LENS_CASES))
def test_half_forward_with_kv_lens(kernels, rng, name, dtype):
    t = rounded(make(rng, KV_LENS_CASES[name], kv_lens=True, sq=100, sk=300, d=64), dtype)
    check_half(run(kernels, t, backward=False), t, f"[{name}]")


# --- decode: the three designs, forward only -----------------------------------------------------
# A decode step's rows against a long cache (sk = 2003): a sliding window on the left, a window
# whose right side ends the keys read (configs.key_reach sizes the splits by it), a negative
# offset that kills the first rows and leaves a few keys to the rest.
DECODE_CASES = {
    "sliding-left": dict(causal=True, causal_offset=2000, window_left=300),
    "both-sides": dict(causal_offset=1000, window_left=70, window_right=20, mask=True),
    "negative-offset": dict(causal=True, causal_offset=-1),
    "right-only-negative": dict(window_right=5, causal_offset=-3, dropout_prob=0.1),
    "left-only-model-options": dict(window_left=500, causal_offset=1800, softcap=2.0, alibi="h",
                                    sinks=True),
}


@pytest.mark.parametrize("name,shape,d,dtype", covering({
    "name": axis(list(DECODE_CASES)),
    "shape": axis(DECODE_SHAPES),
    "d": axis([64, 128], ids=lambda d: f"d{d}"),
    "dtype": axis([pytest.param(FLOAT32, id="f32"), *HALF]),
}))
def test_decode(decoders, rng, name, shape, d, dtype):
    t = make(rng, DECODE_CASES[name], sk=2003, d=d, **shape)
    t = rounded(t, dtype) if dtype != FLOAT32 else t
    got = run(decoders, t, backward=False)
    if dtype == FLOAT32:
        check_f32(got, oracle(t, backward=False), f"[{name}]")
    else:
        check_half(got, t, f"[{name}]")


def test_decode_with_kv_lens(decoders, rng):
    t = make(rng, dict(window_left=40, window_right=2, causal_offset=-5), kv_lens=True, sq=2,
             h=8, hkv=2, sk=1500, d=64)
    check_f32(run(decoders, t, backward=False), oracle(t, backward=False))


# --- a randomized walk over offsets and windows -------------------------------------------------
@st.composite
def visibility_calls(draw):
    spec = dict(causal=draw(st.booleans()), causal_offset=draw(st.integers(-80, 80)),
                window_left=draw(st.sampled_from([-1, 0, 1, 7, 33])),
                window_right=draw(st.sampled_from([-1, 0, 2, 9, 50])))
    spec["mask"] = draw(st.booleans())
    if draw(st.booleans()):
        spec["dropout_prob"] = 0.2
    if draw(st.booleans()):
        spec["sinks"] = True
    shape = dict(b=draw(st.integers(1, 3)), sq=draw(st.integers(1, 130)),
                 sk=draw(st.integers(1, 140)), h=4, hkv=draw(st.sampled_from([1, 2, 4])),
                 d=draw(st.sampled_from([16, 40, 64, 128])))
    return spec, shape, draw(st.booleans()), draw(st.integers(0, 2**32 - 1))


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(call=visibility_calls())
def test_offset_and_window_combinations(dev, call):
    spec, shape, give_lse, seed = call
    t = make(np.random.default_rng(seed), spec, **shape)
    check_f32(run(dev, t, give_lse=give_lse), oracle(t), f"[{spec} {shape}]")
