"""Every kernel variant the CUDA backend can launch compiles, with nvcc and with NVRTC.

The variants are `ferrocupy/cuda/configs.py`'s table (every (op, dtype, head_dim, geometry) the
selector can return, and RoPE per dtype). NVRTC, the compiler the backend uses, builds every one
of them for sm_90 and the widest and narrowest head_dim for sm_80; nvcc builds every source in
every dtype at the widest head_dim (the most registers) for both. A source the table does not
know compiles as it stands (with its `// ferro-variants:` line, if any).

Two runs share that matrix. The default run (`python -m pytest`) compiles, with NVRTC for sm_90
(sm_90a for the wgmma kernels), each code path at the widest head_dim up to DEFAULT_RUN_HEAD_DIM
it is built for (the narrowest above, for a code path built only there): a code path is a source
and the defines that choose code (dtype, mask and dropout compiled out, swizzled rows, warps,
m-tiles, decode rows, dK/dV column parts, packed sequences), as against SIZE_DEFINES, which only
size its tiles; of a variant built with and without softcap, ALiBi and sinks it takes the build
with them, which compiles every statement of the other (SUPERSET_DEFINE). Every other case
carries the `compile` marker, which pyproject.toml's addopts deselects:
`python -m pytest -m compile` compiles them (the narrower head_dims, sm_80, and everything nvcc
builds), and .ci/run runs it after the default run, so CI compiles every variant. (Naming one of
them by node id needs `-m compile` too, or `-m ""`; addopts deselects it otherwise.)

Neither needs a GPU: nvcc is a plain program, and NVRTC is a library that CuPy loads without
touching the driver (`cupy_backends.cuda.libs.nvrtc`; CuPy's own `compile_using_nvrtc` asks the
driver for the device's architecture and so fails on a machine with no GPU). Both compile to a
cubin, so the assembler runs too: register or shared-memory overflows fail here, not at first use.
Only the selected cases are compiled, one compile per core at a time (NVRTC releases the GIL),
the likely slowest first. The NVRTC compiles begin in the background as collection ends and their
cases run last (conftest.py), so in the default run they take the core the other tests leave
idle. A compile that succeeded is recorded outside the clone (tests/compile_cache.py, keyed by the
compiler, the source with its headers and the options) and skipped by later runs while its inputs
stay the same; FERROCUPY_COMPILE_CACHE=0 compiles everything. Failures are never recorded.

A `.cu` file may declare the compile-time variants it is built in, in a comment line such as
`// ferro-variants: FERRO_HEAD_DIM=32,64,96,128`; each listed value is compiled separately (several
`NAME=v1,v2` groups on one line give every combination). A file without the line compiles once.
Each (file, arch, variant) is its own test case. The machinery itself is proven on small sources
written to tmp_path, including sources that must fail, so these tests can fail.
"""

from __future__ import annotations

import functools
import itertools
import os
import queue
import re
import shutil
import subprocess
import threading
from concurrent.futures import Future
from pathlib import Path

import pytest
from compile_cache import (CACHE_ENV, CompileCache, cache_dir, compile_key, nvcc_identity,
                           nvrtc_identity)

CUDA_DIR = Path(__file__).resolve().parents[1] / "ferrocupy" / "cuda"
ARCHS = ("80", "90")
DEFAULT_RUN_ARCH = "90"  # the GPUs the project is measured on (H100, H200); sm_90a rides along
# Defines that size a variant's tiles (extents, buffers, shared memory) rather than choose its code.
SIZE_DEFINES = frozenset({"FERRO_HEAD_DIM", "FERRO_SMEM_BYTES", "FERRO_BN", "FERRO_STAGES",
                          "FERRO_KEY_LANES", "FERRO_COMBINE_THREADS"})
# FERRO_MODS=1 (softcap, ALiBi and sinks compiled in) adds code to its FERRO_MODS=0 twin's and
# chooses none of its own: the kernels test it only as a constant in plain `if`s (no #if,
# `if constexpr` or specialization on it: test_mods_adds_code_only), so its build compiles every
# statement the twin's does. The default run builds a code path's mods variant alone.
SUPERSET_DEFINE = "FERRO_MODS=1"
# FERRO_BF16 (0: float16, 1: bfloat16, absent: float32) chooses, between the two 16-bit types,
# only the element conversions and the MMA instructions' type suffix, in the three headers of
# HALF_TWIN_HEADERS (elsewhere the kernels test only whether it is defined:
# test_half_twins_differ_in_three_headers_only). The default run builds one twin of each code
# path, float16 for the forward sources (HALF_TWIN_FLOAT16) and bfloat16 for the others, so both
# branches of each of those headers compile there; the compile pass builds the other twin.
HALF_TWIN = "FERRO_BF16"
HALF_TWIN_HEADERS = frozenset({"ferro_convert.cuh", "ferro_mma_f16.cuh", "ferro_wgmma.cuh"})
HALF_TWIN_FLOAT16 = frozenset({"flash_fwd.cu", "flash_fwd_wgmma.cu"})
COMPILE_TIMEOUT_S = 900
# The default run's widest head_dim: wider builds of the same code paths (up to 256) take about
# twice as long each and go to the `compile` pass, keeping the README's test command quick.
DEFAULT_RUN_HEAD_DIM = 128

