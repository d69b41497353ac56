"""Turning measured results into the comparison table, its JSON and the plot. Pure Python (the
plot needs matplotlib); everything here works on the results dictionary alone, so a saved JSON
can be re-plotted on any machine."""

from __future__ import annotations

import json
import math

import harness
from harness import DTYPES, FLOOR_ATTN_RATIO, FLOOR_ROPE_PCT, GATE_ROPE_PCT, Case

COLUMNS = [  # header, row key, format
    ("case", "case", "{}"), ("ferro ms", "ferro_ms", "{:.3f}"), ("ferro", "ferro_thr", "{:.1f}"),
    ("unit", "unit", "{}"), ("fastest peer", "peer", "{}"), ("peer ms", "peer_ms", "{:.3f}"),
    ("peer", "peer_thr", "{:.1f}"), ("ratio", "ratio", "{:.2f}x"),
    ("ferro %ceil", "ferro_pct", "{:.0f}%"), ("peer %ceil", "peer_pct", "{:.0f}%"),
    ("note", "note", "{}"),
]
# The peers that get a "vs NAME" column (ferrocupy's throughput over theirs), in this order.
PEER_ORDER = ("torch-sdpa-default", "torch-flash", "torch-cudnn", "torch-efficient",
              "torch-flex", "torch-math", "torch-eager")
DEFAULT_PEER = "torch-sdpa-default"      # issue 25's bar: torch's own choice of SDPA backend


def short(peer: str) -> str:
    return peer[len("torch-"):] if peer.startswith("torch-") else peer


def summarize(case: Case, results: dict, ceilings: dict | None) -> dict:
    """One table row: ferrocupy against the fastest peer that gave a right answer. `ratio` is
    ferrocupy's throughput over that peer's (>= 1: ferrocupy faster); `ratios` holds the same
    against every peer that ran (None where ferrocupy has no number); `%ceil` is throughput over
    the device ceiling (the dtype's matmul rate for TFLOP/s, copy bandwidth for GB/s)."""
    ceilings = ceilings or {}
    ceiling = (ceilings.get("matmul_tflops", {}).get(case.dtype) if case.unit == "TFLOP/s"
               else ceilings.get("copy_gbps"))
    ferro = results.get("ferrocupy", {})
    ok_peers = {n: r for n, r in results.items() if n != "ferrocupy" and r.get("status") == "ok"}
    best = max(ok_peers, key=lambda n: ok_peers[n]["throughput"], default=None)
    row = {"case": case.id, "dtype": case.dtype, "kind": case.kind, "suite": case.suite,
           "direction": case.direction, "unit": case.unit, "floor": case.floor,
           "gate": case.gate, "batch": case.batch, "heads": case.heads,
           "kv_heads": case.kv_heads, "head_dim": case.head_dim, "seq": case.seq_q,
           "causal": case.causal, "window": case.window, "dropout": case.dropout,
           "kv_len": case.kv_len, "plain": case.plain_call.id if case.plain_call else None,
           "ferro_ms": None, "ferro_thr": None, "ferro_pct": None, "peer": best, "peer_ms": None,
           "peer_thr": None, "peer_pct": None, "ratio": None, "ratios": {}, "note": ""}
    if ferro.get("status") == "ok":
        row.update(ferro_ms=ferro["ms"], ferro_thr=ferro["throughput"])
        if ceiling:
            row["ferro_pct"] = 100.0 * ferro["throughput"] / ceiling
    else:
        row["note"] = f"ferrocupy {ferro.get('status', 'not run')}: {ferro.get('reason', '')}"
    for name, p in ok_peers.items():
        row["ratios"][name] = (row["ferro_thr"] / p["throughput"]
                               if row["ferro_thr"] and p["throughput"] else None)
    if best is not None:
        p = ok_peers[best]
        row.update(peer_ms=p["ms"], peer_thr=p["throughput"], ratio=row["ratios"][best])
        if ceiling:
            row["peer_pct"] = 100.0 * p["throughput"] / ceiling
    wrong = [n for n, r in results.items() if r.get("status") == "wrong"]
    if wrong and "ferrocupy" not in wrong:
        row["note"] = "; ".join(filter(None, [row["note"], "wrong answer: " + ", ".join(wrong)]))
    verdict = floor_verdict(case, results, row)
    row["note"] = "; ".join(filter(None, [verdict, row["note"].strip()]))
    return row


