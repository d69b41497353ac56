"""Compile every kernel variant for the current GPU ahead of first use, in parallel.

    python -m ferrocupy.cuda.precompile [--dtype float16,bfloat16] [--jobs N]

NVRTC compiles each variant the first time it is launched (a few seconds each); CuPy then keeps
the binary in its on-disk cache, so later processes start fast. This fills that cache for every
variant `configs.select` can return on this GPU (NVRTC releases the GIL, so threads overlap),
bar the varlen and paged builds (configs.py's `varlen` and `paged` copies), which compile at such a
call's first run.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ferrocupy.cuda.precompile")
    ap.add_argument("--dtype", default="float32,float16,bfloat16")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args(argv)

    import cupy

    from .. import dtypes
    from . import configs
    from .loader import KernelLoader

    wanted = [dtypes.parse(d) for d in args.dtype.split(",")]
    attrs = cupy.cuda.Device().attributes
    limit = attrs["MaxSharedMemoryPerBlockOptin"]
    capability = int(cupy.cuda.Device().compute_capability)
    jobs = {(configs.ROPE_SOURCE, configs.ROPE_KERNEL, tuple(sorted(defines.items())), ())
            for defines in configs.rope_variants()
            if defines["FERRO_ROPE_DTYPE"] in {configs.ROPE_DTYPE_DEFINE[d] for d in wanted}}
    for (op, dtype, dp), candidates in configs.TABLE.items():
        if op == configs.BACKWARD_FUSED:  # the fused backward: only where its switch is on
            for plain, mods, unmasked in ((True, False, True), (False, False, False),
                                          (False, True, False), (False, True, True)):
                v = configs.select_fused(dtype, dp, limit, capability=capability, copy_bytes=16,
                                         plain=plain, mods=mods, unmasked=unmasked)
                if v is not None and dtype in wanted and configs.FUSED_BACKWARD:
                    defines = tuple(sorted(v.defines.items()))
                    jobs.update((v.source, name, defines, v.options) for name in
                                (v.kernel, configs.FUSED_PRE_KERNEL, configs.FUSED_POST_KERNEL))
        elif dtype in wanted:
            for copy_bytes in (16, 4):  # aligned rows, and the fallback for views that are not
                # a call without mask, dropout or model option; one with a mask; one with
                # softcap, ALiBi or sinks and a mask; one with them alone
                for plain, mods, unmasked in ((True, False, True), (False, False, False),
                                              (False, True, False), (False, True, True)):
                    v = configs.select(op, dtype, dp, limit, capability=capability,
                                       copy_bytes=copy_bytes, plain=plain, mods=mods,
                                       unmasked=unmasked)
                    jobs.add((v.source, v.kernel, tuple(sorted(v.defines.items())), v.options))
    jobs.add((configs.SINKS_SOURCE, configs.SINKS_KERNEL, (), ()))
    jobs.update((configs.APPEND_SOURCE, configs.APPEND_KERNEL,
                 tuple(configs.append_defines(d).items()), ()) for d in wanted)
    loader = KernelLoader()
    device = cupy.cuda.Device().id
    t0 = time.time()

    def build(job):
        with cupy.cuda.Device(device):
            loader.function(job[0], job[1], dict(job[2]), job[3])

    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        list(pool.map(build, sorted(jobs)))
    print(f"compiled {len(jobs)} kernels in {time.time() - t0:.1f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
