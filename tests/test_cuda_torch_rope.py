"""`ferrocupy.torch.rope` and `rope_` on CUDA tensors (the kernel, on torch's current stream):
values and gradients against autograd through plain-PyTorch RoPE (tests/torch_rope_formulas.py)
in every dtype and option, views of a fused projection, a side stream, a CUDA graph, opcheck,
torch.compile, and issue 27's regression. Skipped without a GPU or without PyTorch built with
CUDA (the CPU path: tests/test_torch_rope.py)."""

from __future__ import annotations

import numpy as np
import pytest

from gpu_helpers import axis, covering, gpu_pytestmark
from rope_formula import POSITION_KINDS, option_params
from test_cuda_torch import torch  # noqa: F401 - the fixture: torch with a CUDA device

pytestmark = gpu_pytestmark()

DTYPES = ["float32", "float16", "bfloat16"]
OPTIONS = option_params(128, inverse=False)  # the inverse is the gradient
B, S, H, D = 2, 65, 4, 128


@pytest.fixture
def gen(torch, rng):
    return torch.Generator().manual_seed(int(rng.integers(2**62)))


def on_cuda(x):
    return None if x is None else x.cuda()


@pytest.mark.parametrize("layout,kind,kw,dtype", covering({
    "layout": axis(["B,S,H,D", "B,S,H*D", "S,H*D"]),
    "kind": axis(POSITION_KINDS),
    "kw": axis(OPTIONS),
    "dtype": axis(DTYPES),
}))
def test_values_and_gradients(torch, gen, rng, dtype, kw, kind, layout):
    from test_torch_rope import check, positions_like, randn

    b = 1 if layout == "S,H*D" else B
    shape = {"B,S,H,D": (b, S, H, D), "B,S,H*D": (b, S, H * D), "S,H*D": (S, H * D)}[layout]
    pos, positions = positions_like(rng, kind, b, S)
    x = on_cuda(randn(gen, *shape, dtype=getattr(torch, dtype)) * 2)
    check(gen, x, D, pos, on_cuda(positions), 500000.0, **kw)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inverse", [False, True], ids=["forward", "inverse"])
def test_cuda_equals_the_cpu_reference(torch, gen, rng, dtype, inverse):
    """The kernel and the reference backend agree (float32: to rounding; half: one ulp)."""
    from test_torch_rope import assert_close, positions_like, randn

    x = randn(gen, B, S, H, D, dtype=getattr(torch, dtype))
    _, positions = positions_like(rng, "BS-int64", B, S)
    rope = torch.ops.ferrocupy.rope
    want = rope(x, D, 0, 10000.0, positions, 64, True, inverse)
    got = rope(x.cuda(), D, 0, 10000.0, positions.cuda(), 64, True, inverse)
    assert_close(got.cpu(), want.double(), f"inverse={inverse}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_views_of_a_fused_projection(torch, gen, dtype):
    """q and k cut from one [B, S, 3, H, D] projection are rotated where they lie: the same
    bits as their contiguous copies; gradients land in the projection's q and k slots."""
    import ferrocupy.torch as ft
    from test_torch_rope import randn

    qkv = on_cuda(randn(gen, B, S, 3, H, D, dtype=getattr(torch, dtype))).requires_grad_(True)
    positions = torch.randint(0, 4096, (B, S), device="cuda")
    q = ft.rope(qkv[:, :, 0], D, positions=positions, rotary_dim=64)
    k = ft.rope(qkv[:, :, 1], D, positions=positions, rotary_dim=64)
    for got, part in ((q, 0), (k, 1)):
        want = ft.rope(qkv[:, :, part].detach().contiguous(), D, positions=positions,
                       rotary_dim=64)
        assert torch.equal(got, want)
    (q.float() * k.float()).sum().backward()
    assert (qkv.grad[:, :, 2] == 0).all() and qkv.grad[:, :, :2].abs().sum() > 0


def test_runs_on_torchs_current_stream(torch, gen):
    import ferrocupy.torch as ft
    from test_torch_rope import randn

    x = on_cuda(randn(gen, B, S, H, D))
    want = ft.rope(x, D, pos=7, interleaved=True)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            got = ft.rope(x, D, pos=7, interleaved=True)
        got_ = ft.rope_(got.clone(), D, pos=7, interleaved=True)
    side.synchronize()
    assert torch.equal(got, want)
    assert torch.equal(got_, ft.rope(want, D, pos=7, interleaved=True))


def test_cuda_graph_capture_after_one_call(torch, gen):
    """After one call of its shape, rope (and its backward) can be captured in a CUDA graph;
    replays follow the captured input's new values."""
    import ferrocupy.torch as ft
    from test_torch_rope import randn

    x = on_cuda(randn(gen, B, S, H, D))
    positions = torch.randint(0, 4096, (B, S), device="cuda")
    ft.rope(x, D, positions=positions, rotary_dim=64)  # the first call uploads the frequencies
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        ft.rope(x, D, positions=positions, rotary_dim=64)  # warm-up on the capturing stream
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        out = ft.rope(x, D, positions=positions, rotary_dim=64)
    x.copy_(on_cuda(randn(gen, B, S, H, D)))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, ft.rope(x, D, positions=positions, rotary_dim=64))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_opcheck(torch, gen, dtype):
    from test_torch_rope import randn

    x = on_cuda(randn(gen, 2, 9, 3, 64, dtype=getattr(torch, dtype)))
    positions = torch.randint(0, 99, (2, 9), device="cuda")
    for args in ((x, 64, 0, 10000.0, positions, 32, True, False),
                 (x.clone().requires_grad_(True), 64, 5, 500000.0, None, None, False, True)):
        torch.library.opcheck(torch.ops.ferrocupy.rope.default, args)


def test_torch_compile_fullgraph(torch, gen):
    import torch._dynamo

    from test_torch_rope import _layer, assert_compiled_equals_eager, randn

    torch._dynamo.reset()
    x = on_cuda(randn(gen, 2, 6, 2, 3, 16))
    positions = torch.randint(0, 1000, (2, 6), device="cuda")
    assert_compiled_equals_eager(torch.compile(_layer, fullgraph=True), x, positions)


def test_issue_27_regression_on_cuda(torch, gen):
    import ferrocupy.torch as ft
    from test_torch_rope import randn

    w = on_cuda(randn(gen, 2, 5, 3, 8)).requires_grad_(True)
    x = w * 2
    before = x.detach().clone()
    with pytest.raises(RuntimeError, match="rope_ has no gradient"):
        ft.rope_(x, 8, pos=3)
    with pytest.raises(RuntimeError, match="a leaf Variable that requires grad"):
        ft.rope_(w, 8, pos=3)
    assert torch.equal(x.detach(), before)
    ft.rope(w * 2, 8, pos=3).sum().backward()
    assert not torch.allclose(w.grad, torch.full_like(w, 2.0))


def test_positions_on_another_device_are_refused(torch, gen):
    import ferrocupy.torch as ft
    from test_torch_rope import randn

    x = on_cuda(randn(gen, 2, 5, 3, 8))
    before = x.clone()
    with pytest.raises(ValueError, match=r"positions \(shape \(5,\)\) is on cpu"):
        ft.rope_(x, 8, positions=torch.arange(5))
    assert torch.equal(x, before)
    assert np.isfinite(ft.rope(x, 8, positions=torch.arange(5, device="cuda")).cpu().numpy()).all()
