"""SPEC "Beyond the seed, part 2" on the reference backend: signed causal_offset, asymmetric
windows, softcap, ALiBi, attention sinks (with their gradient) and head_dim up to 256, forward
and backward, against the independent dense float64 oracle of tests/dense_options.py (autograd
for the gradients); NaN-poisoned outputs, dead rows, bad inputs, and the CUDA backend's
refusals at plan time."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dense_options import dense, dense_grads, per_head_inputs
from ferrocupy import AttentionOptions, ComputeEngine
from ferrocupy import reference as ref
from ferrocupy.params import FLASH_V2_PARAMS, extras_params, words
from helpers import poison

torch = pytest.importorskip("torch")

TOL = 2e-5  # float32 outputs of a float64 computation, against float64


def _eng():
    return ComputeEngine("reference", quiet=True)


def _opts_of(o: dict) -> AttentionOptions:
    keys = ("causal", "causal_offset", "window", "window_left", "window_right", "softcap",
            "dropout_prob", "seed", "scale")
    return AttentionOptions(**{k: o[k] for k in keys if k in o})


def _oracle_options(opts: AttentionOptions, **tensors) -> dict:
    left, right = opts.windows()
    return dict(causal=opts.causal, causal_offset=opts.causal_offset, window_left=left,
                window_right=right, softcap=float(np.float32(opts.softcap)),
                scale=None if opts.scale is None else float(np.float32(opts.scale)), **tensors)


def _case(rng, b, sq, sk, h, hkv, d, *, alibi=None, sinks=False, mask=False):
    q = rng.standard_normal((b, sq, h, d), dtype=np.float32)
    k = rng.standard_normal((b, sk, hkv, d), dtype=np.float32)
    v = rng.standard_normal((b, sk, hkv, d), dtype=np.float32)
    t = dict(q=q, k=k, v=v) | per_head_inputs(rng, b, h, alibi=alibi, sinks=sinks)
    if mask:
        t["mask"] = rng.standard_normal((1, h, sq, sk)).astype(np.float32)
    return t


def _keep(opts, t):
    """The dropout keep-mask of the call, from the reference's Philox (tested on its own)."""
    if not opts.dropout_prob:
        return None
    q, k = t["q"], t["k"]
    p = np.zeros((), FLASH_V2_PARAMS)
    p["heads"], p["seed"], p["dropout_prob"] = q.shape[2], opts.seed & 0xFFFFFFFF, \
        opts.dropout_prob
    return np.array([[ref.dropout_keep(p, b, h, range(q.shape[1]), range(k.shape[1]))
                      for h in range(q.shape[2])] for b in range(q.shape[0])])


def _forward(eng, t, opts, lse=True):
    out = poison(np.empty_like(t["q"]))
    lse_out = poison(np.empty(t["q"].shape[:1] + t["q"].shape[2:3] + t["q"].shape[1:2],
                              np.float32)) if lse else None
    eng.flash_attention_v2_with(t["q"], t["k"], t["v"], out, opts, t.get("mask"), lse=lse_out,
                                kv_lens=t.get("kv_lens"), alibi_slopes=t.get("alibi_slopes"),
                                sinks=t.get("sinks"))
    return out, lse_out


def _backward(eng, t, opts, out, go, lse=None):
    gq, gk, gv = (poison(np.empty_like(t[n])) for n in ("q", "k", "v"))
    gs = None if t.get("sinks") is None else poison(np.empty_like(t["sinks"]))
    eng.flash_attention_v2_backward_with(t["q"], t["k"], t["v"], out, go, gq, gk, gv, opts,
                                         t.get("mask"), lse=lse,
                                         alibi_slopes=t.get("alibi_slopes"), sinks=t.get("sinks"),
                                         grad_sinks=gs)
    return gq, gk, gv, gs


def _close(got, want, tol=TOL, what=""):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, what
    finite = np.isfinite(want)
    assert np.array_equal(got[~finite], want[~finite]), f"{what}: non-finite entries differ"
    scale = max(np.abs(want[finite]).max(initial=0.0), 1.0)
    err = np.abs(got[finite] - want[finite]).max(initial=0.0) / scale
    assert err <= tol, f"{what}: error {err:.2e}"