_VARIANTS_LINE = re.compile(r"^[ \t]*//[ \t]*ferro-variants:(.*)$", re.MULTILINE)


# --- the machinery ------------------------------------------------------------------------------
def variants(source: str) -> list[tuple[str, ...]]:
    """The `-D` defines of each compile the source asks for: `[()]` when it declares none.

    `// ferro-variants: A=1,2 B=x` gives `[("A=1", "B=x"), ("A=2", "B=x")]`."""
    groups = []
    for line in _VARIANTS_LINE.findall(source):
        line = re.sub(r"\s*([=,])\s*", r"\1", line.replace(";", " "))
        for group in line.split():
            name, sep, values = group.partition("=")
            vals = [v.strip() for v in values.split(",") if v.strip()]
            if not sep or not re.fullmatch(r"[A-Za-z_]\w*", name) or not vals:
                raise ValueError(f"bad ferro-variants entry {group!r}: expected NAME=v1,v2,...")
            groups.append([f"{name}={v}" for v in vals])
    return [tuple(combo) for combo in itertools.product(*groups)] if groups else [()]


def find_nvcc() -> str | None:
    found = shutil.which("nvcc")
    if found:
        return found
    for env in ("CUDA_HOME", "CUDA_PATH"):
        root = os.environ.get(env)
        if root and os.access(Path(root) / "bin" / "nvcc", os.X_OK):
            return str(Path(root) / "bin" / "nvcc")
    return None


def nvcc_options(path: Path, arch: str, defines) -> list:
    return ["-std=c++17", f"-arch=sm_{arch}", "-cubin", f"-I{CUDA_DIR}", f"-I{path.parent}",
            *(f"-D{d}" for d in defines)]


