"""The CUDA backend's choices that need no GPU: which calls take the decode kernels and how
their keys are split, and which variant every head_dim up to 256 gets within each GPU's shared
memory (ferrocupy/cuda/configs.py)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ferrocupy import AttentionDims, AttentionOptions
from ferrocupy.cuda import configs
from ferrocupy.dtypes import BFLOAT16, FLOAT16, FLOAT32
from ferrocupy.params import extras_params


def test_decode_is_what_the_backend_picks():
    """Which calls take the decode kernels, and their split counts."""
    q = np.zeros((16, 1, 32, 128), np.float32)
    k = np.zeros((16, 32, 8, 128), np.float32)
    p = AttentionDims.new(q, k).params(AttentionOptions())
    assert configs.decode_wanted(p)
    q = np.zeros((16, 5, 32, 128), np.float32)  # 4 heads x 5 rows = 20 > 16
    assert not configs.decode_wanted(AttentionDims.new(q, k).params(AttentionOptions()))
    splits, per = configs.decode_splits(8, 131072, 32, 264)
    assert splits * per >= 131072 and (splits - 1) * per < 131072 and per % 32 == 0
    assert splits * 8 <= 264  # one wave


def _reach(seq_q, seq_k, **o):
    q = np.zeros((1, seq_q, 2, 16), np.float32)
    k = np.zeros((1, seq_k, 2, 16), np.float32)
    opts = AttentionOptions(**o)
    return configs.key_reach(AttentionDims.new(q, k).params(opts), extras_params(opts))


def test_key_reach_matches_the_kernels_rule():
    reach = lambda **o: _reach(5, 300, **o)  # noqa: E731
    assert reach() == 300
    assert reach(causal=True, causal_offset=100) == 105
    assert reach(window=3, causal_offset=100) == 107
    assert reach(causal=True, causal_offset=1000) == 300
    assert reach(window_left=0, window_right=2, causal_offset=100) == 107
    assert reach(window_right=2, causal_offset=100) == 107
    assert reach(window_left=2, causal_offset=100) == 300  # the right side unbounded
    assert reach(causal=True, window_right=7, causal_offset=100) == 105  # causal bounds it
    assert reach(causal=True, causal_offset=-3) == 2
    assert reach(causal=True, causal_offset=-10) == 0  # every row dead: nothing is read
    assert reach(window_right=1, causal_offset=-8) == 0


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 8), st.integers(0, 12), st.booleans(), st.integers(-14, 14),
       st.integers(-1, 5), st.integers(-1, 5))
def test_key_reach_is_one_past_the_last_key_any_row_sees(seq_q, seq_k, causal, offset, left,
                                                         right):
    """SPEC's rule by brute force: the last visible key + 1 (0 when none is), no further."""
    seen = [j for j in range(seq_k) for i in range(seq_q)
            if (not causal or j <= i + offset) and (left < 0 or j >= i + offset - left)
            and (right < 0 or j <= i + offset + right)]
    got = _reach(seq_q, seq_k, causal=causal, causal_offset=offset, window_left=left,
                 window_right=right)
    assert max(seen, default=-1) < got <= seq_k
    if right >= 0 or causal:  # a bounded right side: exact (bar keys before the first seen)
        assert got == min(seq_k, max(0, seq_q - 1 + offset + (0 if causal else right) + 1))


def test_decode_splits_fill_one_wave_and_cover_every_key():
    for pairs, keys, slots in [(128, 32768, 264), (8, 131072, 264), (512, 2048, 264),
                               (1, 100, 264), (3, 5000, 528)]:
        splits, per = configs.decode_splits(pairs, keys, 32, slots)
        assert per % 32 == 0 and splits * per >= keys and (splits - 1) * per < keys
        assert per >= 4 * 32 or splits == 1


# --- every head_dim up to SPEC's 256 --------------------------------------------------------------
ATTENTION_OPS = (configs.FORWARD, configs.BACKWARD_DQ, configs.BACKWARD_DKDV, configs.DECODE)
DTYPES = (FLOAT32, FLOAT16, BFLOAT16)
# (bytes of shared memory per block, compute capability): sm_80's and sm_90's opt-in limits
LIMITS = ((163 * 1024, 80), (227 * 1024, 90))


def _selections(op, dtype, hd, limit, cap):
    """Every variant select returns for one (op, dtype, head_dim, GPU), over copy widths,
    decode rows, many or few decode blocks, plain calls, model options and lse given or not."""
    for copy_bytes in (16, 4, 2):
        for rows in ((1, 4, 5, 8, 16) if op == configs.DECODE else (0,)):
            for many, plain, mods, lse in itertools.product((False, True), repeat=4):
                yield configs.select(op, dtype, hd, limit, capability=cap, copy_bytes=copy_bytes,
                                     rows=rows, many_blocks=many, plain=plain and not mods,
                                     mods=mods, lse_given=lse)


