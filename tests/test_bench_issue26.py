"""Issue 26's benchmark pieces on the CPU: the head_dim 256, varlen, paged-decode and model-option
(softcap, ALiBi, sinks) cases, each checked against the float64 reference before it is timed
(ferrocupy's reference backend; PyTorch on the CPU for the SDPA peer), wrong answers refused, and
the gate block. No GPU needed."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import replace

import numpy as np
import pytest

from test_bench_harness import HostEvents, _ok, cpu_pipeline  # noqa: F401 - the fixture
from test_bench_issue25 import cpu_torch, fake_device  # noqa: F401 - the fixture

import compare
import harness
import peers
import report
from harness import Case, attention_flops

SETTINGS = harness.Settings(1, 1, 1, 1, min_warmup=1, settle_ms=0)
D256 = Case("attn", "float32", 2, 24, 24, 2, 2, 256, True, direction="fwd", suite="d256")
# three packed sequences of 48 tokens (mean 16), ragged
VARLEN = Case("attn", "float32", 3, 16, 16, 4, 4, 16, True, suite="varlen", seqlens=(5, 30, 13))
PAGED = Case("decode", "float32", 2, 1, 64, 4, 2, 16, True, 63, suite="paged", kv_len=64,
             page_size=16)
MODS = {m: Case("attn", "float32", 2, 24, 24, 4, 4, 16, True, suite="mods", mod=m)
        for m in harness.MODS}


def _run(case):
    return compare.run_case(case, SETTINGS, 0, HostEvents())


def _both(case):
    return [case, replace(case, direction="bwd")]


# --- the cases ------------------------------------------------------------------------------------
def test_issue26_cases_in_the_full_set():
    cases = harness.issue26_cases("bfloat16")
    full = {c.id: c for c in harness.build_cases(harness.DTYPES)}
    assert {c.id for c in cases} <= set(full)
    assert not [c for c in harness.build_cases(["float16", "float32"]) if c.issue26]
    assert not [c for c in harness.build_cases(["bfloat16"], quick=True) if c.issue26]
    by_suite = {s: [c for c in cases if c.suite == s] for s in harness.ISSUE26_SUITES}
    assert {(c.seq_q, c.causal, c.direction) for c in by_suite["d256"]} == {
        (s, causal, d) for s in (4096, 16384) for causal in (False, True) for d in ("fwd", "bwd")}
    for c in by_suite["d256"]:
        assert (c.batch * c.seq_q, c.heads, c.kv_heads, c.head_dim) == (16384, 8, 8, 256)
        assert c.id == f"attn-{c.direction}-bfloat16-d256-s{c.seq_q}-" + (
            "causal" if c.causal else "noncausal")
        assert peers.implementations(c) == ["ferrocupy", "torch-sdpa-default", "torch-flash",
                                            "torch-efficient", "torch-cudnn"]
    lens = harness.VARLEN_LENGTHS
    assert len(lens) == 8 and sum(lens) == 16384 and min(lens) >= 500 and max(lens) == 4096
    mixed = full["varlen-fwd-bfloat16-b8-h16kv16-d128-s2048-causal-mixed"]
    dense = full["varlen-fwd-bfloat16-b8-h16kv16-d128-s2048-causal-dense"]
    assert mixed.seqlens == lens and mixed.plain_call == dense and dense.plain_call is None
    assert dense.flops == attention_flops(8, 16, 2048, 2048, 128, True)   # the grid's S2048
    assert mixed.flops == sum(attention_flops(1, 16, n, n, 128, True) for n in lens)
    bwd = full["varlen-bwd-bfloat16-b8-h16kv16-d128-s2048-noncausal-mixed"]
    assert bwd.flops == sum(attention_flops(1, 16, n, n, 128, False, "bwd") for n in lens)
    assert mixed.bytes == dense.bytes
    assert peers.implementations(mixed) == ["ferrocupy"]
    assert peers.implementations(dense) == ["ferrocupy", "torch-sdpa-default"]
    paged = full["paged-bfloat16-b16-h32kv8-d128-sk32768-page16"]
    assert paged.plain_call == full["paged-bfloat16-b16-h32kv8-d128-sk32768-page0"]
    assert paged.bytes == paged.plain_call.bytes and paged.kv_len == paged.seq_k == 32768
    assert {(c.batch, c.seq_k) for c in by_suite["paged"]} == set(harness.DECODE_SHAPES)
    assert {c.page_size for c in by_suite["paged"]} == {16, 256, 0}
    for mod in harness.MODS:
        for d in ("fwd", "bwd"):
            c = full[f"mods-{d}-bfloat16-b4-h16kv16-d128-s4096-causal-{mod}"]
            assert c.plain_call.id == f"mods-{d}-bfloat16-b4-h16kv16-d128-s4096-causal-plain"
            assert c.flops == c.plain_call.flops == attention_flops(4, 16, 4096, 4096, 128,
                                                                    True, d)
    for c in cases:
        assert harness.case_by_id(c.id) == c and c.issue26 and c.dtype == "bfloat16"
        assert c.plain_call is None or c.plain_call.id in full


def test_saved_runs_read_back(tmp_path, monkeypatch):
    """A run's JSON (compare.py's records) gives publish.py the same cases back, varlen's
    lengths a tuple again."""
    import json

    import publish

    seen = []
    summarize = report.summarize
    monkeypatch.setattr(report, "summarize", lambda c, *a: seen.append(c) or summarize(c, *a))

    cases = harness.issue26_cases("bfloat16")
    res = {"ferrocupy": {"status": "ok", "ms": 1.0, "throughput": 1.0}}
    records = [{"id": c.id, **dataclasses.asdict(c), "results": res} for c in cases]
    payload = json.loads(json.dumps({"cases": records, "ceilings": {}}))
    rows = publish.Run(tmp_path / "x.json", payload).rows("bfloat16")
    assert [r["case"] for r in rows] == [c.id for c in cases]
    assert [r["plain"] for r in rows] == [c.plain_call and c.plain_call.id for c in cases]
    assert seen == cases


def test_option_values():
    assert harness.alibi_slopes(8) == [2.0 ** -(i + 1) for i in range(8)]
    sinks = harness.sink_logits(16)
    assert sinks[0] == harness.MODS_SINKS[0] and sinks[-1] == harness.MODS_SINKS[1]
    assert peers.cu_seqlens(VARLEN).tolist() == [0, 5, 35, 48]


# --- the pipeline, ferrocupy's reference backend --------------------------------------------------
@pytest.mark.parametrize("case", [
    *(replace(c, dtype=dt) for dt in ("float32", "bfloat16") for c in (
        *_both(VARLEN), *_both(replace(VARLEN, causal=False)), *_both(MODS["softcap"]),
        *_both(MODS["alibi"]), *_both(MODS["sinks"]), *_both(replace(VARLEN, seqlens=())),
        *_both(replace(MODS["sinks"], mod="")), PAGED, replace(PAGED, page_size=4),
        replace(PAGED, page_size=0))),
    *_both(D256), *_both(replace(D256, causal=False))], ids=lambda c: c.id)
def test_issue26_cases_check_then_time(cpu_pipeline, case):  # noqa: F811
    """ferrocupy's answer checked against the float64 reference (with the case's cu_seqlens,
    block table, softcap, ALiBi slopes or sinks), then timed; bfloat16 well inside its
    tolerance (an option left out is off by far more: the tests below)."""
    res = _run(case)
    assert res["ferrocupy"]["status"] == "ok", res["ferrocupy"]
    err = res["ferrocupy"]["rel_err"]
    assert (err < 1e-6 if case.dtype == "float32" else 1e-5 < err < case.tolerance / 4), err
    assert res["ferrocupy"]["ms"] > 0
    assert all(r["status"] == "skipped" for n, r in res.items() if n != "ferrocupy")
    assert report.summarize(case, res, None)["ferro_thr"] > 0


@pytest.mark.parametrize("case", [D256, replace(D256, direction="bwd", causal=False),
                                  replace(VARLEN, seqlens=())],
                         ids=lambda c: c.id)
def test_sdpa_beside_head_dim_256_and_the_dense_call(cpu_torch, case):  # noqa: F811
    """torch's default SDPA (PyTorch on the CPU) checked and timed beside ferrocupy on the
    head_dim 256 cases and on varlen's dense call."""
    res = _run(case)
    for name in ("ferrocupy", "torch-sdpa-default"):
        assert res[name]["status"] == "ok" and res[name]["ms"] > 0, (name, res[name])
        assert res[name]["rel_err"] < 1e-6
    assert report.summarize(case, res, None)["ratios"]["torch-sdpa-default"] > 0


