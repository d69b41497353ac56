"""ferrocupy.transformers: `attn_implementation="ferrocupy"` against transformers' own `sdpa` and
`eager` on tiny random-weight models built from configs (no download), float32 on CPU (the
reference backend): logits, parameter gradients, greedy generation through the KV cache; and the
attention function alone on the cases the models reach only sometimes (a decode step without a
mask, a sliding window without a mask, a static cache's prefill)."""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "AttentionInterface"):
    pytest.skip("this transformers has no AttentionInterface", allow_module_level=True)

import torch.nn.functional as F  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402
from transformers.masking_utils import (causal_mask_function, sdpa_mask,  # noqa: E402
                                        sliding_window_causal_mask_function)

import ferrocupy.torch  # noqa: E402
import ferrocupy.transformers as fct  # noqa: E402
from gpu_helpers import gpu_pytestmark  # noqa: E402  (tests/, on sys.path by conftest)

ROOT = Path(__file__).resolve().parents[1]
VOCAB, S = 96, 12
TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
# Mistral's window (5) and Qwen2's (4, on its second layer only) are shorter than the prompts, so
# the sliding masks cut keys off, in the prompt and in the decode steps.
CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(**TINY),
    "mistral": lambda: transformers.MistralConfig(**TINY, head_dim=16, sliding_window=5),
    "qwen2": lambda: transformers.Qwen2Config(**TINY, use_sliding_window=True, sliding_window=4,
                                              max_window_layers=1),
}
IMPLS = ("ferrocupy", "sdpa", "eager")
# The model tests run on CPU (the reference backend) and, marked `gpu`, on CUDA (the kernels,
# float32: 3xTF32, float32-accurate, against torch's float32 SDPA, hence the looser tolerances).
CUDA = pytest.param("cuda", marks=[*gpu_pytestmark(), pytest.mark.skipif(
    not torch.cuda.is_available(), reason="PyTorch has no CUDA device")])
DEVICES = ["cpu", CUDA]
LOGIT_TOL = {"cpu": 1e-5, "cuda": 1e-4}
GRAD_TOL = {"cpu": (1e-4, 1e-6), "cuda": (1e-3, 1e-5)}  # (rtol, atol)


@pytest.fixture(scope="module", autouse=True)
def registered():
    fct.register()


@pytest.fixture
def calls(monkeypatch):
    """Every call of ferrocupy.torch.attention, as (q, k, v, keyword arguments), still run."""
    seen = []
    real = ferrocupy.torch.attention

    def spy(q, k, v, **kw):
        seen.append((q, k, v, kw))
        return real(q, k, v, **kw)

    monkeypatch.setattr(ferrocupy.torch, "attention", spy)
    return seen


def _models(name: str, device: str = "cpu", **overrides) -> dict:
    """The same random weights under each attention implementation (each model gets its own
    copy of the config: from_config records the implementation in it)."""
    config = CONFIGS[name]()
    for key, value in overrides.items():
        setattr(config, key, value)
    torch.manual_seed(0)
    models = {impl: AutoModelForCausalLM.from_config(copy.deepcopy(config),
                                                     attn_implementation=impl,
                                                     dtype=torch.float32) for impl in IMPLS}
    for model in models.values():
        model.load_state_dict(models["sdpa"].state_dict())
        model.to(device).eval()
    return models


