"""`dynamo_cost`: Dynamo's KV-router cost (scorer.policy.cost), as a score (-cost).

Cached prefix from the event-fed index (`source: events`) or from our own decisions
(`source: decisions`, for fleets without KV events: Dynamo's ApproxKvIndexer), load from
the load view, event-stream health from `events`. On commit the winner's uncached blocks
are inserted into the index speculatively (events) or all its blocks remembered for
`ttl_s` (decisions).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Literal

from pydantic import Field

from scorer.policy.approx_index import ApproxIndex
from scorer.policy.cost import CostModelOptions, dynamo_costs
from scorer.policy.parts import IndexLike
from scorer.policy.plugin import Cycle, Scorer, plugin

if TYPE_CHECKING:
    from scorer.policy.base import PolicyContext
    from scorer.pool.workers import Worker


class DynamoCostOptions(CostModelOptions):
    """The cost model's options plus where the cached prefix comes from."""

    source: Literal["events", "decisions"] = "events"
    # Insert the winner's uncached blocks into the index speculatively so a burst of the
    # same prefix hits before the engine's events arrive (source: events).
    speculative: bool = True
    # A stream silent since a request was routed to its worker gets its credit cut only
    # once that request is older than this (its events had time to come).
    stale_events_grace_s: float = Field(1.0, ge=0)
    # source: decisions — how long a routed prefix counts as cached, and the key bound.
    ttl_s: float = Field(120.0, gt=0)
    max_keys: int = Field(1_000_000, ge=1)


@plugin("dynamo_cost")
class DynamoCost(Scorer):
    """-cost: cached prefix (by medium, decayed credit) against prefill and decode load."""

    Options = DynamoCostOptions
    options: DynamoCostOptions
    consumes = frozenset({"tokens", "index", "events", "load"})

    def __init__(
        self, ctx: PolicyContext, options: DynamoCostOptions, clock: Callable[[], float]
    ) -> None:
        super().__init__(ctx, options, clock)
        self._born = time.monotonic()
        # endpoint -> (the stream's last_event_at when we first routed there since it,
        #              the time of that first routing): "served while silent".
        self._routed_since: dict[str, tuple[float | None, float]] = {}
        self.approx: ApproxIndex | None = None
        if options.source == "decisions":
            self.approx = ApproxIndex(options.ttl_s, options.max_keys, clock)

    def index(self) -> IndexLike | None:
        """Where cached prefixes are looked up."""
        return self.approx if self.approx is not None else self.ctx.parts.index

    def prepare(self, cycle: Cycle) -> None:
        cycle.shown_matches = cycle.matches(self.index())

    def score(self, cycle: Cycle) -> list[float]:
        return [-c for c in self.costs(cycle)]

    def costs(self, cycle: Cycle) -> list[float]:
        """The cost of every eligible candidate (scorer.policy.cost.dynamo_costs)."""
        stale: Callable[[Worker], bool] | None = None
        if self.approx is None and self.ctx.parts.events is not None:
            now = cycle.now

            def stale(w: Worker) -> bool:
                return self.stream_stale(w, now)

        costs, rows, stale_any = dynamo_costs(
            cycle.candidates,
            cycle.eligible,
            cycle.load,
            cycle.matches(self.index()),
            cycle.request_blocks,
            self.options,
            stale,
            cycle.duplicate_blocks,
        )
        cycle.cost_rows = rows
        cycle.stale_any = stale_any
        return costs

    def stream_stale(self, w: Worker, now: float) -> bool:
        """True when `w`'s event stream went silent while serving, or has an unrecovered gap."""
        events = self.ctx.parts.events
        if events is None or w.config.events is None:
            return False
        try:
            st = events.status(w.endpoint)
        except LookupError:
            return False
        if st.unrecovered_gap:
            return True
        seen = self._routed_since.get(w.endpoint)
        if seen is None or seen[0] != st.last_event_at:
            return False  # no routing since the last event we know of
        last = st.last_event_at if st.last_event_at is not None else self._born
        return (
            now - last > self.ctx.config.events.stale_after_s
            and now - seen[1] > self.options.stale_events_grace_s
        )

    def commit(self, cycle: Cycle, winner: int) -> None:
        keys = cycle.request.block_keys
        ep = cycle.candidates[winner].endpoint
        if self.approx is not None:
            # All keys, also the matched ones: the winner just used them, refresh their TTL.
            if keys:
                self.approx.insert(ep, keys)
            return
        events = self.ctx.parts.events
        if events is not None:
            try:
                last = events.status(ep).last_event_at
            except LookupError:
                last = None
            seen = self._routed_since.get(ep)
            if seen is None or seen[0] != last:
                self._routed_since[ep] = (last, self.clock())
        if self.options.speculative and keys:
            m = cycle.matches(self.index()).get(ep)
            matched = 0 if m is None else m.blocks
            idx = self.index()
            if idx is not None and len(keys) > matched:
                idx.insert_speculative(ep, keys[matched:])
