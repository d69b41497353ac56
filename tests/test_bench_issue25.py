"""Issue 25's benchmark pieces on the CPU: the training-step, bias and window cases, the
`sdpa-default` and FlexAttention peers and ferrocupy's training step through
`ferrocupy.torch.attention` (PyTorch on the CPU; ferrocupy's reference backend), each checked
against the float64 reference before it is timed, and the gate block. No GPU needed."""

from __future__ import annotations

import math
from dataclasses import replace

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
BIAS_BWD = replace(BIAS, direction="bwd")
DROPOUT = Case("attn", "float32", 2, 40, 40, 4, 4, 16, True, suite="dropout", dropout=0.1)
# a chunk of 16 queries into a cache of capacity 48 holding 36 keys (bottom-right causal)
KVLENS = Case("attn", "float32", 2, 16, 48, 4, 4, 16, True, 32, suite="kvlens", kv_len=36)


def _run(case):
    return compare.run_case(case, SETTINGS, 0, HostEvents())


# --- the cases ------------------------------------------------------------------------------------
ISSUE25_IDS = [
    "train-step-bfloat16-b4-h16kv16-d128-s4096-causal",
    "train-step-bfloat16-b2-h32kv8-d128-s8192-causal",
    "train-step-bfloat16-b8-h16kv4-d64-s2048-causal",
    "bias-fwd-bfloat16-b4-h16-d128-s4096-noncausal",
    "bias-bwd-bfloat16-b4-h16-d128-s4096-noncausal",
    "window-fwd-bfloat16-b1-h32kv8-d128-s16384-causal-w4096",
    "window-fwd-bfloat16-b1-h32kv8-d128-s16384-causal-w0",
    "dropout-fwd-bfloat16-b4-h16kv16-d128-s4096-causal-p0.1",
    "dropout-fwd-bfloat16-b4-h16kv16-d128-s4096-causal-p0",
    "dropout-bwd-bfloat16-b4-h16kv16-d128-s4096-causal-p0.1",
    "dropout-bwd-bfloat16-b4-h16kv16-d128-s4096-causal-p0",
    "kvlens-fwd-bfloat16-b16-h16kv16-d128-s1024-sk4096-causal-kvlen3072",
    "kvlens-fwd-bfloat16-b16-h16kv16-d128-s1024-sk4096-causal-kvlen0",
    "gqa-fwd-bfloat16-h32kv32-d128-s4096-causal",
    "gqa-bwd-bfloat16-h32kv32-d128-s4096-causal",
]
# Each option case of the gate and its plain call (the same shape without the option).
OPTION_PAIRS = {
    "window-fwd-bfloat16-b1-h32kv8-d128-s16384-causal-w4096":
        "window-fwd-bfloat16-b1-h32kv8-d128-s16384-causal-w0",
    "dropout-fwd-bfloat16-b4-h16kv16-d128-s4096-causal-p0.1":
        "dropout-fwd-bfloat16-b4-h16kv16-d128-s4096-causal-p0",
    "dropout-bwd-bfloat16-b4-h16kv16-d128-s4096-causal-p0.1":
        "dropout-bwd-bfloat16-b4-h16kv16-d128-s4096-causal-p0",
    "kvlens-fwd-bfloat16-b16-h16kv16-d128-s1024-sk4096-causal-kvlen3072":
        "kvlens-fwd-bfloat16-b16-h16kv16-d128-s1024-sk4096-causal-kvlen0",
    "gqa-fwd-bfloat16-h32kv8-d128-s4096-causal": "gqa-fwd-bfloat16-h32kv32-d128-s4096-causal",
    "gqa-bwd-bfloat16-h32kv8-d128-s4096-causal": "gqa-bwd-bfloat16-h32kv32-d128-s4096-causal",
}


