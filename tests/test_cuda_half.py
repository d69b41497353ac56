"""float16 and bfloat16 attention and RoPE on the GPU (issue 8): SPEC's half-precision accuracy
rule (at most twice the error of plain PyTorch in the same dtype, against float64) for out, lse
and the three gradients, over the float32 suite's option covering; lse given to the backward;
dropout's keep mask bit-identical across dtypes.

Skipped unless `ferrocupy.cuda_available()`; `FERRO_GPU_TESTS_ON_REFERENCE=1` runs it with the
reference standing in for the device (see tests/gpu_helpers.py). PyTorch (the CPU build is
enough) supplies the plain same-dtype computation; without it the rule's tests skip.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from ferrocupy import AttentionOptions
from ferrocupy.dtypes import BFLOAT16, FLOAT16, FLOAT32
from gpu_helpers import (AttnCase, DEAD_ROW_CASES, DROPOUT_SEED, check_forward_with_lse,
                         dead_rows, decoders, dev, gpu_pytestmark, grad_floors, kernels,
                         make_case, needs_real_gpu, option_case, option_rows, ref,
                         restricted_device, self_check)
from half_rule import check_rule, inherited_errors, rounded, torch_plain, x64

__all__ = ["decoders", "dev", "kernels", "ref"]

pytestmark = gpu_pytestmark()

HALF = [pytest.param(FLOAT16, id="f16"), pytest.param(BFLOAT16, id="bf16")]
ULP = {FLOAT16: 2.0**-10, BFLOAT16: 2.0**-7}  # relative spacing of the mantissa


def _torch_device() -> str:
    torch = pytest.importorskip("torch", reason="the half-precision rule compares with PyTorch")
    return "cuda" if (not self_check() and torch.cuda.is_available()) else "cpu"


def run(d, case: AttnCase, backward: bool = True, give_lse: bool = True) -> dict:
    """Forward (with lse) and, with `backward`, the backward given the device's own out (and
    lse, when `give_lse`), every output NaN-poisoned first. Host arrays."""
    b, sq, h, dd, sk, hkv = case.dims
    q, k, v, go, mask = (d.put(x) for x in (case.q, case.k, case.v, case.grad_out, case.mask))
    dt = case.q.dtype
    out = d.poisoned(case.q.shape, dtype=dt)
    lse = d.poisoned((b, h, sq), dtype=np.float32)
    d.engine.flash_attention_v2_with(q, k, v, out, case.opts, mask, lse=lse)
    res = {"out": d.get(out), "lse": d.get(lse)}
    if backward:
        gq = d.poisoned(case.q.shape, dtype=dt)
        gk, gv = d.poisoned(case.k.shape, dtype=dt), d.poisoned(case.k.shape, dtype=dt)
        d.engine.flash_attention_v2_backward_with(q, k, v, out, go, gq, gk, gv, case.opts, mask,
                                                  lse=lse if give_lse else None)
        res.update(grad_q=d.get(gq), grad_k=d.get(gk), grad_v=d.get(gv))
    return res


def check_half(dev, case, backward: bool = True, give_lse: bool = True) -> dict:
    """The device meets SPEC's rule on every output; rows that see nothing are exactly 0."""
    got = run(dev, case, backward, give_lse)
    want = x64(case, backward)
    theirs = torch_plain(case, _torch_device(), backward)
    what = case.describe() + f" dtype={case.q.dtype} mask dtype=" + (
        "-" if case.mask is None else str(case.mask.dtype))
    floors = grad_floors(case) if backward else {}
    inherited = inherited_errors(case, want) if backward else {}
    ulp = ULP[np.dtype(case.q.dtype)]
    errs = {n: check_rule(n, got[n], want[n], theirs[n], what, floors.get(n, 0.0), ulp,
                          inherited.get(n, 0.0))
            for n in got}
    dead = dead_rows(case)
    if dead.any():
        assert (got["out"][dead].astype(np.float32) == 0).all(), f"dead rows not 0 {what}"
    return errs


# --- the option covering, in each half dtype ------------------------------------------------------

