"""The backward (given the forward's lse) with an additive mask, dropout, or both, beside the plain
call, in the tree on PYTHONPATH: TFLOP/s (2.5x the forward's FLOPs over visible keys). For A/B of
kernel trees in one device call (lab/ab_trees.sh prepare makes ab/<ref>/):

    for t in ab/A ab/B; do PYTHONPATH=$t python3 lab/bwd_options.py; done

bf16, B4 S4096 H16 D128 non-causal (the bias case's shape) and B8 S2048 H16/4 D64 causal. Each
call is first checked against the plain one (a mask of zeros: within 1% of its largest element,
as it may take another kernel; dropout 0: equal bits)."""
import os
import sys

import cupy as cp
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import harness  # noqa: E402
from ferrocupy import AttentionOptions, ComputeEngine  # noqa: E402

eng = ComputeEngine("cuda", quiet=True)
settings = harness.Settings()
stream = cp.cuda.get_current_stream()
torch.manual_seed(0)
for b, s, h, hkv, d, causal in ((4, 4096, 16, 16, 128, False), (8, 2048, 16, 4, 64, True)):
    r = lambda *shape: torch.randn(*shape, device="cuda", dtype=torch.bfloat16)
    q, go, k, v = r(b, s, h, d), r(b, s, h, d), r(b, s, hkv, d), r(b, s, hkv, d)
    out, gq, gk, gv = (torch.empty_like(x) for x in (q, q, k, k))
    lse = torch.empty(b, h, s, device="cuda")
    zeros, mask = torch.zeros(1, h, s, s, device="cuda", dtype=torch.bfloat16), r(1, h, s, s)
    flops = 2.5 * 4 * b * h * s * s * d / (2 if causal else 1)
    base = AttentionOptions(causal=causal)
    drop = AttentionOptions(causal=causal, dropout_prob=0.1, seed=1)
    eng.flash_attention_v2_with(q, k, v, out, base, None, lse=lse)
    def bwd(opts, m):
        return lambda: eng.flash_attention_v2_backward_with(q, k, v, out, go, gq, gk, gv, opts, m,
                                                            lse=lse)
    bwd(base, None)(); want = gq.clone()
    for name, opts, m in (("mask of zeros", base, zeros),
                          ("dropout 0", AttentionOptions(causal=causal, seed=1), None)):
        gq.fill_(float("nan")); bwd(opts, m)(); torch.cuda.synchronize()
        err = (gq.float() - want.float()).abs().max().item()
        assert err <= 0.01 * want.float().abs().max().item(), (name, err)
    for name, opts, m in (("plain", base, None), ("mask", base, mask), ("dropout 0.1", drop, None),
                          ("mask + dropout", drop, mask)):
        t = harness.time_calls(bwd(opts, m), stream, settings)
        print(f"bwd B{b} S{s} H{h}/{hkv} D{d} {'causal' if causal else 'noncausal':9s} {name:15s} "
              f"{t.median_ms:8.3f} ms {flops / t.median_ms / 1e9:7.1f} TFLOP/s", flush=True)
