"""Decode splits over each entry's own keys (lab/candidates/decode-splits/, a kernel overlay)
against main's splits over the capacity, on the GPU: decode over a preallocated cache whose
sequences fill only part of it (kv_lens), and over a sliding window.

    python3 lab/decode_splits_ab.py [--dtypes bfloat16,float32] [--fill 1,0.25,0.0625]
                                    [--shapes 8x32768,64x32768,8x131072] [--window 0,4096]
                                    [--designs auto,tiles] [--quick]

Per case: a cache [B, Sk, 8, 128] (Sk the capacity), kv_lens = fill x Sk for every entry, 32
query heads, one query row, causal bottom-right (and a window of W keys where given). Both sides
run the same plan (the same split count, planned on the capacity); only the kernels' division
of the keys differs. The answers are checked against each other before timing (the merge order
differs: within 1.6e-2 of the largest magnitude in half precision (4 bfloat16 ulps: a rounding flips where the merge order differs), 1e-5 in float32; the decode GPU
tests under the overlay check the candidate against the reference). Each side is the backend's launches alone (harness.py's
time_calls, enough input sets to miss L2), alternating in rounds; the median of each is printed
with candidate / main (below 1: the candidate faster). A full cache (fill 1) should not move;
fill 1/16 should move most (the review predicts the longest block doing 4-16x fewer keys).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys

import cupy as cp
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "benchmarks"))
from harness import FULL, QUICK, device_info, l2_bytes, rotation_sets, time_calls  # noqa: E402

from ferrocupy import AttentionOptions, ComputeEngine  # noqa: E402
from ferrocupy.cuda import configs, tuning  # noqa: E402
from ferrocupy.cuda.backend import CudaBackend  # noqa: E402
from ferrocupy.cuda.loader import KernelLoader  # noqa: E402
from ferrocupy.dtypes import parse  # noqa: E402

H, HKV, D = 32, 8, 128
# the candidate's overlay, built from its patch (lab/candidates/overlay.sh)
CANDIDATE = subprocess.run(["bash", os.path.join(HERE, "candidates", "overlay.sh"),
                            "decode-splits"], check=True, capture_output=True,
                           text=True).stdout.strip()


def engine(design: str, overlay: str | None) -> ComputeEngine:
    eng = ComputeEngine("cuda", quiet=True)
    table = None if design == "auto" else configs.only(design, configs.TILES)
    eng.backend = CudaBackend(table=table) if table is not None else CudaBackend()
    eng.backend.loader = KernelLoader(overlay=overlay)
    return eng


def make_set(rng, b: int, sk: int, fill: float, dtype) -> dict:
    k, v = (cp.asarray(rng.standard_normal((b, sk, HKV, D), dtype=np.float32)).astype(dtype)
            for _ in range(2))
    q = cp.asarray(rng.standard_normal((b, 1, H, D), dtype=np.float32)).astype(dtype)
    lens = cp.full(b, max(1, int(sk * fill)), np.int32)
    return dict(q=q, k=k, v=v, lens=lens, out_a=cp.empty_like(q), out_b=cp.empty_like(q))


def launcher(eng: ComputeEngine, s: dict, out: str, window: int, stream):
    opts = AttentionOptions(causal=True, causal_offset=s["k"].shape[1] - 1, window=window)
    plan = eng.plan_attention(s["q"], s["k"], s["v"], s[out], opts, kv_lens=s["lens"])
    ptrs = {n: x.data.ptr for n, x in dict(q=s["q"], k=s["k"], v=s["v"], out=s[out],
                                           kv_lens=s["lens"]).items()}
    plan.run_pointers(ptrs)  # every check, once
    return tuning.kernels_only(eng.backend, plan, ptrs, stream.ptr)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--fill", default="1,0.25,0.0625")
    ap.add_argument("--shapes", default="8x32768,64x32768,8x131072")
    ap.add_argument("--window", default="0,4096")
    ap.add_argument("--designs", default="auto")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args()
    settings = QUICK if a.quick else FULL
    info = device_info()
    print(f"# {info['gpu']} (sm {info['compute_capability']}), ferrocupy {info['ferrocupy']}; "
          f"candidate {CANDIDATE}")
    stream = cp.cuda.Stream(non_blocking=True)
    rng = np.random.default_rng(0)
    print("design  dtype     shape        fill    window  main_us  cand_us  cand/main  max_diff")
    for design in a.designs.split(","):
        main_eng, cand_eng = engine(design, None), engine(design, CANDIDATE)
        for dt in a.dtypes.split(","):
            dtype = parse(dt)
            tol = 1e-5 if np.dtype(dtype) == np.float32 else 1.6e-2  # (a few bf16 ulps)
            for shape in a.shapes.split(","):
                b, sk = (int(x) for x in shape.split("x"))
                for fill in (float(f) for f in a.fill.split(",")):
                    for window in (int(w) for w in a.window.split(",")):
                        kv_bytes = 2 * b * int(sk * fill) * HKV * D * np.dtype(dtype).itemsize
                        sets = [make_set(rng, b, sk, fill, dtype)
                                for _ in range(rotation_sets(kv_bytes, l2_bytes(), max_sets=4))]
                        # (made on the legacy stream, which a non-blocking one does not wait for)
                        cp.cuda.Device().synchronize()
                        calls = {}
                        with stream:
                            for side, eng, out in (("main", main_eng, "out_a"),
                                                   ("cand", cand_eng, "out_b")):
                                fns = [launcher(eng, s, out, window, stream) for s in sets]
                                turn = [0]

                                def call(fns=fns, turn=turn):
                                    fns[turn[0] % len(fns)]()
                                    turn[0] += 1
                                calls[side] = call
                                for f in fns:
                                    f()
                        stream.synchronize()
                        diff = max(float(cp.abs(s["out_a"].astype(cp.float32)
                                                - s["out_b"].astype(cp.float32)).max()
                                         / max(float(cp.abs(s["out_a"].astype(cp.float32))
                                                     .max()), 1e-30)) for s in sets)
                        assert diff <= tol, f"{design} {dt} {shape} fill {fill}: diff {diff}"
                        med = {"main": [], "cand": []}
                        for _ in range(a.rounds):
                            for side in ("main", "cand"):
                                med[side].append(time_calls(calls[side], stream,
                                                            settings).median_ms)
                        m, c = (statistics.median(med[x]) * 1e3 for x in ("main", "cand"))
                        print(f"{design:7} {dt:9} {shape:12} {fill:6.4f}  {window:6}  {m:7.1f}  "
                              f"{c:7.1f}  {c / m:9.3f}  {diff:.1e}", flush=True)
                        del sets, calls
                        cp.get_default_memory_pool().free_all_blocks()


if __name__ == "__main__":
    main()