def check_call(t, opts, *, backward=True, lse_given=False, rng=None):
    """Forward (out, lse) and backward (grads, grad_sinks) of the engine against the oracle."""
    eng = _eng()
    keep = _keep(opts, t)
    oracle = _oracle_options(opts, alibi_slopes=t.get("alibi_slopes"), mask=t.get("mask"),
                             kv_lens=t.get("kv_lens"), keep=keep,
                             dropout_prob=opts.dropout_prob)
    out, lse = _forward(eng, t, opts)
    want_out, want_lse = dense(t["q"], t["k"], t["v"], sinks=t.get("sinks"), **oracle)
    _close(out, want_out.numpy(), what="out")
    _close(lse, want_lse.numpy(), what="lse")
    if not backward:
        return
    rng = rng or np.random.default_rng(0)
    go = rng.standard_normal(t["q"].shape).astype(np.float32)
    got = _backward(eng, t, opts, out, go, lse if lse_given else None)
    check_grads(got, dense_grads(t["q"], t["k"], t["v"], go, sinks=t.get("sinks"), **oracle))


def check_grads(got, want):
    """(grad_q, grad_k, grad_v, grad_sinks or None) against the oracle's."""
    for name, g, w in zip(("grad_q", "grad_k", "grad_v", "grad_sinks"), got, want):
        if w is None:
            assert g is None
        else:
            _close(g, w, tol=5e-5, what=name)


