"""The front door on the GPU: the checks of each call's memory run on every call, warm or cold,
for CuPy arrays, UnifiedTensors and PyTorch tensors alike (tests/test_plans.py has the CPU side
and the rules)."""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import aliasing
from aliasing import call_with as _call
from aliasing import issue_case_decode_out_in_q, issue_case_lse_in_q
from ferrocupy import ComputeEngine
from gpu_helpers import gpu_pytestmark, needs_real_gpu

pytestmark = gpu_pytestmark()


@pytest.fixture(scope="module")
def cuda_engine():
    needs_real_gpu()
    return ComputeEngine("cuda", quiet=True)


def _put(a):
    import cupy

    if a.dtype.itemsize == 2:  # half dtypes cross as their 16-bit patterns
        return cupy.asarray(a.view(np.uint16)).view(a.dtype)
    return cupy.asarray(a)


def _torch_put(a):
    import torch

    if a.dtype.itemsize == 2 and a.dtype != np.float16:
        return torch.from_numpy(a.view(np.int16)).cuda().view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(a)).cuda()


def _bits(x) -> np.ndarray:
    if hasattr(x, "cpu"):
        import torch

        return x.view(torch.int16 if x.element_size() == 2 else torch.int32).cpu().numpy()
    return (x.view(np.uint16) if x.dtype.itemsize == 2 else x.view(np.uint32)).get()


# (the issue's case, the argument the bad call replaces, the error)
ISSUE_CASES = {
    "lse-inside-q": (issue_case_lse_in_q, "lse", r"lse \(shape \(3, 4, 3\)\) shares memory with q"),
    "decode-out-interleaved-with-q": (issue_case_decode_out_in_q, "out",
                                      r"out \(shape \(1, 1, 8, 127\)\) shares memory with q"),
}


@pytest.mark.parametrize("case", ISSUE_CASES)
@pytest.mark.parametrize("kind", ["cupy", "torch"])
@pytest.mark.parametrize("warm", [False, True])
def test_issue_case_is_refused(cuda_engine, rng, warm, kind, case):
    """Issue 27's two fuzzed cases: refused warm (after a valid call of the same shapes) as
    cold, and the memory the bad call names is left as it was."""
    if kind == "torch":
        pytest.importorskip("torch")
    build, arg, error = ISSUE_CASES[case]
    t, bad, buffer, opts = build(rng, put=_put if kind == "cupy" else _torch_put)
    if warm:
        _call(cuda_engine, t, opts)
    before = _bits(buffer)
    with pytest.raises(ValueError, match=error):
        _call(cuda_engine, t, opts, **{arg: bad})
    np.testing.assert_array_equal(_bits(buffer), before)


@settings(max_examples=int(os.environ.get("FERRO_ALIASING_EXAMPLES", "40")), deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(call=aliasing.calls(), warm=st.booleans(), seed=st.integers(0, 2**32 - 1),
       kind=st.sampled_from(["cupy", "torch"]))
def test_overlapping_outputs_are_refused_and_others_run(cuda_engine, call, warm, seed, kind):
    if kind == "torch":
        pytest.importorskip("torch")
    aliasing.check(cuda_engine, aliasing.Memory(kind), call, np.random.default_rng(seed), warm,
                 tol=2e-5)


def test_plan_runs_on_a_given_stream(cuda_engine, rng):
    import cupy

    q, k, v = (_put(rng.standard_normal(s).astype(np.float32))
               for s in ((2, 64, 4, 64), (2, 80, 2, 64), (2, 80, 2, 64)))
    outs = [cupy.full(q.shape, np.nan, np.float32) for _ in range(2)]
    plan = cuda_engine.plan_attention(q, k, v, outs[0])
    stream = cupy.cuda.Stream(non_blocking=True)
    plan.run(q, k, v, outs[0], stream=stream)
    plan.run(q, k, v, outs[1], stream=stream.ptr)
    stream.synchronize()
    cuda_engine.flash_attention_v2_with(q, k, v, want := cupy.full(q.shape, np.nan, np.float32))
    for out in outs:
        assert cupy.array_equal(out, want)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_dropout_seed_is_each_runs_own(cuda_engine, rng, dtype):
    """Calls that differ in their seed alone share one plan's launches; each still runs with its
    own seed, forward and backward, in any order: bit-equal to a fresh engine's call with that
    seed (the CPU tests check the same against the reference backend)."""
    from ferrocupy import AttentionOptions
    from ferrocupy.dtypes import parse

    dt = parse(dtype)
    B, S, H, D = 2, 96, 4, 64
    mk = lambda: _put(rng.standard_normal((B, S, H, D)).astype(np.float32).astype(dt))  # noqa
    q, k, v, go = mk(), mk(), mk(), mk()
    seeds = (3, 2**40 + 9, 4)

    def call(eng, seed):
        import cupy

        o = AttentionOptions(causal=True, dropout_prob=0.3, seed=seed)
        out, lse = cupy.full(q.shape, np.nan, q.dtype), cupy.full((B, H, S), np.nan, np.float32)
        eng.flash_attention_v2_with(q, k, v, out, o, lse=lse)
        grads = [cupy.full(q.shape, np.nan, q.dtype) for _ in range(3)]
        eng.flash_attention_v2_backward_with(q, k, v, out, go, *grads, o, lse=lse)
        return [_bits(x) for x in (out, *grads)]

    want = {s: call(ComputeEngine("cuda", quiet=True), s) for s in seeds}
    assert not np.array_equal(want[3][0], want[4][0])
    for s in (3, 4, 2**40 + 9, 3, 4):
        for got, w in zip(call(cuda_engine, s), want[s]):
            np.testing.assert_array_equal(got, w)
