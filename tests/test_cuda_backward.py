"""Flash attention backward (dq kernel, then dkdv kernel) on the GPU against the NumPy reference.

Each of grad_q, grad_k, grad_v must match to relative error 1e-4 on its own, given the same
`out` (the reference forward's) on both sides; gradients are poisoned with NaN before each call
so "writes, never accumulates" is checked everywhere. Skipped unless
`ferrocupy.cuda_available()`; `FERRO_GPU_TESTS_ON_REFERENCE=1` runs it reference-vs-reference.
"""

from __future__ import annotations

import re
from dataclasses import replace

import numpy as np
import pytest

from ferrocupy import AttentionOptions

# gpu_helpers is in tests/, which conftest puts on sys.path.
from gpu_helpers import (BIG_BATCH_SLICES, DEAD_ROW_CASES, SEQ_Q_NE_K,
                         DROPOUT_SEED, assert_grads_close, batch_slice, check_backward,
                         count_launches,
                         dead_keys, dead_rows, dense_backward, dense_forward, dev,
                         gpu_pytestmark, make_case, needs_real_gpu, option_case, option_rows,
                         ref, run_backward, run_forward)

__all__ = ["dev", "ref"]  # fixtures, imported for pytest (`rng` comes from conftest)

pytestmark = gpu_pytestmark()

GRADS = ("grad_q", "grad_k", "grad_v")


# --- every option and their combinations (pairwise covering) ------------------------------------

@pytest.mark.parametrize("row", option_rows())
def test_backward_option_combinations(dev, ref, rng, row):
    check_backward(dev, ref, option_case(rng, row))


def test_backward_every_option_at_once(dev, ref, rng):
    case = make_case(rng, b=2, sq=257, sk=260, h=8, hkv=2, d=64, mask="B,H,Sq,Sk", neg_inf=0.05,
                     causal=True, causal_offset=3, window=64, dropout_prob=0.2, seed=DROPOUT_SEED)
    check_backward(dev, ref, case)


@pytest.mark.parametrize("p", [0.2, 0.5], ids=lambda p: f"p{p}")
@pytest.mark.parametrize("seed", [0, 2**32 + 7], ids=lambda s: f"seed{s:#x}")
def test_backward_dropout_matches_reference(dev, ref, rng, p, seed):
    case = make_case(rng, b=2, sq=67, sk=131, h=4, hkv=2, d=32, causal=True, dropout_prob=p,
                     seed=seed)
    check_backward(dev, ref, case)


# --- sequence lengths and shapes ------------------------------------------------------------------

@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("seq", [1, 7, 127, 128, 129, 1000], ids=lambda s: f"seq{s}")
def test_backward_seq_lengths(dev, ref, rng, seq, causal):
    check_backward(dev, ref, make_case(rng, b=1, sq=seq, sk=seq, h=4, hkv=2, d=64,
                                       causal=causal))




@pytest.mark.parametrize("shape", SEQ_Q_NE_K)
def test_backward_seq_q_ne_seq_k(dev, ref, rng, shape):
    check_backward(dev, ref, make_case(rng, b=2, h=4, hkv=1, d=64, **shape))


@pytest.mark.parametrize("d", [1, 8, 16, 32, 33, 40, 64, 72, 80, 96, 128], ids=lambda d: f"d{d}")
def test_backward_head_dims(dev, ref, rng, d):
    case = make_case(rng, b=2, sq=129, sk=130, h=4, hkv=2, d=d, causal=True, mask="B,1,1,Sk")
    check_backward(dev, ref, case)


