"""Every head_dim on sm_90a's wgmma kernels (GPU): head_dims 8, 24, 40, 72, 80 and 96 (kernel
width 64 or 128, the columns past the head_dim zero-filled as they load), and 136, 200, 256 (the
forward and dQ at width 192 or 256, dK/dV at 256), forward and backward, the backward with
the forward's lse and without it (then the forward runs first for it), over causal / window /
mask / dropout / softcap / ALiBi / sinks combinations, by SPEC's
half rule against ferrocupy's float64 reference (test_cuda_model_options.py's `check_half`, the
PyTorch formula in the dtype as the yardstick), every output NaN-poisoned first.

On compute capability 9.0 each call also asserts which kernels it launched: the wgmma ones only
(or the fused backward's, where its switch is on), never a mma.sync kernel. Elsewhere the same
checks run on whatever the GPU takes. Skipped without a GPU (`FERRO_GPU_TESTS_ON_REFERENCE=1`
runs the numbers against the reference standing in for the device).

A loader that skipped the zero fill past the head_dim (lab/wgmma_zero_fill_plant.sh plants it
through the kernel overlay) reads the next columns of the row's memory into Q, K and V, and the
forward's out fails the rule at every head_dim here."""

from __future__ import annotations

import pytest

from ferrocupy.cuda import configs
from ferrocupy.dtypes import BFLOAT16, FLOAT16
from gpu_helpers import axis, covering, device_under_test, gpu_pytestmark, self_check
from test_cuda_half import ULP

mo = pytest.importorskip("test_cuda_model_options", reason="the dense oracle needs PyTorch")

pytestmark = gpu_pytestmark()

HALF = [pytest.param(FLOAT16, id="f16"), pytest.param(BFLOAT16, id="bf16")]
HEAD_DIMS = [8, 24, 40, 72, 80, 96]
WIDE_HEAD_DIMS = [136, 200, 256]  # widths 192, 256, 256
CASES = {
    "plain": dict(),
    "causal": dict(causal=True, causal_offset=9),
    "window-dropout": dict(window=23, dropout_prob=0.2),
    "causal-mask": dict(causal=True, mask=True),
    "softcap-alibi": dict(softcap=2.5, alibi="h", causal=True),
    "sinks-dead-rows": dict(sinks=True, mask=True, dead=True),
    "all": dict(softcap=4.0, alibi="bh", sinks=True, causal=True, causal_offset=3, window=40,
                mask=True, dropout_prob=0.1),
}
# the kernels a call on sm_90a may launch: the wgmma ones, the fused backward's, grad_sinks'
ON_SM90 = {"flash_fwd_wgmma", "flash_bwd_dq_wgmma", "flash_bwd_dkdv_wgmma",
           "flash_bwd_fused_wgmma", configs.FUSED_PRE_KERNEL, configs.FUSED_POST_KERNEL,
           configs.SINKS_KERNEL}


@pytest.fixture
def launched(monkeypatch):
    """The names of the kernels the CUDA backend launches during the test."""
    from ferrocupy.cuda import launch

    names = []
    real = launch.PackedLaunch.run

    def run(self, *a, **kw):
        names.append(self.fn.name)  # (cupy.RawKernel's)
        return real(self, *a, **kw)

    monkeypatch.setattr(launch.PackedLaunch, "run", run)
    return names


def _on_hopper() -> bool:
    return not self_check() and device_under_test().engine.backend.capability == 90


@pytest.mark.parametrize("name,give_lse,d,dtype", covering({
    "name": axis(list(CASES)),
    "give_lse": axis([True, False], ids=["lse", "no-lse"]),
    "d": axis(HEAD_DIMS, ids=lambda d: f"d{d}"),
    "dtype": axis(HALF),
}))
def test_half_rule_on_the_wgmma_kernels(launched, rng, name, give_lse, d, dtype):
    check_case(launched, rng, name, give_lse, d, dtype)


@pytest.mark.parametrize("name,give_lse,d,dtype", covering({
    "name": axis(["plain", "causal-mask", "window-dropout", "all"]),
    "give_lse": axis([True, False], ids=["lse", "no-lse"]),
    "d": axis(WIDE_HEAD_DIMS, ids=lambda d: f"d{d}"),
    "dtype": axis(HALF),
}))
def test_half_rule_above_128(launched, rng, name, give_lse, d, dtype):
    """Above 128 the wgmma forward and dQ (widths 192 and 256) and dK/dV (width 256, its columns
    split between the warpgroups)."""
    check_case(launched, rng, name, give_lse, d, dtype)


def check_case(launched, rng, name, give_lse, d, dtype):
    dev = device_under_test()
    t = mo.rounded(mo.make(rng, CASES[name], sq=150, sk=211, d=d), dtype)
    mo.check_half(mo.run(dev, t, give_lse=give_lse), t, f"[{name} d{d}]")
    if _on_hopper():
        assert launched and set(launched) <= ON_SM90, launched
        assert "flash_fwd_wgmma" in launched and "flash_bwd_dq_wgmma" in launched \
            or "flash_bwd_fused_wgmma" in launched, launched
        # without the lse the backward's forward runs first: the forward twice
        assert launched.count("flash_fwd_wgmma") == (1 if give_lse else 2), launched


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("d", HEAD_DIMS + WIDE_HEAD_DIMS, ids=lambda d: f"d{d}")
def test_gqa_long_rows_and_kv_lens_forward(launched, rng, dtype, d):
    """GQA 6:1, several query and key tiles (persistent blocks claiming tiles), kv_lens with NaN
    past each length: the zero fill covers rows past a batch's keys as well as columns."""
    dev = device_under_test()
    t = mo.rounded(mo.make(rng, dict(causal=True, causal_offset=40), b=3, sq=300, sk=420, h=6,
                           hkv=1, d=d, kv_lens=True), dtype)
    mo.check_half(mo.run(dev, t, backward=False), t, f"[kv_lens d{d}]")
    if _on_hopper():
        assert launched == ["flash_fwd_wgmma"], launched


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("d", [24, 80], ids=lambda d: f"d{d}")
def test_without_lse_agrees_with_lse_given(rng, dtype, d):
    """The backward's own forward gives the lse the caller's forward gave (the same kernel): the
    gradients with and without it agree to a few units of the last place (bit for bit, where
    the forward is the same build)."""
    dev = device_under_test()
    t = mo.rounded(mo.make(rng, dict(causal=True, mask=True, dropout_prob=0.1), sq=150, sk=211,
                           d=d), dtype)
    a, b = mo.run(dev, t, give_lse=True), mo.run(dev, t, give_lse=False)
    for n in ("grad_q", "grad_k", "grad_v"):
        assert abs(a[n] - b[n]).max() <= 4 * ULP[dtype] * abs(b[n]).max(), n
