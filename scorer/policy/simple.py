"""Policies that ignore the cache: round_robin, random, least_loaded."""

from __future__ import annotations

from collections.abc import Sequence

from scorer.policy.base import Policy, PolicyContext, PolicyOptions, register
from scorer.pool.workers import Worker
from scorer.routing import CandidateScore, Decision, Reason, RoutingRequest


class SimpleOptions(PolicyOptions):
    fallbacks: int = 0  # extra endpoints in the comma list for Envoy to retry on


def load_score(w: Worker) -> CandidateScore:
    """A candidate's load terms (router in-flight view plus the last scrape)."""
    return CandidateScore(
        endpoint=w.endpoint,
        inflight=w.inflight.requests,
        prefill_blocks=w.inflight.prefill_blocks,
        decode_blocks=w.inflight.decode_blocks,
        waiting=w.scraped.waiting,
        kv_usage=w.scraped.kv_usage,
    )


@register
class RoundRobin(Policy):
    """Each eligible worker in turn."""

    name = "round_robin"
    Options = SimpleOptions
    options: SimpleOptions

    def __init__(self, ctx: PolicyContext, options: SimpleOptions) -> None:  # type: ignore[override]
        super().__init__(ctx, options)
        self._next = 0

    def decide(self, request: RoutingRequest, candidates: Sequence[Worker]) -> Decision:
        w = candidates[self._next % len(candidates)]
        if not request.dry_run:
            self._next += 1
        return Decision(
            endpoints=[w.endpoint, *self.fallbacks(w.endpoint, candidates, self.options.fallbacks)],
            reason=Reason.ROUND_ROBIN,
            policy=self.name,
        )


@register
class RandomPolicy(Policy):
    """Uniformly at random."""

    name = "random"
    Options = SimpleOptions
    options: SimpleOptions

    def decide(self, request: RoutingRequest, candidates: Sequence[Worker]) -> Decision:
        w = self.ctx.rng.choice(candidates)
        return Decision(
            endpoints=[w.endpoint, *self.fallbacks(w.endpoint, candidates, self.options.fallbacks)],
            reason=Reason.RANDOM,
            policy=self.name,
        )


def least_loaded(candidates: Sequence[Worker], ctx: PolicyContext) -> Worker:
    """Fewest in-flight requests, then fewest prompt tokens awaiting prefill, then scraped
    waiting queue; ties broken at random so equal workers share the traffic."""

    def key(w: Worker) -> tuple[float, float, float]:
        return (w.inflight.requests, w.inflight.prefill_tokens, w.scraped.waiting)

    best = min(key(w) for w in candidates)
    tied = [w for w in candidates if key(w) == best]
    return tied[0] if len(tied) == 1 else ctx.rng.choice(tied)


@register
class LeastLoaded(Policy):
    """The worker with the least in-flight work by the router's own accounting."""

    name = "least_loaded"
    Options = SimpleOptions
    options: SimpleOptions

    def decide(self, request: RoutingRequest, candidates: Sequence[Worker]) -> Decision:
        w = least_loaded(candidates, self.ctx)
        return Decision(
            endpoints=[w.endpoint, *self.fallbacks(w.endpoint, candidates, self.options.fallbacks)],
            reason=Reason.LOAD,
            policy=self.name,
            candidates=[load_score(c) for c in candidates],
        )
