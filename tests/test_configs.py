"""The CUDA backend's choices that need no GPU: which calls take the decode kernels and how
their keys are split (ferrocupy/cuda/configs.py)."""

from __future__ import annotations

import numpy as np

from ferrocupy import AttentionDims, AttentionOptions
from ferrocupy.cuda import configs


def test_decode_is_what_the_backend_picks():
    """Which calls take the decode kernels, and their split counts."""
    q = np.zeros((16, 1, 32, 128), np.float32)
    k = np.zeros((16, 32, 8, 128), np.float32)
    p = AttentionDims.new(q, k).params(AttentionOptions())
    assert configs.decode_wanted(p)
    q = np.zeros((16, 5, 32, 128), np.float32)  # 4 heads x 5 rows = 20 > 16
    assert not configs.decode_wanted(AttentionDims.new(q, k).params(AttentionOptions()))
    splits, per = configs.decode_splits(8, 131072, 32, 264)
    assert splits * per >= 131072 and (splits - 1) * per < 131072 and per % 32 == 0
    assert splits * 8 <= 264  # one wave


def test_key_reach_matches_the_kernels_rule():
    q = np.zeros((1, 5, 2, 16), np.float32)
    k = np.zeros((1, 300, 2, 16), np.float32)
    reach = lambda **o: configs.key_reach(AttentionDims.new(q, k).params(AttentionOptions(**o)))  # noqa: E731
    assert reach() == 300
    assert reach(causal=True, causal_offset=100) == 105
    assert reach(window=3, causal_offset=100) == 107
    assert reach(causal=True, causal_offset=1000) == 300


def test_decode_splits_fill_one_wave_and_cover_every_key():
    for pairs, keys, slots in [(128, 32768, 264), (8, 131072, 264), (512, 2048, 264),
                               (1, 100, 264), (3, 5000, 528)]:
        splits, per = configs.decode_splits(pairs, keys, 32, slots)
        assert per % 32 == 0 and splits * per >= keys and (splits - 1) * per < keys
        assert per >= 4 * 32 or splits == 1