def floor_verdict(case: Case, results: dict, row: dict) -> str:
    """Issue 3's floor for this case as 'floor PASS/FAIL (...)', issue 27's RoPE gate as
    'gate PASS/FAIL (...)'; '' for other cases."""
    if not (case.floor or case.gate):
        return ""
    what = "gate" if case.gate else "floor"
    ferro = results.get("ferrocupy", {})
    if ferro.get("status") != "ok":
        return f"{what}: no ferrocupy number"
    if case.kind == "rope":
        pct = row.get("ferro_pct")
        if pct is None:
            return f"{what}: no copy ceiling"
        need = GATE_ROPE_PCT if case.gate else FLOOR_ROPE_PCT
        verdict = "PASS" if pct >= need else "FAIL"
        shown = f"{pct:.1f}" if case.gate else f"{pct:.0f}"  # the gate is judged near 85%
        return f"{what} {verdict} ({shown}% of copy, need {need:.0f}%)"
    eff = results.get("torch-efficient", {})
    if eff.get("status") != "ok":
        return "floor: torch-efficient did not run"
    r = ferro["throughput"] / eff["throughput"]
    verdict = "PASS" if r >= FLOOR_ATTN_RATIO else "FAIL"
    return f"floor {verdict} ({r:.2f}x torch-efficient, need {FLOOR_ATTN_RATIO:.1f}x)"


def header_lines(info: dict) -> list[str]:
    cudnn = info.get("cudnn")
    return [f"ferrocupy benchmarks  {info['date']}  (ferrocupy {info.get('ferrocupy') or '?'})",
            f"GPU {info['gpu']} (sm_{info['compute_capability'].replace('.', '')}, "
            f"{info['sms']} SMs, {info['memory_gib']} GiB, L2 {info['l2_mb']} MB)  "
            f"driver {info['driver']}  CUDA runtime {info['cuda_runtime']}",
            f"CuPy {info['cupy']} (CUPY_TF32={info['cupy_tf32']})  torch "
            f"{info.get('torch') or 'not available'}"
            + (f" (CUDA {info['torch_cuda']}, cuDNN {cudnn}, float32 matmul precision "
               f"{info.get('torch_matmul_precision')})" if info.get("torch") else "")
            + f"  Python {info['python']}"]


def _cell(fmt: str, value) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return fmt.format(value)


def _peer_columns(rows: list[dict]) -> list[str]:
    """The peers that ran (right answer) on at least one of `rows`, in PEER_ORDER."""
    seen = {n for r in rows for n in r.get("ratios", {})}
    return [n for n in PEER_ORDER if n in seen] + sorted(seen - set(PEER_ORDER))


def format_table(rows: list[dict]) -> str:
    """A fixed-width text table of `summarize` rows, floor cases marked with '*': ferrocupy,
    the fastest right peer, then one "vs NAME" column per peer that ran on any row."""
    peers = _peer_columns(rows)
    at = [key for _, key, _ in COLUMNS].index("ratio") + 1
    columns = (COLUMNS[:at] + [(f"vs {short(n)}", ("ratios", n), "{:.2f}x") for n in peers]
               + COLUMNS[at:])
    left = {"case", "unit", "peer", "note"}
    cells = [[h for h, _, _ in columns]]
    for r in rows:
        line = [_cell(fmt, r.get("ratios", {}).get(key[1]) if isinstance(key, tuple)
                      else r.get(key)) for _, key, fmt in columns]
        if r.get("floor"):
            line[0] += " *"
        cells.append(line)
    widths = [max(len(c[i]) for c in cells) for i in range(len(columns))]
    out = []
    for n, line in enumerate(cells):
        text = "  ".join((c.ljust(w) if key in left else c.rjust(w))
                         for (_, key, _), c, w in zip(columns, line, widths))
        out.append(text.rstrip())
        if n == 0:
            out.append("-" * len(out[0]))
    out.append("ferro/peer: TFLOP/s (attention) or GB/s (decode: K+V bytes; RoPE: read + "
               "written); ratio = ferrocupy/fastest peer throughput, vs NAME = ferrocupy/NAME "
               "(>= 1: ferrocupy faster; - where either has no number); "
               "* = issue-3 floor case")
    return "\n".join(out)


