"""examples/quickstart.ipynb: its cells are examples/make_quickstart.py's, it is committed with
the outputs of a run (printed values and plots, so a forge shows them), and it runs top to bottom:
executed here by nbclient in a fresh kernel, from the examples folder, on whatever backend the
machine has (the reference in CI)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "examples" / "quickstart.ipynb"


def _generator():
    spec = importlib.util.spec_from_file_location("make_quickstart",
                                                  ROOT / "examples" / "make_quickstart.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _committed():
    nbformat = pytest.importorskip("nbformat", reason="the notebook tests need the test extra")
    return nbformat.read(NOTEBOOK, as_version=4)


def test_notebook_cells_are_the_generators():
    committed, want = _committed(), _generator().notebook()
    assert [(c.cell_type, c.source) for c in committed.cells] == \
        [(c.cell_type, c.source) for c in want.cells], (
        "examples/quickstart.ipynb differs from examples/make_quickstart.py: run that script")


def test_notebook_is_committed_with_its_outputs():
    code = [c for c in _committed().cells if c.cell_type == "code"]
    assert all(c.execution_count for c in code), "committed without running it"
    assert [c.execution_count for c in code] == list(range(1, len(code) + 1)), "not run in order"
    kinds = {o.output_type for c in code for o in c.outputs}
    assert "error" not in kinds
    images = [c for c in code if any("image/png" in o.get("data", {}) for o in c.outputs)]
    assert len(images) >= 2, "the visibility and speed plots should be stored"
    assert "publish" in images[-1].source  # the speed plot is drawn from the published runs


def test_quickstart_notebook_runs_top_to_bottom(monkeypatch):
    nbformat = pytest.importorskip("nbformat", reason="the notebook tests need the test extra")
    nbclient = pytest.importorskip("nbclient", reason="the notebook tests need the test extra")
    pytest.importorskip("matplotlib", reason="the notebook plots")
    # the kernel imports this checkout's ferrocupy, installed or not
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    nb = nbformat.read(NOTEBOOK, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs = []
    client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                     resources={"metadata": {"path": str(NOTEBOOK.parent)}})
    client.execute()  # raises CellExecutionError, with the cell and its traceback, on a failure
    # A cell's stdout may arrive in several chunks, split anywhere (CI once saw "finite:" and
    # " True" apart): join a cell's chunks as they are, and the cells by lines.
    text = "\n".join("".join(o.get("text", "") for o in c.get("outputs", [])
                              if o.get("output_type") == "stream" and o.get("name") == "stdout")
                      for c in nb.cells if c.cell_type == "code")
    assert "norms kept: True" in text and "finite: True" in text, text
    assert "same as the contiguous call: True" in text, text  # the [B, H, S, D] views
    errors = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if "relative error" in line]
    assert len(errors) == 3 and max(errors) < 1e-5, text  # float32: forward, two decode rows