@pytest.mark.parametrize("op", ATTENTION_OPS)
def test_every_head_dim_up_to_256_has_a_variant_within_the_limits(op):
    """sm_80 and sm_90 take every head_dim 1..256 in every dtype: a variant at least as wide
    (mma.sync's: the padded head_dim) that fits the GPU's shared memory; above 128 the wgmma
    forward and dQ at width 192 or 256, the wgmma dK/dV at 256 with its columns split between
    the warpgroups (a block of 64 keys), the mma.sync dK/dV in two column ranges."""
    for dtype in DTYPES:
        for hd in range(1, 257):
            for limit, cap in LIMITS:
                for v in _selections(op, dtype, hd, limit, cap):
                    assert v.head_dim >= hd, v.describe()  # wgmma's: 64-256 (zero-filled)
                    assert v.isa == configs.WGMMA or v.head_dim == configs.padded_head_dim(hd)
                    assert v.shared_bytes <= limit, v.describe()
                    if hd > 128 and v.isa == configs.WGMMA:
                        assert v.head_dim == 256 if op == configs.BACKWARD_DKDV \
                            else v.head_dim in (192, 256)
                    wide_mma = op == configs.BACKWARD_DKDV and hd > 128 and v.isa == configs.MMA
                    assert v.parts == (2 if wide_mma else 1)
                    assert v.split_columns == (op == configs.BACKWARD_DKDV and hd > 128
                                               and v.isa == configs.WGMMA)
                    assert v.block_rows == (64 if v.split_columns else 16 * v.mt * v.warps)


def test_sm86_takes_every_head_dim_but_float32_backward_and_wide_decode_groups():
    """sm_86 / sm_89 (99 KB a block) take every head_dim in half precision, and in float32 the
    forward and decode of up to 8 rows a group; above 144 the float32 backward and, above 160,
    float32 decode of 9-16 rows a group need more: an error naming the op, dtype, head_dim and
    the bytes, before anything runs."""
    limit = 99 * 1024
    for op in ATTENTION_OPS:
        for dtype in DTYPES:
            for hd in range(1, 257):
                for rows in ((1, 8, 16) if op == configs.DECODE else (0,)):
                    short = dtype == FLOAT32 and (
                        (op in (configs.BACKWARD_DQ, configs.BACKWARD_DKDV) and hd > 144)
                        or (op == configs.DECODE and rows > 8 and hd > 160))
                    if not short:
                        assert configs.select(op, dtype, hd, limit, capability=86,
                                              copy_bytes=16, rows=rows).shared_bytes <= limit
                        continue
                    with pytest.raises(ValueError, match=rf"{op} in float32 at head_dim {hd}\b"
                                                         rf".* needs at least \d+ bytes of "
                                                         rf"shared memory per block; this GPU "
                                                         rf"allows {limit}"):
                        configs.select(op, dtype, hd, limit, capability=86, copy_bytes=16,
                                       rows=rows)


def test_the_table_keeps_head_dims_up_to_128_as_they_were():
    """The variants of head_dim <= 128 carry no define the wide ones added (dK/dV's column
    parts; the combine kernel's block stays 128 threads), and wgmma serves 64 and 128 still;
    above 128 the wgmma forward and dQ are built at 192 or 256, the wgmma dK/dV at 256 (its
    columns split between the warpgroups), the mma.sync dK/dV in two column ranges."""
    for (op, dtype, dp), vs in configs.TABLE.items():
        for v in vs:
            if dp <= 128:
                assert v.parts == 1 and "FERRO_DKDV_PARTS" not in v.defines, v.describe()
                assert v.combine_threads == configs.COMBINE_THREADS
            elif v.isa == configs.WGMMA:
                assert v.head_dim in ((256,) if op == configs.BACKWARD_DKDV else (192, 256))
                assert v.parts == 1 and v.split_columns == (op == configs.BACKWARD_DKDV)
            else:
                assert v.combine_threads >= v.head_dim
            assert v.shared_bytes <= configs.MAX_SHARED_BYTES, v.describe()
    big = 227 * 1024
    for hd in (64, 128):
        assert configs.select(configs.FORWARD, BFLOAT16, hd, big, capability=90,
                              copy_bytes=16).isa == configs.WGMMA
    assert configs.select(configs.FORWARD, BFLOAT16, 129, big, capability=90,
                          copy_bytes=16).head_dim == 192
    dkdv = configs.select(configs.BACKWARD_DKDV, BFLOAT16, 129, big, capability=90, copy_bytes=16)
    assert dkdv.isa == configs.WGMMA and dkdv.head_dim == 256 and dkdv.split_columns
    assert "FERRO_DKDV_PARTS" not in dkdv.defines
    assert configs.select(configs.BACKWARD_DKDV, BFLOAT16, 129, big, capability=80,
                          copy_bytes=16).parts == 2


def test_dkdv_column_parts_double_its_blocks():
    """Two column ranges of dK/dV: a block each, both of every key tile."""
    q = np.zeros((2, 300, 8, 200), np.float32)
    k = np.zeros((2, 500, 2, 200), np.float32)
    p = AttentionDims.new(q, k).params(AttentionOptions())
    v = configs.select(configs.BACKWARD_DKDV, BFLOAT16, 200, 163 * 1024, capability=80,
                       copy_bytes=16)
    assert v.parts == 2 and v.defines["FERRO_DKDV_PARTS"] == 2
    assert v.tiles(p) == -(-500 // v.block_rows) * 2 * 2 * 2
    assert v.blocks(p, 132) == v.tiles(p)
