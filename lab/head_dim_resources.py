"""Registers and spills of the kernel variants at some padded head_dims (by default those above
configs.MEASURED_HEAD_DIM, which no sweep has timed yet), one markdown row per variant:

    python lab/head_dim_resources.py [--head-dims 144,192,256] [--match REGEX] [--jobs 2]

Each variant is compiled with nvcc to a cubin for sm_90 (sm_90a for the wgmma ones; `--sm80`
adds sm_80) with the table's defines, and ptxas's --resource-usage read, as lab/seam_resources.py
does (its compile and cache); `seam_resources.py --ref-commit` compares two trees' variants.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import re
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from seam_resources import CACHE, ROOT, compile_one, expanded, label  # noqa: E402

from ferrocupy.cuda import configs  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--head-dims", default=",".join(
        str(d) for d in configs.HEAD_DIMS if d > configs.MEASURED_HEAD_DIM))
    ap.add_argument("--match", default="", help="only variants whose label matches this regex")
    ap.add_argument("--sm80", action="store_true")
    ap.add_argument("--jobs", type=int, default=2)
    args = ap.parse_args(argv)
    dims = {int(d) for d in args.head_dims.split(",")}

    jobs = []
    for v in configs.all_variants():
        if v.head_dim not in dims:
            continue
        d = {f.name: getattr(v, f.name) for f in dataclasses.fields(v)}
        d.update(dtype=str(v.dtype), source=v.source, kernel=v.kernel, arch=v.arch,
                 defines=v.defines, smem_bytes=v.shared_bytes)
        for arch in [v.arch] if v.arch else (["90", "80"] if args.sm80 else ["90"]):
            if args.match and not re.search(args.match, label(d, arch)):
                continue
            src = ROOT / "ferrocupy" / "cuda" / v.source
            key = hashlib.sha1(json.dumps([expanded(src), sorted(v.defines.items()), arch,
                                           v.kernel]).encode()).hexdigest()
            jobs.append((d, arch, key))

    cache = json.loads(CACHE.read_text()) if CACHE.exists() else {}
    tmp = Path(tempfile.mkdtemp(prefix="hd-res-"))

    def run(job):
        d, arch, key = job
        if key not in cache:
            cache[key] = compile_one(ROOT, d, arch, tmp)
        return job, cache[key]

    print("| variant | regs | spill_st (bytes) | shared (bytes) |")
    print("|---|---|---|---|")
    failed = 0
    with ThreadPoolExecutor(args.jobs) as pool:
        for (d, arch, _), res in pool.map(run, jobs):
            if "error" in res:
                failed += 1
                print(f"| {label(d, arch)} | error: {res['error'][-300:]!r} | | |")
            else:
                print(f"| {label(d, arch)} | {res['regs']} | {res['spill_st']} | "
                      f"{d['smem_bytes']} |", flush=True)
    CACHE.parent.mkdir(parents=True, exist_ok=True)
    CACHE.write_text(json.dumps(cache))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
