"""A paged KV cache on the CUDA backend, planned without a GPU (tests/test_backend_plan.py's fake
device): a decode-shaped paged call plans the decode kernel with `block_table` as an argument
filled in on each run and `page_size` in its AttnExtras; a contiguous call passes no table;
paged prefill (more than DECODE_ROWS query rows a KV group) plans the forward's paged build
(configs.py's `paged`, FERRO_PAGED: the wgmma kernel on sm_90a, mma.sync elsewhere and in
float32), `block_table` after its buffers, its copy width covering the cache's block stride; a
contiguous forward never takes a paged build. The append's plan: its launch first
(append_kv.cu), then the attention, which with RoPE reads the rotated q from the workspace.
tests/test_cuda_paged.py and tests/test_cuda_append.py run the kernels."""

from __future__ import annotations

import numpy as np
import pytest

from ferrocupy import AttentionOptions
from ferrocupy.cuda import configs
from ferrocupy.cuda.launch import NULL
from ferrocupy.dtypes import BFLOAT16, FLOAT16, FLOAT32
from ferrocupy.params import EXTRAS_PAGED, AttentionDims, contiguous_layout
from ferrocupy.plan import AttentionPlan, TensorSpec
from test_backend_plan import backend, buf, forward_buffers, ptrs
from test_model_options import _CudaRecorder


def paged_specs(b, sq, h, hkv, d, page, max_blocks, num_blocks, dtype=BFLOAT16):
    c = lambda shape, dt=dtype: TensorSpec.contiguous(shape, dt, "cpu")  # noqa: E731
    return dict(q=c((b, sq, h, d)), k=c((num_blocks, page, hkv, d)),
                v=c((num_blocks, page, hkv, d)), out=c((b, sq, h, d)),
                kv_lens=c((b,), np.int32), block_table=c((b, max_blocks), np.int32))


