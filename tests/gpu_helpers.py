"""Shared helpers of the GPU test suite (`tests/test_cuda_*.py`).

Every GPU test compares `ComputeEngine("cuda")` with `ComputeEngine("reference")` on the same
host float32 inputs: fresh random data (never zeros), GPU outputs poisoned with NaN before each
call, relative error ||gpu - ref|| / ||ref|| computed in float64.

The suite is marked `gpu` and skipped with a reason when `ferrocupy.cuda_available()` is False,
so collecting it on a machine without CuPy or without a GPU only skips.

Self-check mode (for developers without a GPU; keep it out of CI):

    FERRO_GPU_TESTS_ON_REFERENCE=1 python -m pytest tests/test_cuda_*.py

runs the whole suite with the reference backend standing in for the "device" engine (NumPy
arrays on both sides). It proves the test code itself (call signatures, shapes, poisoning, the
exact-zero and NaN expectations, the pairwise covering) is right; it proves nothing about the
CUDA kernels. Tests that only make sense on a GPU (a host tensor given to the CUDA engine, torch
interop) skip in that mode. Only the CI-free developer machine should set it.

Sizes are kept modest because the reference is float64 NumPy looping over (batch, head): the
whole suite spends about a minute in the reference. Option combinations are a pairwise covering
(`pairwise`, `OPTION_FACTORS`), not a cartesian product. Cases with batch*heads > 65535 use the
vectorised direct-formula oracle of tests/helpers.py instead (see `dense_forward`).
"""

from __future__ import annotations

import functools
import itertools
import os
import random
from dataclasses import dataclass, replace

import numpy as np
import pytest

import ferrocupy
from ferrocupy import AttentionOptions, ComputeEngine, UnifiedTensor
from ferrocupy.dtypes import BFLOAT16, FLOAT16, FLOAT32
from helpers import poison, rel_err  # tests/helpers.py (conftest puts tests/ on sys.path)

SELF_CHECK_ENV = "FERRO_GPU_TESTS_ON_REFERENCE"

FWD_TOL = 1e-5   # float32 forward, relative
BWD_TOL = 1e-4   # float32 backward, relative, each gradient on its own
ROPE_TOL = 1e-5  # float32 RoPE, relative

DROPOUT_SEED = 0x5EED_0000_C0FF_EE01  # > 32 bits on purpose: only the low 32 bits are used


def self_check() -> bool:
    """True when the suite runs reference-vs-reference on the CPU (see the module docstring)."""
    return os.environ.get(SELF_CHECK_ENV, "") == "1"


def skip_reason() -> str | None:
    """Why the GPU suite cannot run here, or None when it can."""
    if self_check():
        return None
    if ferrocupy.cuda_available():
        return None
    try:
        import cupy  # noqa: F401
    except ImportError:
        return "GPU test: CuPy is not installed (ferrocupy.cuda_available() is False)"
    return "GPU test: no usable CUDA device (ferrocupy.cuda_available() is False)"


def gpu_pytestmark() -> list:
    """The module-level `pytestmark` of every GPU test file: the `gpu` marker (conftest skips
    `gpu` tests where no CUDA GPU is usable) plus a skipif with the precise reason. In
    self-check mode the `gpu` marker is left off, so conftest does not skip the CPU run."""
    if self_check():
        return []
    reason = skip_reason()
    return [pytest.mark.gpu, pytest.mark.skipif(reason is not None, reason=reason or "")]


def needs_real_gpu():
    """Skip a test that means nothing in self-check mode (it checks CUDA-only behaviour)."""
    if self_check():
        pytest.skip(f"checks the CUDA engine itself; meaningless with {SELF_CHECK_ENV}=1")


def count_launches(monkeypatch, engine: ComputeEngine) -> list:
    """A list that records each attention operation `engine`'s backend runs from now on (the
    CUDA backend's plan runs; the reference backend's forward and backward)."""
    runs = []
    cls = type(engine.backend)
    for name in ("run_plan",) if hasattr(cls, "run_plan") else ("forward", "backward"):
        real = getattr(cls, name)
        monkeypatch.setattr(cls, name, lambda self, *a, _real=real, _name=name, **kw: (
            runs.append(_name), _real(self, *a, **kw))[1])
    return runs


# --- engines and tensors -----------------------------------------------------------------------

