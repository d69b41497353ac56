"""The implementations timed side by side (ferrocupy here, PyTorch's in torch_peers.py), the
inputs they share and the float64 check each one passes before it is timed.

ferrocupy gets its own layout ([B, S, H, D]); PyTorch gets [B, H, S, D], contiguous, holding the
same values. Every implementation keeps its own outputs (RoPE runs in place, so it also gets its
own copy of the input). Each one's first call on input set 0 is checked against a float64
reference on sampled heads (all rows) before any timing.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

import numpy as np

import harness

# "sdpa-default": scaled_dot_product_attention with no sdpa_kernel context, the backend torch
# picks itself (cuDNN on Hopper with torch 2.11); the others forced through sdpa_kernel.
TORCH_BACKENDS = ("sdpa-default", "flash", "efficient", "cudnn", "math")
ROPE_THETA = 10000.0


class Unsupported(Exception):
    """This implementation does not take this case; the message says why."""


class WrongAnswer(Exception):
    """The implementation's output is off the float64 reference: it is not timed."""


def implementations(case) -> list[str]:
    if case.kind == "rope":
        return ["ferrocupy", "torch-eager"]
    if case.suite in ("dropout", "kvlens", "paged", "mods"):  # no peer draws ferrocupy's
        return ["ferrocupy"]    # dropout mask, takes a causal_offset or a paged cache, or is
    #                             timed beside issue 26's options: ferrocupy vs its plain call
    if case.suite == "varlen":  # the dense call at the mean length: SDPA too, for reference
        return ["ferrocupy"] + ([] if case.seqlens else ["torch-sdpa-default"])
    torch = [f"torch-{b}" for b in TORCH_BACKENDS]
    gqa_plain = case.suite == "gqa" and case.kv_heads == case.heads   # issue 25's plain call
    if case.suite in ("train", "bias", "window", "d256") or gqa_plain:  # no math: it times a
        torch = [n for n in torch if n != "torch-math"]          # score matrix
    if case.suite in ("bias", "window"):
        torch.append("torch-flex")
    return ["ferrocupy"] + torch


@dataclass
class Prepared:
    """An implementation ready to run: `check()` runs it once on set 0 and returns its outputs
    as {name: (array, layout)}; `run_next()` runs the next input set, round robin."""

    name: str
    stream: object
    runs: list
    check: object
    _cycle: object = field(default=None, repr=False)

    def run_next(self):
        if self._cycle is None:
            self._cycle = itertools.cycle(self.runs)
        return next(self._cycle)()


# --- arrays ---------------------------------------------------------------------------------------
def _cp():
    import cupy

    return cupy


def _host(x) -> np.ndarray:
    """A NumPy copy of a CuPy array (NumPy's own arrays as they are): CuPy refuses the implicit
    conversion."""
    return x.get() if hasattr(x, "get") else np.asarray(x)


def _torch():
    torch = harness.torch_cuda()
    if torch is None:
        raise Unsupported("PyTorch with CUDA is not importable")
    return torch


def _is_torch(x) -> bool:
    return type(x).__module__.startswith("torch")


def bfloat16():
    """ml_dtypes' bfloat16, the NumPy dtype CuPy (>= 14) and ferrocupy use for bfloat16, or
    None where ml_dtypes is missing."""
    try:
        import ml_dtypes
    except ImportError:
        return None
    return np.dtype(ml_dtypes.bfloat16)


def cast(a32, dtype: str):
    """`a32` (CuPy float32) in `dtype`: CuPy for float32/float16; bfloat16 as a torch tensor
    (the peers need one anyway), or as an ml_dtypes bfloat16 CuPy array where PyTorch is
    missing (CuPy >= 14; NumPy too, which the CPU tests put in CuPy's place)."""
    if dtype != "bfloat16":
        return a32.astype(dtype)
    if harness.torch_cuda() is not None:
        return _torch().from_dlpack(a32).to(_torch().bfloat16)
    dt = bfloat16()
    try:
        if dt is None:
            raise TypeError("ml_dtypes is not installed")
        return a32.astype(dt)
    except Exception as e:
        raise Unsupported(f"bfloat16 needs PyTorch or CuPy >= 14 with ml_dtypes "
                          f"({type(e).__name__}: {e})") from None


