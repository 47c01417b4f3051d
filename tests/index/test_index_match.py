"""BlockIndex semantics: contiguous prefixes, media, ranks, speculative TTL, bounds."""

from __future__ import annotations

import pytest

from scorer.blocks import BlockHasher
from scorer.config import IndexConfig
from scorer.index import BlockIndex, Match

KEYS = BlockHasher(16).keys(list(range(16 * 10)))


def ix(**kw: object) -> BlockIndex:
    return BlockIndex(IndexConfig.model_validate(kw))


def test_contiguous_prefix_and_gap_freezes() -> None:
    idx = ix()
    idx.add("a", 0, range(10), KEYS)
    idx.add("b", 0, range(4), KEYS[:4])
    idx.add("c", 0, range(5), KEYS[:2] + KEYS[3:6])  # holds 0,1,3,4,5: gap at 2
    idx.add("d", 0, [0], KEYS[5:6])  # no leading block
    got = idx.match(KEYS)
    assert {k: v.blocks for k, v in got.items()} == {"a": 10, "b": 4, "c": 2}
    assert got["a"] == Match(10, {"GPU": 10}, 10.0)
    assert idx.match(KEYS, endpoints=["b", "zzz"]) == {"b": Match(4, {"GPU": 4}, 4.0)}
    assert idx.match([]) == {} and idx.match(KEYS, endpoints=[]) == {}


def test_remove_and_media_weights() -> None:
    idx = ix(medium_weights={"GPU": 1.0, "CPU": 0.5, "DISK": 0.25})
    idx.add("a", 0, range(4), KEYS[:4])
    idx.add("a", 0, [10, 11, 12], KEYS[4:7], "CPU")
    idx.add("a", 0, [13], KEYS[7:8], "DISK")
    idx.add("a", 0, [1], KEYS[1:2], "CPU")  # also offloaded: counts once, as GPU
    m = idx.match(KEYS)["a"]
    assert m.blocks == 8 and m.by_medium == {"GPU": 4, "CPU": 3, "DISK": 1}
    assert m.weighted == pytest.approx(4 + 1.5 + 0.25)
    assert idx.remove("a", 0, [1], "GPU") == (1, 0)  # still on CPU
    m = idx.match(KEYS)["a"]
    assert m.blocks == 8 and m.by_medium == {"GPU": 3, "CPU": 4, "DISK": 1}
    assert idx.remove("a", 0, [1], "CPU") == (1, 0)
    assert idx.match(KEYS)["a"].blocks == 1
    assert idx.remove("a", 0, [1, 999]) == (0, 2)  # both unknown now
    assert idx.stats("a")["blocks"] == {"GPU": 3, "CPU": 3, "DISK": 1}


def test_ranks_report_the_best_rank() -> None:
    idx = ix()
    idx.add("a", 0, range(2), KEYS[:2])
    idx.add("a", 1, range(5), KEYS[:5])
    assert idx.match(KEYS)["a"].blocks == 5
    idx.clear("a", 1)
    assert idx.match(KEYS)["a"].blocks == 2
    assert idx.stats("a")["ranks"] == [0, 1]


def test_speculative_ttl_and_confirmation() -> None:
    idx = ix(speculative_ttl_s=2.0)
    now = [100.0]
    idx.clock = lambda: now[0]
    idx.insert_speculative("a", KEYS[:6])
    assert idx.match(KEYS)["a"] == Match(6, {"GPU": 6}, 6.0)
    idx.add("a", 0, range(3), KEYS[:3])  # confirms blocks 0-2
    assert idx.stats("a")["speculative"] == 3
    now[0] += 2.5
    assert idx.match(KEYS)["a"].blocks == 3  # the unconfirmed ones expired
    assert idx.stats("a")["speculative"] == 0
    idx.insert_speculative("b", KEYS[:2], ttl_s=1.0)
    now[0] += 0.5
    idx.insert_speculative("b", KEYS[:2], ttl_s=1.0)  # refreshed
    now[0] += 0.7
    assert idx.match(KEYS)["b"].blocks == 2
    now[0] += 0.5
    assert "b" not in idx.match(KEYS)


def test_speculative_ttl_starts_once_each_engine_step_is_prefilled() -> None:
    """Block i lives ttl + wait + block_s x (i + 1), rounded up to its step's end, capped."""
    idx = ix(speculative_ttl_s=2.0)
    now = [100.0]
    idx.clock = lambda: now[0]
    idx.insert_speculative("a", KEYS, wait_s=1.0, block_s=0.5, step_blocks=4)
    # Steps end after blocks 4, 8, 10: expiries 105, 107, 108.
    now[0] = 104.9
    assert idx.match(KEYS)["a"].blocks == 10
    idx.add("a", 0, range(4), KEYS[:4])  # the first step's BlockStored
    now[0] = 106.9
    assert idx.match(KEYS)["a"].blocks == 10
    now[0] = 107.1
    assert idx.match(KEYS)["a"].blocks == 4  # the second step was never confirmed
    assert idx.stats("a")["speculative"] == 2
    now[0] = 108.1
    assert idx.stats("a")["speculative"] == 2  # expired on the next match
    assert idx.match(KEYS)["a"].blocks == 4 and idx.stats("a")["speculative"] == 0
    # Capped at speculative_ttl_max_s; no wait: the plain TTL.
    idx = ix(speculative_ttl_s=2.0, speculative_ttl_max_s=3.0)
    idx.clock = lambda: now[0]
    idx.insert_speculative("a", KEYS, wait_s=1.0, block_s=0.5, step_blocks=4)
    idx.insert_speculative("b", KEYS)
    now[0] += 2.9
    assert {e: m.blocks for e, m in idx.match(KEYS).items()} == {"a": 10}
    now[0] += 0.2
    assert idx.match(KEYS) == {}


def test_speculative_ttl_max_below_ttl_stops_start_up() -> None:
    with pytest.raises(ValueError, match="speculative_ttl_max_s"):
        ix(speculative_ttl_s=5.0, speculative_ttl_max_s=1.0)


def test_memory_bound_evicts_oldest() -> None:
    idx = ix(max_blocks_per_worker=64)
    keys = BlockHasher(1).keys(list(range(200)))
    idx.add("a", 0, range(200), keys)
    st = idx.stats("a")
    assert st["engine_hashes"] <= 64 and st["evictions"] >= 136
    assert st["blocks"]["GPU"] == st["engine_hashes"]
    assert "a" not in idx.match(keys)  # the oldest (leading) blocks went first
    assert idx.lookup_engine("a", 0, 199) == keys[199]


def test_purge_forgets_a_worker_only() -> None:
    idx = ix()
    idx.add("a", 0, range(10), KEYS)
    idx.add("b", 0, range(10), KEYS)
    idx.insert_speculative("a", KEYS)
    idx.purge("a")
    assert set(idx.match(KEYS)) == {"b"}
    assert idx.stats("a")["purges"] == 1 and idx.total_entries() == 10
