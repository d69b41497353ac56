"""Host cost per call of `ferrocupy.torch.attention` without a GPU: the CUDA backend's whole
host path (the engine's plan cache, the plan's memory checks, the backend's launch plan, its
packed arguments) on CPU tensors dressed as CUDA ones, with the driver's `cuLaunchKernel` a
no-op. The decode shape of benchmarks/call_cost.py: B1 Sq1 Sk128 H8 D64, float32.

    python3 lab/host_cost_cpu.py [OLD_TREE] [--new TREE] [--profile] [--calls N] [--rounds R]

OLD_TREE (a tree whose `ferrocupy/` to compare, e.g. `git archive 40c43ca | tar -x -C /tmp/old`)
is imported as `ferrocupy_old`, its rounds interleaved with this tree's (or `--new` TREE's) in
one process.
`--profile`: cProfile of each of this tree's calls.

What is faked, in this process only (never in the package):
- `cupy`: a module with the few attributes the backend reads (an H100's limits, device 0,
  stream 7); its `cuda.driver.launchKernel` counts launches and does nothing else.
- The engines `ferrocupy.torch` keeps for CPU tensors are CUDA engines on that fake device
  (`ComputeEngine` is swapped while `ferrocupy.torch` is imported, then restored), whose kernel
  loader compiles nothing; their `device` is "cpu", the tensors' own.
- `Tensor.is_cuda` answers True (a Python property: ~0.05 us dearer than torch's own);
  `torch._C._cuda_getCurrentRawStream` (in a CUDA build of torch) answers stream 7;
  `torch.cuda.current_device()` answers 0 (asked where a CUDA tensor's device has index 0).
- The old tree's forward body asks `q.device.type == "cuda"` where this tree asks `q.is_cuda`;
  its copy asks `q.is_cuda` (the same answer on a GPU, ~0.1 us cheaper than the device's).
What it leaves out: the driver's launch (~2-4 us a kernel on the device), CUDA's caching
allocator (torch.empty on the CPU allocator instead), the real stream lookup (~0.2 us). These
are the same in both trees, so differences between the trees are the host path's own; the
device's absolute numbers are higher (host speed differs too).
"""

from __future__ import annotations

import argparse
import importlib
import os
import shutil
import sys
import tempfile
import time
import types
from pathlib import Path

import numpy as np

LAUNCHES = [0]


def install_fake_cupy() -> None:
    """A `cupy` module that a CudaBackend can be built around (device 0, an H100's limits)."""
    cupy = types.ModuleType("cupy")
    cuda = types.ModuleType("cupy.cuda")

    class Device:
        def __init__(self, index=None):
            self.id = 0 if index is None else index
            self.attributes = {"MaxSharedMemoryPerBlockOptin": 232448,
                               "MaxSharedMemoryPerMultiprocessor": 233472,
                               "MultiProcessorCount": 132}
            self.compute_capability = "90"

        def synchronize(self):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    class ExternalStream:
        def __init__(self, ptr, device=None):
            self.ptr = ptr

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    def launch_kernel(*args):
        LAUNCHES[0] += 1

    cuda.Device = Device
    cuda.ExternalStream = ExternalStream
    cuda.runtime = types.SimpleNamespace(getDeviceCount=lambda: 1, getDevice=lambda: 0)
    cuda.driver = types.SimpleNamespace(launchKernel=launch_kernel)
    cuda.get_current_stream = lambda: types.SimpleNamespace(ptr=7)
    cupy.cuda = cuda
    cupy.ndarray = type("ndarray", (), {})
    cupy.zeros, cupy.empty, cupy.asarray = np.zeros, np.empty, np.asarray
    sys.modules["cupy"], sys.modules["cupy.cuda"] = cupy, cuda


class FakeLoader:
    """Compiles nothing: a kernel is a name with a CUfunction of 1."""

    def function(self, source, name, defines=None, options=()):
        return types.SimpleNamespace(name=name, max_dynamic_shared_size_bytes=0,
                                     kernel=types.SimpleNamespace(ptr=1))


