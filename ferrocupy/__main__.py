"""`python -m ferrocupy`: a short demo and self-check.

Picks the best backend (or the one `--backend` names), runs RoPE, attention forward (causal with
GQA, a broadcast additive mask, a KV-cache decode step with a sliding window, dropout) and the
matching backward passes on random float32 inputs, and checks every result: on the GPU against the
NumPy reference backend; on the reference backend against the independent dense NumPy formulas
below (docs/semantics.md written out densely, with its own Philox). Prints one row per check and exits
non-zero if any check fails.
"""

from __future__ import annotations

import argparse
import platform
import secrets
import sys
import time
from dataclasses import dataclass

import numpy as np

from . import __version__
from .engine import AttentionOptions, ComputeEngine
from .tensor import UnifiedTensor

TOL = {"rope": 1e-4, "fwd": 2e-4, "bwd": 1e-3}


# --- independent dense formulas (float64), used when the backend under test is the reference ---
def _philox4x32_10(c0, c1, c2, c3, k0: int, k1: int):
    """Philox4x32-10 as Random123 defines it, on uint64 arrays holding 32-bit words."""
    mask = np.uint64(0xFFFFFFFF)
    c = [np.asarray(x, dtype=np.uint64) & mask for x in np.broadcast_arrays(c0, c1, c2, c3)]
    key = [np.uint64(k0 & 0xFFFFFFFF), np.uint64(k1 & 0xFFFFFFFF)]
    for rnd in range(10):
        if rnd:
            key = [(key[0] + np.uint64(0x9E3779B9)) & mask, (key[1] + np.uint64(0xBB67AE85)) & mask]
        prod0 = np.uint64(0xD2511F53) * c[0]
        prod1 = np.uint64(0xCD9E8D57) * c[2]
        c = [(prod1 >> np.uint64(32)) ^ c[1] ^ key[0], prod1 & mask,
             (prod0 >> np.uint64(32)) ^ c[3] ^ key[1], prod0 & mask]
    return c


def _philox_known_answers() -> bool:
    got1 = [int(w) for w in _philox4x32_10(0, 0, 0, 0, 0, 0)]
    got2 = [int(w) for w in _philox4x32_10(0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344,
                                           0xA4093822, 0x299F31D0)]
    return (got1 == [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]
            and got2 == [0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1])


_FACTORS: dict = {}


