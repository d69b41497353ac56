"""`ferrocupy.torch.rope` (out of place, autograd) and `rope_` (in place) on CPU (the reference
backend): values and gradients against autograd through plain-PyTorch RoPE (Hugging Face's
rotate_half and GPT-J's rotate_every_two, tests/torch_rope_formulas.py) for every option and
layout, opcheck, torch.compile(fullgraph=True), and issue 27's regression (rope_ on a tensor
autograd records raises instead of giving a wrong gradient). Randomised with hypothesis. The CUDA
path runs the same checks in tests/test_cuda_torch_rope.py."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (pip install torch)")

import ferrocupy.torch as ft  # noqa: E402
from helpers import COMPILE_BACKENDS  # noqa: E402
from rope_formula import POSITION_KINDS, make_positions, option_params  # noqa: E402
from torch_rope_formulas import bshd, positions_for, rope_torch  # noqa: E402

hypothesis = pytest.importorskip("hypothesis", reason="hypothesis is not installed")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

ROPE = torch.ops.ferrocupy.rope.default
ULP = {torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}
OPTIONS = option_params(16, inverse=False)  # the inverse is the gradient


@pytest.fixture
def gen(rng):
    return torch.Generator().manual_seed(int(rng.integers(2**62)))


def randn(gen, *shape, dtype=torch.float32):
    return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)


def positions_like(rng, kind: str, b: int, s: int):
    """rope_formula.make_positions as torch tensors."""
    pos, positions = make_positions(rng, kind, b, s)
    return pos, None if positions is None else torch.from_numpy(positions)


def assert_close(got: torch.Tensor, want: torch.Tensor, what: str = "") -> None:
    """float32: 1e-6 of the largest value; half precision: one ulp of it."""
    assert got.dtype in (torch.float32, *ULP), got.dtype
    g, w = got.detach().double(), want.detach().double()
    assert torch.isfinite(g).all(), f"non-finite values {what}"
    tol = 1e-6 if got.dtype == torch.float32 else ULP[got.dtype]
    err = float((g - w).abs().max())
    assert err <= tol * float(w.abs().max()), f"error {err:.3e} {what}"


def check(gen, x, head_dim, pos, positions, theta=10000.0, **kw):
    """ft.rope's value and gradient against autograd through the plain-torch formula (float64
    from the same rounded inputs); the input is left as it was."""
    before = x.detach().clone()
    xg = x.detach().requires_grad_(True)  # a leaf with x's strides (a view stays a view)
    out = ft.rope(xg, head_dim, pos, theta, positions=positions, **kw)
    assert out.shape == x.shape and out.dtype == x.dtype and out.is_contiguous()
    x64 = before.double().requires_grad_(True)
    want = rope_torch(bshd(x64, head_dim), positions_for(bshd(x64, head_dim), pos, positions),
                      theta, **kw).reshape(x.shape)
    what = f"[shape {tuple(x.shape)} pos {pos} {kw}]"
    assert_close(out, want, what)
    g = randn(gen, *x.shape, dtype=x.dtype).to(x.device)
    out.backward(g)
    want.backward(g.double())
    assert_close(xg.grad, x64.grad, "grad " + what)
    assert torch.equal(x.detach(), before), "rope wrote its input"


# --- values and gradients -------------------------------------------------------------------------
@pytest.mark.parametrize("kw", OPTIONS)
@pytest.mark.parametrize("kind", POSITION_KINDS)
@pytest.mark.parametrize("layout", ["B,S,H,D", "B,S,H*D", "S,H*D"])
def test_values_and_gradients(gen, rng, kw, kind, layout):
    b, s, h, d = (1 if layout == "S,H*D" else 2), 7, 3, 16
    shape = {"B,S,H,D": (b, s, h, d), "B,S,H*D": (b, s, h * d), "S,H*D": (s, h * d)}[layout]
    pos, positions = positions_like(rng, kind, b, s)
    check(gen, randn(gen, *shape), d, pos, positions, 500000.0, **kw)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kw", OPTIONS)
def test_half_precision_rounds_once(gen, rng, dtype, kw):
    pos, positions = positions_like(rng, "BS-int64", 2, 5)
    check(gen, randn(gen, 2, 5, 3, 16, dtype=dtype) * 3, 16, pos, positions, **kw)


VIEWS = {  # base shape for b, s, h, d = 2, 6, 3, 16, and the view of it RoPE gets
    "qkv-slice": ((2, 6, 3, 3, 16), lambda t: t[:, :, 1]),
    "bhsd-transposed": ((2, 3, 6, 16), lambda t: t.transpose(1, 2)),
    "padded-rows": ((2, 6, 3, 20), lambda t: t[..., 2:18]),
}


@pytest.mark.parametrize("view", list(VIEWS))
def test_strided_views_of_a_model(gen, rng, view):
    """q or k as models hand them over: views, read where they lie (the same bits as the
    contiguous copy); the gradient lands in the view's elements of the base, zero elsewhere."""
    shape, cut = VIEWS[view]
    full = randn(gen, *shape).requires_grad_(True)
    x = cut(full)
    _, positions = positions_like(rng, "BS-int64", 2, 6)
    kw = dict(positions=positions, rotary_dim=8, interleaved=True)
    out = ft.rope(x, 16, **kw)
    assert torch.equal(out, ft.rope(x.detach().contiguous(), 16, **kw))
    g = randn(gen, *out.shape)
    out.backward(g)
    x64 = x.detach().double().requires_grad_(True)
    rope_torch(x64, positions, 10000.0, 8, True).backward(g.double())
    assert_close(cut(full.grad), x64.grad, view)
    outside = torch.ones(shape, dtype=torch.bool)
    cut(outside)[...] = False
    assert (full.grad[outside] == 0).all()