def _batch(padding: str, seed: int = 1, device: str = "cpu"):
    """(input_ids [3, S], attention_mask [3, S] of 0/1 as a tokenizer gives, or None)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (3, S), generator=gen)
    if padding == "none":
        return ids.to(device), None
    mask = torch.ones(3, S, dtype=torch.long)
    for row, pad in enumerate((3, 0, 7)):  # one row unpadded
        if padding == "left":
            mask[row, :pad] = 0
        else:
            mask[row, S - pad:] = 0
    return ids.masked_fill(mask == 0, 0).to(device), mask.to(device)


def _real(mask):
    """The positions that are not padding (rows of padding queries differ between eager, whose
    mask is finite, and SDPA/ferrocupy, which give 0)."""
    return slice(None) if mask is None else mask.bool()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("padding", ["none", "left", "right"])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_logits_match_sdpa_and_eager(name, padding, device, calls):
    models = _models(name, device)
    ids, mask = _batch(padding, device=device)
    tol = LOGIT_TOL[device]
    with torch.no_grad():
        logits = {impl: m(ids, attention_mask=mask).logits for impl, m in models.items()}
    assert len(calls) == 2  # one a layer: ferrocupy ran, in every layer
    torch.testing.assert_close(logits["ferrocupy"], logits["sdpa"], rtol=tol, atol=tol)
    real = _real(mask)
    torch.testing.assert_close(logits["ferrocupy"][real], logits["eager"][real], rtol=tol,
                               atol=tol)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("padding", ["none", "left", "right"])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_gradients_match_sdpa(name, padding, device):
    models = _models(name, device)
    ids, mask = _batch(padding, seed=2, device=device)
    rtol, atol = GRAD_TOL[device]
    labels = ids if mask is None else ids.masked_fill(mask == 0, -100)
    grads = {}
    for impl in ("ferrocupy", "sdpa"):
        model = models[impl].train()  # attention_dropout is 0: training changes nothing else
        model(ids, attention_mask=mask, labels=labels).loss.backward()
        grads[impl] = {n: p.grad for n, p in model.named_parameters()}
    assert grads["sdpa"].keys() == grads["ferrocupy"].keys()
    for n, g in grads["sdpa"].items():
        torch.testing.assert_close(grads["ferrocupy"][n], g, rtol=rtol, atol=atol, msg=n)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("padding", ["none", "left"])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_greedy_generation_matches_sdpa(name, padding, cache, device):
    """Through the KV cache: the prompt, then one query a step. A dynamic cache without padding
    passes no mask to the decode steps (bottom-right alignment); a static cache without padding
    passes none to the prompt's full-attention layers, whose keys are the cache's 17 slots
    (top-left); padding passes masks."""
    models = _models(name, device)
    ids, mask = _batch(padding, seed=3, device=device)
    out = {impl: models[impl].generate(ids, attention_mask=mask, max_new_tokens=6,
                                       do_sample=False, use_cache=True, pad_token_id=0,
                                       cache_implementation=cache, output_scores=True,
                                       return_dict_in_generate=True)
           for impl in ("ferrocupy", "sdpa")}
    torch.testing.assert_close(out["ferrocupy"].sequences, out["sdpa"].sequences, rtol=0,
                               atol=0)
    tol = LOGIT_TOL[device]
    for mine, theirs in zip(out["ferrocupy"].scores, out["sdpa"].scores):
        torch.testing.assert_close(mine, theirs, rtol=tol, atol=tol)


def test_dropout_only_in_training(calls):
    models = _models("llama", attention_dropout=0.5)
    ids, _ = _batch("none")
    model = models["ferrocupy"]
    with torch.no_grad():
        plain = model(ids).logits
        model.train()
        torch.manual_seed(5)
        first = model(ids).logits
        torch.manual_seed(5)
        again = model(ids).logits
    assert [kw["dropout_p"] for *_, kw in calls] == [0.0, 0.0] + [0.5] * 4
    torch.testing.assert_close(first, again, rtol=0, atol=0)  # seeded from torch's generator
    assert not torch.allclose(first, plain)


def test_gemma2_scaling_matches_eager_without_softcap():
    """Gemma 2's `query_pre_attn_scalar` sets `scaling` (here 1/sqrt(32), not 1/sqrt(head_dim));
    without softcap (which transformers' sdpa refuses) it runs, against eager."""
    config = transformers.Gemma2Config(**TINY, head_dim=16, sliding_window=5,
                                       query_pre_attn_scalar=32, attn_logit_softcapping=None)
    torch.manual_seed(0)
    eager = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="eager")
    mine = AutoModelForCausalLM.from_config(config, attn_implementation="ferrocupy")
    mine.load_state_dict(eager.state_dict())
    ids, mask = _batch("left")
    with torch.no_grad():
        logits = [m.eval()(ids, attention_mask=mask).logits for m in (mine, eager)]
    real = _real(mask)
    torch.testing.assert_close(logits[0][real], logits[1][real], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["gemma2", "gpt_oss"])