def test_issue25_cases_in_the_full_set():
    full = harness.build_cases(["bfloat16"])
    assert [c.id for c in harness.issue25_cases("bfloat16")] == ISSUE25_IDS
    ids = ISSUE25_IDS
    assert set(ids) <= {c.id for c in full}
    assert not [c for c in harness.build_cases(["float16", "float32"]) if c.suite == "train"]
    assert not [c for c in harness.build_cases(["bfloat16"], quick=True) if c.suite == "bias"]
    for i in ids:
        assert harness.case_by_id(i).id == i
    step = harness.case_by_id(ids[0])
    assert step.flops == attention_flops(4, 16, 4096, 4096, 128, True) * 7 // 2
    assert step.tolerance == harness.ATTN_TOL["bfloat16"][1]
    bias = harness.case_by_id("bias-fwd-bfloat16-b4-h16-d128-s4096-noncausal")
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


def test_option_cases_pair_with_their_plain_calls():
    """Every option case of the full set names its plain call, which is in the set: the same
    shape, dtype and direction without the option. GQA outside bfloat16 is not gated."""
    full = {c.id: c for c in harness.build_cases(harness.DTYPES)}
    assert {i: c.plain_call.id for i, c in full.items()
            if c.plain_call and not c.issue26} == OPTION_PAIRS
    same = ("kind", "dtype", "batch", "seq_q", "seq_k", "heads", "head_dim", "causal",
            "causal_offset", "direction", "suite")
    for opt, plain in OPTION_PAIRS.items():
        o, p = full[opt], full[plain]
        assert p.plain_call is None and all(getattr(o, f) == getattr(p, f) for f in same)
        assert o.dtype == "bfloat16" and o.head_dim == 128 and o.causal
        assert (o.window, o.dropout, o.kv_len, o.kv_heads) != (p.window, p.dropout, p.kv_len,
                                                               p.kv_heads)
    drop = full["dropout-bwd-bfloat16-b4-h16kv16-d128-s4096-causal-p0.1"]
    assert drop.dropout == harness.DROPOUT_P == 0.1 and drop.kv_heads == drop.heads == 16
    assert drop.flops == attention_flops(4, 16, 4096, 4096, 128, True, "bwd")
    kv = full["kvlens-fwd-bfloat16-b16-h16kv16-d128-s1024-sk4096-causal-kvlen3072"]
    assert (kv.seq_q, kv.seq_k, kv.causal_offset, kv.kv_len) == (1024, 4096, 3072, 3072)
    gqa = full["gqa-fwd-bfloat16-h32kv8-d128-s4096-causal"]
    assert gqa.flops == full[OPTION_PAIRS[gqa.id]].flops          # the same query work
    assert full["gqa-fwd-float16-h32kv8-d128-s4096-causal"].plain_call is None
    assert full["bias-bwd-bfloat16-b4-h16-d128-s4096-noncausal"].plain_call is None
    for i in ("dropout-fwd-bfloat16-b4-h16kv16-d128-s4096-causal-p0", kv.id):
        assert peers.implementations(full[i]) == ["ferrocupy"]
    assert "torch-math" in peers.implementations(gqa)                # the grid's, unchanged
    assert peers.implementations(full[OPTION_PAIRS[gqa.id]]) == [
        "ferrocupy", "torch-sdpa-default", "torch-flash", "torch-efficient", "torch-cudnn"]
    assert peers.implementations(full["bias-bwd-bfloat16-b4-h16-d128-s4096-noncausal"]) == \
        peers.implementations(full["bias-fwd-bfloat16-b4-h16-d128-s4096-noncausal"])


@pytest.mark.parametrize("sq,sk,offset,kv_len", [(16, 48, 32, 36), (16, 48, 32, 0),
                                                 (20, 20, 0, 15), (8, 40, 0, 40), (4, 30, 26, 2)])
def test_kv_lens_flops_count_visible_pairs(sq, sk, offset, kv_len):
    """SPEC's rule: batch b holds n = kv_lens[b] keys and row i sits at i + offset + n - Sk."""
    n = kv_len or sk
    rows, cols = np.arange(sq)[:, None] + offset + n - sk, np.arange(sk)[None]
    seen = (cols <= rows) & (cols < n)
    case = Case("attn", "bfloat16", 2, sq, sk, 4, 4, 16, True, offset, suite="kvlens",
                kv_len=kv_len)
    assert case.flops == 4 * 2 * 4 * 16 * int(seen.sum())
    step = replace(case, direction="bwd")
    assert step.flops == case.flops * 5 // 2


