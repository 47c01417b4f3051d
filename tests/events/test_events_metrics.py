"""The event path's metrics: `LoopCounter` exposes what prometheus_client's Counter exposes
(without `_created`), and applying a batch counts it in the families users scrape."""

from __future__ import annotations

import time

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from prometheus_client import REGISTRY, CollectorRegistry, Counter, generate_latest

from scorer.blocks import BlockHasher
from scorer.config import IndexConfig
from scorer.events.apply import Applier, LoopCounter
from scorer.events.decode import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from scorer.index import BlockIndex


def _exposition(registry: CollectorRegistry) -> list[str]:
    text = generate_latest(registry).decode()
    return [line for line in text.splitlines() if "_created" not in line]


@settings(derandomize=True, max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["a", "b", "c"]), st.integers(0, 10**6)),
        max_size=30,
    )
)
@example([("a", 0), ("b", 1), ("a", 10**6)])
def test_same_exposition_as_prometheus_client(incs: list[tuple[str, int]]) -> None:
    ref_reg, our_reg = CollectorRegistry(), CollectorRegistry()
    ref = Counter("x_total", "help text", ["kind"], registry=ref_reg)
    ours = LoopCounter("x_total", "help text", ["kind"], registry=our_reg)
    ref.labels("a")  # a child made up front is shown at 0 by both
    ours.labels("a")
    for kind, n in incs:
        ref.labels(kind).inc(n)
        ours.labels(kind).inc(n)
    assert _exposition(our_reg) == _exposition(ref_reg)


def test_name_clash_and_bad_labels_are_refused() -> None:
    reg = CollectorRegistry()
    c = LoopCounter("y_total", "help", ["a"], registry=reg)
    with pytest.raises(ValueError, match="Duplicated"):
        LoopCounter("y", "again", ["a"], registry=reg)
    with pytest.raises(ValueError, match="expected labels"):
        c.labels("one", "two")


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
