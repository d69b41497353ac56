"""PyTorch peers: `scaled_dot_product_attention` as torch picks its backend ("sdpa-default") and
with each backend forced through `torch.nn.attention.sdpa_kernel`, FlexAttention (compiled), plain
eager rotate-half RoPE, and ferrocupy's training step through `ferrocupy.torch.attention`. Each
gets [B, H, S, D] contiguous copies of the shared inputs; a backend that rejects a case is
Unsupported, with the reason PyTorch gives.

A training step ("step") is timed as one call: the forward and the backward through autograd.
The bias case gives every peer the same additive [1, H, S, S] tensor; the window case gives each
peer ferrocupy's rule (`window_visible`) in its own form: a boolean mask for SDPA, a mask_mod for
FlexAttention."""

from __future__ import annotations

import warnings

import harness
from peers import ROPE_THETA, Prepared, Unsupported, _torch, to_torch

_FLEX = {}

MATH_SCORE_LIMIT = 8 << 30     # bytes of float32 scores the math backend may materialize


def _bhsd(x, torch, grad=False, expand=1):
    """[B, H, S, D] contiguous copy of a [B, S, H, D] input; `expand`: each head repeated."""
    y = to_torch(x).transpose(1, 2)
    y = y.repeat_interleave(expand, dim=1) if expand > 1 else y.contiguous()
    return y.requires_grad_(True) if grad else y


def _step(forward, leaves, do, out_layout: str, torch):
    """(run, check) of a training step: `forward()` then the gradients of `leaves` ([B, H, S, D]
    q, k, v) through autograd, given `do` in the output's layout."""
    def run():
        out = forward()
        return out, torch.autograd.grad(out, leaves, do)

    def check():
        out, grads = run()
        res = {"out": (out.detach(), out_layout)}
        res.update(zip(("dq", "dk", "dv"), ((g, "bhsd") for g in grads)))
        return res

    return run, check


def prepare_ferrocupy_step(case, sets) -> Prepared:
    """ferrocupy's training step as a PyTorch user runs it: `ferrocupy.torch.attention` on the
    [B, S, H, D] views (`x.transpose(1, 2)`, no copy) of [B, H, S, D] leaves, then autograd."""
    torch = _torch()
    from ferrocupy.torch import attention

    if case.window or case.suite == "bias":
        raise Unsupported("the training step here takes neither a window nor a bias")
    runs, outs = [], []
    for st in sets:
        q, k, v = (_bhsd(st[n], torch, True) for n in ("q", "k", "v"))
        do = to_torch(st["do"])                  # [B, S, H, D], as ferrocupy's output

        def forward(q=q, k=k, v=v):
            return attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                             causal=case.causal)

        run, check = _step(forward, (q, k, v), do, "bshd", torch)
        runs.append(run)
        outs.append(check)
    return Prepared("ferrocupy", harness.torch_stream_for_cupy(torch), runs,
                    _checked(outs[0], torch))


def _checked(first, torch):
    def check():
        res = first()
        torch.cuda.synchronize()
        return res
    return check


def _flex_attention():
    """torch.compile(flex_attention), built once; Unsupported where this torch has none."""
    if "fn" not in _FLEX:
        try:
            from torch.nn.attention.flex_attention import flex_attention
        except ImportError as e:
            raise Unsupported(f"this torch has no FlexAttention ({e})") from None
        _FLEX["fn"] = _torch().compile(flex_attention, dynamic=False)
    return _FLEX["fn"]


def prepare_torch_flex(case, sets) -> Prepared:
    """FlexAttention, compiled: the bias as a score_mod reading the same [1, H, S, S] tensor,
    causal and the window as a mask_mod (`window_visible`) in a block mask."""
    torch = _torch()
    if case.direction != "fwd":
        raise Unsupported("FlexAttention is timed on forward cases only")
    flex = _flex_attention()
    from torch.nn.attention.flex_attention import create_block_mask

    dev = to_torch(sets[0]["q"]).device
    block_mask = None
    if case.causal or case.window:
        if case.causal_offset:
            raise Unsupported("the FlexAttention peer has no causal_offset")

        def mask_mod(b, h, q_idx, kv_idx):
            return window_visible(q_idx, kv_idx, case.causal, case.window)

        block_mask = create_block_mask(mask_mod, None, None, case.seq_q, case.seq_k, device=dev)
    kw = {"block_mask": block_mask, "enable_gqa": case.kv_heads != case.heads}
    if "bias" in sets[0]:      # one score_mod for every set (they share the bias): one compile
        kw["score_mod"] = _bias_mod(to_torch(sets[0]["bias"]))
    runs, outs = [], []
    for st in sets:
        q, k, v = (_bhsd(st[n], torch) for n in ("q", "k", "v"))
        call = lambda q=q, k=k, v=v: flex(q, k, v, **kw)  # noqa: E731
        _trial(call, torch, "flex")
        runs.append(call)
        outs.append(lambda call=call: {"out": (call(), "bhsd")})
    return Prepared("torch-flex", harness.torch_stream_for_cupy(torch), runs,
                    _checked(outs[0], torch))


