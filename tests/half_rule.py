"""SPEC's accuracy rule for half precision, and the plain-PyTorch computation it measures against.

For every output x (out, lse, grad_q, grad_k, grad_v):

    max|x - x64| <= 2 * max|x_torch - x64| + 1e-3 * max|x64|

where x64 is the float64 reference on the same rounded inputs and x_torch is attention written as
plain PyTorch ops in the same dtype (matmul, softmax, matmul; autograd for the gradients), as
FlashAttention's own tests measure it. The float64 side is ferrocupy's NumPy reference called
directly on float64 copies of the rounded inputs (same packed struct, same dropout bits).

The gradients' bound also allows what the stored out's rounding alone costs (`inherited`): every
FlashAttention-style backward is given the forward's out in the data dtype and forms Delta =
rowsum(dO * O) from it, while plain PyTorch never reads out. That term is the float64 backward
given out rounded to the dtype, minus the float64 backward given the float64 out.
- Where Delta sums many products it is a modest part of the bound. Measured on CPU, 2026-12-03, for the option case of test_half_head_dims: at D 16-128 it is 10-25% of the rule's other terms.
- At head_dim 1, Delta is one product and dS = P (dP - Delta) cancels, so the term is large. Take tests/test_cuda_half.py's test_half_head_dims[auto-d1-f16] (2026-12-03, seed 1174837032845913496). There, rounding out alone moved grad_q by 5.1e-3, against plain PyTorch's error of 2.5e-3, and the device's error of 8.3e-3 failed the rule without this term (bound 7.0e-3). A float64 model of the kernel (out and dS rounded to float16) errs by 6.2e-3 on that case.
"""

from __future__ import annotations

import numpy as np

import ferrocupy.reference as reference
from ferrocupy.dtypes import BFLOAT16, FLOAT16
from ferrocupy.params import AttentionDims
from gpu_helpers import AttnCase, grad_floors, keep_mask, visible

TORCH_DTYPE_NAMES = {FLOAT16: "float16", BFLOAT16: "bfloat16"}


def rounded(case: AttnCase, dtype, mask_dtype=None) -> AttnCase:
    """The case with q, k, v, grad_out rounded to `dtype` (the mask to `mask_dtype`, default
    float32), so the device, the reference and torch all see the same inputs."""
    from dataclasses import replace

    m = case.mask
    if m is not None:
        m = m.astype(mask_dtype or np.float32)
    return replace(case, q=case.q.astype(dtype), k=case.k.astype(dtype),
                   v=case.v.astype(dtype), grad_out=case.grad_out.astype(dtype), mask=m)


def _f64(a):
    return None if a is None else np.asarray(a).astype(np.float64)


def x64(case: AttnCase, backward: bool = True, out_dtype=None,
        forward: dict | None = None) -> dict:
    """float64 reference outputs on the case's (rounded) inputs: out, lse [B,H,Sq] and, with
    `backward`, the three gradients (given the float64 out, or with `out_dtype` that out rounded
    to it, as a device's backward is given its stored out). `forward`: an earlier x64 result on
    this case, whose out and lse are taken instead of running the reference forward again."""
    q, k, v, do, mask = (_f64(x) for x in (case.q, case.k, case.v, case.grad_out, case.mask))
    dims = AttentionDims.new(q, k)
    if forward is None:
        p = dims.params(case.opts, mask)
        out = np.full_like(q, np.nan)
        lse = np.full((dims.batch, dims.heads, dims.seq_q), np.nan)
        reference.flash_attn_v2(q, k, v, out, mask, p, lse=lse)
    else:
        out, lse = forward["out"], forward["lse"]
    res = {"out": out, "lse": lse}
    if backward:
        pb = dims.params_bwd(case.opts, mask)
        gq, gk, gv = (np.full_like(x, np.nan) for x in (q, k, v))
        stats = np.empty((dims.batch * dims.heads * dims.seq_q, 2))
        given = out if out_dtype is None else out.astype(out_dtype).astype(np.float64)
        reference.flash_attn_v2_bw_dq(q, k, v, given, do, gq, mask, stats, pb)
        if dims.seq_k:
            reference.flash_attn_v2_bw_dkdv(q, k, v, do, gk, gv, mask, stats, pb)
        res.update(grad_q=gq, grad_k=gk, grad_v=gv)
    return res