def test_softcap_and_sinks_models_match_eager(name):
    """Gemma 2's logit softcap and gpt-oss's attention sinks (and their gradient) on the
    reference backend, against transformers' eager implementation (the one that takes both)."""
    config = {"gemma2": lambda: transformers.Gemma2Config(**TINY, head_dim=16, sliding_window=4,
                                                          attn_logit_softcapping=5.0),
              "gpt_oss": lambda: transformers.GptOssConfig(**TINY, head_dim=16, sliding_window=4,
                                                           num_local_experts=4,
                                                           num_experts_per_tok=2)}[name]()
    torch.manual_seed(0)
    eager = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="eager")
    mine = AutoModelForCausalLM.from_config(config, attn_implementation="ferrocupy")
    with torch.no_grad():  # scores of order 1 (so the softcap bites), sinks away from zero
        for n, p in eager.named_parameters():
            if n.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(20)
            elif n.endswith("sinks"):
                p.add_(torch.randn_like(p))
    mine.load_state_dict(eager.state_dict())
    ids = torch.randint(0, VOCAB, (2, 7))
    logits = [m.eval()(ids).logits for m in (mine, eager)]
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-5, atol=1e-5)
    for m, lg in zip((mine, eager), logits):
        lg.square().mean().backward()
    for (n, a), (_, b) in zip(mine.named_parameters(), eager.named_parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-6, msg=n)


# --- the attention function alone -------------------------------------------------------------
class _Module(torch.nn.Module):
    is_causal = True
    num_key_value_groups = 2


def _qkv(Sq: int, Sk: int, seed: int = 0, B: int = 2):
    """SDPA-layout q [B, 4, Sq, 16] and k, v [B, 2, Sk, 16] (GQA), as the models hand them."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, 4, Sq, 16, generator=gen)
    k, v = (torch.randn(B, 2, Sk, 16, generator=gen) for _ in range(2))
    return q, k, v


def _sdpa(q, k, v, mask=None, is_causal=False, scale=None):
    """torch's SDPA, the answer in transformers' output layout [B, S, H, D]."""
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal,
                                         scale=scale, enable_gqa=True)
    return out.transpose(1, 2)


def _window_mask(Sq: int, Sk: int, window: int):
    """transformers' own sliding-window causal mask, the queries the last Sq of Sk tokens."""
    return sdpa_mask(batch_size=2, q_length=Sq, kv_length=Sk, q_offset=Sk - Sq,
                     mask_function=sliding_window_causal_mask_function(window),
                     allow_is_causal_skip=False)


def test_views_go_in_without_copies_and_kv_heads_unrepeated(calls):
    q, k, v = _qkv(5, 5)
    out, weights = fct.attention_forward(_Module(), q, k, v, None, scaling=0.3)
    (fq, fk, fv, kw), = calls
    for mine, theirs in ((fq, q), (fk, k), (fv, v)):
        assert mine.data_ptr() == theirs.data_ptr()
        assert mine.shape == theirs.transpose(1, 2).shape
        assert mine.stride() == theirs.transpose(1, 2).stride()
    assert weights is None and kw["scale"] == 0.3
    torch.testing.assert_close(out, _sdpa(q, k, v, is_causal=True, scale=0.3), rtol=1e-5,
                               atol=1e-6)


def test_decode_step_without_mask_sees_the_whole_cache():
    q, k, v = _qkv(1, 9)
    out, _ = fct.attention_forward(_Module(), q, k, v, None)
    torch.testing.assert_close(out, _sdpa(q, k, v), rtol=1e-5, atol=1e-6)


