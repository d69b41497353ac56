"""Why test_half_unaligned_views differs: the unaligned call (no lse) against the aligned one in
several forms (with / without lse, the engine's pick / mma.sync only), on fresh seeds; for each,
the kernels launched and how many output elements differ (and by how many ulps at most).
Run from the repository root with PYTHONPATH=.:tests on a GPU."""
import sys

import numpy as np

sys.path.insert(0, "tests")
from ferrocupy.cuda import launch  # noqa: E402
from ferrocupy.dtypes import BFLOAT16, FLOAT16  # noqa: E402
from gpu_helpers import device_under_test, make_case, restricted_device  # noqa: E402
from half_rule import rounded  # noqa: E402

names = []
real = launch.PackedLaunch.run


def spy(self, *a, **kw):
    names.append(self.fn.name)
    return real(self, *a, **kw)


launch.PackedLaunch.run = spy


def call(d, case, *, unaligned, with_lse):
    put = d.put_unaligned if unaligned else d.put
    q, k, v = (put(getattr(case, n)) for n in ("q", "k", "v"))
    out = d.poisoned(case.q.shape, dtype=case.q.dtype)
    lse = d.poisoned((case.q.shape[0], case.q.shape[2], case.q.shape[1])) if with_lse else None
    names.clear()
    d.engine.flash_attention_v2_with(q, k, v, out, case.opts, lse=lse)
    return d.get(out).astype(np.float32), list(names)


def ulps(a, b, dtype):
    ia, ib = (np.asarray(x, dtype).view(np.int16).astype(np.int32) for x in (a, b))
    return int(np.abs(ia - ib).max())


dev, mma = device_under_test(), restricted_device("mma")
for dtype in (FLOAT16, BFLOAT16):
    for seed in range(4):
        case = rounded(make_case(np.random.default_rng(seed), b=2, sq=65, sk=77, h=4, hkv=2, d=64,
                                 causal=True), dtype)
        base, kn = call(dev, case, unaligned=True, with_lse=False)
        print(f"{np.dtype(dtype).name} seed {seed}: unaligned no-lse {kn}")
        for label, d, wl, un in (("aligned lse auto", dev, True, False),
                                 ("aligned no-lse auto", dev, False, False),
                                 ("aligned lse mma", mma, True, False),
                                 ("aligned no-lse mma", mma, False, False),
                                 ("unaligned lse auto", dev, True, True),
                                 ("unaligned no-lse again", dev, False, True)):
            o, kn = call(d, case, unaligned=un, with_lse=wl)
            diff = o != base
            print(f"   {label:24s} differ {int(diff.sum()):5d} max ulps "
                  f"{ulps(o, base, dtype) if diff.any() else 0:3d}  {kn}")
