"""Time candidate tile geometries of the half-precision kernels on this GPU, one kernel at a time,
to choose `ferrocupy/cuda/configs.py`'s table from measurements.

    python3 lab/tile_sweep.py [--dtype bfloat16] [--dims 64,128] [--seq 4096] [--ops forward]

(`--dims 160,192,256`: the wide head_dims, whose table order is FA2's until swept; dK/dV there in
configs.dkdv_parts' column ranges, no wgmma.)

Shapes are the benchmark's: 16k tokens per batch (B = 16384 / S), hidden 2048 (H = 2048 / D).
Each geometry is compiled (in parallel, first), forced as the table's only candidate
(`tuning.forcing`), checked against the table's own choice on the same inputs, then its kernel
alone is timed with CUDA events (median of 20 after 3 warm-up launches). Prints TFLOP/s per (op,
dtype, D, causal, geometry) and torch SDPA flash's and cudnn's for the same shape.
"""

from __future__ import annotations

import argparse
import statistics
from concurrent.futures import ThreadPoolExecutor

import cupy as cp

from ferrocupy import AttentionDims, AttentionOptions
from ferrocupy.cuda import configs, tuning
from ferrocupy.cuda.backend import CudaBackend
from ferrocupy.dtypes import parse

GEOMETRIES = {  # (warps, mt, step[, isa[, stages]]); wgmma ones as `plain` builds (--general: not)
    configs.FORWARD: [(4, 1, 64), (4, 2, 64), (4, 1, 128), (8, 1, 64), (8, 1, 128), (4, 2, 32),
                      (8, 2, 64), (8, 1, 128, configs.WGMMA), (12, 1, 128, configs.WGMMA),
                      (12, 1, 64, configs.WGMMA), (8, 1, 128, configs.WGMMA, 2),
                      (8, 1, 64, configs.WGMMA, 3), (8, 1, 64, configs.WGMMA, 4)],
    configs.BACKWARD_DQ: [(4, 1, 32), (4, 1, 64), (8, 1, 64), (4, 2, 32), (8, 1, 32), (4, 1, 128)],
    configs.BACKWARD_DKDV: [(4, 1, 16), (4, 1, 32), (4, 1, 64), (8, 1, 32), (8, 1, 64), (4, 2, 32),
                            (2, 2, 64)],
}
FLOPS = {configs.FORWARD: 4, configs.BACKWARD_DQ: 6, configs.BACKWARD_DKDV: 8}  # x B H Sq Sk D
# where each op's kernel sits among its operation's launches, and the output it writes
LAUNCH = {configs.FORWARD: ("forward", 0, "out"), configs.BACKWARD_DQ: ("backward", 0, "grad_q"),
          configs.BACKWARD_DKDV: ("backward", 1, "grad_k")}


def time_ms(fn, reps=20, warm=3) -> float:
    """CUDA-event median of `reps` calls of `fn` after `warm` untimed ones."""
    for _ in range(warm):
        fn()
    times = []
    for _ in range(reps):
        a, b = cp.cuda.Event(), cp.cuda.Event()
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(cp.cuda.get_elapsed_time(a, b))
    return statistics.median(times)


def rel_err(got, want) -> float:
    got = got.astype(cp.float32)
    return float(cp.linalg.norm(got - want) / cp.linalg.norm(want))


