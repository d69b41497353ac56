"""pytest setup: the `gpu` marker, a fresh `rng` per test, and `helpers` on the import path.

Every test gets new random inputs; the seed is printed (pytest shows it on failure) and a failure
can be replayed with FERROCUPY_TEST_SEED=<seed>.
"""

from __future__ import annotations

import os
import secrets
import sys

import numpy as np
import pytest

# `from helpers import ...` works whatever pytest's import mode is.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from helpers import dense_attention, poison, rel_err  # noqa: E402,F401 - re-exported

GPU_SKIP_REASON = ("no usable CUDA GPU: ferrocupy.cuda_available() is False "
                   "(CuPy not installed, no driver, or no device)")


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a usable CUDA GPU (skipped when there is none)")


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_items:
        return
    from ferrocupy import cuda_available

    if cuda_available():
        return
    skip = pytest.mark.skip(reason=GPU_SKIP_REASON)
    for item in gpu_items:
        item.add_marker(skip)


@pytest.fixture
def rng():
    """A fresh `numpy.random.Generator`; its seed is printed so a failure can be replayed."""
    seed = int(os.environ.get("FERROCUPY_TEST_SEED") or secrets.randbits(63))
    print(f"rng seed: {seed} (replay with FERROCUPY_TEST_SEED={seed})")
    return np.random.default_rng(seed)


def pytest_runtest_logreport(report):
    """With FERRO_FAILURE_LOG set, each failure is appended to that file as it happens (a run cut
    off by a time limit still says what failed). Written by the controlling process only."""
    path = os.environ.get("FERRO_FAILURE_LOG")
    if path and report.failed and not os.environ.get("PYTEST_XDIST_WORKER"):
        with open(path, "a") as f:
            f.write(f"== {report.nodeid} ({report.when})\n{report.longreprtext}\n\n")