class Device:
    """An engine plus where its tensors live ("cuda" or "cpu"), with the few array operations the
    tests need, so every test reads the same on the GPU and in self-check mode."""

    def __init__(self, engine: ComputeEngine, where: str):
        self.engine = engine
        self.where = where

    @property
    def xp(self):
        if self.where == "cpu":
            return np
        import cupy

        return cupy

    def put(self, a) -> UnifiedTensor | None:
        """A fresh copy of host array `a` on this device (None stays None)."""
        if a is None:
            return None
        return UnifiedTensor.from_numpy(np.ascontiguousarray(a), device=self.where)

    def put_unaligned(self, a) -> UnifiedTensor | None:
        """Like `put`, but the data starts one element into its allocation: contiguous, yet only
        4-byte aligned (a view at an offset, as a slice of a framework's tensor can be)."""
        if a is None:
            return None
        a = np.ascontiguousarray(a)
        base = UnifiedTensor.empty((a.size + 1,), a.dtype, device=self.where).buffer()
        view = base[1:].reshape(a.shape)
        if a.dtype.itemsize == 2:  # half dtypes: copy the 16-bit patterns
            view.view(np.uint16)[...] = self.xp.asarray(a.view(np.uint16))
        else:
            view[...] = self.xp.asarray(a)
        self.sync()
        return UnifiedTensor(view)

    @staticmethod
    def data_ptr(t: UnifiedTensor) -> int:
        a = t.buffer()
        return a.ctypes.data if isinstance(a, np.ndarray) else a.data.ptr

    def poisoned(self, shape, value=np.nan, dtype=np.float32) -> UnifiedTensor:
        """An output tensor filled with `value` (NaN: anything not written shows up)."""
        t = UnifiedTensor.empty(tuple(shape), dtype, device=self.where)
        if np.isnan(value):
            poison(t.buffer())  # tests/helpers.py's poison: a[...] = NaN (CuPy or NumPy)
        else:
            t.buffer().fill(value)
        self.sync()
        return t

    def sync(self) -> None:
        """Wait for all work on the device (whatever stream the backend launched on)."""
        if self.where != "cpu":
            import cupy

            cupy.cuda.Device().synchronize()

    def get(self, t: UnifiedTensor) -> np.ndarray:
        self.sync()
        return t.to_numpy()

    def array_equal(self, a: UnifiedTensor, b: UnifiedTensor) -> bool:
        self.sync()
        return bool(self.xp.array_equal(a.buffer(), b.buffer()))


_ENGINES: dict = {}


def reference_device() -> Device:
    if "ref" not in _ENGINES:
        _ENGINES["ref"] = Device(ComputeEngine("reference"), "cpu")
    return _ENGINES["ref"]


def device_under_test() -> Device:
    if "dev" not in _ENGINES:
        if self_check():
            _ENGINES["dev"] = Device(ComputeEngine("reference"), "cpu")
        else:
            _ENGINES["dev"] = Device(ComputeEngine("cuda"), "cuda")
    return _ENGINES["dev"]


def restricted_device(design: str) -> Device:
    """The CUDA engine restricted to one design's variants (configs.only): "mma" (the mma.sync
    forward and backward, every GPU from sm_80), "tensor" or "streams" (one decode kernel, with
    "tiles" for the calls it cannot take), "tiles" (the decode kernel that shares each tile
    across the block), so a GPU whose own choice is another kernel still tests these; the
    reference in self-check mode."""
    key = "dev_" + design
    if key not in _ENGINES:
        if self_check():
            _ENGINES[key] = device_under_test()
        else:
            from ferrocupy.cuda import configs
            from ferrocupy.cuda.backend import CudaBackend

            engine = ComputeEngine("cuda")
            designs = ((design, configs.TILES) if design in (configs.TENSOR, configs.STREAMS)
                       else (design,))
            engine.backend = CudaBackend(table=configs.only(*designs))
            _ENGINES[key] = Device(engine, "cuda")
    return _ENGINES[key]


@pytest.fixture(scope="session", params=["auto", "mma"])
def kernels(request) -> Device:
    """The engine under test twice: with the kernels it picks for this GPU, and with the
    portable mma.sync ones only."""
    return device_under_test() if request.param == "auto" else restricted_device("mma")


