"""The event path's metrics: applying a batch counts it in the families users scrape
(`scorer.histogram.LoopCounter`, whose exposition tests/test_histogram.py holds to
prometheus_client's)."""

from __future__ import annotations

import time

from prometheus_client import REGISTRY

from scorer.blocks import BlockHasher
from scorer.config import IndexConfig
from scorer.events.apply import Applier
from scorer.events.decode import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from scorer.index import BlockIndex


def test_an_applied_batch_is_counted_in_the_scraped_families() -> None:
    applier = Applier(BlockIndex(IndexConfig()), BlockHasher(16))

    def sample(name: str, labels: dict[str, str] | None = None) -> float:
        return REGISTRY.get_sample_value(name, labels) or 0.0

    stored = {"type": "BlockStored", "outcome": "ok"}
    before = (
        sample("kv_scorer_events_applied_total", stored),
        sample("kv_scorer_event_blocks_total", {"type": "BlockStored"}),
        sample("kv_scorer_events_applied_total", {"type": "BlockRemoved", "outcome": "ok"}),
        sample("kv_scorer_events_applied_total", {"type": "AllBlocksCleared", "outcome": "ok"}),
        sample("kv_scorer_event_lag_seconds_count"),
    )
    events = [
        BlockStored([1, 2], None, list(range(32)), 16),
        BlockRemoved([2]),
        BlockStored([3], 1, list(range(32, 48)), 16),
    ]
    applier.apply("w0", EventBatch(time.time(), list(events), 0))
    applier.apply("w0", EventBatch(time.time(), [AllBlocksCleared()], 0))
    after = (
        sample("kv_scorer_events_applied_total", stored),
        sample("kv_scorer_event_blocks_total", {"type": "BlockStored"}),
        sample("kv_scorer_events_applied_total", {"type": "BlockRemoved", "outcome": "ok"}),
        sample("kv_scorer_events_applied_total", {"type": "AllBlocksCleared", "outcome": "ok"}),
        sample("kv_scorer_event_lag_seconds_count"),
    )
    assert [a - b for a, b in zip(after, before, strict=True)] == [2, 3, 1, 1, 2]
