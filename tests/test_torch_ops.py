"""ferrocupy.torch on CPU (the reference backend): opcheck of the custom ops, gradients against
torch's own `scaled_dot_product_attention` (computed in float64), dropout seeds, in-place RoPE and
`torch.compile(fullgraph=True)`. Skipped, saying so, when PyTorch is not installed. The CUDA path
(torch's current stream, CUDA graphs) is tested on a GPU elsewhere."""

from __future__ import annotations

import ctypes

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (pip install torch)")

import ferrocupy.torch as ft  # noqa: E402
from ferrocupy import AttentionOptions, ComputeEngine  # noqa: E402
from helpers import COMPILE_BACKENDS  # noqa: E402

FWD = torch.ops.ferrocupy.attention_fwd.default
BWD = torch.ops.ferrocupy.attention_bwd.default
ROPE = torch.ops.ferrocupy.rope_.default
TOL = 1e-4  # relative, float32 against float64


@pytest.fixture
def gen(rng):
    return torch.Generator().manual_seed(int(rng.integers(2**62)))


def _randn(gen, *shape, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).to(dtype)


def _qkv(gen, B=2, Sq=7, Sk=9, H=4, Hkv=2, D=16, dtype=torch.float32):
    return (_randn(gen, B, Sq, H, D, dtype=dtype, scale=1.5),
            _randn(gen, B, Sk, Hkv, D, dtype=dtype, scale=1.5),
            _randn(gen, B, Sk, Hkv, D, dtype=dtype))


def _rel(got, want) -> float:
    got, want = got.double(), want.double()
    assert torch.isfinite(got).all(), "non-finite values in ferrocupy's result"
    return float(torch.linalg.vector_norm(got - want) / torch.linalg.vector_norm(want))


def _visible(Sq, Sk, causal, offset, window) -> torch.Tensor:
    a = torch.arange(Sq)[:, None] + offset
    j = torch.arange(Sk)[None, :]
    vis = torch.ones(Sq, Sk, dtype=torch.bool)
    if causal:
        vis &= j <= a
    if window:
        vis &= (a - j).abs() < window
    return vis


def _sdpa(q, k, v, *, causal=False, causal_offset=0, window=0, attn_mask=None, scale=None):
    """torch SDPA in float64 on ferrocupy-layout tensors, the visibility as an additive mask."""
    import torch.nn.functional as F

    qt, kt, vt = (x.double().transpose(1, 2) for x in (q, k, v))
    Sq, Sk = q.shape[1], k.shape[1]
    m = torch.zeros(Sq, Sk, dtype=torch.float64).masked_fill(
        ~_visible(Sq, Sk, causal, causal_offset, window), -math.inf)
    if attn_mask is not None:
        m = m + attn_mask.double()
    s = 1 / math.sqrt(q.shape[-1]) if scale is None else float(np.float32(scale))
    o = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=m, scale=s, enable_gqa=True)
    return o.transpose(1, 2)


def _grads(fn, inputs, grad_out):
    inputs = [x.detach().clone().requires_grad_(True) for x in inputs]
    out = fn(*inputs)
    out.backward(grad_out)
    return out.detach(), [x.grad for x in inputs]


def _fwd_args(q, k, v, mask=None, causal=False, offset=0, window=0, p=0.0, seed=0, scale=None,
              kv_lens=None):
    return (q, k, v, mask, causal, offset, window, p, torch.tensor(seed, dtype=torch.int64), scale,
            kv_lens)


