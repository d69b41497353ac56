"""Time candidate geometries of the streams or the tensor-core decode kernel (warps, keys per
lane group or per warp tile, buffers)
at the benchmark's decode shapes, to choose `cuda/configs.py`'s decode entries from measurements
(issue 9).

    python3 dev/decode_sweep.py [--dtypes bfloat16,float32] [--small] [--parts] [--design tensor]

Each candidate runs the whole decode (kernel + combine, as the backend plans it), is checked
against the table's own choice on the same inputs, then timed with CUDA events (median of 20
after 3 warm-up calls). Prints GB/s (K + V bytes read once) per (shape, dtype, geometry), and
torch SDPA cudnn's for the same shape. `--parts` times only the table's own plan, each launch on
its own (the decode kernel, then the combine), to see where a shape's time goes.
"""

from __future__ import annotations

import argparse
from concurrent.futures import ThreadPoolExecutor

import cupy as cp
import numpy as np

from ferrocupy import AttentionDims, AttentionOptions
from ferrocupy.cuda import configs
from ferrocupy.cuda.backend import CudaBackend
from ferrocupy.dtypes import parse
from tile_sweep import time_ms  # same folder: CUDA-event median after warm-up

SHAPES = [(16, 32768), (1, 131072), (64, 2048)]  # (batch, keys); H32 / KV heads 8, D128, Sq1
H, HKV, D = 32, 8, 128


def tensor_candidates(dtype) -> list[configs.Variant]:
    """The tensor-core kernel's geometries: warps, keys per warp tile, buffers per warp."""
    out = []
    for warps in (2, 4, 8):
        for tk in (16, 32):
            for stages in (2, 3, 4):
                v = configs.Variant(configs.DECODE, dtype, D, warps, 1, warps * tk,
                                    configs.TENSOR, stages, configs.DECODE_ROWS)
                if v.shared_bytes <= 227 * 1024:
                    out.append(v)
    return out


