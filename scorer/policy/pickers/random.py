"""`random`: uniformly at random among the eligible workers."""

from __future__ import annotations

from scorer.policy.pickers.round_robin import by_load
from scorer.policy.plugin import Cycle, Picker, plugin
from scorer.routing import Reason


@plugin("random")
class RandomPicker(Picker):
    """Ignores the scores."""

    reason = Reason.RANDOM

    def pick(self, cycle: Cycle, costs: list[float]) -> int:
        return self.ctx.rng.choice(range(len(cycle.eligible)))

    def order(self, cycle: Cycle, costs: list[float]) -> list[int]:
        return by_load(cycle, costs)
