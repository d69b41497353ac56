"""RoPE benchmarks: the seed's in-place rotate-half and issue 27's out-of-place forms (full,
partial, interleaved, positions), ferrocupy against plain eager PyTorch; issue 3's 1 GiB float32
floor and issue 27's gate against copy bandwidth are judged by compare.py (see conftest.py)."""

KINDS = ("rope",)


def test_rope(bench, case_id, impl):
    bench(case_id, impl)
