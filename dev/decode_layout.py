"""Does the KV cache's memory layout decide the decode gap to cudnn? compare.py hands ferrocupy
[B, S, Hkv, D] memory (a KV head's key rows 256 B each, Hkv * 256 B apart) and torch SDPA
[B, Hkv, S, D] contiguous copies (each head's keys one contiguous run). Here both libraries read
the same memory in both layouts: ferrocupy takes [B, H, S, D] memory as a transposed view, torch
takes [B, S, H, D] memory as a transposed view. Rounds are interleaved and every round allocates
fresh inputs, to see whether where the buffers land moves the times.

    python3 dev/decode_layout.py [--dtypes bfloat16,float32] [--rounds 3] [--shapes 16,32768;1,131072;64,2048]

Prints us per call (CUDA-event median of 40 after warm-up) and GB/s (K + V bytes once) per
(shape, dtype, memory layout, implementation), each output checked against torch's math
backend in float32 on the same memory first.
"""
from __future__ import annotations

import argparse

import cupy as cp
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from ferrocupy import ComputeEngine, UnifiedTensor
from decode_probe import back_to_back_us  # same folder: CUDA-event median, back to back

H, HKV, D = 32, 8, 128
BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}


def inputs(b, sk, dtype, layout):
    """q [B, 1, H, D] and k, v as [B, S, Hkv, D] views of memory laid out as `layout`."""
    tdt = getattr(torch, dtype)
    q = torch.randn(b, 1, H, D, device="cuda", dtype=tdt)
    if layout == "bshd":
        k, v = (torch.randn(b, sk, HKV, D, device="cuda", dtype=tdt) for _ in range(2))
    else:
        k, v = (torch.randn(b, HKV, sk, D, device="cuda", dtype=tdt).transpose(1, 2)
                for _ in range(2))
    return q, k, v


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--shapes", default="16,32768;1,131072;64,2048")
    args = ap.parse_args()
    shapes = [tuple(int(x) for x in s.split(",")) for s in args.shapes.split(";")]
    eng = ComputeEngine("cuda", quiet=True)
    rows = {}
    for rnd in range(args.rounds):
        for b, sk in shapes:
            for dtype in args.dtypes.split(","):
                for layout in ("bshd", "bhsd"):
                    q, k, v = inputs(b, sk, dtype, layout)
                    gb = 2 * k.numel() * k.element_size() / 1e9
                    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))  # torch's [B, H, S, D]
                    with sdpa_kernel(SDPBackend.MATH):
                        ref = F.scaled_dot_product_attention(qt.float(), kt.float(), vt.float(),
                                                             enable_gqa=True)
                    fq, fk, fv = (UnifiedTensor(cp.from_dlpack(x)) for x in (q, k, v))
                    out = torch.full_like(q, float("nan"))
                    fo = UnifiedTensor(cp.from_dlpack(out))
                    impls = {"ferro": lambda: eng.flash_attention_v2_with(fq, fk, fv, fo)}
                    for name, be in BACKENDS.items():
                        def run(be=be):
                            with sdpa_kernel(be):
                                return F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)
                        impls[name] = run
                    for name, fn in impls.items():
                        key = (b, sk, dtype, layout, name)
                        try:
                            got = fn()
                            torch.cuda.synchronize()
                            got = out if name == "ferro" else got.transpose(1, 2)
                            err = float((got.float() - ref.transpose(1, 2)).norm() /
                                        ref.norm())
                            us = back_to_back_us(fn, n=40)
                        except Exception as e:  # a backend that rejects the strides
                            rows.setdefault(key, []).append(f"({type(e).__name__})")
                            continue
                        rows.setdefault(key, []).append(us)
                        if rnd == 0:
                            rows.setdefault(key + ("err",), []).append(err)
                    del q, k, v, qt, kt, vt, fq, fk, fv, out, fo, ref, impls
                    torch.cuda.empty_cache()
                    cp.get_default_memory_pool().free_all_blocks()
    print(f"{'shape':<14}{'dtype':<10}{'memory':<7}{'impl':<7}{'us per round':<30}"
          f"{'GB/s (best)':>12}{'rel err':>10}")
    for key, ts in rows.items():
        if key[-1] == "err":
            continue
        b, sk, dtype, layout, name = key
        gb = 2 * b * sk * HKV * D * (4 if dtype == "float32" else 2) / 1e9
        nums = [t for t in ts if isinstance(t, float)]
        best = f"{gb / (min(nums) * 1e-6):12.0f}" if nums else f"{'-':>12}"
        err = rows.get(key + ("err",), [float("nan")])[0]
        cells = " ".join(f"{t:7.1f}" if isinstance(t, float) else t for t in ts)
        print(f"b{b} sk{sk:<9}{dtype:<10}{layout:<7}{name:<7}{cells:<30}{best}{err:10.1e}")


if __name__ == "__main__":
    main()
