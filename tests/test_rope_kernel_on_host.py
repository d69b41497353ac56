"""rope.cu's float32 variants run on the CPU, through the CUDA backend's own planning, against the
NumPy reference: no GPU needed, so CI checks the kernel's indexing (positions, partial rotary,
interleaved pairs, the inverse, in and out of place, strided views, head groups, every access
width float32 has) on every change.

g++ compiles rope.cu with CUDA's built-ins stubbed (`blockIdx`, `threadIdx`, ... are globals; a
kernel launch runs its grid thread by thread) into a small library. The engine checks and packs
each call as usual and hands it to a `CudaBackend` built around the host (NumPy arrays are its
"device" memory); the backend picks the variant, grid and head groups and packs the arguments as
for `cuLaunchKernel`, and `driver.launchKernel` is replaced by the library's launcher, which
reads exactly those packed argument bytes. The half-precision variants convert through PTX
instructions and run on the GPU suite only (tests/test_cuda_rope.py)."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from ferrocupy import ComputeEngine
from ferrocupy.cuda import configs
from ferrocupy.cuda.backend import CudaBackend
from ferrocupy.dtypes import FLOAT32

hypothesis = pytest.importorskip("hypothesis", reason="hypothesis is not installed")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

CUDA_DIR = Path(__file__).resolve().parents[1] / "ferrocupy" / "cuda"
SM_COUNT = 2  # a small "GPU": few resident threads, so small calls split their heads in groups

HOST_SHIM = r"""
// CUDA's built-ins on the host: a launch runs its grid thread by thread.
#include <algorithm>
#include <cmath>
#include <cstring>
#define __device__
#define __forceinline__ inline
#define __global__
#define __launch_bounds__(...)
struct uint4 { unsigned x, y, z, w; };
struct uint2 { unsigned x, y; };
struct Dim { unsigned x; };
static Dim blockIdx, threadIdx, blockDim, gridDim;
using std::min;
inline float __int_as_float(unsigned v) { float f; std::memcpy(&f, &v, 4); return f; }
#include "rope.cu"
// `args`: the kernel's argument pointers, as cuLaunchKernel takes them.
extern "C" void launch(void** args, unsigned blocks, unsigned threads) {
    gridDim.x = blocks;
    blockDim.x = threads;
    for (unsigned b = 0; b < blocks; ++b)
        for (unsigned t = 0; t < threads; ++t) {
            blockIdx.x = b;
            threadIdx.x = t;
            rope(*(const float**)args[0], *(float**)args[1], *(const void**)args[2],
                 *(const float**)args[3], *(const u64*)args[4], *(const u32*)args[5],
                 *(const RopeParams*)args[6], *(const RopeLayout*)args[7]);
        }
}
"""


@pytest.fixture(scope="module")
def kernels(tmp_path_factory) -> dict:
    """VEC -> the host build of rope.cu's float32 variant with VEC elements per access."""
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler (g++) on PATH: rope.cu's host build is not tested")
    out = tmp_path_factory.mktemp("rope_host")
    (out / "shim.cpp").write_text(HOST_SHIM)
    libs = {}
    for vec in configs.rope_vectors(FLOAT32):
        lib = out / f"rope_vec{vec}.so"
        cmd = [cxx, "-std=c++17", "-O1", "-shared", "-fPIC", f"-I{CUDA_DIR}",
               "-DFERRO_ROPE_DTYPE=0", f"-DFERRO_ROPE_VEC={vec}", "-o", str(lib),
               str(out / "shim.cpp")]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout}{proc.stderr}"
        libs[vec] = ctypes.CDLL(str(lib))
    return libs


class HostLoader:
    """The backend's kernel loader: a 'kernel' is the host build of its variant."""

    def __init__(self, libs):
        self.libs, self.loaded = libs, []

    def function(self, source, name, defines=None, options=()):
        assert (source, name) == (configs.ROPE_SOURCE, configs.ROPE_KERNEL)
        assert defines["FERRO_ROPE_DTYPE"] == 0
        self.loaded.append(defines["FERRO_ROPE_VEC"])
        return SimpleNamespace(kernel=SimpleNamespace(ptr=defines["FERRO_ROPE_VEC"]))