def test_kv_lens_case_flops():
    """The kv_lens case: the last of 1024 rows sees the 3072 keys held, the first 2049; the plain
    call's first row 3073 keys, its last all 4096."""
    kv = harness.case_by_id("kvlens-fwd-bfloat16-b16-h16kv16-d128-s1024-sk4096-causal-kvlen3072")
    plain = kv.plain_call
    per_pair = 4 * 16 * 16 * 128
    assert kv.flops == per_pair * sum(2049 + i for i in range(1024))
    assert plain.flops == per_pair * sum(3073 + i for i in range(1024))


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


@pytest.mark.parametrize("case", [
    replace(c, dtype=dt) for dt in ("float32", "bfloat16") for c in (
        DROPOUT, replace(DROPOUT, dropout=0.0), replace(DROPOUT, direction="bwd"),
        replace(DROPOUT, direction="bwd", dropout=0.0), KVLENS, replace(KVLENS, kv_len=0))],
    ids=lambda c: c.id)
def test_option_cases_check_then_time(cpu_pipeline, case):  # noqa: F811
    """ferrocupy alone (no peer draws its dropout mask or takes a causal_offset), checked against
    the float64 reference with the exact dropout mask and kv_lens before it is timed; bfloat16
    well inside its tolerance (a wrong mask is off by tens of percent)."""
    res = _run(case)
    assert list(res) == ["ferrocupy"]
    assert res["ferrocupy"]["status"] == "ok", res["ferrocupy"]
    err = res["ferrocupy"]["rel_err"]
    assert (err < 1e-6 if case.dtype == "float32" else 1e-5 < err < case.tolerance / 4), err
    assert res["ferrocupy"]["ms"] > 0


def test_kv_cache_past_kv_lens_holds_nan(cpu_pipeline):  # noqa: F811
    run = peers.CaseRun(KVLENS, l2_bytes=1 << 40)
    for name in ("k", "v"):
        x = run.sets[0][name]
        assert np.isnan(x[:, KVLENS.kv_len:]).all() and np.isfinite(x[:, :KVLENS.kv_len]).all()
    assert np.isfinite(run.reference["out"][(0, 0)]).all()


def test_bias_backward_against_sdpa(cpu_torch):
    """The bias backward: ferrocupy's given the forward's lse and the bias, SDPA's through
    autograd with the same attn_mask; FlexAttention only forward."""
    res = _run(BIAS_BWD)
    for name in ("ferrocupy", "torch-sdpa-default"):
        assert res[name]["status"] == "ok" and res[name]["rel_err"] < 1e-6, (name, res[name])
    assert res["torch-flex"]["status"] == "skipped" and "forward" in res["torch-flex"]["reason"]


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


def test_a_dropout_mask_other_than_specs_is_refused(cpu_torch, monkeypatch):
    """ferrocupy planted with another seed (the mask SPEC's Philox would not draw), then with
    dropout left out: forward and backward fail the check."""
    import ferrocupy

    options = ferrocupy.AttentionOptions
    for plant in ({"seed": harness.DROPOUT_SEED + 1}, {"dropout_prob": 0.0, "seed": 0}):
        monkeypatch.setattr(ferrocupy, "AttentionOptions", lambda **kw: options(**{**kw, **plant}))
        for case in (DROPOUT, replace(DROPOUT, direction="bwd")):
            res = _run(case)["ferrocupy"]
            assert res["status"] == "wrong" and "not timed" in res["reason"], (plant, res)


