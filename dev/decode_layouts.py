"""Does the KV cache's memory layout move decode bandwidth? compare.py gives ferrocupy its own
layout ([B, S, Hkv, D]: a (batch, KV head)'s keys are 256-byte pieces 2 KB apart at D128 bf16)
and torch SDPA [B, Hkv, S, D] (each (batch, KV head)'s keys contiguous). This times both
libraries on both layouts, same data, at compare.py's decode shapes (bf16, H32 / KV heads 8,
D128, Sq 1), with compare.py's timer (back-to-back calls, CUDA-event median):

    python3 dev/decode_layouts.py [--dtype bfloat16]

ferrocupy takes the other layout as strided views (AttnLayout); torch as non-contiguous views
(whatever its backend does with them is what is timed). Each answer is checked against
ferrocupy's own-layout answer before timing.
"""

from __future__ import annotations

import argparse
import os
import sys

import cupy as cp

from ferrocupy import ComputeEngine, UnifiedTensor

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
from harness import FULL, time_calls  # noqa: E402

SHAPES = [(16, 32768), (1, 131072), (64, 2048)]
H, HKV, D = 32, 8, 128


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    eng = ComputeEngine("cuda", quiet=True)
    stream = cp.cuda.get_current_stream()
    rows = []
    for B, SK in SHAPES:
        rng = cp.random.default_rng(0)
        mk = lambda *s: rng.standard_normal(s, dtype=cp.float32).astype(args.dtype)  # noqa: E731
        q = mk(B, 1, H, D)
        k_bshd, v_bshd = mk(B, SK, HKV, D), mk(B, SK, HKV, D)
        k_bhsd, v_bhsd = (cp.ascontiguousarray(x.transpose(0, 2, 1, 3)) for x in (k_bshd, v_bshd))
        gb = 2 * k_bshd.nbytes / 1e9
        want = None
        for layout, (k, v) in (("bshd", (k_bshd, v_bshd)),
                               ("bhsd", (k_bhsd.transpose(0, 2, 1, 3), v_bhsd.transpose(0, 2, 1, 3)))):
            out = cp.full(q.shape, cp.nan, dtype=q.dtype)
            tq, tk, tv, to = (UnifiedTensor(x) for x in (q, k, v, out))
            call = lambda: eng.flash_attention_v2_with(tq, tk, tv, to)  # noqa: E731
            call()
            got = out.astype(cp.float32)
            if want is None:
                want = got
            err = float(cp.linalg.norm(got - want) / cp.linalg.norm(want))
            ms = time_calls(call, stream, FULL).median_ms
            rows.append((f"b{B} sk{SK}", f"ferrocupy {layout}", ms, gb / ms * 1e3, err))
        tq = torch.from_dlpack(q).transpose(1, 2)
        for layout, (k, v) in (("bhsd", (k_bhsd, v_bhsd)), ("bshd", (k_bshd.transpose(0, 2, 1, 3),
                                                                    v_bshd.transpose(0, 2, 1, 3)))):
            tk, tv = torch.from_dlpack(k), torch.from_dlpack(v)
            for name, be in (("flash", SDPBackend.FLASH_ATTENTION),
                             ("cudnn", SDPBackend.CUDNN_ATTENTION)):
                try:
                    with sdpa_kernel(be):
                        fn = lambda: F.scaled_dot_product_attention(tq, tk, tv, enable_gqa=True)  # noqa: E731,E501
                        o = fn()
                        got = cp.from_dlpack(o.transpose(1, 2).contiguous()).astype(cp.float32)
                        err = float(cp.linalg.norm(got - want) / cp.linalg.norm(want))
                        ms = time_calls(fn, stream, FULL).median_ms
                    rows.append((f"b{B} sk{SK}", f"torch-{name} {layout}", ms, gb / ms * 1e3, err))
                except RuntimeError as e:
                    rows.append((f"b{B} sk{SK}", f"torch-{name} {layout}: {str(e)[:40]}", 0, 0, 0))
    print(f"{'shape':<14}{'who / K,V layout':<24}{'ms':>9}{'GB/s':>8}{'rel err':>10}")
    for r in rows:
        print(f"{r[0]:<14}{r[1]:<24}{r[2]:>9.4f}{r[3]:>8.0f}{r[4]:>10.1e}")


if __name__ == "__main__":
    main()
