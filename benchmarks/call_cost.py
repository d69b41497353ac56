"""Host cost of one call (issue 10): the decode shape B1, Sq1, Sk128, H8, D64, float32, where the
GPU work is a few microseconds and the host is what is measured.

Six ways to call, timed back to back in one run (N calls after a warm-up, then one synchronize;
the median of 5 such rounds): the engine on pre-wrapped UnifiedTensors, the engine on torch
tensors passed straight in (a DLPack wrap each call), `ferrocupy.torch.attention`, and torch's
`scaled_dot_product_attention`; the last two again with inputs that require grad (each ratio is
against the SDPA row of the same kind). Each answer is checked against float64 SDPA first. Used
by compare.py (the "call-cost" table) and lab/call_cost.py."""

from __future__ import annotations

import statistics
import time

SHAPE = {"batch": 1, "seq_q": 1, "seq_k": 128, "heads": 8, "head_dim": 64}
CASE_ID = "call-cost-float32-b1-sq1-sk128-h8-d64"
TOLERANCE = 1e-4


def setup():
    """The inputs and the four calls: [(name, fn)], all on torch's current stream."""
    import torch
    import torch.nn.functional as F

    import ferrocupy.torch as ft
    from ferrocupy import AttentionOptions, ComputeEngine, UnifiedTensor

    B, Sq, Sk, H, D = (SHAPE[k] for k in ("batch", "seq_q", "seq_k", "heads", "head_dim"))
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(B, Sq, H, D, device="cuda", generator=g)
    k = torch.randn(B, Sk, H, D, device="cuda", generator=g)
    v = torch.randn(B, Sk, H, D, device="cuda", generator=g)
    out = torch.full_like(q, float("nan"))
    eng = ComputeEngine("cuda", quiet=True)
    opts = AttentionOptions()
    wq, wk, wv, wo = (UnifiedTensor(x) for x in (q, k, v, out))
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    want = F.scaled_dot_product_attention(qt.double(), kt.double(), vt.double()).transpose(1, 2)

    def check(name, got):
        torch.cuda.synchronize()
        err = float((got.double() - want).norm() / want.norm())
        if not err < TOLERANCE:
            raise AssertionError(f"{name}: relative error {err:.2e} (tolerance {TOLERANCE})")

    def engine_wrapped():
        eng.flash_attention_v2_with(wq, wk, wv, wo, opts)

    def engine_torch():
        eng.flash_attention_v2_with(q, k, v, out, opts)

    # With inputs that require grad, each call also records the autograd graph (and
    # ferrocupy.torch goes through its custom op and saves lse): a training step's forward.
    gq, gk, gv = (x.clone().requires_grad_() for x in (q, k, v))
    gqt, gkt, gvt = (x.transpose(1, 2) for x in (gq, gk, gv))
    calls = [("engine, pre-wrapped", engine_wrapped, lambda: out),
             ("engine, torch tensors", engine_torch, lambda: out),
             ("ferrocupy.torch.attention", lambda: ft.attention(q, k, v), None),
             ("torch SDPA", lambda: F.scaled_dot_product_attention(qt, kt, vt), None),
             ("ferrocupy.torch, grad", lambda: ft.attention(gq, gk, gv), None),
             ("torch SDPA, grad", lambda: F.scaled_dot_product_attention(gqt, gkt, gvt), None)]
    checked = []
    for name, fn, result in calls:
        out.fill_(float("nan"))
        got = fn()
        got = result() if result is not None else got
        got = got.detach()
        check(name, got if not name.startswith("torch SDPA") else got.transpose(1, 2))
        checked.append((name, fn))
    return checked


def per_call_us(fn, n: int = 2000, rounds: int = 5) -> float:
    import torch

    for _ in range(200):
        fn()
    times = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) / n * 1e6)
    return statistics.median(times)


def measure() -> list[dict]:
    """[{"name", "us_per_call"}] for the six calls, in one run."""
    return [{"name": name, "us_per_call": round(per_call_us(fn), 2)} for name, fn in setup()]


def format_table(rows: list[dict]) -> str:
    lines = [f"host cost per call, {CASE_ID} (median of 5 x 2000 calls)",
             f"{'call':<28}{'us/call':>9}{'vs torch SDPA':>15}"]
    sdpa = {r["name"].endswith(", grad"): r["us_per_call"] for r in rows
            if r["name"].startswith("torch SDPA")}
    for r in rows:
        base = sdpa.get(r["name"].endswith(", grad"))
        ratio = f"{r['us_per_call'] / base:.2f}x" if base else "-"
        lines.append(f"{r['name']:<28}{r['us_per_call']:>9.1f}{ratio:>15}")
    return "\n".join(lines)
