"""The CUDA engine against PyTorch's `scaled_dot_product_attention`, and zero-copy interop.

At B=2, S=2048, H=16, Hkv=4, D=128 in float32, forward and backward (autograd) are compared with
torch computed in float64 on the GPU (the math SDPA path), causal and not. Torch tensors are
shared with the engine through DLPack (`UnifiedTensor(torch_tensor)`), so outputs land in torch's
memory in place. Skipped without a GPU or without PyTorch built with CUDA.
"""

from __future__ import annotations

import numpy as np
import pytest

from ferrocupy import AttentionOptions, UnifiedTensor

# gpu_helpers is in tests/, which conftest puts on sys.path.
from gpu_helpers import BWD_TOL, FWD_TOL, dev, gpu_pytestmark, needs_real_gpu

__all__ = ["dev"]  # fixture, imported for pytest

pytestmark = gpu_pytestmark()

B, S, H, HKV, D = 2, 2048, 16, 4, 128


@pytest.fixture(scope="module")
def torch():
    needs_real_gpu()
    torch = pytest.importorskip("torch", reason="PyTorch is not installed")
    if not torch.cuda.is_available():
        pytest.skip("PyTorch has no CUDA device")
    return torch


def _scale() -> float:
    return float(np.float32(1.0) / np.sqrt(np.float32(D)))  # the engine's float32 scale


def _sdpa(torch, q, k, v, causal):
    """torch SDPA on [B, S, H, D] tensors (transposed to torch's [B, H, S, D] and back)."""
    import torch.nn.functional as F

    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    try:
        o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, scale=_scale(),
                                           enable_gqa=True)
    except TypeError:  # torch < 2.5: no enable_gqa; expand the KV heads by hand
        rep = qt.shape[1] // kt.shape[1]
        o = F.scaled_dot_product_attention(qt, kt.repeat_interleave(rep, 1),
                                           vt.repeat_interleave(rep, 1), is_causal=causal,
                                           scale=_scale())
    return o.transpose(1, 2)


def _inputs(torch, rng):
    g = torch.Generator(device="cuda").manual_seed(int(rng.integers(2**62)))
    q = torch.randn(B, S, H, D, device="cuda", generator=g) * 1.5
    k = torch.randn(B, S, HKV, D, device="cuda", generator=g) * 1.5
    v = torch.randn(B, S, HKV, D, device="cuda", generator=g)
    go = torch.randn(B, S, H, D, device="cuda", generator=g)
    return q, k, v, go


def _nan_like(torch, x):
    return torch.full_like(x, float("nan"))


def _rel(torch, got, want) -> float:
    assert not torch.isnan(got).any(), "NaN in the engine's output"
    got, want = got.double(), want.double()
    return float(torch.linalg.vector_norm(got - want) / torch.linalg.vector_norm(want))


def _sync(torch, dev):
    torch.cuda.synchronize()
    dev.sync()


def _forward(torch, dev, q, k, v, causal):
    """The engine's forward into a NaN-filled torch tensor (shared through DLPack)."""
    out = _nan_like(torch, q)
    _sync(torch, dev)
    dev.engine.flash_attention_v2_with(UnifiedTensor(q), UnifiedTensor(k), UnifiedTensor(v),
                                       UnifiedTensor(out), AttentionOptions(causal=causal))
    _sync(torch, dev)
    return out


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_forward_against_torch_sdpa(torch, dev, rng, causal):
    q, k, v, _ = _inputs(torch, rng)
    out = _forward(torch, dev, q, k, v, causal)
    with torch.no_grad():
        want = _sdpa(torch, q.double(), k.double(), v.double(), causal)
    err = _rel(torch, out, want)
    assert err < FWD_TOL, f"forward vs torch float64 SDPA: relative error {err:.3e}"


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_backward_against_torch_autograd(torch, dev, rng, causal):
    q, k, v, go = _inputs(torch, rng)
    out = _forward(torch, dev, q, k, v, causal)
    gq, gk, gv = _nan_like(torch, q), _nan_like(torch, k), _nan_like(torch, v)
    dev.engine.flash_attention_v2_backward_with(
        *(UnifiedTensor(x) for x in (q, k, v, out, go, gq, gk, gv)),
        AttentionOptions(causal=causal))
    _sync(torch, dev)
    q64, k64, v64 = (x.double().requires_grad_() for x in (q, k, v))
    _sdpa(torch, q64, k64, v64, causal).backward(go.double())
    for name, got, want in (("grad_q", gq, q64.grad), ("grad_k", gk, k64.grad),
                            ("grad_v", gv, v64.grad)):
        err = _rel(torch, got, want)
        assert err < BWD_TOL, f"{name} vs torch float64 autograd: relative error {err:.3e}"


