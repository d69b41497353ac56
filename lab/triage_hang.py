"""Which GPU test hangs: the GPU suite split into work units (a test function's cases, or a
slice of a big one), each run in a pytest process of its own (no xdist), several at a time, the
most suspect first; a test that runs longer than --test-timeout ends its process with every
thread's stack (lab/triage_plugin.py), is reported as HUNG, and the rest of its unit goes on in a
fresh process. Then each HUNG test runs again alone on an idle GPU, twice: a test that hangs
alone is the culprit; one that passes alone was stalled by another's kernel (a hung kernel can
hold the whole GPU, so several tests may time out together). Run from the tree to test:

    python3 lab/triage_hang.py --out /tmp/out/triage [--budget 420] [--parallel 14]
        [--test-timeout 100] [--unit-size 24] [--rope] [FILES...]

Writes <out>/summary.txt (HUNG tests with their stacks' heads, failures, units left unrun) and
per-unit logs beside it; prints the summary. Only the standard library and pytest are used.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import time
from collections import OrderedDict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAB = Path(__file__).resolve().parent

# The GPU suite the hang was seen in; RoPE's files are left out by default (rope.cu is not
# in the change under test) and come last with --rope.
SUITE = ["tests/test_cuda_half.py", "tests/test_cuda_wgmma.py", "tests/test_cuda_backward.py",
         "tests/test_cuda_attention.py", "tests/test_cuda_decode.py", "tests/test_cuda_reach.py",
         "tests/test_layouts.py", "tests/test_cuda_plans.py", "tests/test_cuda_torch.py",
         "tests/test_model_options.py", "tests/test_transformers_backend.py"]
ROPE = ["tests/test_cuda_rope.py", "tests/test_cuda_torch_rope.py"]
# Test functions run first, most suspect first (regular expressions on "file::function"): the
# sm_90a backward built with the mask and dropout, then every half-precision backward, the
# wgmma forward, the merged float32 kernels, decode.
PRIORITY = [r"test_half_backward_mask_and_dropout", r"test_cuda_half.py::.*backward",
            r"test_cuda_half.py::test_half_option_combinations", r"test_cuda_half.py",
            r"test_cuda_wgmma.py", r"test_cuda_backward.py", r"test_cuda_attention.py",
            r"test_cuda_decode.py", r"test_cuda_reach.py"]
# FIRST (environment, comma-separated patterns): run these before PRIORITY's (a stack's new files)
PRIORITY = [p for p in os.environ.get("FIRST", "").split(",") if p] + PRIORITY


def collect(files: list[str]) -> list[str]:
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                          "-p", "no:cacheprovider", *files], cwd=ROOT, capture_output=True,
                         text=True)
    ids = [line.strip() for line in out.stdout.splitlines() if "::" in line]
    if not ids:
        sys.exit(f"collected nothing:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return ids


def function_of(nodeid: str) -> str:
    return nodeid.split("[", 1)[0]


def rank(func: str) -> int:
    for i, pat in enumerate(PRIORITY):
        if re.search(pat, func):
            return i
    return len(PRIORITY)


def make_units(ids: list[str], size: int, breadth: int = 0) -> list[list[str]]:
    """Each test function's cases in slices of at most `size`, the most suspect first (collection
    order within a rank). `breadth` > 0: first a wave of the first `breadth` cases of every
    function (units of one file each), so that a call cut short has touched every test function
    (every kernel path the suite reaches) before it goes deep into any; then the rest."""
    if breadth > 0:
        seen: dict[str, int] = {}
        wide, rest = [], []
        for i in ids:
            n = seen[function_of(i)] = seen.get(function_of(i), 0) + 1
            (wide if n <= breadth else rest).append(i)
        by_file: OrderedDict[str, list[str]] = OrderedDict()
        for i in sorted(wide, key=lambda i: rank(function_of(i))):
            by_file.setdefault(i.split("::")[0], []).append(i)
        first = [cases[k:k + size] for cases in by_file.values()
                 for k in range(0, len(cases), size)]
        return first + (make_units(rest, size) if rest else [])
    groups: OrderedDict[str, list[str]] = OrderedDict()
    for i in ids:
        groups.setdefault(function_of(i), []).append(i)
    order = sorted(groups, key=lambda f: rank(f))  # stable: collection order within a rank
    units: list[list[str]] = []
    for f in order:
        cases = groups[f]
        last = units[-1] if units else None
        if (last and len(last) + len(cases) <= size and rank(function_of(last[0])) == rank(f)
                and last[0].split("::")[0] == f.split("::")[0]):
            last.extend(cases)  # small functions of one file share a process
            continue
        for k in range(0, len(cases), size):
            units.append(cases[k:k + size])
    return units


class Unit:
    def __init__(self, n: int, ids: list[str], work: Path, attempt: int = 0,
                 name: str | None = None):
        self.n, self.ids, self.attempt = n, ids, attempt
        self.name = name or f"u{n:03d}" + (f"r{attempt}" if attempt else "")
        self.select = work / f"{self.name}.ids"
        self.progress = work / f"{self.name}.progress"
        self.stacks = work / f"{self.name}.stacks"
        self.log = work / f"{self.name}.log"
        self.proc = None
        self.start = 0.0

    @property
    def files(self) -> list[str]:
        return sorted({i.split("::", 1)[0] for i in self.ids})

    def launch(self, test_timeout: float) -> None:
        self.select.write_text("\n".join(self.ids) + "\n")
        path = os.pathsep.join([str(LAB), str(ROOT), os.environ.get("PYTHONPATH", "")])
        # One thread a process for NumPy's BLAS and torch: 15 processes each spawning a thread
        # per core held the 16-core host at a load of 100-130 with the GPU idle.
        env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1",
                   MKL_NUM_THREADS="1", FERRO_TRIAGE_SELECT=str(self.select),
                   FERRO_TRIAGE_PROGRESS=str(self.progress), FERRO_TRIAGE_STACKS=str(self.stacks),
                   FERRO_TRIAGE_TEST_TIMEOUT=str(test_timeout), PYTHONUNBUFFERED="1",
                   PYTHONPATH=path)
        cmd = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider",
               "-p", "triage_plugin", "-W", "ignore::RuntimeWarning", *self.files]
        self.start = time.time()
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()

    def outcome(self, durations: dict | None = None) -> tuple[list[str], str | None, dict]:
        """(tests ended, the test started and never ended or None, {id: outcome} of failures);
        each ended test's seconds into `durations`."""
        ended, started, failed = [], None, {}
        t_start = 0.0
        if self.progress.exists():
            for line in self.progress.read_text().splitlines():
                kind, _, rest = line.partition(" ")
                if kind == "START":
                    started, at = rest.rsplit(" ", 1)
                    t_start = float(at)
                elif kind == "END":
                    nid, at = rest.rsplit(" ", 1)
                    ended.append(nid)
                    if durations is not None and nid == started:
                        durations[nid] = float(at) - t_start
                    if nid == started:
                        started = None
                elif kind == "RESULT":
                    nid, when, res = rest.rsplit(" ", 2)
                    if res != "passed" and res != "skipped":
                        failed[nid] = f"{res} in {when}"
        return ended, started, failed


