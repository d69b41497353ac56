"""Compiles CUDA C++ sources in this folder with NVRTC through `cupy.RawModule`, once per process
and device, and caches the kernels; CuPy caches the binaries on disk, so a second process starts
fast. Knows nothing of attention: a kernel is (source file, name, compile-time defines).

An overlay directory (the `overlay` argument, or the environment variable named by
OVERLAY_ENV) is searched before this folder for every source and `#include "..."` header: a
tuning script builds a modified copy of one kernel or header from there, the package unchanged."""

from __future__ import annotations

import os
import re
from pathlib import Path

SOURCE_DIR = Path(__file__).resolve().parent
OVERLAY_ENV = "FERROCUPY_KERNEL_OVERLAY"
_INCLUDE = re.compile(r'^\s*#include\s+"([^"]+)"\s*(?://.*)?$', re.M)


def expand_includes(path: Path, seen: set | None = None, overlay: Path | None = None) -> str:
    """The source with its local `#include "..."` files inlined, so that CuPy's disk cache, which
    hashes the source text, also sees every change to a header. Each file is read from `overlay`
    where that holds one of the same name (relative to the source's folder), else from beside the
    source."""
    seen = set() if seen is None else seen
    text = _pick(Path(path), overlay).read_text()

    def inline(m):
        dep = (Path(path).parent / m.group(1)).resolve()
        if dep in seen or not _pick(dep, overlay).exists():
            return "" if dep in seen else m.group(0)
        seen.add(dep)
        return f"// ---- {m.group(1)} ----\n{expand_includes(dep, seen, overlay)}\n"

    return _INCLUDE.sub(inline, text)


def _pick(path: Path, overlay: Path | None) -> Path:
    """`overlay`'s file of `path`'s name where there is one, else `path`."""
    if overlay is not None and (Path(overlay) / path.name).is_file():
        return Path(overlay) / path.name
    return path


class KernelLoader:
    def __init__(self, source_dir: Path = SOURCE_DIR, options: tuple = ("-std=c++17",),
                 overlay: Path | str | None = None):
        """`overlay`: a directory searched first for every source and header (default: the
        OVERLAY_ENV environment variable's, if set)."""
        self.source_dir = Path(source_dir)
        self.options = tuple(options)
        if overlay is None:
            overlay = os.environ.get(OVERLAY_ENV) or None
        self.overlay = None if overlay is None else Path(overlay)
        if self.overlay is not None and not self.overlay.is_dir():
            raise ValueError(f"kernel overlay {str(self.overlay)!r} is not a directory")
        self._kernels: dict = {}

    def source(self, source: str) -> str:
        """The text NVRTC compiles for `source`: includes inlined, overlay files first."""
        return expand_includes(self.source_dir / source, overlay=self.overlay)

    def function(self, source: str, name: str, defines: dict | None = None, options: tuple = ()):
        """The compiled `cupy.RawKernel` `name` of `source` with `-Dkey=value` for each define,
        plus `options` (e.g. `-arch=sm_90a` for a variant built for one architecture)."""
        import cupy

        device = cupy.cuda.Device().id
        key = (device, source, name, tuple(sorted((defines or {}).items())), tuple(options))
        kernel = self._kernels.get(key)
        if kernel is None:
            opts = self.options + tuple(options) + tuple(
                f"-D{k}={v}" for k, v in sorted((defines or {}).items()))
            kernel = cupy.RawModule(code=self.source(source), options=opts).get_function(name)
            self._kernels[key] = kernel
        return kernel