def test_torch_out_receives_the_result_in_place(torch, dev, rng):
    """A torch CUDA tensor wrapped with UnifiedTensor is written in place (no copy), and holds
    the same bits as a CuPy-allocated output of the same call."""
    g = torch.Generator(device="cuda").manual_seed(int(rng.integers(2**62)))
    q = torch.randn(2, 130, 8, 64, device="cuda", generator=g)
    k = torch.randn(2, 131, 2, 64, device="cuda", generator=g)
    v = torch.randn(2, 131, 2, 64, device="cuda", generator=g)
    out = _nan_like(torch, q)
    ptr = out.data_ptr()
    wrapped = UnifiedTensor(out)
    assert wrapped.buffer().data.ptr == ptr, "UnifiedTensor(torch tensor) copied the data"
    opts = AttentionOptions(causal=True, dropout_prob=0.2, seed=7)
    _sync(torch, dev)
    dev.engine.flash_attention_v2_with(UnifiedTensor(q), UnifiedTensor(k), UnifiedTensor(v),
                                       wrapped, opts)
    cp_out = dev.poisoned(tuple(q.shape))
    dev.engine.flash_attention_v2_with(UnifiedTensor(q), UnifiedTensor(k), UnifiedTensor(v),
                                       cp_out, opts)
    _sync(torch, dev)
    assert out.data_ptr() == ptr
    assert not torch.isnan(out).any(), "the torch output was not (fully) written"
    np.testing.assert_array_equal(out.cpu().numpy(), dev.get(cp_out))


def test_torch_rope_in_place(torch, dev, rng):
    g = torch.Generator(device="cuda").manual_seed(int(rng.integers(2**62)))
    x = torch.randn(2, 64, 4, 64, device="cuda", generator=g)
    want = UnifiedTensor.from_numpy(x.cpu().numpy(), device="cuda")
    _sync(torch, dev)
    dev.engine.rope(UnifiedTensor(x), 64, 3)
    dev.engine.rope(want, 64, 3)
    _sync(torch, dev)
    np.testing.assert_array_equal(x.cpu().numpy(), dev.get(want))


def test_torch_sdpa_layout_is_read_in_place(torch, dev, rng):
    """Torch's [B, H, S, D] transposed to [B, S, H, D] is a strided view: the engine reads it
    through its strides (no copy) and writes a transposed output view in place, equal to the
    contiguous call; a view whose last dimension is strided stays an error, nothing written."""
    g = torch.Generator(device="cuda").manual_seed(int(rng.integers(2**62)))
    q = torch.randn(2, 8, 33, 64, device="cuda", generator=g).transpose(1, 2)
    k = torch.randn(2, 8, 33, 64, device="cuda", generator=g).transpose(1, 2)
    out = torch.full((2, 8, 33, 64), float("nan"), device="cuda").transpose(1, 2)
    dev.engine.flash_attention_v2_with(UnifiedTensor(q), UnifiedTensor(k), UnifiedTensor(k),
                                       UnifiedTensor(out))
    want = torch.full((2, 33, 8, 64), float("nan"), device="cuda")
    dev.engine.flash_attention_v2_with(*(UnifiedTensor(x.contiguous()) for x in (q, k, k)),
                                       UnifiedTensor(want))
    torch.cuda.synchronize()
    assert torch.equal(out, want)
    bad = torch.full((2, 33, 8, 128), 7.0, device="cuda")[..., ::2]
    with pytest.raises(ValueError, match="contiguous last dimension"):
        dev.engine.flash_attention_v2_with(UnifiedTensor(q), UnifiedTensor(k), UnifiedTensor(k),
                                           UnifiedTensor(bad))
    torch.cuda.synchronize()
    assert bool((bad == 7.0).all())


# --- ferrocupy.torch on CUDA: the launch plans, streams, torch.compile, CUDA graphs ---------------