def to_torch(x):
    """A torch view of `x`; bfloat16 crosses as int16 where DLPack cannot carry it."""
    if _is_torch(x):
        return x
    torch = _torch()
    try:
        return torch.from_dlpack(x)
    except Exception:
        if str(x.dtype) != "bfloat16":
            raise
        return torch.from_dlpack(x.view(_cp().int16)).view(torch.bfloat16)


def to_cupy(x):
    """A CuPy view of `x` (for ferrocupy); bfloat16 crosses as int16 where DLPack cannot."""
    if not _is_torch(x):
        return x
    try:
        return _cp().from_dlpack(x)
    except Exception:
        dt = harness._cupy_dtype(str(x.dtype).replace("torch.", ""))
        if dt is None:
            raise
        return _cp().from_dlpack(x.view(_torch().int16)).view(dt)


def to_f64(x):
    """A CuPy float64 copy of `x` (CuPy array or torch tensor)."""
    if _is_torch(x):
        return _cp().from_dlpack(x.detach().to(_torch().float64).contiguous())
    return x.astype(_cp().float64)


def head(x, layout: str, b: int, h: int | None):
    """[S, D] of batch b, head h from a [B,S,H,D] ("bshd") or [B,H,S,D] ("bhsd") array; with
    h None (RoPE), [S, H, D] of batch b."""
    if h is not None:
        return x[b, :, h] if layout == "bshd" else x[b, h]
    if layout == "bshd":
        return x[b]
    return x[b].transpose(0, 1) if _is_torch(x) else x[b].transpose(1, 0, 2)


def seq_head(case, x, layout: str, b: int, h: int):
    """[S, D] of sequence b, head h: batch entry b, or a varlen case's packed sequence b (x
    [1, total, H, D])."""
    if not case.seqlens:
        return head(x, layout, b, h)
    cu = cu_seqlens(case)
    return head(x, layout, 0, h)[int(cu[b]):int(cu[b + 1])]


def cu_seqlens(case) -> np.ndarray:
    """A varlen case's int32 [N + 1] sequence starts (host)."""
    return np.concatenate([[0], np.cumsum(case.seqlens)]).astype(np.int32)


def _empty_like(x):
    return _torch().empty_like(x) if _is_torch(x) else _cp().empty_like(x)


def _poison(x):
    x.fill_(float("nan")) if _is_torch(x) else x.fill(float("nan"))


# --- inputs and reference -------------------------------------------------------------------------
class CaseRun:
    """A case's inputs (`n_sets` random sets, ferrocupy's layout, the case's dtype) and its float64
    reference on sampled heads; `prepare(impl)` and `rel_err(prepared)` work from them."""

    def __init__(self, case, l2_bytes: int = 60_000_000, seed: int = 0):
        self.case = case
        cp = _cp()
        rng = cp.random.default_rng(seed)
        self.n_sets = harness.rotation_sets(case.bytes, l2_bytes)
        if case.kind == "rope":
            shapes = {"x": case.shape}
        else:
            rows = (1, sum(case.seqlens)) if case.seqlens else (case.batch, case.seq_q)
            q = (*rows, case.heads, case.head_dim)
            kv = (*rows[:1], case.seq_k if not case.seqlens else rows[1], case.kv_heads,
                  case.head_dim)
            shapes = {"q": q, "k": kv, "v": kv}
            if case.direction != "fwd":
                shapes["do"] = q
        self.sets = [{n: cast(rng.standard_normal(s, dtype=cp.float32), case.dtype)
                      for n, s in shapes.items()} for _ in range(self.n_sets)]
        if case.suite == "bias":   # one additive bias [1, H, Sq, Sk], shared by the input sets
            bias = cast(rng.standard_normal((1, case.heads, case.seq_q, case.seq_k),
                                            dtype=cp.float32), case.dtype)
            for st in self.sets:
                st["bias"] = bias
        extra = {}                 # issue 26's per-call inputs, shared by the input sets
        if case.seqlens:
            extra["cu_seqlens"] = cp.asarray(cu_seqlens(case))
        if case.mod == "alibi":
            extra["alibi_slopes"] = cp.asarray(harness.alibi_slopes(case.heads), dtype=np.float32)
        if case.mod == "sinks":
            extra["sinks"] = cp.asarray(harness.sink_logits(case.heads), dtype=np.float32)
        for st in self.sets:
            st.update(extra)
        if case.kv_len:            # a KV cache: its slots past kv_lens hold NaN, read by no kernel
            for st in self.sets:
                for name in ("k", "v"):
                    st[name][:, case.kv_len:] = float("nan")
        # RoPE's positions form: int64 [B, S] positions (transformers' position_ids), a shuffle
        # of 0 .. 2S per batch entry, shared by the input sets.
        self.positions = rope_positions(case) if case.kind == "rope" else None
        if case.kind == "rope":
            self.reference = rope_reference(case, self.sets[0], self.positions)
        else:
            self.reference = attention_reference(case, self.sets[0])

    def prepare(self, impl: str) -> Prepared:
        from torch_peers import (prepare_ferrocupy_step, prepare_torch_flex, prepare_torch_rope,
                                 prepare_torch_sdpa)

        if impl == "ferrocupy" and self.case.direction == "step":
            return prepare_ferrocupy_step(self.case, self.sets)
        if impl == "ferrocupy":
            return prepare_ferrocupy(self.case, self.sets, self.positions)
        if impl == "torch-eager":
            return prepare_torch_rope(self.case, self.sets, self.positions)
        if impl == "torch-flex":
            return prepare_torch_flex(self.case, self.sets)
        if impl.startswith("torch-"):
            return prepare_torch_sdpa(self.case, self.sets, impl.split("-", 1)[1])
        raise ValueError(f"unknown implementation {impl!r}")

    def rel_err(self, prepared: Prepared) -> float:
        """The largest ||impl - ref|| / ||ref|| over the outputs, on the sampled heads."""
        outs = prepared.check()
        worst = 0.0
        for name, per_head in self.reference.items():
            arr, layout = outs[name]
            num = den = 0.0
            for (b, h), ref in per_head.items():
                got = to_f64(seq_head(self.case, arr, layout, b, h))
                num += float(((got - ref) ** 2).sum())
                den += float((ref**2).sum())
            err = math.sqrt(num / den) if den else (0.0 if num == 0 else math.inf)
            worst = max(worst, err if math.isfinite(err) else math.inf)
        return worst


