"""Kernel headers compiled for the CPU with g++, for tests that check their arithmetic without a
GPU: `PRELUDE` stubs CUDA's qualifiers and the intrinsics the headers name (warp shuffles act
on one lane, unless a shim runs lanes as threads with `LANES`; the PTX of a half-precision
conversion becomes a no-op, so a test must use float32 data where one would run), and `build`
compiles a shim that includes the headers into a shared library and loads it."""

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

# For a shim that runs N lanes as N threads (a quad, a warp): `Lanes<N>`, whose `exchange` is a
# shuffle (each lane writes its 32 bits, all meet, each reads its source lane's) and whose `meet`
# is a barrier. A lane that waits 10 s marks the group `broken` (a shuffle or barrier that not
# every lane reached) and goes on, so a diverged group fails its test instead of hanging it.
LANES = r"""
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
template <int N>
struct Lanes {
    std::mutex m;
    std::condition_variable cv;
    int count = 0;
    unsigned gen = 0;
    uint32_t slot[N];
    bool broken = false;
    void meet() {
        std::unique_lock<std::mutex> lk(m);
        const unsigned g = gen;
        if (broken) return;
        if (++count == N) { count = 0; ++gen; cv.notify_all(); }
        else if (!cv.wait_for(lk, std::chrono::seconds(10), [&] { return gen != g; })) {
            broken = true;
            cv.notify_all();
        }
    }
    template <class T> T exchange(T x, int lane, int src) {
        static_assert(sizeof(T) == 4, "32-bit shuffles");
        std::memcpy(&slot[lane], &x, 4);
        meet();
        T y;
        std::memcpy(&y, &slot[src % N], 4);
        meet();
        return y;
    }
};
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
