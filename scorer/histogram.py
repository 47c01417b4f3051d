"""Prometheus histograms and counters for values observed on the event loop, cheaply.

`prometheus_client.Histogram.observe` takes a lock per call, walks the buckets in Python
and increments a locked value per bucket hit plus one for the sum: ~1.5 µs per
observation, and a decision observes up to nine (its stages, the matched-token ratio,
the tokenize time) — about a tenth of a `round_robin` decision. `LoopHistogram` appends
each value to its child's `pending` list (~600 instructions with the lookup, against
~2,000 for a `bisect` and two additions per value) and bins them in bulk, every
`FOLD_AT` values and before each scrape (`HistogramChild.fold`: the sum added in
arrival order, one sort, a bisect per bucket bound); it builds the exposition at
scrape time through the registry's custom collector interface. The exposed family is
the same: name, help, label names, `le` buckets, `_count` and `_sum` (it has no
`_created` sample).

`LoopCounter` does the same for a counter: `prometheus_client.Counter.inc` costs ~4,600
instructions (two Python frames and a lock), a `LoopCounter` child's `value += 1` ~100;
the family exposed is a counter's (`_total`, `_created` per label set).

There is no lock: observe and collect must run on one thread. The decision bookkeeping
(scorer.director) and `/metrics` (scorer.api.admin) both run on the event loop.
"""

from __future__ import annotations

import time
from bisect import bisect_right
from collections.abc import Iterator, Sequence
from functools import reduce
from operator import add

from prometheus_client import REGISTRY
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import CollectorRegistry
from prometheus_client.utils import floatToGoString

# Values a child holds unbinned at most (a scrape bins them all first).
FOLD_AT = 256


class HistogramChild:
    """One label set's buckets (le = the upper bounds, +Inf last) and sum.

    `counts` and `sum` cover the values observed up to the last `fold`; `pending` holds
    the later ones (an inlined observe appends there and folds at FOLD_AT)."""

    __slots__ = ("_bounds", "counts", "pending", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self._bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0
        self.pending: list[float] = []

    def observe(self, value: float) -> None:
        """Count one value (in the first bucket whose bound is >= value, as Prometheus)."""
        p = self.pending
        p.append(value)
        if len(p) >= FOLD_AT:
            self.fold()

    def fold(self) -> None:
        """Bin the pending values: the same counts and the same sum (added in arrival
        order, so the same float) as one `bisect_left` and one addition per value."""
        pending = self.pending
        n = len(pending)
        if not n:
            return
        # Taken out in two list operations (each atomic under the GIL): a value appended
        # meanwhile stays pending; the list stays the same object (observers hold it).
        p = pending[:n]
        del pending[:n]
        total = reduce(add, p, self.sum)
        counts = self.counts
        if total != total:  # a NaN (it sorts nowhere): bucket 0, as bisect_left puts it
            nan = [v for v in p if v != v]
            counts[0] += len(nan)
            p = [v for v in p if v == v]
        self.sum = total
        p.sort()
        below = 0
        for i, bound in enumerate(self._bounds):
            k = bisect_right(p, bound)  # values <= bound: buckets 0..i
            counts[i] += k - below
            below = k
        counts[-1] += len(p) - below


class LoopHistogram:
    """A histogram family registered as a collector (see the module docstring)."""

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str] = (),
        buckets: Sequence[float] = (),
        registry: CollectorRegistry | None = REGISTRY,
    ) -> None:
        bounds = tuple(sorted(float(b) for b in buckets if b != float("inf")))
        if not bounds:
            raise ValueError(f"{name}: a histogram needs at least one finite bucket")
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self._bounds = bounds
        # The `le` text prometheus_client writes (its helper is untyped).
        self._les = [floatToGoString(b) for b in bounds] + ["+Inf"]  # type: ignore[no-untyped-call]
        self._children: dict[tuple[str, ...], HistogramChild] = {}
        if not self.labelnames:
            self._children[()] = HistogramChild(bounds)
        if registry is not None:
            registry.register(self)

    def labels(self, *values: str) -> HistogramChild:
        """The child for one label set (created on first use; keep it to skip the lookup)."""
        if len(values) != len(self.labelnames):
            raise ValueError(f"{self.name}: expected labels {self.labelnames}, got {values}")
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = HistogramChild(self._bounds)
        return child

    def observe(self, value: float) -> None:
        """Observe on the unlabelled histogram."""
        self._children[()].observe(value)

    def describe(self) -> Iterator[Metric]:
        """The family without samples (the registry checks names against it)."""
        yield HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)

    def collect(self) -> Iterator[Metric]:
        """The family with cumulative buckets, count and sum per label set."""
        fam = HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)
        les = self._les
        for key, child in list(self._children.items()):
            child.fold()
            acc = 0
            buckets: list[tuple[str, float]] = []
            for le, n in zip(les, child.counts, strict=True):
                acc += n
                buckets.append((le, float(acc)))
            fam.add_metric(list(key), buckets, child.sum)
        yield fam


class CounterChild:
    """One label set's count (add to `value` directly on the hot path)."""

    __slots__ = ("created", "value")

    def __init__(self) -> None:
        self.value = 0.0
        self.created = time.time()

    def inc(self, amount: float = 1.0) -> None:
        """Add `amount` (>= 0, as a Prometheus counter)."""
        if amount < 0:
            raise ValueError("counters can only be incremented by non-negative amounts")
        self.value += amount


class LoopCounter:
    """A labelled counter family registered as a collector (see the module docstring)."""

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str],
        registry: CollectorRegistry | None = REGISTRY,
    ) -> None:
        # prometheus_client's name handling: the family drops `_total`, samples add it back.
        self.name = name[: -len("_total")] if name.endswith("_total") else name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self._children: dict[tuple[str, ...], CounterChild] = {}
        if registry is not None:
            registry.register(self)

    def labels(self, *values: str) -> CounterChild:
        """The child for one label set (created on first use; keep it to skip the lookup)."""
        if len(values) != len(self.labelnames):
            raise ValueError(f"{self.name}: expected labels {self.labelnames}, got {values}")
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = CounterChild()
        return child

    def describe(self) -> Iterator[Metric]:
        """The family without samples (the registry checks names against it)."""
        yield CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)

    def collect(self) -> Iterator[Metric]:
        """The family with `_total` and `_created` per label set."""
        fam = CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for key, child in list(self._children.items()):
            fam.add_metric(list(key), child.value, created=child.created)
        yield fam