@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("row", option_rows())
def test_half_option_combinations(kernels, rng, row, dtype):
    case = option_case(rng, row)
    # Alternate the mask between float32 and the data dtype (both are allowed).
    mask_dtype = dtype if row["d"] in (16, 64) else FLOAT32
    check_half(kernels, rounded(case, dtype, mask_dtype))


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("seq,d,causal", [(1024, 128, True), (1000, 64, False), (513, 96, True)],
                         ids=["s1024-d128-causal", "s1000-d64", "s513-d96-causal"])
def test_half_long_sequences(kernels, rng, dtype, seq, d, causal):
    case = make_case(rng, b=1, sq=seq, sk=seq, h=2, hkv=1, d=d, causal=causal, qk_scale=1.0)
    check_half(kernels, rounded(case, dtype))


WARPGROUP_RANGE_CASES = {
    # The wgmma forward's three warpgroups each visit only the key tiles their 64 rows see, and
    # one whose rows do not exist none: at 1000 rows one 192-row block has 40 rows (the last
    # block, or under causal the first), so two of its warpgroups are idle. A window makes a warpgroup start past the block's first
    # tile; causal + offset ends each one at a different tile; with a mask or dropout the
    # general kernel runs, without them the plain one.
    "window150": dict(window=150),
    "causal-offset37-window300": dict(causal=True, causal_offset=37, window=300),
    "causal-mask": dict(causal=True, mask="1,H,Sq,Sk", neg_inf=0.05),
    "window150-dropout": dict(window=150, dropout_prob=0.2, seed=DROPOUT_SEED),
}


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("d", [64, 128], ids=lambda d: f"d{d}")
@pytest.mark.parametrize("opts", WARPGROUP_RANGE_CASES.values(), ids=WARPGROUP_RANGE_CASES.keys())
def test_half_forward_warpgroup_key_ranges(kernels, rng, dtype, d, opts):
    case = make_case(rng, b=1, sq=1000, sk=1000, h=2, hkv=1, d=d, qk_scale=1.0, **opts)
    check_half(kernels, rounded(case, dtype), backward=False)


MASK_IN_DTYPE_CASES = {
    # The additive mask in the data dtype on the wgmma forward (the general build), on the
    # wholly visible tiles' fast path (add_mask_row: a lane's two keys in one 4-byte load where
    # every pair is aligned, even seq_k; two 2-byte loads where rows start at odd offsets, odd
    # seq_k) and on the causal edge's per-element path.
    "bias-1HSS-even": dict(sk=1024, mask="1,H,Sq,Sk"),
    "bias-1HSS-odd": dict(sk=1001, mask="1,H,Sq,Sk"),
    "causal-B1SS-even": dict(sk=1024, mask="B,1,Sq,Sk", causal=True),
    "causal-B1SS-odd": dict(sk=1001, mask="B,1,Sq,Sk", causal=True),
}


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("d", [64, 128], ids=lambda d: f"d{d}")
@pytest.mark.parametrize("opts", MASK_IN_DTYPE_CASES.values(), ids=MASK_IN_DTYPE_CASES.keys())
def test_half_forward_mask_in_the_data_dtype(kernels, rng, dtype, d, opts):
    case = make_case(rng, b=2, sq=600, h=2, hkv=1, d=d, qk_scale=1.0, **opts)
    check_half(kernels, rounded(case, dtype, mask_dtype=dtype), backward=False)


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("d", [64, 128], ids=lambda d: f"d{d}")
@pytest.mark.parametrize("opts", [{}, dict(mask="B,1,Sq,Sk", dropout_prob=0.1, seed=DROPOUT_SEED),
                                  dict(causal=True, causal_offset=11)],
                         ids=["plain", "mask-dropout", "causal-offset"])