# --- named cases ---------------------------------------------------------------------------------
CASES = {
    "negative-offset": (dict(causal=True, causal_offset=-3), {}),
    "bottom-right-sq-over-sk": (dict(causal=True, causal_offset=5 - 9), {}),
    "window-left-only": (dict(window_left=2), {}),
    "window-right-only": (dict(window_right=1, causal_offset=2), {}),
    "asymmetric-causal": (dict(causal=True, window_left=3, window_right=0, causal_offset=-1), {}),
    "window-left-zero": (dict(window_left=0, window_right=-1), {}),
    "softcap": (dict(softcap=1.5), {}),
    "softcap-mask": (dict(softcap=0.7, causal=True), dict(mask=True)),
    "alibi-h": (dict(causal=True), dict(alibi="h")),
    "alibi-bh-offset": (dict(causal=True, causal_offset=-2), dict(alibi="bh")),
    "sinks": (dict(), dict(sinks=True)),
    "sinks-causal-dead-rows": (dict(causal=True, causal_offset=-4), dict(sinks=True)),
    "everything": (dict(causal=True, causal_offset=1, window_left=4, window_right=2, softcap=2.0,
                        dropout_prob=0.25, seed=7), dict(alibi="bh", sinks=True, mask=True)),
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("lse_given", [False, True])
def test_options_against_the_dense_oracle(rng, name, lse_given):
    o, tensors = CASES[name]
    t = _case(rng, 2, 9, 5, 4, 2, 8, **tensors)
    check_call(t, _opts_of(o), lse_given=lse_given, rng=rng)


@pytest.mark.parametrize("d", [136, 200, 256])
def test_head_dim_up_to_256(rng, d):
    t = _case(rng, 1, 5, 6, 2, 1, d, sinks=True)
    check_call(t, AttentionOptions(causal=True, softcap=3.0), rng=rng)


def test_kv_lens_with_alibi_and_negative_offset(rng):
    """Rows sit kv_lens[b] - Sk earlier (ALiBi's distance too); forward only."""
    t = _case(rng, 3, 4, 7, 2, 2, 8, alibi="bh", sinks=True)
    t["kv_lens"] = np.array([7, 3, 0], np.int32)
    t["k"][1, 3:] = np.nan  # never read
    check_call(t, AttentionOptions(causal=True, causal_offset=-1), backward=False)


# --- hypothesis over option combinations --------------------------------------------------------
@st.composite
def option_calls(draw):
    sq, sk = draw(st.integers(1, 7)), draw(st.integers(0, 7))
    hkv = draw(st.sampled_from([1, 2]))
    dims = (draw(st.integers(1, 2)), sq, sk, hkv * draw(st.sampled_from([1, 2])), hkv,
            draw(st.sampled_from([4, 8, 16])))
    o = dict(causal=draw(st.booleans()), causal_offset=draw(st.integers(-8, 8)))
    form = draw(st.sampled_from(["none", "symmetric", "asymmetric"]))
    if form == "symmetric":
        o["window"] = draw(st.integers(1, 5))
    elif form == "asymmetric":
        o["window_left"] = draw(st.sampled_from([None, -1, 0, 1, 3]))
        o["window_right"] = draw(st.sampled_from([None, -1, 0, 2]))
    o["softcap"] = draw(st.sampled_from([0.0, 0.5, 5.0]))
    if draw(st.booleans()):
        o.update(dropout_prob=0.3, seed=draw(st.integers(0, 2**40)))
    tensors = dict(alibi=draw(st.sampled_from([None, "h", "bh"])), sinks=draw(st.booleans()),
                   mask=draw(st.booleans()))
    kv_lens = draw(st.none() | st.lists(st.integers(0, sk), min_size=dims[0], max_size=dims[0]))
    return dims, o, tensors, kv_lens, draw(st.booleans()), draw(st.integers(0, 2**32 - 1))


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(option_calls())
def test_option_combinations(call):
    """Forward and backward (the forward alone with kv_lens, which the backward refuses)."""
    dims, o, tensors, kv_lens, lse_given, seed = call
    t = _case(np.random.default_rng(seed), *dims, **tensors)
    if kv_lens is not None:
        t["kv_lens"] = np.array(kv_lens, np.int32)
    check_call(t, _opts_of(o), lse_given=lse_given, rng=np.random.default_rng(seed + 1),
               backward=kv_lens is None)


# --- dead rows ----------------------------------------------------------------------------------
@pytest.mark.parametrize("sinks", [False, True])
def test_dead_rows_give_zeros_and_their_lse(rng, sinks):
    """Rows below position 0 under causal, rows a window leaves without keys and rows whose mask
    is all -inf: out = 0, lse = -inf (the sink's logit with sinks), zero gradients."""
    t = _case(rng, 1, 6, 4, 2, 1, 8, sinks=sinks, mask=True)
    t["mask"][0, :, 5] = -np.inf  # row 5: every score -inf
    # positions -2..3 causal; window_right=-1, window_left=0: row a sees only key a (a <= 3)
    opts = AttentionOptions(causal=True, causal_offset=-2, window_left=0)
    eng = _eng()
    out, lse = _forward(eng, t, opts)
    dead = [0, 1, 5]
    assert np.all(out[0, dead] == 0)
    want = np.broadcast_to(t["sinks"][:, None], (2, 3)) if sinks else np.full((2, 3), -np.inf)
    assert np.array_equal(lse[0][:, dead], want.astype(np.float32))
    assert np.all(np.isfinite(out)) and np.all(np.isfinite(lse[0][:, [2, 3, 4]]))
    go = rng.standard_normal(out.shape).astype(np.float32)
    gq, gk, gv, gs = _backward(eng, t, opts, out, go)
    assert np.all(gq[0, dead] == 0) and np.all(np.isfinite(gk)) and np.all(np.isfinite(gv))
    if sinks:
        assert np.all(np.isfinite(gs))
    check_call(t, opts, rng=rng)


def test_minus_inf_sink_on_dead_rows_gives_zero_gradient(rng):
    """A sink of -inf is no sink: where a row also sees no key its LSE is -inf, and its share of
    grad_sinks is 0 (exp(sink - LSE) is taken as 0 there, never -inf - -inf = NaN)."""
    t = _case(rng, 1, 6, 4, 2, 1, 8, sinks=True, mask=True)
    t["sinks"][0] = -np.inf
    t["mask"][0, :, 5] = -np.inf
    opts = AttentionOptions(causal=True, causal_offset=-2)
    eng = _eng()
    out, lse = _forward(eng, t, opts)
    assert np.all(lse[0][0, [0, 1, 5]] == -np.inf)
    go = rng.standard_normal(out.shape).astype(np.float32)
    gs = _backward(eng, t, opts, out, go)[3]
    assert gs[0] == 0 and np.isfinite(gs[1])


def test_every_row_dead(rng):
    """Sq rows all below position 0: out 0, lse -inf, every gradient 0 (written over NaN)."""
    t = _case(rng, 2, 3, 5, 2, 2, 4, alibi="h")
    opts = AttentionOptions(causal=True, causal_offset=-3)
    eng = _eng()
    out, lse = _forward(eng, t, opts)
    assert np.all(out == 0) and np.all(lse == -np.inf)
    grads = _backward(eng, t, opts, out, rng.standard_normal(out.shape).astype(np.float32))
    assert all(np.all(g == 0) for g in grads[:3])


def test_grad_sinks_written_not_accumulated_and_zero_without_rows(rng):
    t = _case(rng, 1, 0, 4, 2, 1, 8, sinks=True)
    eng = _eng()
    out, _ = _forward(eng, t, AttentionOptions())
    gs = _backward(eng, t, AttentionOptions(), out, np.empty_like(out))[3]
    assert np.array_equal(gs, np.zeros(2, np.float32))
    t = _case(rng, 1, 3, 4, 2, 1, 8, sinks=True)
    out, _ = _forward(eng, t, AttentionOptions())
    go = rng.standard_normal(out.shape).astype(np.float32)
    first = _backward(eng, t, AttentionOptions(), out, go)[3]
    again = np.full(2, 100.0, np.float32)
    eng.flash_attention_v2_backward_with(t["q"], t["k"], t["v"], out, go, np.empty_like(out),
                                         np.empty_like(t["k"]), np.empty_like(t["v"]),
                                         sinks=t["sinks"], grad_sinks=again)
    assert np.array_equal(first, again)


# --- packing -----------------------------------------------------------------------------------
def test_new_options_leave_the_seed_struct_as_it_was(rng):
    """The seed's FlashV2Params / FlashBwdParams carry no new option: a call with them packs
    the same bytes as the call without (the window word is 0 under the asymmetric form); the
    new values live in AttnExtras."""
    t = _case(rng, 2, 3, 4, 2, 1, 8, alibi="bh", sinks=True)
    eng = _eng()
    out = np.empty_like(t["q"])
    plain = eng.plan_attention(t["q"], t["k"], t["v"], out, AttentionOptions(causal=True))
    rich = eng.plan_attention(t["q"], t["k"], t["v"], out,
                              AttentionOptions(causal=True, window_left=3, window_right=0,
                                               softcap=2.5),
                              alibi_slopes=t["alibi_slopes"], sinks=t["sinks"])
    assert plain.params.tobytes() == rich.params.tobytes()
    assert words(plain.extras).tolist() == [2**32 - 1, 2**32 - 1] + [0] * 6
    ex = rich.extras
    assert (int(ex["window_left"]), int(ex["window_right"])) == (3, 0)
    assert np.float32(ex["softcap"]) == np.float32(2.5) and int(ex["flags"]) == 1 | 2 | 4
    sym = extras_params(AttentionOptions(window=4))
    assert (int(sym["window_left"]), int(sym["window_right"])) == (3, 3)


def test_symmetric_window_equals_its_asymmetric_form(rng):
    t = _case(rng, 1, 8, 8, 2, 2, 8)
    eng = _eng()
    a = _forward(eng, t, AttentionOptions(causal=True, window=3, causal_offset=-1))
    b = _forward(eng, t, AttentionOptions(causal=True, window_left=2, window_right=2,
                                          causal_offset=-1))
    assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])