def compile_nvcc(nvcc: str, path: Path, arch: str, defines, out_dir: Path):
    """Compile `path` to a cubin for sm_`arch`; returns (ok, compiler output)."""
    out = out_dir / f"{path.stem}-sm{arch}-{abs(hash(tuple(defines)))}.cubin"
    cmd = [nvcc, *nvcc_options(path, arch, defines), "-o", str(out), str(path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
    ok = proc.returncode == 0 and out.is_file() and out.stat().st_size > 0
    return ok, f"$ {' '.join(cmd)}\n{proc.stdout}{proc.stderr}"


def load_nvrtc():
    """CuPy's NVRTC binding, or skip saying why it is unusable (nothing here needs a GPU)."""
    try:
        import cupy  # noqa: F401
    except ImportError:
        pytest.skip("CuPy is not installed (pip install -e '.[cuda13]'), so NVRTC is not tested")
    try:
        from cupy_backends.cuda.libs import nvrtc

        nvrtc.getVersion()
    except Exception as e:  # libnvrtc missing: CuPy raises its own loader errors
        pytest.skip(f"CuPy imports but libnvrtc cannot be loaded ({type(e).__name__}: {e}); "
                    f"the cuda12/cuda13 extras install it")
    return nvrtc


def _loader_view(path: Path):
    """The source text and options the CUDA backend's loader hands to `cupy.RawModule`, where
    the loader exposes them (`KernelLoader().source`, `.options`: a FERROCUPY_KERNEL_OVERLAY
    folder's files first, as on a GPU); else the file with `-I` paths for its includes and
    `-std=c++17`."""
    try:
        from ferrocupy.cuda.loader import KernelLoader

        loader = KernelLoader(source_dir=path.parent)
        return loader.source(path.name), tuple(loader.options)
    except (ImportError, AttributeError, TypeError):
        return path.read_text(), ("-std=c++17", f"-I{CUDA_DIR}", f"-I{path.parent}")


def nvrtc_inputs(path: Path, arch: str, defines) -> tuple[str, tuple]:
    """(source, options) of an NVRTC compile: the loader's, plus the options CuPy's RawModule
    adds."""
    source, base = _loader_view(path)
    return source, (*base, f"-arch=sm_{arch}", "-ftz=true", "--device-as-default-execution-space",
                    *(f"-D{d}" for d in defines))


def compile_nvrtc(nvrtc, path: Path, arch: str, defines):
    """Compile `path` with NVRTC to a cubin for sm_`arch`, as the loader would; returns (ok,
    log)."""
    source, options = nvrtc_inputs(path, arch, defines)
    prog = nvrtc.createProgram(source, str(path), (), ())
    try:
        try:
            nvrtc.compileProgram(prog, options)
        except nvrtc.NVRTCError as e:
            return False, f"NVRTC {options}: {e}\n{nvrtc.getProgramLog(prog)}"
        cubin = nvrtc.getCUBIN(prog)
        return len(cubin) > 0, f"NVRTC {options}\n{nvrtc.getProgramLog(prog)}"
    finally:
        nvrtc.destroyProgram(prog)


@pytest.fixture(scope="module")
def nvcc():
    found = find_nvcc()
    if found is None:
        pytest.skip("nvcc not found on PATH (nor in $CUDA_HOME/bin, $CUDA_PATH/bin): the nvcc "
                    "compile tests need the CUDA toolkit")
    return found


# --- the project's kernels ----------------------------------------------------------------------
def _case_id(v, arch: str) -> str:
    """The case's name: op, dtype, geometry, design (other than mma.sync), buffers, decode rows,
    dK/dV column parts."""
    from ferrocupy.cuda.configs import MMA

    design = "" if v.isa == MMA else f"-{v.isa}"
    return (f"{v.op}-{v.dtype}-d{v.head_dim}-w{v.warps}m{v.mt}n{v.step}{design}"
            f"{f'-s{v.stages}' if v.stages else ''}{f'-r{v.rows}' if v.rows else ''}"
            f"{f'-p{v.parts}' if v.parts > 1 else ''}"
            f"{'-plain' if v.plain else ''}{'-mods' if v.mods else ''}"
            f"{'-unmasked' if getattr(v, 'unmasked', False) else ''}"
            f"{'-varlen' if v.varlen else ''}{'-paged' if v.paged else ''}-sm_{arch}")


def _table_jobs() -> tuple[list, list]:
    """(nvrtc jobs, nvcc jobs) of configs.py's variants: (path, arch, defines, id)."""
    from ferrocupy.cuda import configs

    nvrtc, nvcc, seen = [], [], set()
    widest, narrowest = max(configs.HEAD_DIMS), min(configs.HEAD_DIMS)
    widest_of = {}  # per (source, design): the widest head_dim it is built for
    for v in configs.all_variants():
        widest_of[(v.source, v.isa)] = max(widest_of.get((v.source, v.isa), 0), v.head_dim)
    for v in configs.all_variants():
        defines = tuple(f"{k}={x}" for k, x in sorted(v.defines.items()))
        if (v.source, defines) in seen:
            continue
        seen.add((v.source, defines))
        first = v.isa in configs.SM90A or configs.TABLE[(v.op, v.dtype, v.head_dim)][0] == v
        if v.arch:  # built for one architecture only
            archs = (v.arch,)
        else:
            archs = ARCHS if v.head_dim in (widest, narrowest) else ("90",)
        for arch in archs:
            job = (CUDA_DIR / v.source, arch, defines, _case_id(v, arch))
            nvrtc.append(job)
            if first and v.head_dim == widest_of[(v.source, v.isa)]:
                nvcc.append(job)
    names = {code: str(dtype) for dtype, code in configs.ROPE_DTYPE_DEFINE.items()}
    for defines in configs.rope_variants():
        for arch in ARCHS:
            job = (CUDA_DIR / configs.ROPE_SOURCE, arch,
                   tuple(f"{k}={x}" for k, x in sorted(defines.items())),
                   f"rope-{names[defines['FERRO_ROPE_DTYPE']]}-vec{defines['FERRO_ROPE_VEC']}"
                   f"-sm_{arch}")
            nvrtc.append(job)
            nvcc.append(job)
    return nvrtc, nvcc


def _head_dim(defines) -> int:
    return next((int(d.partition("=")[2]) for d in defines if d.startswith("FERRO_HEAD_DIM=")), 0)


def _code_path(job) -> tuple:
    path, arch, defines = job[:3]
    return path, arch, tuple(HALF_TWIN if d.partition("=")[0] == HALF_TWIN else d for d in defines
                             if d.partition("=")[0] not in SIZE_DEFINES and d != SUPERSET_DEFINE)


def _default_twin(job) -> bool:
    """Whether the job is the 16-bit twin the default run builds (always, for float32)."""
    path, _, defines = job[:3]
    want = f"{HALF_TWIN}={0 if path.name in HALF_TWIN_FLOAT16 else 1}"
    return all(d == want for d in defines if d.partition("=")[0] == HALF_TWIN)


def default_run_jobs(jobs) -> set:
    """The NVRTC jobs the default run compiles: for sm_90 and sm_90a, each code path (source,
    architecture, and the defines outside SIZE_DEFINES, FERRO_MODS aside, the two 16-bit types
    one) at the widest head_dim up to DEFAULT_RUN_HEAD_DIM it is built for (else the narrowest),
    in every size built there, with softcap, ALiBi and sinks where a variant has them
    (SUPERSET_DEFINE), in the 16-bit type HALF_TWIN_FLOAT16 names. The widest takes the most
    registers and shared memory."""
    def rank(job) -> tuple:
        hd = _head_dim(job[2])
        return (hd <= DEFAULT_RUN_HEAD_DIM, hd if hd <= DEFAULT_RUN_HEAD_DIM else -hd,
                _default_twin(job), SUPERSET_DEFINE in job[2])

    ours = [job for job in jobs if job[1].startswith(DEFAULT_RUN_ARCH)]
    chosen: dict = {}
    for job in ours:
        if _code_path(job) not in chosen or rank(job) > chosen[_code_path(job)]:
            chosen[_code_path(job)] = rank(job)
    return {job[:3] for job in ours if rank(job) == chosen[_code_path(job)]}


def _slowest_first(jobs) -> list:
    """The jobs in the pools' (and the cases') order: the likely slowest first (as measured: with
    softcap, ALiBi and sinks compiled in, then the backward's, then sm_90a's, then the widest
    head_dim), so that no long compile starts last while the other cores idle."""
    return sorted(jobs, key=lambda job: (SUPERSET_DEFINE not in job[2], "_bwd" not in job[0].name,
                                         job[1] != "90a", -_head_dim(job[2])))


def _kernel_cases():
    """(nvrtc cases, nvcc cases); all but the default run's NVRTC cases marked `compile`."""
    nvrtc, nvcc = _table_jobs()
    known = {job[0] for job in nvrtc}
    for path in sorted(CUDA_DIR.glob("*.cu")):
        if path in known:
            continue
        for arch in ARCHS:
            for defines in variants(path.read_text()):
                job = (path, arch, defines, "-".join([path.name, f"sm_{arch}", *defines]))
                nvrtc.append(job)
                nvcc.append(job)
    in_default_run = default_run_jobs(nvrtc)
    cases = (
        [pytest.param(*job[:3], id=job[3],
                      marks=() if job[:3] in in_default_run else pytest.mark.compile)
         for job in _slowest_first(nvrtc)],
        [pytest.param(*job[:3], id=job[3], marks=pytest.mark.compile)
         for job in _slowest_first(nvcc)])
    for c in cases:
        if not c:
            c.append(pytest.param(None, None, None, id="no-kernels", marks=pytest.mark.skip(
                reason=f"no .cu files in {CUDA_DIR} yet (the machinery tests below still run)")))
    return cases


NVRTC_CASES, NVCC_CASES = _kernel_cases()
_NVRTC_JOBS = [tuple(c.values) for c in NVRTC_CASES if c.values[0] is not None]
_NVCC_JOBS = [tuple(c.values) for c in NVCC_CASES if c.values[0] is not None]


def _workers() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def _selected_jobs(items, test_name: str) -> list:
    """(path, arch, defines) of the session's selected cases (`items`) of `test_name`: only those
    are compiled (`-m`, `-k` and node ids all narrow it)."""
    jobs = []
    for item in items:
        if getattr(item, "originalname", None) == test_name:
            job = tuple(item.callspec.params[n] for n in ("path", "arch", "defines"))
            if job[0] is not None:
                jobs.append(job)
    return jobs


@functools.lru_cache(maxsize=None)
def _session_cache() -> CompileCache:
    return CompileCache(cache_dir())


@pytest.fixture(scope="module")
def compile_cache(request):
    """The record of successful compiles (tests/compile_cache.py); says at the module's end how
    many compiles it spared."""
    cache = _session_cache()
    yield cache
    if cache.root is None:
        note = f"compile cache off ({CACHE_ENV}=0): {cache.compiled} kernel compiles"
    else:
        note = (f"compile cache {cache.root}: {cache.compiled} kernel compiles, {cache.hits} "
                f"skipped as compiled before with identical inputs ({CACHE_ENV}=0 compiles all)")
    plugins = request.config.pluginmanager
    reporter, capture = plugins.get_plugin("terminalreporter"), plugins.get_plugin("capturemanager")
    if reporter is not None and capture is not None and cache.compiled + cache.hits:
        with capture.global_and_fixture_disabled():  # else captured as the last test's teardown
            reporter.write_line(f"\n{note}")


def cached_compile(cache, compiler: str, inputs, compile_one, job):
    """`compile_one(job)`'s (ok, log), or `cache`'s note where the key of `compiler` and the
    job's `inputs(*job)` (source, options) compiled before."""
    source, options = inputs(*job)
    key = compile_key(compiler, job[0].name, source, options)
    return cache.compile(key, f"{job[0].name} sm_{job[1]} {' '.join(job[2])}",
                         lambda: compile_one(job))


class CompilePool:
    """Jobs in a queue, each run by whichever of the pool's threads takes it first; `grow` adds
    threads, so a pool can start on fewer cores than it ends with."""

    def __init__(self):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._threads: list = []

    def submit(self, fn, *args) -> Future:
        future: Future = Future()
        self._queue.put((future, fn, args))
        return future

    def grow(self, threads: int) -> None:
        while len(self._threads) < threads:
            self._threads.append(threading.Thread(target=self._work, name="compile"))
            self._threads[-1].start()

    def _work(self) -> None:
        while True:
            try:
                future, fn, args = self._queue.get_nowait()
            except queue.Empty:
                return
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args))
                except BaseException as e:  # the test waiting for it raises it
                    future.set_exception(e)

    def close(self) -> None:
        """Drop the jobs not started (a run cut short does not wait for them); join the rest."""
        while True:
            try:
                self._queue.get_nowait()[0].cancel()
            except queue.Empty:
                break
        for thread in self._threads:
            thread.join()


