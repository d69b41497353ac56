"""The engine's remembered calls (issue 10: cost per call): a loop that calls with the same
UnifiedTensors skips the checks that depend only on them, and still checks what can change
(kv_lens' values) on every call. Run here on the reference backend dressed as a CUDA one (the
remembering is for the CUDA backend only), so it needs no GPU."""

from __future__ import annotations

import gc

import numpy as np
import pytest

from ferrocupy import AttentionOptions, ComputeEngine, UnifiedTensor
from ferrocupy.reference import ReferenceBackend


class CudaLike(ReferenceBackend):
    name = "cuda"  # what turns the remembering on; the arithmetic is the reference's


@pytest.fixture
def eng(monkeypatch):
    e = ComputeEngine("reference")
    e.backend = CudaLike()
    checks = []
    real = e._tensors
    monkeypatch.setattr(e, "_tensors", lambda **named: checks.append(1) or real(**named))
    e.checks = checks
    return e


def tensors(rng, b=2, sq=1, sk=33, h=4, hkv=2, d=16):
    mk = lambda *s: UnifiedTensor(rng.standard_normal(s).astype(np.float32))  # noqa: E731
    q, k, v = mk(b, sq, h, d), mk(b, sk, hkv, d), mk(b, sk, hkv, d)
    return q, k, v, UnifiedTensor(np.full((b, sq, h, d), np.nan, np.float32))


def test_same_tensors_are_checked_once_and_give_the_same_answer(eng, rng):
    q, k, v, out = tensors(rng)
    opts = AttentionOptions(causal=True, causal_offset=32)
    eng.flash_attention_v2_with(q, k, v, out, opts)
    first = out.to_numpy()
    out.buffer()[...] = np.nan
    eng.flash_attention_v2_with(q, k, v, out, AttentionOptions(causal=True, causal_offset=32))
    assert eng.checks == [1]  # equal options (another object), same tensors: remembered
    np.testing.assert_array_equal(out.to_numpy(), first)
    eng.flash_attention_v2_with(q, k, v, out, AttentionOptions(causal=True, causal_offset=31))
    other = UnifiedTensor(np.empty_like(out.buffer()))
    eng.flash_attention_v2_with(q, k, v, other, opts)
    assert eng.checks == [1, 1, 1]  # other options, another output: checked again


def test_kv_lens_values_are_checked_on_every_call(eng, rng):
    q, k, v, out = tensors(rng)
    lens = UnifiedTensor(np.array([33, 20], np.int32))
    eng.flash_attention_v2_with(q, k, v, out, AttentionOptions(), kv_lens=lens)
    lens.buffer()[1] = 34
    out.buffer()[...] = np.nan
    with pytest.raises(ValueError, match=r"kv_lens\[1\] = 34"):
        eng.flash_attention_v2_with(q, k, v, out, AttentionOptions(), kv_lens=lens)
    assert np.isnan(out.to_numpy()).all()  # nothing written


def test_aliasing_is_refused_whatever_was_remembered(eng, rng):
    q, k, v, out = tensors(rng)
    eng.flash_attention_v2_with(q, k, v, out)
    with pytest.raises(ValueError, match="shares memory"):
        eng.flash_attention_v2_with(q, k, v, q)


def test_a_dead_tensor_is_not_taken_for_a_new_one(eng, rng):
    q, k, v, out = tensors(rng)
    eng.flash_attention_v2_with(q, k, v, out)
    del out
    gc.collect()
    # A new output (perhaps at the dead one's id) of another shape must be checked, and refused.
    bad = UnifiedTensor(np.empty((2, 1, 4, 8), np.float32))
    with pytest.raises(ValueError, match="out shape"):
        eng.flash_attention_v2_with(q, k, v, bad)


def test_raw_arrays_and_the_reference_backend_are_not_remembered(eng, rng):
    q, k, v, out = tensors(rng)
    arrays = [x.buffer() for x in (q, k, v, out)]
    eng.flash_attention_v2_with(*arrays)
    eng.flash_attention_v2_with(*arrays)
    assert eng.checks == [1, 1]
    plain = ComputeEngine("reference")
    plain.flash_attention_v2_with(q, k, v, out)
    assert plain._seen == {}