# --- bad inputs ----------------------------------------------------------------------------------
def _bad_calls(rng):
    t = _case(rng, 2, 3, 4, 4, 2, 8, alibi="h", sinks=True)
    f32 = np.float32
    return t, [
        (dict(alibi_slopes=np.ones(3, f32)), ValueError,
         r"alibi_slopes shape \(3,\) must be \[heads\] = \[4\] or \[batch, heads\] = \[2, 4\]"),
        (dict(alibi_slopes=np.ones((4, 2), f32)), ValueError, r"alibi_slopes shape \(4, 2\)"),
        (dict(alibi_slopes=np.ones(4, np.float64)), TypeError,
         r"alibi_slopes has dtype float64 \(shape \(4,\)\); it must be float32"),
        (dict(alibi_slopes=np.ones((4, 2), f32).T), ValueError,
         r"alibi_slopes \(shape \(2, 4\)\) is not C-contiguous"),
        (dict(sinks=np.ones((2, 4), f32)), ValueError,
         r"sinks shape \(2, 4\) must be \[heads\] = \[4\]"),
        (dict(sinks=np.ones(4, np.float16)), TypeError, r"sinks has dtype float16"),
        (dict(opts=AttentionOptions(softcap=-1.0)), ValueError,
         r"softcap must be finite and >= 0 .*got -1.0"),
        (dict(opts=AttentionOptions(softcap=float("nan"))), ValueError, r"softcap must be finite"),
        (dict(opts=AttentionOptions(softcap=1e39)), ValueError, r"softcap must be finite"),
        (dict(opts=AttentionOptions(softcap=True)), TypeError, r"softcap must be a number"),
        (dict(opts=AttentionOptions(window=3, window_left=1)), ValueError,
         r"give either window \(3\) or window_left/window_right \(1, None\), not both"),
        (dict(opts=AttentionOptions(window_right=-2)), ValueError,
         r"window_right must be in \[-1, 2\*\*31\), got -2"),
        (dict(opts=AttentionOptions(window_left=1.0)), TypeError, r"window_left must be an int"),
    ]


