"""`session_affinity`: the worker a session was last sent to scores 1, others 0."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING

from pydantic import Field

from scorer.policy.plugin import Cycle, PluginOptions, Scorer, plugin

if TYPE_CHECKING:
    from scorer.policy.base import PolicyContext


class SessionAffinityOptions(PluginOptions):
    # Request header carrying the session id (RoutingRequest.session_id when set wins).
    header: str = "x-session-affinity"
    idle_ttl_s: float = Field(600.0, gt=0)  # a binding unused this long is forgotten
    max_sessions: int = Field(100_000, ge=1)  # least recently used dropped first


@plugin("session_affinity")
class SessionAffinity(Scorer):
    """Stickiness as a weighted score (the inference extension's session-affinity
    scorer): with a weight above the other scorers' range a session stays put unless a
    filter removed its worker. The `session` policy is the stricter, layered form."""

    Options = SessionAffinityOptions
    options: SessionAffinityOptions
    consumes = frozenset({"headers"})

    def __init__(
        self, ctx: PolicyContext, options: SessionAffinityOptions, clock: Callable[[], float]
    ) -> None:
        super().__init__(ctx, options, clock)
        self._header = options.header.lower()
        self.bindings: OrderedDict[str, tuple[str, float]] = OrderedDict()

    def _session(self, cycle: Cycle) -> str | None:
        r = cycle.request
        return r.session_id or r.headers.get(self._header)

    def score(self, cycle: Cycle) -> list[float]:
        sid = self._session(cycle)
        b = self.bindings.get(sid) if sid else None
        if b is None or cycle.now - b[1] > self.options.idle_ttl_s:
            return [0.0] * len(cycle.eligible)
        cands = cycle.candidates
        return [1.0 if cands[i].endpoint == b[0] else 0.0 for i in cycle.eligible]

    def commit(self, cycle: Cycle, winner: int) -> None:
        sid = self._session(cycle)
        if not sid:
            return
        self.bindings[sid] = (cycle.candidates[winner].endpoint, cycle.now)
        self.bindings.move_to_end(sid)
        while len(self.bindings) > self.options.max_sessions:
            self.bindings.popitem(last=False)
