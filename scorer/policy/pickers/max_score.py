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
        self._tiebreak = options.tiebreak
        self._temperature = options.temperature

    def pick(self, cycle: Cycle, costs: list[float]) -> int:
        elig = cycle.eligible
        cands = cycle.candidates
        tb = self._tiebreak
        if tb == "load":
            load = cycle.load
            pfs, dcs = load.prefill, load.decode

            def key(k: int) -> tuple[float, ...]:
                i = elig[k]
                return (pfs[i] + dcs[i], cands[i].inflight.requests)

        elif tb == "queue":

            def key(k: int) -> tuple[float, ...]:
                w = cands[elig[k]]
                return (w.inflight.prefill_tokens, w.scraped.waiting)

        else:

            def key(k: int) -> tuple[float, ...]:
                return ()

        return pick(costs, key, self._temperature, self.ctx.rng)