def _ft_case(torch, seed, dtype="bfloat16", b=2, sq=1, sk=700, h=8, hkv=2, d=128):
    g = torch.Generator(device="cuda").manual_seed(seed)
    dt = getattr(torch, dtype)
    q = torch.randn(b, sq, h, d, device="cuda", generator=g).to(dt)
    k = torch.randn(b, sk, hkv, d, device="cuda", generator=g).to(dt)
    v = torch.randn(b, sk, hkv, d, device="cuda", generator=g).to(dt)
    return q, k, v


def _want(torch, q, k, v, causal=False):
    rep = q.shape[2] // k.shape[2]
    qt, kt, vt = (x.double().transpose(1, 2) for x in (q, k, v))
    kt, vt = kt.repeat_interleave(rep, 1), vt.repeat_interleave(rep, 1)
    import torch.nn.functional as F

    return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal).transpose(1, 2)


@pytest.mark.parametrize("shape", [dict(sq=1, sk=700), dict(sq=300, sk=300)],
                         ids=["decode", "forward"])
def test_torch_op_reuses_its_plan_with_new_tensors(torch, shape):
    """Second and third calls of one shape take the cached plan with other tensors' addresses:
    each answer is its own inputs'."""
    import ferrocupy.torch as ft

    for seed in (1, 2, 3):
        q, k, v = _ft_case(torch, seed, **shape)
        out = ft.attention(q, k, v)
        torch.cuda.synchronize()
        err = _rel(torch, out, _want(torch, q, k, v))
        assert err < 2e-2, f"call {seed}: relative error {err:.3e}"


def test_torch_op_on_a_side_stream_equals_the_default_stream(torch):
    import ferrocupy.torch as ft

    q, k, v = _ft_case(torch, 4, sq=64, sk=640)
    want = ft.attention(q, k, v, causal=True, causal_offset=576)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        got = ft.attention(q, k, v, causal=True, causal_offset=576)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    assert torch.equal(got, want)


def test_torch_compile_fullgraph_on_cuda(torch):
    import ferrocupy.torch as ft

    q, k, v = _ft_case(torch, 5, sq=128, sk=128)
    q, k, v = (x.requires_grad_() for x in (q, k, v))

    def f(q, k, v):
        return ft.attention(q, k, v, causal=True).float().square().sum()

    eager = torch.autograd.grad(f(q, k, v), (q, k, v))
    compiled = torch.compile(f, fullgraph=True)
    got = torch.autograd.grad(compiled(q, k, v), (q, k, v))
    for a, b in zip(got, eager):
        assert torch.equal(a, b)


@pytest.mark.parametrize("grad", [False, True], ids=["inference", "training"])
def test_torch_compile_reduce_overhead_on_cuda(torch, grad):
    """torch.compile(mode="reduce-overhead"): CUDA graph trees capture the ops (as transformers'
    static-cache generate does). Each replay, on new values copied into the same tensors, equals
    the eager call bit for bit, and its gradients too."""
    import ferrocupy.torch as ft

    q, k, v = _ft_case(torch, 9, sq=64, sk=80)
    q, k, v = (x.requires_grad_(grad) for x in (q, k, v))

    def f(q, k, v):
        return ft.attention(q, k, v, causal=True, causal_offset=16)

    compiled = torch.compile(f, mode="reduce-overhead")
    go = torch.randn_like(q)
    for step in range(4):  # warm-up, record, replays
        with torch.no_grad():
            for x in (q, k, v):
                x.copy_(torch.randn_like(x))
        if grad:
            got = torch.autograd.grad(compiled(q, k, v), (q, k, v), go)
            want = torch.autograd.grad(f(q, k, v), (q, k, v), go)
        else:
            with torch.no_grad():
                got, want = (compiled(q, k, v),), (f(q, k, v),)
        for a, b in zip(got, want):
            assert torch.equal(a, b), f"step {step}"


def test_cuda_graph_capture_and_replay_equals_eager(torch):
    """A decode step captured in a CUDA graph (after a warm-up call made the plan), replayed on
    new inputs copied into the captured tensors."""
    import ferrocupy.torch as ft

    q, k, v = _ft_case(torch, 6, sq=1, sk=4000)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        ft.attention(q, k, v)  # warm-up: compile, plan, workspace
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ft.attention(q, k, v)
    for seed in (7, 8):
        nq, nk, nv = _ft_case(torch, seed, sq=1, sk=4000)
        q.copy_(nq), k.copy_(nk), v.copy_(nv)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, ft.attention(nq, nk, nv))


