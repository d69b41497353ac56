"""The benchmark harness's pure parts, on the CPU: FLOP and byte counts, the case list, the timer
logic (with injected fake events), the summary, the table, the plot, and the whole
check-then-time pipeline with NumPy standing in for CuPy and ferrocupy's reference backend
standing in for its CUDA one. No GPU needed."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import types
from pathlib import Path

import numpy as np
import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))

import compare  # noqa: E402
import harness  # noqa: E402
import peers  # noqa: E402
import report  # noqa: E402
from harness import Case, attention_flops, build_cases  # noqa: E402


# --- counting -------------------------------------------------------------------------------------
def test_attention_flops_follow_flashattention_convention():
    f = 4 * 4 * 16 * 4096 * 4096 * 128
    assert attention_flops(4, 16, 4096, 4096, 128, False) == f == 549_755_813_888
    assert attention_flops(4, 16, 4096, 4096, 128, True) == f // 2
    assert attention_flops(4, 16, 4096, 4096, 128, False, "bwd") == f * 5 // 2
    assert attention_flops(4, 16, 4096, 4096, 128, True, "bwd") == f * 5 // 4


def test_case_counts_and_units():
    c = Case("attn", "float32", 4, 4096, 4096, 16, 16, 128, True, direction="bwd")
    assert c.flops == attention_flops(4, 16, 4096, 4096, 128, True, "bwd")
    assert c.unit == "TFLOP/s" and c.throughput(1.0) == pytest.approx(c.flops / 1e-3 / 1e12)
    dec = Case("decode", "float32", 16, 1, 32768, 32, 8, 128, True, 32767, suite="decode")
    assert dec.bytes == 2 * 16 * 32768 * 8 * 128 * 4 == 4 << 30      # K and V
    assert dec.flops == 4 * 16 * 32 * 32768 * 128                      # every key visible
    assert dec.unit == "GB/s" and dec.throughput(1.0) == pytest.approx(2**32 / 1e-3 / 1e9)
    rope = Case("rope", "bfloat16", shape=(16, 4096, 32, 128), suite="rope")
    assert rope.bytes == 2 * 16 * 4096 * 32 * 128 * 2 and rope.flops == 0
    assert np.isnan(rope.throughput(0))
    assert Case("rope", "float32", shape=harness.FLOOR_ROPE_SHAPE).bytes == 2 << 30


def test_case_list_sizes():
    # grid, GQA, decode (3 at one row a head, 1 at four), RoPE (+ the floor) and its 4 forms
    assert len(build_cases(["float32"])) == 48 + 2 + 4 + 2 + 4
    # issue 25's bfloat16 cases: 3 training steps, the bias (fwd, bwd), the window and dropout
    # (fwd, bwd) and kv_lens each beside its plain call, GQA's plain calls (fwd, bwd); issue 26's
    # (bfloat16): head_dim 256 (8), varlen and its dense calls (8), paged decode at 2 page sizes
    # and contiguous (3 shapes x 3), 3 model options and the plain call (fwd, bwd)
    assert len(build_cases(harness.DTYPES)) == (3 * (48 + 2 + 4 + 1 + 4) + 1 + 3 + 2 + 2 + 4
                                                + 2 + 2 + 8 + 8 + 9 + 8)
    assert len(build_cases(["float32"], quick=True)) == 8 + 1 + 2 + 4
    assert len(build_cases(harness.DTYPES, quick=True)) == 3 * (8 + 1 + 1 + 4) + 1
    assert not [c for c in build_cases(["bfloat16", "float16"]) if c.floor]
    full = build_cases(harness.DTYPES)
    assert len({c.id for c in full}) == len(full)
    assert {c.id for c in build_cases(harness.DTYPES, quick=True)} <= {c.id for c in full}
    for c in full:
        assert harness.case_by_id(c.id) == c
        if c.suite == "grid":
            assert c.batch * c.seq_q == 16384 and c.heads * c.head_dim == 2048
    assert {c.seq_q for c in full if c.suite == "grid"} == set(harness.SEQS)


def test_floor_cases_are_issue_3s():
    floor = [c for c in build_cases(["float32"], quick=True) if c.floor]
    attn = [c for c in floor if c.kind == "attn"]
    assert len(attn) == 4 and {(c.causal, c.direction) for c in attn} == {
        (False, "fwd"), (True, "fwd"), (False, "bwd"), (True, "bwd")}
    assert all((c.batch, c.seq_q, c.heads, c.head_dim) == (4, 4096, 16, 128) for c in attn)
    (rope,) = [c for c in floor if c.kind == "rope"]
    assert rope.shape == (8, 8192, 32, 128)


def test_filters_and_dtype_names():
    cases = build_cases(["float32"])
    assert all("s4096" in c.id for c in harness.filter_cases(cases, "s4096"))
    assert len(harness.filter_cases(cases, "decode,rope")) == 10  # 4 decode, 6 RoPE
    assert harness.filter_cases(cases, "") == cases
    assert harness.parse_dtypes("fp32, bf16,float16,fp32") == ["float32", "bfloat16", "float16"]
    with pytest.raises(ValueError, match="float64"):
        harness.parse_dtypes("float64")


# --- timing ---------------------------------------------------------------------------------------
class FakeEvents:
    """Events on a simulated device clock that the fake calls advance."""

    def __init__(self):
        self.now = 0.0

    def record(self, stream):
        return self.now

    def synchronize(self, ev):
        pass

    def elapsed_ms(self, a, b):
        return b - a


def test_plan_reps_and_rotation():
    s = harness.Settings(target_ms=100, min_reps=5, max_reps=50)
    assert harness.plan_reps(1.0, s) == 50 and harness.plan_reps(10.0, s) == 10
    assert harness.plan_reps(500.0, s) == 5 and harness.plan_reps(float("nan"), s) == 50
    assert harness.rotation_sets(1 << 30, 60_000_000) == 1
    assert harness.rotation_sets(60_000_000, 60_000_000) == 3
    assert harness.rotation_sets(1000, 60_000_000) == 8


def test_time_calls_excludes_warmup_and_rotates_sets():
    ev = FakeEvents()
    order, cost = [], {0: 1.0, 1: 2.0, 2: 3.0}
    state = {"first": True}

    def make(i):
        def run():
            order.append(i)
            ev.now += 500.0 if state.pop("first", False) else cost[i]   # first call compiles
        return run

    prep = peers.Prepared("fake", None, [make(0), make(1), make(2)], check=None)
    s = harness.Settings(warmup_ms=5, target_ms=20, min_reps=5, max_reps=100, min_warmup=2)
    t = harness.time_calls(prep.run_next, "stream", s, ev)
    assert order[:6] == [0, 1, 2, 0, 1, 2]
    assert t.warmup_calls == 2 and 500.0 not in t.times_ms
    assert t.reps == 10 and sorted(set(t.times_ms)) == [1.0, 2.0, 3.0]
    assert t.median_ms == 2.0


@pytest.mark.parametrize("settle_ms, median", [(100, 1.0), (0, 2.0)])
def test_time_calls_waits_out_a_slow_start(settle_ms, median):
    # A device that runs its first 40 calls at half speed (as one idle before the call does,
    # harness.Settings.settle_ms): the timed calls come after it is up to speed, unless settling is off.
    ev = FakeEvents()
    calls = []

    def run():
        calls.append(1)
        ev.now += 2.0 if len(calls) <= 40 else 1.0

    prep = peers.Prepared("fake", None, [run], check=None)
    s = harness.Settings(warmup_ms=5, target_ms=20, min_reps=5, max_reps=100, min_warmup=2,
                         settle_ms=settle_ms)
    t = harness.time_calls(prep.run_next, "stream", s, ev)
    assert t.warmup_calls == 3 and t.median_ms == median
    assert t.settle_calls == (65 if settle_ms else 0)


def test_gpu_clock_reads_device_time():
    ev = FakeEvents()
    clock = harness.GpuClock(ev)
    start = clock()
    ev.now += 7.5
    assert clock() - start == pytest.approx(7.5e-3)
    assert harness.GPU_CLOCK.__name__ == "cuda_event_clock"


# --- summary, table, plot -------------------------------------------------------------------------
def _ok(ms, case):
    return {"status": "ok", "ms": ms, "throughput": case.throughput(ms)}


def test_summarize_picks_fastest_right_peer():
    case = harness.case_by_id("attn-fwd-float32-d128-s4096-causal")
    res = {"ferrocupy": _ok(10.0, case), "torch-efficient": _ok(8.0, case),
           "torch-math": _ok(20.0, case), "torch-flash": {"status": "skipped", "reason": "dtype"},
           "torch-cudnn": {"status": "wrong", "reason": "off"}}
    row = report.summarize(case, res, {"matmul_tflops": {"float32": 50.0}, "copy_gbps": 4000})
    assert row["peer"] == "torch-efficient" and row["ratio"] == pytest.approx(0.8)
    assert row["ferro_pct"] == pytest.approx(100 * case.throughput(10.0) / 50.0)
    assert row["note"].startswith("floor PASS (0.80x torch-efficient")
    assert "wrong answer: torch-cudnn" in row["note"]
    res["ferrocupy"] = _ok(17.0, case)
    assert "floor FAIL" in report.summarize(case, res, None)["note"]


def test_rope_gate_cases_are_issue_27s():
    """Every dtype: the four out-of-place forms at 1 GiB of float32 (16x4096x32x128), gated at
    85% of copy bandwidth, in the quick set too."""
    for quick in (False, True):
        gates = [c for c in build_cases(harness.DTYPES, quick=quick) if c.gate]
        assert {(c.dtype, c.rope) for c in gates} == {
            (d, f) for d in harness.DTYPES for f in ("full", "partial", "interleaved",
                                                     "positions")}
        assert all(c.shape == harness.ROPE_SHAPE and not c.floor for c in gates)
    case = harness.case_by_id("rope-bfloat16-16x4096x32x128-partial")
    assert case.rotary_dim == 64 and case.bytes == 2 * 16 * 4096 * 32 * 128 * 2
    assert harness.case_by_id("rope-float32-16x4096x32x128-interleaved").rotary_dim == 128
    ceil = {"copy_gbps": case.throughput(1.0) / 0.851}
    row = report.summarize(case, {"ferrocupy": _ok(1.0, case)}, ceil)
    assert row["gate"] and row["note"].startswith("gate PASS (85.1% of copy, need 85%)")
    ceil = {"copy_gbps": case.throughput(1.0) / 0.849}
    row = report.summarize(case, {"ferrocupy": _ok(1.0, case)}, ceil)
    assert row["note"].startswith("gate FAIL (84.9% of copy")
    assert report.floor_lines([row], "gate") == [f"  {case.id}: gate FAIL (84.9% of copy, "
                                                 f"need 85%)"]
    assert report.floor_lines([row]) == []


def test_summarize_without_ferrocupy_and_rope_floor():
    case = harness.case_by_id("attn-fwd-bfloat16-d128-s4096-causal")
    row = report.summarize(case, {"ferrocupy": {"status": "skipped", "reason": "not supported "
                                                "yet"}, "torch-flash": _ok(1.0, case)}, None)
    assert row["ratio"] is None and row["peer"] == "torch-flash"
    assert "not supported yet" in row["note"]
    rope = harness.case_by_id("rope-float32-8x8192x32x128")
    ceil = {"copy_gbps": rope.throughput(1.0) / 0.7}
    assert "floor PASS (70%" in report.summarize(rope, {"ferrocupy": _ok(1.0, rope)}, ceil)["note"]
    assert "floor FAIL" in report.summarize(rope, {"ferrocupy": _ok(2.0, rope)}, ceil)["note"]


def test_format_table():
    case = harness.case_by_id("attn-bwd-float32-d128-s4096-noncausal")
    rows = [report.summarize(case, {"ferrocupy": _ok(30.0, case),
                                    "torch-efficient": _ok(15.0, case)}, None),
            report.summarize(harness.case_by_id("decode-float16-b16-h32kv8-d128-sk32768"),
                             {"ferrocupy": {"status": "skipped", "reason": "no"}}, None)]
    text = report.format_table(rows)
    lines = text.splitlines()
    assert lines[0].split()[:3] == ["case", "ferro", "ms"]
    assert "attn-bwd-float32-d128-s4096-noncausal *" in lines[2]
    assert "0.50x" in lines[2] and "30.000" in lines[2] and "torch-efficient" in lines[2]
    assert lines[3].split()[1] == "-"


def test_table_per_peer_ratios_and_summary():
    rows = []
    for causal in (False, True):
        for direction in ("fwd", "bwd"):
            case = harness.case_by_id(f"attn-{direction}-bfloat16-d128-s4096-"
                                      f"{'causal' if causal else 'noncausal'}")
            res = {"ferrocupy": _ok(10.0, case), "torch-flash": _ok(8.0, case),
                   "torch-cudnn": _ok(5.0, case), "torch-efficient": _ok(20.0, case),
                   "torch-math": {"status": "skipped", "reason": "too big"}}
            rows.append(report.summarize(case, res, None))
    fp16 = harness.case_by_id("attn-fwd-float16-d64-s1024-causal")
    rows.append(report.summarize(fp16, {"ferrocupy": {"status": "wrong", "reason": "off"},
                                        "torch-flash": _ok(1.0, fp16)}, None))
    f32 = harness.case_by_id("attn-fwd-float32-d128-s4096-causal")
    rows.append(report.summarize(f32, {"ferrocupy": _ok(10.0, f32),
                                       "torch-efficient": _ok(8.0, f32)}, None))
    assert rows[0]["ratios"] == pytest.approx({"torch-flash": 0.8, "torch-cudnn": 0.5,
                                               "torch-efficient": 2.0})
    assert rows[0]["peer"] == "torch-cudnn" and rows[0]["ratio"] == pytest.approx(0.5)
    assert rows[4]["ratios"] == {"torch-flash": None}
    text = report.format_table(rows[:5])
    head = text.splitlines()[0]
    assert head.index("ratio") < head.index("vs flash") < head.index("vs cudnn") \
        < head.index("vs efficient") < head.index("ferro %ceil") and "vs math" not in head
    assert text.splitlines()[2].split()[7:11] == ["0.50x", "0.80x", "0.50x", "2.00x"]
    tables = report.format_tables(rows)
    assert tables.index("== float32 ==") < tables.index("== bfloat16 ==") \
        < tables.index("== float16 ==")
    f32_table = tables[tables.index("== float32 =="):tables.index("== bfloat16 ==")]
    assert "vs efficient" in f32_table and "vs flash" not in f32_table
    summary = report.ratio_summary(rows)
    assert summary[1] == ("  float32 forward: vs efficient 0.80x (0.80-0.80, 1)  "
                          "[ferrocupy ran 1/1 cases]")
    assert summary[2].startswith("  bfloat16 forward: vs flash 0.80x (0.80-0.80, 2), "
                                 "vs cudnn 0.50x (0.50-0.50, 2), vs efficient 2.00x")
    assert summary[3].startswith("  bfloat16 backward (given lse): vs flash 0.80x")
    assert summary[4] == ("  float16 forward: no ratio (no case where ferrocupy and a peer ran)"
                          "  [ferrocupy ran 0/1 cases]")
    json.loads(json.dumps(rows))


def test_header_names_every_version():
    info = {"date": "2026-01-01 00:00 UTC", "gpu": "NVIDIA H200", "compute_capability": "9.0",
            "sms": 132, "memory_gib": 139.8, "l2_mb": 62.9, "driver": "580.00",
            "cuda_runtime": "13.0", "cupy": "14.2.0", "cupy_tf32": "unset", "python": "3.12.0",
            "torch": "2.11.0", "torch_cuda": "13.0", "cudnn": 91900, "ferrocupy": "abc1234",
            "torch_matmul_precision": "highest"}
    text = "\n".join(report.header_lines(info))
    for word in ("2026-01-01", "NVIDIA H200", "sm_90", "driver 580.00", "CUDA runtime 13.0",
                 "CuPy 14.2.0", "torch 2.11.0", "cuDNN 91900", "CUPY_TF32=unset"):
        assert word in text
    assert "torch not available" in "\n".join(report.header_lines({**info, "torch": None}))


def _synthetic_payload():
    cases = []
    for c in build_cases(["float32"], quick=True):
        res = {"ferrocupy": _ok(2.0 * c.seq_q / 1024, c), "torch-efficient": _ok(1.5, c),
               "torch-flash": {"status": "skipped", "reason": "float32"}}
        cases.append({"id": c.id, "suite": c.suite, "dtype": c.dtype, "direction": c.direction,
                      "head_dim": c.head_dim, "causal": c.causal, "seq_q": c.seq_q, "results": res})
    return {"meta": {"gpu": "Fake GPU", "date": "2026-01-01"}, "cases": cases,
            "ceilings": {"matmul_tflops": {"float32": 50.0}}}


def test_plot_from_synthetic_json(tmp_path):
    pytest.importorskip("matplotlib")
    src = tmp_path / "results.json"
    report.write_json(_synthetic_payload(), str(src))
    out = tmp_path / "plot.png"
    assert compare.main(["--plot-from", str(src), "--plot", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not report.plot({"cases": []}, str(tmp_path / "none.png"))


# --- the command-line entry points without a GPU --------------------------------------------------
def test_compare_exits_cleanly_without_gpu():
    if harness.gpu_status()[0]:
        pytest.skip("a GPU is usable here")
    out = subprocess.run([sys.executable, str(BENCH / "compare.py"), "--quick"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "no GPU to benchmark on" in out.stdout
    listing = subprocess.run([sys.executable, str(BENCH / "compare.py"), "--list", "--quick"],
                             capture_output=True, text=True, timeout=120)
    assert listing.returncode == 0 and "43 cases, dtypes float32, bfloat16, float16" in \
        listing.stdout


def test_compare_list_dtypes(capsys):
    assert compare.main(["--list", "--quick", "--dtype", "bfloat16,float16"]) == 0
    out = capsys.readouterr().out
    assert "28 cases, dtypes bfloat16, float16, quick set" in out
    assert "attn-bwd-bfloat16-d128-s4096-causal" in out and "float32" not in out
    assert compare.main(["--list", "--dtype", "bf16,fp16", "--cases", "s1024-,s4096-,s16384-"]) == 0
    ids = [line for line in capsys.readouterr().out.splitlines() if line.startswith("attn-")]
    # the half-precision attention cases: D64/D128, S 1k/4k/16k, causal or not, fwd and bwd;
    # issue 26's head_dim 256 (bfloat16, S 4k/16k)
    assert len(ids) == 2 * 2 * 3 * 2 * 2 + 2 * 2 * 2
    assert {i.split("-")[4] for i in ids} == {"s1024", "s4096", "s16384"}
    assert compare.main(["--list", "--dtype", "float64"]) == 2
    assert compare.main(["--list", "--dtype", ","]) == 2


# --- the check-then-time pipeline on the CPU ------------------------------------------------------
class HostEvents(FakeEvents):
    def record(self, stream):
        return time.perf_counter() * 1e3


@pytest.fixture
def cpu_pipeline(monkeypatch):
    """NumPy in CuPy's place and ferrocupy's reference backend in its CUDA backend's place."""
    from ferrocupy import ComputeEngine

    shim = types.SimpleNamespace(**{n: getattr(np, n) for n in dir(np) if not n.startswith("_")})
    shim.random = types.SimpleNamespace(default_rng=np.random.default_rng)
    device = types.SimpleNamespace(synchronize=lambda: None)
    shim.cuda = types.SimpleNamespace(get_current_stream=lambda: None, Device=lambda *a: device)
    shim.get_default_memory_pool = lambda: types.SimpleNamespace(free_all_blocks=lambda: None)
    monkeypatch.setattr(peers, "_cp", lambda: shim)
    monkeypatch.setitem(peers._ENGINE, "engine", ComputeEngine("reference"))
    monkeypatch.setattr(harness, "torch_cuda", lambda: None)