def test_static_cache_prefill_without_mask_is_top_left():
    """transformers passes no mask for a prompt of 4 into an empty 8-slot static cache: the
    queries are positions 0..3 and slots 4..7 are unwritten (zeros here)."""
    q, k, v = _qkv(4, 8)
    k[:, :, 4:], v[:, :, 4:] = 0, 0
    out, _ = fct.attention_forward(_Module(), q, k, v, None)
    torch.testing.assert_close(out, _sdpa(q, k[:, :, :4], v[:, :, :4], is_causal=True),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("Sq, Sk", [(9, 9), (1, 9), (1, 3)])
def test_sliding_window_without_mask_is_transformers_rule(Sq, Sk):
    q, k, v = _qkv(Sq, Sk)
    out, _ = fct.attention_forward(_Module(), q, k, v, None, sliding_window=3)
    torch.testing.assert_close(out, _sdpa(q, k, v, _window_mask(Sq, Sk, 3)), rtol=1e-5,
                               atol=1e-6)


def test_a_mask_is_applied_as_it_is():
    """With a mask, neither causality nor the window is added: the mask holds both, and its
    positions may not be the shapes' (here a chunk of 3 queries after 6 cached keys)."""
    q, k, v = _qkv(3, 9)
    mask = _window_mask(3, 9, 4)
    out, _ = fct.attention_forward(_Module(), q, k, v, mask, sliding_window=4)
    torch.testing.assert_close(out, _sdpa(q, k, v, mask), rtol=1e-5, atol=1e-6)


@settings(max_examples=80, deadline=None)
@given(st.data())
def test_every_mask_transformers_builds_reads_as_sdpa_reads_it(data):
    """Whatever transformers' mask function hands over for a cache's positions (a dynamic cache:
    the queries are the last Sq of Sk keys; a static one: they follow `past` written slots, the
    rest unwritten), padding anywhere and any window, mask or None, ferrocupy's answer is SDPA's
    with the mask materialized (`allow_is_causal_skip=False`)."""
    Sk = data.draw(st.integers(1, 10), "Sk")
    Sq = data.draw(st.sampled_from(sorted({1, Sk, data.draw(st.integers(1, Sk))})), "Sq")
    static = data.draw(st.booleans(), "static")
    past = data.draw(st.integers(0, Sk - Sq), "past") if static else Sk - Sq
    window = data.draw(st.none() | st.integers(1, Sk + 1), "window")
    seen = past + Sq  # the 2-D padding mask's length (transformers pads it to Sk with False)
    rows = data.draw(st.lists(st.sampled_from(["full", "left", "right", "holes"]), min_size=1,
                              max_size=3), "padding")
    pad = torch.ones(len(rows), seen, dtype=torch.bool)
    for b, kind in enumerate(rows):
        cut = data.draw(st.integers(0, seen - 1))
        if kind == "left":
            pad[b, :cut] = False
        elif kind == "right":
            pad[b, seen - cut:] = False
        elif kind == "holes":
            pad[b] = torch.tensor(data.draw(st.lists(st.booleans(), min_size=seen,
                                                     max_size=seen)))
    fn = causal_mask_function if window is None else sliding_window_causal_mask_function(window)
    args = dict(batch_size=len(rows), q_length=Sq, kv_length=Sk, q_offset=past,
                mask_function=fn, attention_mask=pad, local_size=window)
    q, k, v = _qkv(Sq, Sk, seed=Sk * 16 + Sq, B=len(rows))
    # create_causal_mask never skips the mask for one query into a static (compileable) cache.
    mask = sdpa_mask(**args, allow_is_causal_skip=not (static and Sq == 1))
    out, _ = fct.attention_forward(_Module(), q, k, v, mask, sliding_window=window)
    want = _sdpa(q, k, v, sdpa_mask(**args, allow_is_causal_skip=False))
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)


def test_softcap_and_sinks_are_handed_on():
    """`softcap` and gpt-oss's `s_aux` reach ferrocupy.torch.attention's softcap= and sinks=
    (cast to float32); None and 0 mean neither."""
    from ferrocupy.torch import attention

    q, k, v = _qkv(3, 3)
    sinks = torch.randn(4, dtype=torch.bfloat16)
    out, _ = fct.attention_forward(_Module(), q, k, v, None, softcap=5.0, s_aux=sinks)
    want = attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True,
                     softcap=5.0, sinks=sinks.float())
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    plain, _ = fct.attention_forward(_Module(), q, k, v, None, softcap=None, s_aux=None)
    assert plain.shape == (2, 3, 4, 16) and not torch.allclose(plain, out)


def test_registered_under_the_name():
    from transformers import AttentionInterface, AttentionMaskInterface

    fct.register("ferrocupy-test")
    assert AttentionInterface()["ferrocupy-test"] is fct.attention_forward
    assert AttentionMaskInterface()["ferrocupy-test"] is sdpa_mask


def test_importing_the_module_imports_no_transformers():
    """transformers (and torch) come in with register(), not with the import."""
    probe = ("import sys, ferrocupy.transformers; "
             "assert 'transformers' not in sys.modules and 'torch' not in sys.modules")
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_a_transformers_without_the_interfaces_is_named(monkeypatch):
    monkeypatch.delattr(transformers.masking_utils, "sdpa_mask")
    with pytest.raises(ImportError, match="sdpa_mask.*this is transformers"):
        fct.register("ferrocupy-old")