@pytest.fixture(scope="session", params=["auto", "streams", "tiles"])
def decoders(request) -> Device:
    """The engine under test three times for decode shapes: with the decode kernels it picks
    (tensor cores in half precision, the streams kernel in float32, where the rows allow), with
    the streams design (tiles where it cannot run: more than 8 rows a group, rows without
    16-byte copies), and with the tiles design only."""
    return device_under_test() if request.param == "auto" else restricted_device(request.param)


@pytest.fixture(scope="session")
def dev() -> Device:
    """The engine under test: CUDA, or the reference in self-check mode."""
    return device_under_test()


@pytest.fixture(scope="session")
def ref() -> Device:
    """The NumPy reference engine with host tensors."""
    return reference_device()


# --- errors ------------------------------------------------------------------------------------

def _first_bad(mask: np.ndarray) -> str:
    idx = np.argwhere(mask)
    return f"{len(idx)} of {mask.size} elements, first at {tuple(int(i) for i in idx[0])}"


def assert_close(name: str, got: np.ndarray, want: np.ndarray, tol: float, what: str = "",
                 nan_ok: bool = False, floor: float = 0.0) -> float:
    """`got` (device) matches `want` (reference) to relative error `tol`:
    ||got - want|| / max(||want||, floor) < tol (`floor`: see `grad_floors`).

    Without `nan_ok`, neither may hold a NaN; with it, both must hold NaN at the same places and
    the error is measured over the rest."""
    assert got.shape == want.shape, f"{name}: shape {got.shape} != reference {want.shape} {what}"
    got_nan, want_nan = np.isnan(got), np.isnan(want)
    if not nan_ok:
        assert not want_nan.any(), f"{name}: the REFERENCE has NaN ({_first_bad(want_nan)}) {what}"
        assert not got_nan.any(), f"{name}: NaN in the device output ({_first_bad(got_nan)}) {what}"
    else:
        differ = got_nan != want_nan
        assert not differ.any(), (f"{name}: NaN pattern differs from the reference "
                                  f"({_first_bad(differ)}) {what}")
    keep = ~want_nan
    err = rel_err(got[keep], want[keep])
    norm = float(np.linalg.norm(want[keep].astype(np.float64)))
    if floor > norm:
        err = err * norm / floor if norm > 0 else err / floor
    if not err < tol:
        d = np.where(keep, np.abs(got.astype(np.float64) - want), 0.0)
        at = np.unravel_index(int(np.nanargmax(d)), d.shape) if d.size else ()
        raise AssertionError(
            f"{name}: relative error {err:.3e} >= {tol:.0e} (reference norm {norm:.3e}, floor "
            f"{floor:.3e}) {what}; largest difference "
            f"{float(d[at]) if d.size else 0:.3e} at {tuple(int(i) for i in at)} "
            f"(device {got[at] if d.size else None!r}, reference {want[at] if d.size else None!r})")
    return err


# --- attention inputs ----------------------------------------------------------------------------

@dataclass(frozen=True)
class AttnCase:
    """One attention problem, as host float32 arrays (built once, given to both engines)."""

    q: np.ndarray         # [B, Sq, H, D]
    k: np.ndarray         # [B, Sk, Hkv, D]
    v: np.ndarray         # [B, Sk, Hkv, D]
    grad_out: np.ndarray  # [B, Sq, H, D]
    mask: np.ndarray | None
    opts: AttentionOptions

    @property
    def dims(self):
        b, sq, h, d = self.q.shape
        return b, sq, h, d, self.k.shape[1], self.k.shape[2]

    def describe(self) -> str:
        b, sq, h, d, sk, hkv = self.dims
        o = self.opts
        m = None if self.mask is None else list(self.mask.shape)
        return (f"[B={b} Sq={sq} Sk={sk} H={h} Hkv={hkv} D={d} causal={o.causal} "
                f"offset={o.causal_offset} window={o.window} dropout={o.dropout_prob} "
                f"mask={m}]")


MASK_SHAPES = ["1,1,1,Sk", "B,1,1,Sk", "1,H,Sq,Sk", "B,H,Sq,Sk", "B,1,Sq,1", "1,H,1,1",
               "1,1,Sq,Sk", "B,1,Sq,Sk"]


def mask_shape(spec, b, h, sq, sk) -> tuple:
    """`"B,1,1,Sk"` -> `(b, 1, 1, sk)`; a tuple of ints is returned as it is."""
    if not isinstance(spec, str):
        return tuple(int(x) for x in spec)
    sizes = {"B": b, "H": h, "Sq": sq, "Sk": sk, "1": 1}
    return tuple(sizes[tok.strip()] for tok in spec.split(","))


