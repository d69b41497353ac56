"""The fused backward (flash_bwd_fused_wgmma.cu) against the two-kernel one, beside torch SDPA's
default backend (cuDNN on Hopper), on one GPU in one process: bf16 B4 H16 S4096, D64 and D128, causal
and not, the backward alone given the forward's lse (benchmarks/compare.py's "bwd" direction).

Every implementation goes through the benchmark harness's public functions: its answer is
checked against the float64 reference on sampled heads before it is timed (peers.prepare_checked:
a wrong answer is reported, not timed), then timed settled (harness.time_calls). The two
ferrocupy backwards are the same engine with CudaBackend.fused_backward switched (plans renewed),
timed in the order two-kernel, fused, two-kernel, fused so a drift of the device shows as a gap
between the two rows of one kernel. The fused one is also run twice and its gradients compared
bit for bit.

    python3 lab/fused_bwd_ab.py [--quick] [--cases SUBSTR,...] [--no-peers]   # on sm_90a

--cases picks compare.py's backward cases by substrings of their ids (harness.filter_cases; only
"-bwd-" ids are kept) instead of the four S4096 shapes; --no-peers leaves torch out (the
ferrocupy rows alone, for option cases whose peers compare.py times anyway).
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import harness  # noqa: E402
import peers  # noqa: E402
from compare import measure  # noqa: E402

SHAPES = [dict(head_dim=d, causal=c) for d in (64, 128) for c in (True, False)]
PEERS = ("torch-sdpa-default",)  # cuDNN on Hopper with torch 2.11: the same timings as torch-cudnn


def case_of(head_dim: int, causal: bool):
    return harness.Case(kind="attn", dtype="bfloat16", batch=4, seq_q=4096, seq_k=4096,
                        heads=16, kv_heads=16, head_dim=head_dim, causal=causal, direction="bwd")


def fused_is_repeatable(run) -> bool:
    """Two fused runs on input set 0 give the same bits in every gradient."""
    prep = run.prepare("ferrocupy")
    first = {n: peers.to_f64(a) for n, (a, _) in prep.check().items()}  # (bf16 -> f64: exact)
    second = {n: peers.to_f64(a) for n, (a, _) in prep.check().items()}
    return all(bool((first[n] == second[n]).all()) for n in first)


def cases_of(argv) -> list:
    if "--cases" not in argv:
        return [case_of(**shape) for shape in SHAPES]
    patterns = argv[argv.index("--cases") + 1]
    picked = harness.filter_cases(harness.build_cases(harness.DTYPES), patterns)
    return [c for c in picked if "-bwd-" in c.id]


def main(argv) -> int:
    settings = harness.QUICK if "--quick" in argv else harness.FULL
    peer_impls = () if "--no-peers" in argv else PEERS
    eng = peers.ferro_engine()
    print(harness.device_info()["gpu"], flush=True)
    for case in cases_of(argv):
        run = peers.CaseRun(case, harness.l2_bytes())
        rows = []
        for fused in (False, True, False, True):
            eng.backend.fused_backward = fused
            rows.append(("fused" if fused else "two-kernel", measure(run, "ferrocupy", settings)))
            peers.release()
        eng.backend.fused_backward = True
        same = fused_is_repeatable(run)
        for impl in peer_impls:
            rows.append((impl, measure(run, impl, settings)))
            peers.release()
        eng.backend.fused_backward = False
        print(f"{case.id}: fused bit-identical across runs: {same}", flush=True)
        for name, r in rows:
            if r["status"] == "ok":
                print(f"  {name:20s} {r['ms']:8.3f} ms  {r['throughput']:7.1f} TFLOP/s  "
                      f"rel err {r['rel_err']:.1e}", flush=True)
            else:
                print(f"  {name:20s} {r['status']}: {r['reason']}", flush=True)
        del run
        peers.release()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
