"""ferrocupy.torch on CUDA tensors against torch SDPA (bf16 and float32), on the default and on a
non-default stream: a smoke run for the device (the CPU paths are tested in tests/test_torch_ops.py).

    python3 dev/torch_cuda_smoke.py
"""

import torch
import torch.nn.functional as F

import ferrocupy.torch as ft


def run(dtype, stream=None):
    torch.manual_seed(0)
    B, S, H, Hkv, D = 2, 300, 8, 2, 64
    mk = lambda *s: torch.randn(*s, device="cuda", dtype=dtype, requires_grad=True)  # noqa: E731
    q, k, v = mk(B, S, H, D), mk(B, S, Hkv, D), mk(B, S, Hkv, D)
    g = torch.randn(B, S, H, D, device="cuda", dtype=dtype)
    ctx = torch.cuda.stream(stream) if stream is not None else torch.cuda.stream(torch.cuda.current_stream())
    with ctx:
        out = ft.attention(q, k, v, causal=True)
        gq, gk, gv = torch.autograd.grad(out, (q, k, v), g)
    torch.cuda.synchronize()
    t = lambda x: x.detach().double().transpose(1, 2).requires_grad_(True)  # noqa: E731
    rq, rk, rv = t(q), t(k), t(v)
    ro = F.scaled_dot_product_attention(rq, rk.repeat_interleave(H // Hkv, 1),
                                        rv.repeat_interleave(H // Hkv, 1), is_causal=True)
    rgq, rgk, rgv = torch.autograd.grad(ro, (rq, rk, rv), g.double().transpose(1, 2))
    rel = lambda a, b: float((a.double() - b.transpose(1, 2)).norm() / b.norm())  # noqa: E731
    print(f"{dtype} stream={'side' if stream is not None else 'default'}: out {rel(out, ro):.2e} "
          f"dq {rel(gq, rgq):.2e} dk {rel(gk, rgk):.2e} dv {rel(gv, rgv):.2e}", flush=True)


for dt in (torch.float32, torch.bfloat16):
    run(dt)
    run(dt, torch.cuda.Stream())
