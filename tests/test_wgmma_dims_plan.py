"""Which head_dims run on sm_90a's wgmma kernels, planned without a GPU (test_backend_plan.py's
fake H200 backend): every padded head_dim up to 128 in half precision, with 16-byte rows, on
compute capability 9.0 (forward, dQ, dK/dV, the fused backward), the kernel built at width 64
(padded 16-64) or 128 (80-128), the columns past the head_dim zero-filled; above 128 the forward
and dQ at width 192 or 256 (dK/dV on mma.sync); compute capability 8.0, narrower rows and
float32 keep the mma.sync kernels. The backward without the forward's lse runs the forward
first where its dQ is a wgmma one. The GPU suite (test_cuda_wgmma_dims.py) runs these plans
against the reference."""

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
    """Compute capability 8.0 (and 8.6, 10.0), rows narrower than 16 bytes and float32: never a
    wgmma variant; above 128 on sm_90a every op has one (dK/dV at width 256)."""
    for d in HEAD_DIMS:
        for cap, copy_bytes, dtype in ((80, 16, BFLOAT16), (86, 16, FLOAT16), (100, 16, BFLOAT16),
                                       (90, 4, BFLOAT16), (90, 2, FLOAT16), (90, 16, FLOAT32)):
            v = configs.select(op, dtype, d, 163 * 1024, capability=cap, copy_bytes=copy_bytes)
            assert v.isa == configs.MMA and v.head_dim == configs.padded_head_dim(d), v.describe()
    for d in (136, 200, 256):
        v = configs.select(op, BFLOAT16, d, H200_SHARED, capability=90, copy_bytes=16)
        assert v.isa == configs.WGMMA, v.describe()
        assert v.head_dim == (256 if op == configs.BACKWARD_DKDV or d > 192 else 192)


def test_the_wgmma_builds_are_the_widths_the_kernels_assert():
    """The table names no wgmma build the kernels' static_asserts refuse (DP 64, 128, 192 or
    256; dK/dV 64, 128 or 256, the fused backward 64 or 128): a padded head_dim's wgmma variants
    are those of its kernel width, define for define, so the compile tests' cases are the ones
    at the widths."""
    for (op, dtype, dp), vs in configs.TABLE.items():
        wg = [v for v in vs if v.isa == configs.WGMMA]
        width = next(w for w in (64, 128, 192, 256) if dp <= w)
        fused = op == configs.BACKWARD_FUSED
        if op == configs.BACKWARD_DKDV and dp > 128:
            width = 256
        if dtype == FLOAT32 or op == configs.DECODE or (fused and dp > 128):
            assert not wg, (op, dtype, dp)
            continue
        assert wg, (op, dtype, dp)
        same = configs.TABLE[(op, dtype, width)]
        widths = {configs.BACKWARD_FUSED: (64, 128), configs.BACKWARD_DKDV: (64, 128, 256)}
        for v in wg:
            assert v.head_dim == width and v in same
            assert v.defines["FERRO_HEAD_DIM"] in widths.get(op, (64, 128, 192, 256))


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_fake_sm90_plans_run_wgmma_at_every_head_dim(dtype, d):
    """The backend's plans on the fake H200: the wgmma forward and, given the forward's lse, the
    wgmma dQ and dK/dV, each built at the kernel width (FERRO_HEAD_DIM) while the call's
    head_dim travels in the params; the fused backward too where it is switched on."""
    q, k = (2, 300, 8, d), (2, 461, 2, d)
    b = backend()
    b.fused_backward = False  # the two kernels first; the fused ones (the default) below
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


# --- the backward not given the forward's lse: on sm_90a the forward runs first for it ----------
def _slot(launch, name):
    """The argument of `launch` at kernel parameter `name` (its variant's order)."""
    names = [a for a in configs.ARGS[configs.FORWARD if "fwd" in launch.fn.name
                                      else configs.BACKWARD_DQ]]
    return launch.args[names.index(name)]


