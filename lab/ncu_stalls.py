"""Where a kernel's warps wait, from an ncu report: each kernel's duration, SM / memory
throughput, issue rate and the stall reasons (warp cycles per issued instruction, largest
first), read from `ncu --import ... --page raw --csv`. The stall metrics are matched by name
(`issue_stalled`), so the table holds whatever this ncu version reports.

    ncu --set full -k regex:flash_fwd -c 1 -o /tmp/fwd python3 lab/profile_once.py
    python3 lab/ncu_stalls.py /tmp/fwd.ncu-rep [--top 12] [--sass 40]

--sass N adds, per report, the N SASS instructions with the most warp-state samples (ncu's
source page, `--page source --print-source sass --csv`: PC sampling, every warp of the kernel,
loaders and computing warps alike), each with its share of all samples and its top stall
reasons: which wait or which instruction the time goes to, not only why.
"""
from __future__ import annotations

import argparse
import csv
import io
import subprocess

HEADLINE = ("gpu__time_duration.sum", "sm__throughput.avg.pct_of_peak_sustained_elapsed",
            "gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed",
            "smsp__issue_active.avg.pct_of_peak_sustained_active",
            "smsp__inst_executed.sum", "launch__registers_per_thread",
            "sm__warps_active.avg.pct_of_peak_sustained_active")


def rows_of(report: str) -> tuple[list[str], list[str], list[list[str]]]:
    text = subprocess.run(["ncu", "--import", report, "--page", "raw", "--csv"],
                          capture_output=True, text=True, check=True).stdout
    table = list(csv.reader(io.StringIO(text)))
    return table[0], table[1], table[2:]  # names, units, one row a kernel


def as_float(x: str) -> float | None:
    try:
        return float(x.replace(",", ""))
    except ValueError:
        return None


def sass_hot_spots(report: str, top: int) -> None:
    """The `top` SASS instructions by sampled warp states (ncu's source page), per kernel: the
    page is one section a kernel, a "Kernel Name" row, then the header row, then an instruction
    a row."""
    run = subprocess.run(["ncu", "--import", report, "--page", "source", "--print-source",
                          "sass", "--csv"], capture_output=True, text=True)
    if run.returncode != 0:
        print(f"   (no source page: {run.stderr.strip()[:200]})")
        return
    rows = list(csv.reader(io.StringIO(run.stdout)))
    sections, cur = [], None
    for r in rows:
        if r and r[0] == "Kernel Name":
            cur = {"kernel": r[1] if len(r) > 1 else "?", "head": None, "rows": []}
            sections.append(cur)
        elif cur is not None and cur["head"] is None:
            cur["head"] = r
        elif cur is not None and len(r) == len(cur["head"]):
            cur["rows"].append(r)
    if not sections:
        print(f"   (source page not understood; first lines: {rows[:3]})")
    for sec in sections:
        head = sec["head"] or []
        pick = lambda words: next((i for i, h in enumerate(head)  # noqa: E731
                                   if all(w in h for w in words)), None)
        i_all = pick(("Sampling", "All"))
        i_src, i_addr = pick(("Source",)), pick(("Address",))
        if i_all is None or i_src is None:
            print(f"   {sec['kernel']}: no sampling columns in {head[:20]}")
            continue
        reasons = [(i, h) for i, h in enumerate(head)
                   if "stall" in h.lower() and "Sampling" not in h and i != i_all]
        hot = [(as_float(r[i_all]) or 0.0, r) for r in sec["rows"]]
        total = sum(v for v, _ in hot) or 1.0
        hot.sort(key=lambda t: -t[0])
        print(f"   == {sec['kernel']}: SASS hot spots ({len(hot)} instructions, {total:.0f} "
              f"samples; columns {len(head)})")
        for v, r in hot[:top]:
            if not v:
                break
            why = sorted(((as_float(r[i]) or 0.0, h) for i, h in reasons), reverse=True)[:2]
            why_s = ", ".join(f"{h} {x:.0f}" for x, h in why if x)
            addr = r[i_addr] if i_addr is not None else "?"
            print(f"     {100 * v / total:5.1f}%  {addr:>8}  {r[i_src][:60]:<60}  {why_s}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("reports", nargs="+")
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--sass", type=int, default=0, help="the N hottest SASS instructions")
    a = ap.parse_args()
    for report in a.reports:
        names, units, kernels = rows_of(report)
        col = {n: i for i, n in enumerate(names)}
        for row in kernels:
            name = row[col["Kernel Name"]] if "Kernel Name" in col else "?"
            print(f"== {report}: {name}")
            for m in HEADLINE:
                if m in col:
                    print(f"   {m:<66} {row[col[m]]:>14} {units[col[m]]}")
            stalls = []
            for n, i in col.items():
                v = as_float(row[i])
                # one family: cycles a warp stalls per issued instruction, by reason
                if ("issue_stalled" in n and n.endswith("_per_issue_active.ratio")
                        and v is not None):
                    stalls.append((v, n))
            stalls.sort(reverse=True)
            total = sum(v for v, _ in stalls)
            print(f"   stall reasons (warp cycles per issued instruction; sum {total:.2f}):")
            for v, n in stalls[:a.top]:
                reason = n.split("issue_stalled_")[1].split("_per_issue_active")[0]
                print(f"     {reason:<28} {v:8.3f}  {100 * v / total if total else 0:5.1f}%")
        if a.sass:
            sass_hot_spots(report, a.sass)


if __name__ == "__main__":
    main()
