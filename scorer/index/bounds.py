"""Memory bounds of the index: a worker's entries past `index.max_blocks_per_worker` are
evicted oldest first, in batches so the scan stays amortised."""

from __future__ import annotations

from prometheus_client import Counter

from scorer.index.slots import Slot

INDEX_EVICTIONS = Counter(
    "kv_scorer_index_evictions_total",
    "Index entries dropped because a worker exceeded index.max_blocks_per_worker",
)


def over_bound(s: Slot, max_blocks: int) -> int:
    """How many of slot `s`'s entries to evict now (0 within the bound). Past the bound a
    batch of 1/64 of it goes at once, so eviction runs once per many inserts."""
    n = len(s.emap)
    return n - max_blocks + max(1, max_blocks // 64) if n > max_blocks else 0


def take_oldest(s: Slot, n: int) -> list[int]:
    """Remove the `n` oldest engine keys of slot `s` (dicts keep insertion order); returns
    their keys in our hash space, for the caller to drop from the media dicts."""
    victims = s.emap.pop_oldest(n)
    s.evictions += len(victims)
    INDEX_EVICTIONS.inc(len(victims))
    return [k for _, k in victims]
