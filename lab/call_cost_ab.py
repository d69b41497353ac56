"""Host cost per call of two trees in one process, interleaved rounds (separate processes on
the device differ by up to 30% in host speed): the decode shape of benchmarks/call_cost.py.

    python3 lab/call_cost_ab.py OLD_TREE    # OLD_TREE/ferrocupy: e.g. `git archive REF | tar -x`

The old tree's package is imported as `ferrocupy_old` (a copy with its torch op namespace
renamed, so both register their ops); this tree's is `ferrocupy`. Each answer is checked first."""
import os
import shutil
import statistics
import sys
import tempfile
import time

old_tree = sys.argv[1]
site = tempfile.mkdtemp()
shutil.copytree(os.path.join(old_tree, "ferrocupy"), os.path.join(site, "ferrocupy_old"))
for root, _, files in os.walk(os.path.join(site, "ferrocupy_old")):
    for f in files:
        if f.endswith(".py"):
            path = os.path.join(root, f)
            with open(path) as fh:
                text = fh.read()
            with open(path, "w") as fh:
                fh.write(text.replace("ferrocupy::", "ferrocupy_old::"))
sys.path.insert(0, site)
import torch  # noqa: E402
import ferrocupy.torch as new_ft  # noqa: E402
import ferrocupy_old.torch as old_ft
from ferrocupy import AttentionOptions as NewOpts, ComputeEngine as NewEng, UnifiedTensor as NewUT
from ferrocupy_old import AttentionOptions as OldOpts, ComputeEngine as OldEng, UnifiedTensor as OldUT
g = torch.Generator(device="cuda").manual_seed(0)
q = torch.randn(1, 1, 8, 64, device="cuda", generator=g)
k = torch.randn(1, 128, 8, 64, device="cuda", generator=g)
v = torch.randn(1, 128, 8, 64, device="cuda", generator=g)
gq, gk, gv = (x.clone().requires_grad_() for x in (q, k, v))
out = torch.empty_like(q)
ne, oe = NewEng("cuda", quiet=True), OldEng("cuda", quiet=True)
nw = [NewUT(x) for x in (q, k, v, out)]; ow = [OldUT(x) for x in (q, k, v, out)]
no, oo = NewOpts(), OldOpts()
calls = {
 "engine, pre-wrapped": (lambda: oe.flash_attention_v2_with(*ow, oo), lambda: ne.flash_attention_v2_with(*nw, no)),
 "engine, torch tensors": (lambda: oe.flash_attention_v2_with(q, k, v, out, oo), lambda: ne.flash_attention_v2_with(q, k, v, out, no)),
 "ferrocupy.torch.attention": (lambda: old_ft.attention(q, k, v), lambda: new_ft.attention(q, k, v)),
 "ferrocupy.torch, grad": (lambda: old_ft.attention(gq, gk, gv), lambda: new_ft.attention(gq, gk, gv)),
}
want = new_ft.attention(q, k, v)
for name, (o, n) in calls.items():
    for f in (o, n):
        out.fill_(float("nan")); r = f(); torch.cuda.synchronize()
        r = out if r is None else r
        assert torch.allclose(r.detach(), want, atol=1e-5), name
def per_call(fn, n=2000):
    torch.cuda.synchronize(); t0 = time.perf_counter()
    for _ in range(n): fn()
    torch.cuda.synchronize(); return (time.perf_counter() - t0) / n * 1e6
print(f"{'call':28s} {'old us':>8s} {'new us':>8s} {'new/old':>8s}   (median of 9 interleaved rounds x 2000 calls)")
for name, (o, n) in calls.items():
    for f in (o, n):
        for _ in range(300): f()
    ts = {"o": [], "n": []}
    for r in range(9):
        for tag, f in (("o", o), ("n", n)) if r % 2 else (("n", n), ("o", o)):
            ts[tag].append(per_call(f))
    mo, mn = statistics.median(ts["o"]), statistics.median(ts["n"])
    print(f"{name:28s} {mo:8.2f} {mn:8.2f} {mn/mo:8.2f}")
# The peer, in the same process: torch's default SDPA on the same shape ([B, H, S, D] views).
F = torch.nn.functional
qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
sdpa = lambda: F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)
for _ in range(300): sdpa()
print(f"{'torch SDPA (default)':28s} {statistics.median(per_call(sdpa) for _ in range(9)):8.2f}")
# FERRO_PROFILE=1: where the torch path's host time goes in each tree (cProfile, 3000 calls each;
# the profiler's own cost inflates small functions, so compare the trees, not absolute figures).
if os.environ.get("FERRO_PROFILE"):
    import cProfile
    import io
    import pstats
    for tag, f in (("old", calls["ferrocupy.torch.attention"][0]),
                   ("new", calls["ferrocupy.torch.attention"][1])):
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(3000):
            f()
        torch.cuda.synchronize()
        prof.disable()
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(28)
        print(f"==== {tag} tree, ferrocupy.torch.attention x 3000, by own time")
        print("\n".join(line for line in s.getvalue().splitlines()[6:] if line.strip()))
