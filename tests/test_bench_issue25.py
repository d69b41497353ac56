"""Issue 25's benchmark pieces on the CPU: the training-step, bias and window cases, the
`sdpa-default` and FlexAttention peers and ferrocupy's training step through
`ferrocupy.torch.attention` (PyTorch on the CPU; ferrocupy's reference backend), each checked
against the float64 reference before it is timed, and the gate block. No GPU needed."""

from __future__ import annotations

import math

import numpy as np
import pytest

from test_bench_harness import HostEvents, _ok, cpu_pipeline  # noqa: F401 - the fixture

import compare
import harness
import peers
import report
from harness import Case, attention_flops

torch = pytest.importorskip("torch")
import torch_peers  # noqa: E402


@pytest.fixture
def cpu_torch(cpu_pipeline, monkeypatch):  # noqa: F811
    """cpu_pipeline with PyTorch's CPU build as the peers' torch; FlexAttention uncompiled
    (compiling it on the CPU takes seconds; the compiled one is the GPU's business)."""
    from torch.nn.attention.flex_attention import flex_attention

    monkeypatch.setattr(harness, "torch_cuda", lambda: torch)
    monkeypatch.setattr(harness, "torch_stream_for_cupy", lambda t: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setitem(torch_peers._FLEX, "fn", flex_attention)


# One input set, one warm-up call, one timed call: eager FlexAttention takes ~0.3 s a call here.
SETTINGS = harness.Settings(1, 1, 1, 1, min_warmup=1, settle_ms=0)
TRAIN = Case("attn", "float32", 2, 40, 40, 4, 2, 16, True, direction="step", suite="train")
BIAS = Case("attn", "float32", 2, 40, 40, 4, 4, 16, False, suite="bias")
WINDOW = Case("attn", "float32", 1, 48, 48, 4, 2, 16, True, suite="window", window=8)
PLAIN = Case("attn", "float32", 1, 48, 48, 4, 2, 16, True, suite="window")


def _run(case):
    return compare.run_case(case, SETTINGS, 0, HostEvents())


# --- the cases ------------------------------------------------------------------------------------
def test_issue25_cases_in_the_full_set():
    full = harness.build_cases(["bfloat16"])
    ids = [c.id for c in full if c.suite in ("train", "bias", "window")]
    assert ids == ["train-step-bfloat16-b4-h16kv16-d128-s4096-causal",
                   "train-step-bfloat16-b2-h32kv8-d128-s8192-causal",
                   "train-step-bfloat16-b8-h16kv4-d64-s2048-causal",
                   "bias-fwd-bfloat16-b4-h16-d128-s4096-noncausal",
                   "window-fwd-bfloat16-b1-h32kv8-d128-s16384-causal-w4096",
                   "window-fwd-bfloat16-b1-h32kv8-d128-s16384-causal-w0"]
    assert not [c for c in harness.build_cases(["float16", "float32"]) if c.suite == "train"]
    assert not [c for c in harness.build_cases(["bfloat16"], quick=True) if c.suite == "bias"]
    for i in ids:
        assert harness.case_by_id(i).id == i
    step = harness.case_by_id(ids[0])
    assert step.flops == attention_flops(4, 16, 4096, 4096, 128, True) * 7 // 2
    assert step.tolerance == harness.ATTN_TOL["bfloat16"][1]
    bias = harness.case_by_id(ids[3])
    assert bias.bytes == 2 * 4 * 4096 * 16 * 128 * 2 * 2 + 16 * 4096 * 4096 * 2
    assert peers.implementations(bias) == ["ferrocupy", "torch-sdpa-default", "torch-flash",
                                           "torch-efficient", "torch-cudnn", "torch-flex"]
    assert peers.implementations(step)[:2] == ["ferrocupy", "torch-sdpa-default"]
    assert "torch-flex" not in peers.implementations(step)
    grid = harness.case_by_id("attn-fwd-float16-d64-s1024-causal")
    assert peers.implementations(grid) == ["ferrocupy", "torch-sdpa-default", "torch-flash",
                                           "torch-efficient", "torch-cudnn", "torch-math"]


@pytest.mark.parametrize("causal,window,offset", [(True, 8, 0), (False, 8, 0), (True, 0, 0),
                                                  (True, 5, 3), (False, 0, 0)])
def test_window_flops_count_visible_pairs(causal, window, offset):
    rows, cols = np.arange(20)[:, None] + offset, np.arange(24)[None]
    seen = ((cols <= rows) if causal else np.ones((20, 24), bool)) & (
        (np.abs(rows - cols) < window) if window else True)
    assert harness.visible_pairs(20, 24, causal, window, offset) == int(seen.sum())
    case = Case("attn", "float32", 2, 20, 24, 4, 2, 16, causal, offset, suite="window",
                window=window)
    assert case.flops == 4 * 2 * 4 * 16 * int(seen.sum())
    x = torch_peers.window_visible(torch.arange(20)[:, None], torch.arange(24)[None], causal,
                                   window)
    if not offset:
        assert np.array_equal(x.numpy(), seen)


# --- the pipeline, PyTorch on the CPU -------------------------------------------------------------
@pytest.mark.parametrize("case", [TRAIN, BIAS, WINDOW, PLAIN], ids=lambda c: c.id)
def test_issue25_cases_check_then_time(cpu_torch, case):
    res = _run(case)
    ran = {"ferrocupy", "torch-sdpa-default"} | ({"torch-flex"} if case.suite != "train" else set())
    for name in ran:
        assert res[name]["status"] == "ok", (name, res[name])
        assert res[name]["rel_err"] < 1e-6 and res[name]["ms"] > 0
    for name in ("torch-cudnn", "torch-efficient"):       # CUDA only
        assert res[name]["status"] == "skipped" and "rejects this case" in res[name]["reason"]
    assert "torch-math" not in res
    row = report.summarize(case, res, None)
    assert row["ratios"]["torch-sdpa-default"] > 0 and row["window"] == case.window


def test_sdpa_default_on_the_grid(cpu_torch):
    case = Case("attn", "float32", 2, 40, 40, 4, 2, 16, True, direction="bwd", suite="gqa")
    res = _run(case)
    assert res["torch-sdpa-default"]["status"] == "ok" and res["ferrocupy"]["status"] == "ok"
    assert res["torch-sdpa-default"]["rel_err"] < 1e-6


def test_training_step_in_bfloat16(cpu_torch):
    case = Case("attn", "bfloat16", 1, 32, 32, 4, 2, 16, True, direction="step", suite="train")
    run = peers.CaseRun(case, l2_bytes=0)
    for impl in ("ferrocupy", "torch-sdpa-default"):
        prep, err = peers.prepare_checked(run, impl)
        assert 1e-5 < err < case.tolerance / 2, (impl, err)
        out, grads = prep.run_next()
        assert out.dtype == torch.bfloat16 and all(g.dtype == torch.bfloat16 for g in grads)


# --- wrong answers are refused --------------------------------------------------------------------
def test_a_window_off_by_one_is_refused(cpu_torch, monkeypatch):
    """The peers' masks planted one key wider than ferrocupy's rule (|i - j| <= window)."""
    rule = torch_peers.window_visible
    monkeypatch.setattr(torch_peers, "window_visible",
                        lambda r, c, causal, w: rule(r, c, causal, w + 1 if w else 0))
    res = _run(WINDOW)
    assert res["ferrocupy"]["status"] == "ok"
    for name in ("torch-sdpa-default", "torch-flex"):
        assert res[name]["status"] == "wrong" and "not timed" in res[name]["reason"], res[name]
    assert {r["status"] for r in _run(PLAIN).values()} == {"ok", "skipped"}


def test_a_bias_left_out_is_refused(cpu_torch, monkeypatch):
    monkeypatch.setattr(torch_peers, "_bias_mod", lambda bias: lambda s, b, h, q, k: s)
    res = _run(BIAS)
    assert res["torch-flex"]["status"] == "wrong" and res["torch-sdpa-default"]["status"] == "ok"


def test_a_wrong_training_step_is_refused(cpu_torch, monkeypatch):
    """ferrocupy's training step planted non-causal: its out and gradients are off."""
    import ferrocupy.torch

    attention = ferrocupy.torch.attention
    monkeypatch.setattr(ferrocupy.torch, "attention",
                        lambda *a, causal, **kw: attention(*a, causal=False, **kw))
    res = _run(TRAIN)
    assert res["ferrocupy"]["status"] == "wrong", res["ferrocupy"]
    assert res["torch-sdpa-default"]["status"] == "ok"