def _compile_all(add_cleanup, jobs, compiler: str, inputs, compile_one, threads: int):
    """(pool, a future per job: its `cached_compile`), the pool on `threads` threads; `add_cleanup`
    takes its close."""
    pool = CompilePool()
    add_cleanup(pool.close)
    futures = {job: pool.submit(cached_compile, _session_cache(), compiler, inputs, compile_one,
                                job) for job in _slowest_first(jobs)}
    pool.grow(threads)
    return pool, futures


NVRTC_TEST = "test_kernel_compiles_with_nvrtc"
_STARTED: dict = {}  # NVRTC_TEST: its futures, once start_compiles has begun them


def start_compiles(session) -> None:
    """Begin the session's selected NVRTC compiles in the background. conftest.py calls this as
    collection ends and runs this module's kernel cases last, so the compiles take the cores the
    other test files leave idle: all but one (NVRTC releases the GIL; the tests keep a core, so
    none runs slower), and every core once the kernel cases begin (`nvrtc_results`). Where NVRTC
    cannot load, nothing starts (the fixture then skips, saying why)."""
    jobs = _selected_jobs(session.items, NVRTC_TEST)
    if NVRTC_TEST in _STARTED or not jobs:
        return
    try:
        nvrtc = load_nvrtc()
    except pytest.skip.Exception:
        return
    _STARTED[NVRTC_TEST] = _compile_all(session.config.add_cleanup, jobs, nvrtc_identity(nvrtc),
                                        nvrtc_inputs, lambda job: compile_nvrtc(nvrtc, *job),
                                        max(1, _workers() - 1))