def test_bad_inputs_raise_naming_the_argument_and_write_nothing(rng):
    t, cases = _bad_calls(rng)
    eng = _eng()
    for change, err, match in cases:
        out, lse = np.zeros_like(t["q"]), np.zeros((2, 4, 3), np.float32)
        args = dict(alibi_slopes=t["alibi_slopes"], sinks=t["sinks"]) | change
        opts = args.pop("opts", AttentionOptions())
        with pytest.raises(err, match=match):
            eng.flash_attention_v2_with(t["q"], t["k"], t["v"], out, opts, lse=lse, **args)
        assert not out.any() and not lse.any()
        grads = [np.zeros_like(t[n]) for n in ("q", "k", "v")]
        gs = np.zeros(4, np.float32)
        with pytest.raises(err, match=match):
            eng.flash_attention_v2_backward_with(t["q"], t["k"], t["v"], out, out, *grads, opts,
                                                 grad_sinks=gs, **args)
        assert not any(g.any() for g in grads) and not gs.any()


def test_grad_sinks_rules(rng):
    t = _case(rng, 1, 3, 4, 2, 1, 8, sinks=True)
    eng = _eng()
    out = np.zeros_like(t["q"])
    grads = [np.zeros_like(t[n]) for n in ("q", "k", "v")]
    with pytest.raises(ValueError, match=r"grad_sinks \(shape \(2,\)\) is the gradient of sinks"):
        eng.flash_attention_v2_backward_with(t["q"], t["k"], t["v"], out, out, *grads,
                                             grad_sinks=np.zeros(2, np.float32))
    with pytest.raises(ValueError, match=r"grad_sinks shape \(3,\) must be \[heads\] = \[2\]"):
        eng.flash_attention_v2_backward_with(t["q"], t["k"], t["v"], out, out, *grads,
                                             sinks=t["sinks"], grad_sinks=np.zeros(3, np.float32))
    with pytest.raises(ValueError, match=r"grad_sinks \(shape \(2,\)\) shares memory with sinks"):
        eng.flash_attention_v2_backward_with(t["q"], t["k"], t["v"], out, out, *grads,
                                             sinks=t["sinks"], grad_sinks=t["sinks"])
    assert not any(g.any() for g in grads)