def test_reading_past_kv_lens_is_refused(cpu_pipeline, monkeypatch):  # noqa: F811
    """ferrocupy planted to ignore kv_lens (every slot of the cache read), then to read one key
    past it: the NaN there reaches the output and fails the check."""
    from ferrocupy import UnifiedTensor

    engine = peers._ENGINE["engine"]
    forward = engine.flash_attention_v2_with
    for plant in (lambda kv: None, lambda kv: UnifiedTensor(kv.buffer() + 1)):
        monkeypatch.setattr(engine, "flash_attention_v2_with", lambda *a, kv_lens=None, **kw:
                            forward(*a, kv_lens=plant(kv_lens), **kw))
        res = _run(KVLENS)["ferrocupy"]
        assert res["status"] == "wrong" and "rel err inf" in res["reason"], res


def test_a_bias_backward_without_the_bias_is_refused(cpu_torch, monkeypatch):
    engine = peers._ENGINE["engine"]
    backward = engine.flash_attention_v2_backward_with
    monkeypatch.setattr(engine, "flash_attention_v2_backward_with",
                        lambda *a, **kw: backward(*a[:9], None, **kw))
    res = _run(BIAS_BWD)
    assert res["ferrocupy"]["status"] == "wrong" and res["torch-sdpa-default"]["status"] == "ok"


# --- the gate block -------------------------------------------------------------------------------
def _row(case, ferro_ms, default_ms):
    res = {"ferrocupy": _ok(ferro_ms, case) if ferro_ms else {"status": "wrong", "reason": "x"},
           "torch-sdpa-default": _ok(default_ms, case), "torch-flash": _ok(0.5, case)}
    return report.summarize(case, res, None)


def _grid(dtype, direction, ratio, skip=()):
    rows = []
    for d in harness.GATE25_DIMS:
        for s in harness.GATE25_SEQS:
            for causal in (False, True):
                case = Case("attn", dtype, 16384 // s, s, s, 2048 // d, 2048 // d, d, causal,
                            direction=direction)
                if case.id not in skip:
                    rows.append(_row(case, 1.0, ratio))
    return rows


def test_gate_block_passes_and_fails_per_line():
    fwd = _grid("bfloat16", "fwd", 1.2)                            # every case and mean pass
    bwd = _grid("bfloat16", "bwd", 1.05)
    bwd[0] = _row(harness.case_by_id(bwd[0]["case"]), 1.0, 0.85)   # one case under 0.9
    fp16 = _grid("float16", "fwd", 1.05, skip={"attn-fwd-float16-d64-s1024-causal"})
    fp16[0] = _row(harness.case_by_id(fp16[0]["case"]), None, 1.0)  # ferrocupy wrong: no ratio
    other = [harness.case_by_id(f"attn-fwd-bfloat16-d128-s{s}-causal") for s in (512, 2048)]
    cases = {c.id: c for c in harness.issue25_cases("bfloat16")}
    ids = list(cases)
    special = [_row(cases[ids[0]], 1.0, 1.1), _row(cases[ids[1]], 1.0, 0.9),
               _row(cases[ids[3]], 1.0, 1.3)]
    window, plain = cases[ids[5]], cases[ids[6]]
    # the window at 0.95x and the plain call's TFLOP/s, each over its own visible keys
    ms_window = window.flops / (0.95 * plain.flops / 2.0)
    rows = (fwd + bwd + fp16 + [_row(c, 1.0, 2.0) for c in other] + special
            + [_row(window, ms_window, 1.0), _row(plain, 2.0, 1.0)])
    lines = report.gate25_lines(rows)
    assert lines[0].startswith("issue-25 gate (ferrocupy / torch's default SDPA, same run; "
                               "forward >= 1.0x each and >= 1.1x geometric mean")
    body = lines[1:-1]
    # the grid (12 + 12 + 11 lines and a mean each), 3 special cases (2 train, bias), window
    assert len(body) == 12 + 1 + 12 + 1 + 11 + 1 + 3 + 1
    by_case = {line.split(":")[0].strip(): line for line in body}
    assert by_case["attn-fwd-bfloat16-d64-s1024-noncausal"] == (
        "  attn-fwd-bfloat16-d64-s1024-noncausal: 1.20x sdpa-default, need >= 1.00: PASS")
    assert by_case[bwd[0]["case"]].endswith("0.85x sdpa-default, need >= 0.90: FAIL")
    assert by_case[fp16[0]["case"]].endswith("no ratio (ferrocupy or sdpa-default has no "
                                             "number), need >= 1.00: FAIL")
    assert by_case["bfloat16 forward geometric mean"].endswith("1.20x sdpa-default, "
                                                               "need >= 1.10: PASS")
    geo = math.exp((11 * math.log(1.05) + math.log(0.85)) / 12)
    assert by_case["bfloat16 backward (given lse) geometric mean"].endswith(
        f"{geo:.2f}x sdpa-default, need >= 1.00: {'PASS' if geo >= 1 else 'FAIL'}")
    assert by_case["float16 forward geometric mean"].endswith(
        "need >= 1.10: INCOMPLETE (10 of the 12 cases have a ratio)")
    assert by_case[ids[0]].endswith("1.10x sdpa-default (forward + backward), need >= 1.00: PASS")
    assert by_case[ids[1]].endswith("0.90x sdpa-default (forward + backward), need >= 1.00: FAIL")
    assert by_case[ids[3]].endswith("1.30x sdpa-default with the same bias, need >= 1.25: PASS")
    assert by_case[window.id].endswith(f"0.95x the plain call's TFLOP/s ({plain.id}; visible "
                                       f"keys), need >= 0.90: PASS")
    assert not any(c.id in by_case for c in other)            # S512, S2048: not the gate's
    assert ids[6] not in by_case                              # the plain call: no line of its own
    passed = sum(line.endswith(": PASS") for line in body)
    assert lines[-1] == f"  {passed} of {len(body)} lines PASS"
    assert passed == len(body) - 1 - 1 - 1 - 1 - (geo < 1)    # bwd case, fp16 x2, train
    slow = report.gate25_lines([_row(window, ms_window * 1.1, 1.0), _row(plain, 2.0, 1.0)])
    assert slow[1].endswith("0.86x the plain call's TFLOP/s "
                            f"({plain.id}; visible keys), need >= 0.90: FAIL")
    alone = report.gate25_lines([_row(window, ms_window, 1.0)])
    assert alone[1].endswith("no ratio (ferrocupy has no number here or on the plain call), "
                             "need >= 0.90: FAIL")
    assert report.gate25_lines(other and [_row(c, 1.0, 2.0) for c in other]) == []