# --- opcheck --------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", ["plain", "causal-mask-dropout", "window-offset-scale"])
def test_opcheck_forward_and_backward(gen, dtype, case):
    q, k, v = _qkv(gen, dtype=dtype)
    kw = {"plain": {},
          "causal-mask-dropout": dict(mask=_randn(gen, 2, 1, 7, 9), causal=True, offset=2,
                                      p=0.25, seed=1234),
          "window-offset-scale": dict(window=3, offset=1, causal=True, scale=0.3)}[case]
    args = _fwd_args(q, k, v, **kw)
    grad_args = _fwd_args(*(x.detach().clone().requires_grad_(True) for x in (q, k, v)), **kw)
    torch.library.opcheck(FWD, args)
    torch.library.opcheck(FWD, grad_args)  # with the autograd registration
    out, lse = FWD(*args)
    assert out.dtype == dtype and lse.dtype == torch.float32 and lse.shape == (2, 4, 7)
    go = _randn(gen, *out.shape, dtype=dtype)
    bwd_args = (go, q, k, v, out, lse, *args[3:-1])  # the backward takes no kv_lens
    torch.library.opcheck(BWD, bwd_args)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_opcheck_rope(gen, dtype):
    x = _randn(gen, 2, 5, 3, 8, dtype=dtype)
    torch.library.opcheck(ROPE, (x, 8, 3, 10000.0))
    torch.library.opcheck(ROPE, (_randn(gen, 2, 5, 3, 8, dtype=dtype), 8, 0, 500000.0))


# --- gradients against torch SDPA --------------------------------------------------------------
CASES = {
    "plain": dict(),
    "causal": dict(causal=True),
    "causal-offset-window": dict(causal=True, causal_offset=2, window=4),
    "mask": dict(mask=(2, 1, 7, 9)),
    "mask-full-causal-scale": dict(mask=(2, 4, 7, 9), causal=True, causal_offset=2, scale=0.2),
    "scale": dict(scale=0.7),
}


