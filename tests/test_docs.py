"""docs/semantics.md, the contract README links, stays true to the code: its struct word orders are
the packed structs' fields, its Philox constants and known answers are the reference's, its links
resolve, and what is only planned stays in its "planned" list."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from ferrocupy import params, reference

ROOT = Path(__file__).resolve().parents[1]
DOC_PATH = ROOT / "docs" / "semantics.md"
DOC = DOC_PATH.read_text()


def _anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_readme_links_the_contract():
    readme = (ROOT / "README.md").read_text()
    assert "](docs/semantics.md)" in readme
    assert "SPEC.md" not in readme  # not in the repository: the contract is docs/semantics.md


def test_links_resolve():
    anchors = {_anchor(h) for h in re.findall(r"^#+ (.+)$", DOC, re.MULTILINE)}
    links = re.findall(r"\]\(([^)\s]+)\)", DOC)
    assert links, "expected at least the link to the planned list"
    for link in links:
        if link.startswith("#"):
            assert link[1:] in anchors, link
        elif not re.match(r"\w+://", link):
            assert (DOC_PATH.parent / link.split("#")[0]).exists(), link


@pytest.mark.parametrize("title, dtype", [("RoPE", params.ROPE_PARAMS),
                                          ("Forward", params.FLASH_V2_PARAMS),
                                          ("Backward", params.FLASH_BWD_PARAMS)])
def test_struct_word_order(title, dtype):
    m = re.search(rf"- \*\*{title}\*\*[^:]*: `([^`]+)`", DOC)
    assert m, title
    words = [w.split(" (")[0].strip() for w in m.group(1).split(",")]
    fields = [f if not f.startswith("_pad") else "0" for f in dtype.names]
    assert words == fields
    assert f"{len(fields)} words ({dtype.itemsize} bytes)" in DOC


def test_philox_constants_and_known_answers():
    for const in (reference.PHILOX_M0, reference.PHILOX_M1, reference.PHILOX_W0,
                  reference.PHILOX_W1):
        assert f"0x{const:X}" in DOC, hex(const)
    section = DOC.split("## Dropout", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `\(([^)]*)\)` \| `\(([^)]*)\)` \| `([^`]*)` \|$", section,
                      re.MULTILINE)
    assert len(rows) == 2, rows
    for counter, key, output in rows:
        c = [int(x, 0) for x in counter.split(",")]
        k = [int(x, 0) for x in key.split(",")]
        want = [int(x, 16) for x in output.split()]
        got = [int(w) for w in reference.philox4x32_10([np.uint64(x) for x in c], k)]
        assert got == want, (counter, key)


def test_landed_features_are_described_outside_the_planned_list():
    body, planned = DOC.split("## Planned, not there yet", 1)
    for word in ("ferrocupy.torch", "AttnLayout", "transposed"):  # they exist
        assert word in body and word not in planned, word


def test_numpy_floor_matches_pyproject():
    floor = re.search(r'"numpy>=([\d.]+)"', (ROOT / "pyproject.toml").read_text()).group(1)
    assert f"NumPy ≥ {floor}" in DOC and f"`numpy>={floor}`" in DOC
