"""pytest setup: the `gpu` marker, a fresh `rng` per test, `helpers` on the import path, and the
kernel compiles (tests/test_compile.py) begun in the background as collection ends.

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


def _compile_module(item):
    """tests/test_compile.py's module where `item` is one of its kernel compile cases, else None."""
    module = getattr(item, "module", None)
    is_kernel_case = getattr(module, "is_kernel_case", None)
    return module if is_kernel_case is not None and is_kernel_case(item) else None


def pytest_collection_finish(session):
    """The selected kernel compiles begin now, in the background (tests/test_compile.py's
    start_compiles)."""
    if session.config.option.collectonly:
        return
    for module in {_compile_module(item) for item in session.items} - {None}:
        module.start_compiles(session)


def pytest_collection_modifyitems(config, items):
    # The kernel compile cases run last: each waits for its compile, begun as collection ends, so
    # the compiles use the cores the other tests leave idle until then.
    kernel_cases = [item for item in items if _compile_module(item)]
    if kernel_cases:
        items[:] = [item for item in items if not _compile_module(item)] + kernel_cases
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
