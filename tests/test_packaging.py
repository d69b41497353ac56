"""The wheel carries the kernel sources, and an installed (not editable) ferrocupy loads them from
its own package folder. Builds the wheel from a copy of the sources, so the work tree stays clean
(pip needs an index for the build backend, as `pip install -e .` does)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "ferrocupy"


def _sources(patterns) -> set[str]:
    return {p.relative_to(ROOT).as_posix() for pat in patterns for p in PKG.rglob(pat)
            if "__pycache__" not in p.parts}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(PKG, src / "ferrocupy",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    out = tmp_path_factory.mktemp("wheel")
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w",
                           str(out), str(src)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"pip wheel failed:\n{proc.stdout}\n{proc.stderr}"
    wheels = list(out.glob("ferrocupy-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


def test_wheel_contains_package_and_kernel_sources(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    kernels = _sources(["*.cu", "*.cuh"])
    assert {"ferrocupy/cuda/ferro_params.cuh", "ferrocupy/cuda/ferro_mma_f16.cuh"} <= kernels
    missing = (_sources(["*.py"]) | kernels) - names
    assert not missing, f"not in {wheel.name}: {sorted(missing)}"
    assert not [n for n in names if n.startswith(("tests/", "benchmarks/", "lab/", "examples/", ".ci/"))]


def test_wheel_metadata_extras(wheel):
    with zipfile.ZipFile(wheel) as z:
        meta = next(z.read(n).decode() for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    assert "Requires-Python: >=3.10" in meta
    # numpy 2.2.5: the first whose np.from_dlpack gives writeable arrays (tests/test_tensor.py's
    # test_dlpack_in_without_copy); ml_dtypes 0.4: the first that imports under NumPy 2.
    assert "Requires-Dist: numpy>=2.2.5" in meta
    assert "Requires-Dist: ml_dtypes>=0.4" in meta  # bfloat16
    for extra, dist in [("cuda12", "cupy-cuda12x>=14"), ("cuda13", "cupy-cuda13x>=14"),
                        ("test", "pytest>=7"), ("test", "pytest-benchmark>=4"),
                        ("test", "transformers<6,>=5.17"), ("plot", "matplotlib"),
                        ("torch", "torch")]:
        assert f"Provides-Extra: {extra}" in meta
        assert f'Requires-Dist: {dist}; extra == "{extra}"' in meta, (extra, dist)
    import ferrocupy

    assert f"Version: {ferrocupy.__version__}" in meta


def test_wheel_carries_the_mit_license(wheel):
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        meta = next(z.read(n).decode() for n in names if n.endswith(".dist-info/METADATA"))
        licenses = [n for n in names if n.endswith(".dist-info/licenses/LICENSE")]
        assert len(licenses) == 1, names
        shipped = z.read(licenses[0]).decode()
    assert "License-Expression: MIT" in meta.splitlines()
    assert "License-File: LICENSE" in meta.splitlines()
    assert shipped == (ROOT / "LICENSE").read_text()
    assert shipped.startswith("MIT License\n")
    assert "Copyright (c) 2026 ferrocupy contributors" in shipped
    assert "Permission is hereby granted, free of charge" in shipped


def test_installed_package_loads_kernels_from_itself(wheel, tmp_path):
    site = tmp_path / "site"
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target",
                           str(site), str(wheel)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    probe = textwrap.dedent("""
        import importlib.resources, pathlib, sys
        import ferrocupy
        from ferrocupy.cuda import loader
        here = pathlib.Path(ferrocupy.__file__).resolve().parent
        assert here == pathlib.Path(sys.argv[1]).resolve() / "ferrocupy", here
        assert pathlib.Path(loader.SOURCE_DIR).resolve() == here / "cuda", loader.SOURCE_DIR
        names = sorted(p.name for p in importlib.resources.files("ferrocupy.cuda").iterdir())
        print(" ".join(n for n in names if n.endswith((".cu", ".cuh"))))
        for cu in pathlib.Path(loader.SOURCE_DIR).glob("*.cu"):
            code = loader.expand_includes(cu)  # what the loader hands to NVRTC
            assert '#include "' not in code, cu
    """)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(site)
    proc = subprocess.run([sys.executable, "-c", probe, str(site)], capture_output=True,
                          text=True, timeout=120, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    shipped = set(proc.stdout.split())
    assert shipped == {Path(p).name for p in _sources(["*.cu", "*.cuh"])}
