"""Compiles CUDA C++ sources in this folder with NVRTC through `cupy.RawModule`, once per process
and device, and caches the kernels; CuPy caches the binaries on disk, so a second process starts
fast. Knows nothing of attention: a kernel is (source file, name, compile-time defines)."""

from __future__ import annotations

import re
from pathlib import Path

SOURCE_DIR = Path(__file__).resolve().parent
_INCLUDE = re.compile(r'^\s*#include\s+"([^"]+)"\s*(?://.*)?$', re.M)


def expand_includes(path: Path, seen: set | None = None) -> str:
    """The source with its local `#include "..."` files inlined, so that CuPy's disk cache, which
    hashes the source text, also sees every change to a header."""
    seen = set() if seen is None else seen
    text = path.read_text()

    def inline(m):
        dep = (path.parent / m.group(1)).resolve()
        if dep in seen or not dep.exists():
            return "" if dep in seen else m.group(0)
        seen.add(dep)
        return f"// ---- {m.group(1)} ----\n{expand_includes(dep, seen)}\n"

    return _INCLUDE.sub(inline, text)


class KernelLoader:
    def __init__(self, source_dir: Path = SOURCE_DIR, options: tuple = ("-std=c++17",)):
        self.source_dir = Path(source_dir)
        self.options = tuple(options)
        self._kernels: dict = {}

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
            code = expand_includes(self.source_dir / source)
            kernel = cupy.RawModule(code=code, options=opts).get_function(name)
            self._kernels[key] = kernel
        return kernel
