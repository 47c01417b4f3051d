"""`busy`: drop workers over a load threshold (scraped queue, KV usage, in-flight)."""

from __future__ import annotations

from scorer.policy.cost import BusyOptions, busy_flags
from scorer.policy.plugin import Cycle, Filter, plugin


@plugin("busy")
class BusyFilter(Filter):
    """Workers at or over a threshold are dropped with reason busy_waiting,
    busy_kv_usage or busy_inflight. All busy: a sheddable request gets 429 when
    `shed_when_busy`, otherwise every worker is scored (reason busy_all)."""

    Options = BusyOptions
    options: BusyOptions
    consumes = frozenset({"load"})

    def sheds(self) -> bool:
        return self.options.shed_when_busy

    def filter(self, cycle: Cycle) -> None:
        f = cycle.filtered
        for i, b in enumerate(busy_flags(cycle.candidates, cycle.load, self.options)):
            if b is not None and f[i] is None:
                f[i] = b
