"""A record of the kernel compiles that succeeded, so that a later run skips those whose inputs are
unchanged (tests/test_compile.py's variant cases use it; its machinery tests never do).

A record is an empty-ish file named by the compile's key under ~/.cache/ferrocupy/compiled-ok/
($XDG_CACHE_HOME/ferrocupy/compiled-ok/ where that is set), outside any clone, so a fresh clone or
a fresh virtual environment on the same machine reuses it. The key is a SHA-256 of everything that
decides whether the compile succeeds:

- the compiler: its name and identity (nvcc: `nvcc --version`, build id included; NVRTC: its
  version and the bytes of the libnvrtc libraries CuPy loaded, so a reinstall of the same version
  still matches while any other build does not),
- the source as the compiler sees it: the file with every local `#include "..."` inlined,
  recursively (the loader's `expand_includes`), so editing any header changes the key of every
  source that includes it; system headers come with the compiler,
- every option (architecture, `-D` defines, language standard), bar the `-I` folders and file
  paths, which only say where the same text is found.

Only successes are recorded: a variant that fails to compile is compiled again on every run and
fails every run. FERROCUPY_COMPILE_CACHE=0 turns the cache off (every variant compiled, nothing
read or written); `rm -rf ~/.cache/ferrocupy/compiled-ok` empties it.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import tempfile
from pathlib import Path

CACHE_ENV = "FERROCUPY_COMPILE_CACHE"


def cache_dir(environ=os.environ) -> Path | None:
    """The record folder, or None where FERROCUPY_COMPILE_CACHE=0 turns the cache off."""
    if environ.get(CACHE_ENV, "").strip() == "0":
        return None
    base = environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "ferrocupy" / "compiled-ok"


def compile_key(compiler: str, name: str, source: str, options) -> str:
    """The key of compiling `source` (file name `name`, expanded text) with `options`."""
    kept = [o for o in options if not o.startswith("-I")]
    h = hashlib.sha256()
    for part in (compiler, name, source, *kept):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()


def _file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def nvcc_identity(nvcc: str) -> str:
    """nvcc's version text (release and build)."""
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60)
    return f"nvcc\n{out.stdout}"


def nvrtc_identity(nvrtc) -> str:
    """NVRTC's version and a digest of each libnvrtc library in the folder of the one this
    process loaded (libnvrtc and its builtins); the version alone where /proc/self/maps does not
    say which (not Linux)."""
    parts = [f"nvrtc {nvrtc.getVersion()}"]
    try:
        with open("/proc/self/maps") as maps:
            loaded = {Path(line.split()[-1]) for line in maps
                      if Path(line.split()[-1]).name.startswith("libnvrtc")}
    except OSError:
        loaded = set()
    folders = {p.parent for p in loaded if p.is_file()}
    for lib in sorted(f for d in folders for f in d.glob("libnvrtc*.so*") if f.is_file()):
        parts.append(f"{lib.name} {_file_digest(lib)}")
    return "\n".join(parts)


class CompileCache:
    """Successful compiles by key under `root` (None: no cache, every compile runs)."""

    def __init__(self, root: Path | None):
        self.root = root
        self.hits = self.compiled = 0

    def compile(self, key: str, label: str, compile_fn):
        """`compile_fn()`'s (ok, log), or (True, a note) where `key` compiled before."""
        record = self.root / key if self.root is not None else None
        if record is not None and record.is_file():
            self.hits += 1
            return True, f"{label}: compiled before with identical inputs (record {record}; " \
                         f"{CACHE_ENV}=0 compiles it again)"
        ok, log = compile_fn()
        self.compiled += 1
        if ok and record is not None:
            self.root.mkdir(parents=True, exist_ok=True)
            # written whole, then renamed: a record never exists half-written
            fd, tmp = tempfile.mkstemp(dir=self.root, prefix=".tmp-")
            with os.fdopen(fd, "w") as f:
                f.write(label + "\n")
            os.replace(tmp, record)
        return ok, log