@pytest.fixture
def engine(kernels, monkeypatch):
    """A ComputeEngine whose backend is the CUDA backend over host memory."""
    from cupy.cuda import driver

    stream = SimpleNamespace(ptr=7, synchronize=lambda: None)
    b = object.__new__(CudaBackend)
    b.xp = SimpleNamespace(asarray=np.asarray, cuda=SimpleNamespace(
        runtime=SimpleNamespace(getDevice=lambda: 0), get_current_stream=lambda: stream))
    b._id, b.device, b.name, b.dtypes = 0, "cpu", "cuda", (FLOAT32,)
    b.loader, b.sm_count, b._rope_plans, b._rope_tables = HostLoader(kernels), SM_COUNT, {}, {}
    grids = []

    def launch(function, gx, gy, gz, bx, by, bz, smem, stream_ptr, args, extra):
        assert (gy, gz, by, bz, smem, stream_ptr) == (1, 1, 1, 1, 0, 7)
        grids.append((function, gx, bx))
        kernels[function].launch(ctypes.c_void_p(args), gx, bx)

    monkeypatch.setattr(driver, "launchKernel", launch)
    eng = ComputeEngine("reference", quiet=True)
    eng.backend = b
    eng.grids = grids
    return eng


@pytest.fixture(scope="module")
def ref():
    return ComputeEngine("reference", quiet=True)


def call(e, base, cut, head_dim, pos, out_of_place, **kw):
    """RoPE of `cut(copy of base)` on engine `e`: (result, the base afterwards)."""
    b = base.copy()
    x = cut(b)
    if not out_of_place:
        e.rope_theta(x, head_dim, pos, 500000.0, **kw)
        return np.array(x), b
    out = np.full(x.shape, np.nan, np.float32)
    e.rope_theta(x, head_dim, pos, 500000.0, out=out, **kw)
    return out, b


OPTIONS = [{}, dict(rotary_dim=8), dict(interleaved=True), dict(rotary_dim=12, interleaved=True),
           dict(inverse=True), dict(rotary_dim=4, interleaved=True, inverse=True)]
