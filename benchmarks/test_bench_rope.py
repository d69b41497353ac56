"""RoPE benchmarks (in place, rotate-half): ferrocupy against plain eager PyTorch, and issue 3's
1 GiB float32 floor against copy bandwidth (see conftest.py)."""

KINDS = ("rope",)


def test_rope(bench, case_id, impl):
    bench(case_id, impl)
