"""README.md stays true to the code: its API table matches the engine's signatures, every python
block runs as written (here: on the CPU, on the reference backend), .ci/run runs exactly its test
command, its performance tables are the published runs', and its layout names files that
exist."""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import numpy as np
import pytest

import ferrocupy
from ferrocupy import ComputeEngine

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
SEED_METHODS = ("rope", "rope_theta", "flash_attention", "flash_attention_v2",
                "flash_attention_v2_with", "flash_attention_backward",
                "flash_attention_v2_backward", "flash_attention_v2_backward_with")


def _api_rows() -> dict:
    rows = {}
    for m in re.finditer(r"^\| `(\w+)` \| `(\w+)(\(.*\)) -> None` \|", README, re.MULTILINE):
        name, sig_name, sig = m.groups()
        assert name == sig_name, m.group(0)
        rows[name] = sig
    return rows


def _params_from_readme(sig: str):
    fn = ast.parse(f"def f{sig}: pass").body[0]
    args = fn.args.args
    defaults = [None] * (len(args) - len(fn.args.defaults)) + list(fn.args.defaults)
    args = args + fn.args.kwonlyargs
    defaults = defaults + list(fn.args.kw_defaults)
    out = []
    for a, d in zip(args, defaults):
        ann = None if a.annotation is None else ast.unparse(a.annotation)
        default = inspect.Parameter.empty if d is None else eval(  # noqa: S307 - our README
            ast.unparse(d), vars(ferrocupy))
        out.append((a.arg, ann, default))
    return out


def _params_from_code(name: str):
    sig = inspect.signature(getattr(ComputeEngine, name))
    out = []
    for p in list(sig.parameters.values())[1:]:  # less self
        ann = None if p.annotation is inspect.Parameter.empty else str(p.annotation).strip("'")
        out.append((p.name, ann, p.default))
    return out


def test_api_table_lists_every_seed_method_with_its_signature():
    rows = _api_rows()
    assert set(rows) == set(SEED_METHODS), sorted(rows)
    for name in SEED_METHODS:
        assert _params_from_readme(rows[name]) == _params_from_code(name), name


def _bash_command(after: str) -> str:
    m = re.search(re.escape(after) + r".*?```bash\n(.+?)\n```", README, re.DOTALL)
    assert m, f"no bash block after {after!r}"
    return m.group(1).strip()


def test_the_two_commands():
    main = _bash_command("**Install and run the demo / self-check**")
    tests = _bash_command("**Install and run the tests**")
    assert main.endswith("python -m ferrocupy") and "pip install -e \".[cuda13]\"" in main
    assert tests.endswith("python -m pytest") and "pip install -e \".[cuda13,test]\"" in tests


def test_ci_runs_exactly_the_readme_test_command():
    steps = [s.strip() for s in _bash_command("**Install and run the tests**").split("&&")]
    venv, activate, install, run = steps
    assert venv.startswith("python3 -m venv") and activate.startswith(". ")
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert install in ci, f"{install!r} is not a line of .ci/run"
    assert any(line.startswith("python3 -m venv") for line in ci)
    assert "set -euo pipefail" in ci
    # pytest runs: first the README's, then only passes the README names (the compile pass)
    passes = [line for line in ci if line.startswith("python -m pytest")]
    assert passes and passes[0] == run, f".ci/run's first pytest run is not {run!r}: {passes}"
    for extra in passes[1:]:
        assert f"`{extra}`" in README, f".ci/run runs {extra!r}, which README.md does not name"
    assert not [line for line in ci if line.startswith("pip install") and line != install], (
        "every package .ci/run installs comes from the README's install command")


def test_cpu_torch_variant_keeps_the_test_extras_pin():
    """The README's variant of the test command for machines without a GPU installs the CPU
    build of exactly the torch the `test` extra pins (so the install keeps it), then runs the
    test command's own steps."""
    extra = re.search(r"^test = \[(.*?)\]", (ROOT / "pyproject.toml").read_text(),
                      re.MULTILINE | re.DOTALL)
    pin = re.search(r'"(torch==[^"]+)"', extra.group(1)).group(1)
    variant = next(block for block in re.findall(r"```bash\n(.+?)\n```", README, re.DOTALL)
                   if "download.pytorch.org/whl/cpu" in block).strip()
    steps = [s.strip() for s in _bash_command("**Install and run the tests**").split("&&")]
    assert [s.strip() for s in variant.split("&&")] == [
        *steps[:2], f"pip install {pin} --index-url https://download.pytorch.org/whl/cpu",
        *steps[2:]]


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README, re.DOTALL)


def _check_block(code: str, name: str) -> dict:
    """Runs a README block as written, in a fresh namespace (a block needing torch or
    transformers is skipped where it is not installed: CI installs both)."""
    if re.search(r"^\s*(import torch|from torch|from ferrocupy.torch)", code, re.MULTILINE):
        pytest.importorskip("torch", reason="torch is not installed")
    if re.search(r"^\s*(import|from) (ferrocupy\.)?transformers", code, re.MULTILINE):
        pytest.importorskip("transformers", reason="transformers is not installed")
    scope: dict = {"__name__": "__readme__"}
    exec(compile(code, name, "exec"), scope)  # noqa: S102 - our README
    return scope


@pytest.mark.parametrize("index", range(len(_python_blocks())))
def test_every_python_block_runs_as_written(index):
    _check_block(_python_blocks()[index], f"README python block {index}")


def test_there_are_python_blocks_to_run():
    assert len(_python_blocks()) >= 3