def test_half_forward_many_tiles_per_block(kernels, rng, dtype, d, opts):
    """More query tiles than SMs (5 x 72 = 360 of 192 rows): the persistent wgmma forward's
    blocks each claim several through one ring of K/V buffers and one Q buffer; causal tiles end
    at seq_q, the short one holding the first rows. 830 keys make 7 tiles at d64 and 13 at d128,
    neither a multiple of the 3 buffers, so each query tile starts the ring where the last one
    left it."""
    case = make_case(rng, b=3, sq=830, sk=830, h=24, hkv=6, d=d, qk_scale=1.0, **opts)
    check_half(kernels, rounded(case, dtype), backward=False)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_persistent_forward_on_concurrent_streams_and_repeated(dev, rng, causal):
    """The persistent forward's blocks claim tiles from their stream's counter, which each launch
    leaves at 0: calls repeated on one stream, and calls on two streams at once (each its own
    counter), give the default stream's bits; an unreset or shared counter leaves tiles unwritten
    (NaN) or written twice by a later call's blocks."""
    needs_real_gpu()
    import cupy

    b, sq, h, d = 3, 830, 24, 64  # 360 tiles of 192 rows: several per block
    opts = AttentionOptions(causal=causal)
    cases = [[dev.put(rng.standard_normal((b, sq, h, d)).astype(BFLOAT16)) for _ in range(3)]
             for _ in range(2)]

    def call(case):
        out = dev.poisoned((b, sq, h, d), dtype=BFLOAT16)
        dev.engine.flash_attention_v2_with(*case, out, opts)
        return out

    want = [dev.get(call(c)) for c in cases]
    for _ in range(3):  # repeated on the default stream
        assert all(np.array_equal(dev.get(call(c)), w, equal_nan=True) for c, w in zip(cases, want))
    streams = [cupy.cuda.Stream(non_blocking=True) for _ in cases]
    outs = []
    for _ in range(3):  # both streams at once, three calls each
        for c, st in zip(cases, streams):
            with st:
                outs.append(call(c))
    dev.sync()
    for i, out in enumerate(outs):
        assert np.array_equal(dev.get(out), want[i % 2], equal_nan=True), f"call {i}"
    assert not np.isnan(want[0].astype(np.float32)).any()


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("d", [64, 128], ids=lambda d: f"d{d}")
@pytest.mark.parametrize("opts", [dict(causal=True, causal_offset=30), dict(window=100),
                                  dict(causal=True, window=70, causal_offset=5)],
                         ids=["causal-offset30", "window100", "causal-window70"])
def test_half_backward_key_blocks(kernels, rng, dtype, d, opts):
    """The dK/dV kernels (on sm_90a without mask or dropout, the wgmma one: two warpgroups of 64
    keys, query tiles of 64 rows from a ring of two) at lengths that are not multiples of any
    tile, GQA 4, each key seeing a different span of rows."""
    case = make_case(rng, b=2, sq=333, sk=461, h=8, hkv=2, d=d, qk_scale=1.0, **opts)
    check_half(kernels, rounded(case, dtype))