def format_tables(rows: list[dict]) -> str:
    """`format_table` per dtype (each with its own peer columns), half precision first-class:
    float32, bfloat16, float16, each under its own heading."""
    order = {d: i for i, d in enumerate(DTYPES)}
    dtypes = sorted({r.get("dtype") for r in rows}, key=lambda d: order.get(d, len(order)))
    if len(dtypes) <= 1:
        return format_table(rows)
    return "\n\n".join(f"== {d} ==\n" + format_table([r for r in rows if r.get("dtype") == d])
                        for d in dtypes)


def geomean(xs: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def ratio_summary(rows: list[dict]) -> list[str]:
    """Per dtype and direction of the attention sweep (grid cases): ferrocupy's throughput over
    each peer's, as a geometric mean with min-max and the number of cases both ran."""
    order = {d: i for i, d in enumerate(DTYPES)}
    grid = [r for r in rows if r.get("kind") == "attn" and r.get("suite") == "grid"]
    groups = sorted({(r["dtype"], r["direction"]) for r in grid},
                    key=lambda g: (order.get(g[0], len(order)), g[1] != "fwd"))
    lines = []
    for dtype, direction in groups:
        rs = [r for r in grid if (r["dtype"], r["direction"]) == (dtype, direction)]
        parts = []
        for peer in _peer_columns(rs):
            xs = [r["ratios"][peer] for r in rs if r["ratios"].get(peer)]
            if xs:
                parts.append(f"vs {short(peer)} {geomean(xs):.2f}x ({min(xs):.2f}-"
                             f"{max(xs):.2f}, {len(xs)})")
        ferro = sum(1 for r in rs if r.get("ferro_thr"))
        what = ", ".join(parts) if parts else "no ratio (no case where ferrocupy and a peer ran)"
        name = "backward (given lse)" if direction == "bwd" else "forward"
        lines.append(f"  {dtype} {name}: {what}  [ferrocupy ran {ferro}/{len(rs)} cases]")
    if lines:
        lines.insert(0, "ferrocupy / peer throughput on the attention sweep, geometric mean "
                        "(min-max, cases both ran):")
    return lines


def floor_lines(rows: list[dict], key: str = "floor") -> list[str]:
    """The verdicts of the floor cases (key "floor") or of the gate cases (key "gate")."""
    return [f"  {r['case']}: {r['note'].split(';')[0]}" for r in rows if r.get(key)]


def _verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def _vs_default(r: dict, need: float, what: str = "") -> str:
    """'CASE: R x sdpa-default, need >= N: PASS/FAIL' (FAIL where either has no number)."""
    x = r.get("ratios", {}).get(DEFAULT_PEER)
    if not x:
        return (f"  {r['case']}: no ratio (ferrocupy or sdpa-default has no number){what}, "
                f"need >= {need:.2f}: FAIL")
    return f"  {r['case']}: {x:.2f}x sdpa-default{what}, need >= {need:.2f}: {_verdict(x >= need)}"


def gate25_lines(rows: list[dict]) -> list[str]:
    """Issue 25's gate on the rows present (harness.GATE25_*): a heading, one PASS/FAIL line
    each, then how many passed. The grid per case and as a geometric mean per dtype and
    direction (INCOMPLETE where a case of the gate's set has no ratio), the training steps, the
    bias (forward; its backward is in the table, not gated), each option case (window, dropout,
    kv_lens, GQA: a row whose "plain" names its plain call) against its plain call. Empty when
    no row is one of the gate's."""
    h = harness
    n_grid = len(h.GATE25_DIMS) * len(h.GATE25_SEQS) * 2
    lines = []
    for dtype in h.GATE25_DTYPES:
        for direction, (each, geo) in (("fwd", h.GATE25_FWD), ("bwd", h.GATE25_BWD)):
            rs = [r for r in rows if r.get("suite") == "grid" and r.get("kind") == "attn"
                  and r["dtype"] == dtype and r["direction"] == direction
                  and r["head_dim"] in h.GATE25_DIMS and r["seq"] in h.GATE25_SEQS]
            if not rs:
                continue
            lines += [_vs_default(r, each) for r in rs]
            xs = [r["ratios"][DEFAULT_PEER] for r in rs if r["ratios"].get(DEFAULT_PEER)]
            name = "backward (given lse)" if direction == "bwd" else "forward"
            mean = f"{geomean(xs):.2f}x" if xs else "-"
            verdict = (_verdict(geomean(xs) >= geo) if len(xs) == n_grid else
                       f"INCOMPLETE ({len(xs)} of the {n_grid} cases have a ratio)")
            lines.append(f"  {dtype} {name} geometric mean: {mean} sdpa-default, "
                         f"need >= {geo:.2f}: {verdict}")
    lines += [_vs_default(r, h.GATE25_TRAIN, " (forward + backward)")
              for r in rows if r.get("suite") == "train"]
    lines += [_vs_default(r, h.GATE25_BIAS, " with the same bias")
              for r in rows if r.get("suite") == "bias" and r.get("direction") == "fwd"]
    lines += [_vs_plain(r, rows, h.GATE25_OPTION, "TFLOP/s", "; visible keys")
              for r in rows if r.get("plain") and r.get("suite") not in h.ISSUE26_SUITES]
    return _gate_block(
        f"issue-25 gate (ferrocupy / torch's default SDPA, same run; forward >= "
        f"{h.GATE25_FWD[0]}x each and >= {h.GATE25_FWD[1]}x geometric mean, backward >= "
        f"{h.GATE25_BWD[0]}x and >= {h.GATE25_BWD[1]}x, training step >= {h.GATE25_TRAIN}x, "
        f"bias >= {h.GATE25_BIAS}x; window, dropout, kv_lens and GQA >= "
        f"{h.GATE25_OPTION}x their plain calls):", lines)


def _gate_block(head: str, lines: list[str]) -> list[str]:
    """`head`, the lines, then how many PASS; empty without lines."""
    if not lines:
        return []
    passed = sum(line.endswith(": PASS") for line in lines)
    return [head] + lines + [f"  {passed} of {len(lines)} lines PASS"]


def _vs_plain(r: dict, rows: list[dict], need: float, what: str, counted: str = "") -> str:
    """'CASE: R x the plain call's WHAT (PLAIN), need >= N: PASS/FAIL': ferrocupy's throughput
    over its own on the plain call (`r["plain"]`); with what "time", the plain call's
    throughput over this one's (the same work: the time ratio), need <= N."""
    plain = next((p for p in rows if p["case"] == r["plain"]), None)
    rel = "<=" if what == "time" else ">="
    if plain is None or not (r.get("ferro_thr") and plain.get("ferro_thr")):
        return (f"  {r['case']}: no ratio (ferrocupy has no number here or on the plain call), "
                f"need {rel} {need:.2f}: FAIL")
    x = r["ferro_thr"] / plain["ferro_thr"]
    if what == "time":
        x = 1 / x
    ok = x <= need if what == "time" else x >= need
    return (f"  {r['case']}: {x:.2f}x the plain call's {what} ({plain['case']}{counted}), "
            f"need {rel} {need:.2f}: {_verdict(ok)}")


def gate26_lines(rows: list[dict]) -> list[str]:
    """Issue 26's gate on the rows present (harness.GATE26_*, the cases of
    harness.issue26_cases): a heading, one PASS/FAIL line each, then how many passed. head_dim
    256 against torch's default SDPA; varlen, paged decode, softcap, ALiBi and sinks against
    their plain calls (ferrocupy's dense call at the mean length, contiguous decode, the call
    without the option). Empty when no row is one of the gate's."""
    h = harness
    lines = [_vs_default(r, h.GATE26_D256) for r in rows if r.get("suite") == "d256"]
    needs = {"varlen": (h.GATE26_VARLEN, "TFLOP/s", "; real work"),
             "paged": (h.GATE26_PAGED, "time", ""), "mods": (h.GATE26_MODS, "TFLOP/s", "")}
    lines += [_vs_plain(r, rows, *needs[r["suite"]]) for r in rows
              if r.get("plain") and r.get("suite") in needs]
    return _gate_block(
        f"issue-26 gate (ferrocupy, same run; head_dim 256 >= {h.GATE26_D256}x torch's "
        f"default SDPA; varlen >= {h.GATE26_VARLEN}x the dense call's TFLOP/s at the mean "
        f"length; paged decode time <= {h.GATE26_PAGED}x contiguous decode's; softcap, "
        f"ALiBi and sinks >= {h.GATE26_MODS}x the plain call's TFLOP/s):", lines)


def write_json(payload: dict, path: str) -> None:
    with open(path, "w") as f:
        json.dump(payload, f, indent=1, default=_jsonable)
        f.write("\n")


def _jsonable(x):
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return str(x)


def _seq_label(s: int) -> str:
    return f"{s // 1024}k" if s >= 1024 and s % 1024 == 0 else str(s)


def plot(payload: dict, path: str) -> bool:
    """Throughput against sequence length, one line per implementation, one panel per
    dtype/head_dim/causal/direction of the attention sweep. False when there is nothing to plot."""
    grid = [c for c in payload.get("cases", []) if c.get("suite") == "grid"]
    if not grid:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    key = lambda c: (c["dtype"], c["direction"], c["head_dim"], c["causal"])  # noqa: E731
    panels = sorted({key(c) for c in grid}, key=lambda k: (k[0], k[1] != "fwd", k[2], k[3]))
    impls = sorted({n for c in grid for n, r in c["results"].items() if r.get("status") == "ok"},
                   key=lambda n: (n != "ferrocupy", n))
    ncols = min(4, len(panels))
    nrows = math.ceil(len(panels) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.2 * ncols, 3.3 * nrows), squeeze=False)
    colors = {n: f"C{i}" for i, n in enumerate(impls)}
    ceilings = payload.get("ceilings", {}).get("matmul_tflops", {})
    for ax, panel in zip(axes.flat, panels):
        cases = sorted((c for c in grid if key(c) == panel), key=lambda c: c["seq_q"])
        for n in impls:
            pts = [(c["seq_q"], c["results"][n]["throughput"]) for c in cases
                   if c["results"].get(n, {}).get("status") == "ok"]
            if pts:
                ax.plot(*zip(*pts), marker="o", color=colors[n], label=n,
                        lw=2.6 if n == "ferrocupy" else 1.4, zorder=3 if n == "ferrocupy" else 2)
        if ceilings.get(panel[0]):
            ax.axhline(ceilings[panel[0]], color="gray", ls=":", lw=1)
        seqs = sorted({c["seq_q"] for c in cases})
        ax.set_xscale("log", base=2)
        ax.set_xticks(seqs, [_seq_label(s) for s in seqs])
        ax.set_ylim(bottom=0)
        ax.set_title(f"{panel[0]} {panel[1]} D{panel[2]} {'causal' if panel[3] else 'non-causal'}",
                     fontsize=10)
        ax.set_xlabel("sequence length")
        ax.set_ylabel("TFLOP/s")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    handles = [plt.Line2D([], [], color=colors[n], marker="o", lw=2.6 if n == "ferrocupy" else 1.4,
                          label=n) for n in impls]
    handles.append(plt.Line2D([], [], color="gray", ls=":", label="matmul ceiling"))
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), frameon=False)
    meta = payload.get("meta", {})
    fig.suptitle(f"ferrocupy vs PyTorch SDPA: {meta.get('gpu', '?')}, {meta.get('date', '?')} "
                 f"(batch*seq = 16384 tokens, hidden 2048)", fontsize=11)
    fig.tight_layout(rect=(0, 0.06, 1, 0.95))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
