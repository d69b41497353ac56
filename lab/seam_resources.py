"""Registers, spills, shared memory and SASS instruction counts of the kernel variants in two
trees (a reference and the working tree), side by side: a kernel-layer refactor should leave them
equal (or fewer registers, no new spills), and any changed instruction count wants a reason.

    python lab/seam_resources.py [--ref DIR | --ref-commit SHA] [--new DIR]
        [--head-dims 64,128] [--dtypes float32,bfloat16] [--match REGEX] [--sm80] [--jobs 2]
        [--mods]

Each tree's `ferrocupy/cuda/configs.py` lists its variants (run in a subprocess per tree, so the
two packages never meet in one interpreter); variants are paired by their geometry (op, dtype,
head_dim, warps, mt, step, isa, stages, rows, plain), whatever source or entry point builds them
in either tree. Each is compiled with nvcc to a cubin for sm_90 (sm_90a for the wgmma variants;
`--sm80` adds sm_80 for the rest) with the table's defines, as tests/test_compile.py does; ptxas's
--resource-usage gives registers, spills and static shared memory, `cuobjdump -sass` the counts
(cuobjdump and nvdisasm come from the nvidia-cuda-cuobjdump / -nvdisasm wheels where the toolkit
lacks them: put their bin/ on PATH; nvdisasm alone serves too: `pip install nvidia-cuda-nvdisasm`
puts it in the venv's `nvidia/cu13/bin`). Results are cached by the expanded source text,
defines and arch in ~/.cache/ferrocupy-seam-resources.json.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CACHE = Path.home() / ".cache" / "ferrocupy-seam-resources.json"
COUNTED = ("HMMA", "HGMMA", "LDSM", "LDS", "STS", "LDG", "STG", "LDGSTS", "SHFL", "MUFU", "BAR")
KEY_FIELDS = ("op", "dtype", "head_dim", "warps", "mt", "step", "isa", "stages", "rows", "plain",
              "mods", "varlen", "unmasked")

_DUMP = r"""
import json
from ferrocupy.cuda import configs
out = []
for v in configs.all_variants():
    out.append({"op": v.op, "dtype": str(v.dtype), "head_dim": v.head_dim, "warps": v.warps,
                "mt": v.mt, "step": v.step, "isa": v.isa, "stages": v.stages, "rows": v.rows,
                "plain": v.plain, "mods": getattr(v, "mods", False),
                "varlen": getattr(v, "varlen", False),
                "unmasked": getattr(v, "unmasked", False), "source": v.source,
                "kernel": v.kernel, "arch": v.arch,
                "defines": v.defines})
print(json.dumps(out))
"""


def variants_of(tree: Path) -> list[dict]:
    out = subprocess.run([sys.executable, "-c", _DUMP], cwd=tree, capture_output=True, text=True,
                         check=True)
    return json.loads(out.stdout)


def expanded(path: Path, seen=None) -> str:
    """The source with its local includes inlined (what the cache key hashes)."""
    seen = set() if seen is None else seen
    text = path.read_text()
    for name in re.findall(r'^\s*#include\s+"([^"]+)"', text, re.M):
        dep = path.parent / name
        if dep.exists() and dep not in seen:
            seen.add(dep)
            text += expanded(dep, seen)
    return text


def compile_one(tree: Path, v: dict, arch: str, tmp: Path) -> dict:
    src = tree / "ferrocupy" / "cuda" / v["source"]
    defines = sorted(f"-D{k}={x}" for k, x in v["defines"].items())
    out = tmp / (hashlib.sha1(f"{tree}{src}{defines}{arch}".encode()).hexdigest() + ".cubin")
    cmd = ["nvcc", "-std=c++17", f"-arch=sm_{arch}", "-cubin", "--resource-usage",
           f"-I{src.parent}", *defines, "-o", str(out), str(src)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        return {"error": (proc.stdout + proc.stderr)[-2000:]}
    log = proc.stdout + proc.stderr
    entry = re.search(r"Function properties for (\w+)\s*\n\s*(\d+) bytes stack frame, (\d+) bytes "
                      r"spill stores, (\d+) bytes spill loads\s*\n.*?Used (\d+) registers"
                      r"(?:, used \d+ barriers)?(?:, (\d+) bytes smem)?",
                      _main_entry(log, v["kernel"]), re.S)
    res = {"regs": int(entry.group(5)), "stack": int(entry.group(2)),
           "spill_st": int(entry.group(3)), "spill_ld": int(entry.group(4)),
           "smem": int(entry.group(6) or 0)}
    dis = (["cuobjdump", "-sass", "-fun", v["kernel"]] if shutil.which("cuobjdump") else
           ["nvdisasm", "-fun", v["kernel"]] if shutil.which("nvdisasm") else None)
    if dis:
        sass = subprocess.run([*dis, str(out)], capture_output=True, text=True).stdout
        ops = re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)", sass)
        res["total"] = len(ops)
        for name in COUNTED:
            res[name] = sum(1 for op in ops if op == name)
    out.unlink(missing_ok=True)
    return res


def _main_entry(log: str, kernel: str) -> str:
    """The ptxas lines of the variant's entry point (a source may hold a second kernel)."""
    start = log.find(f"Function properties for {kernel}")
    return log[start:] if start >= 0 else log