MASK_DROPOUT_CASES = {
    "mask": dict(mask="B,H,Sq,Sk", neg_inf=0.1),
    "dropout": dict(dropout_prob=0.2, seed=DROPOUT_SEED),
    "both-causal-offset20": dict(mask="1,H,1,Sk", dropout_prob=0.1, seed=DROPOUT_SEED, causal=True,
                                 causal_offset=20),
    "mask-window90": dict(mask="B,1,Sq,Sk", window=90),
}


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("d", [64, 128], ids=lambda d: f"d{d}")
@pytest.mark.parametrize("give_lse", [True, False], ids=["lse", "no-lse"])
@pytest.mark.parametrize("opts", MASK_DROPOUT_CASES.values(), ids=MASK_DROPOUT_CASES.keys())
def test_half_backward_mask_and_dropout(dev, rng, dtype, d, give_lse, opts):
    """The backward with an additive mask and dropout: on sm_90a the wgmma kernels built with
    them (dQ given the forward's lse, or the forward run first for it), at lengths that are no
    multiple of a tile, GQA 4, the mask in the data dtype."""
    case = make_case(rng, b=2, sq=333, sk=461, h=8, hkv=2, d=d, qk_scale=1.0, **opts)
    check_half(dev, rounded(case, dtype, dtype), give_lse=give_lse)
    if not self_check() and dev.engine.backend.capability == 90:
        built = {(hit[0].op, hit[0].isa, hit[0].plain)
                 for hit in dev.engine.backend._kernels.values() if isinstance(hit, tuple)}
        assert ("backward_dkdv", "wgmma", False) in built
        assert ("backward_dq", "wgmma", False) in built


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("d", [64, 128], ids=lambda d: f"d{d}")
def test_half_forward_kv_lens_many_tiles_per_block(kernels, ref, rng, dtype, d):
    """Each of a persistent block's tiles takes its own batch's kv_lens (3 x 6 x 24 = 432
    tiles): full, partial, tile-straddling, 1 and 0 keys, NaN past each."""
    b, sq, sk, h, hkv = 6, 400, 700, 24, 6
    q = rng.standard_normal((b, sq, h, d)).astype(np.float32).astype(dtype)
    k = rng.standard_normal((b, sk, hkv, d)).astype(np.float32).astype(dtype)
    v = rng.standard_normal((b, sk, hkv, d)).astype(np.float32).astype(dtype)
    lens = np.array([700, 500, 333, 129, 1, 0], np.int32)
    for i, n in enumerate(lens):
        k[i, n:], v[i, n:] = np.nan, np.nan
    for opts in (AttentionOptions(), AttentionOptions(causal=True)):  # persistent, and not
        check_forward_with_lse(kernels, ref, q, k, v, opts, None, lens, what=str(opts))


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("d", [1, 6, 7, 33, 40, 56, 64, 80, 104, 112, 128], ids=lambda d: f"d{d}")
def test_half_head_dims(kernels, rng, dtype, d):
    """Odd head_dims take the element-wise copies, even ones not divisible by 8 the 4-byte ones;
    40, 56, 80, 104 and 112 run a wgmma kernel (where the GPU has one) zero-filled past the
    head_dim."""
    case = make_case(rng, b=2, sq=70, sk=90, h=4, hkv=2, d=d, causal=True, causal_offset=20)
    check_half(kernels, rounded(case, dtype))


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("sq,h,hkv,d", [(1, 8, 2, 128), (1, 8, 2, 64), (2, 8, 2, 128),
                                        (4, 8, 2, 128), (1, 4, 4, 96)],
                         ids=["q1-g4-d128", "q1-g4-d64", "q2-g4-d128", "q4-g4-d128", "q1-g1-d96"])
def test_half_decode(decoders, rng, dtype, sq, h, hkv, d):
    """The decode kernels (each design: `decoders`) meet the half-precision rule: few query rows
    against 3000 keys (several splits), every key visible to the last row."""
    case = make_case(rng, b=2, sq=sq, sk=3000, h=h, hkv=hkv, d=d, causal=True,
                     causal_offset=3000 - sq)
    check_half(decoders, rounded(case, dtype), backward=False)


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("shape", DEAD_ROW_CASES)
def test_half_dead_rows(kernels, rng, dtype, shape):
    check_half(kernels, rounded(make_case(rng, b=2, h=4, hkv=2, d=32, **shape), dtype))


@pytest.mark.parametrize("dtype", HALF)
def test_half_unaligned_views(dev, rng, dtype):
    """Inputs starting 2 bytes into their allocation: only element-wise copies are legal, so the
    call runs an mma.sync build with 2-byte copies. Bit for bit the same as the aligned call on
    the mma.sync kernels (the 16-byte copies), and by the half rule on the engine's own pick (on
    sm_90a a wgmma kernel, whose products round differently: up to ~20 bf16 ulps apart on an
    element in ~1 seed of 10, measured on an H100, lab/unaligned_probe.py)."""
    case = rounded(make_case(rng, b=2, sq=65, sk=77, h=4, hkv=2, d=64, causal=True), dtype)
    t = {n: dev.put_unaligned(getattr(case, n)) for n in ("q", "k", "v")}
    out = dev.poisoned(case.q.shape, dtype=dtype)
    dev.engine.flash_attention_v2_with(t["q"], t["k"], t["v"], out, case.opts)
    got = dev.get(out)
    aligned = run(restricted_device("mma"), case, backward=False)["out"]
    assert np.array_equal(got.astype(np.float32), aligned.astype(np.float32))
    check_rule("out", got, x64(case, backward=False)["out"],
               torch_plain(case, backward=False)["out"], "unaligned")


