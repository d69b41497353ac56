"""A paged KV cache on the CUDA backend, planned without a GPU (tests/test_backend_plan.py's fake
device): a decode-shaped paged call plans the decode kernel with `block_table` as an argument
filled in on each run and `page_size` in its AttnExtras; a contiguous call passes no table;
paged prefill (more than DECODE_ROWS query rows a KV group) stays refused, by name, before
anything is planned. The append's plan: its launch first (append_kv.cu), then the attention,
which with RoPE reads the rotated q from the workspace. tests/test_cuda_paged.py and
tests/test_cuda_append.py run the kernels."""

from __future__ import annotations

import numpy as np
import pytest

from ferrocupy import AttentionOptions
from ferrocupy.cuda import configs
from ferrocupy.cuda.launch import NULL
from ferrocupy.dtypes import BFLOAT16, FLOAT32
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


@pytest.mark.parametrize("sq,h,hkv,refused", [(1, 32, 8, False), (4, 16, 4, False),
                                              (16, 2, 2, False), (17, 2, 2, True),
                                              (9, 4, 2, True), (64, 8, 8, True)])
def test_paged_calls_plan_exactly_where_the_decode_kernels_take_them(sq, h, hkv, refused):
    """At most DECODE_ROWS query rows a KV group: decode (planned); more: prefill, refused
    naming block_table and the rows; never a silent fallback."""
    specs = paged_specs(2, sq, h, hkv, 64, 16, 4, 10)
    rec = _CudaRecorder()
    rows = h // hkv * sq
    assert (rows > configs.DECODE_ROWS) == refused
    if refused:
        with pytest.raises(ValueError, match=rf"block_table \(shape \(2, 4\)\), a paged KV cache "
                                             rf"with {rows} query rows per KV group"):
            AttentionPlan(rec, "forward", specs, AttentionOptions())
    else:
        AttentionPlan(rec, "forward", specs, AttentionOptions())


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
