"""Host cost of one call at a decode shape (issue 10 item 2): B1, Sq1, Sk128, H8, D64, float32.

    python3 dev/call_cost.py [--profile]

Times N calls back to back (the GPU work is a few microseconds, so the host is what is measured)
and prints microseconds per call for: the engine on pre-wrapped UnifiedTensors, the engine on
torch tensors passed straight in, ferrocupy.torch.attention, and torch SDPA."""

import sys
import time

import torch

import ferrocupy.torch as ft
from ferrocupy import AttentionOptions, ComputeEngine, UnifiedTensor

N = 2000


def per_call(fn) -> float:
    for _ in range(200):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(N):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / N * 1e6


q = torch.randn(1, 1, 8, 64, device="cuda")
k, v = torch.randn(1, 128, 8, 64, device="cuda"), torch.randn(1, 128, 8, 64, device="cuda")
out = torch.empty_like(q)
eng = ComputeEngine("cuda", quiet=True)
opts = AttentionOptions()
wq, wk, wv, wo = (UnifiedTensor(x) for x in (q, k, v, out))
qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
rows = [("engine, pre-wrapped", per_call(lambda: eng.flash_attention_v2_with(wq, wk, wv, wo, opts))),
        ("engine, torch tensors", per_call(lambda: eng.flash_attention_v2_with(q, k, v, out, opts))),
        ("ferrocupy.torch.attention", per_call(lambda: ft.attention(q, k, v))),
        ("torch SDPA", per_call(lambda: torch.nn.functional.scaled_dot_product_attention(qt, kt, vt)))]
for name, us in rows:
    print(f"{name:<28}{us:8.1f} us/call")

if "--profile" in sys.argv:  # where the host time of the first and third go (cProfile, 500 calls)
    import cProfile
    import pstats

    for name, fn in (("engine, pre-wrapped", lambda: eng.flash_attention_v2_with(wq, wk, wv, wo, opts)),
                     ("ferrocupy.torch.attention", lambda: ft.attention(q, k, v))):
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(500):
            fn()
        prof.disable()
        print(f"\n== {name} ==")
        pstats.Stats(prof).sort_stats("tottime").print_stats(22)