# --- lse ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [pytest.param(FLOAT32, id="f32"), *HALF])
def test_lse_matches_the_reference(dev, rng, dtype):
    # rows i > 109 sit past the last key's window: dead, lse -inf
    case = make_case(rng, b=2, sq=130, sk=100, h=4, hkv=2, d=64, causal=True, causal_offset=10,
                     window=20, mask="B,1,Sq,Sk", neg_inf=0.1)
    if dtype != FLOAT32:
        case = rounded(case, dtype)
    got = run(dev, case, backward=False)["lse"]
    want = x64(case, backward=False)["lse"]
    fin = np.isfinite(want)
    assert (~fin).any(), "the case should have dead rows"
    assert (got[~fin] == -np.inf).all(), "lse of a row that sees nothing must be -inf"
    np.testing.assert_allclose(got[fin], want[fin], rtol=0, atol=2e-5 * np.abs(want[fin]).max())


@pytest.mark.parametrize("dtype", [pytest.param(FLOAT32, id="f32"), *HALF])
@pytest.mark.parametrize("extra", [dict(mask="B,1,1,Sk"),
                                   dict(mask="B,1,1,Sk", dropout_prob=0.2, seed=DROPOUT_SEED), {}],
                         ids=["mask", "mask-drop", "plain"])
def test_backward_with_and_without_lse_agree(dev, rng, dtype, extra):
    """Given the lse or not, the same dQ kernel runs (on sm_90a in half precision the wgmma one,
    the forward run first for the lse the call did not pass; elsewhere the mma.sync one, with
    its statistics pass where no lse comes)."""
    case = make_case(rng, b=2, sq=150, sk=170, h=4, hkv=2, d=64, causal=True, causal_offset=20,
                     **extra)
    if dtype != FLOAT32:
        case = rounded(case, dtype)
    with_lse = run(dev, case, give_lse=True)
    without = run(dev, case, give_lse=False)
    ulp = 1e-5 if dtype == FLOAT32 else ULP[dtype]
    for n in ("grad_q", "grad_k", "grad_v"):
        a, b = (x[n].astype(np.float64) for x in (with_lse, without))
        # equal to float32 rounding: within a few units of the output's last place
        assert np.abs(a - b).max() <= 4 * ulp * np.abs(b).max(), n


@pytest.mark.parametrize("dtype,d", [(FLOAT32, 32), (BFLOAT16, 64), (FLOAT16, 128)],
                         ids=["f32-d32", "bf16-d64", "f16-d128"])
def test_backward_uses_the_given_lse(dev, rng, dtype, d):
    """A different lse gives different gradients: the argument is read, not ignored (by the
    dQ kernel, and through the stats it writes by the dK/dV kernel; in half precision at head_dim
    64 and 128 on sm_90a, the wgmma ones)."""
    case = make_case(rng, b=1, sq=40, sk=40, h=2, d=d)
    if dtype != FLOAT32:
        case = rounded(case, dtype)
    q, k, v, go = (dev.put(x) for x in (case.q, case.k, case.v, case.grad_out))
    out = dev.poisoned(case.q.shape, dtype=dtype)
    lse = dev.poisoned((1, 2, 40))
    dev.engine.flash_attention_v2_with(q, k, v, out, case.opts, lse=lse)
    grads = []
    for shift in (0.0, 1.0):
        shifted = dev.put(dev.get(lse) + np.float32(shift))
        g = [dev.poisoned(x.shape, dtype=dtype) for x in (case.q, case.k, case.v)]
        dev.engine.flash_attention_v2_backward_with(q, k, v, out, go, *g, lse=shifted)
        grads.append([dev.get(x).astype(np.float32) for x in g])
    for n, a, b in zip(("grad_q", "grad_k", "grad_v"), *grads):
        assert not np.allclose(a, b), n


@pytest.mark.parametrize("dtype,d", [(FLOAT32, 32), (BFLOAT16, 64), (FLOAT16, 128)],
                         ids=["f32-d32", "bf16-d64", "f16-d128"])
