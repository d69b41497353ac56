"""Kernel headers compiled for the CPU with g++, for tests that check their arithmetic without a
GPU: `PRELUDE` stubs CUDA's qualifiers and the intrinsics the headers name (warp shuffles act
on one lane (a harness may run a quad or a warp of lanes instead); the PTX of a half-precision conversion becomes a no-op, so a test must use float32
data where one would run), and `build` compiles a shim that includes the headers into a shared
library and loads it."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
from pathlib import Path

import pytest

CUDA_DIR = Path(__file__).resolve().parents[1] / "ferrocupy" / "cuda"

PRELUDE = r"""
#include <algorithm>
#include <cmath>
#include <cstring>
#define __device__
#define __forceinline__ inline
using std::max;
using std::min;
inline float __uint_as_float(unsigned v) { float f; std::memcpy(&f, &v, 4); return f; }
inline float __int_as_float(int v) { float f; std::memcpy(&f, &v, 4); return f; }
struct Dim { unsigned x, y, z; };
static Dim threadIdx, blockIdx, blockDim, gridDim;
struct float4 { float x, y, z, w; };
struct uint4 { unsigned x, y, z, w; };
struct uint2 { unsigned x, y; };
struct float2 { float x, y; };
inline unsigned __umulhi(unsigned a, unsigned b) { return (unsigned)(((unsigned long long)a * b) >> 32); }
template <class T> inline T __shfl_xor_sync(unsigned, T x, int) { return x; }
template <class T> inline T __shfl_sync(unsigned, T x, int) { return x; }
inline bool __any_sync(unsigned, bool x) { return x; }
#define asm(...) (void)0
"""


def build(directory: Path, shim: str, what: str) -> ctypes.CDLL:
    """`PRELUDE + shim` compiled against the kernel headers (a FERROCUPY_KERNEL_OVERLAY folder's
    first) into `directory`, loaded; skipped (naming `what`) where no C++ compiler is on PATH."""
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip(f"no C++ compiler (g++) on PATH: {what} is untested")
    (directory / "shim.cpp").write_text(PRELUDE + shim)
    so = directory / "shim.so"
    # (a kernel overlay, as the loader takes it, comes first: a candidate's headers are tested)
    overlay = os.environ.get("FERROCUPY_KERNEL_OVERLAY")
    include = ([f"-I{Path(overlay).resolve()}"] if overlay else []) + [f"-I{CUDA_DIR}"]
    cmd = [cxx, "-std=c++17", "-O1", "-shared", "-fPIC", *include, "-o", str(so),
           str(directory / "shim.cpp")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout}{proc.stderr}"
    return ctypes.CDLL(str(so))
