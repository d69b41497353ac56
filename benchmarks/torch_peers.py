"""PyTorch peers: `scaled_dot_product_attention` with each backend forced through
`torch.nn.attention.sdpa_kernel`, and plain eager rotate-half RoPE. Each gets [B, H, S, D]
contiguous copies of the shared inputs; a backend that rejects a case is Unsupported, with the
reason PyTorch gives."""

from __future__ import annotations

import warnings

import harness
from peers import ROPE_THETA, Prepared, Unsupported, _torch, to_torch

MATH_SCORE_LIMIT = 8 << 30     # bytes of float32 scores the math backend may materialize


def _bhsd(x, torch, grad=False):
    y = to_torch(x).transpose(1, 2).contiguous()
    return y.requires_grad_(True) if grad else y


def prepare_torch_sdpa(case, sets, backend: str) -> Prepared:
    torch = _torch()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    which = {"flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION",
             "cudnn": "CUDNN_ATTENTION", "math": "MATH"}[backend]
    if not hasattr(SDPBackend, which):
        raise Unsupported(f"this torch has no SDPBackend.{which}")
    kernel = getattr(SDPBackend, which)
    if case.causal and case.causal_offset >= case.seq_k - 1:
        is_causal = False                  # every key visible (decode)
    elif not case.causal or (case.causal_offset == 0 and case.seq_q == case.seq_k):
        is_causal = case.causal
    else:
        raise Unsupported("torch SDPA has no causal_offset")
    scores = case.batch * case.heads * case.seq_q * case.seq_k * 4
    if backend == "math" and scores > MATH_SCORE_LIMIT:
        raise Unsupported(f"math would materialize {scores / 2**30:.0f} GiB of scores "
                          f"(limit {MATH_SCORE_LIMIT >> 30} GiB)")
    kw = {"is_causal": is_causal}
    if case.kv_heads != case.heads:
        kw["enable_gqa"] = True
    bwd = case.direction == "bwd"
    f = torch.nn.functional.scaled_dot_product_attention

    def fwd(q, k, v):
        with sdpa_kernel(kernel):
            return f(q, k, v, **kw)

    runs, outs = [], []
    for st in sets:
        q, k, v = (_bhsd(st[n], torch, bwd) for n in ("q", "k", "v"))
        out = _trial(lambda: fwd(q, k, v), torch, backend)
        if not bwd:
            runs.append(lambda q=q, k=k, v=v: fwd(q, k, v))
            outs.append(lambda q=q, k=k, v=v: {"out": (fwd(q, k, v), "bhsd")})
            continue
        do = _bhsd(st["do"], torch)
        def grad(o=out, q=q, k=k, v=v, do=do):    # only the backward: the graph is kept
            return torch.autograd.grad(o, (q, k, v), do, retain_graph=True)

        _trial(grad, torch, backend + " backward")
        runs.append(grad)
        outs.append(lambda grad=grad: dict(zip(("dq", "dk", "dv"),
                                               ((g, "bhsd") for g in grad()))))

    def check():
        res = outs[0]()
        torch.cuda.synchronize()
        return res

    return Prepared(f"torch-{backend}", harness.torch_stream_for_cupy(torch), runs, check)


def _trial(fn, torch, what: str):
    """Run `fn` once; a backend that rejects the case becomes Unsupported with torch's reason."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            res = fn()
            torch.cuda.synchronize()
            return res
        except (RuntimeError, TypeError, ValueError, NotImplementedError) as e:
            if isinstance(e, torch.cuda.OutOfMemoryError):
                torch.cuda.empty_cache()
                raise Unsupported(f"{what}: out of memory") from None
            why = [str(w.message).strip().split("\n")[0] for w in caught]
            msg = "; ".join(dict.fromkeys(why)) or str(e).split("\n")[0]
            raise Unsupported(f"{what} rejects this case: {msg[:300]}") from None


def prepare_torch_rope(case, sets, positions=None) -> Prepared:
    """Plain eager RoPE as model code writes it: cos/sin precomputed (per batch entry from
    positions), Hugging Face's rotate_half (GPT-J's rotate_every_two when interleaved), the
    features past rotary_dim concatenated back."""
    torch = _torch()
    bsz, seq, heads, d = case.shape
    r = case.rotary_dim
    xs = [_bhsd(st["x"], torch) for st in sets]
    dev = xs[0].device
    inv = 1.0 / (ROPE_THETA ** (torch.arange(0, r, 2, dtype=torch.int64, device=dev).float() / r))
    t = (torch.arange(seq, dtype=torch.int64, device=dev)[None] if positions is None
         else to_torch(positions))
    freqs = t.float()[..., None] * inv                     # [1 or B, S, r/2]
    interleaved = case.rope == "interleaved"
    emb = freqs.repeat_interleave(2, -1) if interleaved else torch.cat((freqs, freqs), dim=-1)
    dtype = getattr(torch, case.dtype)
    cos, sin = (f(emb).to(dtype)[:, None] for f in (torch.cos, torch.sin))  # [., 1, S, r]

    def turn(x):
        if interleaved:
            return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)
        return torch.cat((-x[..., r // 2:], x[..., : r // 2]), dim=-1)

    def rope(x):
        if r == d:
            return x * cos + turn(x) * sin
        x_rot = x[..., :r]
        return torch.cat((x_rot * cos + turn(x_rot) * sin, x[..., r:]), dim=-1)

    runs = [lambda x=x: rope(x) for x in xs]

    def check():
        res = {"x": (rope(xs[0]), "bhsd")}
        torch.cuda.synchronize()
        return res

    return Prepared("torch-eager", harness.torch_stream_for_cupy(torch), runs, check)
