"""The fused backward's selection and workspace, planned without a GPU (test_backend_plan.py's
fake sm_90 backend): by default as configs.FUSED_BACKWARD_DEFAULT says, on or off by
FERROCUPY_FUSED_BACKWARD or a backend's fused_backward, chosen only where it serves the call
(half precision, head_dim with a wgmma variant, sm_90a, 16-byte rows; without the forward's lse
after the forward run for it: test_wgmma_dims_plan.py), its
three launches in order, and its workspace (the float32 dQ accumulator and the order counters)
sized per (batch, head, query tile). The GPU suite (test_cuda_fused_backward.py) runs it."""

from __future__ import annotations

import numpy as np
import pytest

from ferrocupy import AttentionDims, AttentionOptions
from ferrocupy.cuda import configs
from ferrocupy.dtypes import BFLOAT16, FLOAT16, FLOAT32
from ferrocupy.params import contiguous_layout
from test_backend_plan import _extras, backend, buf, forward_buffers, make_plan, ptrs, recorded

TWO_KERNELS = ["flash_bwd_dq_wgmma", "flash_bwd_dkdv_wgmma"]
FUSED = [configs.FUSED_PRE_KERNEL, "flash_bwd_fused_wgmma", configs.FUSED_POST_KERNEL]


def backward_buffers(q, k, dtype, lse=True, offset=0):
    b, sq, h, _ = q
    bufs = dict(forward_buffers(q, k, dtype, offset), grad_out=buf(q, dtype), grad_q=buf(q, dtype),
                grad_k=buf(k, dtype), grad_v=buf(k, dtype),
                lse=buf((b, h, sq), FLOAT32) if lse else None)
    bufs.pop("kv_lens")
    return bufs


def bwd_params(q, k, **opts):
    return AttentionDims.new(np.zeros(q), np.zeros(k)).params_bwd(AttentionOptions(**opts))


def kernel_names(plan) -> list:
    return [launch.fn.name for launch in plan.launches]


Q, K = (2, 300, 8, 128), (2, 461, 2, 128)


def test_the_switch_reads_the_environment():
    default = configs.FUSED_BACKWARD_DEFAULT
    assert configs.fused_backward_wanted({}) is default
    assert configs.fused_backward_wanted({configs.FUSED_BACKWARD_ENV: ""}) is default
    assert configs.fused_backward_wanted({configs.FUSED_BACKWARD_ENV: "1"}) is True
    assert configs.fused_backward_wanted({configs.FUSED_BACKWARD_ENV: "0"}) is False
    b = backend()
    assert b.fused_backward is configs.FUSED_BACKWARD


@pytest.mark.parametrize("opts", [dict(), dict(causal=True), dict(window=256),
                                  dict(causal=True, window_left=100)], ids=str)
@pytest.mark.parametrize("sk", [64, 1024, 4096])
def test_switched_on_every_call_it_serves_is_fused(opts, sk):
    """Switched on, every call it serves, causal, windowed and short ones included (the order of
    the adds: ferro_dq_order.cuh's downward walk); off, the two kernels; unset, the default."""
    q, k = (2, 1024, 8, 128), (2, sk, 2, 128)
    p = bwd_params(q, k, **opts)
    extras = _extras(opts)
    for switch, want in ((None, configs.FUSED_BACKWARD), (True, True), (False, False)):
        b = backend()
        if switch is not None:
            b.fused_backward = switch
        bufs = backward_buffers(q, k, BFLOAT16)
        plan = b.plan("backward", bufs, p, contiguous_layout(p), ptrs(bufs), extras)
        assert kernel_names(plan) == (FUSED if want else TWO_KERNELS), (opts, sk, switch)


