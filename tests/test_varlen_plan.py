"""The CUDA backend's plan of a varlen (packed sequences) call, without a GPU (the fake device of
tests/test_backend_plan.py): one launch of the forward kernel for the whole packed batch, its
grid (number of sequences) x heads x ceil(max_seqlen_q / tile), cu_seqlens_q / cu_seqlens_k as
kernel arguments, the AttnExtras with its varlen flag, on mma.sync and on sm_90a's wgmma; a
varlen call with few query rows a KV group takes the decode kernels, which read cu_seqlens too;
the backward's launches over the frame (dQ and dK/dV, or the fused backward's three), then
the sinks' launch."""

from __future__ import annotations

import numpy as np
import pytest

from ferrocupy import AttentionOptions
from ferrocupy.cuda import configs
from ferrocupy.cuda.launch import NULL
from ferrocupy.dtypes import BFLOAT16, FLOAT16, FLOAT32
from ferrocupy.params import EXTRAS_VARLEN, AttentionDims, extras_params, layout_params
from test_backend_plan import backend, buf, ptrs


def varlen_call(total_q, total_k, n, max_q, max_k, h, hkv, d, dtype, opts=None, sinks=False):
    """(buffers, params, layout, extras) of a packed forward as plan.py packs them."""
    opts = opts or AttentionOptions(causal=True, causal_offset=max_k - max_q)
    q = np.zeros((total_q, h, d), np.float32)
    k = np.zeros((total_k, hkv, d), np.float32)
    dims = AttentionDims.packed(q, k, n, max_q, max_k)
    bufs = dict(q=buf(q.shape, dtype), k=buf(k.shape, dtype), v=buf(k.shape, dtype),
                out=buf(q.shape, dtype), mask=None, lse=buf((h, total_q), FLOAT32),
                kv_lens=None, cu_seqlens_q=buf((n + 1,), np.int32, 0x100),
                cu_seqlens_k=buf((n + 1,), np.int32, 0x200),
                sinks=buf((h,), FLOAT32) if sinks else None)
    layout = layout_params({n: q for n in ("q", "out", "grad_out", "grad_q")}
                           | {n: k for n in ("k", "v", "grad_k", "grad_v")})
    return bufs, dims.params(opts), layout, extras_params(opts, sinks=bufs["sinks"], varlen=True)


@pytest.mark.parametrize("capability, dtype, kernel", [
    (90, BFLOAT16, "flash_fwd_wgmma"), (80, FLOAT16, "flash_fwd_half"),
    (90, FLOAT32, "flash_attn_v2")])