def test_backward_given_lse_of_minus_inf_gives_those_rows_nothing(dev, ref, rng, dtype, d):
    """SPEC: rows whose given lse is -inf have P = 0, even where they see keys (an lse from
    another call, say): their grad_q is exactly 0, nothing is NaN, and the gradients equal the
    reference's given the same lse (on sm_90a in half precision: the wgmma dQ and dK/dV)."""
    case = make_case(rng, b=1, sq=96, sk=80, h=2, d=d, causal=True, causal_offset=10)
    if dtype != FLOAT32:
        case = rounded(case, dtype)
    dead = np.zeros((1, 2, 96), bool)
    dead[0, 0, 5:40] = dead[0, 1, 60:] = True
    res = []
    for e in (dev, ref):
        q, k, v, go = (e.put(x) for x in (case.q, case.k, case.v, case.grad_out))
        out, lse = e.poisoned(case.q.shape, dtype=dtype), e.poisoned((1, 2, 96))
        e.engine.flash_attention_v2_with(q, k, v, out, case.opts, lse=lse)
        given = e.get(lse).copy()
        given[dead] = -np.inf
        g = [e.poisoned(x.shape, dtype=dtype) for x in (case.q, case.k, case.v)]
        e.engine.flash_attention_v2_backward_with(q, k, v, out, go, *g, case.opts,
                                                  lse=e.put(given))
        res.append({n: e.get(x).astype(np.float64) for n, x in zip(("grad_q", "grad_k", "grad_v"), g)})
    got, want = res
    assert all(np.isfinite(x).all() for x in got.values())
    assert (got["grad_q"].transpose(0, 2, 1, 3)[dead] == 0).all()
    tol = 1e-4 if dtype == FLOAT32 else 3e-2
    for n in got:
        err = np.linalg.norm(got[n] - want[n]) / np.linalg.norm(want[n])
        assert err < tol, f"{n}: relative error {err:.2e}"


# --- dropout's keep mask is the same in every dtype -----------------------------------------------

def test_dropout_keep_mask_is_identical_across_dtypes(dev, rng):
    """v one-hot per key makes out[i, :Sk] = P'_ij itself: exactly 0 where dropped. The zero
    pattern must be the reference's keep mask, in float32, float16 and bfloat16 alike."""
    from gpu_helpers import keep_mask

    sq, sk, d = 37, 64, 64
    case = make_case(rng, b=2, sq=sq, sk=sk, h=2, hkv=1, d=d, qk_scale=0.3, dropout_prob=0.5,
                     seed=DROPOUT_SEED)
    onehot = np.zeros((2, sk, 1, d), np.float32)
    onehot[:, np.arange(sk), 0, np.arange(sk)] = 1.0
    case = replace(case, v=onehot)
    keep = keep_mask(case)                                  # [B, H, Sq, Sk]
    want = np.transpose(keep, (0, 2, 1, 3))                 # [B, Sq, H, Sk]
    for dtype in (FLOAT32, FLOAT16, BFLOAT16):
        c = case if dtype == FLOAT32 else rounded(case, dtype)
        out = run(dev, c, backward=False)["out"].astype(np.float32)[..., :sk]
        assert ((out != 0) == want).all(), f"keep mask differs in {dtype}"


# --- RoPE ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("shape,head_dim,pos", [((2, 37, 3, 64), 64, 5), ((5, 128), 128, 1000),
                                                ((3, 11, 2, 6), 6, 0)],
                         ids=["bshd-d64", "2d-d128-pos1000", "d6"])
def test_half_rope_rounds_once(dev, ref, rng, dtype, shape, head_dim, pos):
    """The device equals the reference (float64, rounded once) to one unit in the last place."""
    x = rng.standard_normal(shape).astype(np.float32).astype(dtype)
    got, want = dev.put(x), ref.put(x)
    dev.engine.rope(got, head_dim, pos)
    ref.engine.rope(want, head_dim, pos)
    g, w = (a.astype(np.float64) for a in (dev.get(got), ref.get(want)))
    assert np.abs(g - w).max() <= ULP[dtype] * np.abs(w).max(), "more than 1 ulp from the reference"
    assert not np.array_equal(g, x.astype(np.float64)), "nothing was rotated"


def test_half_scale_option(dev, rng):
    case = rounded(make_case(rng, b=1, sq=50, sk=60, h=2, d=32,
                             opts=AttentionOptions(scale=0.05)), FLOAT16)
    check_half(dev, case, backward=True)