def start_of(unit: Unit, nodeid: str) -> float:
    """When `nodeid` last started in `unit` (epoch seconds; now if never)."""
    at = time.time()
    if unit.progress.exists():
        for line in unit.progress.read_text().splitlines():
            if line.startswith(f"START {nodeid} "):
                at = float(line.rsplit(" ", 1)[1])
    return at


def timed_out(unit: Unit, nodeid: str) -> bool:
    """Whether the per-test limit fired in `nodeid` (else the process died another way)."""
    if not unit.stacks.exists():
        return False
    text = unit.stacks.read_text()
    at = text.rfind(f"==== {nodeid}:")
    return at >= 0 and "Timeout (" in text[at:]


def stack_head(unit: Unit, nodeid: str, lines: int = 16) -> str:
    """The faulthandler dump written for `nodeid` (its first lines: the main thread's stack)."""
    if not unit.stacks.exists():
        return "(no stack file)"
    text = unit.stacks.read_text()
    at = text.rfind(f"==== {nodeid}:")
    if at < 0:
        return "(no stack dumped: killed at the deadline, not by the per-test timeout)"
    part = text[at:].splitlines()[1:]
    if not part:
        return "(no timeout dump: a fatal error's stack is in the unit log)"
    return "\n".join(part[:lines])


