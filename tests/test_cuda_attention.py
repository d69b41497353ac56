"""Flash attention forward on the GPU against the NumPy reference (issue 3).

Skipped unless `ferrocupy.cuda_available()`; `FERRO_GPU_TESTS_ON_REFERENCE=1` runs it
reference-vs-reference on the CPU to check the test code itself (see tests/gpu_helpers.py).
"""

from __future__ import annotations

import re
from dataclasses import replace

import numpy as np
import pytest

from ferrocupy import AttentionOptions

# gpu_helpers is in tests/, which conftest puts on sys.path.
from gpu_helpers import (BIG_BATCH_SLICES, DEAD_ROW_CASES, SEQ_Q_NE_K,
                         DROPOUT_SEED, FWD_TOL, assert_close, batch_slice, check_forward,
                         count_launches,
                         dead_rows, dense_forward, dev, gpu_pytestmark, make_case,
                         needs_real_gpu, option_case, option_rows, ref, run_forward)

__all__ = ["dev", "ref"]  # fixtures, imported for pytest (`rng` comes from conftest)

pytestmark = gpu_pytestmark()


# --- every option and their combinations (pairwise covering) ------------------------------------

@pytest.mark.parametrize("row", option_rows())
def test_forward_option_combinations(dev, ref, rng, row):
    check_forward(dev, ref, option_case(rng, row))


def test_forward_every_option_at_once(dev, ref, rng):
    case = make_case(rng, b=2, sq=257, sk=260, h=8, hkv=2, d=64, mask="B,H,Sq,Sk", neg_inf=0.05,
                     causal=True, causal_offset=3, window=64, dropout_prob=0.2, seed=DROPOUT_SEED)
    check_forward(dev, ref, case)


@pytest.mark.parametrize("p", [0.2, 0.5, 0.9], ids=lambda p: f"p{p}")
@pytest.mark.parametrize("seed", [0, 1, 2**32 + 7, 2**64 - 1], ids=lambda s: f"seed{s:#x}")
def test_forward_dropout_matches_reference(dev, ref, rng, p, seed):
    """The same elements are dropped as in the reference (else the error is O(1))."""
    case = make_case(rng, b=2, sq=67, sk=131, h=4, hkv=2, d=32, dropout_prob=p, seed=seed)
    check_forward(dev, ref, case)


def test_forward_dropout_seed_changes_the_output(dev, rng):
    a = make_case(rng, b=1, sq=33, sk=65, h=2, d=32, dropout_prob=0.2, seed=1)
    b = replace(a, opts=replace(a.opts, seed=2))
    assert not np.array_equal(run_forward(dev, a), run_forward(dev, b))


# --- sequence lengths and shapes ------------------------------------------------------------------

@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("seq", [1, 7, 127, 128, 129, 1000], ids=lambda s: f"seq{s}")
def test_forward_seq_lengths(dev, ref, rng, seq, causal):
    check_forward(dev, ref, make_case(rng, b=1, sq=seq, sk=seq, h=4, hkv=2, d=64, causal=causal))




@pytest.mark.parametrize("shape", SEQ_Q_NE_K)
def test_forward_seq_q_ne_seq_k(dev, ref, rng, shape):
    check_forward(dev, ref, make_case(rng, b=2, h=4, hkv=1, d=64, **shape))


@pytest.mark.parametrize("d", [1, 8, 16, 32, 33, 40, 64, 72, 80, 96, 128], ids=lambda d: f"d{d}")
def test_forward_head_dims(dev, ref, rng, d):
    case = make_case(rng, b=2, sq=129, sk=130, h=4, hkv=2, d=d, causal=True, mask="B,1,1,Sk")
    check_forward(dev, ref, case)


