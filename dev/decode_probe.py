"""What bounds the streams decode kernel: its compute or its copies? Each geometry of
flash_decode_streams.cu runs three ways at compare.py's decode shapes (bf16, H32 / KV heads 8,
D128, Sq 1): as built, with FERRO_PROBE=1 (only the first tiles copied, the math done on every
tile: the compute alone) and FERRO_PROBE=2 (every tile copied, no math: the copies alone), beside
torch SDPA cudnn on the same memory. Times are CUDA-event medians of back-to-back calls (the
decode kernel, and the combine where the design has one: tiles) in us; `kernel` is the decode
kernel alone, without a combine (the same launch where the kernel merges its own splits); GB/s
counts K + V once.

    python3 dev/decode_probe.py [--dtype bfloat16] [--all]   (--all: every streams geometry of
                                                               decode_sweep.py --small)
"""
from __future__ import annotations

import argparse
import statistics
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import cupy as cp
import numpy as np

from ferrocupy import AttentionDims, AttentionOptions
from ferrocupy.cuda import configs
from ferrocupy.cuda.backend import CudaBackend
from ferrocupy.dtypes import parse

SHAPES = [(16, 32768), (1, 131072), (64, 2048)]
H, HKV, D = 32, 8, 128
# (warps, keys a lane group takes per tile, buffers a warp): 4 KB tiles x 5 / 7 and 2 KB x 9 /
# 13 at 8 warps; at 4 warps 8 KB x 4 (one block an SM), 4 KB x 7, 2 KB x 13 (two an SM)
DEEP = ((8, 2, 5), (8, 2, 7), (8, 1, 9), (8, 1, 13), (4, 4, 4), (4, 2, 7), (4, 1, 13))


@dataclass(frozen=True)
class Probe(configs.Variant):
    probe: int = 0

    @property
    def defines(self) -> dict:
        return super().defines | {"FERRO_PROBE": self.probe}


def probed(g: configs.Variant, probe: int) -> Probe:
    fields = {f: getattr(g, f) for f in configs.Variant.__dataclass_fields__}
    return Probe(**fields, probe=probe)