def _bias_mod(bias):
    """A score_mod adding bias[0, h, i, j] ([1, H, Sq, Sk]) to each score."""
    def score_mod(score, b, h, q_idx, kv_idx):
        return score + bias[0, h, q_idx, kv_idx]
    return score_mod


def window_visible(rows, cols, causal: bool, window: int):
    """ferrocupy's visibility rule (offset 0): key j is visible to query i iff (not causal or
    j <= i) and (window == 0 or |i - j| < window); `rows`, `cols` broadcast (tensors)."""
    ok = cols <= rows if causal else (rows >= 0) & (cols >= 0)
    return ok & ((rows - cols).abs() < window) if window else ok


def _is_causal(case) -> bool:
    """SDPA's is_causal for the case (decode: every key visible), or Unsupported."""
    if case.causal and case.causal_offset >= case.seq_k - 1:
        is_causal = False                  # every key visible (decode)
    elif not case.causal or (case.causal_offset == 0 and case.seq_q == case.seq_k):
        is_causal = case.causal
    else:
        raise Unsupported("torch SDPA has no causal_offset")
    return is_causal


def prepare_torch_sdpa(case, sets, backend: str) -> Prepared:
    torch = _torch()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if backend == "sdpa-default":
        kernel = None
    else:
        which = {"flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION",
                 "cudnn": "CUDNN_ATTENTION", "math": "MATH"}[backend]
        if not hasattr(SDPBackend, which):
            raise Unsupported(f"this torch has no SDPBackend.{which}")
        kernel = getattr(SDPBackend, which)
    if case.window and case.causal_offset:
        raise Unsupported("the SDPA window peer has no causal_offset")
    is_causal = _is_causal(case) if not case.window else False
    scores = case.batch * case.heads * case.seq_q * case.seq_k * 4
    if backend == "math" and scores > MATH_SCORE_LIMIT:
        raise Unsupported(f"math would materialize {scores / 2**30:.0f} GiB of scores "
                          f"(limit {MATH_SCORE_LIMIT >> 30} GiB)")
    kw = {"is_causal": is_causal}
    expand = 1
    if case.window:     # a boolean [S, S] mask; K/V expanded to H heads (enable_gqa with a mask
        dev = to_torch(sets[0]["q"]).device          # leaves SDPA for math on some backends)
        rows = torch.arange(case.seq_q, device=dev)[:, None]
        kw["attn_mask"] = window_visible(rows, torch.arange(case.seq_k, device=dev)[None],
                                         case.causal, case.window)
        expand = case.heads // case.kv_heads
    elif case.kv_heads != case.heads:
        kw["enable_gqa"] = True
    grad = case.direction != "fwd"
    f = torch.nn.functional.scaled_dot_product_attention

    def fwd(q, k, v, bias=None):
        extra = {} if bias is None else {"attn_mask": bias}
        if kernel is None:
            return f(q, k, v, **kw, **extra)
        with sdpa_kernel(kernel):
            return f(q, k, v, **kw, **extra)

    runs, outs = [], []
    for st in sets:
        q = _bhsd(st["q"], torch, grad)
        k, v = (_bhsd(st[n], torch, grad, expand) for n in ("k", "v"))
        bias = to_torch(st["bias"]) if "bias" in st else None
        if case.direction == "step":
            run, check = _step(lambda q=q, k=k, v=v, b=bias: fwd(q, k, v, b), (q, k, v),
                               _bhsd(st["do"], torch), "bhsd", torch)
            _trial(run, torch, backend + " training step")
            runs.append(run)
            outs.append(check)
            continue
        out = _trial(lambda: fwd(q, k, v, bias), torch, backend)
        if case.direction == "fwd":
            runs.append(lambda q=q, k=k, v=v, b=bias: fwd(q, k, v, b))
            outs.append(lambda q=q, k=k, v=v, b=bias: {"out": (fwd(q, k, v, b), "bhsd")})
            continue
        do = _bhsd(st["do"], torch)

        def grad(o=out, q=q, k=k, v=v, do=do):    # only the backward: the graph is kept
            return torch.autograd.grad(o, (q, k, v), do, retain_graph=True)

        _trial(grad, torch, backend + " backward")
        runs.append(grad)
        outs.append(lambda grad=grad: dict(zip(("dq", "dk", "dv"),
                                               ((g, "bhsd") for g in grad()))))

    return Prepared(f"torch-{backend}", harness.torch_stream_for_cupy(torch), runs,
                    _checked(outs[0], torch))


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

    return Prepared("torch-eager", harness.torch_stream_for_cupy(torch), runs,
                    _checked(lambda: {"x": (rope(xs[0]), "bhsd")}, torch))
