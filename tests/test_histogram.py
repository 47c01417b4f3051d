"""scorer.histogram.LoopHistogram / LoopCounter expose what prometheus_client's Histogram /
Counter expose."""

from __future__ import annotations

from bisect import bisect_left

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from scorer.histogram import FOLD_AT, LoopCounter, LoopHistogram
from scorer.native import NATIVE
from scorer.policy.metrics import append_stages

BUCKETS = (5e-6, 1e-5, 2.5e-5, 1e-4, 0.5)


def _exposition(registry: CollectorRegistry) -> list[str]:
    # Our family has no `_created` sample (it is not a documented metric).
    text = generate_latest(registry).decode()
    return [line for line in text.splitlines() if "_created" not in line]


@settings(derandomize=True, max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["parse", "total"]),
            st.one_of(st.sampled_from(BUCKETS), st.floats(0, 2, allow_nan=False)),
        ),
        max_size=40,
    )
)
@example([("parse", 5e-6), ("parse", 0.5), ("total", 0.0), ("total", 3.0)])  # bounds, +Inf
def test_same_exposition_as_prometheus_client(values: list[tuple[str, float]]) -> None:
    ref_reg, our_reg = CollectorRegistry(), CollectorRegistry()
    ref = Histogram("x_seconds", "help text", ["stage"], buckets=BUCKETS, registry=ref_reg)
    ours = LoopHistogram("x_seconds", "help text", ["stage"], BUCKETS, registry=our_reg)
    for stage, v in values:
        ref.labels(stage).observe(v)
        ours.labels(stage).observe(v)
    assert _exposition(our_reg) == _exposition(ref_reg)


def test_unlabelled_histogram_and_sample_values() -> None:
    reg = CollectorRegistry()
    h = LoopHistogram("y_seconds", "help", buckets=(0.1, 1.0), registry=reg)
    assert reg.get_sample_value("y_seconds_count") == 0.0
    for v in (0.05, 0.1, 0.5, 7.0):
        h.observe(v)
    assert reg.get_sample_value("y_seconds_bucket", {"le": "0.1"}) == 2.0
    assert reg.get_sample_value("y_seconds_bucket", {"le": "1.0"}) == 3.0
    assert reg.get_sample_value("y_seconds_bucket", {"le": "+Inf"}) == 4.0
    assert reg.get_sample_value("y_seconds_count") == 4.0
    assert reg.get_sample_value("y_seconds_sum") == 7.65


def test_name_clash_and_bad_labels_are_refused() -> None:
    reg = CollectorRegistry()
    h = LoopHistogram("z", "help", ["a"], (1.0,), registry=reg)
    with pytest.raises(ValueError, match="Duplicated"):
        LoopHistogram("z", "again", ["a"], (1.0,), registry=reg)
    with pytest.raises(ValueError, match="expected labels"):
        h.labels("one", "two")


@settings(derandomize=True, max_examples=40, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["kv", "round_robin"]), st.sampled_from(["load", "kv_hit"])),
        max_size=30,
    )
)
@example([])  # no label set yet: the family alone
@example([("kv", "load"), ("kv", "load"), ("round_robin", "kv_hit")])
def test_counter_same_exposition_as_prometheus_client(incs: list[tuple[str, str]]) -> None:
    ref_reg, our_reg = CollectorRegistry(), CollectorRegistry()
    ref = Counter("d_total", "help text", ["policy", "reason"], registry=ref_reg)
    ours = LoopCounter("d_total", "help text", ["policy", "reason"], registry=our_reg)
    for policy, reason in incs:
        ref.labels(policy, reason).inc()
        child = ours.labels(policy, reason)
        child.value += 1.0  # the hot path's increment
    assert _exposition(our_reg) == _exposition(ref_reg)
    # Both expose a `_created` sample per label set.
    for policy, reason in set(incs):
        labels = {"policy": policy, "reason": reason}
        assert our_reg.get_sample_value("d_created", labels) is not None
        assert our_reg.get_sample_value("d_total", labels) == incs.count((policy, reason))


def test_counter_inc_refuses_negative_and_bad_labels() -> None:
    reg = CollectorRegistry()
    c = LoopCounter("e_total", "help", ["a"], registry=reg)
    c.labels("x").inc(2.5)
    assert reg.get_sample_value("e_total", {"a": "x"}) == 2.5
    with pytest.raises(ValueError, match="non-negative"):
        c.labels("x").inc(-1)
    with pytest.raises(ValueError, match="expected labels"):
        c.labels("x", "y")
    with pytest.raises(ValueError, match="Duplicated"):
        LoopCounter("e_total", "again", ["a"], registry=reg)


@settings(derandomize=True, max_examples=80, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.sampled_from(BUCKETS),
            st.floats(-1, 3, allow_nan=False),
            st.just(float("nan")),
            st.just(float("inf")),
        ),
        max_size=3 * FOLD_AT,
    )
)
@example([1e-5, 1e-5, 0.0, 0.5, 0.6])  # on a bound (its own bucket), above the last
@example([float("nan"), 1e-6, 1.0])  # NaN: bucket 0 (bisect_left), the sum NaN
@example([0.1] * (FOLD_AT + 3))  # folded once while observing, the rest at collect
def test_fold_bins_as_one_bisect_and_one_addition_per_value(values: list[float]) -> None:
    # The reference: what observe did per value before values were folded in bulk.
    counts = [0] * (len(BUCKETS) + 1)
    total = 0.0
    for v in values:
        counts[bisect_left(BUCKETS, v)] += 1
        total += v
    child = LoopHistogram("f", "h", buckets=BUCKETS, registry=None).labels()
    for v in values:
        child.observe(v)
    assert len(child.pending) < FOLD_AT  # bounded between scrapes
    child.fold()
    assert child.pending == []
    assert child.counts == counts
    assert repr(child.sum) == repr(total)  # the same float (added in arrival order)


_STAGE_NAMES = ["parse", "tokenize", "hash", "match", "score", "explain", "total", "policy", "x"]


@settings(derandomize=True, max_examples=80, deadline=None)
@given(
    stages=st.dictionaries(
        st.sampled_from(_STAGE_NAMES), st.floats(allow_nan=True, allow_infinity=True)
    ),
    held=st.dictionaries(st.sampled_from(_STAGE_NAMES), st.integers(0, 6)),
    fold_at=st.integers(1, 8),
)
@example(stages={"parse": 1e-5, "policy": 2e-5}, held={"parse": 3}, fold_at=4)  # reaches it
@example(stages={"total": 1.0}, held={}, fold_at=1)  # no list for the stage: nothing
def test_append_stages_compiled_is_the_reference(
    stages: dict[str, float], held: dict[str, int], fold_at: int
) -> None:
    assert NATIVE is not None  # (tests/index/test_native.py says why when not)

    def pending() -> dict[str, list[float]]:
        return {s: [float(i) for i in range(n)] for s, n in held.items()}

    ref, ours = pending(), pending()
    full = append_stages(stages, ref, fold_at)
    assert NATIVE.append_stages(stages, ours, fold_at) is full
    assert repr(ours) == repr(ref)  # (repr: NaN compares unequal to itself)
    assert full == any(len(ref[s]) >= fold_at for s in stages if s in ref)