def prepare_checked(run: CaseRun, impl: str):
    """(prepared, rel_err) once its first output passed the check; Unsupported or WrongAnswer."""
    prep = run.prepare(impl)
    err = run.rel_err(prep)
    tol = run.case.tolerance
    if not err <= tol:
        raise WrongAnswer(f"{impl} gives a wrong answer on {run.case.id}: rel err {err:.2e} > "
                          f"tolerance {tol:.0e} against float64; not timed")
    return prep, err


def release() -> None:
    """Hand cached device memory back between cases (CuPy's pool, PyTorch's allocator)."""
    _cp().get_default_memory_pool().free_all_blocks()
    torch = harness.torch_cuda()
    if torch is not None:
        torch.cuda.empty_cache()


def _samples(case):
    """(batch, kv head) pairs whose query heads are checked: first and last."""
    return sorted({(0, 0), (case.batch - 1, case.kv_heads - 1)})


def attention_reference(case, s) -> dict:
    """float64 forward (and backward; both for a training step) of the sampled heads, with the
    case's bias, window, kv_lens (the keys past it left out), dropout (SPEC's Philox mask,
    ferrocupy.reference's), softcap, ALiBi and sinks (SPEC's order: softcap, then ALiBi, then
    the mask; a sink joins each row's denominator), each varlen sequence on its own; rows in
    chunks to bound memory."""
    from ferrocupy.reference import dropout_keep, dropout_scale

    cp = _cp()
    group = case.heads // case.kv_heads
    scale = float(np.float32(1.0) / np.sqrt(np.float32(case.head_dim)))
    bwd = case.direction != "fwd"
    names = {"fwd": ("out",), "bwd": ("dq", "dk", "dv"), "step": ("out", "dq", "dk", "dv")}
    res = {n: {} for n in names[case.direction]}
    drop = {"heads": case.heads, "seed": harness.DROPOUT_SEED, "dropout_prob": case.dropout}
    cap = harness.MODS_SOFTCAP if case.mod == "softcap" else 0.0
    slopes, sinks = (_host(to_f64(s[n])).tolist() if n in s else None
                     for n in ("alibi_slopes", "sinks"))
    for b, g in _samples(case):
        k, v = (to_f64(seq_head(case, s[n], "bshd", b, g)) for n in ("k", "v"))
        seq_k = k.shape[0]
        n_keys = case.kv_len or seq_k           # kv_lens: rows sit kv_len - seq_k earlier
        k, v = k[:n_keys], v[:n_keys]
        offset = case.causal_offset + n_keys - seq_k
        cols = cp.arange(n_keys)[None, :]
        chunk = max(1, (32 << 20) // max(n_keys, 1))
        dk, dv = cp.zeros_like(k), cp.zeros_like(v)
        for h in range(g * group, (g + 1) * group):
            q = to_f64(seq_head(case, s["q"], "bshd", b, h))
            do = to_f64(seq_head(case, s["do"], "bshd", b, h)) if bwd else None
            bias = to_f64(head(s["bias"], "bhsd", 0, h)) if "bias" in s else None
            outs, dqs = [], []
            for i0 in range(0, q.shape[0], chunk):
                qc = q[i0:i0 + chunk]
                sc = scale * (qc @ k.T)
                if cap:
                    tanh = cp.tanh(sc / cap)
                    sc = cap * tanh
                rows = cp.arange(i0, i0 + qc.shape[0])[:, None] + offset
                if slopes is not None:
                    sc = sc - slopes[h] * cp.abs(rows - cols)
                if bias is not None:
                    sc = sc + bias[i0:i0 + chunk]
                if case.causal:
                    sc = cp.where(cols <= rows, sc, -cp.inf)
                if case.window:
                    sc = cp.where(cp.abs(rows - cols) < case.window, sc, -cp.inf)
                m = sc.max(axis=1, keepdims=True)
                if sinks is not None:
                    m = cp.maximum(m, sinks[h])
                p = cp.exp(sc - cp.where(cp.isfinite(m), m, 0.0))
                lsum = p.sum(axis=1, keepdims=True)
                if sinks is not None:
                    lsum = lsum + cp.exp(sinks[h] - m)
                p = cp.where(lsum > 0, p / cp.where(lsum > 0, lsum, 1.0), 0.0)
                kept = p                        # P' = P * keep / (1 - p) multiplies V
                if case.dropout:
                    keep = dropout_keep(drop, b, h, np.arange(i0, i0 + qc.shape[0]),
                                        np.arange(n_keys))
                    factor = cp.asarray(keep) * float(dropout_scale(drop))
                    kept = p * factor
                o = kept @ v
                outs.append(o)
                if bwd:
                    dc = do[i0:i0 + chunk]
                    dp = dc @ v.T                   # dP', then dP = dP' * keep / (1 - p)
                    dp = dp * factor if case.dropout else dp
                    ds = p * (dp - (dc * o).sum(axis=1, keepdims=True))
                    if cap:                         # through the cap: 1 - tanh^2
                        ds = ds * (1.0 - tanh**2)
                    dqs.append(scale * (ds @ k))
                    dk += scale * (ds.T @ qc)
                    dv += kept.T @ dc
            if bwd:
                res["dq"][(b, h)] = cp.concatenate(dqs)
            if "out" in res:
                res["out"][(b, h)] = cp.concatenate(outs)
        if bwd:
            res["dk"][(b, g)], res["dv"][(b, g)] = dk, dv
    return res


def rope_positions(case):
    """The positions form's int64 [B, S] positions (None for the other forms)."""
    if case.rope != "positions":
        return None
    bsz, seq = case.shape[:2]
    rng = np.random.default_rng(1)
    return _cp().asarray(np.stack([rng.permutation(2 * seq)[:seq] for _ in range(bsz)]),
                         dtype=np.int64)


def rope_reference(case, s, positions=None) -> dict:
    """float64 RoPE of the first and last batch entry, the case's form (rotate-half or
    interleaved, rotary_dim, positions); angles as SPEC.md: float32."""
    cp = _cp()
    bsz, seq, _, d = case.shape
    r = case.rotary_dim
    i = cp.arange(r // 2, dtype=cp.float32)
    inv = cp.float32(1.0) / cp.power(cp.float32(ROPE_THETA), (2 * i) / cp.float32(r))
    res = {}
    for b in sorted({0, bsz - 1}):
        t = cp.arange(seq) if positions is None else positions[b]
        ang = (t.astype(cp.float32)[:, None] * inv[None, :]).astype(cp.float64)
        cos, sin = cp.cos(ang)[:, None, :], cp.sin(ang)[:, None, :]
        x = to_f64(head(s["x"], "bshd", b, None))
        if case.rope == "interleaved":
            x1, x2 = x[..., 0:r:2], x[..., 1:r:2]
            rot = cp.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).reshape(
                x.shape[:-1] + (r,))
        else:
            x1, x2 = x[..., : r // 2], x[..., r // 2:r]
            rot = cp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
        res[(b, None)] = cp.concatenate([rot, x[..., r:]], axis=-1)
    return {"x": res}


# --- ferrocupy ------------------------------------------------------------------------------------
_ENGINE = {}


def ferro_engine():
    """The CUDA ComputeEngine (built once), or Unsupported with the reason it cannot be built."""
    if "engine" not in _ENGINE:
        try:
            from ferrocupy import ComputeEngine

            _ENGINE["engine"] = ComputeEngine("cuda", quiet=True)
        except Exception as e:
            _ENGINE["engine"] = Unsupported(f"CUDA engine unavailable ({type(e).__name__}: {e})")
    if isinstance(_ENGINE["engine"], Unsupported):
        raise _ENGINE["engine"]
    return _ENGINE["engine"]


def ferro_dtypes() -> list[str]:
    """The dtypes ferrocupy's CUDA engine takes (names), float32 if the engine is unavailable."""
    try:
        return [d for d in harness.DTYPES if d in {str(t) for t in ferro_engine().backend.dtypes}]
    except Unsupported:
        return ["float32"]


def _ferro_stream(engine):
    stream = getattr(engine.backend, "stream", None)
    return stream if stream is not None else _cp().cuda.get_current_stream()


def prepare_ferrocupy(case, sets, positions=None) -> Prepared:
    from ferrocupy import AttentionOptions, UnifiedTensor

    eng = ferro_engine()
    takes = sorted(str(t) for t in eng.backend.dtypes)
    if case.dtype not in takes:
        raise Unsupported(f"not supported yet ({case.dtype}; the CUDA engine takes "
                          f"{', '.join(takes)})")
    t = UnifiedTensor
    runs, outs, front = [], [], None     # front: the checked call (else runs[0])
    if case.kind == "rope" and not case.rope:
        for st in sets:
            x = t(to_cupy(st["x"]).copy())        # in place: its own copy
            runs.append(lambda x=x: eng.rope(x, case.shape[-1], 0))
            outs.append({"x": (x.buffer(), "bshd")})
    elif case.kind == "rope":                     # out of place, as ferrocupy.torch.rope runs
        kw = dict(rotary_dim=case.rotary_dim, interleaved=case.rope == "interleaved",
                  positions=None if positions is None else t(positions))
        for st in sets:
            x = t(to_cupy(st["x"]))
            out = t(_empty_like(x.buffer()))
            runs.append(lambda x=x, out=out: eng.rope(x, case.shape[-1], 0, out=out, **kw))
            outs.append({"x": (out.buffer(), "bshd")})
    else:
        opts = AttentionOptions(causal=case.causal, causal_offset=case.causal_offset,
                                window=case.window, dropout_prob=case.dropout,
                                seed=harness.DROPOUT_SEED if case.dropout else 0,
                                softcap=harness.MODS_SOFTCAP if case.mod == "softcap" else 0.0)
        calls = [_attention_calls(eng, case, st, opts) for st in sets]
        runs = [run for _, run, _ in calls]
        outs = [out for _, _, out in calls]
        front = calls[0][0]

    def check():
        for arr, _ in outs[0].values():
            if case.kind != "rope" or case.rope:  # an output, not the in-place input
                _poison(arr)
        (front or runs[0])()
        _cp().cuda.Device().synchronize()
        return outs[0]

    return Prepared("ferrocupy", _ferro_stream(eng), runs, check)


def _attention_calls(eng, case, st, opts):
    """(front, run, outputs) of input set `st`: `front()` the call through ferrocupy's front door
    (every check), `run()` the call timed: the same, or its launches alone where the call carries
    index tensors (kv_lens, cu_seqlens, block_table: harness's docstring says why); `outputs`
    {name: (array, layout)}. A varlen case's [1, total, H, D] inputs go in as [total, H, D]."""
    from ferrocupy import UnifiedTensor as t

    cp = _cp()
    packed = (lambda x: x[0]) if case.seqlens else (lambda x: x)
    full = {n: to_cupy(st[n]) for n in ("q", "k", "v", "do") if n in st}
    q, k, v = (t(packed(full[n])) for n in ("q", "k", "v"))
    out_full = _empty_like(full["q"])
    out = t(packed(out_full))
    mask = t(to_cupy(st["bias"])) if "bias" in st else None
    named, scalars = {}, {}
    if case.kv_len:
        named["kv_lens"] = t(cp.full((case.batch,), case.kv_len, dtype=np.int32))
    if case.page_size:
        k, v, named["block_table"] = paged_cache(case, k, v)
    named.update((n, t(st[n])) for n in ("alibi_slopes", "sinks") if n in st)
    if case.seqlens:
        named["cu_seqlens_q"] = named["cu_seqlens_k"] = t(st["cu_seqlens"])
        scalars = {"max_seqlen_q": max(case.seqlens), "max_seqlen_k": max(case.seqlens)}
    indexed = any(n in named for n in ("kv_lens", "block_table", "cu_seqlens_q"))
    if case.direction == "fwd":
        def front():
            eng.flash_attention_v2_with(q, k, v, out, opts, mask, **named, **scalars)

        plan = indexed and eng.plan_attention(q, k, v, out, opts, mask, **named, **scalars)
        run = launches_only(eng, plan, dict(q=q, k=k, v=v, out=out, mask=mask, **named)) \
            if indexed else front
        return front, run, {"out": (out_full, "bshd")}
    # As a training step: the forward writes out and its float32 log-sum-exp, and the backward
    # is given both (so it does not recompute the LSE), with the forward's options, mask and
    # issue 26's inputs (the sinks' backward writes grad_sinks). Only the backward is timed, as
    # with torch, whose autograd graph keeps its forward's LSE.
    rows = (case.heads, sum(case.seqlens)) if case.seqlens else (case.batch, case.heads,
                                                                 case.seq_q)
    named["lse"] = t(cp.empty(rows, dtype=np.float32))
    eng.flash_attention_v2_with(q, k, v, out, opts, mask, **named, **scalars)
    do = t(packed(full["do"]))
    grads_full = [_empty_like(full[n]) for n in ("q", "k", "v")]
    g = [t(packed(x)) for x in grads_full]
    if "sinks" in named:
        named["grad_sinks"] = t(cp.empty((case.heads,), dtype=np.float32))

    def front():
        eng.flash_attention_v2_backward_with(q, k, v, out, do, *g, opts, mask, **named,
                                             **scalars)

    tensors = dict(q=q, k=k, v=v, out=out, grad_out=do, grad_q=g[0], grad_k=g[1], grad_v=g[2],
                   mask=mask, **named)
    run = launches_only(eng, eng.plan_attention_backward(q, k, v, out, do, *g, opts, mask, **named,
                                                     **scalars), tensors) if indexed else front
    return front, run, dict(zip(("dq", "dk", "dv"), ((x, "bshd") for x in grads_full)))


def launches_only(eng, plan, tensors: dict):
    """A call running `plan`'s kernels alone on `tensors` (plan argument name -> UnifiedTensor or
    None) on the engine's stream, as lab/paged_decode_ab.py: the front door's per-call checks
    (index tensors read to the host: a round trip) stay out. On the reference backend, which
    has no launches, `plan.run`."""
    backend = eng.backend
    if backend.name != "cuda":
        return lambda: plan.run(**tensors)
    from ferrocupy.cuda import tuning

    ptrs = {n: x.buffer().data.ptr for n, x in tensors.items() if x is not None}
    stream = _ferro_stream(eng)
    return tuning.kernels_only(backend, plan, ptrs, int(getattr(stream, "ptr", stream)))


def paged_cache(case, k, v, seed: int = 0):
    """k, v ([B, Sk, Hkv, D] UnifiedTensors) as pools of pages of `case.page_size` keys, [B * Sk
    / page, page, Hkv, D], with the int32 block table [B, Sk / page]: the pool's blocks in a
    random order, as an allocator that has run a while leaves them."""
    from ferrocupy import UnifiedTensor as t

    cp = _cp()
    per = case.seq_k // case.page_size
    order = np.random.default_rng(seed).permutation(case.batch * per).astype(np.int32)
    where = cp.asarray(order)
    pools = []
    for x in (k, v):
        a = x.buffer()
        pool = cp.empty((len(order), case.page_size) + tuple(a.shape[2:]), dtype=a.dtype)
        bits = np.dtype(f"int{8 * a.dtype.itemsize}")  # (a copy any dtype takes: bfloat16's)
        pool.view(bits)[where] = a.view(bits).reshape(pool.shape)
        pools.append(t(pool))
    return pools[0], pools[1], t(cp.asarray(order.reshape(case.batch, per)))


