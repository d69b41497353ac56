"""SPEC part 2's paged KV cache on the reference backend (forward only): `k`, `v` as
`[num_blocks, page_size, Hkv, D]` read through `block_table`, against the independent dense
float64 oracle (tests/dense_options.py) on the pages gathered into a contiguous cache; every
page size; blocks no sequence reaches hold NaN and block-table entries past a sequence's reach
hold garbage, neither read; hypothesis over page sizes, tables and options; bad block ids and
shapes refused by name with nothing written; the CUDA backend plans paged decode and paged
prefill, and refuses a bad block table before any launch (tests/test_cuda_paged.py and
tests/test_cuda_paged_prefill.py run them on the GPU)."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dense_options import dense, per_head_inputs
from ferrocupy import AttentionOptions, ComputeEngine
from helpers import poison
from test_model_options import _CudaRecorder, _close, _keep, _oracle_options

torch = pytest.importorskip("torch")


def _eng():
    return ComputeEngine("reference", quiet=True)


def paged_case(rng, b, sq, h, hkv, d, page_size, max_blocks, kv_lens, *, spare_blocks=2,
               alibi=None, sinks=False, mask=False):
    """A paged cache whose blocks are a random permutation (plus spare blocks nobody uses, full
    of NaN); each table row names only the blocks its sequence reaches and -1 past them."""
    used = [-(-n // page_size) for n in kv_lens]
    num_blocks = sum(used) + spare_blocks
    order = rng.permutation(num_blocks)
    k_cache = np.full((num_blocks, page_size, hkv, d), np.nan, np.float32)
    v_cache = np.full_like(k_cache, np.nan)
    table = np.full((b, max_blocks), -1, np.int32)
    at = 0
    for i, n in enumerate(used):
        table[i, :n] = order[at:at + n]
        at += n
    for i, n in enumerate(kv_lens):  # the slots sequence i holds; the rest stays NaN
        for j in range(n):
            blk, row = table[i, j // page_size], j % page_size
            k_cache[blk, row] = rng.standard_normal((hkv, d))
            v_cache[blk, row] = rng.standard_normal((hkv, d))
    t = dict(q=rng.standard_normal((b, sq, h, d), dtype=np.float32), k=k_cache, v=v_cache,
             block_table=table, kv_lens=np.array(kv_lens, np.int32))
    t |= per_head_inputs(rng, b, h, alibi=alibi, sinks=sinks)
    if mask:
        t["mask"] = rng.standard_normal((b, 1, sq, max_blocks * page_size)).astype(np.float32)
    return t


def gathered(t):
    """The contiguous `[B, capacity, Hkv, D]` cache the pages stand for (0 where a table entry
    names no block: past a sequence's reach, those keys do not exist)."""
    table, page = t["block_table"], t["k"].shape[1]
    out = []
    for name in ("k", "v"):
        blocks = t[name]
        rows = [np.concatenate([blocks[blk] if 0 <= blk < len(blocks) else
                                np.zeros_like(blocks[0]) for blk in row]) for row in table]
        out.append(np.stack(rows))
    assert out[0].shape[1] == table.shape[1] * page
    return out


def forward(eng, t, opts):
    out = poison(np.empty_like(t["q"]))
    lse = poison(np.empty((t["q"].shape[0], t["q"].shape[2], t["q"].shape[1]), np.float32))
    eng.flash_attention_v2_with(t["q"], t["k"], t["v"], out, opts, t.get("mask"), lse=lse,
                                kv_lens=t.get("kv_lens"), block_table=t["block_table"],
                                alibi_slopes=t.get("alibi_slopes"), sinks=t.get("sinks"))
    return out, lse


def check(t, opts):
    out, lse = forward(_eng(), t, opts)
    k, v = gathered(t)
    dense_t = dict(q=t["q"], k=k)
    keep = _keep(opts, dense_t)
    want_out, want_lse = dense(t["q"], np.nan_to_num(k), np.nan_to_num(v), sinks=t.get("sinks"),
                               **_oracle_options(opts, alibi_slopes=t.get("alibi_slopes"),
                                                 mask=t.get("mask"), kv_lens=t.get("kv_lens"),
                                                 keep=keep, dropout_prob=opts.dropout_prob))
    _close(out, want_out.numpy(), what="out")
    _close(lse, want_lse.numpy(), what="lse")


@pytest.mark.parametrize("page_size", [1, 3, 4, 16])
@pytest.mark.parametrize("name, o, tensors", [
    ("decode", dict(causal=True, causal_offset="bottom-right"), dict(alibi="bh", sinks=True)),
    ("prefill-window-softcap", dict(causal=True, causal_offset="bottom-right", window_left=3,
                                    softcap=2.0), {}),
    ("plain-dropout-mask", dict(dropout_prob=0.3, seed=9), dict(mask=True, alibi="h")),
])
def test_pages_against_the_dense_oracle(rng, page_size, name, o, tensors):
    sq = 1 if name == "decode" else 4
    max_blocks = -(-13 // page_size) + 1  # one table column past every sequence's reach
    t = paged_case(rng, 3, sq, 4, 2, 8, page_size, max_blocks, [13, 0, 5], **tensors)
    if o.get("causal_offset") == "bottom-right":
        o = o | dict(causal_offset=max_blocks * page_size - sq)
    check(t, AttentionOptions(**o))


def test_without_kv_lens_every_slot_is_a_key(rng):
    t = paged_case(rng, 2, 3, 2, 1, 8, 4, 3, [12, 12])
    del t["kv_lens"]
    check(t, AttentionOptions(causal=True, causal_offset=9))


def test_paged_equals_the_contiguous_call(rng):
    """Same answer, bit for bit, as the engine's contiguous call on the gathered cache."""
    t = paged_case(rng, 2, 2, 4, 2, 8, 5, 3, [11, 7], alibi="h", sinks=True)
    opts = AttentionOptions(causal=True, causal_offset=13, softcap=4.0)
    out, lse = forward(_eng(), t, opts)
    k, v = gathered(t)
    want, want_lse = np.empty_like(out), np.empty_like(lse)
    _eng().flash_attention_v2_with(t["q"], k, v, want, opts, lse=want_lse, kv_lens=t["kv_lens"],
                                   alibi_slopes=t["alibi_slopes"], sinks=t["sinks"])
    np.testing.assert_array_equal(out, want)
    np.testing.assert_array_equal(lse, want_lse)


@st.composite
def paged_calls(draw):
    b, page = draw(st.integers(1, 3)), draw(st.integers(1, 6))
    max_blocks = draw(st.integers(1, 4))
    kv_lens = draw(st.lists(st.integers(0, max_blocks * page), min_size=b, max_size=b))
    hkv = draw(st.sampled_from([1, 2]))
    o = dict(causal=draw(st.booleans()), causal_offset=draw(st.integers(-3, 12)))
    if draw(st.booleans()):
        o["window_left"] = draw(st.sampled_from([None, 0, 2]))
        o["window_right"] = draw(st.sampled_from([None, 1]))
    o["softcap"] = draw(st.sampled_from([0.0, 1.0]))
    if draw(st.booleans()):
        o.update(dropout_prob=0.25, seed=draw(st.integers(0, 2**40)))
    tensors = dict(alibi=draw(st.sampled_from([None, "h", "bh"])), sinks=draw(st.booleans()))
    return (b, draw(st.integers(1, 4)), hkv * draw(st.sampled_from([1, 2])), hkv,
            draw(st.sampled_from([4, 8])), page, max_blocks, kv_lens, o, tensors,
            draw(st.integers(0, 2**32 - 1)))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(paged_calls())
def test_random_pages(call):
    *dims, o, tensors, seed = call
    t = paged_case(np.random.default_rng(seed), *dims, **tensors)
    check(t, AttentionOptions(**o))


# --- bad inputs ----------------------------------------------------------------------------------
def _bad_calls(rng):
    t = paged_case(rng, 2, 1, 2, 1, 8, 4, 3, [9, 2], spare_blocks=0)  # 3 + 1 blocks
    table = t["block_table"]
    with_table = lambda **c: dict(block_table=table.copy()) | c  # noqa: E731
    bad_id = table.copy()
    bad_id[0, 2] = 4
    negative = table.copy()
    negative[1, 0] = -1
    return t, [
        (with_table(block_table=bad_id), ValueError,
         r"block_table\[0, 2\] = 4 is not a block of the cache \(k shape: 4 blocks of 4\); "
         r"sequence 0 reaches 9 keys \(3 blocks\)"),
        (with_table(block_table=negative), ValueError, r"block_table\[1, 0\] = -1 is not a block"),
        (with_table(kv_lens=np.array([13, 2], np.int32)), ValueError,
         r"kv_lens\[0\] = 13 is outside \[0, seq_k = 12\]"),
        (with_table(block_table=table.astype(np.int64)), TypeError,
         r"block_table has dtype int64 \(shape \(2, 3\)\); it must be int32"),
        (with_table(block_table=table[:1]), ValueError,
         r"block_table shape \(1, 3\) must be \[batch, max_blocks\] with batch = 2"),
        (with_table(block_table=table.reshape(-1)), ValueError,
         r"block_table shape \(6,\) must be \[batch, max_blocks\]"),
        (with_table(k=t["k"][:, :0], v=t["v"][:, :0]), ValueError,
         r"page_size must be at least 1, got k shape \(4, 0, 1, 8\)"),
        (with_table(v=t["v"][:, :2]), ValueError,
         r"v shape \(4, 2, 1, 8\) must equal k shape \(4, 4, 1, 8\)"),
        (with_table(k=t["k"][0]), ValueError,
         r"with block_table, k must be \[num_blocks, page_size, kv_heads, head_dim\], got shape "
         r"\(4, 1, 8\)"),
        (with_table(block_table=np.broadcast_to(table[:1], (2, 3))), ValueError,
         r"block_table \(shape \(2, 3\)\) is not C-contiguous"),
    ]


def test_bad_inputs_raise_naming_the_argument_and_write_nothing(rng):
    t, cases = _bad_calls(rng)
    eng = _eng()
    for change, err, match in cases:
        args = dict(k=t["k"], v=t["v"], kv_lens=t["kv_lens"]) | change
        out, lse = np.zeros_like(t["q"]), np.zeros((2, 2, 1), np.float32)
        k, v = args.pop("k"), args.pop("v")
        with pytest.raises(err, match=match):
            eng.flash_attention_v2_with(t["q"], k, v, out, AttentionOptions(), lse=lse, **args)
        assert not out.any() and not lse.any()


def test_unreached_table_entries_are_never_read(rng):
    """Entries past each sequence's reach may be anything (flash-attn's tables hold garbage
    there); the blocks they would name are never read."""
    t = paged_case(rng, 2, 2, 2, 1, 8, 4, 4, [5, 0], spare_blocks=1)
    t["block_table"][0, 2:] = [2**31 - 1, -7]
    t["block_table"][1, :] = -2**31
    check(t, AttentionOptions(causal=True, causal_offset=14))


def test_the_backward_takes_no_block_table(rng):
    t = paged_case(rng, 1, 2, 2, 1, 8, 4, 2, [5])
    eng = _eng()
    with pytest.raises(TypeError, match="block_table"):
        eng.flash_attention_v2_backward_with(t["q"], t["k"], t["v"], t["q"], t["q"],
                                             *(np.zeros_like(t[n]) for n in ("q", "k", "v")),
                                             block_table=t["block_table"])


def test_out_sharing_the_cache_is_refused(rng):
    t = paged_case(rng, 1, 4, 2, 1, 8, 4, 2, [5])
    out = t["k"].reshape(-1)[:t["q"].size].reshape(t["q"].shape)
    with pytest.raises(ValueError, match=r"out \(shape \(1, 4, 2, 8\)\) shares memory with k"):
        forward_into(t, out)


def forward_into(t, out):
    _eng().flash_attention_v2_with(t["q"], t["k"], t["v"], out, kv_lens=t["kv_lens"],
                                   block_table=t["block_table"])


# --- CUDA: paged KV on the decode and forward kernels; bad tables refused before any launch ------
class _CudaRunner(_CudaRecorder):
    """The CUDA stand-in with a run: index tensors read from host memory, runs recorded (nothing
    computed)."""

    def __init__(self):
        super().__init__()
        self.runs = []

    def current_stream(self) -> int:
        return 0

    def read_int32(self, ptr: int, n: int, stream: int) -> np.ndarray:
        return (np.ctypeslib.as_array((ctypes.c_int32 * n).from_address(ptr)).copy() if n
                else np.empty(0, np.int32))

    def run_plan(self, plan, ptrs, stream, *args, **kwargs) -> None:
        self.runs.append(str(plan))


@pytest.mark.parametrize("sq", [1, 9], ids=["decode", "prefill"])
def test_cuda_backend_runs_paged_calls_and_refuses_bad_tables_before_any_launch(rng, sq):
    """A KV group of 2 rows (decode) or 18 (prefill, the forward's paged build): planned and
    run; every bad table of _bad_calls refused by name before the plan runs, nothing written."""
    eng = _eng()
    eng.backend = rec = _CudaRunner()
    t, cases = _bad_calls(rng)
    t["q"] = rng.standard_normal((2, sq, 2, 8), dtype=np.float32)
    for change, err, match in cases:
        if "block_table" not in match:
            continue
        args = dict(k=t["k"], v=t["v"], kv_lens=t["kv_lens"]) | change
        out = np.zeros_like(t["q"])
        k, v = args.pop("k"), args.pop("v")
        with pytest.raises(err, match=match):
            eng.flash_attention_v2_with(t["q"], k, v, out, **args)
        assert not out.any() and rec.runs == []
    eng.flash_attention_v2_with(t["q"], t["k"], t["v"], np.zeros_like(t["q"]),
                                kv_lens=t["kv_lens"], block_table=t["block_table"])
    assert rec.plans == rec.runs == ["forward"]