def candidates(dtype, small: bool = False, design: str = configs.STREAMS) -> list[configs.Variant]:
    if design == configs.TENSOR:
        return tensor_candidates(dtype)
    if design == configs.TILES:
        return [v for v in configs.TABLE[(configs.DECODE, dtype, D)] if v.isa == configs.TILES]
    out = []
    for warps in (4, 8):
        for lane_dims in ((16,) if small else (16, 8)):
            probe = configs.Variant(configs.DECODE, dtype, D, warps, 1, 0, configs.STREAMS, 0, 4,
                                    lane_dims)
            kw = 32 // probe.key_lanes
            for c in ((2, 4) if small else (1, 2, 4)):
                for stages in ((2, 3) if small else (2, 3, 4)):
                    v = configs.Variant(configs.DECODE, dtype, D, warps, 1, warps * kw * c,
                                        configs.STREAMS, stages, 4, lane_dims)
                    if v.shared_bytes <= 227 * 1024 and kw * c >= 4:
                        out.append(v)
    return out


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
                    "each of these split counts (comma list), to test configs.decode_splits")
    args = ap.parse_args()
    backend = CudaBackend()
    rows = []
    for dtype in (parse(x) for x in args.dtypes.split(",")):
        key = (configs.DECODE, dtype, D)
        default = backend.variant(configs.DECODE, dtype, D, 16, 4 * args.sq)
        with ThreadPoolExecutor(16) as pool:  # compile every candidate first, in parallel
            list(pool.map(lambda v: [backend.loader.function(v.source, name, v.defines, v.options)
                                     for name in (v.kernel, v.combine_kernel)],
                          [] if args.parts else candidates(dtype, args.small, args.design)))
        for B, SK in SHAPES:
            rng = cp.random.default_rng(0)
            mk = lambda *s: rng.standard_normal(s, dtype=cp.float32).astype(dtype)  # noqa: E731
            q, k, v = mk(B, args.sq, H, D), mk(B, SK, HKV, D), mk(B, SK, HKV, D)
            out = cp.empty_like(q)
            bufs = dict(q=q, k=k, v=v, out=out, mask=None, lse=None, kv_lens=None)
            p = AttentionDims.new(q, k).params(AttentionOptions())
            gbytes = 2 * k.nbytes / 1e9
            backend.table = configs.TABLE
            for launch in backend._plan_decode(bufs, p)[0]:
                backend._launch(*launch, p)
            want = out.astype(cp.float32)
            if args.parts:
                launches, _work = backend._plan_decode(bufs, p)
                splits = int(launches[0][4][configs.ARGS[configs.DECODE].index("splits")])
                total = time_ms(lambda: [backend._launch(*x, p) for x in launches])
                for i, x in enumerate(launches):
                    ms = time_ms(lambda x=x: backend._launch(*x, p))
                    tag = f"{x[0].name[13:23]} b{x[1]} t{x[2]}"
                    rows.append((f"b{B} sk{SK}", str(dtype), tag, splits, ms,
                                 gbytes / ms * 1e3 if i == 0 else 0.0, 0.0))
                rows.append((f"b{B} sk{SK}", str(dtype), "both", splits, total,
                             gbytes / total * 1e3, 0.0))
                chosen = configs.decode_splits
                for n in (int(x) for x in args.splits.split(",") if x):
                    def forced(pairs, reach, step, slots, max_splits=0, n=n):
                        per = -(-max(1, -(-reach // step)) // n)
                        return -(-max(1, -(-reach // step)) // per), per * step
                    configs.decode_splits = forced
                    try:
                        forced_launches, _ = backend._plan_decode(bufs, p)
                        out.fill(np.nan)
                        [backend._launch(*x, p) for x in forced_launches]
                        err = float(cp.linalg.norm(out.astype(cp.float32) - want)
                                    / cp.linalg.norm(want))
                        ms = time_ms(lambda: [backend._launch(*x, p) for x in forced_launches])
                        got = int(forced_launches[0][4][
                            configs.ARGS[configs.DECODE].index("splits")])
                        rows.append((f"b{B} sk{SK}", str(dtype), f"forced {n}", got, ms,
                                     gbytes / ms * 1e3, err))
                    finally:
                        configs.decode_splits = chosen
            for var in ([] if args.parts else candidates(dtype, args.small, args.design)):
                backend.table = dict(configs.TABLE) | {key: (var,)}
                launches, _work = backend._plan_decode(bufs, p)
                splits = int(launches[0][4][configs.ARGS[configs.DECODE].index("splits")])

                def run(launches=launches):
                    for launch in launches:
                        backend._launch(*launch, p)
                out.fill(np.nan)
                run()
                err = float(cp.linalg.norm(out.astype(cp.float32) - want) / cp.linalg.norm(want))
                ms = time_ms(run)
                tag = (f"w{var.warps} {'t' if var.isa == configs.TENSOR else 'l'}"
                       f"{var.step // var.warps if var.isa == configs.TENSOR else var.lane_dims}"
                       f" n{var.step} s{var.stages}"
                       + (" *" if var == default else ""))
                rows.append((f"b{B} sk{SK}", str(dtype), tag, splits, ms, gbytes / ms * 1e3, err))
            backend.table = configs.TABLE
            try:
                import torch
                import torch.nn.functional as F
                from torch.nn.attention import SDPBackend, sdpa_kernel

                tdt = getattr(torch, str(dtype))
                tq = torch.randn(B, H, args.sq, D, device="cuda", dtype=tdt)
                tk, tv = (torch.randn(B, SK, HKV, D, device="cuda", dtype=tdt).transpose(1, 2)
                          for _ in range(2))
                for name, be in (("flash", SDPBackend.FLASH_ATTENTION),
                                 ("cudnn", SDPBackend.CUDNN_ATTENTION)):
                    try:
                        with sdpa_kernel(be):
                            fn = lambda: F.scaled_dot_product_attention(tq, tk, tv, enable_gqa=True)  # noqa: E731,E501
                            ms = time_ms(fn)
                        rows.append((f"b{B} sk{SK}", str(dtype), f"torch-{name}", 0, ms,
                                     gbytes / ms * 1e3, 0.0))
                    except RuntimeError as e:
                        print(f"torch {name} skipped: {str(e).splitlines()[0]}")
            except ImportError:
                pass
    print(f"{'shape':<14}{'dtype':<10}{'geometry':<18}{'splits':>7}{'ms':>9}{'GB/s':>8}{'rel err':>10}")
    for r in rows:
        print(f"{r[0]:<14}{r[1]:<10}{r[2]:<18}{r[3]:>7}{r[4]:>9.4f}{r[5]:>8.0f}{r[6]:>10.1e}")


if __name__ == "__main__":
    main()
