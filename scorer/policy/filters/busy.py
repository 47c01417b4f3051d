"""`busy`: drop workers over a load threshold (scraped queue, KV usage, in-flight)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from scorer.policy.cost import BusyOptions, BusyRule, load_table
from scorer.policy.plugin import Cycle, Filter, plugin

if TYPE_CHECKING:
    from scorer.policy.base import PolicyContext


@plugin("busy")
class BusyFilter(Filter):
    """Workers at or over a threshold are dropped with reason busy_waiting,
    busy_kv_usage or busy_inflight. All busy: a sheddable request gets 429 when
    `shed_when_busy`, otherwise every worker is scored (reason busy_all)."""

    Options = BusyOptions
    options: BusyOptions
    consumes = frozenset({"load"})

    def __init__(
        self, ctx: PolicyContext, options: BusyOptions, clock: Callable[[], float]
    ) -> None:
        super().__init__(ctx, options, clock)
        # The thresholds read once (the profile hands them to the load table's pass).
        self.rule = BusyRule(options)

    def sheds(self) -> bool:
        return self.rule.shed_when_busy

    def filter(self, cycle: Cycle) -> None:
        # The load table applies the busy rule in its one pass when the profile handed it
        # these thresholds (cycle.busy); a second busy filter computes its own.
        if cycle.busy is self.rule:
            flags = cycle.load.busy
        else:
            flags = load_table(
                cycle.candidates,
                cycle.now,
                cycle.stale_after_s,
                cycle.waiting_request_blocks,
                self.rule,
            ).busy
        assert flags is not None
        f = cycle.filtered
        if not any(f):
            cycle.filtered = list(flags)
            return
        for i, b in enumerate(flags):
            if b is not None and f[i] is None:
                f[i] = b