def gpu_snapshot() -> str:
    try:
        q = subprocess.run(["nvidia-smi", "--query-gpu=utilization.gpu,memory.used,clocks.sm",
                            "--format=csv,noheader"], capture_output=True, text=True, timeout=10)
        p = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory",
                            "--format=csv,noheader"], capture_output=True, text=True, timeout=10)
        gpu = f"{q.stdout.strip()} | {len(p.stdout.splitlines())} processes"
    except Exception as e:  # noqa: BLE001 - a monitor line, never fatal
        gpu = f"nvidia-smi: {e}"
    # The host's side too: a stall from memory pressure or CPU starvation looks like a hang.
    try:
        avail = next(line.split()[1] for line in open("/proc/meminfo")
                     if line.startswith("MemAvailable"))
        load = open("/proc/loadavg").read().split()[0]
        return f"{gpu} | host: {int(avail) // 1024} MB available, load {load}"
    except Exception as e:  # noqa: BLE001
        return f"{gpu} | host: {e}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("files", nargs="*")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/out") + "/triage")
    ap.add_argument("--budget", type=float, default=420.0,
                    help="seconds for the parallel phase (from this script's start)")
    ap.add_argument("--alone-budget", type=float, default=120.0,
                    help="seconds for rerunning HUNG tests alone")
    ap.add_argument("--parallel", type=int, default=14)
    ap.add_argument("--test-timeout", type=float, default=100.0)
    ap.add_argument("--alone-timeout", type=float, default=50.0)
    ap.add_argument("--unit-size", type=int, default=24)
    ap.add_argument("--breadth", type=int, default=int(os.environ.get("BREADTH", "0")),
                    help="first the first N cases of every test function, then the rest "
                         "(BREADTH in the environment)")
    ap.add_argument("--rope", action="store_true", help="add the RoPE files (last)")
    ap.add_argument("--skip", help="a file of test ids to leave out (an earlier call's "
                    "ended.txt), so a second call runs what the first left unrun")
    args = ap.parse_args(argv)

    t0 = time.time()
    work = Path(args.out)
    work.mkdir(parents=True, exist_ok=True)
    files = args.files or SUITE + (ROPE if args.rope else [])
    ids = collect(files)
    if args.skip and os.path.exists(args.skip):
        skip = set(Path(args.skip).read_text().splitlines())
        ids = [i for i in ids if i not in skip]
    units = [Unit(n, u, work) for n, u in enumerate(make_units(ids, args.unit_size, args.breadth))]
    print(f"[{time.time() - t0:5.0f}s] {len(ids)} tests in {len(units)} units, "
          f"{args.parallel} at a time", flush=True)

    pending = list(units)
    running: list[Unit] = []
    hung: list[tuple[Unit, str, float]] = []  # (unit, test, seconds since the start)
    failed: dict[str, str] = {}
    errors: list[str] = []
    durations: dict[str, float] = {}
    in_flight: list[tuple[str, float]] = []  # (test, seconds it had run) when the phase ended
    done = 0
    cut: list[Unit] = []
    monitor = work / "gpu_monitor.txt"
    last_mon = 0.0
    deadline = t0 + args.budget
    while pending or running:
        now = time.time()
        if now - last_mon > 15:
            last_mon = now
            with open(monitor, "a") as m:
                m.write(f"{now - t0:5.0f}s running={len(running)} done={done} "
                        f"hung={len(hung)} {gpu_snapshot()}\n")
        while pending and len(running) < args.parallel and now < deadline - 20:
            u = pending.pop(0)
            u.launch(args.test_timeout)
            running.append(u)
        for u in list(running):
            rc = u.proc.poll()
            if rc is None and time.time() < deadline:
                continue
            if rc is None:  # the parallel phase is over
                u.kill()
            running.remove(u)
            ended, started, fails = u.outcome(durations)
            failed.update(fails)
            done += len(ended)
            left = [i for i in u.ids if i not in set(ended) and i != started]
            if started is not None and rc is not None:
                hung.append((u, started, time.time() - t0))
                what = "HUNG" if timed_out(u, started) else f"CRASHED (rc {rc}) in"
                print(f"[{time.time() - t0:5.0f}s] {what} {started} ({u.name})", flush=True)
            elif started is not None:
                since = time.time() - start_of(u, started)
                in_flight.append((started, since))
                print(f"[{time.time() - t0:5.0f}s] cut at the deadline in {started} ({u.name}, "
                      f"{since:.0f} s into it)", flush=True)
            if rc is None:
                cut.append(Unit(u.n, left, work, u.attempt + 1))
            if rc is not None and started is None and not ended and rc not in (0, 1, 5):
                errors.append(f"{u.name}: pytest exited {rc} before any test ({u.log.name})")
            elif rc is not None and left and (started is not None or rc not in (0, 1, 5)):
                if u.attempt < 4:  # the rest of the unit, in a fresh process, first in line
                    pending.insert(0, Unit(u.n, left, work, u.attempt + 1))
                else:
                    cut.append(Unit(u.n, left, work, u.attempt + 1))
        if not pending and not running:
            break
        if time.time() >= deadline and not running:
            break
        time.sleep(0.5)
    unrun = cut + pending
    all_ended = []  # every test that ended (passed, failed or skipped), for a later --skip
    for prog in sorted(work.glob("u*.progress")):
        all_ended += [ln[4:].rsplit(" ", 1)[0] for ln in prog.read_text().splitlines()
                      if ln.startswith("END ")]
    (work / "ended.txt").write_text("\n".join(sorted(set(all_ended))) + "\n")
    par_s = time.time() - t0

    # Each HUNG test alone on an otherwise idle GPU (the first four, in the order they hung):
    # once each, then a second time while the time lasts.
    suspects = hung[:4]
    runs: dict[str, list[str]] = {test: [] for _, test, _ in suspects}
    alone_end = time.time() + args.alone_budget
    for attempt in range(2):
        for k, (u, test, _) in enumerate(suspects):
            if time.time() + args.alone_timeout + 5 > alone_end:
                runs[test].append("not run (time)")
                continue
            a = Unit(u.n, [test], work, name=f"alone{k:02d}_{attempt}")
            a.launch(args.alone_timeout)
            try:
                a.proc.wait(timeout=args.alone_timeout + 60)
            except subprocess.TimeoutExpired:
                a.kill()
            ended, started, fails = a.outcome()
            runs[test].append(("HANGS alone" if timed_out(a, test) else
                               f"crashes alone (rc {a.proc.returncode})") if started else
                              ("fails alone: " + fails[test]) if test in fails else
                              ("passes alone" if ended else
                               f"did not start (rc {a.proc.returncode})"))
    verdicts = [(test, runs.get(test, ["not rerun (only the first four are)"]))
                for _, test, _ in hung]

    lines = [f"{len(ids)} tests, {len(units)} units; parallel phase {par_s:.0f} s, "
             f"{done} tests ended, {len(hung)} HUNG or crashed, {len(failed)} failed, "
             f"{sum(len(u.ids) for u in unrun)} left unrun"]
    for (u, test, at), (_, runs) in zip(hung, verdicts):
        what = "HUNG" if timed_out(u, test) else "CRASHED in"
        lines += [f"\n{what} {test}", f"  at {at:.0f} s in {u.name} (log {u.log.name}); alone: "
                  + "; ".join(runs), "  stack (main thread first):"]
        lines += ["    " + s for s in stack_head(u, test).splitlines()]
    if in_flight:
        lines.append("\nIN FLIGHT WHEN THE PARALLEL PHASE ENDED (a long one may be a hang):")
        lines += [f"  {t:6.0f} s  {k}" for k, t in sorted(in_flight, key=lambda kv: -kv[1])]
    if errors:
        lines.append("\nUNITS THAT RAN NO TEST:")
        lines += [f"  {e}" for e in errors]
    if failed:
        lines.append("\nFAILED (see the unit logs):")
        lines += [f"  {k}: {v}" for k, v in sorted(failed.items())]
    if unrun:
        lines.append("\nLEFT UNRUN (deadline):")
        funcs = OrderedDict()
        for u in unrun:
            for i in u.ids:
                funcs[function_of(i)] = funcs.get(function_of(i), 0) + 1
        lines += [f"  {f}: {n}" for f, n in funcs.items()]
    slow = sorted(durations.items(), key=lambda kv: -kv[1])[:12]
    if slow:
        lines.append("\nSLOWEST TESTS THAT ENDED (s; the per-test limit must stay above these):")
        lines += [f"  {t:7.1f}  {k}" for k, t in slow]
    text = "\n".join(lines) + "\n"
    (work / "summary.txt").write_text(text)
    # every ended test's seconds (wall, under the parallel phase's load), by function too: what
    # to make cheaper so the suite fits fewer device calls
    (work / "durations.txt").write_text("".join(
        f"{t:8.2f}  {k}\n" for k, t in sorted(durations.items(), key=lambda kv: -kv[1])))
    per_fn: dict[str, list[float]] = {}
    for k, t in durations.items():
        per_fn.setdefault(function_of(k), []).append(t)
    (work / "durations_by_function.txt").write_text("".join(
        f"{sum(ts):9.1f} s  {len(ts):4d} tests  {f}\n"
        for f, ts in sorted(per_fn.items(), key=lambda kv: -sum(kv[1]))))
    print(text, flush=True)
    return 1 if hung else 0


if __name__ == "__main__":
    sys.exit(main())
