"""Paged against contiguous decode on the GPU (issue 26's gate: paged decode at page sizes 16 and
256 within 5% of contiguous decode), the same keys either way; with --seq-q above 1 (more than
16 rows a KV group: 4 query heads a KV head), prefill on the forward's paged builds.

    python3 lab/paged_decode_ab.py [--dtypes bfloat16,float16,float32] [--pages 16,256]
                                   [--shapes 1x131072,16x32768,64x2048] [--order random|linear]
                                   [--seq-q 1] [--quick]
    python3 lab/paged_decode_ab.py --seq-q 1024 --shapes 4x8192,16x2048   # prefill

Per (dtype, batch x keys, page size): a contiguous cache `[B, Sk, 8, 128]` with kv_lens (every
sequence full) and the same keys as pages of a pool (`--order random`: each sequence's blocks
scattered over the pool, as an allocator that has run a while leaves them; `linear`: in order),
32 query heads, one query row (--seq-q: that many), causal bottom-right. The answers are checked
equal (the same kernel and splits: the same bits) before timing. Each side is the backend's
launches alone (the plan's checks, which copy kv_lens and block_table to the host, stay out),
timed with benchmarks/harness.py's time_calls over enough input sets that consecutive calls miss
L2; the two sides alternate in rounds (--rounds) and each side's median over the rounds is
reported, with paged / contiguous and whether it is within 5%.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import cupy as cp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
from harness import FULL, QUICK, device_info, l2_bytes, rotation_sets, time_calls  # noqa: E402

from ferrocupy import AttentionOptions, ComputeEngine  # noqa: E402
from ferrocupy.cuda import tuning  # noqa: E402
from ferrocupy.dtypes import parse  # noqa: E402

H, HKV, D = 32, 8, 128
GATE = 1.05


def make_set(rng, b: int, sk: int, page: int, dtype, order: str, sq: int = 1) -> dict:
    """One input set: q, out, a contiguous cache and the same keys as pages."""
    k = cp.asarray(rng.standard_normal((b, sk, HKV, D), dtype=np.float32)).astype(dtype)
    v = cp.asarray(rng.standard_normal((b, sk, HKV, D), dtype=np.float32)).astype(dtype)
    per = sk // page
    blocks = np.arange(b * per) if order == "linear" else rng.permutation(b * per)
    table = blocks.reshape(b, per).astype(np.int32)
    kp, vp = (cp.empty((b * per, page, HKV, D), dtype) for _ in range(2))
    flat = cp.asarray(table.reshape(-1))
    kp[flat] = k.reshape(b * per, page, HKV, D)
    vp[flat] = v.reshape(b * per, page, HKV, D)
    q = cp.asarray(rng.standard_normal((b, sq, H, D), dtype=np.float32)).astype(dtype)
    return dict(q=q, k=k, v=v, kp=kp, vp=vp, table=cp.asarray(table),
                lens=cp.full(b, sk, np.int32), out=cp.empty_like(q), out_p=cp.empty_like(q))


def launcher(eng: ComputeEngine, s: dict, paged: bool, stream):
    """A call running the backend's launches of the plan for set `s` (checked once here)."""
    opts = AttentionOptions(causal=True, causal_offset=s["k"].shape[1] - s["q"].shape[1])
    k, v, out = (s["kp"], s["vp"], s["out_p"]) if paged else (s["k"], s["v"], s["out"])
    table = s["table"] if paged else None
    plan = eng.plan_attention(s["q"], k, v, out, opts, kv_lens=s["lens"], block_table=table)
    ptrs = {n: 0 if x is None else x.data.ptr for n, x in
            dict(q=s["q"], k=k, v=v, out=out, kv_lens=s["lens"], block_table=table).items()}
    plan.run_pointers(ptrs)  # every check, once
    return tuning.kernels_only(eng.backend, plan, ptrs, stream.ptr)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtypes", default="bfloat16,float16,float32")
    ap.add_argument("--pages", default="16,256")
    ap.add_argument("--shapes", default="1x131072,16x32768,64x2048")
    ap.add_argument("--order", default="random", choices=("random", "linear"))
    ap.add_argument("--seq-q", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args()
    settings = QUICK if a.quick else FULL
    info = device_info()
    print(f"# {info['gpu']} (sm {info['compute_capability']}), ferrocupy {info['ferrocupy']}, "
          f"order {a.order}, seq_q {a.seq_q}")
    eng = ComputeEngine("cuda", quiet=True)
    stream = cp.cuda.Stream(non_blocking=True)
    rng = np.random.default_rng(0)
    print("dtype     shape          page  contiguous_us  paged_us  ratio  gate")
    failed = 0
    for dt in a.dtypes.split(","):
        dtype = parse(dt)
        for shape in a.shapes.split(","):
            b, sk = (int(x) for x in shape.split("x"))
            for page in (int(p) for p in a.pages.split(",")):
                kv_bytes = 2 * b * sk * HKV * D * np.dtype(dtype).itemsize
                n_sets = rotation_sets(kv_bytes, l2_bytes(), max_sets=4)
                sets = [make_set(rng, b, sk, page, dtype, a.order, a.seq_q)
                        for _ in range(n_sets)]
                # (made on the legacy stream, which the non-blocking one does not wait for: the
                # plan's check reads kv_lens and the table on it)
                cp.cuda.Device().synchronize()
                calls = {}
                with stream:
                    for paged in (False, True):
                        fns = [launcher(eng, s, paged, stream) for s in sets]
                        turn = [0]

                        def call(fns=fns, turn=turn):
                            fns[turn[0] % len(fns)]()
                            turn[0] += 1
                        calls[paged] = call
                stream.synchronize()
                for s in sets:  # the same geometry (and splits) on the same keys: the same bits
                    assert cp.array_equal(s["out"], s["out_p"]), f"{dt} {shape} page {page}"
                med = {False: [], True: []}
                for _ in range(a.rounds):
                    for paged in (False, True):
                        med[paged].append(time_calls(calls[paged], stream, settings).median_ms)
                c, p = (statistics.median(med[x]) * 1e3 for x in (False, True))
                ok = p <= GATE * c
                failed += not ok
                print(f"{dt:9} {shape:14} {page:4}  {c:13.1f}  {p:8.1f}  {p / c:5.3f}  "
                      f"{'ok' if ok else 'OVER 5%'}", flush=True)
                del sets, calls
                cp.get_default_memory_pool().free_all_blocks()
    print(f"# {failed} case(s) over the {GATE:.2f} gate")


if __name__ == "__main__":
    main()
