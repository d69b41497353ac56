"""A pytest plugin for lab/triage_hang.py: runs only the tests a work unit names, records each
test's start, outcome and end in a progress file (line-buffered and fsynced, so a process killed
mid-test still says which test it was in), and ends the process after FERRO_TRIAGE_TEST_TIMEOUT
seconds in one test with every thread's Python stack (faulthandler's watchdog is a C thread: it
fires even while the main thread is blocked in a CUDA call on a hung kernel).

    FERRO_TRIAGE_SELECT=ids.txt FERRO_TRIAGE_PROGRESS=progress.txt FERRO_TRIAGE_STACKS=stacks.txt \
    FERRO_TRIAGE_TEST_TIMEOUT=120 PYTHONPATH=lab:. python3 -m pytest -p triage_plugin FILES...

ids.txt: one node id a line (collected with --collect-only -q); every other test is deselected.
Progress lines: `START <id>`, `RESULT <id> <when> <outcome>`, `END <id>`.
"""

from __future__ import annotations

import faulthandler
import os
import time

_progress = None
_stacks = None
_timeout = 0.0


def _log(line: str) -> None:
    if _progress is not None:
        _progress.write(f"{line}\n")
        _progress.flush()
        os.fsync(_progress.fileno())


def pytest_configure(config):
    global _progress, _stacks, _timeout
    path = os.environ.get("FERRO_TRIAGE_PROGRESS")
    if path:
        _progress = open(path, "a", buffering=1)
    stacks = os.environ.get("FERRO_TRIAGE_STACKS")
    if stacks:
        _stacks = open(stacks, "a", buffering=1)
    _timeout = float(os.environ.get("FERRO_TRIAGE_TEST_TIMEOUT") or 0)


def pytest_collection_modifyitems(config, items):
    path = os.environ.get("FERRO_TRIAGE_SELECT")
    if not path:
        return
    with open(path) as f:
        wanted = {line.strip() for line in f if line.strip()}
    keep = [it for it in items if it.nodeid in wanted]
    drop = [it for it in items if it.nodeid not in wanted]
    if drop:
        config.hook.pytest_deselected(items=drop)
    items[:] = keep


def pytest_runtest_logstart(nodeid, location):
    _log(f"START {nodeid} {time.time():.1f}")
    if _timeout > 0:
        out = _stacks if _stacks is not None else None
        if out is not None:
            out.write(f"\n==== {nodeid}: stacks if it passes {_timeout:.0f} s\n")
            out.flush()
            faulthandler.dump_traceback_later(_timeout, exit=True, file=out)
        else:
            faulthandler.dump_traceback_later(_timeout, exit=True)


def pytest_runtest_logreport(report):
    if report.when == "call" or report.outcome != "passed":
        _log(f"RESULT {report.nodeid} {report.when} {report.outcome}")


def pytest_runtest_logfinish(nodeid, location):
    if _timeout > 0:
        faulthandler.cancel_dump_traceback_later()
    _log(f"END {nodeid} {time.time():.1f}")
