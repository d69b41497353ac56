"""One small call of each kernel the sm_90 seam changed, printed before and after it runs, for
`compute-sanitizer --tool synccheck` / `racecheck` and for lab/triage_hang.sh (a call that never
prints its `ok` is the one that hung):

    compute-sanitizer --tool synccheck python3 lab/hang_suspects.py [CALL ...]

CALLs (default all, in this order): the sm_90a backward built with the mask and dropout (dQ and
dK/dV given the forward's lse; dK/dV alone without it), the wgmma forward with both, the plain
wgmma forward and backward, the merged mma.sync kernels (float32, and half at head_dim 32),
decode (tensor-core and float32 designs, splits merged by tickets). Lengths no multiple of a
tile, GQA 2, causal with an offset, a window, a row that sees nothing.
"""

from __future__ import annotations

import os
import sys

import numpy as np

from ferrocupy import AttentionOptions, ComputeEngine, UnifiedTensor
from ferrocupy.dtypes import BFLOAT16, FLOAT16, FLOAT32

B, SQ, SK, H, HKV = 2, 70, 133, 4, 2
OPTS = AttentionOptions(causal=True, causal_offset=20, window=57, dropout_prob=0.2, seed=3)


def main(argv: list[str]) -> None:
    # FERRO_SUSPECTS_CPU=1: the same calls on the reference backend (checks the script itself).
    on_cpu = bool(os.environ.get("FERRO_SUSPECTS_CPU"))
    where = "cpu" if on_cpu else "cuda"
    eng = ComputeEngine("reference" if on_cpu else "cuda", quiet=True)
    rng = np.random.default_rng(0)

    def put(shape, dtype):
        a = rng.standard_normal(shape).astype(np.float32).astype(dtype)
        return UnifiedTensor.from_numpy(a, device=where)

    def tensors(dtype, d, sq=SQ, sk=SK):
        q = put((B, sq, H, d), dtype)
        k, v = put((B, sk, HKV, d), dtype), put((B, sk, HKV, d), dtype)
        mask = put((B, 1, sq, sk), dtype)
        out = UnifiedTensor.empty(q.shape, dtype, device=where)
        lse = UnifiedTensor.empty((B, H, sq), np.float32, device=where)
        go = put(q.shape, dtype)
        grads = [UnifiedTensor.empty(x.shape, dtype, device=where) for x in (q, k, v)]
        return q, k, v, mask, out, lse, go, grads

    def backward_general(dtype, d):
        q, k, v, mask, out, lse, go, grads = tensors(dtype, d)
        eng.flash_attention_v2_with(q, k, v, out, OPTS, mask, lse=lse)
        eng.flash_attention_v2_backward_with(q, k, v, out, go, *grads, OPTS, mask, lse=lse)
        eng.flash_attention_v2_backward_with(q, k, v, out, go, *grads, OPTS, mask)

    def forward_general(dtype, d):
        q, k, v, mask, out, lse, _, _ = tensors(dtype, d, sq=400)
        eng.flash_attention_v2_with(q, k, v, out, OPTS, mask, lse=lse)

    def plain(dtype, d):
        q, k, v, _, out, lse, go, grads = tensors(dtype, d)
        causal = AttentionOptions(causal=True, causal_offset=20)
        eng.flash_attention_v2_with(q, k, v, out, causal, lse=lse)
        eng.flash_attention_v2_backward_with(q, k, v, out, go, *grads, causal, lse=lse)
        eng.flash_attention_v2_with(q, k, v, out)  # whole tiles, the alpha skip

    def decode(dtype, d):
        qd = put((2, 2, H, d), dtype)
        kd, vd = put((2, 1500, HKV, d), dtype), put((2, 1500, HKV, d), dtype)
        lens = UnifiedTensor.from_numpy(np.array([1500, 0], np.int32), device=where)
        out = UnifiedTensor.empty(qd.shape, dtype, device=where)
        lse = UnifiedTensor.empty((2, H, 2), np.float32, device=where)
        mask = put((2, 1, 2, 1500), dtype)
        eng.flash_attention_v2_with(qd, kd, vd, out, AttentionOptions(
            causal=True, causal_offset=1498, window=301, dropout_prob=0.1, seed=2), mask, lse=lse,
            kv_lens=lens)

    calls = {}
    for dt in (BFLOAT16, FLOAT16):
        for d in (64, 128):
            calls[f"bwd_general_{np.dtype(dt).name}_d{d}"] = (backward_general, dt, d)
    for d in (64, 128):
        calls[f"fwd_general_bfloat16_d{d}"] = (forward_general, BFLOAT16, d)
        calls[f"plain_bfloat16_d{d}"] = (plain, BFLOAT16, d)
    calls["mma_float32_d64"] = (backward_general, FLOAT32, 64)
    calls["mma_plain_float32_d64"] = (plain, FLOAT32, 64)
    calls["mma_half_d32"] = (backward_general, FLOAT16, 32)
    calls["decode_bfloat16_d128"] = (decode, BFLOAT16, 128)
    calls["decode_float32_d64"] = (decode, FLOAT32, 64)
    for name in argv or list(calls):
        fn, dt, d = calls[name]
        print(f"{name}: start", flush=True)
        fn(dt, d)
        if not on_cpu:
            import cupy

            cupy.cuda.Device().synchronize()
        print(f"{name}: ok", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
