"""PrefixCache and timing model: hits, misses, pinning, LRU eviction, counters."""

from __future__ import annotations

import pytest

from kvscorer_tools.sim.cache import CacheFullError, PrefixCache
from kvscorer_tools.sim.timing import TimingModel, decode_ms_per_token, prefill_ms


def test_hit_miss_and_counters_in_tokens() -> None:
    c = PrefixCache(capacity_blocks=8, block_size=16)
    assert c.lookup([1, 2, 3], prompt_tokens=50) == 0
    assert c.admit([1, 2, 3], extra_blocks=1) == [1, 2, 3]
    c.release([1, 2, 3], extra_blocks=1)
    assert c.pinned_blocks == 0 and len(c) == 3
    # Second prompt shares the first two blocks only.
    assert c.lookup([1, 2, 9], prompt_tokens=48) == 2
    assert c.queries_tokens == 98
    assert c.hits_tokens == 32
    assert c.admit([1, 2, 9]) == [9]  # only the new block is stored


def test_pinned_blocks_are_never_evicted_and_capacity_is_respected() -> None:
    evicted: list[list[int]] = []
    c = PrefixCache(capacity_blocks=4, block_size=16, on_evict=evicted.append)
    c.admit([1, 2])  # running: pinned
    c.admit([3, 4])
    c.release([3, 4])
    assert not c.can_admit([5, 6, 7])  # 2 pinned + 3 new > 4
    with pytest.raises(CacheFullError):
        c.admit([5, 6, 7])
    assert sorted(c.cached_hashes()) == [1, 2, 3, 4]  # failed admit changed nothing
    assert c.admit([5, 6]) == [5, 6]
    assert evicted == [[4, 3]]  # tail freed first → evicted first
    assert c.is_pinned(1) and c.is_pinned(2)
    assert len(c) == 4 and c.pinned_blocks == 4 and c.free_blocks == 0
    assert c.usage == 1.0


def test_lru_order_and_hit_refreshes() -> None:
    c = PrefixCache(capacity_blocks=3, block_size=4)
    for h in (10, 20, 30):
        c.admit([h])
        c.release([h])
    # Reuse 10: it becomes the most recently freed.
    c.admit([10])
    c.release([10])
    c.admit([40])
    assert c.last_evicted == [20]
    c.admit([50])
    assert c.last_evicted == [30]
    assert set(c.cached_hashes()) == {10, 40, 50}
    assert c.evictions == 2


def test_own_evictable_blocks_are_not_counted_as_room() -> None:
    c = PrefixCache(capacity_blocks=3, block_size=4)
    c.admit([1, 2, 3])
    c.release([1, 2, 3])
    # Reusing 1,2 and adding 2 new needs 4 blocks: impossible, even though 3 are free.
    assert not c.can_admit([1, 2, 8, 9])
    assert c.can_admit([1, 2, 8])
    assert c.admit([1, 2, 8]) == [8]
    assert c.last_evicted == [3]


def test_shared_block_pinned_by_two_requests() -> None:
    c = PrefixCache(capacity_blocks=4, block_size=4)
    c.admit([1, 2])
    c.admit([1, 3])
    c.release([1, 2])
    assert c.is_pinned(1) and not c.is_pinned(2)
    c.release([1, 3])
    assert not c.is_pinned(1)


def test_reset_refused_while_pinned() -> None:
    c = PrefixCache(capacity_blocks=4, block_size=4)
    c.admit([1])
    assert c.reset() is False and 1 in c
    c.release([1])
    assert c.reset() is True and len(c) == 0


def test_timing_model() -> None:
    # Dynamo mocker fit at T=1000: 0.421 + 15.18344 + 16.50142 ms.
    assert prefill_ms(1000) == pytest.approx(4.209989e-07 * 1e6 + 15.18344 + 16.50142)
    assert prefill_ms(0) == 0.0
    assert decode_ms_per_token(1) == pytest.approx(8.25)
    assert decode_ms_per_token(64) > 2.5 * decode_ms_per_token(1)
    fast = TimingModel(speed=100.0)
    assert fast.wall_s(1000.0) == pytest.approx(0.01)
    with pytest.raises(ValueError):
        TimingModel(speed=0)
