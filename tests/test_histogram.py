"""scorer.histogram.LoopHistogram / LoopCounter expose what prometheus_client's Histogram /
Counter expose."""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from scorer.histogram import LoopCounter, LoopHistogram

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