# --- the CUDA backend refuses what its kernels do not take yet, when the plan is made -----------
class _CudaRecorder:
    """A CUDA backend stand-in on host memory: plans are recorded, nothing runs."""

    name, device, generation = "cuda", "cpu", 0
    dtypes = ComputeEngine("reference", quiet=True).backend.dtypes

    def __init__(self):
        self.plans = []

    def plan(self, op, buffers, params, layout, ptrs, extras=None):
        self.plans.append(op)
        return type("Plan", (str,), {"counted": False})(op)


CUDA_REFUSALS = [
    (dict(d=257), r"head_dim <= 256, got 257 \(q shape \(2, 3, 4, 257\)\)"),
]


@pytest.mark.parametrize("d", [129, 136, 160, 200, 255, 256])
@pytest.mark.parametrize("op", ["forward", "backward"])
def test_cuda_backend_plans_every_head_dim_up_to_256(rng, op, d):
    """head_dim up to SPEC's 256 plans on the CUDA backend, with the model options (what
    test_cuda_backend_refuses_at_plan_time refuses at 257, and did above 128)."""
    eng = _eng()
    eng.backend = _CudaRecorder()
    t = _case(rng, 2, 3, 4, 4, 2, d, alibi="h", sinks=True)
    q, k, v = t["q"], t["k"], t["v"]
    opts = AttentionOptions(causal=True, softcap=5.0)
    named = dict(alibi_slopes=t["alibi_slopes"], sinks=t["sinks"])
    if op == "forward":
        plan = eng.plan_attention(q, k, v, np.zeros_like(q), opts, **named)
    else:
        plan = eng.plan_attention_backward(q, k, v, q, q, np.zeros_like(q), np.zeros_like(k),
                                           np.zeros_like(v), opts, **named)
    assert plan.dims.head_dim == d


@pytest.mark.parametrize("change, match", CUDA_REFUSALS)
@pytest.mark.parametrize("op", ["forward", "backward"])
def test_cuda_backend_refuses_at_plan_time(rng, change, match, op):
    eng = _eng()
    eng.backend = rec = _CudaRecorder()
    t = _case(rng, 2, 3, 4, 4, 2, change.get("d", 8), alibi="h", sinks=True)
    named = {n: t[n] for n in ("alibi_slopes", "sinks") if change.get(n)}
    opts = change.get("opts", AttentionOptions())
    q, k, v = t["q"], t["k"], t["v"]
    out = np.zeros_like(q)
    with pytest.raises(ValueError, match=match):
        if op == "forward":
            eng.plan_attention(q, k, v, out, opts, **named)
        else:
            eng.plan_attention_backward(q, k, v, out, out, np.zeros_like(q), np.zeros_like(k),
                                        np.zeros_like(v), opts, **named)
    with pytest.raises(ValueError, match=match):  # the engine's call plans first: same refusal
        eng.flash_attention_v2_with(q, k, v, out, opts, **named)
    assert rec.plans == [] and not out.any()
    # the seed's options still plan on it
    eng.plan_attention(q[..., :8], k[..., :8], v[..., :8], out[..., :8],
                       AttentionOptions(causal=True, causal_offset=2, window=3))


