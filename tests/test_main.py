"""`python -m ferrocupy`, the demo and self-check: it runs, reports, and catches wrong kernels.

On the reference backend the demo checks the reference against its own dense formulas; these
tests corrupt one kernel's output at a time (through the engine's launch seam) and expect the
demo to fail on exactly the rows that use it, with a non-zero exit code.
"""

from __future__ import annotations

import inspect
import os
import subprocess
import sys

import numpy as np
import pytest

from ferrocupy import AttentionOptions, cuda_available
from ferrocupy import __main__ as demo
from ferrocupy import reference

ROWS = 10  # 2 RoPE rows + 4 cases x (forward, backward)
CASES = ("causal, GQA", "mask [B,1,S,S], GQA", "decode: offset + window", "dropout 0.1, causal")
FORWARD = {f"forward {case}" for case in CASES}
BACKWARD = {f"backward {case} (dq, dk, dv)" for case in CASES}


def run_demo(capsys, *args):
    rc = demo.main(["--backend", "reference", "--quick", *args])
    out = capsys.readouterr().out
    return rc, out


def table_rows(out: str) -> dict:
    """op -> result column of the printed table."""
    rows = {}
    for line in out.splitlines():
        if line.startswith(("rope", "forward", "backward")):
            op = line.split("  ")[0].strip()
            rows[op] = line.rsplit("  ", 1)[-1].strip()
    return rows


def test_demo_command_runs_from_the_shell():
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "ferrocupy", "--quick"], capture_output=True,
                          text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"{ROWS} passed, 0 failed" in proc.stdout
    if not cuda_available():  # the default pick is announced on stderr
        assert "using the reference backend (no CUDA GPU is usable)" in proc.stderr
        assert "backend: reference" in proc.stdout


def test_demo_passes_and_prints_a_table(capsys):
    rc, out = run_demo(capsys, "--seed", "7")
    assert rc == 0, out
    rows = table_rows(out)
    assert len(rows) == ROWS and set(rows.values()) == {"pass"}, out
    for column in ("op", "backend", "shape", "rel. error", "result"):
        assert column in out
    assert "input seed 7" in out and "dense NumPy" in out
    assert f"{ROWS} passed, 0 failed" in out


def test_demo_full_size_default(capsys):
    rc = demo.main(["--backend", "reference", "--seed", "3"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "q[2,256,8,64] kv[2,256,2,64]" in out


@pytest.mark.parametrize("kernel, buffer, failing", [
    ("rope", "x", {"rope (theta 1e4, pos 5)", "rope_theta (theta 1e5, pos 100)"}),
    ("flash_attn_v2", "out", FORWARD | BACKWARD),  # no backward on a failed forward's output
    ("flash_attn_v2_bw_dq", "grad_q", BACKWARD),
    ("flash_attn_v2_bw_dkdv", "grad_v", BACKWARD),
])
@pytest.mark.parametrize("corruption", ["scale", "unwritten"])
def test_demo_fails_on_a_wrong_kernel(capsys, monkeypatch, kernel, buffer, failing, corruption):
    real = reference.KERNELS[kernel]
    names = inspect.signature(real).parameters

    def wrong(*args, **kwargs):
        real(*args, **kwargs)
        bound = dict(zip(names, args), **kwargs)
        flat = bound[buffer].reshape(-1)
        if corruption == "scale":
            flat *= np.float32(1.01)  # a 1% error: far above every tolerance
        else:
            flat[flat.size // 2] = np.nan  # one element left unwritten (outputs start NaN)

    monkeypatch.setitem(reference.KERNELS, kernel, wrong)
    rc, out = run_demo(capsys)
    rows = table_rows(out)
    assert rc == 1, out
    assert {op for op, result in rows.items() if result != "pass"} == failing, out
    assert f"{ROWS - len(failing)} passed, {len(failing)} failed" in out


def test_demo_reports_a_kernel_that_raises(capsys, monkeypatch):
    def not_written(name):
        def kernel(*args, **kwargs):
            raise NotImplementedError(f"kernel {name} is not written yet")
        return kernel

    for name in list(reference.KERNELS):
        monkeypatch.setitem(reference.KERNELS, name, not_written(name))
    rc, out = run_demo(capsys)
    assert rc == 1
    assert "NotImplementedError: kernel rope is not written yet" in out
    assert f"0 passed, {ROWS} failed" in out


@pytest.mark.skipif(cuda_available(), reason="a CUDA GPU is usable here")
def test_demo_cuda_without_gpu_exits_2(capsys):
    assert demo.main(["--backend", "cuda", "--quick"]) == 2
    err = capsys.readouterr().err
    assert "cannot start the cuda backend: RuntimeError: backend='cuda' needs CuPy" in err
    assert "pip install 'ferrocupy[cuda13]'" in err


# --- bad option values: argparse's usage error (exit code 2), never a traceback ------------------
@pytest.mark.parametrize("value", ["-1", "-12345678901234567890", "abc", "1.5", ""])
def test_demo_bad_seed_is_a_usage_error(capsys, value):
    with pytest.raises(SystemExit) as exit_:
        demo.main(["--backend", "reference", "--quick", "--seed", value])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"error: argument --seed: must be an integer >= 0, got {value!r}" in err
    assert "Traceback" not in err


def test_demo_negative_seed_from_the_shell():
    proc = subprocess.run([sys.executable, "-m", "ferrocupy", "--quick", "--seed", "-1"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    assert "usage: python -m ferrocupy" in proc.stderr
    assert "argument --seed: must be an integer >= 0, got '-1'" in proc.stderr
    assert proc.stdout == ""  # stopped before picking a backend or running anything


@pytest.mark.parametrize("value", ["0", "2", str(2**70)])
def test_demo_seed_edges_accepted(capsys, value):
    rc, out = run_demo(capsys, "--seed", value)
    assert rc == 0, out
    assert f"input seed {value}: replay with --seed {value}" in out


# --- the demo's own oracle ----------------------------------------------------------------------
def test_demo_philox_known_answers():
    assert demo._philox_known_answers()


def test_demo_dropout_mask_rate_and_reproducibility():
    opts = AttentionOptions(dropout_prob=0.25, seed=99)
    f = demo.dense_dropout_factor(opts, 2, 3, 64, 67)
    assert f.shape == (2, 3, 64, 67)
    kept = f > 0
    assert abs(kept.mean() - 0.75) < 0.01
    np.testing.assert_array_equal(f[kept], np.float32(1) / (np.float32(1) - np.float32(0.25)))
    g = demo.dense_dropout_factor(AttentionOptions(dropout_prob=0.25, seed=100), 2, 3, 64, 67)
    assert (kept != (g > 0)).mean() > 0.2  # a different seed gives a different mask
    assert demo.dense_dropout_factor(AttentionOptions(), 2, 3, 64, 67) is None


def test_rel_err_flags_nan_and_shape():
    a = np.ones((2, 3))
    assert demo.rel_err(a, a) == 0.0
    b = a.copy()
    b[0, 0] = np.nan
    assert demo.rel_err(b, a) == float("inf")
    assert demo.rel_err(a[:1], a) == float("inf")
    assert demo.rel_err(np.zeros((2, 3)), np.zeros((2, 3))) == 0.0
    assert np.isclose(demo.rel_err(a * 1.5, a), 0.5)