def is_kernel_case(item) -> bool:
    """Whether `item` only waits for a compile start_compiles or nvcc_results began (conftest.py
    runs these last)."""
    return getattr(item, "originalname", None) in (NVRTC_TEST, "test_kernel_compiles_with_nvcc")


@pytest.fixture(scope="module")
def nvcc_results(request, nvcc, compile_cache, tmp_path_factory):
    """The selected nvcc cases compiled, one compile per core at a time; each test waits for
    its own result, so a failure is reported against its (file, arch, variant)."""
    out_dir = tmp_path_factory.mktemp("nvcc")
    return _compile_all(request.addfinalizer,
                        _selected_jobs(request.session.items, "test_kernel_compiles_with_nvcc"),
                        nvcc_identity(nvcc),
                        lambda path, arch, defines: (_loader_view(path)[0],
                                                     nvcc_options(path, arch, defines)),
                        lambda job: compile_nvcc(nvcc, *job, out_dir), _workers())[1]


@pytest.fixture(scope="module")
def nvrtc_results(request, compile_cache):
    """As `nvcc_results`, through NVRTC (which releases the GIL while it compiles), begun by
    start_compiles."""
    load_nvrtc()  # skips, saying why, where it cannot load
    start_compiles(request.session)  # where conftest.py's hook did not
    pool, futures = _STARTED[NVRTC_TEST]
    pool.grow(_workers())  # the other tests are done: every core
    return futures


@pytest.mark.parametrize("path, arch, defines", NVCC_CASES)
def test_kernel_compiles_with_nvcc(nvcc_results, path, arch, defines):
    ok, log = nvcc_results[(path, arch, defines)].result()
    assert ok, f"{path.name} does not compile for sm_{arch} with {defines}:\n{log}"


@pytest.mark.parametrize("path, arch, defines", NVRTC_CASES)
def test_kernel_compiles_with_nvrtc(nvrtc_results, path, arch, defines):
    ok, log = nvrtc_results[(path, arch, defines)].result()
    assert ok, f"{path.name} does not compile for sm_{arch} with {defines} via NVRTC:\n{log}"


# --- the machinery, proven on sources written here ----------------------------------------------
TINY_HEADER = """
#pragma once
__device__ __forceinline__ float twice(float x) { return 2.0f * x; }
"""

TINY_KERNEL = """
// A kernel in two head-dim variants, the way the project's templated kernels declare them.
// ferro-variants: FERRO_HEAD_DIM=32,64
#include "tiny_common.cuh"
#ifndef FERRO_HEAD_DIM
#error "FERRO_HEAD_DIM must be defined"
#endif
template <int D>
__device__ void scale_row(float* row) {
#pragma unroll
    for (int i = 0; i < D; ++i) row[i] = twice(row[i]);
}
extern "C" __global__ void scale_rows(float* x, unsigned rows) {
    unsigned r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r < rows) scale_row<FERRO_HEAD_DIM>(x + (size_t)r * FERRO_HEAD_DIM);
}
"""

