"""Where a decode call's time goes beyond its kernels: the bf16 B1 Sk128k step (compare.py's
shape) timed with CUDA events back to back (as compare.py does), then with the device idle before
each call (synchronized), then back to back again. Prints the medians in us; compare with ncu's
kernel durations (dev/profile_once.py).

    FERRO_DECODE=1,131072 FERRO_DECODE_DESIGN=streams python3 dev/decode_gap.py
"""
import os
import statistics

import cupy as cp

from ferrocupy import ComputeEngine, UnifiedTensor

b, sk = (int(x) for x in os.environ.get("FERRO_DECODE", "1,131072").split(","))
eng = ComputeEngine("cuda", quiet=True)
if os.environ.get("FERRO_DECODE_DESIGN"):
    from ferrocupy.cuda import configs

    eng.backend.table = configs.only(os.environ["FERRO_DECODE_DESIGN"], configs.TILES)
rng = cp.random.default_rng(0)
q, k, v = (UnifiedTensor(rng.standard_normal(s, dtype=cp.float32).astype("bfloat16"))
           for s in ((b, 1, 32, 128), (b, sk, 8, 128), (b, sk, 8, 128)))
out = UnifiedTensor(cp.empty((b, 1, 32, 128), dtype="bfloat16"))
call = lambda: eng.flash_attention_v2_with(q, k, v, out)  # noqa: E731
stream = cp.cuda.get_current_stream()


def timed(fn, sync, n=60):
    ts = []  # (start, end) event pairs
    for _ in range(n):
        if sync:
            stream.synchronize()
        a, z = cp.cuda.Event(), cp.cuda.Event()
        a.record(stream)
        fn()
        z.record(stream)
        ts.append((a, z))
    stream.synchronize()
    return statistics.median(cp.cuda.get_elapsed_time(a, z) * 1e3 for a, z in ts)


for _ in range(5):
    call()
print(f"b{b} sk{sk}: back to back {timed(call, False):.1f} us, idle before each "
      f"{timed(call, True):.1f} us, back to back again {timed(call, False):.1f} us")
