"""Host cost of one call at a decode shape: B1, Sq1, Sk128, H8, D64, float32.

    python3 lab/call_cost.py [--profile]

The table is benchmarks/call_cost.py's (compare.py prints it too); --profile adds where the host
time of the engine and of ferrocupy.torch.attention goes (cProfile, 500 calls each)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import call_cost  # noqa: E402

print(call_cost.format_table(call_cost.measure()))

if "--profile" in sys.argv:
    import cProfile
    import pstats

    for name, fn in call_cost.setup():
        if name not in ("engine, pre-wrapped", "ferrocupy.torch.attention"):
            continue
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(500):
            fn()
        prof.disable()
        print(f"\n== {name} ==")
        pstats.Stats(prof).sort_stats("tottime").print_stats(22)
