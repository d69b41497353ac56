"""Attention benchmarks: the forward/backward sweep, GQA, decode and issue 3's float32 floor;
ferrocupy against torch SDPA's flash, efficient, cudnn and math backends (see conftest.py)."""

KINDS = ("attn", "decode")


def test_attention(bench, case_id, impl):
    bench(case_id, impl)