@pytest.mark.parametrize("hkv", [4, 2, 1], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("case", list(CASES))
def test_gradients_match_torch_sdpa(gen, case, hkv):
    kw = dict(CASES[case])
    mask = kw.pop("mask", None)
    q, k, v = _qkv(gen, Hkv=hkv)
    if mask is not None:
        mask = _randn(gen, *mask)
    go = _randn(gen, *q.shape)
    out, grads = _grads(lambda q, k, v: ft.attention(q, k, v, attn_mask=mask, **kw), (q, k, v),
                        go)
    want, want_grads = _grads(lambda q, k, v: _sdpa(q, k, v, attn_mask=mask, **kw),
                              (q.double(), k.double(), v.double()), go.double())
    assert out.dtype == torch.float32 and out.shape == q.shape
    assert _rel(out, want) < TOL
    for name, g, w in zip("qkv", grads, want_grads):
        assert g.dtype == torch.float32 and g.shape == w.shape
        assert _rel(g, w) < TOL, f"grad_{name}"


def test_backward_takes_the_forwards_lse_and_never_recomputes_it(gen, monkeypatch):
    calls = []
    engine = ft._REFERENCE
    for name in ("plan_attention", "plan_attention_backward"):
        real = getattr(engine, name)

        def spy(*args, _real=real, _name=name, **kw):
            calls.append((_name, kw.get("lse")))
            return _real(*args, **kw)

        monkeypatch.setattr(engine, name, spy)
    q, k, v = _qkv(gen)
    _grads(lambda q, k, v: ft.attention(q, k, v, causal=True, dropout_p=0.2, seed=3), (q, k, v),
           _randn(gen, *q.shape))
    assert [n for n, _ in calls] == ["plan_attention", "plan_attention_backward"]
    fwd_lse, bwd_lse = (lse for _, lse in calls)
    assert bwd_lse.shape == (2, 4, 7) and bwd_lse.data_ptr() == fwd_lse.data_ptr()


def test_bool_mask_is_sdpa_convention(gen):
    q, k, v = _qkv(gen)
    keep = torch.rand(2, 1, 7, 9, generator=gen) > 0.3
    keep[..., 0] = True  # every row sees a key
    additive = torch.zeros(keep.shape).masked_fill(~keep, -math.inf)
    assert torch.equal(ft.attention(q, k, v, attn_mask=keep),
                       ft.attention(q, k, v, attn_mask=additive))


def test_non_contiguous_inputs(gen, monkeypatch):
    """Torch-layout [B, H, S, D] tensors passed as transposed views (read in place, through
    their strides: no copy), and a non-contiguous grad."""
    q, k, v = _qkv(gen)
    qt, kt, vt = (x.transpose(1, 2).contiguous().requires_grad_(True) for x in (q, k, v))
    planned = []
    real_plan = ft._REFERENCE.plan_attention
    monkeypatch.setattr(ft._REFERENCE, "plan_attention",
                        lambda *a, **kw: planned.append(a) or real_plan(*a, **kw))
    out = ft.attention(qt.transpose(1, 2), kt.transpose(1, 2), vt.transpose(1, 2), causal=True)
    assert [t.data_ptr() for t in planned[0][:3]] == [x.data_ptr() for x in (qt, kt, vt)]
    assert not planned[0][0].is_contiguous()  # the view itself went to the engine
    go = _randn(gen, 2, 4, 7, 16)
    out.backward(go.transpose(1, 2))
    want, grads = _grads(lambda q, k, v: ft.attention(q, k, v, causal=True), (q, k, v),
                         go.transpose(1, 2).contiguous())
    assert torch.equal(out, want)
    for x, g in zip((qt, kt, vt), grads):
        assert torch.equal(x.grad.transpose(1, 2), g)


def test_a_strided_last_dimension_is_copied_first(gen):
    """Every other element of a wider tensor: the kernels need a contiguous last dimension, so
    the op copies it (and the answer is the contiguous one's)."""
    q, k, v = _qkv(gen)
    wide = torch.zeros(q.shape[:-1] + (2 * q.shape[-1],))
    wide[..., ::2] = q
    assert torch.equal(ft.attention(wide[..., ::2], k, v), ft.attention(q, k, v))


def test_bfloat16_close_to_float32(gen):
    q, k, v = _qkv(gen)
    go = _randn(gen, *q.shape)
    out32, g32 = _grads(lambda q, k, v: ft.attention(q, k, v, causal=True), (q, k, v), go)
    out16, g16 = _grads(lambda q, k, v: ft.attention(q, k, v, causal=True),
                        [x.bfloat16() for x in (q, k, v)], go.bfloat16())
    assert out16.dtype == torch.bfloat16 and all(g.dtype == torch.bfloat16 for g in g16)
    assert _rel(out16, out32) < 2e-2
    for a, b in zip(g16, g32):
        assert _rel(a, b) < 3e-2


# --- dropout and seeds --------------------------------------------------------------------------
def test_dropout_same_seed_same_output_different_seed_differs(gen):
    q, k, v = _qkv(gen)
    a = ft.attention(q, k, v, dropout_p=0.3, seed=42)
    b = ft.attention(q, k, v, dropout_p=0.3, seed=42)
    c = ft.attention(q, k, v, dropout_p=0.3, seed=43)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    assert not torch.equal(a, ft.attention(q, k, v))
    big = ft.attention(q, k, v, dropout_p=0.3, seed=2**64 - 1)  # the engine's whole seed range
    assert torch.isfinite(big).all()


def _engine_direct(q, k, v, go, opts, mask=None):
    """The reference engine called directly on NumPy copies: (out, grad_q, grad_k, grad_v)."""
    e = ComputeEngine("reference", quiet=True)
    qn, kn, vn, gon = (x.detach().numpy().copy() for x in (q, k, v, go))
    mn = None if mask is None else mask.numpy().copy()
    out = np.empty_like(qn)
    e.flash_attention_v2_with(qn, kn, vn, out, opts, mn)
    gq, gk, gv = np.empty_like(qn), np.empty_like(kn), np.empty_like(vn)
    e.flash_attention_v2_backward_with(qn, kn, vn, out, gon, gq, gk, gv, opts, mn)
    return [torch.from_numpy(x) for x in (out, gq, gk, gv)]


def test_dropout_backward_equals_the_engine_called_directly(gen):
    q, k, v = _qkv(gen)
    mask = _randn(gen, 2, 1, 7, 9)
    go = _randn(gen, *q.shape)
    kw = dict(causal=True, causal_offset=2, dropout_p=0.25, seed=987654321)
    out, grads = _grads(lambda q, k, v: ft.attention(q, k, v, attn_mask=mask, **kw), (q, k, v),
                        go)
    opts = AttentionOptions(causal=True, causal_offset=2, dropout_prob=0.25, seed=987654321)
    want = _engine_direct(q, k, v, go, opts, mask)
    assert torch.equal(out, want[0])
    for g, w in zip(grads, want[1:]):
        assert _rel(g, w) < 1e-6


def _dropout_weights(q, k, p, seed, **kw):
    """The forward's dropped, rescaled weights P' [B, H, Sq, Sk], read off with v = one-hot keys
    (out = P' v = P' when v is the identity over keys; needs D == Sk)."""
    B, Sk, Hkv, D = k.shape
    assert D == Sk
    eye = torch.eye(Sk).reshape(1, Sk, 1, Sk).expand(B, Sk, Hkv, Sk).contiguous()
    return ft.attention(q, k, eye, dropout_p=p, seed=seed, **kw).transpose(1, 2).double()


def test_dropout_backward_equals_dense_recomputation_with_the_same_mask(gen):
    """Dense float64 attention with the dropout mask of the same seed (read off the forward)
    gives the same output and gradients as the op's backward."""
    q, k, v = _qkv(gen, Sq=6, Sk=12, D=12)
    go = _randn(gen, *q.shape)
    p, seed = 0.3, 2024
    dropped = _dropout_weights(q, k, p, seed, causal=True, causal_offset=6)
    weights = _dropout_weights(q, k, 0.0, 0, causal=True, causal_offset=6)
    keep = (dropped != 0) & (weights != 0)
    assert 0 < keep.sum() < (weights != 0).sum(), "no element was dropped, or every one was"
    scale_keep = keep.double() * float(np.float32(1) / np.float32(1 - p))  # 1/(1-p) in float32

    def dense(q, k, v):
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
        rep = qt.shape[1] // kt.shape[1]
        kt, vt = kt.repeat_interleave(rep, 1), vt.repeat_interleave(rep, 1)
        s = (qt @ kt.transpose(-1, -2)) / math.sqrt(q.shape[-1])
        s = s.masked_fill(~_visible(6, 12, True, 6, 0), -math.inf)
        return ((torch.softmax(s, -1) * scale_keep) @ vt).transpose(1, 2)

    out, grads = _grads(lambda q, k, v: ft.attention(q, k, v, causal=True, causal_offset=6,
                                                     dropout_p=p, seed=seed), (q, k, v), go)
    want, want_grads = _grads(dense, (q.double(), k.double(), v.double()), go.double())
    assert _rel(out, want) < TOL
    for name, g, w in zip("qkv", grads, want_grads):
        assert _rel(g, w) < TOL, f"grad_{name}"


def test_seed_none_draws_fresh_seeds_and_backward_reuses_its_own(gen, monkeypatch):
    q, k, v = _qkv(gen)
    go = _randn(gen, *q.shape)
    seeds = []
    real_fwd = ft._fwd_body

    def spy(*args):
        seeds.append(int(args[8]) % 2**64)
        return real_fwd(*args)

    monkeypatch.setattr(ft, "_fwd_body", spy)
    outs, grads = [], []
    for _ in range(3):
        o, g = _grads(lambda q, k, v: ft.attention(q, k, v, dropout_p=0.3), (q, k, v), go)
        outs.append(o)
        grads.append(g)
    assert len(set(seeds)) == 3, seeds
    assert not torch.equal(outs[0], outs[1]) and not torch.equal(outs[1], outs[2])
    for seed, o, g in zip(seeds, outs, grads):  # each call's backward used that call's seed
        want = _engine_direct(q, k, v, go, AttentionOptions(dropout_prob=0.3, seed=seed))
        assert torch.equal(o, want[0])
        for a, b in zip(g, want[1:]):
            assert _rel(a, b) < 1e-6
    # reproducible under torch.manual_seed
    torch.manual_seed(5)
    a = ft.attention(q, k, v, dropout_p=0.3)
    torch.manual_seed(5)
    assert torch.equal(a, ft.attention(q, k, v, dropout_p=0.3))


def test_bad_seed_is_an_error(gen):
    q, k, v = _qkv(gen)
    for seed in (-1, 2**64, 1.5, True):
        with pytest.raises(ValueError, match="seed"):
            ft.attention(q, k, v, dropout_p=0.1, seed=seed)


# --- RoPE ---------------------------------------------------------------------------------------
def test_rope_in_place_equals_the_engine(gen):
    x = _randn(gen, 2, 5, 3, 8)
    want = x.numpy().copy()
    ComputeEngine("reference", quiet=True).rope_theta(want, 8, 3, 500000.0)
    ptr = x.data_ptr()
    assert ft.rope_(x, 8, pos=3, theta=500000.0) is x
    assert x.data_ptr() == ptr and torch.equal(x, torch.from_numpy(want))


def test_rope_on_a_non_contiguous_view_writes_back(gen):
    base = _randn(gen, 2, 3, 5, 8)  # [B, H, S, D]
    want = base.transpose(1, 2).contiguous()
    ft.rope_(want, 8, 1)
    view = base.transpose(1, 2)
    ft.rope_(view, 8, 1)
    assert torch.equal(view, want) and torch.equal(base, want.transpose(1, 2))


# --- torch.compile ------------------------------------------------------------------------------
def _block(q, k, v, mask):
    q = ft.rope(q, q.shape[-1], pos=3)
    k = ft.rope(k, k.shape[-1])
    o = ft.attention(q, k, v, causal=True, causal_offset=2, attn_mask=mask, dropout_p=0.1,
                     seed=77)
    return (o * o).sum()


@pytest.mark.parametrize("backend", COMPILE_BACKENDS)
def test_torch_compile_fullgraph_equals_eager(gen, backend):
    import torch._dynamo

    torch._dynamo.reset()
    q, k, v = _qkv(gen)
    mask = _randn(gen, 2, 1, 7, 9)
    want, want_grads = _grads(lambda q, k, v: _block(q, k, v, mask), (q, k, v), torch.tensor(1.0))
    # explain(): the traced function has exactly one graph, no break
    explained = torch._dynamo.explain(_block)(q, k, v, mask)
    assert explained.graph_break_count == 0 and explained.graph_count == 1, explained
    compiled = torch.compile(_block, fullgraph=True, backend=backend)
    got, got_grads = _grads(lambda q, k, v: compiled(q, k, v, mask), (q, k, v), torch.tensor(1.0))
    assert _rel(got, want) < 1e-5
    for g, w in zip(got_grads, want_grads):
        assert _rel(g, w) < 1e-5


def test_torch_compile_with_seed_none(gen):
    """seed=None under torch.compile: the seed is drawn inside the graph (no break), fresh on each
    call, and the same as eager after the same torch.manual_seed."""
    import torch._dynamo

    torch._dynamo.reset()
    q, k, v = _qkv(gen)

    def fn(q, k, v):
        return ft.attention(q, k, v, dropout_p=0.3)

    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    a, b = compiled(q, k, v), compiled(q, k, v)
    assert not torch.equal(a, b)
    torch.manual_seed(11)
    eager = fn(q, k, v)
    torch.manual_seed(11)
    assert torch.equal(compiled(q, k, v), eager)


def test_opcheck_forward_with_kv_lens(gen):
    q, k, v = _qkv(gen)
    lens = torch.tensor([9, 4], dtype=torch.int32)
    torch.library.opcheck(FWD, _fwd_args(q, k, v, causal=True, offset=8, kv_lens=lens))


def test_kv_lens_is_each_sequence_on_its_own_and_has_no_backward(gen):
    """kv_lens[b] = n: sequence b attends to its first n keys (NaN past them is never read),
    its queries n - Sk positions earlier; the backward refuses it."""
    q, k, v = _qkv(gen)  # [2, 7, 4, 16] over [2, 9, 2, 16]
    k, v = k.clone(), v.clone()
    lens = torch.tensor([9, 4], dtype=torch.int32)
    k[1, 4:], v[1, 4:] = float("nan"), float("nan")
    out = ft.attention(q, k, v, causal=True, causal_offset=2, kv_lens=lens)
    assert torch.isfinite(out).all()
    for b, n in enumerate(lens.tolist()):
        alone = ft.attention(q[b:b + 1], k[b:b + 1, :n], v[b:b + 1, :n], causal=True,
                             causal_offset=2 + n - 9) if n >= 7 - 2 else None
        if alone is not None:
            torch.testing.assert_close(out[b:b + 1], alone, rtol=0, atol=0)
    qg = q.detach().clone().requires_grad_(True)
    with pytest.raises(ValueError, match="no backward with kv_lens"):
        ft.attention(qg, k, v, causal=True, causal_offset=2, kv_lens=lens)
    with torch.no_grad():  # inference: fine, also compiled
        got = torch.compile(lambda *a: ft.attention(*a, causal=True, causal_offset=2,
                                                    kv_lens=lens), fullgraph=True,
                            backend="aot_eager")(qg, k, v)
    torch.testing.assert_close(got, out, rtol=0, atol=0)


class _CudaRecorder:
    """A CUDA backend stand-in on host memory: plans are strings, runs are recorded."""

    name, device, generation = "cuda", "cpu", 0
    dtypes = ComputeEngine("reference", quiet=True).backend.dtypes

    def __init__(self, counted=True):
        self.plans, self.launches, self.seeds, self.counted = [], [], [], counted

    def plan(self, op, buffers, params, layout, ptrs, extras=None):
        self.plans.append((op, {n: b and b.dtype for n, b in buffers.items()}))
        plan = type("Plan", (str,), {"counted": self.counted})(op)
        return plan

    @staticmethod
    def alignment(ptrs):
        return 0

    def read_int32(self, ptr, n, stream):  # "device" memory is host memory here
        return np.ctypeslib.as_array((ctypes.c_int32 * n).from_address(ptr)).copy()

    def run_plan(self, plan, ptrs, stream, alloc, counter=None, seed=None):
        work = alloc((3, 2))
        self.launches.append((plan, dict(ptrs), stream, work.dtype, tuple(work.shape), counter))
        self.seeds.append(seed)


def test_cuda_tensors_run_a_kept_plan_from_their_addresses(gen, monkeypatch):
    """`_run_cuda` on CPU tensors: the engine plans a call shape once (every check), and
    each call runs it from the tensors' addresses on torch's stream with workspace from torch's
    allocator; kv_lens' values are checked on every call. (The GPU runs it for real.)"""
    engine = ComputeEngine("reference", quiet=True)
    engine.backend = rec = _CudaRecorder()
    monkeypatch.setattr(ft, "_engine", lambda device: engine)
    monkeypatch.setattr(ft, "_stream", lambda device: 77)

    def run(named, capturing=False):
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing)
        plan = engine.plan_attention(*(named[n] for n in ("q", "k", "v", "out")), opts,
                                     named["mask"], lse=named["lse"], kv_lens=named["kv_lens"])
        ft._run_cuda(plan, {n: t.data_ptr() for n, t in named.items() if t is not None},
                     torch.device("cpu"))
        return plan

    opts = AttentionOptions(causal=True, causal_offset=8)
    plans = []
    for _ in range(2):
        q, k, v = _qkv(gen, B=2, Sq=1, Sk=9)
        out, lse = torch.empty_like(q), torch.empty(2, 4, 1)
        lens = torch.tensor([9, 4], dtype=torch.int32)
        named = {"q": q, "k": k, "v": v, "out": out, "mask": None, "lse": lse, "kv_lens": lens}
        plans.append(run(named))
        plan, ptrs, stream, wdtype, wshape, counter = rec.launches[-1]
        assert plan == "forward" and counter is None  # not capturing: the stream's counter
        assert ptrs["q"] == q.data_ptr() and ptrs["out"] == out.data_ptr()
        assert ptrs.get("mask", 0) == 0 and ptrs["lse"] == lse.data_ptr() and stream == 77
        assert wdtype == torch.float32 and wshape == (3, 2)
    assert plans[0] is plans[1]  # one plan for the call shape, kept by the engine
    assert rec.plans == [("forward", {"q": np.float32, "k": np.float32, "v": np.float32,
                                      "out": np.float32, "mask": None, "lse": np.float32,
                                      "kv_lens": np.int32, "alibi_slopes": None,
                                      "sinks": None, "cu_seqlens_q": None, "cu_seqlens_k": None,
                                      "block_table": None, "k_new": None, "v_new": None,
                                      "rotary_cos": None, "rotary_sin": None})]
    # Captured in a CUDA graph, the launch gets a zeroed counter of its own (made in the graph).
    run(named, capturing=True)
    counter = rec.launches.pop()[-1]
    assert counter.dtype == torch.float32 and counter.tolist() == [0]
    lens[1] = 10
    with pytest.raises(ValueError, match=r"kv_lens\[1\] = 10 is outside \[0, seq_k = 9\]"):
        run(named)
    assert len(rec.launches) == 2
    with pytest.raises(ValueError, match="lse .* shares memory with q"):  # checked every call
        run(dict(named, lse=q.view(-1)[:8].view(2, 4, 1)))
    assert len(rec.launches) == 2


