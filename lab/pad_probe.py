"""Would the sm_90a wgmma kernels, zero-padded up to head_dim 64 or 128, beat the mma.sync
kernels at the head_dims they do not serve today (issue 25: "every head_dim the API takes runs
there too, padded if that measures best")? Times each operation's whole launch sequence with the
table's choice and with the padded wgmma variants forced, on the same inputs, after checking the
two agree.

    python3 lab/pad_probe.py [--dims 32,48,80,96] [--seq 4096] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse

import cupy as cp

from ferrocupy import AttentionDims, AttentionOptions
from ferrocupy.cuda import configs, tuning
from ferrocupy.cuda.backend import CudaBackend
from ferrocupy.dtypes import parse

from tile_sweep import time_ms  # noqa: E402  (lab/ on sys.path when run as a script)


def padded_table(dtype, dp: int) -> dict:
    """configs.TABLE with the wgmma variants of the next wgmma width first for head_dim dp."""
    kd = 64 if dp <= 64 else 128
    table = dict(configs.TABLE)
    for op in (configs.FORWARD, configs.BACKWARD_DQ, configs.BACKWARD_DKDV):
        key = (op, dtype, dp)
        wgmma = tuple(v for v in configs.TABLE[(op, dtype, kd)] if v.isa == configs.WGMMA)
        table[key] = wgmma + tuple(table[key])
    return table


def run_both(res: dict, dtype, D, q, k, v, do, opts, dims, B, H, S) -> None:
    """Both tables' forward and backward on these inputs: outputs, timings, kernel names."""
    for name, table in (("table", configs.TABLE), ("wgmma", padded_table(dtype, D))):
        be = CudaBackend(table=table)
        be.fused_backward = False  # (times the two-kernel backward)
        out, gq, gk, gv = (cp.full(x.shape, cp.nan, dtype) for x in (q, q, k, v))
        lse = cp.empty((B, H, S), cp.float32)
        fwd = tuning.launches(be, "forward", dict(q=q, k=k, v=v, out=out, lse=lse),
                              dims.params(opts))
        bwd = tuning.launches(be, "backward", dict(q=q, k=k, v=v, out=out, grad_out=do,
                                                   grad_q=gq, grad_k=gk, grad_v=gv,
                                                   lse=lse), dims.params_bwd(opts))
        run = lambda ls: [f() for f in ls]  # noqa: E731
        run(fwd), run(bwd)
        cp.cuda.Device().synchronize()
        res[name] = dict(out=out.astype(cp.float32), gq=gq.astype(cp.float32),
                         gk=gk.astype(cp.float32), gv=gv.astype(cp.float32),
                         fwd=time_ms(lambda: run(fwd)), bwd=time_ms(lambda: run(bwd)),
                         kernels=[x.kernel for x in fwd + bwd])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dims", default="32,48,80,96")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    dtype = parse(args.dtype)
    S, B, H = args.seq, 16384 // args.seq, 16
    print(f"{'D':>4} {'causal':<7}{'op':<9}{'table ms':>10}{'wgmma ms':>10}{'ratio':>7}"
          f"{'TFLOP/s':>9}{'->':>3}{'TFLOP/s':>8}{'max rel diff':>14}   kernels")
    for D in (int(x) for x in args.dims.split(",")):
        rng = cp.random.default_rng(D)
        mk = lambda: rng.standard_normal((B, S, H, D), dtype=cp.float32).astype(dtype)  # noqa
        q, k, v, do = mk(), mk(), mk(), mk()
        for causal in (False, True):
            opts = AttentionOptions(causal=causal)
            dims = AttentionDims.new(q, k)
            res = {}
            try:
                run_both(res, dtype, D, q, k, v, do, opts, dims, B, H, S)
            except Exception as e:  # (a variant that cannot serve D: say so, go on)
                print(f"{D:>4} {str(causal):<7}failed: {type(e).__name__}: {e}"[:300])
                continue
            a, b = res["table"], res["wgmma"]
            diff = max(float(cp.linalg.norm(a[n] - b[n]) / cp.linalg.norm(a[n]))
                       for n in ("out", "gq", "gk", "gv"))
            for op, fl in (("fwd", 4), ("bwd", 10)):
                flops = fl * B * H * S * S * D / (2 if causal else 1)
                print(f"{D:>4} {str(causal):<7}{op:<9}{a[op]:>10.3f}{b[op]:>10.3f}"
                      f"{a[op] / b[op]:>7.2f}{flops / a[op] / 1e9:>9.1f}{'':>3}"
                      f"{flops / b[op] / 1e9:>8.1f}{diff:>14.1e}   "
                      f"{','.join(a['kernels'])} | {','.join(b['kernels'])}")


if __name__ == "__main__":
    main()
