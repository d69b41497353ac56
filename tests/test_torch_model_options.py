"""ferrocupy.torch.attention's SPEC part 2 keywords (softcap, window_left, window_right,
alibi_slopes, sinks, negative causal_offset) on CPU tensors: forward and gradients (sinks'
included) against autograd through the dense float64 oracle of tests/dense_options.py, eager
and under torch.compile; opcheck of the ops with them; the CUDA backend's refusal through the
torch path."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import ferrocupy.torch as ft  # noqa: E402
from dense_options import dense  # noqa: E402
from ferrocupy import ComputeEngine  # noqa: E402

FWD = torch.ops.ferrocupy.attention_fwd.default
BWD = torch.ops.ferrocupy.attention_bwd.default
TOL = 5e-5


@pytest.fixture
def gen(rng):
    return torch.Generator().manual_seed(int(rng.integers(2**62)))


def _inputs(gen, B=2, Sq=6, Sk=5, H=4, Hkv=2, D=8, alibi="bh"):
    q = torch.randn(B, Sq, H, D, generator=gen)
    k = torch.randn(B, Sk, Hkv, D, generator=gen)
    v = torch.randn(B, Sk, Hkv, D, generator=gen)
    slopes = torch.rand((B, H) if alibi == "bh" else (H,), generator=gen) * 0.5
    sinks = torch.randn(H, generator=gen) * 2
    return q, k, v, slopes, sinks


KW = {
    "everything": dict(causal=True, causal_offset=-1, window_left=3, window_right=1, softcap=2.0),
    "bottom-right": dict(causal=True, causal_offset=5 - 6, softcap=0.5),
    "window-left-only": dict(window_left=1),
    "plain": dict(),
}


def _oracle(q, k, v, slopes, sinks, kw):
    return dense(q, k, v, causal=kw.get("causal", False),
                 causal_offset=kw.get("causal_offset", 0),
                 window_left=-1 if kw.get("window_left") is None else kw["window_left"],
                 window_right=-1 if kw.get("window_right") is None else kw["window_right"],
                 softcap=kw.get("softcap", 0.0), alibi_slopes=slopes, sinks=sinks)[0]


def _grads(fn, leaves, go):
    leaves = [x.detach().clone().requires_grad_(True) for x in leaves]
    out = fn(*leaves)
    out.backward(go)
    return out.detach().double(), [x.grad.double() for x in leaves]


def _assert_close(got, want, what):
    assert torch.isfinite(got).all(), what
    err = float((got - want).abs().max() / max(float(want.abs().max()), 1.0))
    assert err <= TOL, f"{what}: {err:.2e}"


@pytest.mark.parametrize("name", list(KW))
@pytest.mark.parametrize("alibi", ["h", "bh", None])
@pytest.mark.parametrize("compiled", [False, True])
def test_keywords_against_the_dense_oracle(gen, name, alibi, compiled):
    kw = KW[name]
    q, k, v, slopes, sinks = _inputs(gen, alibi=alibi or "h")
    slopes = slopes if alibi else None
    go = torch.randn(q.shape, generator=gen)

    def call(q, k, v, sinks):
        return ft.attention(q, k, v, alibi_slopes=slopes, sinks=sinks, **kw)

    if compiled:
        torch.compiler.reset()  # each case is a new graph of one function: no recompile limit
    fn = torch.compile(call, fullgraph=True, backend="aot_eager") if compiled else call
    out, grads = _grads(fn, (q, k, v, sinks), go)
    want, want_grads = _grads(lambda q, k, v, s: _oracle(q, k, v, slopes, s, kw),
                              (q.double(), k.double(), v.double(), sinks.double()), go.double())
    _assert_close(out, want, "out")
    for name_, g, w in zip(("grad_q", "grad_k", "grad_v", "grad_sinks"), grads, want_grads):
        _assert_close(g, w, name_)


def test_sinks_without_grad_and_inputs_without(gen):
    """sinks that need no gradient, and q, k, v that do (and the other way round)."""
    q, k, v, slopes, sinks = _inputs(gen)
    qg = q.clone().requires_grad_(True)
    ft.attention(qg, k, v, sinks=sinks).sum().backward()
    assert qg.grad is not None and sinks.grad is None
    sg = sinks.clone().requires_grad_(True)
    ft.attention(q, k, v, sinks=sg, causal=True, causal_offset=-2).sum().backward()
    s64 = sinks.double().requires_grad_(True)
    dense(q, k, v, sinks=s64, causal=True, causal_offset=-2)[0].sum().backward()
    assert sg.grad.shape == (4,)
    _assert_close(sg.grad.double(), s64.grad, "grad_sinks")


@pytest.mark.parametrize("with_sinks", [False, True])
def test_opcheck_with_the_new_arguments(gen, with_sinks):
    q, k, v, slopes, sinks = _inputs(gen)
    seed = torch.tensor(0, dtype=torch.int64)
    s = sinks if with_sinks else None
    args = (q, k, v, None, True, -1, 0, 0.0, seed, None, None, 2, 1, 1.5, slopes, s)
    torch.library.opcheck(FWD, args)
    grad_args = tuple(x.clone().requires_grad_(True) for x in (q, k, v)) + args[3:15] + (
        None if s is None else s.clone().requires_grad_(True),)
    torch.library.opcheck(FWD, grad_args)
    out, lse = FWD(*args)
    go = torch.randn(out.shape, generator=gen)
    bwd = (go, q, k, v, out, lse, *args[3:10], 2, 1, 1.5, slopes, s)
    torch.library.opcheck(BWD, bwd)
    gs = BWD(*bwd)[3]
    assert gs.shape == ((4,) if with_sinks else (0,)) and gs.dtype == torch.float32


def test_cuda_backend_refuses_the_keywords_through_torch(gen, monkeypatch):
    """A stand-in CUDA backend (host memory): what the kernels don't take (head_dim > 256) is
    refused when the plan is made, before anything runs, whatever keywords come with it (a
    window side and a negative offset, which the kernels take)."""

    class _CudaRecorder:
        name, device, generation = "cuda", "cpu", 0
        dtypes = ComputeEngine("reference", quiet=True).backend.dtypes
        plans: list = []

        def plan(self, *args):
            self.plans.append(args)
            raise AssertionError("a refused call reached the backend")

    engine = ComputeEngine("reference", quiet=True)
    engine.backend = _CudaRecorder()
    monkeypatch.setattr(ft, "_engine", lambda device: engine)
    q, k, v, *_ = _inputs(gen, alibi="h", D=257)
    for kw in (dict(window_left=2), dict(causal=True, causal_offset=-1)):
        with pytest.raises(ValueError, match=r"head_dim <= 256, got 257"):
            ft.attention(q, k, v, **kw)
    assert engine.backend.plans == []
