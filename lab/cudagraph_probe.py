"""Which ferrocupy.torch calls survive torch.compile(mode="reduce-overhead") (CUDA graph trees,
slow-path pool asserts on, as transformers' static-cache generate compiles): each form called
four times, against the eager call; graph breaks counted by torch._dynamo.explain."""
import sys
import traceback

import torch
import torch._inductor.config as iconf

import ferrocupy.torch as ft

iconf.triton.slow_path_cudagraph_asserts = True
dev = "cuda"
torch.manual_seed(0)


def case(sq, sk, mask, dtype):
    B, H, D = 3, 4, 16
    q = torch.randn(B, H, sq, D, device=dev, dtype=dtype).transpose(1, 2)  # transformers' views
    k = torch.randn(B, 2, sk, D, device=dev, dtype=dtype).transpose(1, 2)
    v = torch.randn(B, 2, sk, D, device=dev, dtype=dtype).transpose(1, 2)
    m = None
    if mask == "bool":
        m = torch.rand(B, 1, sq, sk, device=dev) > 0.3
        m[..., 0] = True
    return q, k, v, m


def f(q, k, v, m, causal, offset, p=0.0):
    return ft.attention(q, k, v, attn_mask=m, causal=causal, causal_offset=offset, dropout_p=p,
                        seed=None if not p else 5) * 2.0


for dtype in (torch.float32, torch.bfloat16):
    for sq, sk, mask, causal, p in ((1, 17, None, True, 0.0), (1, 17, "bool", False, 0.0),
                                    (5, 17, None, True, 0.0), (5, 17, "bool", False, 0.0),
                                    (5, 17, None, True, 0.1)):
        what = f"{dtype} sq{sq} sk{sk} mask={mask} causal={causal} dropout={p}"
        q, k, v, m = case(sq, sk, mask, dtype)
        try:
            ex = torch._dynamo.explain(f)(q, k, v, m, causal, sk - 1 if sq == 1 else 0, p)
            breaks = ex.graph_break_count
            torch._dynamo.reset()
            g = torch.compile(f, mode="reduce-overhead")
            want = f(q, k, v, m, causal, sk - 1 if sq == 1 else 0, p)
            for i in range(4):
                got = g(q, k, v, m, causal, sk - 1 if sq == 1 else 0, p)
            err = (got.float() - want.float()).abs().max().item()
            print(f"OK   {what}: breaks {breaks}, max diff {err:.2e}", flush=True)
        except Exception as e:  # noqa: BLE001
            print(f"FAIL {what}: {type(e).__name__}: {str(e)[:300]}", flush=True)
            traceback.print_exc(limit=-6, file=sys.stdout)
        torch._dynamo.reset()