def _option_rows(ratios: dict) -> list[dict]:
    """Rows of the full set's option cases, each at ferrocupy TFLOP/s = ratios[id] x its plain
    call's (None: ferrocupy gave a wrong answer), then their plain calls."""
    cases = {c.id: c for c in harness.build_cases(["bfloat16"])}
    rows, plains = [], []
    for opt, x in ratios.items():
        o, p = cases[opt], cases[OPTION_PAIRS[opt]]
        rows.append(_row(o, x and o.flops / (x * p.flops / 2.0), 1.0))
        plains.append(_row(p, 2.0, 1.0))
    return rows + plains


def test_gate_block_holds_each_option_case_to_its_plain_call():
    ids = list(OPTION_PAIRS)
    ratios = dict(zip(ids, (0.95, 0.91, 0.89, 1.2, 0.5, None)))
    bias_bwd = harness.case_by_id("bias-bwd-bfloat16-b4-h16-d128-s4096-noncausal")
    fp16_gqa = harness.case_by_id("gqa-fwd-float16-h32kv8-d128-s4096-causal")
    rows = _option_rows(ratios) + [_row(bias_bwd, 1.0, 0.5), _row(fp16_gqa, 1.0, 0.5)]
    lines = report.gate25_lines(rows)
    assert lines[0].endswith("window, dropout, kv_lens and GQA >= 0.9x their plain calls):")
    want = [f"  {i}: {x:.2f}x the plain call's TFLOP/s ({OPTION_PAIRS[i]}; visible keys), "
            f"need >= 0.90: {'PASS' if x >= 0.9 else 'FAIL'}" for i, x in ratios.items() if x]
    want.append(f"  {ids[-1]}: no ratio (ferrocupy has no number here or on the plain call), "
                f"need >= 0.90: FAIL")
    assert lines[1:-1] == want                   # no line for the plain calls, the bias
    assert lines[-1] == "  3 of 6 lines PASS"    # backward or float16's GQA
    assert [line.endswith("PASS") for line in want] == [True, True, False, True, False, False]
    no_plain = [r for r in rows if r["case"] != OPTION_PAIRS[ids[3]]]
    assert report.gate25_lines(no_plain)[4] == (
        f"  {ids[3]}: no ratio (ferrocupy has no number here or on the plain call), "
        f"need >= 0.90: FAIL")
    assert report.gate25_lines(rows[len(ids):]) == []            # the plain calls alone