BROKEN_KERNEL = """
extern "C" __global__ void broken(float* x) { x[threadIdx.x] = undeclared_name; }
"""

# 64 KiB of static shared memory: past the 48 KiB static limit, which only the assembler sees.
TOO_MUCH_SHARED = """
extern "C" __global__ void greedy(float* x) {
    __shared__ float tile[16384];
    tile[threadIdx.x] = x[threadIdx.x];
    __syncthreads();
    x[threadIdx.x] = tile[(threadIdx.x + 1) % 16384];
}
"""


@pytest.fixture
def tiny(tmp_path):
    (tmp_path / "tiny_common.cuh").write_text(TINY_HEADER)
    (tmp_path / "tiny.cu").write_text(TINY_KERNEL)
    (tmp_path / "broken.cu").write_text(BROKEN_KERNEL)
    (tmp_path / "greedy.cu").write_text(TOO_MUCH_SHARED)
    return tmp_path


def test_variants_parsing():
    assert variants("extern \"C\" __global__ void k() {}") == [()]
    assert variants("// ferro-variants: FERRO_HEAD_DIM=32,64,96,128\n") == [
        ("FERRO_HEAD_DIM=32",), ("FERRO_HEAD_DIM=64",), ("FERRO_HEAD_DIM=96",),
        ("FERRO_HEAD_DIM=128",)]
    assert variants("  //ferro-variants:  A=1, 2  B=x\n") == [("A=1", "B=x"), ("A=2", "B=x")]
    assert variants("int x; // ferro-variants: A=1\n") == [()]  # only whole comment lines count
    with pytest.raises(ValueError, match="bad ferro-variants"):
        variants("// ferro-variants: FERRO_HEAD_DIM\n")


@pytest.mark.compile  # with the nvcc cases: the default run builds nothing with nvcc
@pytest.mark.parametrize("arch", ARCHS)
def test_nvcc_machinery(nvcc, tiny, arch):
    src = tiny / "tiny.cu"
    assert variants(src.read_text()) == [("FERRO_HEAD_DIM=32",), ("FERRO_HEAD_DIM=64",)]
    for defines in variants(src.read_text()):
        ok, log = compile_nvcc(nvcc, src, arch, defines, tiny)
        assert ok, log
    ok, log = compile_nvcc(nvcc, src, arch, (), tiny)  # the variant's define left out
    assert not ok and "FERRO_HEAD_DIM must be defined" in log
    ok, log = compile_nvcc(nvcc, tiny / "broken.cu", arch, (), tiny)
    assert not ok and "undeclared_name" in log
    ok, log = compile_nvcc(nvcc, tiny / "greedy.cu", arch, (), tiny)
    assert not ok and "shared" in log.lower(), log


@pytest.mark.parametrize("arch", ARCHS)
def test_nvrtc_machinery(tiny, arch):
    nvrtc = load_nvrtc()
    src = tiny / "tiny.cu"
    for defines in variants(src.read_text()):
        ok, log = compile_nvrtc(nvrtc, src, arch, defines)
        assert ok, log
    ok, log = compile_nvrtc(nvrtc, src, arch, ())
    assert not ok and "FERRO_HEAD_DIM must be defined" in log
    ok, log = compile_nvrtc(nvrtc, tiny / "broken.cu", arch, ())
    assert not ok and "undeclared_name" in log
    ok, log = compile_nvrtc(nvrtc, tiny / "greedy.cu", arch, ())
    assert not ok and "shared" in log.lower(), log


def test_compile_cache(tiny, tmp_path):
    """A success is recorded and then skipped while its inputs stay the same; a failure never is;
    a header's edit or another option compiles again; `-I` folders do not count."""
    nvrtc = load_nvrtc()
    cache = CompileCache(tmp_path / "records")
    compiler = nvrtc_identity(nvrtc)
    assert "libnvrtc" in compiler  # the library's bytes, not only its version

    def through_cache(name, defines=(), arch="90"):
        return cached_compile(cache, compiler, nvrtc_inputs,
                              lambda job: compile_nvrtc(nvrtc, *job), (tiny / name, arch, defines))

    assert through_cache("tiny.cu", ("FERRO_HEAD_DIM=32",))[0] and cache.compiled == 1
    ok, log = through_cache("tiny.cu", ("FERRO_HEAD_DIM=32",))
    assert ok and "compiled before" in log and (cache.hits, cache.compiled) == (1, 1)
    assert len(list((tmp_path / "records").iterdir())) == 1
    through_cache("tiny.cu", ("FERRO_HEAD_DIM=64",))
    through_cache("tiny.cu", ("FERRO_HEAD_DIM=32",), arch="80")
    assert (cache.hits, cache.compiled) == (1, 3)
    (tiny / "tiny_common.cuh").write_text(TINY_HEADER + "// edited\n")
    assert through_cache("tiny.cu", ("FERRO_HEAD_DIM=32",))[0] and cache.compiled == 4
    for _ in range(2):  # failures are compiled, and fail, every time
        ok, log = through_cache("broken.cu")
        assert not ok and "undeclared_name" in log
    assert (cache.hits, cache.compiled) == (1, 6)
    assert len(list((tmp_path / "records").iterdir())) == 4
    options = nvrtc_inputs(tiny / "tiny.cu", "90", ())[1]
    assert compile_key(compiler, "tiny.cu", "x", (*options, "-I/elsewhere")) == \
        compile_key(compiler, "tiny.cu", "x", options)
    off = CompileCache(None)
    assert off.compile("k", "x", lambda: (True, "ran")) == (True, "ran") and off.compiled == 1


