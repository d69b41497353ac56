#!/usr/bin/env python3
"""ferrocupy against PyTorch SDPA and the device's ceilings, in one run on one GPU.

    python benchmarks/compare.py --quick                      # all three dtypes, small set
    python benchmarks/compare.py --json benchmarks/results-h100.json   # full set, kept (publish.py)
    python benchmarks/compare.py --dtype bfloat16,float16     # half precision only, full set
    python benchmarks/compare.py --dtype bf16,fp16 --cases s1024-,s4096-,s16384-
    python benchmarks/compare.py --dtype float32 --cases s4096
    python benchmarks/compare.py --list                       # the cases, no GPU needed

`--dtype` takes float32, bfloat16, float16 (or fp32, bf16, fp16); the default is all three. The
attention sweep is the same for every dtype: D64 and D128, S from 512 to 16384 at 16384 tokens per
batch (batch = 16384 / S) and hidden 2048 (heads = 2048 / D), causal and not, forward and
backward (the backward given the forward's out and float32 log-sum-exp, as a training step runs
it); plus GQA, decode and RoPE; and the host cost of one call (call_cost.py, id "call-cost-...").
The peers are torch SDPA as torch picks its backend ("sdpa-default": no sdpa_kernel context;
cuDNN on Hopper with torch 2.11) and its flash, cudnn, efficient and math backends forced (flash
and cudnn take only float16/bfloat16), FlexAttention (compiled) on the bias and window cases, and
eager RoPE. The full set adds issue 25's bfloat16 cases: training steps ("train-step-...":
forward + backward through ferrocupy.torch.attention against SDPA through autograd), an additive
bias [1, H, S, S] ("bias-fwd-...", "bias-bwd-...": the same tensor as ferrocupy's mask, SDPA's
attn_mask and FlexAttention's score_mod; the backward reported, not gated), and the option cases,
each beside the same call without its option (TFLOP/s over visible keys; harness's docstring
has the shapes and why): a sliding window ("window-...-w4096" beside "-w0": ferrocupy's rule
|i - j| < window as SDPA's boolean mask and FlexAttention's mask_mod), dropout p=0.1 forward and
backward ("dropout-...-p0.1" beside "-p0"), kv_lens ("kvlens-...-kvlen3072" beside "-kvlen0": a
chunk of queries into a KV cache 3/4 full) and GQA ("gqa-...-h32kv8-..." beside "-h32kv32-"; the
dropout and kv_lens cases time ferrocupy alone). After the tables come issue 27's RoPE gate and
issue 25's gate (against sdpa-default; the option cases against their plain calls), PASS/FAIL
per line, for the cases that ran:

    python benchmarks/compare.py --dtype bf16,fp16 \
        --cases s1024-,s4096-,s16384-,train-,bias-,window-,dropout-,kvlens-,gqa-

(that subset also picks up issue 26's head_dim 256 and model-option cases, whose ids hold
"s4096-" or "s16384-"). The full set adds issue 26's bfloat16 cases too (harness's docstring has
the shapes): head_dim 256 ("attn-...-d256-...", against sdpa-default), varlen ("varlen-...-mixed":
8 packed sequences of mixed lengths, 16384 tokens, beside "-dense", the dense call at their mean
length; TFLOP/s over the real work), paged decode ("paged-...-page16", "-page256" beside
"-page0", the same keys contiguous: time against time) and softcap, ALiBi and sinks
("mods-...-softcap", "-alibi", "-sinks" beside "-plain"); all but decode forward and backward.
The calls with index tensors (varlen, paged and its contiguous pair) are timed as their kernels'
launches (the front door's host read of those tensors stays out; the checked call goes through
it). Their gate, printed last, PASS/FAIL per line (bfloat16 only; about a minute of cases on an
H100, more where the kernels compile first):

    python benchmarks/compare.py --dtype bf16 --cases d256-,varlen-,paged-,mods-

Prints a header (date, GPU, driver, CUDA, CuPy, torch, cuDNN), measures the ceilings (device copy
bandwidth, a large matmul per dtype), then every case: each implementation's first output is
checked against a float64 reference and only a right answer is timed (median of CUDA-event timed
repetitions after warm-up and at least 100 ms of untimed back-to-back calls, so that no
implementation is timed on a device still speeding up: harness.Settings.settle_ms). Then one table per dtype, with ferrocupy's ratio to the fastest peer
and to each peer ("vs flash", "vs cudnn", ...), and the geometric mean of those ratios per dtype
and direction. Without a GPU it says so and exits 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
for p in (str(HERE.parent), str(HERE)):      # this checkout's ferrocupy, then the harness
    if p not in sys.path:
        sys.path.insert(0, p)

import call_cost  # noqa: E402
import harness  # noqa: E402
import report  # noqa: E402

# Assumed rates for --list's rough runtime estimate (TFLOP/s fwd, bwd; GB/s), not measurements.
_RATES = {"float32": {"ferrocupy": (40, 24), "torch-efficient": (45, 35), "torch-math": (15, 10),
                      "torch-sdpa-default": (45, 35)},
          "half": {"ferrocupy": (200, 120), "torch-flash": (300, 250),
                   "torch-efficient": (200, 150), "torch-cudnn": (450, 400),
                   "torch-sdpa-default": (450, 400), "torch-flex": (300, 200),
                   "torch-math": (60, 40)}}
_COMPILE_S = 30           # assumed: FlexAttention's first compile of a case (mask, score_mod)
_GBPS = {"ferrocupy": 3000, "torch-eager": 700}


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="the small set: issue-3 floor cases, D128 S in {1k,4k}, decode, RoPE")
    ap.add_argument("--dtype", default=",".join(harness.DTYPES),
                    help="comma list of float32,bfloat16,float16 (also fp32,bf16,fp16; "
                    "default: all three)")
    ap.add_argument("--cases", default="", help="comma list of substrings of case ids to keep")
    ap.add_argument("--json", metavar="PATH", help="write cases, results and ceilings as JSON")
    ap.add_argument("--plot", metavar="PATH", help="write throughput vs sequence length (PNG)")
    ap.add_argument("--plot-from", metavar="JSON", help="re-plot a saved --json file (no GPU)")
    ap.add_argument("--device-info", action="store_true", help="print the header and exit")
    ap.add_argument("--list", action="store_true", help="list the cases with a rough runtime "
                    "estimate and exit (no GPU needed)")
    return ap.parse_args(argv)


def estimate_seconds(cases, settings: harness.Settings) -> float:
    """A rough runtime from assumed rates (see _RATES), to size --quick and the full set."""
    import peers
    import torch_peers

    total = 0.0
    for c in cases:
        total += 0.3                                   # inputs, float64 reference, setup
        for impl in peers.implementations(c):
            if c.kind == "attn":
                rates = _RATES["float32" if c.dtype == "float32" else "half"].get(impl)
                if rates is None:
                    continue
                if impl == "torch-math" and c.batch * c.heads * c.seq_q * c.seq_k * 4 > \
                        torch_peers.MATH_SCORE_LIMIT:
                    continue
                t = c.flops / 1e12 / rates[c.direction != "fwd"] * 1e3
                total += _COMPILE_S if impl == "torch-flex" else 0
            else:
                t = c.bytes / 1e9 / _GBPS.get(impl, 2000) * 1e3
            reps = harness.plan_reps(t, settings)
            warm = max(settings.warmup_ms, settings.min_warmup * t) + settings.settle_ms
            total += (warm + (reps + 3) * t) / 1e3 + 0.05
    return total


def measure(run, impl: str, settings: harness.Settings, events=None) -> dict:
    import peers

    try:
        prep, err = peers.prepare_checked(run, impl)
    except peers.Unsupported as e:
        return {"status": "skipped", "reason": str(e)}
    except peers.WrongAnswer as e:
        return {"status": "wrong", "reason": str(e)}
    except Exception as e:  # a crash in one implementation must not hide the others
        return {"status": "error", "reason": f"{type(e).__name__}: {str(e)[:300]}"}
    try:
        t = harness.time_calls(prep.run_next, prep.stream, settings, events)
    except Exception as e:
        return {"status": "error", "reason": f"timing: {type(e).__name__}: {str(e)[:300]}"}
    finally:
        del prep
    c = run.case
    return {"status": "ok", "ms": t.median_ms, "throughput": c.throughput(t.median_ms),
            "rel_err": err, "reps": t.reps, "warmup_calls": t.warmup_calls,
            "settle_calls": t.settle_calls,
            "min_ms": min(t.times_ms), "max_ms": max(t.times_ms),
            "times_ms": [round(x, 5) for x in t.times_ms]}


def run_case(case, settings, l2_bytes, events=None) -> dict:
    import peers

    try:
        run = peers.CaseRun(case, l2_bytes)
    except peers.Unsupported as e:
        return {impl: {"status": "skipped", "reason": str(e)}
                for impl in peers.implementations(case)}
    results = {}
    for impl in peers.implementations(case):
        results[impl] = measure(run, impl, settings, events)
        peers.release()
    del run
    peers.release()
    return results


def _progress(i, n, case, results, secs):
    parts = []
    for impl, r in results.items():
        if r["status"] == "ok":
            parts.append(f"{impl} {r['ms']:.3f} ms {r['throughput']:.1f}")
        elif r["status"] != "skipped" or impl == "ferrocupy":
            parts.append(f"{impl} {r['status'].upper()}")
    print(f"[{i}/{n}] {case.id} ({secs:.1f}s): {', '.join(parts)} {case.unit}",
          file=sys.stderr, flush=True)
    for impl, r in results.items():
        if r["status"] in ("wrong", "error"):
            print(f"    {impl}: {r['reason']}", file=sys.stderr, flush=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        dtypes = harness.parse_dtypes(args.dtype)
        if not dtypes:
            raise ValueError("--dtype names no dtype")
    except ValueError as e:
        print(f"compare.py: {e}", file=sys.stderr)
        return 2
    if args.plot_from:
        import json

        payload = json.loads(Path(args.plot_from).read_text())
        out = args.plot or str(Path(args.plot_from).with_suffix(".png"))
        print(f"wrote {out}" if report.plot(payload, out) else "no attention sweep to plot")
        return 0
    settings = harness.QUICK if args.quick else harness.FULL
    if args.list:
        cases = harness.filter_cases(harness.build_cases(dtypes, args.quick), args.cases)
        for c in cases:
            issue = 26 if c.issue26 else 25
            mark = ("  [issue-3 floor]" if c.floor else "  [issue-27 gate]" if c.gate else
                    f"  [issue-{issue} gate: vs {c.plain_call.id}]" if c.plain_call else
                    f"  [issue-26 gate: vs {report.DEFAULT_PEER}]" if c.suite == "d256" else "")
            print(f"{c.id}{mark}")
        minutes = estimate_seconds(cases, settings) / 60
        print(f"{len(cases)} cases, dtypes {', '.join(dtypes)}, "
              f"{'quick' if args.quick else 'full'} set; rough estimate {minutes:.1f} min "
              f"(assumed rates, not measured)")
        return 0
    notes = []
    if os.environ.get("CUPY_TF32", "0") != "0":      # CuPy reads it at import: plain FP32 only
        notes.append(f"CUPY_TF32={os.environ['CUPY_TF32']} was set; set to 0 so float32 "
                     f"matmul ceilings are plain FP32")
        os.environ["CUPY_TF32"] = "0"
    ok, why = harness.gpu_status()
    if not ok:
        print(f"compare.py: no GPU to benchmark on: {why}. Nothing was measured "
              f"(this needs an NVIDIA GPU with CuPy; PyTorch for the peers).")
        return 0
    import peers

    torch = harness.torch_cuda()
    if torch is not None and torch.get_float32_matmul_precision() != "highest":
        notes.append(f"torch float32 matmul precision was "
                     f"{torch.get_float32_matmul_precision()}; set to highest (no TF32)")
        torch.set_float32_matmul_precision("highest")
    info = harness.device_info()
    try:
        peers.ferro_engine()
        engine = f"ferrocupy CUDA engine takes {', '.join(peers.ferro_dtypes())}"
    except peers.Unsupported as e:
        engine = f"ferrocupy {e}"
    info["ferrocupy_engine"] = engine
    print("\n".join(report.header_lines(info) + [engine] + notes), flush=True)
    if torch is None:
        print("PyTorch with CUDA is not importable: peers are skipped", flush=True)
    if args.device_info:
        return 0
    cases = harness.filter_cases(harness.build_cases(dtypes, args.quick), args.cases)
    print(f"{len(cases)} cases, dtypes {', '.join(dtypes)}, "
          f"{'quick' if args.quick else 'full'} set", flush=True)
    start = time.time()
    ceilings = harness.measure_ceilings(dtypes, settings)
    print(f"ceilings: copy {ceilings['copy_gbps']:.0f} GB/s ("
          + ", ".join(f"{k} {v:.0f}" for k, v in ceilings["copy"].items()) + "); matmul "
          + ", ".join(f"{d} {ceilings['matmul_tflops'][d]:.0f} TFLOP/s"
                      if d in ceilings["matmul_tflops"] else f"{d} {ceilings['matmul'][d]}"
                      for d in dtypes) + "  [" + "; ".join(ceilings["matmul"].values()) + "]",
          flush=True)
    records, rows = [], []
    for i, case in enumerate(cases, 1):
        t0 = time.time()
        results = run_case(case, settings, info["l2_bytes"])
        _progress(i, len(cases), case, results, time.time() - t0)
        records.append({"id": case.id, **dataclasses.asdict(case), "flops": case.flops,
                        "bytes": case.bytes, "unit": case.unit, "tolerance": case.tolerance,
                        "results": results})
        rows.append(report.summarize(case, results, ceilings))
    payload = {"meta": {**info, "quick": args.quick, "dtypes": dtypes, "cases_filter": args.cases,
                        "settings": dataclasses.asdict(settings), "notes": notes,
                        "seconds": round(time.time() - start, 1)},
               "ceilings": ceilings, "cases": records, "rows": rows}
    if args.json:
        report.write_json(payload, args.json)
        print(f"wrote {args.json}")
    if args.plot:
        print(f"wrote {args.plot}" if report.plot(payload, args.plot)
              else "plot: no attention sweep case in this run; nothing plotted")
    call_rows = None
    if torch is not None and (not args.cases or any(
            f and f in call_cost.CASE_ID for f in args.cases.split(","))):
        try:
            call_rows = call_cost.measure()
        except Exception as e:  # a wrong answer or a crash: reported, not timed
            print(f"call cost: {type(e).__name__}: {e}", file=sys.stderr)
        payload["call_cost"] = call_rows
        if args.json:
            report.write_json(payload, args.json)
    floors = report.floor_lines(rows)
    if floors:
        print("issue-3 floor:\n" + "\n".join(floors))
    gates = report.floor_lines(rows, "gate")
    if gates:
        print(f"issue-27 RoPE gate (out of place, >= {harness.GATE_ROPE_PCT:.0f}% of the copy "
              f"bandwidth measured above):\n" + "\n".join(gates))
    wrong = [r["case"] for c, r in zip(records, rows)
             if c["results"].get("ferrocupy", {}).get("status") in ("wrong", "error")]
    if wrong:
        print(f"ferrocupy gave a wrong answer or failed on {len(wrong)} case(s): "
              f"{', '.join(wrong)} (see the notes; exit status 1)")
    print(f"\n{len(cases)} cases in {time.time() - start:.0f} s\n")
    print(report.format_tables(rows))
    summary = report.ratio_summary(rows)
    if summary:
        print("\n" + "\n".join(summary))
    if call_rows:
        print("\n" + call_cost.format_table(call_rows))
    for gate in (report.gate25_lines(rows), report.gate26_lines(rows)):  # last: what issues
        if gate:                                                          # 25 and 26 read
            print("\n" + "\n".join(gate))
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