def test_dropout_with_a_fresh_seed_each_step_plans_once(gen, monkeypatch):
    """A training step draws a new dropout seed every time: its calls reuse one backend plan
    (the checks and launches of the call shape), each run carrying its own seed."""
    engine = ComputeEngine("reference", quiet=True)
    engine.backend = rec = _CudaRecorder()
    monkeypatch.setattr(ft, "_engine", lambda device: engine)
    monkeypatch.setattr(ft, "_stream", lambda device: 77)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    q, k, v = _qkv(gen, B=1, Sq=4, Sk=6)
    seeds = []
    for step in range(4):
        torch.manual_seed(step)
        seeds.append(ft._seed_int(ft._seed_tensor(None, 0.2)))
        torch.manual_seed(step)
        ft._forward_now(q, k, v, None, True, 2, 0, 0.2, None, None, None)
    assert len(set(seeds)) == 4 and len(rec.plans) == 1
    assert rec.seeds == [s & 0xFFFFFFFF for s in seeds]


def test_eager_inference_runs_the_ops_body_without_the_op(gen, monkeypatch):
    """An eager CUDA call that needs no gradient skips the custom op (its dispatch costs more
    than a decode step's kernel) but not the checks: `_forward_now` plans with a fresh `out`, no
    lse, and the op's seed. Everything else takes the op."""
    calls = []
    monkeypatch.setattr(ft, "_run_cuda", lambda plan, pointers, device, fresh: calls.append(
        (plan, set(pointers), fresh)))
    q, k, v = _qkv(gen, B=1, Sq=2, Sk=5)
    out = ft._forward_now(q, k, v, None, True, 3, 0, 0.0, None, None, None)
    assert out.shape == q.shape and out.dtype == q.dtype
    plan, present, fresh = calls[-1]
    assert plan.op == "forward" and fresh == ("out",)
    assert present == {"q", "k", "v", "out"}  # (no mask, no kv_lens)
    assert plan.specs["lse"] is None
    assert plan.options == AttentionOptions(causal=True, causal_offset=3)
    torch.manual_seed(5)
    ft._forward_now(q, k, v, None, False, 0, 0, 0.25, None, None, None)
    torch.manual_seed(5)
    assert calls[-1][0].options.seed == ft._seed_int(ft._seed_tensor(None, 0.25))  # the op's draw
    # CPU tensors, and any call that needs a gradient, take the op
    assert not ft._eager_inference(q, k, v, None, None)