@pytest.mark.parametrize("case", [
    Case("attn", "float32", 2, 48, 48, 4, 2, 16, True, direction="fwd", suite="gqa"),
    Case("attn", "float32", 2, 40, 40, 4, 2, 16, True, direction="bwd", suite="gqa"),
    Case("attn", "float32", 1, 33, 33, 2, 2, 32, False, direction="bwd"),
    Case("decode", "float32", 2, 1, 64, 4, 2, 16, True, 63, suite="decode"),
    Case("rope", "float32", shape=(2, 24, 3, 16), suite="rope"),
    *(Case("rope", dt, shape=(2, 24, 3, 16), suite="rope", rope=form)
      for dt in ("float32", "bfloat16") for form in harness.ROPE_FORMS),
], ids=lambda c: c.id)
def test_pipeline_checks_then_times(cpu_pipeline, case):
    run = peers.CaseRun(case, l2_bytes=case.bytes)          # 3 rotating input sets
    assert run.n_sets == 3
    prep, err = peers.prepare_checked(run, "ferrocupy")
    assert err < (1e-6 if case.dtype == "float32" else 4e-3), err
    t = harness.time_calls(prep.run_next, prep.stream, harness.Settings(1, 1, 3, 3), HostEvents())
    assert t.reps == 3 and t.median_ms > 0
    results = compare.run_case(case, harness.Settings(1, 1, 2, 2), 1 << 40, HostEvents())
    assert results["ferrocupy"]["status"] == "ok", results["ferrocupy"]
    assert all(r["status"] == "skipped" and "PyTorch" in r["reason"]
               for n, r in results.items() if n != "ferrocupy")
    assert report.summarize(case, results, None)["ferro_thr"] > 0