def dense_dropout_factor(opts: AttentionOptions, B: int, H: int, Sq: int, Sk: int):
    """`keep / (1 - p)` as `[B, H, Sq, Sk]` float64, or None without dropout."""
    p32 = np.float32(opts.dropout_prob)
    thr = int(float(p32) * 2.0**32)
    if thr == 0:
        return None
    key = (opts.seed, thr, B, H, Sq, Sk)
    if key not in _FACTORS:  # the forward and its backward share one mask
        b = np.arange(B)[:, None, None, None]
        h = np.arange(H)[None, :, None, None]
        i = np.arange(Sq)[None, None, :, None]
        g = np.arange((Sk + 3) // 4)[None, None, None, :]  # counter word 0 is j >> 2
        words = np.stack(_philox4x32_10(g, i, b * H + h, 0, opts.seed, 0), axis=-1)
        word = words.reshape(B, H, Sq, -1)[..., :Sk]  # key j takes word j & 3 of group j >> 2
        _FACTORS.clear()
        _FACTORS[key] = (word >= thr) * float(np.float32(1.0) / (np.float32(1.0) - p32))
    return _FACTORS[key]


def _heads_first(x, group: int = 1):
    """`[B, S, heads, D]` as float64 `[B, heads * group, S, D]` (KV heads repeated for GQA)."""
    x = np.repeat(x.astype(np.float64), group, axis=2) if group > 1 else x.astype(np.float64)
    return np.ascontiguousarray(x.transpose(0, 2, 1, 3))


def _dense_probs(q, k, opts, mask):
    B, Sq, H, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    qh, kh = _heads_first(q), _heads_first(k, H // Hkv)  # head h reads KV head h // (H/Hkv)
    scale = float(np.float32(1.0) / np.sqrt(np.float32(D)))
    s = (qh @ kh.transpose(0, 1, 3, 2)) * scale  # [B, H, Sq, Sk]
    if mask is not None:
        s = s + mask.astype(np.float64)  # NumPy broadcasting is the mask's broadcast rule
    a = np.arange(Sq)[:, None] + opts.causal_offset
    j = np.arange(Sk)[None, :]
    vis = np.ones((Sq, Sk), dtype=bool)
    if opts.causal:
        vis &= j <= a
    if opts.window:
        vis &= np.abs(a - j) < opts.window
    s = np.where(vis, s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    e = np.exp(s - np.where(m == -np.inf, 0.0, m))
    total = e.sum(axis=-1, keepdims=True)
    prob = e / np.where(total > 0, total, 1.0)  # a row with no visible key: P = 0, out = 0
    factor = dense_dropout_factor(opts, B, H, Sq, Sk)
    return prob, (prob if factor is None else prob * factor), factor, qh, kh, scale


def dense_forward(q, k, v, opts, mask):
    with np.errstate(all="ignore"):
        _, prob_d, _, _, _, _ = _dense_probs(q, k, opts, mask)
        vh = _heads_first(v, q.shape[2] // k.shape[2])
        return (prob_d @ vh).transpose(0, 2, 1, 3)  # back to [B, Sq, H, D]


def dense_backward(q, k, v, out, grad_out, opts, mask):
    B, Sk, Hkv, D = k.shape
    group = q.shape[2] // Hkv
    with np.errstate(all="ignore"):
        prob, prob_d, factor, qh, kh, scale = _dense_probs(q, k, opts, mask)
        vh, go = _heads_first(v, group), _heads_first(grad_out)
        dp = go @ vh.transpose(0, 1, 3, 2)
        if factor is not None:
            dp = dp * factor
        delta = (go * _heads_first(out)).sum(axis=-1)  # [B, H, Sq]
        ds = prob * (dp - delta[..., None])
        gq = scale * (ds @ kh)
        gk = scale * (ds.transpose(0, 1, 3, 2) @ qh)  # [B, H, Sk, D]
        gv = prob_d.transpose(0, 1, 3, 2) @ go

        def fold(g):  # sum each KV head's group of query heads, back to [B, Sk, Hkv, D]
            return g.reshape(B, Hkv, group, Sk, D).sum(axis=2).transpose(0, 2, 1, 3)

        return gq.transpose(0, 2, 1, 3), fold(gk), fold(gv)


def dense_rope(x, pos: int, theta: float):
    """Rotate-half RoPE of `[B, S, heads, D]`: angles in float32 as Hugging Face forms them."""
    D = x.shape[-1]
    half = D // 2
    expo = np.arange(0, D, 2, dtype=np.float32)[:half] / np.float32(D)
    inv = np.float32(1.0) / np.power(np.float64(np.float32(theta)), expo.astype(np.float64)
                                     ).astype(np.float32)
    t = (pos + np.arange(x.shape[1])).astype(np.float32)
    ang = (t[:, None] * inv[None, :]).astype(np.float64)[None, :, None, :]
    x1, x2 = x[..., :half].astype(np.float64), x[..., half:].astype(np.float64)
    return np.concatenate([x1 * np.cos(ang) - x2 * np.sin(ang),
                           x2 * np.cos(ang) + x1 * np.sin(ang)], axis=-1)


# --- running one engine -------------------------------------------------------------------------
class Runner:
    """Runs the ops on one engine from host arrays; outputs start as NaN, so any element a kernel
    leaves unwritten fails its check."""

    def __init__(self, engine: ComputeEngine):
        self.engine = engine
        self.device = engine.backend.device

    def _t(self, a):
        return None if a is None else UnifiedTensor.from_numpy(a, device=self.device)

    def _nan(self, shape):
        return self._t(np.full(shape, np.nan, dtype=np.float32))

    def rope(self, x, pos, theta):
        t = self._t(x)
        if theta == 10000.0:
            self.engine.rope(t, x.shape[-1], pos)
        else:
            self.engine.rope_theta(t, x.shape[-1], pos, theta)
        return t.to_numpy()

    def forward(self, q, k, v, opts, mask):
        out = self._nan(q.shape)
        self.engine.flash_attention_v2_with(self._t(q), self._t(k), self._t(v), out, opts,
                                            self._t(mask))
        return out.to_numpy()

    def backward(self, q, k, v, out, grad_out, opts, mask):
        grads = [self._nan(q.shape), self._nan(k.shape), self._nan(k.shape)]
        self.engine.flash_attention_v2_backward_with(
            self._t(q), self._t(k), self._t(v), self._t(out), self._t(grad_out), *grads, opts,
            self._t(mask))
        return tuple(g.to_numpy() for g in grads)


class DenseOracle:
    """The oracle for the reference backend: the dense formulas above."""

    def rope(self, x, pos, theta):
        return dense_rope(x, pos, theta)

    def forward(self, q, k, v, opts, mask):
        return dense_forward(q, k, v, opts, mask)

    def backward(self, q, k, v, out, grad_out, opts, mask):
        return dense_backward(q, k, v, out, grad_out, opts, mask)


def rel_err(got, want) -> float:
    """max |got - want| / max |want|; inf when shapes differ or `got` is NaN/inf where `want`
    is finite (an unwritten or blown-up element)."""
    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    if got.shape != want.shape:
        return float("inf")
    finite = np.isfinite(want)
    if not np.array_equal(np.isfinite(got), finite) or not np.array_equal(
            got[~finite], want[~finite], equal_nan=True):
        return float("inf")
    if not finite.any():
        return 0.0
    diff = np.abs(got[finite] - want[finite]).max()
    return float(diff / max(np.abs(want[finite]).max(), 1e-30))


# --- the checks ---------------------------------------------------------------------------------
@dataclass
class Row:
    op: str
    shape: str
    err: float | None
    tol: float
    note: str = ""

    @property
    def ok(self) -> bool:
        return self.err is not None and self.err <= self.tol


def _shape(*arrays) -> str:
    return " ".join(f"{n}[{','.join(str(d) for d in a.shape)}]" for n, a in arrays)


def run_checks(runner: Runner, oracle, rng, quick: bool) -> list[Row]:
    B, S, H, Hkv, D = (1, 64, 4, 2, 32) if quick else (2, 256, 8, 2, 64)
    f32 = np.float32

    def randn(*shape):
        return rng.standard_normal(shape).astype(f32)

    q, k, v = randn(B, S, H, D), randn(B, S, Hkv, D), randn(B, S, Hkv, D)
    # Additive mask broadcast over heads, some keys hidden (-inf), and query row 3 of batch 0
    # hidden entirely, so its output must be exactly 0.
    mask = randn(B, 1, S, S)
    mask[rng.random(mask.shape) < 0.1] = -np.inf
    mask[0, 0, 3, :] = -np.inf
    decode = 4  # a KV-cache step: 4 new queries at absolute positions S-4 .. S-1
    qd = randn(B, decode, H, D)

    rows: list[Row] = []

    def check(op, kind, shape, fn, note=""):
        try:
            got, want = fn()
            if isinstance(got, tuple):
                err = max(rel_err(g, w) for g, w in zip(got, want))
            else:
                err = rel_err(got, want)
            rows.append(Row(op, shape, err, TOL[kind], note))
        except Exception as e:  # a kernel not written yet, a compile error: report, don't crash
            msg = f"{type(e).__name__}: {e}".splitlines()[0]
            rows.append(Row(op, shape, None, TOL[kind], msg[:120]))

    def both(method, *args):
        return getattr(runner, method)(*args), getattr(oracle, method)(*args)

    check("rope (theta 1e4, pos 5)", "rope", _shape(("x", q)),
          lambda: both("rope", q, 5, 10000.0))
    check("rope_theta (theta 1e5, pos 100)", "rope", _shape(("x", k)),
          lambda: both("rope", k, 100, 100000.0))

    cases = [
        ("causal, GQA", _shape(("q", q), ("kv", k)),
         (q, k, v, AttentionOptions(causal=True), None)),
        ("mask [B,1,S,S], GQA", _shape(("q", q), ("kv", k), ("mask", mask)),
         (q, k, v, AttentionOptions(), mask)),
        ("decode: offset + window", _shape(("q", qd), ("kv", k)),
         (qd, k, v, AttentionOptions(causal=True, causal_offset=S - decode, window=S // 4), None)),
        ("dropout 0.1, causal", _shape(("q", q), ("kv", k)),
         (q, k, v, AttentionOptions(causal=True, dropout_prob=0.1, seed=20240611), None)),
    ]
    for name, shape, (qq, kk, vv, opts, m) in cases:
        outs = {}

        def fwd(qq=qq, kk=kk, vv=vv, opts=opts, m=m, outs=outs):
            got, want = both("forward", qq, kk, vv, opts, m)
            outs["out"] = got
            return got, want

        check(f"forward {name}", "fwd", shape, fwd)
        if not rows[-1].ok:  # the backward needs this forward's output
            rows.append(Row(f"backward {name} (dq, dk, dv)", shape, None, TOL["bwd"],
                            "forward failed"))
            continue
        grad_out = randn(*qq.shape)
        check(f"backward {name} (dq, dk, dv)", "bwd", shape,
              lambda qq=qq, kk=kk, vv=vv, opts=opts, m=m, out=outs["out"], go=grad_out:
              both("backward", qq, kk, vv, out, go, opts, m))
    return rows


def _print_table(rows: list[Row], backend: str, oracle: str) -> None:
    head = ("op", "backend", "shape", "vs", "rel. error", "tol", "result")
    body = [(r.op, backend, r.shape, oracle,
             "-" if r.err is None else f"{r.err:.2e}", f"{r.tol:.0e}",
             "pass" if r.ok else "FAIL" + (f" ({r.note})" if r.err is None else ""))
            for r in rows]
    widths = [max(len(x[i]) for x in [head, *body]) for i in range(len(head) - 1)]
    for line in [head, tuple("-" * w for w in widths) + ("-" * 6,), *body]:
        print("  ".join(c.ljust(w) for c, w in zip(line, widths)) + "  " + line[-1])


def _seed(text: str) -> int:
    """`--seed`: a non-negative integer (what `numpy.random.default_rng` takes), else a usage
    error from argparse (exit code 2), not a traceback."""
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text!r}")
    return value


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m ferrocupy",
        description="ferrocupy demo and self-check: RoPE and attention forward/backward on the "
                    "best backend, checked against the NumPy reference (or, on the reference "
                    "backend, against independent dense formulas).")
    ap.add_argument("--backend", choices=("cuda", "reference"),
                    help="backend to test (default: CUDA when a GPU is usable, else reference)")
    ap.add_argument("--quick", action="store_true", help="smaller shapes")
    ap.add_argument("--seed", type=_seed, metavar="N",
                    help="seed of the random inputs, an integer >= 0 (default: fresh)")
    args = ap.parse_args(argv)

    start = time.perf_counter()
    try:
        engine = ComputeEngine(args.backend)
    except Exception as e:
        print(f"ferrocupy: cannot start the {args.backend or 'default'} backend: "
              f"{type(e).__name__}: {e}", file=sys.stderr)
        return 2
    backend = engine.backend_name
    seed = args.seed if args.seed is not None else secrets.randbits(32)
    rng = np.random.default_rng(seed)

    print(f"ferrocupy {__version__} self-check  (Python {platform.python_version()}, "
          f"NumPy {np.__version__}, input seed {seed}: replay with --seed {seed})")
    if backend == "cuda":
        import cupy

        name = getattr(engine.backend, "device_name", lambda: "?")()
        print(f"backend: cuda on {engine.backend.device} = {name}, CuPy {cupy.__version__}, "
              f"CUDA runtime {cupy.cuda.runtime.runtimeGetVersion()}")
        oracle, oracle_name = Runner(ComputeEngine("reference", quiet=True)), "reference"
        print("checked against: the NumPy reference backend (float64 inside)")
    else:
        print("backend: reference (NumPy on the host, float64 inside)")
        if not _philox_known_answers():
            print("FAIL: the demo's own Philox4x32-10 misses the known answers of docs/semantics.md")
            return 1
        oracle, oracle_name = DenseOracle(), "dense NumPy"
        print("checked against: independent dense NumPy formulas (own Philox, known answers ok)")
    print()

    rows = run_checks(Runner(engine), oracle, rng, args.quick)
    _print_table(rows, backend, oracle_name)
    failed = [r for r in rows if not r.ok]
    print()
    print(f"{len(rows) - len(failed)} passed, {len(failed)} failed "
          f"({time.perf_counter() - start:.1f} s, first CUDA use includes compiling the kernels)"
          if backend == "cuda" else
          f"{len(rows) - len(failed)} passed, {len(failed)} failed "
          f"({time.perf_counter() - start:.1f} s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