def test_eager_gradients_skip_the_ops_and_equal_them(gen, monkeypatch):
    """An eager call that needs a gradient runs the ops' bodies through an autograd.Function
    (a custom op with autograd costs ~100 us a call more); forward and gradients equal the ops'
    bit for bit, and the forward is still never recomputed."""
    q, k, v = _qkv(gen)
    go = _randn(gen, *q.shape)
    kw = dict(causal=True, causal_offset=2, dropout_p=0.2, seed=11)
    used = []
    for name in ("_attention_fwd", "_attention_bwd"):
        real = getattr(ft, name)
        monkeypatch.setattr(ft, name, lambda *a, _r=real, _n=name: used.append(_n) or _r(*a))
    eager = _grads(lambda q, k, v: ft.attention(q, k, v, **kw), (q, k, v), go)
    assert used == []  # the ops were not called
    seed = ft._seed_tensor(11, 0.2)

    def through_ops(q, k, v):
        return ft._attention_fwd(q, k, v, None, True, 2, 0, 0.2, seed, None, None)[0]

    ops = _grads(through_ops, (q, k, v), go)
    assert used == ["_attention_fwd", "_attention_bwd"]
    assert torch.equal(eager[0], ops[0])
    for a, b in zip(eager[1], ops[1]):
        assert torch.equal(a, b)


