"""The sm_90a wgmma kernels at the head_dims they now serve padded (32 on the width-64 build, 80
and 96 on the width-128 one) against the mma.sync kernels forced (configs.only(MMA)), on one GPU
in one process: bf16 B4 H16 S4096, causal and not, the forward and the backward given the
forward's lse (benchmarks/compare.py's "fwd" and "bwd" directions), then the backward without
the lse (wgmma: the forward first, then the wgmma backward; mma.sync: its dQ's statistics pass).

Every timed answer is checked first: through the benchmark harness (peers.prepare_checked: against
the float64 reference on sampled heads, a wrong answer reported, not timed) for "fwd" and "bwd";
the backward without the lse against the same table's backward given it (tuning.launches on the
same inputs). The two tables alternate (wgmma, mma.sync, wgmma, mma.sync), so a drift of the
device shows as a gap between the two rows of one table. Each shape first prints the kernels
each table launches (tuning.launches on a small call), so a row is known to time what it says.

    python3 lab/wgmma_dims_ab.py [--quick] [--dims 32,80,96]     # on an H100/H200 (sm_90a)
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import cupy as cp  # noqa: E402
import harness  # noqa: E402
import peers  # noqa: E402
from compare import measure  # noqa: E402

from ferrocupy import AttentionDims, AttentionOptions  # noqa: E402
from ferrocupy.cuda import configs, tuning  # noqa: E402
from ferrocupy.cuda.backend import CudaBackend  # noqa: E402
from ferrocupy.dtypes import BFLOAT16  # noqa: E402
from tile_sweep import time_ms  # noqa: E402  (lab/ on sys.path when run as a script)

TABLES = {"wgmma": configs.TABLE, "mma.sync": configs.only(configs.MMA)}
B, S, H = 4, 4096, 16


def case_of(head_dim: int, causal: bool, direction: str):
    return harness.Case(kind="attn", dtype="bfloat16", batch=B, seq_q=S, seq_k=S, heads=H,
                        kv_heads=H, head_dim=head_dim, causal=causal, direction=direction)


def inputs(d: int, b: int, s: int, h: int, seed: int = 0) -> dict:
    rng = cp.random.default_rng(seed)
    mk = lambda: rng.standard_normal((b, s, h, d), dtype=cp.float32).astype(BFLOAT16)  # noqa
    return dict(q=mk(), k=mk(), v=mk(), grad_out=mk())


def backward_launches(table: dict, x: dict, causal: bool, give_lse: bool) -> tuple:
    """(forward launches, backward launches, outputs) of `table` on inputs `x`."""
    be = CudaBackend(table=table)
    be.fused_backward = False  # (times the two-kernel backward)
    q = x["q"]
    out = {n: cp.full(q.shape, cp.nan, BFLOAT16) for n in ("out", "grad_q", "grad_k", "grad_v")}
    lse = cp.empty((q.shape[0], q.shape[2], q.shape[1]), cp.float32)
    dims, opts = AttentionDims.new(q, x["k"]), AttentionOptions(causal=causal)
    fwd = tuning.launches(be, "forward", dict(q=q, k=x["k"], v=x["v"], out=out["out"], lse=lse),
                          dims.params(opts))
    bwd = tuning.launches(be, "backward",
                          dict(q=q, k=x["k"], v=x["v"], out=out["out"], grad_out=x["grad_out"],
                               grad_q=out["grad_q"], grad_k=out["grad_k"],
                               grad_v=out["grad_v"], lse=lse if give_lse else None),
                          dims.params_bwd(opts))
    return fwd, bwd, out


def run(launches) -> None:
    for f in launches:
        f()


def kernels_of(table: dict, d: int, causal: bool) -> str:
    x = inputs(d, 1, 256, 2)
    fwd, bwd, _ = backward_launches(table, x, causal, True)
    _, bwd_no_lse, _ = backward_launches(table, x, causal, False)
    names = lambda ls: ",".join(f.kernel for f in ls)  # noqa: E731
    return f"fwd {names(fwd)} | bwd {names(bwd)} | bwd without lse {names(bwd_no_lse)}"


def backward_without_lse(table: dict, x: dict, causal: bool) -> tuple[float, float]:
    """(ms, largest relative difference of the gradients from the same table's backward given
    the lse) of the backward without the lse."""
    fwd, given, ref = backward_launches(table, x, causal, True)
    run(fwd), run(given)
    fwd2, alone, got = backward_launches(table, x, causal, False)
    run(fwd2), run(alone)
    cp.cuda.Device().synchronize()
    diff = max(float(cp.linalg.norm(got[n].astype(cp.float32) - ref[n].astype(cp.float32))
                     / cp.linalg.norm(ref[n].astype(cp.float32)))
               for n in ("grad_q", "grad_k", "grad_v"))
    if not diff < 1e-2:
        return float("nan"), diff  # not timed: a wrong answer
    return time_ms(lambda: run(alone)), diff


def main(argv) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--dims", default="32,80,96")
    args = ap.parse_args(argv)
    settings = harness.QUICK if args.quick else harness.FULL
    eng = peers.ferro_engine()
    print(harness.device_info()["gpu"], flush=True)
    if eng.backend.capability != 90:
        print(f"the wgmma kernels run on compute capability 9.0; this GPU is "
              f"{eng.backend.capability}: nothing to compare")
        return 1
    for d in (int(x) for x in args.dims.split(",")):
        for causal in (False, True):
            for name, table in TABLES.items():
                print(f"d{d} causal={causal} {name}: {kernels_of(table, d, causal)}", flush=True)
            for direction in ("fwd", "bwd"):
                case = case_of(d, causal, direction)
                crun = peers.CaseRun(case, harness.l2_bytes())
                rows = []
                for name in list(TABLES) * 2:
                    eng.backend.table = TABLES[name]  # (plans renewed)
                    rows.append((name, measure(crun, "ferrocupy", settings)))
                    peers.release()
                print(f"{case.id}:", flush=True)
                for name, r in rows:
                    if r["status"] == "ok":
                        print(f"  {name:10s} {r['ms']:8.3f} ms  {r['throughput']:7.1f} TFLOP/s  "
                              f"rel err {r['rel_err']:.1e}", flush=True)
                    else:
                        print(f"  {name:10s} {r['status']}: {r['reason']}", flush=True)
                del crun
                peers.release()
            x = inputs(d, B, S, H)
            flops = harness.attention_flops(B, H, S, S, d, causal, "bwd")
            print(f"bwd without lse d{d} causal={causal}:", flush=True)
            for name in list(TABLES) * 2:
                ms, diff = backward_without_lse(TABLES[name], x, causal)
                print(f"  {name:10s} {ms:8.3f} ms  {flops / ms / 1e9:7.1f} TFLOP/s (as the "
                      f"backward's)  rel diff from lse given {diff:.1e}", flush=True)
            del x
            peers.release()
    eng.backend.table = configs.TABLE
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