@pytest.mark.parametrize("op", ["forward", "backward"])
def test_cuda_backend_plans_softcap_alibi_and_sinks(rng, op):
    """The CUDA kernels take softcap, ALiBi ([heads] or [batch, heads]) and sinks: a plan is
    made, and its AttnExtras (what the kernels receive) carry them."""
    from ferrocupy.params import EXTRAS_ALIBI, EXTRAS_ALIBI_PER_BATCH, EXTRAS_SINKS

    eng = _eng()
    eng.backend = _CudaRecorder()
    for alibi, per_batch in (("h", 0), ("bh", EXTRAS_ALIBI_PER_BATCH)):
        t = _case(rng, 2, 3, 4, 4, 2, 8, alibi=alibi, sinks=True)
        q, k, v = t["q"], t["k"], t["v"]
        out = np.zeros_like(q)
        opts = AttentionOptions(causal=True, softcap=30.0)
        named = dict(alibi_slopes=t["alibi_slopes"], sinks=t["sinks"])
        if op == "forward":
            plan = eng.plan_attention(q, k, v, out, opts, **named)
        else:
            plan = eng.plan_attention_backward(q, k, v, out, out, np.zeros_like(q),
                                               np.zeros_like(k), np.zeros_like(v), opts,
                                               grad_sinks=np.zeros(4, np.float32), **named)
        assert float(plan.extras["softcap"]) == 30.0
        assert int(plan.extras["flags"]) == EXTRAS_ALIBI | per_batch | EXTRAS_SINKS


@pytest.mark.parametrize("op", ["forward", "backward"])
@pytest.mark.parametrize("opts, sides", [
    (AttentionOptions(causal=True, causal_offset=-3), (-1, -1)),
    (AttentionOptions(window_left=2), (2, -1)),
    (AttentionOptions(window_right=-1), (-1, -1)),
    (AttentionOptions(causal=True, causal_offset=-1, window_left=3, window_right=0), (3, 0)),
    (AttentionOptions(causal_offset=-2, window_left=0, window_right=4), (0, 4)),
])
def test_cuda_backend_plans_negative_offsets_and_asymmetric_windows(rng, op, opts, sides):
    """The CUDA kernels take a negative causal_offset and either side of the window: a plan is
    made, its seed struct holds the signed offset and its AttnExtras (whence every kernel reads
    the window, attn_shape) the sides."""
    eng = _eng()
    eng.backend = _CudaRecorder()
    t = _case(rng, 2, 3, 4, 4, 2, 8)
    q, k, v = t["q"], t["k"], t["v"]
    out = np.zeros_like(q)
    if op == "forward":
        plan = eng.plan_attention(q, k, v, out, opts)
    else:
        plan = eng.plan_attention_backward(q, k, v, out, out, np.zeros_like(q),
                                           np.zeros_like(k), np.zeros_like(v), opts)
    assert (int(plan.extras["window_left"]), int(plan.extras["window_right"])) == sides
    assert int(plan.params["causal_offset"]) == opts.causal_offset


@pytest.mark.parametrize("name", ["negative-offset", "window-right-only", "asymmetric-causal",
                                  "everything"])
def test_small_blocks_see_their_keys(rng, monkeypatch, name):
    """Blocks of 2 rows read only the keys some row of theirs can see (windows on either side,
    negative offsets): every block boundary must still add up."""
    monkeypatch.setattr(ref, "_BLOCK_ROWS", 2)
    o, tensors = CASES[name]
    t = _case(rng, 2, 9, 11, 4, 2, 8, **tensors)
    check_call(t, _opts_of(o), rng=rng)


@pytest.mark.gpu
@pytest.mark.parametrize("change, match", CUDA_REFUSALS)
def test_the_cuda_backend_refuses_on_the_gpu(rng, change, match):
    """The same refusals from the real CUDA backend, on CuPy arrays, nothing written."""
    import cupy

    eng = ComputeEngine("cuda", quiet=True)
    t = {n: cupy.asarray(a) for n, a in
         _case(rng, 2, 3, 4, 4, 2, change.get("d", 8), alibi="h", sinks=True).items()}
    named = {n: t[n] for n in ("alibi_slopes", "sinks") if change.get(n)}
    opts = change.get("opts", AttentionOptions())
    out = cupy.zeros_like(t["q"])
    with pytest.raises(ValueError, match=match):
        eng.flash_attention_v2_with(t["q"], t["k"], t["v"], out, opts, **named)
    grads = [cupy.zeros_like(t[n]) for n in ("q", "k", "v")]
    with pytest.raises(ValueError, match=match):
        eng.flash_attention_v2_backward_with(t["q"], t["k"], t["v"], out, out, *grads, opts,
                                             **named)
    assert not out.any() and not any(g.any() for g in grads)