def test_gradient_of_a_sum_is_not_all_ones(gen):
    """The gradient of sum(rope(x)) is the inverse rotation of ones (grad broadcast from a
    scalar: a stride-0 tensor, copied before the kernel)."""
    w = randn(gen, 2, 5, 3, 8).requires_grad_(True)
    ft.rope(w * 2, 8, pos=3).sum().backward()
    x64 = (w.detach().double() * 2).requires_grad_(True)
    rope_torch(x64, 3 + torch.arange(5), 10000.0).sum().backward()
    assert_close(w.grad, 2 * x64.grad)
    assert not torch.allclose(w.grad, torch.full_like(w, 2.0))


def test_double_backward_is_the_forward_rotation(gen):
    """rope is linear: the gradient of its gradient with respect to grad_out is the forward
    rotation."""
    x = randn(gen, 2, 5, 3, 8).requires_grad_(True)
    g = randn(gen, 2, 5, 3, 8).requires_grad_(True)
    (gx,) = torch.autograd.grad(ft.rope(x, 8, pos=2, rotary_dim=4), x, g, create_graph=True)
    v = randn(gen, 2, 5, 3, 8)
    (gx * v).sum().backward()
    assert torch.allclose(g.grad, ft.rope(v, 8, pos=2, rotary_dim=4), rtol=0, atol=1e-6)


def test_expanded_position_ids(gen, rng):
    """transformers' `position_ids` expanded to the batch (stride 0) are read where they lie."""
    x = randn(gen, 3, 7, 2, 16)
    _, row = positions_like(rng, "1S-int64", 3, 7)
    assert torch.equal(ft.rope(x, 16, positions=row.expand(3, 7)), ft.rope(x, 16, positions=row))


def test_positions_get_no_gradient(gen):
    x = randn(gen, 2, 5, 3, 8).requires_grad_(True)
    positions = torch.arange(5)
    ft.rope(x, 8, positions=positions).sum().backward()
    assert positions.grad is None and x.grad is not None


