"""The balanced decode grid's bookkeeping without a GPU: configs.py's share_start and share_of
mirror ferro_decode.cuh's DecodeShares, and this walks every block's segments the way
flash_decode_streams does, checking what the kernel relies on: every unit of every pair is
streamed by exactly one block, a pair's blocks know how many they are and which block counts
them, no two shared pairs count in the same counter, and no two (block, pair) write one slot.
Each KV head's batches are cut alike, so one head's walk (batches as the "pairs" here, its
per_head shares as the blocks) is every head's."""

from __future__ import annotations

import random

import pytest

from ferrocupy.cuda import configs


def segments(pairs: int, pair_units: int, blocks: int):
    """(block, pair, first unit, end unit) in the order flash_decode_streams visits them."""
    units = pairs * pair_units
    for i in range(blocks):
        u0, u1 = configs.share_start(units, blocks, i), configs.share_start(units, blocks, i + 1)
        pair = u0 // pair_units
        while u0 < u1 and pair * pair_units < u1:
            t0 = max(u0, pair * pair_units) - pair * pair_units
            t1 = min(u1, (pair + 1) * pair_units) - pair * pair_units
            yield i, pair, t0, t1
            pair += 1


def check(pairs: int, pair_units: int, blocks: int) -> None:
    units = pairs * pair_units
    covered = [0] * units
    by_pair: dict = {}
    for i, pair, t0, t1 in segments(pairs, pair_units, blocks):
        assert t0 < t1, "a segment of no units would count itself without a share"
        for t in range(t0, t1):
            covered[pair * pair_units + t] += 1
        by_pair.setdefault(pair, []).append(i)
    assert covered == [1] * units
    counters, slots = set(), set()
    for pair, members in by_pair.items():
        first = pair * pair_units
        f = configs.share_of(units, blocks, first)
        last = configs.share_of(units, blocks, first + pair_units - 1)
        assert members == list(range(f, last + 1))  # the kernel's contributor count: l - f + 1
        if len(members) == 1:  # whole: t0 == 0 and t1 == pair_units, written directly
            continue
        assert f not in counters
        counters.add(f)
        for i in members:  # the kernel's slot_of
            slot = 2 * i + (0 if configs.share_start(units, blocks, i) >= first else 1)
            assert slot not in slots
            slots.add(slot)
    assert len(by_pair) == pairs and max(counters, default=0) < blocks


@pytest.mark.parametrize("pairs, pair_units, blocks", [
    (8, 8192, 132), (128, 2048, 132), (512, 128, 264), (3, 1, 7), (1, 5, 5), (7, 3, 2),
    (64, 1, 264), (1, 1, 1), (5, 1000, 1000)])
def test_every_unit_once_and_each_shared_pair_counts_in_its_own_counter(pairs, pair_units, blocks):
    check(pairs, pair_units, min(blocks, pairs * pair_units))


def test_random_grids():
    rng = random.Random(1)
    for _ in range(300):
        pairs, pair_units = rng.randint(1, 60), rng.randint(1, 70)
        check(pairs, pair_units, rng.randint(1, pairs * pair_units))


@pytest.mark.parametrize("batch, kv_heads, span, slots", [
    (1, 8, 131072, 264), (64, 8, 2048, 264), (16, 8, 32768, 132), (10**5, 3, 64, 264),
    (2, 1, 300, 132), (1, 2000, 4096, 264), (4, 256, 8192, 2000)])
def test_the_plan_fills_one_wave_within_the_counters(batch, kv_heads, span, slots):
    blocks, pair_units = configs.decode_share(batch, kv_heads, span, 16, 4, slots)
    per_head = blocks // kv_heads
    assert blocks % kv_heads == 0 and pair_units * 16 >= span > (pair_units - 1) * 16
    assert per_head <= batch * pair_units  # no share without a unit
    if per_head > 1:  # shared pairs count in counters f * kv_heads + hk < blocks
        assert blocks <= min(slots, configs.COUNTER_WORDS)
    if batch * pair_units >= 16 * slots:  # a long cache: the wave is filled to a head's worth
        assert blocks > slots - kv_heads
