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
    if case.suite in ("dropout", "kvlens"):   # no peer draws ferrocupy's dropout mask or takes
        return ["ferrocupy"]                   # a causal_offset: ferrocupy against its plain call
    torch = [f"torch-{b}" for b in TORCH_BACKENDS]
    gqa_plain = case.suite == "gqa" and case.kv_heads == case.heads   # issue 25's plain call
    if case.suite in ("train", "bias", "window") or gqa_plain:   # no math: it would time a
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
            q = (case.batch, case.seq_q, case.heads, case.head_dim)
            kv = (case.batch, case.seq_k, case.kv_heads, case.head_dim)
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
                got = to_f64(head(arr, layout, b, h))
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
    case's bias, window, kv_lens (the keys past it left out) and dropout (SPEC's Philox mask,
    ferrocupy.reference's); rows in chunks to bound memory."""
    from ferrocupy.reference import dropout_keep, dropout_scale

    cp = _cp()
    group = case.heads // case.kv_heads
    scale = float(np.float32(1.0) / np.sqrt(np.float32(case.head_dim)))
    bwd = case.direction != "fwd"
    names = {"fwd": ("out",), "bwd": ("dq", "dk", "dv"), "step": ("out", "dq", "dk", "dv")}
    res = {n: {} for n in names[case.direction]}
    chunk = max(1, (32 << 20) // max(case.seq_k, 1))
    n_keys = case.kv_len or case.seq_k          # kv_lens: rows sit kv_len - seq_k earlier
    offset = case.causal_offset + n_keys - case.seq_k
    cols = cp.arange(n_keys)[None, :]
    drop = {"heads": case.heads, "seed": harness.DROPOUT_SEED, "dropout_prob": case.dropout}
    for b, g in _samples(case):
        k, v = (to_f64(head(s[n], "bshd", b, g))[:n_keys] for n in ("k", "v"))
        dk, dv = cp.zeros_like(k), cp.zeros_like(v)
        for h in range(g * group, (g + 1) * group):
            q = to_f64(head(s["q"], "bshd", b, h))
            do = to_f64(head(s["do"], "bshd", b, h)) if bwd else None
            bias = to_f64(head(s["bias"], "bhsd", 0, h)) if "bias" in s else None
            outs, dqs = [], []
            for i0 in range(0, case.seq_q, chunk):
                qc = q[i0:i0 + chunk]
                sc = scale * (qc @ k.T)
                if bias is not None:
                    sc = sc + bias[i0:i0 + chunk]
                rows = cp.arange(i0, i0 + qc.shape[0])[:, None] + offset
                if case.causal:
                    sc = cp.where(cols <= rows, sc, -cp.inf)
                if case.window:
                    sc = cp.where(cp.abs(rows - cols) < case.window, sc, -cp.inf)
                m = sc.max(axis=1, keepdims=True)
                p = cp.exp(sc - cp.where(cp.isfinite(m), m, 0.0))
                lsum = p.sum(axis=1, keepdims=True)
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
    runs, outs = [], []
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
                                seed=harness.DROPOUT_SEED if case.dropout else 0)
        kv_lens = (t(_cp().full((case.batch,), case.kv_len, dtype=np.int32)) if case.kv_len
                   else None)
        for st in sets:
            q, k, v = (t(to_cupy(st[n])) for n in ("q", "k", "v"))
            out = t(_empty_like(q.buffer()))
            mask = t(to_cupy(st["bias"])) if "bias" in st else None
            if case.direction == "fwd":
                runs.append(lambda q=q, k=k, v=v, o=out, m=mask:
                            eng.flash_attention_v2_with(q, k, v, o, opts, m, kv_lens=kv_lens))
                outs.append({"out": (out.buffer(), "bshd")})
                continue
            # As a training step: the forward writes out and its float32 log-sum-exp, and the
            # backward is given both (so it does not recompute the LSE), with the forward's
            # options and mask. Only the backward is timed, as with torch, whose autograd graph
            # keeps its forward's LSE.
            lse = t(_cp().empty((case.batch, case.heads, case.seq_q), dtype=np.float32))
            eng.flash_attention_v2_with(q, k, v, out, opts, mask, lse=lse)
            do = t(to_cupy(st["do"]))
            g = [t(_empty_like(x.buffer())) for x in (q, k, v)]
            runs.append(lambda q=q, k=k, v=v, o=out, do=do, g=g, m=mask, lse=lse:
                        eng.flash_attention_v2_backward_with(q, k, v, o, do, *g, opts, m,
                                                             lse=lse))
            outs.append({n: (x.buffer(), "bshd") for n, x in zip(("dq", "dk", "dv"), g)})

    def check():
        for arr, _ in outs[0].values():
            if case.kind != "rope" or case.rope:  # an output, not the in-place input
                _poison(arr)
        runs[0]()
        _cp().cuda.Device().synchronize()
        return outs[0]

    return Prepared("ferrocupy", _ferro_stream(eng), runs, check)
