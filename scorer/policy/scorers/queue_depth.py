"""`queue_depth`: fewer requests waiting in the engine's queue is better."""

from __future__ import annotations

from scorer.policy.plugin import Cycle, Scorer, plugin


@plugin("queue_depth")
class QueueDepth(Scorer):
    """1 / (1 + scraped `vllm:num_requests_waiting`) (fresh scrapes only, else 1)."""

    consumes = frozenset({"load"})

    def score(self, cycle: Cycle) -> list[float]:
        wq = cycle.load.waiting
        return [1.0 / (1.0 + wq[i]) for i in cycle.eligible]