def test_pipeline_refuses_a_wrong_answer(cpu_pipeline):
    case = Case("attn", "float32", 1, 32, 32, 2, 2, 16, False)
    run = peers.CaseRun(case, l2_bytes=1 << 40)
    for per_head in run.reference.values():          # as if the implementation were 1% off
        for key in per_head:
            per_head[key] = per_head[key] * 1.01
    with pytest.raises(peers.WrongAnswer, match="rel err 9.90e-03 > tolerance 1e-04"):
        peers.prepare_checked(run, "ferrocupy")


def test_dtype_ferrocupy_does_not_take_is_skipped(cpu_pipeline, monkeypatch):
    monkeypatch.setattr(peers._ENGINE["engine"].backend, "dtypes", (np.dtype(np.float32),))
    assert peers.ferro_dtypes() == ["float32"]
    case = Case("attn", "float16", 1, 32, 32, 2, 2, 16, False)
    with pytest.raises(peers.Unsupported, match="not supported yet"):
        peers.CaseRun(case, l2_bytes=1 << 40).prepare("ferrocupy")
    results = compare.run_case(case, harness.Settings(1, 1, 2, 2), 1 << 40, HostEvents())
    res = json.loads(json.dumps(results))["ferrocupy"]
    assert res["status"] == "skipped" and "not supported yet" in res["reason"]