def _strided_layout(p):
    """The contiguous layout, but grad_q's rows a padded 2 * head_dim + 8 elements apart (its
    own strides, unlike out's)."""
    from ferrocupy.params import contiguous_layout

    lay = np.zeros((), contiguous_layout(p).dtype)
    lay[()] = contiguous_layout(p)
    d, h, sq = int(p["head_dim"]), int(p["heads"]), int(p["seq_q"])
    row = 2 * d + 8
    lay["grad_q_h"], lay["grad_q_s"], lay["grad_q_b"] = row, h * row, sq * h * row
    return lay[()]


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("d", [8, 24, 40, 64, 72, 80, 96, 128])
def test_backward_without_lse_runs_the_wgmma_forward_first(dtype, d):
    """Not given the forward's lse, the backward on the fake sm_90a plans the wgmma forward
    first (its own struct: the call's, dropout off), writing each row's lse into the workspace's
    LSE_PASS and its O into grad_q (through grad_q's strides), then the wgmma dQ reading that lse
    and dK/dV: no launch leaves the warpgroup kernels."""
    from ferrocupy.params import FLASH_V2_PARAMS

    q, k = (2, 300, 8, d), (2, 461, 2, d)
    b = backend()
    b.fused_backward = False  # (the lse pass before the fused backward: below)
    p = bwd_params(q, k, causal=True, causal_offset=5, dropout_prob=0.2, seed=9, window=50)
    bufs = backward_buffers(q, k, dtype, lse=False)
    lay = _strided_layout(p)
    plan = b.plan("backward", bufs, p, lay, {n: 0 if x is None else x.data.ptr
                                             for n, x in bufs.items()})
    assert kernel_names(plan) == ["flash_fwd_wgmma", "flash_bwd_dq_wgmma", "flash_bwd_dkdv_wgmma"]
    assert plan.workspace[configs.LSE_PASS] == (2 * 8 * 300,)
    fwd, dq, dkdv = plan.launches
    assert _slot(fwd, "out").name == "grad_q" and _slot(fwd, "lse").name == configs.LSE_PASS
    assert _slot(dq, "lse").name == configs.LSE_PASS and _slot(dq, "out").name == "out"
    struct, layout = fwd.args[-2], fwd.args[-3]
    assert struct.dtype == FLASH_V2_PARAMS and dq.args[-2] is p
    assert float(struct["dropout_prob"]) == 0.0
    for name in FLASH_V2_PARAMS.names:
        if name != "dropout_prob":
            assert struct[name] == p[name], name
    for c in "bsh":
        assert layout[f"out_{c}"] == lay[f"grad_q_{c}"] and layout[f"q_{c}"] == lay[f"q_{c}"]
    assert dq.args[-3] is lay  # dQ reads the call's own out through the call's layout
    assert {dict(c[2])["FERRO_HEAD_DIM"] for c in b.loader.compiled} == {kernel_width(d)}
    # dropout off in the forward: the plain build; dQ and dK/dV with dropout compiled in
    plains = [("FERRO_PLAIN", 1) in c[2] for c in b.loader.compiled]
    assert plains == [True, False, False]
    fused = backend()
    fused.fused_backward = True
    plan = fused.plan("backward", bufs, p, lay, {n: 0 if x is None else x.data.ptr
                                                 for n, x in bufs.items()})
    assert kernel_names(plan) == ["flash_fwd_wgmma", configs.FUSED_PRE_KERNEL,
                                  "flash_bwd_fused_wgmma", configs.FUSED_POST_KERNEL]
    assert plan.launches[1].args[2].name == configs.LSE_PASS  # the pre-kernel's lse


def test_the_lse_pass_takes_the_calls_mask_and_model_options():
    """The forward run for the lse is the call's: its mask, softcap, ALiBi and sinks (the lse
    holds the sink), the variant built with them; dQ given that lse is plain of the sinks."""
    from test_backend_plan import _extras, buf

    q, k = (2, 256, 8, 80), (2, 256, 8, 80)
    p = bwd_params(q, k)
    sinks = buf((8,), FLOAT32)
    for opts, fwd_mods in ((dict(softcap=2.0), True), ({}, True)):
        bufs = dict(backward_buffers(q, k, BFLOAT16, lse=False),
                    mask=buf((1, 1, 1, 256), BFLOAT16), alibi_slopes=None, sinks=sinks)
        b = backend()
        b.fused_backward = False  # (the fused backward after the lse pass: its own tests)
        from ferrocupy.params import contiguous_layout
        plan = b.plan("backward", bufs, p, contiguous_layout(p),
                      {n: 0 if x is None else x.data.ptr for n, x in bufs.items()},
                      _extras(opts, sinks=sinks))
        assert kernel_names(plan) == ["flash_fwd_wgmma", "flash_bwd_dq_wgmma",
                                      "flash_bwd_dkdv_wgmma"]
        fwd = plan.launches[0]
        assert _slot(fwd, "mask").name == "mask" and _slot(fwd, "sinks").name == "sinks"
        defines = [dict(c[2]) for c in b.loader.compiled]
        assert defines[0].get("FERRO_MODS") == (1 if fwd_mods else None)
        assert "FERRO_PLAIN" not in defines[0]


