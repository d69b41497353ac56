"""Time candidate geometries of the streams or the tensor-core decode kernel (warps, keys per
lane group or per warp tile, buffers) at the benchmark's decode shapes, to choose
`ferrocupy/cuda/configs.py`'s decode entries from measurements.

    python3 lab/decode_sweep.py [--dtypes bfloat16,float32] [--small] [--design tensor]
    python3 lab/decode_sweep.py --parts [--splits 8,16,32]

Each candidate, forced as the table's only one (`tuning.forcing`), runs the whole decode (its
kernel, and the combine where the design has one), is checked against the table's own choice on
the same inputs, then timed with CUDA events (median of 20 after 3 warm-up calls). Prints GB/s
(K + V bytes read once) per (shape, dtype, geometry), and torch SDPA flash's and cudnn's for the
same shape. `--parts` times only the table's own plan, each launch on its own, and with
`--splits` the same plan forced to each split count (`tuning.decode_splits`).
"""

from __future__ import annotations

import argparse
from concurrent.futures import ThreadPoolExecutor

import cupy as cp
import numpy as np

from ferrocupy import AttentionDims, AttentionOptions
from ferrocupy.cuda import configs, tuning
from ferrocupy.cuda.backend import CudaBackend
from ferrocupy.dtypes import parse
from tile_sweep import each_sdpa_backend, rel_err, time_ms  # same folder

SHAPES = [(16, 32768), (1, 131072), (64, 2048)]  # (batch, keys); H32 / KV heads 8, D128
H, HKV, D = 32, 8, 128
LIMIT = 227 * 1024  # the largest per-block shared memory of the GPUs tuned for (sm_90)


def tensor_candidates(dtype) -> list[configs.Variant]:
    """The tensor-core kernel's geometries: warps, keys per warp tile, buffers per warp."""
    return [v for warps in (2, 4, 8) for tk in (16, 32) for stages in (2, 3, 4)
            if (v := configs.Variant(configs.DECODE, dtype, D, warps, 1, warps * tk,
                                     configs.TENSOR, stages, configs.DECODE_ROWS)).shared_bytes
            <= LIMIT]


def streams_candidates(dtype, small: bool) -> list[configs.Variant]:
    """The streams kernel's: warps, head dims a lane, keys a lane group (C), buffers."""
    out = []
    for warps in (4, 8):
        for lane_dims in ((16,) if small else (16, 8)):
            lanes = configs.Variant(configs.DECODE, dtype, D, warps, 1, 0, configs.STREAMS, 0, 4,
                                    lane_dims).key_lanes
            kw = 32 // lanes
            for c in ((2, 4) if small else (1, 2, 4)):
                for stages in ((2, 3) if small else (2, 3, 4)):
                    v = configs.Variant(configs.DECODE, dtype, D, warps, 1, warps * kw * c,
                                        configs.STREAMS, stages, 4, lane_dims)
                    if v.shared_bytes <= LIMIT and kw * c >= 4:
                        out.append(v)
    return out


def candidates(dtype, small: bool, design: str) -> list[configs.Variant]:
    if design == configs.TENSOR:
        return tensor_candidates(dtype)
    if design == configs.TILES:
        return [v for v in configs.TABLE[(configs.DECODE, dtype, D)] if v.isa == configs.TILES]
    return streams_candidates(dtype, small)


def tag(var: configs.Variant) -> str:
    per = var.step // var.warps if var.isa == configs.TENSOR else var.lane_dims
    return f"w{var.warps} {'t' if var.isa == configs.TENSOR else 'l'}{per} n{var.step} s{var.stages}"


def timed(runs) -> float:
    return time_ms(lambda: [launch() for launch in runs])