@pytest.mark.parametrize("gqa", [1, 2, 4, 8, 16], ids=lambda g: f"gqa{g}")
def test_backward_gqa_ratios(dev, ref, rng, gqa):
    """dkdv sums over the query heads of each KV group."""
    check_backward(dev, ref, make_case(rng, b=2, sq=65, sk=190, h=16, hkv=16 // gqa, d=64))


@pytest.mark.parametrize("spec", ["1,1,1,Sk", "B,1,1,Sk", "1,H,Sq,Sk", "B,H,Sq,Sk", "B,1,Sq,1",
                                  "1,H,1,1", "1,1,Sq,Sk", "B,H,1,Sk"], ids=lambda s: f"mask[{s}]")
def test_backward_mask_broadcast_shapes(dev, ref, rng, spec):
    case = make_case(rng, b=3, sq=70, sk=133, h=4, hkv=2, d=32, mask=spec, neg_inf=0.1)
    check_backward(dev, ref, case)




def test_backward_batch_heads_beyond_grid_z(dev, ref, rng):
    """B*H = B*Hkv = 70400 > 65535: both the dq grid and the dkdv grid exceed gridDim.z.
    Checked against the vectorised oracle everywhere and the reference engine on batch slices."""
    case = make_case(rng, b=1100, sq=4, sk=4, h=64, hkv=64, d=16, causal=True, mask="B,1,1,Sk",
                     neg_inf=0.05)
    out = dense_forward(case).astype(np.float32)
    got = run_backward(dev, case, out)
    want = dense_backward(case)
    sub = batch_slice(case, BIG_BATCH_SLICES)
    want_sub = run_backward(ref, sub, out[BIG_BATCH_SLICES])
    assert_grads_close(got, want, case, case.describe())
    assert_grads_close({n: got[n][BIG_BATCH_SLICES] for n in GRADS}, want_sub, sub,
                       f"batch slices {BIG_BATCH_SLICES} {sub.describe()}")


def test_backward_batch_heads_beyond_grid_z_gqa_dropout(dev, rng):
    """GQA 8 (dkdv grid 8800 x key tiles) with dropout's counter past 65535, against the oracle."""
    case = make_case(rng, b=1100, sq=5, sk=3, h=64, hkv=8, d=16, mask="B,1,1,Sk",
                     dropout_prob=0.2, seed=DROPOUT_SEED)
    got = run_backward(dev, case, dense_forward(case).astype(np.float32))
    assert_grads_close(got, dense_backward(case), case, case.describe())


@pytest.mark.parametrize("d", [64, 128, 40], ids=lambda d: f"d{d}")
def test_backward_unaligned_views(dev, ref, rng, d):
    """Contiguous tensors that start 4 bytes into their allocation (no 16-byte vector loads)."""
    case = make_case(rng, b=2, sq=70, sk=133, h=4, hkv=2, d=d, mask="B,1,1,Sk", causal=True,
                     causal_offset=63, dropout_prob=0.2, seed=DROPOUT_SEED)
    out = run_forward(ref, case)
    want = run_backward(ref, case, out)
    t = [dev.put_unaligned(x) for x in (case.q, case.k, case.v, out, case.grad_out)]
    nan_q = np.full(case.q.shape, np.nan, dtype=np.float32)
    nan_k = np.full(case.k.shape, np.nan, dtype=np.float32)
    g = [dev.put_unaligned(nan_q), dev.put_unaligned(nan_k), dev.put_unaligned(nan_k)]
    dev.engine.flash_attention_v2_backward_with(*t, *g, case.opts, dev.put_unaligned(case.mask))
    got = {name: dev.get(x) for name, x in zip(GRADS, g)}
    assert_grads_close(got, want, case, case.describe())


# --- fully-masked rows ----------------------------------------------------------------------------



@pytest.mark.parametrize("shape", DEAD_ROW_CASES)
def test_backward_rows_without_visible_keys(dev, ref, rng, shape):
    """Dead rows: LSE = -inf must not become NaN in P = exp(s - LSE); their grads are 0."""
    case = make_case(rng, b=2, h=4, hkv=2, d=32, **shape)
    assert dead_rows(case).any()
    check_backward(dev, ref, case)


def test_backward_mask_minus_inf_rows(dev, ref, rng):
    case = make_case(rng, b=2, sq=130, sk=77, h=4, hkv=2, d=64, mask="B,1,Sq,1")
    case.mask[0, 0, [0, 5, 129], 0] = -np.inf
    case.mask[1, 0, 64:, 0] = -np.inf
    check_backward(dev, ref, case)


def test_backward_mask_minus_inf_keys(dev, ref, rng):
    """Keys masked for every query get exactly zero grad_k and grad_v."""
    case = make_case(rng, b=2, sq=50, sk=140, h=4, hkv=2, d=32, mask="B,1,1,Sk", causal=True,
                     causal_offset=90)
    case.mask[0, 0, 0, 7:30] = -np.inf
    case.mask[1, 0, 0, 128:] = -np.inf
    case.mask[0, 0, 0, 0] = -np.inf
    assert dead_keys(case).sum() == 2 * (23 + 12 + 1)
    check_backward(dev, ref, case)


def test_backward_all_keys_masked_everywhere(dev, ref, rng):
    case = make_case(rng, b=1, sq=9, sk=200, h=2, d=16, mask="1,1,1,1")
    case.mask[...] = -np.inf
    check_backward(dev, ref, case)


# --- single-head form -----------------------------------------------------------------------------

@pytest.mark.parametrize("sq,sk,causal", [(129, 129, False), (129, 129, True), (7, 300, False),
                                          (300, 7, True), (1, 1, False)],
                         ids=["s129", "s129-causal", "q7-k300", "q300-k7-causal", "s1"])
def test_single_head_flash_attention_backward(dev, ref, rng, sq, sk, causal):
    case = make_case(rng, b=1, sq=sq, sk=sk, h=1, d=64, causal=causal)
    out4 = run_forward(ref, case)
    host = [x[0, :, 0, :] for x in (case.q, case.k, case.v, out4, case.grad_out)]
    grads = []
    for d in (ref, dev):
        g = [d.poisoned((sq, 64)), d.poisoned((sk, 64)), d.poisoned((sk, 64))]
        d.engine.flash_attention_backward(*(d.put(x) for x in host), *g, causal)
        grads.append([d.get(x) for x in g])
    as4 = [{n: x.reshape(like.shape) for n, x, like in zip(GRADS, gs, (case.q, case.k, case.k))}
           for gs in grads]
    assert_grads_close(as4[1], as4[0], case, f"[single head {sq}x{sk} causal={causal}]")
    # The same numbers as the 4-D call on [1, seq, 1, D].
    four = run_backward(dev, case, out4)
    for name, got in zip(GRADS, grads[1]):
        np.testing.assert_array_equal(got, four[name][0, :, 0, :], err_msg=name)


def test_backward_legacy_signature(dev, ref, rng):
    """`flash_attention_v2_backward(..., causal)`: no mask, no dropout."""
    case = make_case(rng, b=2, sq=45, sk=61, h=4, hkv=2, d=32, causal=True)
    out = run_forward(ref, case)
    res = []
    for d in (ref, dev):
        g = [d.poisoned(case.q.shape), d.poisoned(case.k.shape), d.poisoned(case.k.shape)]
        d.engine.flash_attention_v2_backward(
            *(d.put(x) for x in (case.q, case.k, case.v, out, case.grad_out)), *g, True)
        res.append({name: d.get(x) for name, x in zip(GRADS, g)})
    assert_grads_close(res[1], res[0], case, case.describe())


# --- determinism --------------------------------------------------------------------------------

@pytest.mark.parametrize("gqa", [1, 4], ids=lambda g: f"gqa{g}")
def test_backward_is_bit_identical_across_runs(dev, rng, gqa):
    case = make_case(rng, b=2, sq=300, sk=301, h=8, hkv=8 // gqa, d=64, mask="B,1,Sq,Sk",
                     neg_inf=0.05, causal=True, window=100, dropout_prob=0.2, seed=DROPOUT_SEED)
    t = [dev.put(x) for x in (case.q, case.k, case.v, run_forward(dev, case), case.grad_out)]
    mask = dev.put(case.mask)
    runs = []
    for _ in range(2):
        g = [dev.poisoned(case.q.shape), dev.poisoned(case.k.shape), dev.poisoned(case.k.shape)]
        dev.engine.flash_attention_v2_backward_with(*t, *g, case.opts, mask)
        runs.append(g)
    for name, a, b in zip(GRADS, *runs):
        assert not np.isnan(dev.get(a)).any(), name
        assert dev.array_equal(a, b), f"{name} differs between two runs on the same inputs"


def test_backward_writes_never_accumulates(dev, ref, rng):
    """Gradients pre-filled with large finite values are overwritten, not added to."""
    case = make_case(rng, b=2, sq=70, sk=90, h=4, hkv=2, d=32, causal=True)
    out = run_forward(ref, case)
    want = run_backward(ref, case, out)
    t = [dev.put(x) for x in (case.q, case.k, case.v, out, case.grad_out)]
    g = [dev.poisoned(case.q.shape, 1e3), dev.poisoned(case.k.shape, 1e3),
         dev.poisoned(case.k.shape, 1e3)]
    dev.engine.flash_attention_v2_backward_with(*t, *g, case.opts, None)
    assert_grads_close({name: dev.get(x) for name, x in zip(GRADS, g)}, want, case,
                       case.describe())


def test_backward_inputs_are_not_modified(dev, rng):
    case = make_case(rng, b=2, sq=33, sk=65, h=4, hkv=2, d=32, mask="B,1,1,Sk",
                     dropout_prob=0.2, seed=3)
    out = run_forward(dev, case)
    host = dict(q=case.q, k=case.k, v=case.v, out=out, grad_out=case.grad_out, mask=case.mask)
    t = {n: dev.put(x) for n, x in host.items()}
    g = [dev.poisoned(case.q.shape), dev.poisoned(case.k.shape), dev.poisoned(case.k.shape)]
    dev.engine.flash_attention_v2_backward_with(t["q"], t["k"], t["v"], t["out"], t["grad_out"],
                                                *g, case.opts, t["mask"])
    for n, x in t.items():
        np.testing.assert_array_equal(dev.get(x), host[n], err_msg=f"{n} was modified")


# --- zero-size edges -----------------------------------------------------------------------------

def test_backward_seq_k_zero(dev, ref, rng):
    """No key: grad_q is written as 0 (the dq kernel still runs), grad_k/grad_v are empty."""
    case = make_case(rng, b=2, sq=5, sk=0, h=4, hkv=2, d=32, causal=True)
    got = run_backward(dev, case, np.zeros_like(case.q))
    assert (got["grad_q"] == 0).all()
    assert got["grad_k"].shape == got["grad_v"].shape == (2, 0, 2, 32)
    check_backward(dev, ref, case)


def test_backward_seq_q_zero_zeroes_kv_grads(dev, ref, rng):
    case = make_case(rng, b=2, sq=0, sk=5, h=4, hkv=2, d=32)
    got = run_backward(dev, case, np.zeros_like(case.q))
    assert (got["grad_k"] == 0).all() and (got["grad_v"] == 0).all()
    check_backward(dev, ref, case)


def test_backward_batch_zero_runs_without_launching(dev, rng, monkeypatch):
    case = make_case(rng, b=0, sq=5, sk=5, h=4, hkv=2, d=32)
    launches = count_launches(monkeypatch, dev.engine)
    got = run_backward(dev, case, np.zeros_like(case.q))
    assert launches == [], f"launched {launches} for batch 0"
    assert all(x.size == 0 for x in got.values())


# --- errors on the GPU path -----------------------------------------------------------------------

BWD_ARGS = ["q", "k", "v", "out", "grad_out", "grad_q", "grad_k", "grad_v", "mask"]


@pytest.mark.parametrize("host_arg", BWD_ARGS)
def test_backward_host_tensor_is_a_clear_error(dev, rng, host_arg):
    needs_real_gpu()
    from ferrocupy import UnifiedTensor

    case = make_case(rng, b=2, sq=9, sk=9, h=2, d=16, mask="B,1,1,Sk")
    t = {n: dev.put(getattr(case, n)) for n in ("q", "k", "v", "grad_out", "mask")}
    t["out"] = dev.put(case.q)
    for n, like in (("grad_q", case.q), ("grad_k", case.k), ("grad_v", case.k)):
        t[n] = dev.poisoned(like.shape, value=7.0)
    grads = [t["grad_q"], t["grad_k"], t["grad_v"]]
    t[host_arg] = UnifiedTensor(t[host_arg].to_numpy())
    with pytest.raises(ValueError) as e:
        dev.engine.flash_attention_v2_backward_with(
            *(t[n] for n in BWD_ARGS[:-1]), case.opts, t["mask"])
    msg = str(e.value)
    assert re.search(rf"\b{host_arg}\b", msg) and "cpu" in msg and "cuda" in msg, msg
    for name, g in zip(GRADS, grads):
        assert (dev.get(g) == 7.0).all(), f"{name} was written although the call raised"


BAD_BACKWARD = [
    pytest.param(lambda t: dict(grad_k=t["grad_k"].buffer()[:, :, :1].copy()),
                 id="grad_k-wrong-shape"),
    pytest.param(lambda t: dict(grad_out=t["grad_out"].buffer()[:, :4].copy()),
                 id="grad_out-wrong-shape"),
    pytest.param(lambda t: dict(out=t["out"].buffer()[:, :, :, :8]), id="out-not-contiguous"),
    pytest.param(lambda t: dict(mask=t["mask"].buffer()[:, :, :, :3].copy()),
                 id="mask-bad-broadcast"),
    pytest.param(lambda t: dict(opts=AttentionOptions(dropout_prob=-0.1)), id="dropout-negative"),
    pytest.param(lambda t: dict(grad_v=t["grad_v"].buffer().astype("float64")),
                 id="grad_v-float64"),
]


@pytest.mark.parametrize("bad", BAD_BACKWARD)
def test_backward_bad_input_raises_before_writing(dev, rng, bad):
    case = make_case(rng, b=2, sq=9, sk=9, h=2, d=16, mask="B,1,1,Sk")
    t = {n: dev.put(getattr(case, n)) for n in ("q", "k", "v", "grad_out", "mask")}
    t["out"] = dev.put(case.q)
    for n, like in (("grad_q", case.q), ("grad_k", case.k), ("grad_v", case.k)):
        t[n] = dev.poisoned(like.shape, value=7.0)
    grads = [t["grad_q"], t["grad_k"], t["grad_v"]]
    args = dict(t, opts=case.opts)
    args.update(bad(t))
    with pytest.raises((ValueError, TypeError)):
        dev.engine.flash_attention_v2_backward_with(
            *(args[n] for n in BWD_ARGS[:-1]), args["opts"], args["mask"])
    for name, g in zip(GRADS, grads):
        assert (dev.get(g) == 7.0).all(), f"{name} was written although the call raised"


def test_backward_dropout_seed_matters(dev, rng):
    """A different seed is a different dropout pattern (the backward regenerates it)."""
    case = make_case(rng, b=1, sq=33, sk=65, h=2, d=32, dropout_prob=0.2, seed=1)
    other = replace(case, opts=replace(case.opts, seed=2))
    out = run_forward(dev, case)
    a, b = run_backward(dev, case, out), run_backward(dev, other, out)
    assert not np.array_equal(a["grad_v"], b["grad_v"])
