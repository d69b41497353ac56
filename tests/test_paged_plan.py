"""A paged KV cache on the CUDA backend, planned without a GPU (tests/test_backend_plan.py's fake
device): a decode-shaped paged call plans the decode kernel with `block_table` as an argument
filled in on each run and `page_size` in its AttnExtras; a contiguous call passes no table;
paged prefill (more than DECODE_ROWS query rows a KV group) and the append stay refused, by
name, before anything is planned. tests/test_cuda_paged.py runs the kernels."""

from __future__ import annotations

import numpy as np
import pytest

from ferrocupy import AttentionOptions, ComputeEngine
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


def test_the_append_is_still_refused_on_cuda(rng):
    eng = ComputeEngine("reference", quiet=True)
    eng.backend = rec = _CudaRecorder()
    q = np.zeros((2, 1, 4, 8), np.float32)
    cache = np.zeros((2, 16, 2, 8), np.float32)
    new = np.zeros((2, 1, 2, 8), np.float32)
    with pytest.raises(ValueError, match=r"k_new \(shape \(2, 1, 2, 8\)\), a KV-cache append"):
        eng.plan_attention_with_kvcache(q, cache, cache.copy(), np.zeros_like(q),
                                        cache_seqlens=np.zeros(2, np.int32), k_new=new,
                                        v_new=new.copy())
    assert rec.plans == []