def peer_rows(shape: str, dtype, B, SK, sq, gbytes) -> list:
    """torch SDPA flash's and cudnn's decode at the same shape, if torch runs."""
    try:
        import torch
        import torch.nn.functional as F
    except ImportError:
        return []
    rows = []
    tdt = getattr(torch, str(dtype))
    tq = torch.randn(B, H, sq, D, device="cuda", dtype=tdt)
    tk, tv = (torch.randn(B, SK, HKV, D, device="cuda", dtype=tdt).transpose(1, 2)
              for _ in range(2))

    def run(name):
        ms = time_ms(lambda: F.scaled_dot_product_attention(tq, tk, tv, enable_gqa=True))
        rows.append((shape, str(dtype), f"torch-{name}", 0, ms, gbytes / ms * 1e3, 0.0))

    each_sdpa_backend(run)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--small", action="store_true", help="16 dims a lane, 2-3 buffers, C 2-4")
    ap.add_argument("--design", default=configs.STREAMS, help="streams, tensor or tiles: whose "
                    "geometries to time")
    ap.add_argument("--sq", type=int, default=1, help="query rows per head (KV group rows: "
                    "4 x sq)")
    ap.add_argument("--parts", action="store_true", help="the table's plan, launch by launch")
    ap.add_argument("--splits", default="", help="with --parts: also time the plan forced to "
                    "each of these split counts (comma list)")
    args = ap.parse_args()
    backend = CudaBackend()
    rows = []
    for dtype in (parse(x) for x in args.dtypes.split(",")):
        default = backend.variant(configs.DECODE, dtype, D, 16, 4 * args.sq)
        todo = [] if args.parts else candidates(dtype, args.small, args.design)
        with ThreadPoolExecutor(16) as pool:  # compile every candidate first, in parallel
            list(pool.map(lambda v: [backend.loader.function(v.source, name, v.defines, v.options)
                                     for name in (v.kernel, v.combine_kernel)], todo))
        for B, SK in SHAPES:
            shape = f"b{B} sk{SK}"
            rng = cp.random.default_rng(0)
            mk = lambda *s: rng.standard_normal(s, dtype=cp.float32).astype(dtype)  # noqa: E731
            q, k, v = mk(B, args.sq, H, D), mk(B, SK, HKV, D), mk(B, SK, HKV, D)
            out = cp.empty_like(q)
            bufs = dict(q=q, k=k, v=v, out=out)
            p = AttentionDims.new(q, k).params(AttentionOptions())
            gbytes = 2 * k.nbytes / 1e9
            backend.table = configs.TABLE
            runs = tuning.launches(backend, "forward", bufs, p)
            for launch in runs:
                launch()
            want = out.astype(cp.float32)
            if args.parts:
                splits = int(runs[0].arg("splits"))
                for i, launch in enumerate(runs):
                    ms = time_ms(launch)
                    rows.append((shape, str(dtype), f"{launch.kernel[:18]} b{launch.blocks}",
                                 splits, ms, gbytes / ms * 1e3 if i == 0 else 0.0, 0.0))
                total = timed(runs)
                rows.append((shape, str(dtype), "all", splits, total, gbytes / total * 1e3, 0.0))
                for n in (int(x) for x in args.splits.split(",") if x):
                    with tuning.decode_splits(n):
                        forced = tuning.launches(CudaBackend(), "forward", bufs, p)
                    out.fill(np.nan)
                    for launch in forced:
                        launch()
                    ms = timed(forced)
                    rows.append((shape, str(dtype), f"forced {n}", int(forced[0].arg("splits")),
                                 ms, gbytes / ms * 1e3, rel_err(out, want)))
            for var in todo:
                backend.table = tuning.forcing(var)
                runs = tuning.launches(backend, "forward", bufs, p)
                out.fill(np.nan)
                for launch in runs:
                    launch()
                ms = timed(runs)
                rows.append((shape, str(dtype), tag(var) + (" *" if var == default else ""),
                             int(runs[0].arg("splits")), ms, gbytes / ms * 1e3,
                             rel_err(out, want)))
            backend.table = configs.TABLE
            rows += peer_rows(shape, dtype, B, SK, args.sq, gbytes)
    print(f"{'shape':<14}{'dtype':<10}{'geometry':<22}{'splits':>7}{'ms':>9}{'GB/s':>8}"
          f"{'rel err':>10}")
    for r in rows:
        print(f"{r[0]:<14}{r[1]:<10}{r[2]:<22}{r[3]:>7}{r[4]:>9.4f}{r[5]:>8.0f}{r[6]:>10.1e}")


if __name__ == "__main__":
    main()