def key_of(v: dict, fields=KEY_FIELDS) -> tuple:
    return tuple(v.get(f, False) for f in fields)  # (a tree before `mods`: none have them)


def label(v: dict, arch: str) -> str:
    return (f"{v['op'].replace('backward_', '')}/{v['dtype'].replace('float', 'f').replace('bf16', 'bf16')}"
            f"/d{v['head_dim']} {v['isa']} {v['warps']}w{v['mt']}m{v['step']}"
            + (f"s{v['stages']}" if v["stages"] else "") + (f"r{v['rows']}" if v["rows"] else "")
            + (" plain" if v["plain"] else "") + (" mods" if v.get("mods") else "")
            + (" unmasked" if v.get("unmasked") else "") + f" sm{arch}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ref", type=Path, help="a tree holding ferrocupy/ (default: --ref-commit)")
    ap.add_argument("--ref-commit", default="40c43ca")
    ap.add_argument("--new", type=Path, default=ROOT)
    ap.add_argument("--head-dims", default="64,128")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--match", default="", help="only variants whose label matches this regex")
    ap.add_argument("--sm80", action="store_true", help="also sm_80 for the non-sm_90a variants")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--mods", action="store_true",
                    help="pair the new tree's variants built with softcap, ALiBi and sinks "
                         "(`mods`) with the reference's of the same geometry without them")
    args = ap.parse_args(argv)

    tmp = Path(tempfile.mkdtemp(prefix="seam-res-"))
    ref = args.ref
    if ref is None:
        ref = tmp / "ref"
        ref.mkdir()
        arc = subprocess.run(["git", "archive", args.ref_commit, "ferrocupy"], cwd=ROOT,
                             capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(ref)], input=arc, check=True)
    dims = {int(d) for d in args.head_dims.split(",")}
    dtypes = set(args.dtypes.split(","))

    trees = {"ref": ref.resolve(), "new": args.new.resolve()}
    fields = tuple(f for f in KEY_FIELDS if f != "mods") if args.mods else KEY_FIELDS
    table = {name: {key_of(v, fields): v for v in variants_of(tree)
                    if not (args.mods and name == "new" and not v.get("mods"))}
             for name, tree in trees.items()}
    keys = [k for k in table["new"] if k in table["ref"]]
    only = {name: sorted(set(table[name]) - set(table["ref" if name == "new" else "new"]))
            for name in trees}
    for name, missing in only.items():
        if missing:
            print(f"variants only in {name}: {len(missing)}", file=sys.stderr)

    cache = json.loads(CACHE.read_text()) if CACHE.exists() else {}
    jobs = []
    for k in keys:
        v_new = table["new"][k]
        if v_new["head_dim"] not in dims or v_new["dtype"] not in dtypes:
            continue
        archs = [v_new["arch"]] if v_new["arch"] else (["90", "80"] if args.sm80 else ["90"])
        for arch in archs:
            if args.match and not re.search(args.match, label(v_new, arch)):
                continue
            for name in trees:
                v = table[name][k]
                src = trees[name] / "ferrocupy" / "cuda" / v["source"]
                ck = hashlib.sha1(json.dumps([expanded(src), sorted(v["defines"].items()), arch,
                                              v["kernel"]]).encode()).hexdigest()
                jobs.append((k, arch, name, v, ck))

    def run(job):
        k, arch, name, v, ck = job
        if ck not in cache:
            cache[ck] = compile_one(trees[name], v, arch, tmp)
        return job, cache[ck]

    results = {}
    with ThreadPoolExecutor(args.jobs) as pool:
        for (k, arch, name, v, ck), res in pool.map(run, jobs):
            results[(k, arch, name)] = res
    CACHE.parent.mkdir(parents=True, exist_ok=True)
    CACHE.write_text(json.dumps(cache))

    cols = ["regs", "spill_st", "smem", "HMMA", "HGMMA", "LDSM", "LDS", "STS", "SHFL", "MUFU",
            "total"]
    print("| variant | " + " | ".join(cols) + " |")
    print("|---|" + "---|" * len(cols))
    worse = 0
    for k in keys:
        for arch in ("90a", "90", "80"):
            r, n = results.get((k, arch, "ref")), results.get((k, arch, "new"))
            if r is None or n is None:
                continue
            if "error" in r or "error" in n:
                print(f"| {label(table['new'][k], arch)} | error: "
                      f"{(r.get('error') or n.get('error'))[:200]!r} |")
                worse += 1
                continue
            cells = []
            for c in cols:
                a, b = r.get(c), n.get(c)
                cells.append(f"{a}" if a == b else f"{a} → **{b}**")
            if n["regs"] > r["regs"] or n["spill_st"] > r["spill_st"]:
                worse += 1
            print(f"| {label(table['new'][k], arch)} | " + " | ".join(cells) + " |")
    print(f"\n{worse} variant(s) with more registers or spills than the reference (or errors)")
    shutil.rmtree(tmp, ignore_errors=True)
    return 1 if worse else 0


if __name__ == "__main__":
    sys.exit(main())