def make_case(rng: np.random.Generator, *, b: int = 2, sq: int, sk: int, h: int = 4,
              hkv: int | None = None, d: int = 32, mask=None, neg_inf: float = 0.0,
              qk_scale: float = 1.5, opts: AttentionOptions = AttentionOptions(),
              **opt_fields) -> AttnCase:
    """Random standard-normal inputs. `q` and `k` are scaled by `qk_scale` so scores have a
    standard deviation of about `qk_scale**2` and the softmax is neither flat nor one-hot.
    `mask` is None, a shape spec from MASK_SHAPES, or a tuple; its values are standard normal,
    with a fraction `neg_inf` of them set to -inf (padding-style)."""
    hkv = h if hkv is None else hkv
    opts = replace(opts, **opt_fields)
    f32 = np.float32
    q = (rng.standard_normal((b, sq, h, d)) * qk_scale).astype(f32)
    k = (rng.standard_normal((b, sk, hkv, d)) * qk_scale).astype(f32)
    v = rng.standard_normal((b, sk, hkv, d)).astype(f32)
    grad_out = rng.standard_normal((b, sq, h, d)).astype(f32)
    m = None
    if mask is not None:
        shape = mask_shape(mask, b, h, sq, sk)
        m = rng.standard_normal(shape).astype(f32)
        if neg_inf:
            m[rng.random(shape) < neg_inf] = -np.inf
    return AttnCase(q, k, v, grad_out, m, opts)


def visible(case: AttnCase) -> np.ndarray:
    """[B, H, Sq, Sk] booleans: key j contributes to row i (options and -inf mask entries)."""
    b, sq, h, d, sk, hkv = case.dims
    o = case.opts
    a = np.arange(sq, dtype=np.int64)[:, None] + o.causal_offset
    j = np.arange(sk, dtype=np.int64)[None, :]
    vis = np.ones((sq, sk), dtype=bool)
    if o.causal:
        vis &= j <= a
    if o.window:
        vis &= np.abs(a - j) < o.window
    vis = np.broadcast_to(vis, (b, h, sq, sk))
    if case.mask is not None:
        vis = vis & (np.broadcast_to(case.mask, (b, h, sq, sk)) > -np.inf)
    return vis


def dead_rows(case: AttnCase) -> np.ndarray:
    """[B, Sq, H] booleans: rows with no visible key (their output must be exactly 0)."""
    return np.transpose(~visible(case).any(axis=-1), (0, 2, 1))