def _block_with(text: str) -> str:
    (code,) = [b for b in _python_blocks() if text in b]
    return code


def test_quick_start_computes_the_outputs():
    scope = _check_block(_block_with("flash_attention_v2_backward_with"), "README quick start")
    out, grads = scope["out"], (scope["grad_q"], scope["grad_k"], scope["grad_v"])
    assert out.shape == (2, 128, 8, 64)
    for t in (out, *grads):
        assert np.isfinite(t.to_numpy()).all()


def test_torch_interop_block_writes_in_place():
    torch = pytest.importorskip("torch", reason="torch is not installed")
    code = _block_with("torch.from_dlpack(x)")
    lines = code.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("t = torch."))
    lines.insert(at + 1, "t0 = t.clone()")  # remember t before the in-place RoPE
    scope = _check_block("\n".join(lines), "README torch interop")
    t, t0, back = scope["t"], scope["t0"], scope["back"]
    assert not torch.equal(t, t0), "RoPE did not write into the torch tensor's memory"
    assert torch.equal(t[:, 0], t0[:, 0])  # position 0 is not rotated
    assert back.data_ptr() == t.data_ptr()


def test_pytorch_section_example_runs():
    torch = pytest.importorskip("torch", reason="torch is not installed")
    section = README.split("## PyTorch\n", 1)[1].split("\n## ", 1)[0]
    code = re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1)
    assert len([line for line in code.splitlines() if line.strip()]) <= 8
    scope = _check_block(code, "README PyTorch example")
    q, out = scope["q"], scope["out"]
    assert out.shape == q.shape == (2, 128, 8, 64)
    for t in (scope["q"], scope["k"], scope["v"]):
        assert t.grad is not None and torch.isfinite(t.grad).all()


def test_performance_section_figures_come_from_results():
    """Every figure in the README's Performance section appears in benchmarks/RESULTS.md, the
    page that holds the benchmark command's output (no number is written by hand)."""
    section = README.split("## Performance", 1)[1].split("\n## ", 1)[0]
    assert "benchmarks/RESULTS.md" in section
    results = (ROOT / "benchmarks" / "RESULTS.md").read_text()
    figures = re.findall(r"\d+\.\d+(?=\s*(?:TFLOP/s|×|x\b|ms))|\d+(?= GB/s)", section)
    assert figures, "the Performance section should state the measured headline figures"
    missing = [f for f in figures if f not in results]
    assert not missing, f"figures in README.md not found in benchmarks/RESULTS.md: {missing}"


def test_performance_tables_are_the_published_runs():
    """README's tables and benchmarks/RESULTS.md are benchmarks/publish.py's output for the run
    files kept in benchmarks/ (regenerate with `python benchmarks/publish.py`)."""
    import sys

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import publish

    runs = publish.load_runs()
    assert runs, "no benchmark run file in benchmarks/"
    assert (ROOT / "benchmarks" / "RESULTS.md").read_text() == publish.results_page(runs), (
        "benchmarks/RESULTS.md is out of date: run python benchmarks/publish.py")
    assert README == publish.readme_with_block(README, publish.readme_block(runs)), (
        "README.md's performance tables are out of date: run python benchmarks/publish.py")
    for gpu in publish.latest(runs):
        assert publish.plot_path(gpu).exists(), publish.plot_path(gpu)
        assert f"]({publish.plot_path(gpu).name})" in (ROOT / "benchmarks" / "RESULTS.md").read_text()


def _layout() -> list[str]:
    """The paths the Project layout section names (globs allowed), from its indented tree."""
    section = README.split("## Project layout", 1)[1].split("\n## ", 1)[0]
    tree = re.search(r"```\n(.*?)```", section, re.DOTALL).group(1)
    paths, parents = [], []
    for line in tree.splitlines():
        indent = (len(line) - len(line.lstrip())) // 2
        name = line.split()[0].rstrip(",")
        parents = parents[:indent]
        if name.endswith("/"):
            parents.append(name)
        paths.append("".join(parents[:indent]) + name)
        if line.split()[0].endswith(","):  # "README.md, LICENSE"
            paths.append("".join(parents[:indent]) + line.split()[1])
    return paths


def test_layout_names_only_existing_paths():
    paths = _layout()
    assert "ferrocupy/cuda/tuning.py" in paths and "lab/" in paths
    missing = [p for p in paths if not list(ROOT.glob(p.rstrip("/")))]
    assert not missing, f"README's layout names paths that do not exist: {missing}"


def test_layout_covers_the_package_and_the_top_level():
    import fnmatch
    import subprocess

    patterns = [p.rstrip("/") for p in _layout()]
    tracked = subprocess.run(["git", "-C", str(ROOT), "ls-files"], capture_output=True,
                             text=True).stdout.split()
    if not tracked:
        pytest.skip("not a git checkout")
    wanted = {f.split("/")[0] for f in tracked} | {
        f for f in tracked if f.startswith("ferrocupy/") and f.endswith((".py", ".cu", ".cuh"))}
    wanted -= {".gitignore", ".ci"}
    wanted |= {".ci/run"}
    unnamed = sorted(w for w in wanted if not any(
        fnmatch.fnmatch(w, p) or p.startswith(w + "/") for p in patterns))
    assert not unnamed, f"README's layout does not name: {unnamed}"


def test_reads_as_current():
    """No timestamps or history in the README: it says what is, the log is lab/TUNING.md."""
    for phrase in ("UTC", "since then", "Since then", "the seed's", "it was ", "dev/"):
        assert phrase not in README, phrase