# --- the in-place form ---------------------------------------------------------------------------
def test_issue_27_rope_in_place_on_a_recorded_tensor_raises(gen):
    """`x = w * 2; rope_(x, 8, pos=3); x.sum().backward()` gave w.grad = 2 everywhere: wrong.
    Now the in-place call raises, as torch's in-place ops on a leaf that requires grad do."""
    w = randn(gen, 2, 5, 3, 8).requires_grad_(True)
    x = w * 2
    before = x.detach().clone()
    with pytest.raises(RuntimeError, match=r"ferrocupy.torch.rope_ has no gradient, and x "
                                           r"\(shape \(2, 5, 3, 8\)\) requires grad"):
        ft.rope_(x, 8, pos=3)
    assert torch.equal(x.detach(), before)
    with pytest.raises(RuntimeError, match=r"a leaf Variable that requires grad is being used "
                                           r"in an in-place operation"):
        ft.rope_(w, 8, pos=3)


def test_rope_in_place_without_autograd(gen):
    """Under no_grad (a leaf that requires grad included, as torch allows) and on plain tensors
    rope_ rotates in place, equal to rope."""
    w = randn(gen, 2, 5, 3, 8).requires_grad_(True)
    want = ft.rope(w.detach(), 8, pos=3, rotary_dim=4, interleaved=True)
    with torch.no_grad():
        assert ft.rope_(w, 8, pos=3, rotary_dim=4, interleaved=True) is w
    assert torch.equal(w.detach(), want)
    x = randn(gen, 2, 5, 24)
    positions = torch.tensor([4, 0, 9, -2, 7], dtype=torch.int32)
    want = ft.rope(x, 8, positions=positions)
    ptr = x.data_ptr()
    ft.rope_(x, 8, positions=positions)
    assert torch.equal(x, want) and x.data_ptr() == ptr


def test_rope_in_place_on_a_view_with_strided_head_dim_writes_back(gen):
    base = randn(gen, 2, 5, 3, 16)
    view = base[..., ::2]  # head_dim 8, every other element
    want = ft.rope(view.contiguous(), 8, pos=1)
    ft.rope_(view, 8, pos=1)
    assert torch.equal(base[..., ::2], want)


# --- the op: opcheck and torch.compile -----------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kw", [dict(), dict(positions="BS"), dict(rotary_dim=4),
                                dict(interleaved=True, positions="S"), dict(inverse=True)],
                         ids=["plain", "positions-BS", "partial", "interleaved-S", "inverse"])
def test_opcheck(gen, dtype, kw):
    x = randn(gen, 2, 5, 3, 8, dtype=dtype)
    positions = {None: None, "BS": torch.randint(0, 99, (2, 5), generator=gen),
                 "S": torch.randint(0, 99, (5,), generator=gen).int()}[kw.get("positions")]
    args = (x, 8, 0 if positions is not None else 3, 10000.0, positions, kw.get("rotary_dim"),
            kw.get("interleaved", False), kw.get("inverse", False))
    torch.library.opcheck(ROPE, args)
    torch.library.opcheck(ROPE, (x.clone().requires_grad_(True), *args[1:]))  # with autograd


def test_opcheck_in_place(gen):
    x = randn(gen, 2, 5, 3, 8)
    torch.library.opcheck(torch.ops.ferrocupy.rope_.default, (x, 8, 0, 10000.0,
                                                               torch.arange(5), 4, True))


def _layer(x, positions):
    """A model's use: q and k cut from one projection, rotated with positions, a loss."""
    q, k = x[:, :, 0], x[:, :, 1]
    q = ft.rope(q, 16, positions=positions, rotary_dim=8)
    k = ft.rope(k, 16, positions=positions, rotary_dim=8, theta=500000.0)
    return (q * k).sum() + (ft.rope(q, 16, pos=3, interleaved=True) ** 2).sum()


@pytest.mark.parametrize("backend", COMPILE_BACKENDS)
def test_torch_compile_fullgraph(gen, backend):
    import torch._dynamo

    torch._dynamo.reset()
    x = randn(gen, 2, 6, 2, 3, 16)
    positions = torch.randint(0, 1000, (2, 6), generator=gen)
    explained = torch._dynamo.explain(_layer)(x, positions)
    assert explained.graph_break_count == 0 and explained.graph_count == 1, explained
    assert_compiled_equals_eager(torch.compile(_layer, fullgraph=True, backend=backend), x,
                                 positions)