@pytest.mark.parametrize("gqa", [1, 2, 4, 8, 16], ids=lambda g: f"gqa{g}")
def test_forward_gqa_ratios(dev, ref, rng, gqa):
    check_forward(dev, ref, make_case(rng, b=2, sq=65, sk=190, h=16, hkv=16 // gqa, d=64))


@pytest.mark.parametrize("spec", ["1,1,1,Sk", "B,1,1,Sk", "1,H,Sq,Sk", "B,H,Sq,Sk", "B,1,Sq,1",
                                  "1,H,1,1", "1,1,Sq,Sk", "B,1,Sq,Sk", "B,H,1,Sk", "1,1,1,1",
                                  "B,H,Sq,1"], ids=lambda s: f"mask[{s}]")
def test_forward_mask_broadcast_shapes(dev, ref, rng, spec):
    """Every broadcast form of the additive mask (float32, contiguous), with -inf padding."""
    case = make_case(rng, b=3, sq=70, sk=133, h=4, hkv=2, d=32, mask=spec, neg_inf=0.1)
    check_forward(dev, ref, case)


def test_forward_large_mask_values(dev, ref, rng):
    """A large finite negative mask (-1e9, padding-style) is not -inf: no NaN, no dead row.
    (A row with every key at -1e9 is left out: float32 rounds q.k - 1e9 to steps of 64, so
    the kernel's uniform row and a float64 reference legitimately disagree.)"""
    case = make_case(rng, b=2, sq=40, sk=50, h=2, d=32, mask="B,1,Sq,Sk")
    case.mask[...] = np.where(rng.random(case.mask.shape) < 0.5, -1e9, case.mask)
    case.mask[0, 0, 3, 1:] = -1e9  # one live key: exp(-1e9 - m) underflows to 0 for the rest
    case.mask[0, 0, 3, 0] = 0.5
    check_forward(dev, ref, case)




def test_forward_batch_heads_beyond_grid_z(dev, ref, rng):
    """B*H = 70400 > 65535 (gridDim.z's limit in the seed's layout), GQA 8, causal. Checked
    against the vectorised oracle everywhere and the reference engine on batch slices on both
    sides of b*H + h = 65535."""
    case = make_case(rng, b=1100, sq=4, sk=4, h=64, hkv=8, d=16, causal=True, mask="B,1,1,Sk",
                     neg_inf=0.05)
    got = run_forward(dev, case)
    assert_close("out", got, dense_forward(case), FWD_TOL, case.describe())
    sub = batch_slice(case, BIG_BATCH_SLICES)
    assert_close("out", got[BIG_BATCH_SLICES], run_forward(ref, sub), FWD_TOL,
                 f"batch slices {BIG_BATCH_SLICES} {sub.describe()}")


def test_forward_batch_heads_beyond_grid_z_with_dropout(dev, rng):
    """The dropout counter's b*H + h word past 65535, against the oracle with the same Philox."""
    case = make_case(rng, b=1100, sq=5, sk=3, h=64, hkv=64, d=16, mask="B,1,1,Sk",
                     dropout_prob=0.2, seed=DROPOUT_SEED)
    assert_close("out", run_forward(dev, case), dense_forward(case), FWD_TOL, case.describe())


@pytest.mark.parametrize("d", [64, 128, 40], ids=lambda d: f"d{d}")
def test_forward_unaligned_views(dev, ref, rng, d):
    """Contiguous tensors that start 4 bytes into their allocation (no 16-byte vector loads)."""
    case = make_case(rng, b=2, sq=70, sk=133, h=4, hkv=2, d=d, mask="B,1,1,Sk", causal=True,
                     causal_offset=63, dropout_prob=0.2, seed=DROPOUT_SEED)
    q, k, v, mask = (dev.put_unaligned(x) for x in (case.q, case.k, case.v, case.mask))
    out = dev.put_unaligned(np.full(case.q.shape, np.nan, dtype=np.float32))
    assert all(dev.data_ptr(x) % 16 for x in (q, k, v, mask, out))
    dev.engine.flash_attention_v2_with(q, k, v, out, case.opts, mask)
    assert_close("out", dev.get(out), run_forward(ref, case), FWD_TOL, case.describe())


# --- fully-masked rows and NaN --------------------------------------------------------------------



@pytest.mark.parametrize("shape", DEAD_ROW_CASES)
def test_forward_rows_without_visible_keys_are_zero(dev, ref, rng, shape):
    case = make_case(rng, b=2, h=4, hkv=2, d=32, **shape)
    assert dead_rows(case).any()
    check_forward(dev, ref, case)


def test_forward_mask_minus_inf_rows_are_zero(dev, ref, rng):
    case = make_case(rng, b=2, sq=130, sk=77, h=4, hkv=2, d=64, mask="B,1,Sq,1")
    case.mask[0, 0, [0, 5, 129], 0] = -np.inf
    case.mask[1, 0, 64:, 0] = -np.inf
    assert dead_rows(case).sum() == 4 * (3 + 66)
    check_forward(dev, ref, case)


def test_forward_mask_minus_inf_full_mask(dev, ref, rng):
    """Per-head dead rows, a partly -inf row, and -inf on exactly the causally visible keys."""
    case = make_case(rng, b=2, sq=40, sk=40, h=4, hkv=4, d=32, mask="B,H,Sq,Sk", causal=True)
    case.mask[1, 2, 7, :] = -np.inf          # a dead row in one head only
    case.mask[0, 1, 9, :5] = -np.inf         # partly masked
    case.mask[0, 3, 20, :21] = -np.inf       # every visible key masked; the rest is hidden
    case.mask[1, 0, 0, 0] = -np.inf          # row 0 sees only key 0
    dead = dead_rows(case)
    assert dead[1, 7, 2] and dead[0, 20, 3] and dead[1, 0, 0] and not dead[0, 9, 1]
    check_forward(dev, ref, case)


def test_forward_all_keys_masked_everywhere(dev, ref, rng):
    case = make_case(rng, b=1, sq=9, sk=200, h=2, d=16, mask="1,1,1,1")
    case.mask[...] = -np.inf
    got, _ = check_forward(dev, ref, case)
    assert (got == 0).all()


def test_forward_nan_in_q_propagates(dev, ref, rng):
    case = make_case(rng, b=2, sq=150, sk=140, h=4, hkv=2, d=32, causal=True)
    case.q[1, 131, 3, 5] = np.nan
    got, _ = check_forward(dev, ref, case, nan_ok=True)
    assert np.isnan(got[1, 131, 3]).all(), "NaN in q must make its output row NaN"
    others = np.ones(got.shape[:3], dtype=bool)
    others[1, 131, 3] = False
    assert not np.isnan(got[others]).any(), "NaN in one q row leaked into other rows"


# --- single-head form -----------------------------------------------------------------------------

@pytest.mark.parametrize("sq,sk,causal", [(129, 129, False), (129, 129, True), (7, 300, False),
                                          (300, 7, True), (1, 1, False)],
                         ids=["s129", "s129-causal", "q7-k300", "q300-k7-causal", "s1"])
def test_single_head_flash_attention(dev, ref, rng, sq, sk, causal):
    case = make_case(rng, b=1, sq=sq, sk=sk, h=1, d=64, causal=causal)
    q, k, v = (x[0, :, 0, :] for x in (case.q, case.k, case.v))
    outs = []
    for d in (ref, dev):
        out = d.poisoned((sq, 64))
        d.engine.flash_attention(d.put(q), d.put(k), d.put(v), out, causal)
        outs.append(d.get(out))
    assert_close("out", outs[1], outs[0], FWD_TOL, f"[single head {sq}x{sk} causal={causal}]")
    # The same numbers as the 4-D call on [1, seq, 1, D].
    np.testing.assert_array_equal(outs[1], run_forward(dev, case)[0, :, 0, :])


# --- determinism and in-place ---------------------------------------------------------------------

def test_forward_is_deterministic(dev, rng):
    case = make_case(rng, b=2, sq=300, sk=301, h=8, hkv=2, d=64, mask="B,1,Sq,Sk", neg_inf=0.05,
                     causal=True, window=100, dropout_prob=0.2, seed=DROPOUT_SEED)
    q, k, v, mask = (dev.put(x) for x in (case.q, case.k, case.v, case.mask))
    out1, out2 = dev.poisoned(case.q.shape), dev.poisoned(case.q.shape)
    dev.engine.flash_attention_v2_with(q, k, v, out1, case.opts, mask)
    dev.engine.flash_attention_v2_with(q, k, v, out2, case.opts, mask)
    assert not np.isnan(dev.get(out1)).any()
    assert dev.array_equal(out1, out2), "two forward runs on the same inputs differ"


def test_forward_inputs_are_not_modified(dev, rng):
    case = make_case(rng, b=2, sq=33, sk=65, h=4, hkv=2, d=32, mask="B,1,1,Sk",
                     dropout_prob=0.2, seed=3)
    t = {n: dev.put(getattr(case, n)) for n in ("q", "k", "v", "mask")}
    out = dev.poisoned(case.q.shape)
    dev.engine.flash_attention_v2_with(t["q"], t["k"], t["v"], out, case.opts, t["mask"])
    for n, x in t.items():
        np.testing.assert_array_equal(dev.get(x), getattr(case, n), err_msg=f"{n} was modified")


def test_forward_legacy_signature(dev, ref, rng):
    """`flash_attention_v2(q, k, v, out, causal, dropout_prob, seed, mask)` (seed order)."""
    case = make_case(rng, b=2, sq=45, sk=45, h=4, hkv=2, d=32, mask="B,1,1,Sk",
                     causal=True, dropout_prob=0.2, seed=DROPOUT_SEED)
    outs = []
    for d in (ref, dev):
        out = d.poisoned(case.q.shape)
        d.engine.flash_attention_v2(d.put(case.q), d.put(case.k), d.put(case.v), out, True, 0.2,
                                    DROPOUT_SEED, d.put(case.mask))
        outs.append(d.get(out))
    assert_close("out", outs[1], outs[0], FWD_TOL, case.describe())
    np.testing.assert_array_equal(outs[1], run_forward(dev, case))


# --- zero-size edges -----------------------------------------------------------------------------

def test_forward_seq_k_zero_gives_zero(dev, ref, rng):
    case = make_case(rng, b=2, sq=5, sk=0, h=4, hkv=2, d=32)
    got, _ = check_forward(dev, ref, case)
    assert (got == 0).all()


def test_forward_seq_k_zero_with_mask(dev, ref, rng):
    case = make_case(rng, b=2, sq=5, sk=0, h=4, hkv=2, d=32, mask="B,1,1,Sk", causal=True)
    got, _ = check_forward(dev, ref, case)
    assert (got == 0).all()


@pytest.mark.parametrize("shape", [dict(b=0, sq=5, sk=5), dict(b=2, sq=0, sk=5),
                                   dict(b=0, sq=0, sk=0)], ids=["batch0", "seq_q0", "all0"])
def test_forward_empty_runs_without_launching(dev, rng, monkeypatch, shape):
    case = make_case(rng, h=4, hkv=2, d=32, **shape)
    launches = count_launches(monkeypatch, dev.engine)
    out = dev.poisoned(case.q.shape)
    dev.engine.flash_attention_v2_with(dev.put(case.q), dev.put(case.k), dev.put(case.v), out)
    dev.sync()
    assert launches == [], f"launched {launches} for an empty problem {case.describe()}"


# --- errors on the GPU path -----------------------------------------------------------------------

FWD_ARGS = ["q", "k", "v", "out", "mask"]


@pytest.mark.parametrize("host_arg", FWD_ARGS)
def test_forward_host_tensor_is_a_clear_error(dev, rng, host_arg):
    needs_real_gpu()
    case = make_case(rng, b=2, sq=9, sk=9, h=2, d=16, mask="B,1,1,Sk")
    t = {n: dev.put(getattr(case, n)) for n in ("q", "k", "v", "mask")}
    t["out"] = dev.poisoned(case.q.shape, value=7.0)
    out_dev = t["out"]
    t[host_arg] = _host(t[host_arg])
    with pytest.raises(ValueError) as e:
        dev.engine.flash_attention_v2_with(t["q"], t["k"], t["v"], t["out"], case.opts, t["mask"])
    msg = str(e.value)
    assert re.search(rf"\b{host_arg}\b", msg) and "cpu" in msg and "cuda" in msg, msg
    assert (dev.get(out_dev) == 7.0).all(), "out was written although the call raised"


def test_forward_tensor_on_another_gpu_is_a_clear_error(dev, rng):
    needs_real_gpu()
    import cupy

    if cupy.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs two GPUs")
    case = make_case(rng, b=1, sq=9, sk=9, h=2, d=16)
    q, v = dev.put(case.q), dev.put(case.v)
    out = dev.poisoned(case.q.shape, value=7.0)
    from ferrocupy import UnifiedTensor

    k = UnifiedTensor.from_numpy(case.k, device="cuda:1")
    with pytest.raises(ValueError, match="k"):
        dev.engine.flash_attention_v2_with(q, k, v, out)
    assert (dev.get(out) == 7.0).all()


BAD_FORWARD = [
    pytest.param(lambda c: dict(q=c["q"].buffer()[:, :, :, :8]), id="q-not-contiguous"),
    pytest.param(lambda c: dict(out=c["out"].buffer()[:, :, :1].copy()), id="out-wrong-shape"),
    pytest.param(lambda c: dict(v=c["v"].buffer()[:, :4].copy()), id="v-shape-differs-from-k"),
    pytest.param(lambda c: dict(mask=c["mask"].buffer()[:, :, :, :3].copy()),
                 id="mask-bad-broadcast"),
    pytest.param(lambda c: dict(mask=c["mask"].buffer()[0]), id="mask-rank3"),
    pytest.param(lambda c: dict(mask=c["mask"].buffer()[..., ::2]), id="mask-not-contiguous"),
    pytest.param(lambda c: dict(opts=AttentionOptions(dropout_prob=1.0)), id="dropout-1"),
    pytest.param(lambda c: dict(opts=AttentionOptions(window=-1)), id="window-negative"),
    pytest.param(lambda c: dict(q=c["q"].buffer().astype("float64"),
                                out=c["out"].buffer().astype("float64")), id="float64"),
]


@pytest.mark.parametrize("bad", BAD_FORWARD)
def test_forward_bad_input_raises_before_writing(dev, rng, bad):
    case = make_case(rng, b=2, sq=9, sk=9, h=2, d=16, mask="B,1,1,Sk")
    t = {n: dev.put(getattr(case, n)) for n in ("q", "k", "v", "mask")}
    out = t["out"] = dev.poisoned(case.q.shape, value=7.0)
    args = dict(t, opts=case.opts)
    args.update(bad(t))
    with pytest.raises((ValueError, TypeError)):
        dev.engine.flash_attention_v2_with(args["q"], args["k"], args["v"], args["out"],
                                           args["opts"], args["mask"])
    assert (dev.get(out) == 7.0).all(), "out was written although the call raised"


@pytest.mark.parametrize("mask_dtype", [np.float64, np.float16], ids=["f64", "f16"])
def test_forward_mask_dtype_must_be_the_kernels(dev, rng, mask_dtype):
    """The mask is float32 for float32 inputs; another dtype is an error, not a reinterpretation."""
    case = make_case(rng, b=2, sq=9, sk=9, h=2, d=16, mask="B,1,1,Sk")
    out = dev.poisoned(case.q.shape, value=7.0)
    mask = dev.put(case.mask.astype(mask_dtype))
    with pytest.raises((TypeError, ValueError), match="mask"):
        dev.engine.flash_attention_v2_with(dev.put(case.q), dev.put(case.k), dev.put(case.v), out,
                                           case.opts, mask)
    assert (dev.get(out) == 7.0).all()


def _host(t):
    """A host (NumPy-backed) UnifiedTensor holding the same data as `t`."""
    from ferrocupy import UnifiedTensor

    return UnifiedTensor(t.to_numpy())