def back_to_back_us(fn, n=30, warm=5) -> float:
    """Median us of `fn` between CUDA events on the current stream (the legacy default stream,
    torch's too), after `warm` calls, the calls back to back (no wait until the last)."""
    for _ in range(warm):
        fn()
    pairs = []
    for _ in range(n):
        a, z = cp.cuda.Event(), cp.cuda.Event()
        a.record()
        fn()
        z.record()
        pairs.append((a, z))
    pairs[-1][1].synchronize()
    return statistics.median(cp.cuda.get_elapsed_time(a, z) * 1e3 for a, z in pairs)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--all", action="store_true")
    ap.add_argument("--deep", action="store_true", help="streams geometries with 20-26 KB of "
                    "copies in flight a warp (DEEP)")
    ap.add_argument("--tensor", action="store_true", help="also the tensor-core kernel's "
                    "geometries (8 warps x 16 keys, 2-3 buffers; 4 warps x 16 keys, 2-4; 4 x 32, "
                    "2; 2 warps x 16 keys, 4 and 6: three and more blocks an SM)")
    args = ap.parse_args()
    dtype = parse(args.dtype)
    backend = CudaBackend()
    key = (configs.DECODE, dtype, D)
    rows = []
    for B, SK in SHAPES:
        rng = cp.random.default_rng(0)
        mk = lambda *s: rng.standard_normal(s, dtype=cp.float32).astype(dtype)  # noqa: E731
        q, k, v = mk(B, 1, H, D), mk(B, SK, HKV, D), mk(B, SK, HKV, D)
        out = cp.empty_like(q)
        bufs = dict(q=q, k=k, v=v, out=out, mask=None, lse=None, kv_lens=None)
        p = AttentionDims.new(q, k).params(AttentionOptions())
        gb = 2 * k.nbytes / 1e9
        backend.table = configs.TABLE
        for launch in backend._plan_decode(bufs, p)[0]:
            backend._launch(*launch, p)
        want = out.astype(cp.float32)
        chosen = backend.variant(configs.DECODE, dtype, D, 16, 4, B * HKV > backend.sm_count)
        geoms = [chosen]
        if args.all:
            from decode_sweep import candidates
            geoms += [g for g in candidates(dtype, small=True) if g != chosen]
        if args.deep:  # more copies in flight a warp than the table's 16 KB (rows 4, 16 dims a lane)
            geoms += [configs.Variant(configs.DECODE, dtype, D, w, 1, w * 4 * c, configs.STREAMS, st,
                                      4, 16)
                      for w, c, st in DEEP]
        if args.tensor:
            geoms += [configs.Variant(configs.DECODE, dtype, D, w, 1, w * tk, configs.TENSOR, st,
                                      configs.DECODE_ROWS)
                      for w, tk, st in ((8, 16, 2), (8, 16, 3), (4, 16, 3), (4, 16, 4), (4, 32, 2),
                                        (4, 16, 2), (2, 16, 4), (2, 16, 6))]
        with ThreadPoolExecutor(16) as pool:  # compile every (geometry, probe) first, in parallel
            list(pool.map(lambda v: [backend.loader.function(v.source, name, v.defines, v.options)
                                     for name in (v.kernel,) + ((v.combine_kernel,) if v.isa
                                                                == configs.TILES else ())],
                          [probed(g, pr) for g in geoms for pr in (0, 1, 2)]))
        for g in geoms:
            times = []
            for probe in (0, 1, 2):
                backend.table = dict(configs.TABLE) | {key: (probed(g, probe),)}
                try:
                    launches, _ = backend._plan_decode(bufs, p)
                except ValueError:  # select passes it over at this shape (8 warps, many pairs)
                    break
                splits = int(launches[0][4][configs.ARGS[configs.DECODE].index("splits")])
                out.fill(np.nan)
                if probe == 0:
                    [backend._launch(*x, p) for x in launches]
                    err = float(cp.linalg.norm(out.astype(cp.float32) - want) / cp.linalg.norm(want))
                times.append(back_to_back_us(lambda: [backend._launch(*x, p) for x in launches]))
                if probe == 0:  # the decode kernel without its combine
                    alone = back_to_back_us(lambda: backend._launch(*launches[0], p))
            if len(times) < 3:
                continue
            tag = (f"{g.isa[0]} w{g.warps} n{g.step} s{g.stages}" + (" *" if g == chosen else ""))
            rows.append((f"b{B} sk{SK}", tag, splits, *times, alone, gb / times[0] * 1e6, err))
        backend.table = configs.TABLE
        try:
            import torch
            import torch.nn.functional as F
            from torch.nn.attention import SDPBackend, sdpa_kernel

            tq, tk, tv = (torch.from_dlpack(x).transpose(1, 2) for x in (q, k, v))
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                us = back_to_back_us(
                    lambda: F.scaled_dot_product_attention(tq, tk, tv, enable_gqa=True))
            rows.append((f"b{B} sk{SK}", "torch-cudnn", 0, us, 0.0, 0.0, us, gb / us * 1e6, 0.0))
        except Exception as e:  # noqa: BLE001
            print(f"cudnn skipped: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
        del q, k, v, out, bufs
        cp.get_default_memory_pool().free_all_blocks()
    print(f"{'shape':<14}{'geometry':<16}{'splits':>7}{'us':>9}{'compute':>9}{'copies':>9}"
          f"{'kernel':>9}{'GB/s':>8}{'err':>9}")
    for r in rows:
        print(f"{r[0]:<14}{r[1]:<16}{r[2]:>7}{r[3]:>9.1f}{r[4]:>9.1f}{r[5]:>9.1f}{r[6]:>9.1f}"
              f"{r[7]:>8.0f}{r[8]:>9.1e}")


if __name__ == "__main__":
    main()
