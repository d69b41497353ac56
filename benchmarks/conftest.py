"""The pytest-benchmark suite: `pytest benchmarks/ --benchmark-only`.

One benchmark group per case, holding ferrocupy and every available peer (torch SDPA backends,
eager torch RoPE). Runs the quick set by default; `--bench-full` runs the full set and
`--bench-dtype bfloat16,float16` picks dtypes (default: all three, float32, bfloat16 and
float16). ferrocupy's backward is given the forward's log-sum-exp, as in a training step. Each
implementation's first output is checked against a float64 reference: a wrong answer fails the
test and is not timed; a peer that rejects the case is skipped with its reason.
pytest-benchmark times with `harness.GPU_CLOCK`, a timer that reads CUDA events, so its numbers
are device time; warm-up runs first so compilation stays out. TFLOP/s or GB/s go to extra_info
and a side-by-side table is printed at the end. Without a GPU each module has one test,
skipped with the reason, and pytest exits 0.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
for _p in (str(HERE.parent), str(HERE)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import harness  # noqa: E402
import report  # noqa: E402

ROUND_MS = 5.0          # pytest-benchmark iterations per round: at least this much device time
_RUN: dict = {}         # the current case's inputs (one case at a time: they can be GiBs)
_RESULTS: dict = {}     # case id -> implementation -> result, for the closing table


def pytest_addoption(parser):
    group = parser.getgroup("ferrocupy benchmarks")
    group.addoption("--bench-full", action="store_true", default=False,
                    help="run the full case set (default: the quick set)")
    group.addoption("--bench-dtype", default=None,
                    help="comma list of float32,bfloat16,float16 (default: all three)")


def pytest_generate_tests(metafunc):
    if "case_id" not in metafunc.fixturenames:
        return
    why = harness.suite_skip_reason()
    if why:   # one skipped test per module, with the reason (pytest then exits 0)
        metafunc.parametrize("case_id,impl", [pytest.param(
            None, None, id="no-gpu", marks=pytest.mark.skip(reason=why))])
        return
    import peers

    opt = metafunc.config.getoption
    dtypes = harness.parse_dtypes(opt("--bench-dtype") or ",".join(harness.DTYPES))
    kinds = metafunc.module.KINDS
    params = []
    for case in harness.build_cases(dtypes, quick=not opt("--bench-full")):
        if case.kind not in kinds:
            continue
        for impl in peers.implementations(case):
            group = case.id + ("  [issue-3 floor]" if case.floor else
                               "  [issue-27 gate]" if case.gate else "")
            mark = pytest.mark.benchmark(group=group, timer=harness.GPU_CLOCK)
            params.append(pytest.param(case.id, impl, id=f"{case.id}-{impl}", marks=mark))
    metafunc.parametrize("case_id,impl", params)


def _case_run(case):
    import peers

    if case.id not in _RUN:
        _RUN.clear()
        peers.release()
        try:
            _RUN[case.id] = peers.CaseRun(case, harness.l2_bytes())
        except peers.Unsupported as e:
            _RUN[case.id] = e
    return _RUN[case.id]


@pytest.fixture
def bench(benchmark, request):
    """`bench(case_id, impl)`: check, then time one implementation on one case."""
    import peers

    settings = harness.FULL if request.config.getoption("--bench-full") else harness.QUICK

    def go(case_id: str, impl: str):
        case = harness.case_by_id(case_id)
        record = _RESULTS.setdefault(case_id, {})
        run = _case_run(case)
        try:
            if isinstance(run, Exception):
                raise run
            prep, err = peers.prepare_checked(run, impl)
        except peers.Unsupported as e:
            record[impl] = {"status": "skipped", "reason": str(e)}
            pytest.skip(f"{impl}: {e}")
        except peers.WrongAnswer as e:
            record[impl] = {"status": "wrong", "reason": str(e)}
            pytest.fail(str(e), pytrace=False)
        except Exception as e:
            record[impl] = {"status": "error", "reason": f"{type(e).__name__}: {e}"}
            raise
        # Warm up and size the rounds from a first event-timed estimate.
        probe = harness.Settings(warmup_ms=settings.warmup_ms, target_ms=0, min_reps=3,
                                 max_reps=3)
        est = max(harness.time_calls(prep.run_next, prep.stream, probe).median_ms, 1e-3)
        iterations = max(1, math.ceil(ROUND_MS / est))
        rounds = max(settings.min_reps, min(50, math.ceil(settings.target_ms / (est * iterations))))
        harness.GPU_CLOCK.stream = prep.stream
        benchmark.pedantic(prep.run_next, rounds=rounds, iterations=iterations, warmup_rounds=1)
        stats = getattr(benchmark, "stats", None)
        ms = stats.stats.median * 1e3 if stats is not None else est
        thr = case.throughput(ms)
        benchmark.extra_info.update({
            "case": case.id, "impl": impl, "dtype": case.dtype, "unit": case.unit,
            "throughput": thr, ("tflops" if case.unit == "TFLOP/s" else "gbps"): thr,
            "flops": case.flops, "bytes": case.bytes, "rel_err": err,
            "tolerance": case.tolerance, "issue3_floor": case.floor})
        record[impl] = {"status": "ok", "ms": ms, "throughput": thr, "rel_err": err}

    return go


def pytest_terminal_summary(terminalreporter):
    if not _RESULTS:
        return
    rows = [report.summarize(harness.case_by_id(cid), res, None) for cid, res in _RESULTS.items()]
    terminalreporter.write_sep("=", "ferrocupy vs peers (median device time)")
    terminalreporter.write_line(report.format_tables(rows))
    for line in report.ratio_summary(rows):
        terminalreporter.write_line(line)
