"""The fused backward on the GPU (flash_bwd_fused_wgmma.cu: sm_90a, float16 / bfloat16, given the
forward's lse): SPEC's half rule against the float64 reference with NaN-poisoned gradients over
the options the two-kernel wgmma backward honours (causal, offset, windows, GQA, additive mask,
dropout, softcap, ALiBi, sinks, strided layouts), bit-identical gradients run after run (the
ordered dQ adds), and agreement with the two-kernel backward to the output's rounding.

Each test takes an engine of its own whose backend has the fused backward switched on (and one
with it off to compare), so the environment's switch does not matter. Skipped without a GPU, and
on a GPU other than compute capability 9.0 (the kernels are built for sm_90a)."""

from __future__ import annotations

import numpy as np
import pytest

from ferrocupy import AttentionOptions, ComputeEngine, UnifiedTensor
from ferrocupy.cuda import configs
from ferrocupy.dtypes import BFLOAT16, FLOAT16
from gpu_helpers import (DROPOUT_SEED, Device, device_under_test, gpu_pytestmark, make_case,
                         self_check)
from half_rule import rounded
from test_cuda_half import MASK_DROPOUT_CASES, ULP, check_half, run

pytestmark = gpu_pytestmark()

HALF = [pytest.param(FLOAT16, id="f16"), pytest.param(BFLOAT16, id="bf16")]
DIMS = pytest.mark.parametrize("d", [64, 128], ids=lambda d: f"d{d}")
VISIBILITY_CASES = {
    "plain": dict(),
    "causal": dict(causal=True),
    "causal-offset30": dict(causal=True, causal_offset=30),
    "causal-offset-neg40": dict(causal=True, causal_offset=-40),
    "window100": dict(window=100),
    "causal-window70": dict(causal=True, window=70, causal_offset=5),
}
_DEVICES: dict = {}


def engine_with(fused: bool) -> Device:
    """A CUDA engine of its own with the fused backward on or off (the reference in self-check
    mode)."""
    if self_check():
        return device_under_test()
    if fused not in _DEVICES:
        engine = ComputeEngine("cuda")
        if engine.backend.capability != 90:
            pytest.skip(f"the fused backward is built for sm_90a; this GPU is "
                        f"sm_{engine.backend.capability}")
        engine.backend.fused_backward = fused
        _DEVICES[fused] = Device(engine, "cuda")
    return _DEVICES[fused]


def assert_fused_ran(d: Device, plain: bool | None = None) -> None:
    """The backend built the fused kernel (the `plain` variant, or the full one, where given)."""
    if self_check():
        return
    built = {hit[0].plain for key, hit in d.engine.backend._kernels.items()
             if key[0] == configs.BACKWARD_FUSED}
    assert built, "the fused backward did not run"
    assert plain is None or plain in built


@pytest.mark.parametrize("dtype", HALF)
@DIMS
@pytest.mark.parametrize("opts", VISIBILITY_CASES.values(), ids=VISIBILITY_CASES.keys())
def test_fused_visibility_and_gqa(rng, dtype, d, opts):
    """Lengths that are no multiple of a tile, GQA 4 (one KV head's block adds into four heads'
    dQ), each key block seeing a different span of query tiles: the first block to add into a
    tile is not block 0."""
    fused = engine_with(True)
    case = make_case(rng, b=2, sq=333, sk=461, h=8, hkv=2, d=d, qk_scale=1.0, **opts)
    check_half(fused, rounded(case, dtype), give_lse=True)
    assert_fused_ran(fused, plain=True)


@pytest.mark.parametrize("dtype", HALF)
@DIMS
@pytest.mark.parametrize("opts", MASK_DROPOUT_CASES.values(), ids=MASK_DROPOUT_CASES.keys())
def test_fused_mask_and_dropout(rng, dtype, d, opts):
    fused = engine_with(True)
    case = make_case(rng, b=2, sq=333, sk=461, h=8, hkv=2, d=d, qk_scale=1.0, **opts)
    check_half(fused, rounded(case, dtype, dtype), give_lse=True)
    assert_fused_ran(fused, plain=False)


MODEL_CASES = ("softcap", "alibi-bh-window-mask", "sinks-causal-offset", "softcap-alibi", "all",
               "all-dead-rows")


@pytest.mark.parametrize("dtype", HALF)
@DIMS
@pytest.mark.parametrize("name", MODEL_CASES)
def test_fused_model_options(rng, dtype, d, name):
    """Softcap, ALiBi and sinks (grad_sinks from the pre-kernel's stats) by the half rule."""
    mo = pytest.importorskip("test_cuda_model_options")
    fused = engine_with(True)
    t = mo.rounded(mo.make(rng, mo.CASES[name], sq=150, sk=211, d=d), dtype)
    mo.check_half(mo.run(fused, t, give_lse=True), t, f"[fused {name} d{d}]")
    assert_fused_ran(fused)