def test_one_forward_launch_for_the_packed_batch(capability, dtype, kernel):
    b = backend(capability)
    n, max_q, h = 5, 300, 8
    bufs, p, layout, extras = varlen_call(900, 1000, n, max_q, 400, h, 2, 128, dtype)
    assert int(extras["flags"]) & EXTRAS_VARLEN
    plan = b.plan("forward", bufs, p, layout, ptrs(bufs), extras)
    (launch,) = plan.launches
    assert launch.fn.name == kernel and launch.args[-1] is extras and launch.args[-2] is p
    v = configs.select(configs.FORWARD, dtype, 128, 232448, capability=capability,
                       copy_bytes=16)
    assert v.tiles(p) == -(-max_q // v.block_rows) * n * h  # the frame's tiles, every sequence
    if not v.persistent:
        assert launch.blocks == v.tiles(p)
    for name in ("cu_seqlens_q", "cu_seqlens_k"):
        assert launch.args[v.args.index(name)].name == name  # filled in on each run
    assert v.args.index("cu_seqlens_k") == v.args.index("cu_seqlens_q") + 1
    assert_varlen_builds(b)


def assert_varlen_builds(b, varlen=True):
    """Every kernel the backend compiled is a varlen build (FERRO_VARLEN), or none is."""
    assert b.loader.compiled
    for source, name, defines, _ in b.loader.compiled:
        if name not in (configs.SINKS_KERNEL, configs.APPEND_KERNEL):  # (no variants)
            assert (dict(defines).get("FERRO_VARLEN") == 1) == varlen, (source, name)


def test_a_dense_call_passes_no_cu_seqlens():
    b = backend(80)
    q = np.zeros((2, 64, 4, 64), np.float32)
    dims = AttentionDims.new(q, q)
    p = dims.params(AttentionOptions())
    bufs = dict(q=buf(q.shape, FLOAT16), k=buf(q.shape, FLOAT16), v=buf(q.shape, FLOAT16),
                out=buf(q.shape, FLOAT16), mask=None, lse=None, kv_lens=None)
    (launch,) = b.plan("forward", bufs, p, layout_params({"q": q}), ptrs(bufs)).launches
    v = configs.select(configs.FORWARD, FLOAT16, 64, 232448, capability=80, copy_bytes=16)
    assert all(launch.args[v.args.index(n)] is NULL
               for n in ("cu_seqlens_q", "cu_seqlens_k"))
    assert_varlen_builds(b, varlen=False)  # (the dense builds: sequence lengths as parameters)


@pytest.mark.parametrize("design", configs.DECODE_DESIGNS)
@pytest.mark.parametrize("dtype", [FLOAT32, BFLOAT16])
def test_few_query_rows_take_the_decode_kernels_with_cu_seqlens(dtype, design):
    """One query row a sequence (a packed decode step): the decode kernel over (sequence, KV
    head, split), its workspace over the frame's rows, cu_seqlens passed to it and (the tiles
    design) to the combine kernel."""
    b = backend()
    b.table = configs.only(design, configs.TILES)  # (tiles: where the design cannot run)
    n, h = 3, 8
    bufs, p, layout, extras = varlen_call(3, 7000, n, 1, 4000, h, 8, 64, dtype)
    assert configs.decode_wanted(p)
    plan = b.plan("forward", bufs, p, layout, ptrs(bufs), extras)
    first = plan.launches[0]
    assert "decode" in first.fn.name
    names = configs.ARGS[configs.DECODE]
    for name in ("cu_seqlens_q", "cu_seqlens_k"):
        assert first.args[names.index(name)].name == name
    splits = int(first.args[names.index("splits")])
    assert first.blocks == n * 8 * splits
    if "part_o" in plan.workspace:
        assert plan.workspace["part_o"][:2] == (splits, n * h * 1)  # the frame's rows
    if len(plan.launches) > 1:  # the tiles design's combine: a block per frame row
        (combine,) = plan.launches[1:]
        assert combine.fn.name == "flash_decode_combine" and combine.blocks == n * h
        assert [a.name for a in combine.args[5:7]] == ["cu_seqlens_q", "cu_seqlens_k"]
    assert_varlen_builds(b)


FUSED = (configs.FUSED_PRE_KERNEL, "flash_bwd_fused_wgmma", configs.FUSED_POST_KERNEL)


@pytest.mark.parametrize("capability, dtype, fused, kernels", [
    (90, BFLOAT16, False, ("flash_bwd_dq_wgmma", "flash_bwd_dkdv_wgmma")),
    (90, BFLOAT16, True, FUSED),
    (80, FLOAT16, True, ("flash_bwd_dq_half", "flash_bwd_dkdv_half")),
    (90, FLOAT32, True, ("flash_attn_v2_bw_dq", "flash_attn_v2_bw_dkdv"))])
def test_backward_launches_over_the_frame_then_the_sinks(capability, dtype, fused, kernels):
    """dQ over the frame's query tiles and dK/dV over its key tiles (or the fused backward's
    three launches, its dQ workspace over the frame's rows), each taking cu_seqlens; then the
    sinks' launch reads the [heads, total_q] stats through cu_seqlens_q."""
    b = backend(capability)
    b.fused_backward = fused
    n, max_q, max_k, h, hkv = 4, 300, 400, 8, 2
    bufs, _, layout, extras = varlen_call(900, 1000, n, max_q, max_k, h, hkv, 128, dtype,
                                          sinks=True)
    q = np.zeros((900, h, 128), np.float32)
    k = np.zeros((1000, hkv, 128), np.float32)
    opts = AttentionOptions(causal=True)
    p = AttentionDims.packed(q, k, n, max_q, max_k).params_bwd(opts)
    bufs |= dict(grad_out=bufs["q"], grad_q=bufs["q"], grad_k=bufs["k"], grad_v=bufs["k"],
                 grad_sinks=buf((h,), FLOAT32))
    plan = b.plan("backward", bufs, p, layout, ptrs(bufs), extras)
    names = [launch.fn.name for launch in plan.launches]
    assert names == [*kernels, configs.SINKS_KERNEL]
    ops = (("pre", configs.FUSED_PRE_ARGS), ("main", configs.ARGS[configs.BACKWARD_FUSED]),
           ("post", configs.FUSED_POST_ARGS)) if kernels == FUSED else \
        (("dq", configs.ARGS[configs.BACKWARD_DQ]), ("dkdv", configs.ARGS[configs.BACKWARD_DKDV]))
    for launch, (_, args) in zip(plan.launches, ops):
        for name in ("cu_seqlens_q", "cu_seqlens_k"):
            assert launch.args[args.index(name)].name == name
    op = configs.BACKWARD_FUSED if kernels == FUSED else configs.BACKWARD_DKDV
    v = b._kernels[next(key for key in b._kernels if key[0] == op)][0]
    assert plan.launches[1].blocks == -(-max_k // v.block_rows) * n * hkv * v.parts
    if kernels == FUSED:
        q_tiles = -(-max_q // v.step)
        assert plan.launches[0].blocks == plan.launches[2].blocks == n * h * q_tiles
        assert plan.workspace["dq_semaphores"] == (n * h * q_tiles,)
    sinks = plan.launches[-1]
    assert [a.name for a in sinks.args[:4]] == ["stats", "sinks", "grad_sinks", "cu_seqlens_q"]
    assert plan.workspace["stats"][0] >= h * 900  # [heads, total_q] rows fit
    assert_varlen_builds(b)


@pytest.mark.parametrize("fused", [False, True])
def test_backward_without_lse_runs_the_varlen_forward_first(fused):
    """Not given the forward's lse, a varlen backward on sm_90a runs the varlen wgmma forward
    first (the call's extras, cu_seqlens_q / cu_seqlens_k as its arguments), its lse into the
    workspace's LSE_PASS in the [heads, total_q] layout dQ reads and its O into grad_q; the
    backward's wgmma launches then take that lse, and every build is a varlen one."""
    b = backend(90)
    b.fused_backward = fused
    n, max_q, max_k, h, hkv, total_q = 4, 300, 400, 8, 2, 900
    bufs, _, layout, extras = varlen_call(total_q, 1000, n, max_q, max_k, h, hkv, 96, BFLOAT16,
                                          sinks=True)
    q = np.zeros((total_q, h, 96), np.float32)
    k = np.zeros((1000, hkv, 96), np.float32)
    p = AttentionDims.packed(q, k, n, max_q, max_k).params_bwd(AttentionOptions(causal=True))
    bufs |= dict(lse=None, grad_out=buf(q.shape, BFLOAT16), grad_q=buf(q.shape, BFLOAT16),
                 grad_k=bufs["k"], grad_v=bufs["k"], grad_sinks=buf((h,), FLOAT32))
    plan = b.plan("backward", bufs, p, layout, ptrs(bufs), extras)
    kernels = FUSED if fused else ("flash_bwd_dq_wgmma", "flash_bwd_dkdv_wgmma")
    names = [launch.fn.name for launch in plan.launches]
    assert names == ["flash_fwd_wgmma", *kernels, configs.SINKS_KERNEL]
    fwd = plan.launches[0]
    slot = dict(zip(configs.ARGS[configs.FORWARD], fwd.args))
    assert slot["out"].name == "grad_q" and slot["lse"].name == configs.LSE_PASS
    assert slot["cu_seqlens_q"].name == "cu_seqlens_q"
    assert slot["cu_seqlens_k"].name == "cu_seqlens_k"
    assert fwd.args[-1] is extras and int(extras["flags"]) & EXTRAS_VARLEN
    assert plan.workspace[configs.LSE_PASS][0] >= h * total_q  # [heads, total_q] rows fit
    if fused:
        assert plan.launches[1].args[2].name == configs.LSE_PASS  # the pre-kernel's lse
    else:
        dq = dict(zip(configs.ARGS[configs.BACKWARD_DQ], plan.launches[1].args))
        assert dq["lse"].name == configs.LSE_PASS and dq["cu_seqlens_q"].name == "cu_seqlens_q"
    assert_varlen_builds(b)