def test_compare_list_shows_the_option_cases(capsys):
    """The docstring's gate subset lists every issue-25 case, each option case marked with its
    plain call."""
    import re

    subset = re.search(r"--cases (\S*train-\S*)", compare.__doc__).group(1)
    assert subset == "s1024-,s4096-,s16384-,train-,bias-,window-,dropout-,kvlens-,gqa-"
    assert compare.main(["--list", "--dtype", "bf16,fp16", "--cases", subset]) == 0
    lines = capsys.readouterr().out.splitlines()
    listed = {line.split()[0]: line for line in lines[:-1]}
    assert set(ISSUE25_IDS) | set(OPTION_PAIRS) <= set(listed)
    for opt, plain in OPTION_PAIRS.items():
        assert listed[opt].endswith(f"  [issue-25 gate: vs {plain}]") and listed[plain] == plain
    assert lines[-1].startswith(f"{len(listed)} cases, dtypes bfloat16, float16, full set")


def fake_device(monkeypatch, cases):
    """compare.py on the CPU: a device, its ceilings and its case list (`cases`, whatever the
    flags) faked; the quick set's settings one call each, timed on the host clock."""
    info = {"date": "2026-01-01 00:00 UTC", "gpu": "CPU stand-in", "compute_capability": "9.0",
            "sms": 1, "memory_gib": 1.0, "l2_mb": 0.0, "l2_bytes": 0, "driver": "-",
            "cuda_runtime": "-", "cupy": "-", "cupy_tf32": "0", "python": "3", "torch": None}
    monkeypatch.setattr(harness, "gpu_status", lambda: (True, ""))
    monkeypatch.setattr(harness, "device_info", lambda: info)
    monkeypatch.setattr(harness, "measure_ceilings", lambda d, s: {
        "copy_gbps": 1.0, "copy": {"x": 1.0}, "matmul_tflops": {"float32": 1.0},
        "matmul": {"float32": "x"}})
    monkeypatch.setattr(harness, "build_cases", lambda dtypes, quick: cases)
    monkeypatch.setattr(harness, "QUICK", SETTINGS)
    monkeypatch.setattr(harness, "CupyEvents", HostEvents)


def test_compare_prints_the_gate_last(cpu_torch, monkeypatch, capsys):
    """compare.py's whole run on the CPU (device, ceilings and case list faked): the new cases
    measured and the issue-25 block printed after the tables."""
    fake_device(monkeypatch, [TRAIN, BIAS, BIAS_BWD, WINDOW, PLAIN, DROPOUT, DROPOUT.plain_call,
                              KVLENS, KVLENS.plain_call])
    assert compare.main(["--quick", "--dtype", "float32", "--cases",
                         "train-,bias-,window-,dropout-,kvlens-"]) == 0
    out = capsys.readouterr().out
    gate = out[out.index("issue-25 gate"):].splitlines()
    assert out.index("vs sdpa-default") < out.index("issue-25 gate")
    assert [line.split(":")[0].strip() for line in gate[1:-1]] == [TRAIN.id, BIAS.id, WINDOW.id,
                                                                   DROPOUT.id, KVLENS.id]
    for line, case in zip(gate[3:6], (WINDOW, DROPOUT, KVLENS)):
        assert f"the plain call's TFLOP/s ({case.plain_call.id}; visible keys)" in line
    assert gate[-1].endswith("lines PASS") and "vs flex" in out
    assert BIAS_BWD.id in out[:out.index("issue-25 gate")]       # in the table, not gated