def each_sdpa_backend(run) -> None:
    """`run(name)` under torch SDPA's flash and then its cudnn backend, forced; a backend that
    refuses the call is reported and passed over."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    for name, backend in (("flash", SDPBackend.FLASH_ATTENTION),
                          ("cudnn", SDPBackend.CUDNN_ATTENTION)):
        try:
            with sdpa_kernel(backend):
                run(name)
        except RuntimeError as e:
            print(f"torch {name} skipped: {str(e).splitlines()[0]}")


def peer_rows(dtype, B, S, H, D, causal) -> list:
    """torch SDPA flash's and cudnn's forward and backward at the same shape, if torch runs."""
    try:
        import torch
        import torch.nn.functional as F
    except ImportError:
        return []
    rows = []
    tq, tk, tv = (torch.randn(B, H, S, D, device="cuda", dtype=getattr(torch, str(dtype)),
                              requires_grad=True) for _ in range(3))

    def run(name):
        o = F.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)
        g = torch.randn_like(o)
        fwd = lambda: F.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)  # noqa: E731
        bwd = lambda: torch.autograd.grad(o, (tq, tk, tv), g, retain_graph=True)  # noqa: E731
        for direction, fn, fl in (("fwd", fwd, 4), ("bwd", bwd, 10)):
            ms = time_ms(fn)
            rows.append((f"torch-{name}-{direction}", str(dtype), D, causal, "", ms,
                         fl * B * H * S * S * D / (2 if causal else 1) / ms / 1e9, 0.0))

    each_sdpa_backend(run)
    return rows


def label(var) -> str:
    """A geometry as the table prints it (and `--only` matches it)."""
    return f"w{var.warps} m{var.mt} n{var.step} s{var.stages} {var.isa}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--dims", default="64,128")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--ops", default="forward,backward_dq,backward_dkdv")
    ap.add_argument("--wgmma-only", action="store_true", help="only the sm_90a geometries")
    ap.add_argument("--general", action="store_true",
                    help="wgmma geometries as their general builds (mask, dropout, model options)")
    ap.add_argument("--only", default="",
                    help="comma-separated geometry labels to keep, each a prefix of the printed "
                         "one (\"w8 m1 n128 s2,w12 m1 n64\")")
    ap.add_argument("--no-peers", action="store_true", help="no torch SDPA rows")
    args = ap.parse_args()
    only = [x.strip() for x in args.only.split(",") if x.strip()]
    dtype = parse(args.dtype)
    backend = CudaBackend()
    backend.fused_backward = False  # the dQ and dK/dV kernels' geometries (LAUNCH's positions)
    limit = tuning.shared_memory_limit()
    S = args.seq
    rows = []
    for D in (int(x) for x in args.dims.split(",")):
        B, H = 16384 // S, 2048 // D
        wg_plain = dict(plain=not args.general, mods=args.general)
        variants = {op: [v for v in (configs.Variant(op, dtype, D, *g,
                                                     parts=configs.dkdv_parts(op, D),
                                                     **(wg_plain if g[3:4] == (configs.WGMMA,)
                                                        else {}))
                                     for g in gs)
                         if v.runs_on(backend.capability, 16) and v.shared_bytes <= limit
                         and (v.isa == configs.WGMMA or not args.wgmma_only)
                         and (v.isa != configs.WGMMA or D <= configs.MEASURED_HEAD_DIM)
                         and (not only or any(label(v).startswith(o) for o in only))]
                    for op, gs in GEOMETRIES.items() if op in args.ops.split(",")}
        with ThreadPoolExecutor(16) as pool:
            list(pool.map(lambda v: backend.loader.function(v.source, v.kernel, v.defines,
                                                            v.options),
                          [v for vs in variants.values() for v in vs]))
        rng = cp.random.default_rng(0)
        mk = lambda *s: rng.standard_normal(s, dtype=cp.float32).astype(dtype)  # noqa: E731
        q, k, v, do = mk(B, S, H, D), mk(B, S, H, D), mk(B, S, H, D), mk(B, S, H, D)
        out, gq, gk, gv = (cp.empty_like(x) for x in (q, q, k, v))
        lse = cp.empty((B, H, S), cp.float32)
        bufs = {"forward": dict(q=q, k=k, v=v, out=out, lse=lse),
                "backward": dict(q=q, k=k, v=v, out=out, grad_out=do, grad_q=gq, grad_k=gk,
                                 grad_v=gv, lse=lse)}
        for causal in (False, True):
            opts = AttentionOptions(causal=causal)
            dims = AttentionDims.new(q, k)
            params = {"forward": dims.params(opts), "backward": dims.params_bwd(opts)}
            # The table's own variants: out, lse, and the answers to check each geometry against.
            backend.table = configs.TABLE
            for op in ("forward", "backward"):
                for launch in tuning.launches(backend, op, bufs[op], params[op]):
                    launch()
            want = {n: bufs["backward"][n].astype(cp.float32) for n in ("out", "grad_q", "grad_k")}
            for op, vs in variants.items():
                which, at, name = LAUNCH[op]
                flops = FLOPS[op] * B * H * S * S * D / (2 if causal else 1)
                for var in vs:
                    backend.table = tuning.forcing(var)
                    runs = tuning.launches(backend, which, bufs[which], params[which])
                    for launch in runs:  # dK/dV reads the statistics dQ writes
                        launch()
                    ms = time_ms(runs[at])
                    rows.append((op, str(dtype), D, causal,
                                 label(var), ms,
                                 flops / ms / 1e9, rel_err(bufs[which][name], want[name])))
            backend.table = configs.TABLE
            if not args.no_peers:
                rows += peer_rows(dtype, B, S, H, D, causal)
    print(f"{'op':<22}{'dtype':<10}{'D':>4} {'causal':<7}{'geometry':<24}{'ms':>9}{'TFLOP/s':>9}"
          f"{'rel err':>10}")
    for r in rows:
        print(f"{r[0]:<22}{r[1]:<10}{r[2]:>4} {str(r[3]):<7}{r[4]:<24}{r[5]:>9.3f}{r[6]:>9.1f}"
              f"{r[7]:>10.1e}")


if __name__ == "__main__":
    main()
