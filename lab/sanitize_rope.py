"""A small run of every RoPE kernel variant for compute-sanitizer (memcheck, racecheck): each
dtype, in place and out of place, full and partial rotary, rotate-half and interleaved, pos and a
positions tensor, 16-byte, 4-byte and one-element rows.

    compute-sanitizer --tool memcheck python3 lab/sanitize_rope.py
"""
import itertools

import cupy
import numpy as np

from ferrocupy import ComputeEngine
from ferrocupy.dtypes import BFLOAT16

eng = ComputeEngine("cuda", quiet=True)
rng = np.random.default_rng(0)
runs = 0
for dtype, (d, pad), partial, interleaved, positions, out_of_place in itertools.product(
        (np.float32, np.float16, BFLOAT16), ((64, 0), (64, 2), (30, 1)), (False, True),
        (False, True), (False, True), (False, True)):
    b, s, h = 2, 5, 3
    host = rng.standard_normal((b, s, h, d + pad)).astype(np.float32).astype(dtype)
    full = cupy.asarray(host.view(np.uint16)).view(dtype) if host.itemsize == 2 else \
        cupy.asarray(host)
    x = full[..., pad:]  # pad shifts the rows' alignment (4-byte or one-element access)
    out = cupy.empty_like(x) if out_of_place else None
    pos = cupy.asarray(rng.integers(0, 1000, (b, s)), dtype=cupy.int64) if positions else None
    eng.rope_theta(x, d, 0, 10000.0, positions=pos, rotary_dim=(d // 2) & ~1 if partial else None,
                   interleaved=interleaved, out=out)
    runs += 1
cupy.cuda.runtime.deviceSynchronize()
print(f"sanitize_rope: {runs} RoPE calls ran")
