"""`max_score`: the highest total score; ties by load, then at random; or sampling."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Literal

from pydantic import Field

from scorer.policy.cost import pick
from scorer.policy.plugin import Cycle, Picker, PluginOptions, plugin

if TYPE_CHECKING:
    from scorer.policy.base import PolicyContext


class MaxScoreOptions(PluginOptions):
    # Softmax sampling over the normalised scores; 0 = always the best (see cost.pick).
    temperature: float = Field(0.0, ge=0)
    # Among equal scores: "load" = least blocks (prefill + decode), then fewest in-flight
    # requests; "queue" = fewest prompt tokens awaiting prefill, then the smallest scraped
    # queue; "none" = straight to random. Remaining ties: random.
    tiebreak: Literal["load", "queue", "none"] = "load"


@plugin("max_score")
class MaxScore(Picker):
    """The inference extension's max-score picker with Dynamo's tie-break and
    temperature sampling (scorer.policy.cost.pick)."""

    Options = MaxScoreOptions
    options: MaxScoreOptions

    def __init__(
        self, ctx: PolicyContext, options: MaxScoreOptions, clock: Callable[[], float]
    ) -> None:
        super().__init__(ctx, options, clock)
        # Read once (an options model's attribute goes through pydantic's __getattr__).
        self._temperature = options.temperature
        # The tie-break key, a bound method made once (a closure per decision cost a
        # function and a cell per captured name); it reads the cycle being picked for.
        keys = {"load": self._load_key, "queue": self._queue_key, "none": self._no_key}
        self._key: Callable[[int], tuple[float, ...]] = keys[options.tiebreak]
        self._cycle: Cycle | None = None

    def pick(self, cycle: Cycle, costs: list[float]) -> int:
        self._cycle = cycle
        try:
            return pick(costs, self._key, self._temperature, self.ctx.rng)
        finally:
            self._cycle = None  # (a decision's cycle is not kept past it)

    def _load_key(self, k: int) -> tuple[float, ...]:
        c = self._cycle
        assert c is not None
        i = c.eligible[k]
        load = c.load
        return (load.prefill[i] + load.decode[i], c.candidates[i].inflight.requests)

    def _queue_key(self, k: int) -> tuple[float, ...]:
        c = self._cycle
        assert c is not None
        w = c.candidates[c.eligible[k]]
        return (w.inflight.prefill_tokens, w.scraped.waiting)

    def _no_key(self, k: int) -> tuple[float, ...]:
        return ()
