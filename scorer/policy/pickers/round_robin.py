"""`round_robin`: each eligible worker in turn."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from scorer.policy.plugin import Cycle, Picker, PluginOptions, plugin
from scorer.routing import Reason

if TYPE_CHECKING:
    from scorer.policy.base import PolicyContext


def by_load(cycle: Cycle, costs: list[float]) -> list[int]:
    """Positions in `cycle.eligible`, fewest in-flight requests then prompt tokens first."""
    cands, elig = cycle.candidates, cycle.eligible

    def key(k: int) -> tuple[int, int]:
        fl = cands[elig[k]].inflight
        return (fl.requests, fl.prefill_tokens)

    return sorted(range(len(elig)), key=key)


@plugin("round_robin")
class RoundRobinPicker(Picker):
    """Ignores the scores. A dry run does not move the turn."""

    reason = Reason.ROUND_ROBIN

    def __init__(
        self, ctx: PolicyContext, options: PluginOptions, clock: Callable[[], float]
    ) -> None:
        super().__init__(ctx, options, clock)
        self._next = 0

    def pick(self, cycle: Cycle, costs: list[float]) -> int:
        return self._next % len(cycle.eligible)

    def order(self, cycle: Cycle, costs: list[float]) -> list[int]:
        return by_load(cycle, costs)

    def commit(self, cycle: Cycle, winner: int) -> None:
        self._next += 1
