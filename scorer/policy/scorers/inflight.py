"""`inflight`: fewer requests in flight (the router's own count) is better."""

from __future__ import annotations

from scorer.policy.plugin import Cycle, Scorer, plugin


@plugin("inflight")
class Inflight(Scorer):
    """-(requests this router has in flight on the worker): always current, even
    between scrapes. The `least_loaded` profile is this scorer alone."""

    consumes = frozenset({"load"})

    def score(self, cycle: Cycle) -> list[float]:
        cands = cycle.candidates
        return [-float(cands[i].inflight.requests) for i in cycle.eligible]