LAYOUTS = {
    "contiguous": ((3, 5, 4, 16), lambda a: a),
    "qkv-slice": ((3, 5, 3, 4, 16), lambda a: a[:, :, 2]),
    "bhsd-transposed": ((3, 4, 5, 16), lambda a: a.transpose(0, 2, 1, 3)),
    "rows-one-element-off": ((3, 5, 4, 17), lambda a: a[..., 1:]),
    "seq-hd": ((5, 64), lambda a: a),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("kw", OPTIONS, ids=lambda kw: "-".join(f"{k}{v}" for k, v in
                                                             kw.items()) or "full")
@pytest.mark.parametrize("positions", ["pos", "S-int32", "BS-int64", "BS-expanded", "BS-cut"])
@pytest.mark.parametrize("out_of_place", [False, True], ids=["in-place", "out"])
def test_kernel_matches_the_reference(engine, ref, rng, layout, kw, positions, out_of_place):
    shape, cut = LAYOUTS[layout]
    base = rng.standard_normal(shape).astype(np.float32)
    b, s = (1, shape[0]) if len(shape) == 2 else (3, 5)
    pos, ps = 0, None
    if positions == "pos":
        pos = 99_000
    elif positions == "S-int32":
        ps = rng.integers(-300, 100_000, s).astype(np.int32)
    elif positions == "BS-int64":
        ps = rng.integers(-300, 100_000, (b, s))
    elif positions == "BS-expanded":  # one row for every batch entry: batch stride 0
        ps = np.broadcast_to(rng.integers(-300, 100_000, (1, s)), (b, s))
    else:  # rows of a wider buffer: batch stride s + 3
        ps = rng.integers(-300, 100_000, (b, s + 3))[:, 2:2 + s]
    got, got_base = call(engine, base, cut, 16, pos, out_of_place, positions=ps, **kw)
    want, want_base = call(ref, base, cut, 16, pos, out_of_place, positions=ps, **kw)
    assert not np.isnan(got).any(), "an output element was not written"
    assert np.abs(got - want).max() <= 1e-6 * np.abs(want).max()
    assert np.abs(got_base - want_base).max() <= 1e-6 * np.abs(want_base).max()
    assert engine.grids, "the kernel did not run"


def test_access_widths_and_head_groups(engine, ref, rng):
    """16-byte accesses where the layout allows, one element where it does not; two tokens of
    24 heads on this small GPU split their heads into groups."""
    for shape, cut, vec in (((1, 2, 24, 16), lambda a: a, 4),
                            ((1, 2, 24, 17), lambda a: a[..., 1:], 1)):
        base = rng.standard_normal(shape).astype(np.float32)
        got, _ = call(engine, base, cut, 16, 7, True, rotary_dim=8)
        want, _ = call(ref, base, cut, 16, 7, True, rotary_dim=8)
        assert np.abs(got - want).max() <= 1e-6 * np.abs(want).max()
        assert engine.backend.loader.loaded[-1] == vec
        lanes = 8 // 2 // vec + 8 // vec  # rotation lanes, then the passed-through features
        assert configs.rope_head_groups(2, lanes, 24, SM_COUNT) > 1


def test_a_plan_is_made_once_per_call_shape(engine, rng):
    x = rng.standard_normal((2, 5, 4, 16)).astype(np.float32)
    for _ in range(3):
        engine.rope(x.copy(), 16, 3)
    engine.rope(x.copy(), 16, 3, interleaved=True)
    assert len(engine.backend._rope_plans) == 2 and len(engine.backend._rope_tables) == 1
    assert len(engine.grids) == 4


@st.composite
def host_calls(draw):
    """A random call: head_dim, rotary width, shape, layout (a view), options, positions."""
    d = draw(st.sampled_from([2, 4, 6, 8, 12, 16, 24, 32]))
    b, s, h = (draw(st.integers(1, 4)) for _ in range(3))
    return dict(d=d, r=draw(st.sampled_from(range(2, d + 1, 2))), b=b, s=s, h=h,
                layout=draw(st.sampled_from(["contiguous", "qkv-slice", "bhsd-transposed",
                                             "padded", "one-element-off"])),
                interleaved=draw(st.booleans()), inverse=draw(st.booleans()),
                kind=draw(st.sampled_from(["pos", "S", "BS", "expanded"])),
                out_of_place=draw(st.booleans()), seed=draw(st.integers(0, 2**32 - 1)))


@given(host_calls())
@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_random_calls(engine, ref, c):
    rng = np.random.default_rng(c["seed"])
    b, s, h, d = c["b"], c["s"], c["h"], c["d"]
    shape, cut = {"contiguous": ((b, s, h, d), lambda a: a),
                  "qkv-slice": ((b, s, 3, h, d), lambda a: a[:, :, 1]),
                  "bhsd-transposed": ((b, h, s, d), lambda a: a.transpose(0, 2, 1, 3)),
                  "padded": ((b, s, h, d + 8), lambda a: a[..., 4:4 + d]),
                  "one-element-off": ((b, s, h, d + 1), lambda a: a[..., 1:])}[c["layout"]]
    base = rng.standard_normal(shape).astype(np.float32)
    ps = {"pos": None, "S": rng.integers(-9, 10**5, s).astype(np.int32),
          "BS": rng.integers(-9, 10**5, (b, s)),
          "expanded": np.broadcast_to(rng.integers(0, 10**5, (1, s)), (b, s))}[c["kind"]]
    kw = dict(positions=ps, rotary_dim=c["r"], interleaved=c["interleaved"],
              inverse=c["inverse"])
    pos = 12345 if ps is None else 0
    got, got_base = call(engine, base, cut, d, pos, c["out_of_place"], **kw)
    want, want_base = call(ref, base, cut, d, pos, c["out_of_place"], **kw)
    assert not np.isnan(got).any(), "an output element was not written"
    assert np.abs(got - want).max() <= 1e-6 * np.abs(want).max()
    if c["out_of_place"]:
        assert np.array_equal(got_base, base), "the input was written"
    assert np.abs(got_base - want_base).max() <= 1e-6 * np.abs(want_base).max()
