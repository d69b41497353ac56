"""Where a kernel's warps wait, from an ncu report: each kernel's duration, SM / memory
throughput, issue rate and the stall reasons (warp cycles per issued instruction, largest
first), read from `ncu --import ... --page raw --csv`. The stall metrics are matched by name
(`issue_stalled`), so the table holds whatever this ncu version reports.

    ncu --set full -k regex:flash_fwd -c 1 -o /tmp/fwd python3 lab/profile_once.py
    python3 lab/ncu_stalls.py /tmp/fwd.ncu-rep [--top 12]
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("reports", nargs="+")
    ap.add_argument("--top", type=int, default=12)
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


if __name__ == "__main__":
    main()
