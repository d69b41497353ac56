"""Why does the bf16 B1 Sk128k decode step take 185 us in one process and 217 us in another on
the same machine (H100, 2026-12-06), while B16 and B64 do not move? Hypothesis: its 16 splits
start exactly 16 MiB apart in K and in V (8192 keys x 2 KB), so the blocks' 32 streams walk
addresses a power of two apart and, for some physical placements of the buffers, crowd the same
DRAM channels. Each trial allocates fresh K and V (after a spacer of random size, to move them),
then times the same step forced to several split counts (15 and 17 put the streams 17.25 and
15.5 MiB apart) and torch SDPA cudnn on the same memory.

    python3 dev/decode_camping.py [--trials 6] [--splits 16,15,17,12,20]

Refuted (H100, 2026-12-06, the tensor-core kernel, 8 trials): 16 splits took 180.3-181.6 us in
every trial (cudnn 179.0-180.7 on the same memory), 15 took 185.5-186.6, 17 took 228.3-230.8
(136 blocks of one per SM: a second wave), 12 took 201-203 (96 SMs busy), 20 took 208-209. The
power-of-two spacing is the fastest. What does move B1 is the device idling before a call:
dev/decode_gap.py measured 180.8 us back to back and 216.9 us with the device idle before each
call, the 0.217 ms that compare.py reported in some runs (and cudnn's 215 us in some rounds of
dev/decode_layout.py).
"""
from __future__ import annotations

import argparse

import cupy as cp
import numpy as np

from ferrocupy import AttentionDims, AttentionOptions
from ferrocupy.cuda import configs
from ferrocupy.cuda.backend import CudaBackend
from ferrocupy.dtypes import parse
from decode_probe import back_to_back_us  # same folder

B, SK, H, HKV, D = 1, 131072, 32, 8, 128


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=6)
    ap.add_argument("--splits", default="16,15,17,12,20")
    args = ap.parse_args()
    counts = [int(x) for x in args.splits.split(",")]
    dtype = parse("bfloat16")
    backend = CudaBackend()
    rng = np.random.default_rng(1)
    chosen = configs.decode_splits
    print(f"{'trial':<6}{'k at (MiB)':>12}" + "".join(f"{'n' + str(n):>9}" for n in counts)
          + f"{'cudnn':>9}   (us per step)")
    keep = []
    for trial in range(args.trials):
        spacer = cp.empty(int(rng.integers(1, 4096)) << 20, dtype=cp.uint8)
        crng = cp.random.default_rng(trial)
        mk = lambda *s: crng.standard_normal(s, dtype=cp.float32).astype(dtype)  # noqa: E731
        q, k, v = mk(B, 1, H, D), mk(B, SK, HKV, D), mk(B, SK, HKV, D)
        out = cp.empty_like(q)
        bufs = dict(q=q, k=k, v=v, out=out, mask=None, lse=None, kv_lens=None)
        p = AttentionDims.new(q, k).params(AttentionOptions())
        row = []
        for n in counts:
            def forced(pairs, reach, step, slots, max_splits=0, n=n):
                tiles = max(1, -(-reach // step))
                per = -(-tiles // n)
                return -(-tiles // per), per * step
            configs.decode_splits = forced
            try:
                launches, _ = backend._plan_decode(bufs, p)
            finally:
                configs.decode_splits = chosen
            row.append(back_to_back_us(lambda: [backend._launch(*x, p) for x in launches]))
        try:
            import torch
            import torch.nn.functional as F
            from torch.nn.attention import SDPBackend, sdpa_kernel

            tq, tk, tv = (torch.from_dlpack(x).transpose(1, 2) for x in (q, k, v))
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                row.append(back_to_back_us(
                    lambda: F.scaled_dot_product_attention(tq, tk, tv, enable_gqa=True)))
        except Exception:  # noqa: BLE001
            row.append(float("nan"))
        print(f"{trial:<6}{(k.data.ptr >> 20) % 100000:>12}" + "".join(f"{t:9.1f}" for t in row))
        keep.append((spacer, q, k, v, out))  # held: the next trial lands elsewhere
        if len(keep) > 2:
            keep.pop(0)


if __name__ == "__main__":
    main()