def test_no_double_backward_in_eager_or_through_the_ops(gen):
    """A gradient of a gradient is an error on both paths, never a silently dropped term."""
    q, k, v = (x.requires_grad_() for x in _qkv(gen))
    (g,) = torch.autograd.grad(ft.attention(q, k, v).square().sum(), q, create_graph=True)
    with pytest.raises(RuntimeError):
        (g.square().sum() + q.sum()).backward()
    seed = ft._seed_tensor(0, 0.0)
    out = ft._attention_fwd(q, k, v, None, False, 0, 0, 0.0, seed, None, None)[0]
    (g,) = torch.autograd.grad(out.square().sum(), q, create_graph=True)
    with pytest.raises(RuntimeError):
        (g.square().sum() + q.sum()).backward()


def test_a_devices_engine_is_looked_up_once(monkeypatch):
    """CPU tensors get the reference engine; a device with its index (every tensor's) finds its
    engine once, one without (torch.device("cuda"): whichever GPU is current) each time; any
    other kind of device is refused by name."""
    assert ft._engine(torch.device("cpu")) is ft._REFERENCE
    with pytest.raises(ValueError, match="not meta"):
        ft._engine(torch.device("meta"))
    asked = []
    monkeypatch.setattr(ft, "_engine_of", lambda device: asked.append(device) or "engine")
    monkeypatch.setattr(ft, "_BY_DEVICE", {})
    for name in ("cuda:1", "cuda:1", "cuda", "cuda"):
        assert ft._engine(torch.device(name)) == "engine"
    assert asked == [torch.device(n) for n in ("cuda:1", "cuda", "cuda")]


@pytest.mark.parametrize("dropout_p", [0.0, 0.2])
def test_a_compiled_call_makes_a_cpu_seed_only_for_dropout(gen, dropout_p):
    """torch.compile(mode="reduce-overhead") (CUDA graph trees; transformers' static-cache
    generate) refuses a CPU tensor as an input of a captured partition ("storage data ptrs are
    not allocated in pool", on the H100 for every such call while the ops always took an int64
    CPU seed). A call without dropout passes the ops no seed, so its graph makes no tensor but
    the op's outputs; one with dropout still draws its seed on the CPU (traced, no graph break)."""
    q, k, v = _qkv(gen)
    graphs = []

    def backend(gm, inputs):
        graphs.append(gm)
        return gm

    f = torch.compile(lambda q, k, v: ft.attention(q, k, v, causal=True, dropout_p=dropout_p),
                      backend=backend, fullgraph=True)
    with torch.no_grad():
        f(q, k, v)
    (gm,) = graphs
    made = [n.target for n in gm.graph.nodes if n.op == "call_function"
            and n.target in (torch.zeros, torch.tensor, torch.randint, torch.empty)]
    assert made == ([] if not dropout_p else [torch.randint]), gm.code