def assert_compiled_equals_eager(compiled, x, positions):
    """`_layer`'s loss and gradient, compiled and eager, agree."""
    results = []
    for fn in (_layer, compiled):
        xg = x.clone().requires_grad_(True)
        loss = fn(xg, positions)
        loss.backward()
        results.append((loss.detach(), xg.grad))
    (want, want_grad), (got, got_grad) = results
    assert torch.allclose(got, want, rtol=1e-5)
    assert torch.allclose(got_grad, want_grad, rtol=1e-5, atol=1e-6)


# --- hypothesis: shapes, layouts and options; bad inputs ----------------------------------------
@given(st.data())
@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_random_calls(gen, rng, data):
    d = data.draw(st.sampled_from([2, 4, 8, 12]), label="head_dim")
    r = data.draw(st.sampled_from([None, *range(2, d + 1, 2)]), label="rotary_dim")
    rank = data.draw(st.sampled_from([2, 3, 4]), label="rank")
    b = 1 if rank == 2 else data.draw(st.integers(1, 3), label="batch")
    s, h = data.draw(st.integers(1, 6), label="seq"), data.draw(st.integers(1, 3), label="heads")
    kind = data.draw(st.sampled_from(POSITION_KINDS), label="kind")
    transposed = rank == 4 and data.draw(st.booleans(), label="transposed")
    x = randn(gen, b, h, s, d).transpose(1, 2) if transposed else randn(gen, b, s, h, d)
    x = x if rank == 4 else x.reshape(b, s, h * d) if rank == 3 else x.reshape(s, h * d)
    pos, positions = positions_like(rng, kind, b, s)
    check(gen, x, d, pos, positions, data.draw(st.sampled_from([10.0, 10000.0])),
          rotary_dim=r, interleaved=data.draw(st.booleans(), label="interleaved"))


BAD = [  # (what, kwargs, exception, message)
    ("odd head_dim", dict(head_dim=7), ValueError,
     r"rope needs an even head_dim > 0, got 7 \(tensor shape \(2, 5, 3, 8\)\)"),
    ("head_dim not dividing", dict(head_dim=16), ValueError,
     r"tensor of shape \(2, 5, 3, 8\) \(240 elements\) is not a whole number of 10 tokens x "
     r"head_dim 16"),
    ("odd rotary_dim", dict(rotary_dim=3), ValueError,
     r"rotary_dim must be even and in \[2, head_dim = 8\], got 3 \(tensor shape \(2, 5, 3, 8\)\)"),
    ("float positions", dict(positions=torch.zeros(5)), TypeError,
     r"positions has dtype float32 \(shape \(5,\)\); it must be int32 or int64"),
    ("positions [S, B]", dict(positions=torch.zeros(5, 2, dtype=torch.int64)), ValueError,
     r"positions shape \(5, 2\) must be \[seq_len\] = \[5\] or \[batch, seq_len\] = \[2, 5\]"),
    ("positions and pos", dict(positions=torch.arange(5), pos=1), ValueError,
     r"pass pos or positions, not both"),
    ("float64 x", dict(dtype=torch.float64), TypeError, r"tensor has dtype float64"),
]


@pytest.mark.parametrize("what,kw,exc,match", BAD, ids=[b[0] for b in BAD])
@pytest.mark.parametrize("fn", ["rope", "rope_"])
def test_bad_arguments_raise_and_write_nothing(gen, what, kw, exc, match, fn):
    kw = dict(kw)
    x = randn(gen, 2, 5, 3, 8, dtype=kw.pop("dtype", torch.float32))
    before = x.clone()
    head_dim = kw.pop("head_dim", 8)
    with pytest.raises(exc, match=match):
        getattr(ft, fn)(x, head_dim, **kw)
    assert torch.equal(x, before)
