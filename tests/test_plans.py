"""The front door: plans (`ComputeEngine.plan_attention`, `plan_attention_backward`), kept one per
call shape, and the checks of each call's memory on every call, warm or cold (aliasing and
overlap of outputs with any argument, read-only outputs, kv_lens' values). On the reference
backend here; tests/test_cuda_plans.py runs the same on the GPU."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import aliasing
from aliasing import call_with as _call
from aliasing import issue_case_decode_out_in_q, issue_case_lse_in_q
from ferrocupy import AttentionOptions, ComputeEngine, TensorSpec, UnifiedTensor


@pytest.fixture
def eng():
    return ComputeEngine("reference", quiet=True)


def _qkvo(rng, b=2, sq=3, sk=5, h=4, hkv=2, d=8, dtype=np.float32):
    mk = lambda *s: rng.standard_normal(s).astype(dtype)  # noqa: E731
    return mk(b, sq, h, d), mk(b, sk, hkv, d), mk(b, sk, hkv, d), np.full((b, sq, h, d), np.nan,
                                                                         dtype)


def test_one_plan_per_call_shape(eng, rng):
    q, k, v, out = _qkvo(rng)
    opts = AttentionOptions(causal=True)
    plan = eng.plan_attention(q, k, v, out, opts)
    assert eng.plan_attention(*_qkvo(rng), AttentionOptions(causal=True)) is plan  # equal options
    assert eng.plan_attention(q, k, v, out, AttentionOptions()) is not plan
    assert eng.plan_attention(q, k, v, np.full((2, 4, 3, 8), np.nan, np.float32).transpose(
        0, 2, 1, 3), opts) is not plan  # other strides: another plan
    assert plan.op == "forward" and plan.specs["lse"] is None and plan.dims.seq_k == 5
    assert plan.specs["q"] == TensorSpec((2, 3, 4, 8), (96, 32, 8, 1), np.dtype(np.float32), "cpu")
    plan.run(q, k, v, out)
    want = np.full_like(out, np.nan)
    eng.flash_attention_v2_with(q, k, v, want, opts)
    np.testing.assert_array_equal(out, want)


def test_dropout_plans_differ_in_their_seed_alone(eng, rng):
    """The seed is a value of each run: a call with a new seed reuses the checks and launch plans
    of its call shape (a training step draws a fresh seed every time) but runs with its own
    seed, every time, whichever seed ran before it."""
    q, k, v, _ = _qkvo(rng, sq=6, sk=9)
    opts = {s: AttentionOptions(causal=True, dropout_prob=0.5, seed=s) for s in (1, 2, 2**40 + 3)}
    want = {}
    for s, o in opts.items():  # each seed on a fresh engine: its answer alone
        want[s] = np.full((2, 6, 4, 8), np.nan, np.float32)
        ComputeEngine("reference", quiet=True).flash_attention_v2_with(q, k, v, want[s], o)
    assert not np.array_equal(want[1], want[2])
    first = eng.plan_attention(q, k, v, want[1], opts[1])
    for s in (2, 1, 2**40 + 3, 2, 1):
        out = np.full_like(want[1], np.nan)
        eng.flash_attention_v2_with(q, k, v, out, opts[s])
        np.testing.assert_array_equal(out, want[s])
        plan = eng.plan_attention(q, k, v, out, opts[s])
        assert plan.options is opts[s] and int(plan.params["seed"]) == s & 0xFFFFFFFF
        assert (plan is first) == (s == 1) and plan.dims is first.dims  # checks shared
    assert int(first.params["seed"]) == 1  # a reseeded plan leaves its origin's params alone
    for bad in (True, -1, 2**64, 1.0, np.array([1, 2]), "1"):
        with pytest.raises(ValueError, match="seed must be an int"):
            eng.flash_attention_v2_with(q, k, v, out, AttentionOptions(dropout_prob=0.5,
                                                                        causal=True, seed=bad))


def test_a_plan_made_from_specs_runs_on_tensors(eng, rng):
    q, k, v, out = _qkvo(rng)
    spec = lambda a: TensorSpec.contiguous(a.shape, a.dtype, "cpu")  # noqa: E731
    plan = eng.plan_attention(spec(q), spec(k), spec(v), spec(out))
    plan.run(q, k, v, out=out)
    assert np.isfinite(out).all()
    assert eng.plan_attention(q, k, v, out) is not None


def test_run_refuses_tensors_unlike_the_plan(eng, rng):
    q, k, v, out = _qkvo(rng)
    plan = eng.plan_attention(q, k, v, out)
    with pytest.raises(ValueError, match=r"q \(shape \(2, 3, 4, 16\).*does not match the plan"):
        plan.run(_qkvo(rng, d=16)[0], k, v, out)
    with pytest.raises(ValueError, match="the plan was made without it"):
        plan.run(q, k, v, out, lse=np.empty((2, 4, 3), np.float32))
    with pytest.raises(TypeError, match="unexpected argument 'grad_q'"):
        plan.run(q, k, v, out, grad_q=out)
    assert np.isnan(out).all()  # nothing written


def test_read_only_output_refused_on_every_call(eng, rng):
    q, k, v, out = _qkvo(rng)
    eng.flash_attention_v2_with(q, k, v, out)
    out[...] = np.nan
    out.flags.writeable = False
    for _ in range(2):
        with pytest.raises(ValueError, match=r"out \(shape \(2, 3, 4, 8\)\) is read-only"):
            eng.flash_attention_v2_with(q, k, v, out)


def test_kv_lens_values_checked_on_every_call(eng, rng):
    q, k, v, out = _qkvo(rng, sq=1)
    lens = np.array([5, 2], np.int32)
    eng.flash_attention_v2_with(q, k, v, out, AttentionOptions(), kv_lens=lens)
    lens[1] = 6
    out[...] = np.nan
    with pytest.raises(ValueError, match=r"kv_lens\[1\] = 6 is outside \[0, seq_k = 5\]"):
        eng.flash_attention_v2_with(q, k, v, out, AttentionOptions(), kv_lens=lens)
    assert np.isnan(out).all()


# --- the two aliasing holes found by fuzzing (issue 27), each after a valid warm call -----------
@pytest.mark.parametrize("warm", [False, True])
def test_issue_case_lse_inside_q_is_refused(eng, rng, warm):
    t, bad_lse, qbuf, opts = issue_case_lse_in_q(rng)
    if warm:
        _call(eng, t, opts)
    before = qbuf.copy()
    with pytest.raises(ValueError, match=r"lse \(shape \(3, 4, 3\)\) shares memory with q"):
        _call(eng, t, opts, lse=bad_lse)
    np.testing.assert_array_equal(qbuf, before)


@pytest.mark.parametrize("warm", [False, True])
def test_issue_case_decode_out_interleaved_with_q_is_refused(eng, rng, warm):
    t, bad_out, both, opts = issue_case_decode_out_in_q(rng)
    if warm:
        _call(eng, t, opts)
    before = both.view(np.uint16).copy()
    with pytest.raises(ValueError, match=r"out \(shape \(1, 1, 8, 127\)\) shares memory with q"):
        _call(eng, t, opts, out=bad_out)
    np.testing.assert_array_equal(both.view(np.uint16), before)


# --- every way views can overlap ------------------------------------------------------------------
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(call=aliasing.calls(extras=True), warm=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_overlapping_outputs_are_refused_and_others_run(call, warm, seed):
    aliasing.check(ComputeEngine("reference", quiet=True), aliasing.Memory(), call,
                 np.random.default_rng(seed), warm, tol=1e-12)


def test_the_strategy_draws_both_outcomes():
    """The property above is not vacuous: its calls are refused and accepted, interleaved too.
    (Any example shows a case is reachable, so none is shrunk; a fixed seed keeps it quick and
    the same on every run.)"""
    import random

    from hypothesis import Phase, find

    def draws(condition, extras=False):
        find(aliasing.calls(extras=extras), condition, random=random.Random(0),
             settings=settings(max_examples=5000, database=None, phases=[Phase.generate]))

    draws(lambda c: c.expect_error())
    draws(lambda c: not c.expect_error())
    draws(lambda c: c.expect_error() and any(
        c.places[n][0] - c.places["q"][0] == c.shapes["q"][3] for n in ("out", "grad_q")
        if n in c.places))

    def grad_sinks_meets_sinks(c):
        (lo, hi), (lo2, hi2) = (c.spans().get(n, (0, 0)) for n in ("grad_sinks", "sinks"))
        return lo < hi2 and lo2 < hi

    draws(grad_sinks_meets_sinks, extras=True)


def test_unified_tensors_and_arrays_share_plans(eng, rng):
    q, k, v, out = _qkvo(rng)
    plan = eng.plan_attention(q, k, v, out)
    wrapped = [UnifiedTensor(x) for x in (q, k, v, out)]
    assert eng.plan_attention(*wrapped) is plan
    plan.run(*wrapped)
    assert np.isfinite(out).all()