@pytest.mark.parametrize("case", ["given", "sm80", "unaligned", "float32", "seq_k0", "seq_q0",
                                  "batch0"])
def test_no_lse_pass_where_the_backward_has_what_it_needs(case):
    """No forward first where the call passes the lse, or where dQ is not a wgmma one anyway
    (sm_80, narrower rows, float32: the mma.sync dQ has its statistics pass), or where there
    is no key or no query row."""
    q, k, dtype, cap, offset = (2, 300, 8, 96), (2, 461, 2, 96), BFLOAT16, 90, 0
    if case == "sm80":
        cap = 80
    if case == "unaligned":
        offset = 2
    if case == "float32":
        dtype = FLOAT32
    if case == "seq_k0":
        k = (2, 0, 2, 96)
    if case == "seq_q0":
        q = (2, 0, 8, 96)
    if case == "batch0":
        q, k = (0,) + q[1:], (0,) + k[1:]
    b = backend(cap)
    plan = make_plan(b, "backward", backward_buffers(q, k, dtype, lse=case == "given",
                                                     offset=offset), bwd_params(q, k))
    assert not [n for n in kernel_names(plan) if "fwd" in n], case
    assert configs.LSE_PASS not in plan.workspace


def test_a_run_gives_the_lse_pass_grad_q_and_one_workspace(monkeypatch):
    from test_backend_plan import ptrs, recorded

    runs = recorded(monkeypatch, "ptrs")
    b = backend()
    b.fused_backward = False
    q, k = (1, 256, 8, 40), (1, 256, 4, 40)
    bufs = backward_buffers(q, k, FLOAT16, lse=False)
    plan = make_plan(b, "backward", bufs, bwd_params(q, k))
    b.run_plan(plan, ptrs(bufs), 7)
    b.run_plan(plan, ptrs(bufs), 7)
    assert [r[0] for r in runs] == ["flash_fwd_wgmma", "flash_bwd_dq_wgmma",
                                    "flash_bwd_dkdv_wgmma"] * 2
    lse = {r[1][configs.LSE_PASS] for r in runs}
    assert len(lse) == 1 and 0 not in lse and lse != {runs[0][1]["stats"]}


# --- above 128: the wgmma forward and dQ at widths 192 and 256, dK/dV at 256 --------------------
@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("d", [136, 152, 192, 200, 248, 256])
def test_fake_sm90_plans_above_128_run_wgmma_kernels(dtype, d):
    """Every kernel of a wide call is a wgmma one: the forward and dQ at width 192 or 256, dK/dV
    at 256 (a block of 64 keys, its columns split between the two warpgroups: twice the key
    tiles' blocks of a 128-key grid, no column parts)."""
    width = 192 if d <= 192 else 256
    q, k = (2, 300, 8, d), (2, 461, 2, d)
    for fused_on in (False, True):  # (no fused backward above 128: the two kernels either way)
        b = backend()
        b.fused_backward = fused_on
        plan = make_plan(b, "forward", forward_buffers(q, k, dtype), params(q, k, causal=True))
        assert kernel_names(plan) == ["flash_fwd_wgmma"]
        plan = make_plan(b, "backward", backward_buffers(q, k, dtype), bwd_params(q, k))
        assert kernel_names(plan) == ["flash_bwd_dq_wgmma", "flash_bwd_dkdv_wgmma"]
        assert plan.launches[1].blocks == -(-461 // 64) * 2 * 2
        plan = make_plan(b, "backward", backward_buffers(q, k, dtype, lse=False), bwd_params(q, k))
        assert kernel_names(plan) == ["flash_fwd_wgmma", "flash_bwd_dq_wgmma",
                                      "flash_bwd_dkdv_wgmma"]
        widths = {(c[1], dict(c[2])["FERRO_HEAD_DIM"]) for c in b.loader.compiled}
        assert widths == {("flash_fwd_wgmma", width), ("flash_bwd_dq_wgmma", width),
                          ("flash_bwd_dkdv_wgmma", 256)}
        dkdv = b._kernels[next(key for key in b._kernels if key[0] == configs.BACKWARD_DKDV)][0]
        assert dkdv.parts == 1 and dkdv.split_columns and dkdv.block_rows == 64
