"""benchmarks/publish.py on synthetic run files: only full runs are kept, each GPU and dtype shows
its newest run, the README block and the page follow them. No GPU needed."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))

import publish  # noqa: E402
from harness import build_cases  # noqa: E402


def _run(gpu: str, date: str, dtypes: list, ferro_ms: float, **meta) -> dict:
    cases = []
    for c in build_cases(dtypes, quick=True):
        res = {"ferrocupy": {"status": "ok", "ms": ferro_ms, "throughput": c.throughput(ferro_ms)},
               "torch-efficient": {"status": "ok", "ms": 1.0, "throughput": c.throughput(1.0)}}
        rec = {"id": c.id, "kind": c.kind, "dtype": c.dtype, "batch": c.batch, "seq_q": c.seq_q,
               "seq_k": c.seq_k, "heads": c.heads, "kv_heads": c.kv_heads,
               "head_dim": c.head_dim, "causal": c.causal, "direction": c.direction,
               "shape": list(c.shape), "suite": c.suite, "floor": c.floor, "results": res}
        cases.append(rec)
    info = {"date": date, "gpu": gpu, "compute_capability": "9.0", "sms": 132, "memory_gib": 80,
            "l2_mb": 50, "driver": "1", "cuda_runtime": "13.0", "cupy": "14", "cupy_tf32": "0",
            "python": "3.12", "torch": None, "ferrocupy": "abc1234", "quick": False,
            "cases_filter": "", "dtypes": dtypes, **meta}
    ceilings = {"copy_gbps": 3000.0, "matmul_tflops": {d: 500.0 for d in dtypes}}
    return {"meta": info, "ceilings": ceilings, "cases": cases}


def _write(folder: Path, name: str, payload: dict) -> None:
    (folder / f"results-{name}.json").write_text(json.dumps(payload))


def test_newest_run_per_gpu_and_dtype(tmp_path):
    _write(tmp_path, "a-old", _run("GPU A", "2026-01-01 10:00 UTC", ["float32", "bfloat16"], 2.0))
    _write(tmp_path, "a-new", _run("GPU A", "2026-02-01 10:00 UTC", ["bfloat16"], 1.0))
    _write(tmp_path, "b", _run("GPU B", "2026-03-01 10:00 UTC", ["float16"], 4.0))
    runs = publish.load_runs(tmp_path)
    latest = publish.latest(runs)
    assert list(latest) == ["GPU B", "GPU A"]  # the newest GPU first
    assert latest["GPU A"]["bfloat16"].date.startswith("2026-02")
    assert latest["GPU A"]["float32"].date.startswith("2026-01")
    page = publish.results_page(runs)
    assert page.index("## GPU B") < page.index("## GPU A")
    assert "results-a-new.json" in page and "results-a-old.json" in page
    block = publish.readme_block(runs)
    assert "GPU B" in block and "GPU A" not in block and "**float16**, run of 2026-03-01" in block


def test_partial_runs_are_refused(tmp_path):
    _write(tmp_path, "x", _run("GPU A", "2026-01-01 10:00 UTC", ["float32"], 1.0,
                              cases_filter="decode"))
    with pytest.raises(ValueError, match="not a full run"):
        publish.load_runs(tmp_path)


def test_readme_block_replaced_between_markers():
    text = f"intro\n{publish.BEGIN}\nold table\n{publish.END}\nafter\n"
    assert publish.readme_with_block(text, "new") == f"intro\n{publish.BEGIN}\nnew\n{publish.END}\nafter\n"
    with pytest.raises(ValueError, match="needs one"):
        publish.readme_with_block("no markers", "new")
