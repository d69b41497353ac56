"""Fill CuPy's kernel cache with EVERY variant of the variant table that can run on this GPU (not
only the ones `configs.select` picks, as `python -m ferrocupy.cuda.precompile` does): the GPU
suite forces other designs (the `kernels` fixture's "mma", the decode designs), and a test that
compiles its own variant while 14 others do the same waits up to a minute for NVRTC. Run before a
device round's test phase, with CUPY_CACHE_DIR where the test processes will look:

    python3 lab/precompile_all.py [--jobs 16]

Uses the public configs table and the kernel loader; prints how many kernels it built."""
from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import cupy

from ferrocupy.cuda import configs
from ferrocupy.cuda.loader import KernelLoader


def jobs_for(capability: int, smem_limit: int) -> set:
    jobs = set()
    for v in configs.all_variants():
        if not (v.runs_on(capability, 16) or v.runs_on(capability, 4)):
            continue
        if v.shared_bytes > smem_limit:
            continue
        defines = tuple(sorted(v.defines.items()))
        names = [v.kernel]
        if v.op == getattr(configs, "BACKWARD_FUSED", None):
            names += [configs.FUSED_PRE_KERNEL, configs.FUSED_POST_KERNEL]
        jobs.update((v.source, n, defines, v.options) for n in names)
    for defines in configs.rope_variants():
        jobs.add((configs.ROPE_SOURCE, configs.ROPE_KERNEL, tuple(sorted(defines.items())), ()))
    if hasattr(configs, "SINKS_SOURCE"):
        jobs.add((configs.SINKS_SOURCE, configs.SINKS_KERNEL, (), ()))
    if hasattr(configs, "APPEND_SOURCE"):
        jobs.update((configs.APPEND_SOURCE, configs.APPEND_KERNEL,
                     tuple(configs.append_defines(d).items()), ())
                    for d in configs.ROPE_DTYPE_DEFINE)
    return jobs


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args()
    dev = cupy.cuda.Device()
    jobs = jobs_for(int(dev.compute_capability), dev.attributes["MaxSharedMemoryPerBlockOptin"])
    loader, t0, failed = KernelLoader(), time.time(), []

    def build(job):
        with cupy.cuda.Device(dev.id):
            try:
                loader.function(job[0], job[1], dict(job[2]), job[3])
            except Exception as e:  # noqa: BLE001 - reported, the others still build
                failed.append(f"{job[0]} {job[1]} {job[2]}: {type(e).__name__}: {e}"[:400])

    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        list(pool.map(build, sorted(jobs)))
    print(f"compiled {len(jobs) - len(failed)} of {len(jobs)} kernels in {time.time() - t0:.1f} s",
          file=sys.stderr)
    for f in failed:
        print("FAILED", f, file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