def test_paged_cache_holds_the_keys_scattered(cpu_pipeline):  # noqa: F811
    """The pool holds key j of sequence b at row j % page of block table[b, j // page], the
    blocks a permutation of the pool (not in order)."""
    from ferrocupy import UnifiedTensor

    run = peers.CaseRun(PAGED, l2_bytes=1 << 40)
    k, v = (UnifiedTensor(run.sets[0][n]) for n in ("k", "v"))
    kp, vp, table = (x.buffer() for x in peers.paged_cache(PAGED, k, v))
    table = np.asarray(table)
    assert table.dtype == np.int32 and table.shape == (2, 4)
    assert sorted(table.ravel()) == list(range(8)) and (table.ravel() != np.arange(8)).any()
    for dense, pool in ((k.buffer(), kp), (v.buffer(), vp)):
        for b in range(2):
            for j in range(64):
                assert np.array_equal(pool[table[b, j // 16], j % 16], dense[b, j])


def test_launches_alone_on_cuda(cpu_pipeline, monkeypatch):  # noqa: F811
    """On the CUDA backend, a call with index tensors is timed as the backend's launches of its
    plan (made once, with every argument's address, 0 for an absent one) on the engine's
    stream, with no front door (no host read of the index tensors) per call."""
    import types

    from ferrocupy import UnifiedTensor

    seen = []
    backend = types.SimpleNamespace(
        name="cuda", plan=lambda *a: seen.append(("plan", a)) or "launch",
        run_plan=lambda *a: seen.append(("run", a)))
    plan = types.SimpleNamespace(op="forward", names=("q", "k", "mask", "kv_lens"),
                                 specs="specs", params="params", layout="layout",
                                 extras="extras", run=lambda **kw: seen.append(("front", kw)))
    buffers = {n: types.SimpleNamespace(data=types.SimpleNamespace(ptr=p))
               for n, p in (("q", 100), ("k", 200), ("kv_lens", 300))}
    tensors = {n: UnifiedTensor.__new__(UnifiedTensor) for n in buffers}
    monkeypatch.setattr(UnifiedTensor, "buffer", lambda self: buffers[
        next(n for n, x in tensors.items() if x is self)])
    monkeypatch.setattr(peers, "_ferro_stream", lambda eng: types.SimpleNamespace(ptr=7))
    run = peers.launches_only(types.SimpleNamespace(backend=backend), plan,
                          {**tensors, "mask": None})
    ptrs = {"q": 100, "k": 200, "mask": 0, "kv_lens": 300}
    assert seen == [("plan", ("forward", "specs", "params", "layout", ptrs, "extras"))]
    run()
    run()
    assert seen[1:] == [("run", ("launch", ptrs, 7))] * 2
    backend.name = "reference"                   # no launches there: the plan's run
    peers.launches_only(types.SimpleNamespace(backend=backend), plan, tensors)()
    assert seen[-1] == ("front", tensors)


def test_varlen_reference_is_each_sequence_alone(cpu_pipeline):  # noqa: F811
    """The varlen reference of the last sequence equals a dense reference of that sequence
    alone (its own causal mask, keys of no other sequence)."""
    run = peers.CaseRun(VARLEN, l2_bytes=1 << 40)
    lo, hi = 35, 48
    alone = Case("attn", "float32", 1, hi - lo, hi - lo, 4, 4, 16, True)
    dense = {n: x[:, lo:hi] for n, x in run.sets[0].items() if n != "cu_seqlens"}
    ref = peers.attention_reference(alone, dense)["out"]
    assert np.allclose(run.reference["out"][(2, 3)], ref[(0, 3)], rtol=0, atol=1e-12)


# --- wrong answers are refused --------------------------------------------------------------------
def _planted(monkeypatch, plant):
    """ferrocupy's forward and backward with `plant(kwargs) -> kwargs` applied to their keyword
    arguments (the options are the 7th positional argument of the forward, 9th of the
    backward: `plant` gets them as "opts")."""
    engine = peers._ENGINE["engine"]
    for name, at in (("flash_attention_v2_with", 4), ("flash_attention_v2_backward_with", 8)):
        method = getattr(engine, name)

        def call(*a, method=method, at=at, **kw):
            kw = plant({"opts": a[at], **kw})
            return method(*a[:at], kw.pop("opts"), *a[at + 1:], **kw)

        monkeypatch.setattr(engine, name, call)


def _wrong(case):
    res = _run(case)["ferrocupy"]
    assert res["status"] == "wrong" and "not timed" in res["reason"], (case.id, res)


@pytest.mark.parametrize("mod,drop", [("softcap", {"softcap": 0.0}), ("alibi", "alibi_slopes"),
                                      ("sinks", "sinks")])
def test_an_option_left_out_is_refused(cpu_pipeline, monkeypatch, mod, drop):  # noqa: F811
    """Each model option dropped from ferrocupy's calls (the reference keeps it): forward and
    backward fail the check, in bfloat16 too (its values move answers beyond the tolerance)."""
    def plant(kw):
        if isinstance(drop, dict):
            return {**kw, "opts": replace(kw["opts"], **drop)}
        return {**kw, drop: None, **({"grad_sinks": None} if "grad_sinks" in kw else {})}

    _planted(monkeypatch, plant)
    for case in _both(MODS[mod]) + _both(replace(MODS[mod], dtype="bfloat16")):
        _wrong(case)


def test_varlen_sequences_run_together_are_refused(cpu_pipeline, monkeypatch):  # noqa: F811
    """ferrocupy planted with the pack as one sequence (cu_seqlens [0, total]): each sequence's
    rows see the others' keys, forward and backward fail the check."""
    from ferrocupy import UnifiedTensor

    total = sum(VARLEN.seqlens)
    one = UnifiedTensor(np.array([0, total], dtype=np.int32))

    def plant(kw):
        return {**kw, "cu_seqlens_q": one, "cu_seqlens_k": one, "max_seqlen_q": total,
                "max_seqlen_k": total}

    _planted(monkeypatch, plant)
    for case in _both(VARLEN):
        _wrong(case)


def test_a_block_table_in_pool_order_is_refused(cpu_pipeline, monkeypatch):  # noqa: F811
    """The keys scattered over the pool but the table planted in order (block b * per + j):
    the keys read are the wrong ones."""
    from ferrocupy import UnifiedTensor

    def plant(kw):
        shape = kw["block_table"].buffer().shape
        order = np.arange(np.prod(shape), dtype=np.int32).reshape(shape)
        return {**kw, "block_table": UnifiedTensor(order)}

    _planted(monkeypatch, plant)
    _wrong(PAGED)
    _wrong(replace(PAGED, page_size=4, dtype="bfloat16"))


def test_head_dim_256_non_causal_for_causal_is_refused(cpu_pipeline, monkeypatch):  # noqa: F811
    _planted(monkeypatch, lambda kw: {**kw, "opts": replace(kw["opts"], causal=False)})
    for case in _both(D256):
        _wrong(case)


# --- the gate block -------------------------------------------------------------------------------
def _row(case, ferro_ms, default_ms=None):
    res = {"ferrocupy": _ok(ferro_ms, case) if ferro_ms else {"status": "wrong", "reason": "x"}}
    if default_ms:
        res["torch-sdpa-default"] = _ok(default_ms, case)
    return report.summarize(case, res, None)


def test_gate_block_passes_and_fails_per_line():
    cases = {c.id: c for c in harness.issue26_cases("bfloat16")}
    d256 = [c for c in cases.values() if c.suite == "d256"]
    rows = [_row(c, 1.0, 1.2 if i else 1.05) for i, c in enumerate(d256)]  # first under 1.1x
    plain = {i: c for i, c in cases.items() if c.suite != "d256" and c.plain_call is None}
    rows += [_row(c, 2.0, 2.0 if c.suite == "varlen" else None) for c in plain.values()]
    # each option case at ratio x of its plain call's throughput (time, for paged decode)
    ratios = {"varlen-fwd-bfloat16-b8-h16kv16-d128-s2048-causal-mixed": 0.95,
              "varlen-bwd-bfloat16-b8-h16kv16-d128-s2048-causal-mixed": 0.85,
              "varlen-fwd-bfloat16-b8-h16kv16-d128-s2048-noncausal-mixed": None,
              "paged-bfloat16-b16-h32kv8-d128-sk32768-page16": 1 / 1.04,
              "paged-bfloat16-b16-h32kv8-d128-sk32768-page256": 1 / 1.06,
              "mods-fwd-bfloat16-b4-h16kv16-d128-s4096-causal-sinks": 0.91,
              "mods-bwd-bfloat16-b4-h16kv16-d128-s4096-causal-softcap": 0.89}
    opts = [c for c in cases.values() if c.plain_call is not None]
    for c in opts:
        x = ratios.get(c.id, 1.0)
        p = c.plain_call
        rows.append(_row(c, x and c.flops / (x * p.flops / 2.0) if c.kind == "attn"
                         else x and c.bytes / (x * p.bytes / 2.0)))
    lines = report.gate26_lines(rows)
    assert lines[0].startswith("issue-26 gate (ferrocupy, same run; head_dim 256 >= 1.1x torch's")
    body = lines[1:-1]
    assert len(body) == len(d256) + len(opts) == 8 + 4 + 6 + 6
    by_case = {line.split(":")[0].strip(): line for line in body}
    assert by_case[d256[0].id].endswith("1.05x sdpa-default, need >= 1.10: FAIL")
    assert by_case[d256[1].id].endswith("1.20x sdpa-default, need >= 1.10: PASS")
    mixed, dense = "varlen-fwd-bfloat16-b8-h16kv16-d128-s2048-causal-mixed", \
        "varlen-fwd-bfloat16-b8-h16kv16-d128-s2048-causal-dense"
    assert by_case[mixed] == (f"  {mixed}: 0.95x the plain call's TFLOP/s ({dense}; real "
                              f"work), need >= 0.90: PASS")
    assert by_case[mixed.replace("fwd", "bwd")].endswith("0.85x the plain call's TFLOP/s ("
                                                          f"{dense.replace('fwd', 'bwd')}; real "
                                                          "work), need >= 0.90: FAIL")
    assert by_case[mixed.replace("causal", "noncausal")].endswith(
        "no ratio (ferrocupy has no number here or on the plain call), need >= 0.90: FAIL")
    page = "paged-bfloat16-b16-h32kv8-d128-sk32768-page"
    assert by_case[page + "16"] == (f"  {page}16: 1.04x the plain call's time ({page}0), "
                                    f"need <= 1.05: PASS")
    assert by_case[page + "256"].endswith(f"1.06x the plain call's time ({page}0), "
                                          f"need <= 1.05: FAIL")
    assert by_case["mods-fwd-bfloat16-b4-h16kv16-d128-s4096-causal-sinks"].endswith(
        "0.91x the plain call's TFLOP/s (mods-fwd-bfloat16-b4-h16kv16-d128-s4096-causal-plain),"
        " need >= 0.90: PASS")
    assert by_case["mods-bwd-bfloat16-b4-h16kv16-d128-s4096-causal-softcap"].endswith(
        "need >= 0.90: FAIL")
    assert not set(plain) & set(by_case)                  # plain calls: no line of their own
    assert lines[-1] == f"  {len(body) - 5} of {len(body)} lines PASS"   # the 5 above
    assert report.gate25_lines(rows) == []                # none of issue 25's
    assert report.gate26_lines([r for r in rows if r["case"] in plain
                                and not r["case"].startswith("varlen")]) == []
    no_plain = [r for r in rows if r["case"] != page + "0"]
    assert report.gate26_lines(no_plain)[-1] == f"  {len(body) - 6} of {len(body)} lines PASS"


def test_gate_block_wrong_answer_fails():
    """A case whose answer was refused has no number: its line fails, whatever its peer did."""
    case = harness.case_by_id("mods-fwd-bfloat16-b4-h16kv16-d128-s4096-causal-alibi")
    d256 = harness.case_by_id("attn-fwd-bfloat16-d256-s4096-causal")
    lines = report.gate26_lines([_row(case, None), _row(case.plain_call, 1.0),
                                 _row(d256, None, 1.0)])
    assert lines[1].endswith("no ratio (ferrocupy or sdpa-default has no number), need >= "
                             "1.10: FAIL")
    assert lines[2].endswith("no ratio (ferrocupy has no number here or on the plain call), "
                             "need >= 0.90: FAIL")
    assert lines[-1] == "  0 of 2 lines PASS"


# --- compare.py -----------------------------------------------------------------------------------
def test_compare_list_shows_the_gate_cases(capsys):
    subset = re.search(r"--cases (\S*varlen-\S*)", compare.__doc__).group(1)
    assert subset == "d256-,varlen-,paged-,mods-"
    assert compare.main(["--list", "--dtype", "bf16", "--cases", subset]) == 0
    lines = capsys.readouterr().out.splitlines()
    listed = {line.split()[0]: line for line in lines[:-1]}
    cases = harness.issue26_cases("bfloat16")
    assert set(listed) == {c.id for c in cases}
    for c in cases:
        if c.suite == "d256":
            assert listed[c.id].endswith("  [issue-26 gate: vs torch-sdpa-default]")
        elif c.plain_call:
            assert listed[c.id].endswith(f"  [issue-26 gate: vs {c.plain_call.id}]")
        else:
            assert listed[c.id] == c.id
    minutes = float(re.search(r"rough estimate ([\d.]+) min", lines[-1]).group(1))
    assert lines[-1].startswith(f"{len(cases)} cases, dtypes bfloat16, full set")
    assert 0 < minutes <= 2.0


def test_compare_prints_the_gate_last(cpu_pipeline, monkeypatch, capsys):  # noqa: F811
    """compare.py's whole run on the CPU (device, ceilings and case list faked): the new cases
    measured and the issue-26 block printed last, after the tables."""
    fake_device(monkeypatch, [D256, VARLEN, VARLEN.plain_call, PAGED, PAGED.plain_call,
                              MODS["alibi"], MODS["alibi"].plain_call])
    assert compare.main(["--quick", "--dtype", "float32", "--cases",
                         "d256-,varlen-,paged-,mods-"]) == 0
    out = capsys.readouterr().out
    gate = out[out.index("issue-26 gate"):].splitlines()
    assert "issue-25 gate" not in out
    assert out.index(PAGED.plain_call.id) < out.index("issue-26 gate")
    assert [line.split(":")[0].strip() for line in gate[1:-1]] == [
        D256.id, VARLEN.id, PAGED.id, MODS["alibi"].id]
    assert gate[1].endswith("no ratio (ferrocupy or sdpa-default has no number), need >= "
                            "1.10: FAIL")                      # no torch here: no peer
    for line in gate[2:5]:
        assert "x the plain call's" in line and line.endswith(("PASS", "FAIL"))
    assert gate[-1].endswith("lines PASS") and gate[-1] == out.rstrip().splitlines()[-1]