def torch_plain(case: AttnCase, device: str = "cpu", backward: bool = True) -> dict:
    """Attention as plain PyTorch ops in the case's dtype (no upcast), same visibility, mask and
    dropout keep mask; rows that see no key give 0 (not NaN). Returns float64 NumPy arrays."""
    import torch

    dtype = getattr(torch, TORCH_DTYPE_NAMES[np.dtype(case.q.dtype)])
    b, sq, h, d, sk, hkv = case.dims

    def t(a, grad=False):
        x = torch.from_numpy(np.asarray(a).astype(np.float32)).to(device=device, dtype=dtype)
        return x.requires_grad_(grad)

    q, k, v = (t(x, backward) for x in (case.q, case.k, case.v))
    g = h // hkv
    qh = q.permute(0, 2, 1, 3)                                     # [B, H, Sq, D]
    kh = k.permute(0, 2, 1, 3).repeat_interleave(g, dim=1)         # [B, H, Sk, D]
    vh = v.permute(0, 2, 1, 3).repeat_interleave(g, dim=1)
    scale = float(np.float32(case.opts.scale) if case.opts.scale is not None
                  else np.float32(1.0) / np.sqrt(np.float32(d)))
    s = (qh @ kh.transpose(-1, -2)) * scale
    if case.mask is not None:
        s = s + t(case.mask)
    vis = torch.from_numpy(np.ascontiguousarray(visible(case))).to(device)
    s = s.masked_fill(~vis, float("-inf"))
    dead = torch.isneginf(s).all(dim=-1, keepdim=True)
    s = s.masked_fill(dead, 0.0)  # softmax of a dead row is then finite; its P is zeroed below
    lse = torch.logsumexp(s, dim=-1).masked_fill(dead[..., 0], float("-inf"))
    p = torch.softmax(s, dim=-1).masked_fill(dead, 0.0)
    keep = keep_mask(case)
    if keep is not None:
        pd = np.float32(case.opts.dropout_prob)
        p = p * torch.from_numpy(keep).to(device) * float(np.float32(1) / (np.float32(1) - pd))
    out = (p @ vh).permute(0, 2, 1, 3)
    res = {"out": out, "lse": lse}
    if backward:
        out.backward(t(case.grad_out))
        res.update(grad_q=q.grad, grad_k=k.grad, grad_v=v.grad)
    return {n: x.detach().to("cpu", torch.float64).numpy() for n, x in res.items()}


def inherited_errors(case: AttnCase, want64: dict) -> dict:
    """Per gradient, what the stored out's rounding to the case's dtype alone moves it by (the
    module's `inherited` term): max |backward(out rounded) - backward(out)| in float64."""
    given = x64(case, backward=True, out_dtype=case.q.dtype, forward=want64)
    res = {}
    for n in ("grad_q", "grad_k", "grad_v"):
        fin = np.isfinite(want64[n]) & np.isfinite(given[n])
        res[n] = float(np.abs(given[n] - want64[n])[fin].max(initial=0.0))
    return res


def check_rule(name: str, got, want64, torch64, what: str = "", floor: float = 0.0,
               ulp: float = 0.0, inherited: float = 0.0) -> tuple[float, float]:
    """SPEC's rule on one output; non-finite entries (lse of dead rows: -inf) must agree exactly
    and are left out of the maxima. Returns (device error, torch error).

    Where a gradient cancels in float64 (`floor`, gpu_helpers.grad_floors, exceeds its norm: a
    row that sees a single key has P = 1 and dP = Delta, so dS = 0 exactly), the rule has nothing
    to scale by, and plain PyTorch is exact there (its softmax backward forms g - sum(g p) with
    p = 1), while every FlashAttention-style backward forms Delta = dO . O from the stored,
    rounded O. There the bound also allows 8 units in the last place (`ulp`, the dtype's) of the
    RMS of the uncancelled sums. `inherited`: inherited_errors' term for this output, added
    to the bound."""
    got = np.asarray(got).astype(np.float64)
    assert got.shape == want64.shape, f"{name}: shape {got.shape} != {want64.shape} {what}"
    assert not np.isnan(got).any(), f"{name}: NaN in the device output {what}"
    fin = np.isfinite(want64)
    assert (got[~fin] == want64[~fin]).all(), f"{name}: non-finite entries differ {what}"
    err = float(np.abs(got - want64)[fin].max(initial=0.0))
    terr = float(np.abs(torch64 - want64)[fin].max(initial=0.0))
    bound = 2 * terr + 1e-3 * float(np.abs(want64[fin]).max(initial=0.0)) + inherited
    if floor > float(np.linalg.norm(want64[fin])):
        bound += 8 * ulp * 10 * floor / np.sqrt(max(int(fin.sum()), 1))
    assert err <= bound, (f"{name}: max error {err:.3e} > 2 x torch's {terr:.3e} + 1e-3 max|x| "
                          f"+ {inherited:.3e} (the stored out's rounding) = {bound:.3e} {what}")
    return err, terr