@pytest.mark.parametrize("case", [
    Case("attn", dt, 2, 40, 40, 4, 2, 16, causal, direction=direction, suite="gqa")
    for dt in ("bfloat16", "float16") for direction in ("fwd", "bwd")
    for causal in (False, True)], ids=lambda c: c.id)
def test_pipeline_half_precision(cpu_pipeline, monkeypatch, case):
    """bfloat16 and float16 through the whole pipeline on the reference backend: inputs in the
    dtype, the check against float64 within the dtype's tolerance, and for the backward the
    forward's lse handed to the backward (the same buffer, filled, float32 [B, H, Sq])."""
    backend = peers._ENGINE["engine"].backend
    seen = {"fwd": [], "bwd": []}
    fwd, bwd = backend.forward, backend.backward
    monkeypatch.setattr(backend, "forward", lambda b, p, *rest: (seen["fwd"].append(b), fwd(b, p, *rest)))
    monkeypatch.setattr(backend, "backward", lambda b, p, *rest: (seen["bwd"].append(b), bwd(b, p, *rest)))
    run = peers.CaseRun(case, l2_bytes=case.bytes)
    assert run.n_sets == 3
    assert all(str(x.dtype) == case.dtype for st in run.sets for x in st.values())
    prep, err = peers.prepare_checked(run, "ferrocupy")
    # the half-precision rounding of the outputs, well inside the tolerance, but not float32's
    assert 1e-5 < err < case.tolerance / 2, err
    if case.direction == "fwd":
        assert not seen["bwd"] and all(b["lse"] is None for b in seen["fwd"])
    else:
        assert len(seen["fwd"]) == run.n_sets and len(seen["bwd"]) == 1     # prepare, check
        for f, b in zip(seen["fwd"], seen["bwd"]):
            lse = f["lse"]
            assert lse is not None and b["lse"] is lse and b["out"] is f["out"]
            assert lse.dtype == np.float32 and lse.shape == (case.batch, case.heads, case.seq_q)
            assert np.isfinite(lse).all()
    prep.run_next()                              # sets 0 then 1, round robin
    prep.run_next()
    if case.direction == "bwd":                  # each input set with its own forward's lse
        assert [id(b["lse"]) for b in seen["bwd"][1:]] == [id(f["lse"]) for f in seen["fwd"][:2]]
    results = compare.run_case(case, harness.Settings(1, 1, 2, 2), 1 << 40, HostEvents())
    assert results["ferrocupy"]["status"] == "ok", results["ferrocupy"]
    assert results["ferrocupy"]["rel_err"] == pytest.approx(err)


def test_pipeline_half_precision_refuses_a_wrong_answer(cpu_pipeline):
    """Off by a few times a right kernel's error (bf16: ~4e-3 out, ~1e-2 gradients; float16
    eight times less) fails the check: bf16 3% forward, 6% backward; float16 1% and 2%."""
    for dtype, direction, off in (("bfloat16", "bwd", 1.06), ("bfloat16", "fwd", 1.03),
                                  ("float16", "bwd", 1.02), ("float16", "fwd", 1.01)):
        run = peers.CaseRun(Case("attn", dtype, 1, 32, 32, 2, 2, 16, True, direction=direction),
                            l2_bytes=1 << 40)
        for per_head in run.reference.values():
            for key in per_head:
                per_head[key] = per_head[key] * off
        with pytest.raises(peers.WrongAnswer, match="rel err"):
            peers.prepare_checked(run, "ferrocupy")