def dead_keys(case: AttnCase) -> np.ndarray:
    """[B, Sk, Hkv] booleans: keys no query of their group sees (zero grad_k and grad_v)."""
    b, sq, h, d, sk, hkv = case.dims
    seen = visible(case).any(axis=2)                       # [B, H, Sk]
    seen = seen.reshape(b, hkv, h // hkv, sk).any(axis=2)  # [B, Hkv, Sk]
    return np.transpose(~seen, (0, 2, 1))


# --- running both engines -----------------------------------------------------------------------

def run_forward(d: Device, case: AttnCase) -> np.ndarray:
    """`flash_attention_v2_with` on `d` with a NaN-poisoned `out`; returns `out` on the host."""
    q, k, v, mask = (d.put(x) for x in (case.q, case.k, case.v, case.mask))
    out = d.poisoned(case.q.shape)
    d.engine.flash_attention_v2_with(q, k, v, out, case.opts, mask)
    return d.get(out)


def run_backward(d: Device, case: AttnCase, out: np.ndarray) -> dict:
    """`flash_attention_v2_backward_with` on `d` with NaN-poisoned gradients, given the forward's
    `out` (host); returns {"grad_q", "grad_k", "grad_v"} on the host."""
    q, k, v, o, go, mask = (d.put(x) for x in
                            (case.q, case.k, case.v, out, case.grad_out, case.mask))
    gq = d.poisoned(case.q.shape)
    gk, gv = d.poisoned(case.k.shape), d.poisoned(case.k.shape)
    d.engine.flash_attention_v2_backward_with(q, k, v, o, go, gq, gk, gv, case.opts, mask)
    return {"grad_q": d.get(gq), "grad_k": d.get(gk), "grad_v": d.get(gv)}


def check_forward(dev: Device, ref: Device, case: AttnCase, nan_ok: bool = False):
    """Device vs reference forward; rows with no visible key must be exactly 0 on the device.
    Returns (device out, reference out)."""
    want = run_forward(ref, case)
    got = run_forward(dev, case)
    what = case.describe()
    assert_close("out", got, want, FWD_TOL, what, nan_ok=nan_ok)
    dead = dead_rows(case)
    if dead.any():
        rows = got[dead]
        assert not np.isnan(rows).any(), f"out: NaN in a row with no visible key {what}"
        assert (rows == 0).all(), f"out: a row with no visible key is not exactly 0 {what}"
    return got, want


def check_backward(dev: Device, ref: Device, case: AttnCase) -> dict:
    """Device vs reference backward, each gradient on its own, given the reference forward's
    `out` on both sides. Gradients of rows/keys that see nothing must be exactly 0."""
    out = run_forward(ref, case)
    want = run_backward(ref, case, out)
    got = run_backward(dev, case, out)
    what = case.describe()
    errs = assert_grads_close(got, want, case, what)
    dead = dead_rows(case)
    if dead.any():
        assert (got["grad_q"][dead] == 0).all(), \
            f"grad_q: a row with no visible key is not 0 {what}"
    dk = dead_keys(case)
    if dk.any():
        for name in ("grad_k", "grad_v"):
            assert (got[name][dk] == 0).all(), f"{name}: a key no query sees is not 0 {what}"
    return errs


# Forward out and lse of one dtype against the float64 reference, relative (kv_lens and decode).
FWD_TOL_BY_DTYPE = {FLOAT32: 1e-5, FLOAT16: 4e-3, BFLOAT16: 3e-2}


def check_forward_with_lse(dev: Device, ref: Device, q, k, v, opts, mask=None, kv_lens=None,
                           what: str = "") -> None:
    """The device's out and lse (NaN-poisoned first) equal the reference's within the dtype's
    tolerance; no NaN anywhere (unwritten, or read past kv_lens); rows that see nothing give the
    reference's exact values (out 0, lse -inf). Host arrays in, already in the call's dtype."""
    dtype = np.dtype(q.dtype)
    tol = FWD_TOL_BY_DTYPE[dtype]
    b, sq, h, _ = q.shape
    res = []
    for e in (dev, ref):
        out = e.poisoned(q.shape, dtype=dtype)
        lse = e.poisoned((b, h, sq), dtype=np.float32)
        e.engine.flash_attention_v2_with(e.put(q), e.put(k), e.put(v), out, opts, e.put(mask),
                                         lse=lse, kv_lens=e.put(kv_lens))
        res.append((e.get(out).astype(np.float64), e.get(lse).astype(np.float64)))
    for name, got, want in zip(("out", "lse"), *res):
        assert not np.isnan(got).any(), f"{name}: NaN (unwritten, or read past kv_lens) {what}"
        fin = np.isfinite(want)  # lse is -inf for a row that sees nothing
        assert (got[~fin] == want[~fin]).all(), f"{name}: rows that see nothing differ {what}"
        err = np.linalg.norm(got[fin] - want[fin]) / np.linalg.norm(want[fin])
        assert err < tol, f"{name}: relative error {err:.2e} (tol {tol}) {what}"


def check_decode_case(dev: Device, ref: Device, rng: np.random.Generator, dtype, b: int,
                      sq: int, h: int, hkv: int, d: int, sk: int, opts: AttentionOptions,
                      mask: bool, lens, what: str = "") -> None:
    """check_forward_with_lse on fresh standard-normal inputs in `dtype` at a decode shape, with
    a [b, 1, sq, sk] float32 mask if `mask`, and per-batch `lens` (kv_lens; NaN in k and v past
    them) unless None."""
    q = rng.standard_normal((b, sq, h, d)).astype(np.float32).astype(dtype)
    k = rng.standard_normal((b, sk, hkv, d)).astype(np.float32).astype(dtype)
    v = rng.standard_normal((b, sk, hkv, d)).astype(np.float32).astype(dtype)
    m = rng.standard_normal((b, 1, sq, sk)).astype(np.float32) if mask else None
    kv_lens = None if lens is None else np.array(lens, np.int32)
    if kv_lens is not None:
        for i, n in enumerate(kv_lens):
            k[i, n:], v[i, n:] = np.nan, np.nan
    check_forward_with_lse(dev, ref, q, k, v, opts, m, kv_lens, what=what)


def grad_floors(case: AttnCase) -> dict:
    """The norm each gradient would have without the `- Delta` cancellation, times 0.1.

    `grad_q_i = scale sum_j P_ij (dP_ij - Delta_i) k_j` (and `grad_k` alike) cancels exactly
    where a row sees a single key (window 1, seq 1, Sk = 1): then P = 1 and dP = Delta, so the
    reference gradient is 0 up to float64 rounding, and `||gpu - ref|| / ||ref||` would measure
    float32 rounding against nothing. The error is then taken relative to this floor, the size of
    the float32 sums the kernel actually forms (`scale sum_j P_ij dP_ij k_j`). It only takes
    effect where the reference norm is below a tenth of it (at least 10x cancellation).
    Dense float64, every (b, h) at once: for the modest sizes of this suite only."""
    b, sq, h, d, sk, hkv = case.dims
    g = h // hkv
    f8 = np.float64
    q, do = case.q.astype(f8), case.grad_out.astype(f8)
    k, v = (np.repeat(x.astype(f8), g, axis=2) for x in (case.k, case.v))
    scale = f8(np.float32(1.0) / np.sqrt(np.float32(d)))
    with np.errstate(all="ignore"):
        s = np.einsum("bihd,bjhd->bhij", q, k) * scale
        if case.mask is not None:
            s = s + case.mask.astype(f8)
        s = np.where(visible(case), s, -np.inf)
        mx = s.max(axis=-1, keepdims=True, initial=-np.inf)
        e = np.exp(s - np.where(mx == -np.inf, 0.0, mx))
        p = e / np.maximum(e.sum(axis=-1, keepdims=True), np.finfo(f8).tiny)
        a = p * np.einsum("bihd,bjhd->bhij", do, v)
        keep = keep_mask(case)
        if keep is not None:
            a = a * keep * f8(np.float32(1) / (np.float32(1) - np.float32(case.opts.dropout_prob)))
        aq = scale * np.einsum("bhij,bjhd->bihd", a, k)
        ak = scale * np.einsum("bhij,bihd->bjhd", a, q).reshape(b, sk, hkv, g, d).sum(axis=3)
    return {"grad_q": 0.1 * float(np.linalg.norm(aq)), "grad_k": 0.1 * float(np.linalg.norm(ak)),
            "grad_v": 0.0}


def assert_grads_close(got: dict, want: dict, case: AttnCase, what: str = "") -> dict:
    """Each of grad_q, grad_k, grad_v to BWD_TOL on its own (relative, with `grad_floors`)."""
    floors = grad_floors(case)
    return {name: assert_close(name, got[name], want[name], BWD_TOL, what, floor=floors[name])
            for name in ("grad_q", "grad_k", "grad_v")}


# --- covering combinations ---------------------------------------------------------------------

def pairwise(factors: dict, seed: int = 0, tries: int = 40) -> list[dict]:
    """A deterministic set of rows (dicts) in which every pair of values of every two factors
    appears at least once (greedy AETG-style all-pairs covering)."""
    names = list(factors)
    sizes = [len(factors[n]) for n in names]
    uncovered = {(i, a, j, b) for i, j in itertools.combinations(range(len(names)), 2)
                 for a in range(sizes[i]) for b in range(sizes[j])}
    rnd = random.Random(seed)
    rows = []
    used = [[0] * n for n in sizes]

    def gain(row, partial):
        return sum((i, row[i], j, row[j]) in uncovered
                   for i, j in itertools.combinations(sorted(partial), 2))

    while uncovered:
        best, best_gain = None, -1
        pool = sorted(uncovered)
        for _ in range(tries):
            row = [None] * len(names)
            i, a, j, b = pool[0] if best is None else rnd.choice(pool)
            row[i], row[j] = a, b
            order = [x for x in range(len(names)) if x not in (i, j)]
            rnd.shuffle(order)
            done = {i, j}
            for f in order:
                scores = []
                for val in range(sizes[f]):
                    row[f] = val
                    # ties go to the value used least so far, so values spread evenly
                    scores.append((gain(row, done | {f}), -used[f][val], rnd.random(), val))
                row[f] = max(scores)[3]
                done.add(f)
            g = gain(row, done)
            if g > best_gain:
                best, best_gain = list(row), g
        rows.append(best)
        for f, val in enumerate(best):
            used[f][val] += 1
        uncovered -= {(i, best[i], j, best[j])
                      for i, j in itertools.combinations(range(len(names)), 2)}
    return [{n: factors[n][v] for n, v in zip(names, row)} for row in rows]


FULL_GRID_ENV = "FERRO_FULL_GRID"


def full_grid() -> bool:
    """True when `covering` gives whole cartesian products (FERRO_FULL_GRID=1)."""
    return os.environ.get(FULL_GRID_ENV, "") == "1"


def axis(values, ids=None) -> list:
    """One factor of `covering` as `pytest.mark.parametrize(name, values, ids=ids)` would name
    its values (a list of ids, a function of the value, or None: a `pytest.param`'s own id, else
    the value's str)."""
    param_type = type(pytest.param(0))
    out = []
    for n, v in enumerate(values):
        if isinstance(v, param_type):
            out.append(v)
        elif ids is None:
            out.append(pytest.param(v, id=str(v)))
        else:
            out.append(pytest.param(v, id=ids[n] if isinstance(ids, (list, tuple)) else ids(v)))
    return out


def covering(factors: dict, seed: int = 0) -> list:
    """`pytest.param`s over `factors` (argument name -> values, each a value or a `pytest.param`
    with an id) for `pytest.mark.parametrize(",".join(factors), covering(factors))`: a pairwise
    covering (every pair of values of every two factors in at least one row; `pairwise`), or
    with FERRO_FULL_GRID=1 their whole cartesian product. Ids are the values' ids joined by "-"
    in the factors' order.

    A GPU round runs the covering (the suite must fit a device call or two); the full grid
    finds what only a triple of values shows, for when time allows."""
    table = {n: [(p.values[0], p.id) for p in axis(vals)] for n, vals in factors.items()}
    if full_grid():
        rows = [dict(zip(table, combo)) for combo in itertools.product(*table.values())]
    else:
        index = pairwise({n: list(range(len(vals))) for n, vals in table.items()}, seed=seed)
        rows = [{n: table[n][i] for n, i in r.items()} for r in index]
    return [pytest.param(*(v for v, _ in r.values()), id="-".join(i for _, i in r.values()))
            for r in rows]


# The option space of every forward and backward combination test (pairwise covered).
OPTION_FACTORS = {
    "seqs": [(7, 7), (129, 129), (64, 129), (127, 300), (200, 33)],
    "d": [16, 40, 64, 128],
    "gqa": [1, 2, 8],
    "causal": [False, True],
    "offset": [0, 3, 40],
    "window": [0, 1, 17],
    "mask": [None, *MASK_SHAPES],
    "dropout": [0.0, 0.2],
}


def option_id(row: dict) -> str:
    sq, sk = row["seqs"]
    parts = [f"q{sq}k{sk}", f"d{row['d']}", f"gqa{row['gqa']}",
             "causal" if row["causal"] else "full", f"off{row['offset']}", f"win{row['window']}",
             "nomask" if row["mask"] is None else f"mask[{row['mask']}]",
             f"drop{row['dropout']}"]
    return "-".join(parts)


@functools.lru_cache(maxsize=None)
def _option_cover() -> tuple:
    return tuple(pairwise(OPTION_FACTORS, seed=3))


def option_rows() -> list:
    """`pytest.param`s of the pairwise covering of OPTION_FACTORS (45 rows), readable ids."""
    return [pytest.param(r, id=option_id(r)) for r in _option_cover()]


def option_case(rng: np.random.Generator, row: dict) -> AttnCase:
    sq, sk = row["seqs"]
    h = 8
    return make_case(rng, b=2, sq=sq, sk=sk, h=h, hkv=h // row["gqa"], d=row["d"],
                     mask=row["mask"], neg_inf=0.05 if row["mask"] else 0.0,
                     causal=row["causal"], causal_offset=row["offset"], window=row["window"],
                     dropout_prob=row["dropout"], seed=DROPOUT_SEED)


# --- a vectorised oracle for batch*heads beyond 65535 ------------------------------------------
# The reference loops over (batch, head) in Python: ~70,000 pairs take minutes there (dropout
# included). These cases are checked instead against tests/helpers.py's direct-formula oracle,
# which is vectorised over batch and heads, with the dropout keep-mask drawn from the
# reference's own Philox (also vectorised), plus the reference engine itself on a few batch
# slices when there is no dropout (dropout's counter depends on b, so slices would differ).

def keep_mask(case: AttnCase) -> np.ndarray | None:
    """`[B, H, Sq, Sk]` dropout keep-mask of SPEC "Dropout", every (b, h) at once."""
    from ferrocupy.reference import philox4x32_10

    thr = int(float(np.float32(case.opts.dropout_prob)) * 2.0**32)
    if thr == 0:
        return None
    b, sq, h, d, sk, hkv = case.dims
    bh = np.arange(b * h, dtype=np.int64).reshape(b, h, 1, 1)
    i = np.arange(sq, dtype=np.int64).reshape(1, 1, sq, 1)
    # One Philox call per 4 keys (counter j >> 2): its 4 words are keys 4c .. 4c + 3 in order.
    quads = np.arange((sk + 3) // 4, dtype=np.int64).reshape(1, 1, 1, -1)
    words = philox4x32_10((quads, i, bh, 0), (int(case.opts.seed) & 0xFFFFFFFF, 0))
    word = np.stack(words, axis=-1).reshape(b, h, sq, -1)[..., :sk]
    return word >= np.uint32(thr)


def _dense_kwargs(case: AttnCase) -> dict:
    o = case.opts
    return dict(causal=o.causal, causal_offset=o.causal_offset, window=o.window,
                mask=case.mask, keep=keep_mask(case), dropout_prob=o.dropout_prob)


def dense_forward(case: AttnCase) -> np.ndarray:
    from helpers import dense_attention

    return dense_attention(case.q, case.k, case.v, **_dense_kwargs(case))[0]


def dense_backward(case: AttnCase) -> dict:
    from helpers import dense_attention_grads

    gq, gk, gv, _, _ = dense_attention_grads(case.q, case.k, case.v, case.grad_out,
                                             **_dense_kwargs(case))
    return {"grad_q": gq, "grad_k": gk, "grad_v": gv}


def batch_slice(case: AttnCase, idx) -> AttnCase:
    """The sub-problem of batch entries `idx` (only meaningful without dropout)."""
    idx = list(idx)
    m = case.mask
    if m is not None and m.shape[0] > 1:
        m = np.ascontiguousarray(m[idx])
    return replace(case, q=case.q[idx], k=case.k[idx], v=case.v[idx],
                   grad_out=case.grad_out[idx], mask=m)


# --- case lists shared by the forward and backward suites -----------------------------------
SEQ_Q_NE_K = [
    pytest.param(dict(sq=7, sk=300), id="q7-k300"),
    pytest.param(dict(sq=300, sk=7), id="q300-k7"),
    pytest.param(dict(sq=300, sk=7, causal=True), id="q300-k7-causal"),
    pytest.param(dict(sq=1, sk=1000, causal=True, causal_offset=999), id="decode-q1-k1000"),
    pytest.param(dict(sq=1, sk=1000, causal=True, causal_offset=999, window=128),
                 id="decode-q1-k1000-win128"),
    pytest.param(dict(sq=1, sk=1000, causal=True, causal_offset=500), id="decode-q1-k1000-off500"),
    pytest.param(dict(sq=16, sk=1000, causal=True, causal_offset=984), id="chunk-q16-k1000"),
    pytest.param(dict(sq=129, sk=1000, causal=True, causal_offset=871, mask="B,1,1,Sk"),
                 id="chunk-q129-k1000-padmask"),
    pytest.param(dict(sq=1000, sk=1), id="q1000-k1"),
    pytest.param(dict(sq=1, sk=1), id="q1-k1"),
]

DEAD_ROW_CASES = [
    pytest.param(dict(sq=20, sk=8, causal=True, window=4), id="causal-window-past-the-keys"),
    pytest.param(dict(sq=6, sk=10, causal_offset=50, window=8), id="window-offset-all-rows-dead"),
    pytest.param(dict(sq=1, sk=1000, causal=True, causal_offset=2000, window=500),
                 id="decode-window-beyond-cache"),
    pytest.param(dict(sq=140, sk=130, causal=True, causal_offset=10, window=1),
                 id="window1-diagonal-and-dead-tail"),
    pytest.param(dict(sq=20, sk=8, causal=True, window=4, dropout_prob=0.2, seed=5),
                 id="dead-rows-with-dropout"),
]

BIG_BATCH_SLICES = [0, 1023, 1024, 1099]  # b*64 + h crosses 65535 at b = 1024