@pytest.mark.parametrize("layout", ["sdpa", "packed", "mixed"])
def test_fused_layouts_read_and_write_through_their_strides(rng, layout):
    """Every tensor of the call in a strided layout (test_layouts.py's views) gives the
    contiguous call's gradients bit for bit (same kernels: 16-byte rows), nothing written
    outside the views."""
    lay = pytest.importorskip("test_layouts")
    fused = engine_with(True)
    q, k, v, do = lay._inputs(rng, B=2, Sq=150, Sk=170, H=4, Hkv=2, D=64, dtype=BFLOAT16)
    opts = AttentionOptions(causal=True, causal_offset=20)
    out, lse = lay._forward(fused, q, k, v, "contiguous", opts)
    grads = {}
    for name in ("contiguous", layout):
        views = [lay._view(fused, x, lay._layout(name, n))[0]
                 for n, x in zip(("q", "k", "v", "out", "grad_out"), (q, k, v, out, do))]
        gs = [lay._view(fused, x, lay._layout(name, n), fill=np.nan)
              for n, x in zip(("grad_q", "grad_k", "grad_v"), (q, k, v))]
        fused.engine.flash_attention_v2_backward_with(*views, *(g for g, _ in gs), opts,
                                                      lse=fused.put(lse))
        grads[name] = []
        for g, buf in gs:
            got = lay._host(fused, g)
            whole = lay._host(fused, UnifiedTensor(buf)).astype(np.float32)
            assert np.isnan(whole).sum() == whole.size - got.size, "wrote outside the view"
            grads[name].append(got)
    for n, a, b in zip(("grad_q", "grad_k", "grad_v"), grads["contiguous"], grads[layout]):
        assert np.array_equal(a.view(np.uint16), b.view(np.uint16)), n
    assert_fused_ran(fused)


DETERMINISM_CASES = {
    "causal-window-gqa": dict(causal=True, window=300, h=8, hkv=2),
    "dropout-mask": dict(dropout_prob=0.1, seed=DROPOUT_SEED, mask="B,1,Sq,Sk", h=4, hkv=4),
}


@pytest.mark.parametrize("dtype", HALF)
@DIMS
@pytest.mark.parametrize("opts", DETERMINISM_CASES.values(), ids=DETERMINISM_CASES.keys())
def test_fused_runs_are_bit_identical(rng, dtype, d, opts):
    """Many key blocks add into every query tile (1000 keys: 8 blocks), in an order the counters
    fix: three runs give the same bits."""
    fused = engine_with(True)
    case = rounded(make_case(rng, b=2, sq=1000, sk=1000, d=d, qk_scale=1.0, **opts), dtype,
                   dtype)
    runs = [run(fused, case) for _ in range(3)]
    for n in ("grad_q", "grad_k", "grad_v"):
        assert not np.isnan(runs[0][n].astype(np.float32)).any(), n
        for r in runs[1:]:
            assert np.array_equal(runs[0][n].view(np.uint16), r[n].view(np.uint16)), n
    assert_fused_ran(fused)


@pytest.mark.parametrize("dtype", HALF)
@DIMS
@pytest.mark.parametrize("opts", [dict(causal=True, causal_offset=20), dict(window=90),
                                  dict(mask="B,H,Sq,Sk", neg_inf=0.1, dropout_prob=0.1,
                                       seed=DROPOUT_SEED)],
                         ids=["causal-offset20", "window90", "mask-dropout"])
def test_fused_agrees_with_the_two_kernel_backward(rng, dtype, d, opts):
    """The same products, rounded the same way: the gradients differ only in float32 summation
    order (dQ's partials, Delta's sum), within a few units of the output's last place."""
    case = rounded(make_case(rng, b=2, sq=333, sk=461, h=8, hkv=2, d=d, qk_scale=1.0, **opts),
                   dtype, dtype)
    fused, two = (run(engine_with(on), case) for on in (True, False))
    for n in ("grad_q", "grad_k", "grad_v"):
        a, b = (x[n].astype(np.float64) for x in (fused, two))
        assert not np.isnan(a).any(), n
        assert np.abs(a - b).max() <= 4 * ULP[dtype] * np.abs(b).max(), n
    assert_fused_ran(engine_with(True))
    if not self_check():
        assert not any(k[0] == configs.BACKWARD_FUSED
                       for k in engine_with(False).engine.backend._kernels)