@pytest.mark.parametrize("dtype", [FLOAT32, BFLOAT16])
@pytest.mark.parametrize("page", [1, 16, 48, 256])
def test_paged_decode_plans_the_decode_kernel_with_the_table(dtype, page):
    specs = paged_specs(3, 1, 32, 8, 128, page, 4096 // page, 9000 // page + 1, dtype)
    plan = AttentionPlan(_CudaRecorder(), "forward", specs,
                         AttentionOptions(causal=True, causal_offset=4095))
    assert int(plan.extras["page_size"]) == page and int(plan.extras["flags"]) & EXTRAS_PAGED
    assert plan.dims.seq_k == 4096 // page * page  # the capacity
    b = backend()
    bufs = forward_buffers((3, 1, 32, 128), specs["k"].shape, dtype) | dict(
        kv_lens=buf((3,), np.int32, 64), block_table=buf(specs["block_table"].shape, np.int32,
                                                         128))
    made = b.plan("forward", bufs, plan.params, plan.layout, ptrs(bufs), plan.extras)
    launch = made.launches[0]
    names = configs.ARGS[configs.DECODE]
    assert launch.fn.name.startswith("flash_decode")
    assert launch.args[names.index("block_table")].name == "block_table"
    assert launch.args[names.index("kv_lens")].name == "kv_lens"
    # the layout's k rows: block stride page * kv_heads * head_dim, row stride kv_heads * head_dim
    if page > 1:
        assert int(plan.layout["k_s"]) == 8 * 128 and int(plan.layout["k_b"]) == page * 8 * 128


def test_a_contiguous_decode_passes_no_table():
    b = backend()
    q, k = (2, 1, 32, 128), (2, 4096, 8, 128)
    p = AttentionDims.new(np.zeros(q), np.zeros(k)).params(AttentionOptions(causal=True))
    bufs = forward_buffers(q, k, BFLOAT16)
    ((_, _, _, _, args), *_), _ = b._plan_decode(bufs, p, contiguous_layout(p), ptrs(bufs))
    assert args[configs.ARGS[configs.DECODE].index("block_table")] is NULL


@pytest.mark.parametrize("sq,h,hkv", [(1, 32, 8), (4, 16, 4), (16, 2, 2), (17, 2, 2), (9, 4, 2),
                                      (64, 8, 8)])
def test_paged_calls_take_the_decode_kernels_up_to_16_rows_a_group_else_the_paged_forward(
        sq, h, hkv):
    """At most DECODE_ROWS query rows a KV group: decode; more: the forward's paged build
    (nothing refused, nothing falls back to a contiguous copy)."""
    plan, made, compiled = _paged_plan(backend(), sq=sq, h=h, hkv=hkv, d=64, page=16)
    name = made.launches[0].fn.name
    if h // hkv * sq <= configs.DECODE_ROWS:
        assert name.startswith("flash_decode") and "FERRO_PAGED" not in dict(compiled[-1][2])
    else:
        assert name == "flash_fwd_wgmma" and dict(compiled[-1][2])["FERRO_PAGED"] == 1


def _paged_plan(b, *, sq, h, hkv, d, page, dtype=BFLOAT16, opts=None, k=None, mask=False):
    """(engine plan, backend plan, the loader's compiles) of a paged forward: 2 sequences, a
    capacity of 1024 keys, kv_lens; `k`: the cache's TensorSpec (default C-contiguous)."""
    specs = paged_specs(2, sq, h, hkv, d, page, 1024 // page, 2 * (1024 // page) + 1, dtype)
    if k is not None:
        specs |= dict(k=k, v=k)
    if mask:
        specs["mask"] = TensorSpec.contiguous((2, 1, sq, 1024), FLOAT32, "cpu")
    opts = AttentionOptions(causal=True, causal_offset=1024 - sq) if opts is None else opts
    plan = AttentionPlan(_CudaRecorder(), "forward", specs, opts)
    bufs = {n: None if s is None else buf(s.shape, s.dtype) for n, s in plan.specs.items()}
    return plan, b.plan("forward", bufs, plan.params, plan.layout, ptrs(bufs), plan.extras), \
        b.loader.compiled


PREFILL_BUILDS = [  # (capability, dtype): the kernel, its options
    (90, BFLOAT16, "flash_fwd_wgmma", ("-arch=sm_90a",)),
    (90, FLOAT16, "flash_fwd_wgmma", ("-arch=sm_90a",)),
    (80, BFLOAT16, "flash_fwd_half", ()),
    (90, FLOAT32, "flash_attn_v2", ()),
]


@pytest.mark.parametrize("page", [1, 16, 48, 64, 256])
@pytest.mark.parametrize("capability,dtype,kernel,options", PREFILL_BUILDS,
                         ids=["sm90-bf16", "sm90-f16", "sm80-bf16", "sm90-f32"])
def test_paged_prefill_plans_the_forward_s_paged_build(page, capability, dtype, kernel, options):
    b = backend(capability)
    plan, made, compiled = _paged_plan(b, sq=100, h=8, hkv=2, d=128, page=page, dtype=dtype)
    assert int(plan.extras["page_size"]) == page and int(plan.extras["flags"]) & EXTRAS_PAGED
    (launch,) = made.launches
    source, name, defines, opts = compiled[-1]
    assert launch.fn.name == name == kernel and opts == options
    assert dict(defines)["FERRO_PAGED"] == 1 and "FERRO_VARLEN" not in dict(defines)
    forward = configs.ARGS[configs.FORWARD]
    slots = [a.name if hasattr(a, "name") else a for a in launch.args]
    assert slots[len(forward)] == "block_table"  # after the forward's buffers
    assert slots[forward.index("kv_lens")] == "kv_lens"
    v = configs.select(configs.FORWARD, dtype, 128, b._smem_limit, capability=capability,
                       copy_bytes=16, plain=True, paged=True)
    assert v.paged and v.args[len(forward)] == "block_table" and len(launch.args) == len(v.args) + 5
    # the contiguous prefill beside it: the plain build, no table, no FERRO_PAGED
    q, kc = (2, 100, 8, 128), (2, 1024, 2, 128)
    p = AttentionDims.new(np.zeros(q), np.zeros(kc)).params(AttentionOptions(causal=True))
    bufs = forward_buffers(q, kc, dtype)
    (dense,) = b.plan("forward", bufs, p, contiguous_layout(p), ptrs(bufs)).launches
    assert "FERRO_PAGED" not in dict(b.loader.compiled[-1][2])
    assert "block_table" not in [a.name for a in dense.args if hasattr(a, "name")]


@pytest.mark.parametrize("what,capability", [("mask", 80), ("softcap", 80), ("mask", 90),
                                             ("softcap", 90)])
def test_paged_prefill_with_a_mask_or_model_options_takes_those_paged_builds(what, capability):
    """The general paged builds: the mma.sync one without softcap, ALiBi and sinks for a mask,
    with them for softcap; on sm_90a the wgmma general build (which has them)."""
    b = backend(capability)
    opts = AttentionOptions(causal=True, causal_offset=924,
                            softcap=5.0 if what == "softcap" else 0.0)
    _, made, compiled = _paged_plan(b, sq=100, h=8, hkv=2, d=64, page=16, opts=opts,
                                    mask=what == "mask")
    defines = dict(compiled[-1][2])
    assert defines["FERRO_PAGED"] == 1 and "FERRO_PLAIN" not in defines
    mods = what == "softcap" or capability == 90
    assert defines.get("FERRO_MODS") == (1 if mods else None)


@pytest.mark.parametrize("extra,vec,kernel", [(0, 8, "flash_fwd_wgmma"), (8, 8, "flash_fwd_wgmma"),
                                              (2, 2, "flash_fwd_half"), (1, 1, "flash_fwd_half")])
def test_the_copy_width_covers_the_cache_s_block_stride(extra, vec, kernel):
    """A cache whose blocks lie `extra` elements further apart than their rows fill: the
    block stride alone decides the copy width (16, 4 or 2 bytes), and with it the kernel."""
    page, hkv, d = 16, 2, 64
    block = page * hkv * d + extra
    k = TensorSpec((65, page, hkv, d), (block, hkv * d, d, 1), BFLOAT16, "cpu")
    plan, made, _ = _paged_plan(backend(), sq=64, h=4, hkv=hkv, d=d, page=page, k=k)
    assert int(plan.layout["k_b"]) == block
    (launch,) = made.launches
    assert launch.fn.name == kernel and int(launch.args[-5]) == vec  # (then mask kind, layout,
    # the structs)


def test_paged_builds_are_the_forward_s_dense_ones_alone():
    """with_paged: each forward entry's copy, none for another op or a varlen build; every
    forward entry's paged copy is in all_variants (what the compile tests build)."""
    forward = [v for vs in configs.TABLE.values() for v in vs if v.op == configs.FORWARD]
    paged = [v for v in configs.all_variants() if v.paged]
    assert sorted(map(repr, paged)) == sorted(repr(configs.with_paged(v, True)) for v in forward)
    assert all(v.defines["FERRO_PAGED"] == 1 and "FERRO_VARLEN" not in v.defines for v in paged)
    assert all("FERRO_PAGED" not in v.defines for v in configs.all_variants() if not v.paged)
    dq = configs.TABLE[(configs.BACKWARD_DQ, np.dtype(BFLOAT16), 64)][0]
    with pytest.raises(ValueError, match="forward's dense builds alone"):
        configs.with_paged(dq, True)
    with pytest.raises(ValueError, match="forward's dense builds alone"):
        configs.with_paged(configs.with_varlen(forward[0], True), True)


def _append_plan(b, *, sq, rotary_dim, page=None, dtype=BFLOAT16, causal=True):
    """The fake backend's plan of an append of 2 keys a sequence (rotated when `rotary_dim`)
    into a contiguous cache of 64, or paged with `page`; q a strided view (heads outermost)."""
    B, H, HKV, D = 2, 8, 2, 64
    c = lambda shape, dt=dtype: TensorSpec.contiguous(shape, dt, "cpu")  # noqa: E731
    q = TensorSpec((B, sq, H, D), (sq * D, D, B * sq * D, 1), dtype, "cpu")  # heads outermost
    specs = dict(q=q, out=c((B, sq, H, D)), kv_lens=c((B,), np.int32),
                 k_new=c((B, 2, HKV, D)), v_new=c((B, 2, HKV, D)))
    if page:
        specs |= dict(k=c((9, page, HKV, D)), v=c((9, page, HKV, D)),
                      block_table=c((B, 64 // page), np.int32))
    else:
        specs |= dict(k=c((B, 64, HKV, D)), v=c((B, 64, HKV, D)))
    if rotary_dim:
        specs |= dict(rotary_cos=c((80, rotary_dim // 2), FLOAT32),
                      rotary_sin=c((80, rotary_dim // 2), FLOAT32))
    opts = AttentionOptions(causal=causal, causal_offset=64 - sq)
    plan = AttentionPlan(_CudaRecorder(), "forward", specs, opts)
    bufs = {n: None if s is None else buf(s.shape, s.dtype) for n, s in plan.specs.items()}
    return plan, b.plan("forward", bufs, plan.params, plan.layout, ptrs(bufs), plan.extras)


@pytest.mark.parametrize("page, sq", [(None, 1), (None, 40), (16, 1)],
                         ids=["contiguous-decode", "contiguous-prefill", "page16-decode"])
def test_the_append_launches_first_and_the_attention_reads_the_rotated_q(page, sq):
    plan, made = _append_plan(backend(), sq=sq, rotary_dim=32, page=page)
    first, *attention = made.launches
    assert first.fn.name == "append_kv" and attention
    names = [a.name if hasattr(a, "name") else a for a in first.args]
    assert names[:10] == ["q", "k", "v", "k_new", "v_new", configs.Q_ROTATED, "kv_lens",
                          NULL if not page else "block_table", "rotary_cos", "rotary_sin"]
    assert int(first.args[10]) == 1  # float32 tables
    assert first.args[11].tobytes() == plan.layout.tobytes()  # the append reads the call's q
    # q_rot: the rotated q, C-contiguous, in float32 words
    assert made.workspace[configs.Q_ROTATED] == (2 * sq * 8 * 64 * 2 // 4,)
    for launch in attention[:1]:
        slots = [a.name for a in launch.args if hasattr(a, "name")]
        assert configs.Q_ROTATED in slots and "q" not in slots
        lay = next(a for a in launch.args if getattr(a, "dtype", None) == plan.layout.dtype)
        assert (int(lay["q_b"]), int(lay["q_s"]), int(lay["q_h"])) == (sq * 8 * 64,
                                                                     8 * 64 if sq > 1 else 0, 64)
        assert int(lay["k_s"]) == int(plan.layout["k_s"])  # the rest is the call's


def test_an_append_without_rope_reads_q_where_it_lies():
    plan, made = _append_plan(backend(), sq=1, rotary_dim=0)
    first, attention, *_ = made.launches
    assert first.fn.name == "append_kv" and first.args[5] is NULL  # no q_rot
    assert configs.Q_ROTATED not in made.workspace
    assert "q" in [a.name for a in attention.args if hasattr(a, "name")]
    assert int(plan.extras["new_keys"]) == 2


def test_an_append_with_no_query_row_only_writes():
    plan, made = _append_plan(backend(), sq=0, rotary_dim=8)
    assert [launch.fn.name for launch in made.launches] == ["append_kv"]