def test_cuda_graph_of_the_persistent_forward_replays(torch):
    """The persistent forward (more query tiles than SMs, causal) captured on a side stream and
    replayed: its blocks claim tiles from that stream's counter, which each launch leaves at 0,
    so every replay writes every tile, as eager does."""
    import ferrocupy.torch as ft

    q, k, v = _ft_case(torch, 10, b=3, sq=830, sk=830, h=24, hkv=6, d=64)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        ft.attention(q, k, v, causal=True)  # warm-up: compile, plan
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ft.attention(q, k, v, causal=True)
    for seed in (11, 12, 13):
        nq, nk, nv = _ft_case(torch, seed, b=3, sq=830, sk=830, h=24, hkv=6, d=64)
        q.copy_(nq), k.copy_(nk), v.copy_(nv)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, ft.attention(nq, nk, nv, causal=True)), f"replay {seed}"


def test_torch_kv_lens_values_are_checked_on_every_call(torch):
    import ferrocupy.torch as ft

    q, k, v = _ft_case(torch, 9, sq=1, sk=500)
    lens = torch.tensor([500, 123], dtype=torch.int32, device="cuda")
    with torch.no_grad():
        ft.attention(q, k, v, kv_lens=lens)
        lens[1] = 501
        with pytest.raises(ValueError, match=r"kv_lens\[1\] = 501"):
            ft.attention(q, k, v, kv_lens=lens)


@pytest.mark.parametrize("shape", [dict(sq=1, sk=3000), dict(sq=200, sk=200)],
                         ids=["decode", "forward"])
def test_eager_inference_path_equals_the_op(torch, shape, monkeypatch):
    """Inputs that need no gradient skip the custom op (`_forward_now`); the answer is the op's
    (called directly), bit for bit, with and without dropout (the same seed drawn from torch's
    generator)."""
    import ferrocupy.torch as ft

    q, k, v = _ft_case(torch, 10, **shape)
    taken = []
    real = ft._forward_now
    monkeypatch.setattr(ft, "_forward_now", lambda *a: taken.append(1) or real(*a))
    offset = shape["sk"] - shape["sq"]
    for causal, p in ((True, 0.0), (False, 0.2)):
        kw = dict(causal=causal, causal_offset=offset if causal else 0, dropout_p=p)
        torch.manual_seed(3)
        fast = ft.attention(q, k, v, **kw)
        torch.manual_seed(3)  # the op, called as torch.compile would: the same seed drawn
        seed = ft._seed_tensor(None, p)
        with torch.enable_grad():
            op = ft._attention_fwd(q.clone().requires_grad_(), k, v, None, causal,
                                   kw["causal_offset"], 0, p, seed, None, None)[0].detach()
        torch.cuda.synchronize()
        assert torch.equal(fast, op), kw
    assert len(taken) == 2


@pytest.mark.parametrize("shape", [dict(sq=1, sk=3000), dict(sq=200, sk=200)],
                         ids=["decode", "forward"])
def test_torch_op_reads_sdpa_layout_views_in_place(torch, shape):
    """q, k, v as `x.transpose(1, 2)` of SDPA's [B, H, S, D] tensors (and a transposed
    grad_out): the op reads them through their strides, and out and the gradients equal the
    contiguous call's bit for bit (16-byte aligned rows: the same kernels)."""
    import ferrocupy.torch as ft

    q, k, v = _ft_case(torch, 12, **shape)
    views = [x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v)]
    # (q's view is "contiguous" to torch at Sq 1, a size-1 dimension's stride not counting; k's
    # never is)
    assert not views[1].is_contiguous() and torch.equal(views[1], k)
    go = torch.randn_like(q).transpose(1, 2).contiguous().transpose(1, 2)
    results = []
    for inputs in (views, [q, k, v]):
        inputs = [x.detach().clone() if x.is_contiguous() else x.detach() for x in inputs]
        for x in inputs:
            x.requires_grad_()
        out = ft.attention(*inputs, causal=True, causal_offset=shape["sk"] - shape["sq"])
        out.backward(go)
        results.append([out.detach()] + [x.grad for x in inputs])
    torch.cuda.synchronize()
    for a, b in zip(*results):
        assert torch.equal(a, b)
    with torch.no_grad():  # the eager inference path too
        assert torch.equal(ft.attention(*views), ft.attention(q, k, v))
