"""The CUDA backend's choices that need no GPU: which calls take the decode kernels and how
their keys are split (ferrocupy/cuda/configs.py)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from ferrocupy import AttentionDims, AttentionOptions
from ferrocupy.cuda import configs
from ferrocupy.params import extras_params


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


def _reach(seq_q, seq_k, **o):
    q = np.zeros((1, seq_q, 2, 16), np.float32)
    k = np.zeros((1, seq_k, 2, 16), np.float32)
    opts = AttentionOptions(**o)
    return configs.key_reach(AttentionDims.new(q, k).params(opts), extras_params(opts))


def test_key_reach_matches_the_kernels_rule():
    reach = lambda **o: _reach(5, 300, **o)  # noqa: E731
    assert reach() == 300
    assert reach(causal=True, causal_offset=100) == 105
    assert reach(window=3, causal_offset=100) == 107
    assert reach(causal=True, causal_offset=1000) == 300
    assert reach(window_left=0, window_right=2, causal_offset=100) == 107
    assert reach(window_right=2, causal_offset=100) == 107
    assert reach(window_left=2, causal_offset=100) == 300  # the right side unbounded
    assert reach(causal=True, window_right=7, causal_offset=100) == 105  # causal bounds it
    assert reach(causal=True, causal_offset=-3) == 2
    assert reach(causal=True, causal_offset=-10) == 0  # every row dead: nothing is read
    assert reach(window_right=1, causal_offset=-8) == 0


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 8), st.integers(0, 12), st.booleans(), st.integers(-14, 14),
       st.integers(-1, 5), st.integers(-1, 5))
def test_key_reach_is_one_past_the_last_key_any_row_sees(seq_q, seq_k, causal, offset, left,
                                                         right):
    """SPEC's rule by brute force: the last visible key + 1 (0 when none is), no further."""
    seen = [j for j in range(seq_k) for i in range(seq_q)
            if (not causal or j <= i + offset) and (left < 0 or j >= i + offset - left)
            and (right < 0 or j <= i + offset + right)]
    got = _reach(seq_q, seq_k, causal=causal, causal_offset=offset, window_left=left,
                 window_right=right)
    assert max(seen, default=-1) < got <= seq_k
    if right >= 0 or causal:  # a bounded right side: exact (bar keys before the first seen)
        assert got == min(seq_k, max(0, seq_q - 1 + offset + (0 if causal else right) + 1))


def test_decode_splits_fill_one_wave_and_cover_every_key():
    for pairs, keys, slots in [(128, 32768, 264), (8, 131072, 264), (512, 2048, 264),
                               (1, 100, 264), (3, 5000, 528)]:
        splits, per = configs.decode_splits(pairs, keys, 32, slots)
        assert per % 32 == 0 and splits * per >= keys and (splits - 1) * per < keys
        assert per >= 4 * 32 or splits == 1