def test_compile_cache_folder(tmp_path):
    assert cache_dir({"XDG_CACHE_HOME": str(tmp_path)}) == tmp_path / "ferrocupy" / "compiled-ok"
    assert cache_dir({}) == Path.home() / ".cache" / "ferrocupy" / "compiled-ok"
    assert cache_dir({CACHE_ENV: "0", "XDG_CACHE_HOME": str(tmp_path)}) is None
    assert cache_dir({CACHE_ENV: "1"}) is not None


def test_default_run_builds_every_source_and_code_path():
    """The default run's NVRTC cases take every `.cu` file and every code path the full matrix
    builds for sm_90 and sm_90a, so a source broken in any of its code paths fails it."""
    default = default_run_jobs(_NVRTC_JOBS)
    assert {path for path, _, _ in default} == set(CUDA_DIR.glob("*.cu"))
    assert {_code_path(job) for job in default} == {
        _code_path(job) for job in _NVRTC_JOBS if job[1].startswith(DEFAULT_RUN_ARCH)}
    for case in NVRTC_CASES:  # the rest is what `-m compile` builds
        assert (tuple(case.values) in default) != any(m.name == "compile" for m in case.marks)


def test_default_run_builds_both_branches_of_the_half_twin_headers():
    """Of each 16-bit code path the default run builds one twin, and over the run both: float16
    through the forward sources, bfloat16 through the others, each of which includes the headers
    that choose between them."""
    default = default_run_jobs(_NVRTC_JOBS)
    twins = {d for job in default for d in job[2] if d.partition("=")[0] == HALF_TWIN}
    assert twins == {f"{HALF_TWIN}=0", f"{HALF_TWIN}=1"}
    assert all(_default_twin(job) for job in default)
    float16 = {job[0].name for job in default if f"{HALF_TWIN}=0" in job[2]}
    assert float16 == HALF_TWIN_FLOAT16
    for header in ("ferro_mma_f16.cuh", "ferro_wgmma.cuh"):
        assert any(f'#include "{header}"' in (CUDA_DIR / name).read_text()
                   for name in HALF_TWIN_FLOAT16), header


def test_half_twins_differ_in_three_headers_only():
    """HALF_TWIN's premise: outside HALF_TWIN_HEADERS the kernels test FERRO_BF16 only for being
    defined (16-bit or float32), never its value, so the two 16-bit twins of a code path differ
    only in those headers' conversions and instruction types. (append_kv.cu sets it from its
    own FERRO_APPEND_DTYPE and is built in every dtype by the default run.)"""
    presence = re.compile(r"#\s*if(n)?def\s+FERRO_BF16\b|#\s*error\b.*")
    for path in sorted([*CUDA_DIR.glob("*.cu"), *CUDA_DIR.glob("*.cuh")]):
        if path.name in HALF_TWIN_HEADERS:
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("//")[0].strip()
            if HALF_TWIN not in code:
                continue
            assert presence.fullmatch(code) or (
                path.name == "append_kv.cu" and re.fullmatch(r"#define FERRO_BF16 [01]", code)), \
                f"{path.name}:{n} tests FERRO_BF16's value: {line}"


def test_mods_adds_code_only():
    """SUPERSET_DEFINE's premise: FERRO_MODS reaches the kernels only as ferro_score.cuh's
    BuildOptions::MODS, a constant they test in plain `if`s or pass on as a template argument,
    never in a preprocessor test, an `if constexpr`, a specialization or a type choice, so a
    FERRO_MODS=1 build compiles every statement of its FERRO_MODS=0 twin."""
    choosers = re.compile(r"#\s*(el)?if|constexpr\s*\(|template\s*<\s*>|conditional|enable_if")
    for path in sorted([*CUDA_DIR.glob("*.cu"), *CUDA_DIR.glob("*.cuh")]):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("//")[0]
            if "FERRO_MODS" in code:
                assert path.name == "ferro_score.cuh" and re.fullmatch(
                    r"#ifndef FERRO_MODS|#define FERRO_MODS 0|typedef Options<.*> BuildOptions;",
                    code.strip()), f"{path.name}:{n}: {line}"
            elif "MODS" in code:
                assert not choosers.search(code), f"{path.name}:{n} chooses code by MODS: {line}"


