"""One forward and one backward (given lse) at the benchmark's D128 S4096 bf16 shape, for ncu:

    ncu --clock-control none --section SpeedOfLight ... python3 lab/profile_once.py

FERRO_SHAPE=B,S,H,D (say 2,4096,8,256) changes the shape. FERRO_FWD_ISA=mma (say) profiles that forward kernel instead of the table's first choice;
FERRO_FWD_GEOMETRY=8,1,128,2 (warps, mt, keys a tile, K/V stages) the plain wgmma forward of that
geometry (lab/ncu_stalls.sh compares geometries so).
FERRO_DECODE=B,SK (say 1,131072) runs one bf16 decode step instead (Sq 1, H32 / KV heads 8,
D128: compare.py's decode shapes), its decode kernel and combine; FERRO_DECODE_DESIGN=streams
(or tensor, tiles) restricts the decode kernels to that design:

    FERRO_DECODE=1,131072 ncu --clock-control none --section SpeedOfLight \
        --section MemoryWorkloadAnalysis --section Occupancy python3 lab/profile_once.py
"""
import os

import cupy as cp

from ferrocupy import AttentionOptions, ComputeEngine, UnifiedTensor

B, S, H, D = (int(x) for x in os.environ.get("FERRO_SHAPE", "4,4096,16,128").split(","))
eng = ComputeEngine("cuda", quiet=True)
if os.environ.get("FERRO_DECODE"):
    b, sk = (int(x) for x in os.environ["FERRO_DECODE"].split(","))
    if os.environ.get("FERRO_DECODE_DESIGN"):
        from ferrocupy.cuda import configs

        eng.backend.table = configs.only(os.environ["FERRO_DECODE_DESIGN"])
    rng = cp.random.default_rng(0)
    q, k, v = (UnifiedTensor(rng.standard_normal(s, dtype=cp.float32).astype("bfloat16"))
               for s in ((b, 1, 32, D), (b, sk, 8, D), (b, sk, 8, D)))
    out = UnifiedTensor(cp.empty((b, 1, 32, D), dtype="bfloat16"))
    eng.flash_attention_v2_with(q, k, v, out)
    cp.cuda.Device().synchronize()
    raise SystemExit(0)
if os.environ.get("FERRO_FWD_ISA"):
    from ferrocupy.cuda import configs, tuning
    from ferrocupy.dtypes import BFLOAT16

    eng.backend.table = tuning.forcing(configs.Variant(
        configs.FORWARD, BFLOAT16, D, 8, 1, 128, os.environ["FERRO_FWD_ISA"]))
if os.environ.get("FERRO_FWD_GEOMETRY"):  # "warps,mt,step,stages": that plain wgmma forward
    from ferrocupy.cuda import configs, tuning
    from ferrocupy.dtypes import BFLOAT16

    w, mt, n, st = (int(x) for x in os.environ["FERRO_FWD_GEOMETRY"].split(","))
    eng.backend.table = tuning.forcing(configs.Variant(
        configs.FORWARD, BFLOAT16, D, w, mt, n, configs.WGMMA, stages=st, plain=True))
rng = cp.random.default_rng(0)
q, k, v, do = (UnifiedTensor(rng.standard_normal((B, S, H, D), dtype=cp.float32)
                             .astype("bfloat16")) for _ in range(4))
out, gq, gk, gv = (UnifiedTensor(cp.empty((B, S, H, D), dtype="bfloat16")) for _ in range(4))
lse = UnifiedTensor(cp.empty((B, H, S), dtype=cp.float32))
opts = AttentionOptions()
eng.flash_attention_v2_with(q, k, v, out, opts, lse=lse)
eng.flash_attention_v2_backward_with(q, k, v, out, do, gq, gk, gv, opts, lse=lse)
cp.cuda.Device().synchronize()