@pytest.mark.parametrize("dtype", [FLOAT16, BFLOAT16], ids=["f16", "bf16"])
@pytest.mark.parametrize("d", [64, 112, 128])
def test_switched_on_the_backward_is_three_fused_launches(dtype, d):
    q, k = Q[:3] + (d,), K[:3] + (d,)
    b = backend()
    b.fused_backward = True
    p = bwd_params(q, k, causal=True, causal_offset=7)
    plan = make_plan(b, "backward", backward_buffers(q, k, dtype), p)
    assert kernel_names(plan) == FUSED
    pre, main, post = plan.launches
    v = configs.select_fused(dtype, d, b._smem_limit, capability=90, copy_bytes=16, plain=True)
    assert v.op == configs.BACKWARD_FUSED and v.plain and v.isa == configs.WGMMA
    q_tiles = -(-300 // v.step)
    assert (pre.blocks, post.blocks) == (2 * 8 * q_tiles,) * 2
    assert pre.threads == post.threads == configs.FUSED_THREADS
    assert main.blocks == v.tiles(p) == -(-461 // v.block_rows) * 2 * 2  # (batch, KV head)
    assert main.smem == v.shared_bytes
    dkdv = configs.select(configs.BACKWARD_DKDV, dtype, d, b._smem_limit, capability=90,
                          copy_bytes=16, plain=True)
    # 2 dS buffers, and a staged float32 dQ partial per computing warpgroup
    assert v.shared_bytes == (dkdv.shared_bytes + dtype.itemsize * 2 * 128 * v.step
                              + 4 * 2 * v.step * v.head_dim)
    absent = [None, None]  # cu_seqlens_q, cu_seqlens_k: a dense call's are NULL
    assert [getattr(a, "name", None) for a in pre.args[:8]] == [*configs.FUSED_PRE_ARGS[:6],
                                                                  *absent]
    assert [getattr(a, "name", None) for a in post.args[:4]] == [*configs.FUSED_POST_ARGS[:2],
                                                                   *absent]
    names = [getattr(a, "name", None) for a in main.args[:13]]
    assert names == ["q", "k", "v", "grad_out", "grad_k", "grad_v", None, "stats", None, None,
                     None, "dq_accum", "dq_semaphores"]  # mask, alibi, cu_seqlens absent: NULL


@pytest.mark.parametrize("sq,d", [(300, 128), (64, 64), (65, 112), (1, 64)])
def test_workspace_is_a_float32_dq_and_a_counter_per_query_tile(sq, d):
    q, k = (3, sq, 4, d), (3, 77, 2, d)
    b = backend()
    b.fused_backward = True
    plan = make_plan(b, "backward", backward_buffers(q, k, BFLOAT16), bwd_params(q, k))
    q_tiles = -(-sq // 64)
    dp = 64 if d <= 64 else 128
    assert plan.workspace == {"stats": (3 * 4 * sq, 2), "dq_accum": (3 * 4 * q_tiles * 64, dp),
                              "dq_semaphores": (3 * 4 * q_tiles,)}


def test_runs_reuse_one_workspace_per_stream(monkeypatch):
    runs = recorded(monkeypatch, "ptrs")
    b = backend()
    b.fused_backward = True
    bufs = backward_buffers(Q, K, BFLOAT16)
    plan = make_plan(b, "backward", bufs, bwd_params(Q, K))
    b.run_plan(plan, ptrs(bufs), 7)
    b.run_plan(plan, ptrs(bufs), 7)
    assert [r[0] for r in runs] == FUSED * 2
    for name in ("stats", "dq_accum", "dq_semaphores"):
        addrs = {r[1][name] for r in runs}
        assert len(addrs) == 1 and 0 not in addrs, name  # every launch: the one workspace
    assert len({runs[0][1][n] for n in ("stats", "dq_accum", "dq_semaphores")}) == 3


@pytest.mark.parametrize("case", ["no-lse-sm80", "float32", "sm80", "unaligned", "d136", "seq_k0"])
def test_calls_it_does_not_serve_take_the_two_kernels(case):
    q, k, dtype, capability, offset = Q, K, BFLOAT16, 90, 0
    if case == "float32":
        dtype = FLOAT32
    if case in ("sm80", "no-lse-sm80"):
        capability = 80
    if case == "unaligned":
        offset = 2  # 4-byte aligned rows
    if case == "d136":  # above 128: no wgmma variant
        q, k = Q[:3] + (136,), K[:3] + (136,)
    if case == "seq_k0":
        k = (2, 0, 2, 128)
    b = backend(capability)
    b.fused_backward = True
    bufs = backward_buffers(q, k, dtype, lse=case != "no-lse-sm80", offset=offset)
    plan = make_plan(b, "backward", bufs, bwd_params(q, k))
    assert not set(kernel_names(plan)) & set(FUSED), case
    assert set(plan.workspace) == {"stats"}


def test_mask_dropout_and_model_options_take_the_full_variant():
    b = backend()
    b.fused_backward = True
    bufs = dict(backward_buffers(Q, K, BFLOAT16), mask=buf((1, 1, 1, 461), BFLOAT16))
    plan = make_plan(b, "backward", bufs, bwd_params(Q, K, dropout_prob=0.1))
    assert kernel_names(plan) == FUSED
    chosen = {key[0]: hit[0] for key, hit in b._kernels.items()}
    assert not chosen[configs.BACKWARD_FUSED].plain
    b = backend()
    b.fused_backward = True
    bufs = backward_buffers(Q, K, BFLOAT16)
    p = bwd_params(Q, K)
    extras = _extras(dict(softcap=2.0))
    plan = b.plan("backward", bufs, p, contiguous_layout(p), ptrs(bufs), extras)
    assert kernel_names(plan) == FUSED
    assert b._kernels[next(k for k in b._kernels if k[0] == configs.BACKWARD_FUSED)][0].mods


def test_grad_sinks_reads_the_pre_kernels_stats_after_the_fused_launches():
    b = backend()
    b.fused_backward = True
    sinks = buf((8,), FLOAT32)
    bufs = dict(backward_buffers(Q, K, BFLOAT16), sinks=sinks, grad_sinks=buf((8,), FLOAT32),
                alibi_slopes=None)
    p = bwd_params(Q, K)
    plan = b.plan("backward", bufs, p, contiguous_layout(p), ptrs(bufs), _extras({}, sinks=sinks))
    assert kernel_names(plan) == FUSED + [configs.SINKS_KERNEL]
    assert plan.launches[-1].args[0].name == "stats"


def test_switching_renews_the_plans():
    b = backend()
    before = b.generation
    b.fused_backward = True
    assert b.generation == before + 1 and b.fused_backward
    b.fused_backward = False
    assert b.generation == before + 2 and not b.fused_backward
    plan = make_plan(b, "backward", backward_buffers(Q, K, BFLOAT16), bwd_params(Q, K))
    assert kernel_names(plan) == TWO_KERNELS


@pytest.mark.parametrize("fused", [False, True], ids=["two-kernel", "fused"])
@pytest.mark.parametrize("case", ["softcap", "alibi", "softcap-mask", "softcap-dropout", "mask"])
def test_model_options_without_mask_or_dropout_take_the_unmasked_build(case, fused):
    """On sm_90a a call with softcap, ALiBi or sinks and neither a mask nor dropout runs the
    wgmma builds without them (`unmasked`, FERRO_UNMASKED: fewer registers held across the
    loop); any mask or dropout takes the general build, whose code reads them."""
    b = backend()
    b.fused_backward = fused
    mask = "mask" in case
    bufs = dict(backward_buffers(Q, K, BFLOAT16),
                mask=buf((1, 1, 1, 461), BFLOAT16) if mask else None)
    named = dict(alibi=buf((8,), FLOAT32)) if case == "alibi" else {}
    bufs |= dict(alibi_slopes=named.get("alibi"), sinks=None)
    opts = dict(softcap=2.0) if "softcap" in case else {}
    dropout = 0.1 if "dropout" in case else 0.0
    p = bwd_params(Q, K, dropout_prob=dropout, **opts)
    fp = AttentionDims.new(np.zeros(Q), np.zeros(K)).params(
        AttentionOptions(dropout_prob=dropout, **opts))
    extras = _extras(dict(dropout_prob=dropout, **opts), **named)
    b.plan("forward", bufs, fp, contiguous_layout(fp), ptrs(bufs), extras)
    b.plan("backward", bufs, p, contiguous_layout(p), ptrs(bufs), extras)
    chosen = {key[0]: hit[0] for key, hit in b._kernels.items()}
    want = case in ("softcap", "alibi")
    ops = [configs.FORWARD] + ([configs.BACKWARD_FUSED] if fused else
                               [configs.BACKWARD_DQ, configs.BACKWARD_DKDV])
    for op in ops:
        v = chosen[op]
        assert v.isa == configs.WGMMA and v.unmasked == want, (op, case, v.describe())
        assert v.mods and not v.plain, (op, case)  # (the general wgmma build has them too)
        assert ("FERRO_UNMASKED" in v.defines) == want
