"""The half-precision accuracy rule's own pieces (tests/half_rule.py), on the CPU: the bound
refuses an error past it, and the `inherited` term is exactly what rounding the stored out
moves each gradient by."""

from __future__ import annotations

import numpy as np
import pytest

from ferrocupy.dtypes import FLOAT16
from gpu_helpers import make_case
from half_rule import check_rule, inherited_errors, rounded, x64


def test_rule_refuses_an_error_past_its_bound_and_allows_the_inherited_term():
    want = np.array([1.0, -2.0, 4.0])
    theirs = want + np.array([0.0, 1e-3, 0.0])  # torch's error 1e-3: the bound 2e-3 + 4e-3
    check_rule("x", want + 5.9e-3, want, theirs)
    with pytest.raises(AssertionError, match="max error"):
        check_rule("x", want + 6.1e-3, want, theirs)
    check_rule("x", want + 6.1e-3, want, theirs, inherited=2e-4)


def test_inherited_term_is_the_backward_moved_by_the_rounded_out(rng):
    """At head_dim 1 (Delta one product, dS = P (dP - Delta) cancelling) rounding out to float16
    moves grad_q and grad_k; grad_v never reads out."""
    case = rounded(make_case(rng, b=1, sq=40, sk=50, h=2, hkv=1, d=1, causal=True,
                             causal_offset=10), FLOAT16)
    want = x64(case)
    inh = inherited_errors(case, want)
    given = x64(case, out_dtype=FLOAT16)
    assert inh["grad_v"] == 0.0 and np.array_equal(given["grad_v"], want["grad_v"])
    for n in ("grad_q", "grad_k"):
        assert inh[n] == np.abs(given[n] - want[n]).max() > 0, n