def torch_module(package: str):
    """`package`.torch, with the engines it makes being CUDA engines on the fake device."""
    engine_module = importlib.import_module(package + ".engine")
    real = engine_module.ComputeEngine

    def fake_cuda_engine(backend=None, *, quiet=False):
        engine = real("cuda", quiet=True)
        engine.backend.loader = FakeLoader()
        engine.backend.device = "cpu"
        return engine

    engine_module.ComputeEngine = fake_cuda_engine
    try:
        return importlib.import_module(package + ".torch")
    finally:
        engine_module.ComputeEngine = real


def copy_old_tree(tree: str) -> None:
    """`tree`/ferrocupy importable as `ferrocupy_old` (its op namespace renamed, so both register
    their ops; its forward body asking `q.is_cuda`)."""
    site = tempfile.mkdtemp()
    shutil.copytree(os.path.join(tree, "ferrocupy"), os.path.join(site, "ferrocupy_old"))
    for path in Path(site, "ferrocupy_old").rglob("*.py"):
        text = path.read_text().replace("ferrocupy::", "ferrocupy_old::")
        path.write_text(text.replace('q.device.type == "cuda"', "q.is_cuda"))
    sys.path.insert(0, site)


def calls(ft, torch):
    """(name, fn) of the calls timed, on this module's tensors."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 1, 8, 64, generator=g)
    k = torch.randn(1, 128, 8, 64, generator=g)
    v = torch.randn(1, 128, 8, 64, generator=g)
    gq, gk, gv = (x.clone().requires_grad_() for x in (q, k, v))

    def grad():
        return ft.attention(gq, gk, gv)

    return [("torch.attention (no grad)", lambda: ft.attention(q, k, v)),
            ("torch.attention (grad)", grad)]


def per_call(fn, n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("old", nargs="?")
    ap.add_argument("--new", default=str(Path(__file__).resolve().parents[1]),
                    help="the tree whose ferrocupy/ is `new` (default: this one)")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=101)
    args = ap.parse_args()
    sys.path.insert(0, args.new)
    install_fake_cupy()
    import torch

    torch.Tensor.is_cuda = property(lambda self: True)
    torch._C._cuda_getCurrentRawStream = lambda index: 7
    torch.cuda.is_current_stream_capturing = lambda: False
    torch.cuda.current_device = lambda: 0  # a CPU tensor's device has no index
    trees = {"new": torch_module("ferrocupy")}
    if args.old:
        copy_old_tree(args.old)
        trees = {"old": torch_module("ferrocupy_old"), **trees}
    table = {tag: calls(ft, torch) for tag, ft in trees.items()}
    for tag, rows in table.items():  # warm (plans made), and each call launches one kernel
        for name, fn in rows:
            for _ in range(50):
                fn()
            before = LAUNCHES[0]
            fn()
            assert LAUNCHES[0] == before + 1, (tag, name, LAUNCHES[0] - before)
    tags = list(table)
    print(f"{'call (CPU, launch stubbed)':30s} " + " ".join(f"{t + ' us':>9s}" for t in tags)
          + ("   new/old" if len(tags) == 2 else "")
          + f"   (fastest of {args.rounds} interleaved rounds x {args.calls} calls: the machine's"
          f" other load only adds)")
    for i, (name, _) in enumerate(table[tags[-1]]):
        ts = {t: [] for t in tags}
        for r in range(args.rounds):
            for t in (tags if r % 2 else tags[::-1]):
                ts[t].append(per_call(table[t][i][1], args.calls))
        med = [min(ts[t]) for t in tags]
        print(f"{name:30s} " + " ".join(f"{m:9.2f}" for m in med)
              + (f"   {med[1] / med[0]:7.3f}" if len(med) == 2 else ""))
    if args.profile:
        import cProfile
        import pstats

        for name, fn in table["new"]:
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(2000):
                fn()
            prof.disable()
            print(f"\n== {name} (this tree, 2000 calls) ==")
            pstats.Stats(prof).sort_stats("tottime").print_stats(30)


if __name__ == "__main__":
    main()
