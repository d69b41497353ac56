"""Which head_dims run on sm_90a's wgmma kernels, planned without a GPU (test_backend_plan.py's
fake H200 backend): every padded head_dim up to 128 in half precision, with 16-byte rows, on
compute capability 9.0 (forward, dQ, dK/dV, the fused backward), the kernel built at width 64
(padded 16-64) or 128 (80-128), the columns past the head_dim zero-filled; compute capability
8.0, narrower rows, float32 and head_dims above 128 keep the mma.sync kernels. The GPU suite
(test_cuda_wgmma_dims.py) runs these plans against the reference."""

from __future__ import annotations

import numpy as np
import pytest

from ferrocupy.cuda import configs
from ferrocupy.dtypes import BFLOAT16, FLOAT16, FLOAT32
from test_backend_plan import backend, forward_buffers, make_plan, params
from test_fused_backward_plan import backward_buffers, bwd_params, kernel_names

HALF = [pytest.param(FLOAT16, id="f16"), pytest.param(BFLOAT16, id="bf16")]
H200_SHARED = 232448
# Half-precision head_dims with 16-byte rows (a multiple of 8), one per padded head_dim <= 128,
# and the padded ones themselves.
HEAD_DIMS = sorted({*range(8, 129, 16), *range(16, 129, 16)})
WGMMA_KERNELS = {configs.FORWARD: "flash_fwd_wgmma", configs.BACKWARD_DQ: "flash_bwd_dq_wgmma",
                 configs.BACKWARD_DKDV: "flash_bwd_dkdv_wgmma"}


def kernel_width(d: int) -> int:
    return 64 if d <= 64 else 128


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("op", list(WGMMA_KERNELS))
def test_select_takes_wgmma_at_every_head_dim_up_to_128_on_sm90(op, dtype):
    """Every selection a call can make (plain or not, model options or not, lse or not) at
    every half-precision head_dim with 16-byte rows: wgmma on 9.0, built at 64 or 128; the
    dQ kernel without the forward's lse excepted here (the backend gives it one: see
    test_backward_without_lse_*)."""
    for d in HEAD_DIMS:
        for plain, mods, lse in ((True, False, True), (False, False, True), (False, True, True),
                                 (True, False, False), (False, True, False)):
            v = configs.select(op, dtype, d, H200_SHARED, capability=90, copy_bytes=16,
                               plain=plain, mods=mods, lse_given=lse)
            if op == configs.BACKWARD_DQ and not lse:
                assert v.isa == configs.MMA, v.describe()
                continue
            assert v.isa == configs.WGMMA, (d, v.describe())
            assert v.head_dim == kernel_width(d) and v.shared_bytes <= H200_SHARED
            assert v.plain == plain and (v.mods or not mods)


@pytest.mark.parametrize("op", list(WGMMA_KERNELS))
def test_select_keeps_mma_sync_elsewhere(op):
    """Compute capability 8.0 (and 8.6, 10.0), rows narrower than 16 bytes, float32 and head_dims
    above 128: never a wgmma variant."""
    for d in HEAD_DIMS:
        for cap, copy_bytes, dtype in ((80, 16, BFLOAT16), (86, 16, FLOAT16), (100, 16, BFLOAT16),
                                       (90, 4, BFLOAT16), (90, 2, FLOAT16), (90, 16, FLOAT32)):
            v = configs.select(op, dtype, d, 163 * 1024, capability=cap, copy_bytes=copy_bytes)
            assert v.isa == configs.MMA and v.head_dim == configs.padded_head_dim(d), v.describe()
    for d in (136, 200, 256):
        v = configs.select(op, BFLOAT16, d, H200_SHARED, capability=90, copy_bytes=16)
        assert v.isa == configs.MMA


def test_the_wgmma_builds_are_the_two_widths_the_kernels_assert():
    """The table names no wgmma build the kernels' static_asserts refuse (DP 64 or 128) and no
    new one: a padded head_dim's wgmma variants are those of its kernel width, define for
    define, so the compile tests' cases are the ones at 64 and 128."""
    for (op, dtype, dp), vs in configs.TABLE.items():
        wg = [v for v in vs if v.isa == configs.WGMMA]
        if dtype == FLOAT32 or op == configs.DECODE or dp > configs.MEASURED_HEAD_DIM:
            assert not wg, (op, dtype, dp)
            continue
        assert wg, (op, dtype, dp)
        same = configs.TABLE[(op, dtype, kernel_width(dp))]
        for v in wg:
            assert v.head_dim == kernel_width(dp) and v in same
            assert v.defines["FERRO_HEAD_DIM"] in (64, 128)


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_fake_sm90_plans_run_wgmma_at_every_head_dim(dtype, d):
    """The backend's plans on the fake H200: the wgmma forward and, given the forward's lse, the
    wgmma dQ and dK/dV, each built at the kernel width (FERRO_HEAD_DIM) while the call's
    head_dim travels in the params; the fused backward too where it is switched on."""
    q, k = (2, 300, 8, d), (2, 461, 2, d)
    b = backend()
    plan = make_plan(b, "forward", forward_buffers(q, k, dtype), params(q, k, causal=True))
    assert kernel_names(plan) == ["flash_fwd_wgmma"]
    p = bwd_params(q, k, causal=True)
    plan = make_plan(b, "backward", backward_buffers(q, k, dtype), p)
    assert kernel_names(plan) == [WGMMA_KERNELS[configs.BACKWARD_DQ],
                                  WGMMA_KERNELS[configs.BACKWARD_DKDV]]
    assert int(p["head_dim"]) == d
    assert {dict(c[2])["FERRO_HEAD_DIM"] for c in b.loader.compiled} == {kernel_width(d)}
    assert {c[3] for c in b.loader.compiled} == {("-arch=sm_90a",)}
    fused = backend()
    fused.fused_backward = True
    plan = make_plan(fused, "backward", backward_buffers(q, k, dtype), p)
    assert kernel_names(plan) == [configs.FUSED_PRE_KERNEL, "flash_bwd_fused_wgmma",
                                  configs.FUSED_POST_KERNEL]
    assert plan.workspace["dq_accum"][1] == kernel_width(d)


@pytest.mark.parametrize("d", [8, 24, 40, 72, 80, 96])
def test_fake_sm80_and_unaligned_rows_plan_mma_sync(d):
    q, k = (2, 300, 8, d), (2, 461, 2, d)
    for b, offset in ((backend(capability=80), 0), (backend(), 2)):
        plan = make_plan(b, "forward", forward_buffers(q, k, BFLOAT16, offset),
                         params(q, k, causal=True))
        assert kernel_names(plan) == ["flash_fwd_half"]
        plan = make_plan(b, "backward", backward_buffers(q, k, BFLOAT16, offset=offset),
                         bwd_params(q, k))
        assert kernel_names(plan) == ["flash_bwd_dq_half", "flash_bwd_dkdv_half"]
        assert {dict(c[2])["FERRO_HEAD_DIM"] for c in b.loader.compiled} == {-(-d // 16) * 16}