# Shared-memory limits per block (bytes) and their compute capabilities: sm_86 / sm_89, sm_80,
# sm_90.
SMEM_LIMITS = ((99 * 1024, 86), (163 * 1024, 80), (227 * 1024, 90))


def test_every_selectable_variant_is_compiled():
    """The compile cases cover whatever `configs.select` can return, for every dtype and
    head_dim 1..256, at sm_86's (99 KB), sm_80's (163 KB) and sm_90's (227 KB) shared-memory
    limits, and (decode) KV groups of 1, 5 and 16 query rows, for calls with and without mask or
    dropout, with and without softcap, ALiBi or sinks, dense or varlen. (What 99 KB cannot hold is
    tests/test_configs.py's.)"""
    from ferrocupy.cuda import configs

    compiled = {(p.name, a, d) for p, a, d in _NVRTC_JOBS}
    for op in (configs.FORWARD, configs.BACKWARD_DQ, configs.BACKWARD_DKDV, configs.DECODE):
        for dtype in configs.ROPE_DTYPE_DEFINE:
            for hd in range(1, 257):
                for limit, cap in SMEM_LIMITS:
                    for copy_bytes in (16, 4, 2):
                        for rows, plain, mods, varlen in itertools.product(
                                (1, 5, 16) if op == configs.DECODE else (0,), (False, True),
                                (False, True), (False, True)):
                            try:  # (`plain`: no mask or dropout, so the unmasked builds too)
                                v = configs.select(op, dtype, hd, limit, capability=cap,
                                                   copy_bytes=copy_bytes, rows=rows,
                                                   plain=plain and not mods, mods=mods,
                                                   varlen=varlen, unmasked=plain)
                            except ValueError:
                                assert limit < 163 * 1024 and hd > 128, (op, dtype, hd, limit)
                                continue
                            defines = tuple(f"{k}={x}" for k, x in sorted(v.defines.items()))
                            assert (v.source, v.arch or "90", defines) in compiled, v.describe()


def test_every_rope_variant_is_compiled():
    """The compile cases cover every (dtype, elements per access) `configs.rope_vector` can
    return, whatever the call's head_dim, rotary_dim, strides and addresses."""
    from ferrocupy.cuda import configs

    compiled = {(p.name, d) for p, a, d in _NVCC_JOBS if a == "90"} & \
        {(p.name, d) for p, a, d in _NVRTC_JOBS if a == "90"}
    for dtype in configs.ROPE_DTYPE_DEFINE:
        for d, rd, stride, address in itertools.product((2, 6, 8, 16, 24, 128), (2, 4, 8, 16, 64),
                                                        (1, 2, 4, 8, 96), (0, 2, 4, 8)):
            if rd > d:
                continue
            vec = configs.rope_vector(dtype, d, rd, (stride, 0, d), (256 + address, 512))
            defines = tuple(f"{k}={x}" for k, x in sorted(configs.rope_defines(dtype,
                                                                               vec).items()))
            assert (configs.ROPE_SOURCE, defines) in compiled, (dtype, d, rd, stride, address)


def test_wgmma_header_is_the_generators_output():
    """ferro_wgmma_ops.cuh is generated (ferrocupy/cuda/gen_wgmma.py); the committed text must
    match."""
    from ferrocupy.cuda import gen_wgmma

    assert (CUDA_DIR / "ferro_wgmma_ops.cuh").read_text() == gen_wgmma.header(), (
        "ferro_wgmma_ops.cuh differs from its generator's output: run "
        "python -m ferrocupy.cuda.gen_wgmma")


def test_wgmma_variants_are_chosen_only_where_they_run():
    """sm_90a kernels only on compute capability 9.0 with 16-byte rows; elsewhere mma.sync."""
    from ferrocupy.cuda import configs
    from ferrocupy.dtypes import BFLOAT16, FLOAT32

    big = 227 * 1024
    assert configs.select(configs.FORWARD, BFLOAT16, 128, big, capability=90,
                          copy_bytes=16).isa == configs.WGMMA
    assert configs.select(configs.FORWARD, BFLOAT16, 64, big, capability=90,
                          copy_bytes=16).head_dim == 64
    for cap, copy_bytes in ((90, 4), (80, 16), (100, 16)):
        assert configs.select(configs.FORWARD, BFLOAT16, 128, big, capability=cap,
                              copy_bytes=copy_bytes).isa == configs.MMA
    assert configs.select(configs.FORWARD, FLOAT32, 128, big, capability=90,
                          copy_bytes=16).isa == configs.MMA
    table = configs.only(configs.MMA)
    assert all(v.isa == configs.MMA for vs in table.values() for v in vs if v.op != configs.DECODE)
    assert table[(configs.DECODE, BFLOAT16, 128)] == configs.TABLE[(configs.DECODE, BFLOAT16, 128)]
    table = configs.only(configs.TILES)
    assert {v.isa for v in table[(configs.DECODE, BFLOAT16, 128)]} == {configs.TILES}
