"""The GPU suite's option grids (`gpu_helpers.covering`): a pairwise covering by default, the
whole cartesian product with FERRO_FULL_GRID=1, ids as stacked `parametrize` would give them."""

from __future__ import annotations

import itertools

import pytest

from gpu_helpers import FULL_GRID_ENV, axis, covering

FACTORS = {
    "name": axis(["softcap", "alibi", "sinks", "all", "window"]),
    "give_lse": axis([True, False], ids=["lse", "no-lse"]),
    "d": axis([40, 64, 96, 128], ids=lambda d: f"d{d}"),
    "dtype": [pytest.param("f16-value", id="f16"), pytest.param("bf16-value", id="bf16")],
}


def _rows(params):
    return [(p.values, p.id) for p in params]


def test_every_pair_of_values_meets(monkeypatch):
    monkeypatch.delenv(FULL_GRID_ENV, raising=False)
    rows = _rows(covering(FACTORS))
    values = [[p.values[0] for p in axis(v)] for v in FACTORS.values()]
    for (i, a), (j, b) in itertools.combinations(enumerate(values), 2):
        for x, y in itertools.product(a, b):
            assert any(r[i] == x and r[j] == y for r, _ in rows), (i, x, j, y)
    full = 5 * 2 * 4 * 2
    assert len(rows) < full / 2  # a covering, not the product
    assert len({i for _, i in rows}) == len(rows)


def test_the_full_grid_is_the_product_with_parametrize_ids(monkeypatch):
    monkeypatch.setenv(FULL_GRID_ENV, "1")
    rows = _rows(covering(FACTORS))
    assert len(rows) == 5 * 2 * 4 * 2
    assert ("softcap", True, 40, "f16-value") in {v for v, _ in rows}
    assert "softcap-lse-d40-f16" in {i for _, i in rows}
    assert "window-no-lse-d128-bf16" in {i for _, i in rows}
