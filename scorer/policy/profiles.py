"""The shipped profiles: `policy: kv | approx | least_loaded | round_robin | random`.

Each is a ProfileSpec built from its options model (`policies.NAME`, validated as before,
so existing configs keep working and decide as before: tests/policy/
test_recorded_decisions.py replays recorded decisions). `session` layers over any of
them (scorer.policy.session).

    kv            busy → dynamo_cost (events index) → max_score (tie: load)
    approx        busy → dynamo_cost (decisions)    → max_score (tie: load)
    least_loaded         inflight                   → max_score (tie: queue)
    round_robin                                       round_robin
    random                                            random
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pydantic import Field

from scorer.policy.base import PolicyOptions
from scorer.policy.cost import BusyOptions, CostOptions
from scorer.policy.filters.busy import BusyFilter
from scorer.policy.pickers.max_score import MaxScore, MaxScoreOptions
from scorer.policy.pickers.random import RandomPicker
from scorer.policy.pickers.round_robin import RoundRobinPicker
from scorer.policy.plugin import PluginOptions
from scorer.policy.profile import ProfileSpec
from scorer.policy.scorers.dynamo_cost import DynamoCost, DynamoCostOptions
from scorer.policy.scorers.inflight import Inflight


class KvOptions(CostOptions):
    """`policies.kv`: the cost options plus event-stream health.

    `kv`'s defaults for the fleet terms were set on the replay benchmarks (1,000 blocks
    per worker, every workload; bench/routing/results.md, 2026-11-24 "fleet terms"):
    `approx` keeps the plain cost (its index guesses what is cached; its recorded
    decisions are unchanged).
    """

    credit_decay: float = Field(0.05, ge=0)
    duplicate_cost: float = Field(12.0, ge=0)
    continuity: float = Field(0.6, ge=0, lt=1)
    continuity_own_blocks: bool = True
    session_spread: float = Field(1.0, ge=0)
    infer_conversations: bool = True
    conversation_spread: float = Field(1.0, ge=0)
    continuity_evicted: float = Field(0.3, ge=0, lt=1)
    # Step sharing (scorer.policy.cost, "Step sharing"): on for kv since it enters before
    # continuity and the spreads (docs/policy.md, "Step sharing": e2e prefill p50 -17 ms,
    # TTFT p50 -40 ms, hit rate not lower).
    step_share: float = Field(1.0, ge=0)

    # A stream that has been silent since a request was routed to its worker gets its
    # credit cut only once that request is older than this (its events had time to come).
    stale_events_grace_s: float = Field(1.0, ge=0)


class ApproxOptions(CostOptions):
    """`policies.approx`: the cost options plus the decision-fed index."""

    ttl_s: float = Field(120.0, gt=0)  # how long a routed prefix counts as cached
    max_keys: int = Field(1_000_000, ge=1)  # bound on remembered block keys


class SimpleOptions(PolicyOptions):
    """`policies.least_loaded` / `round_robin` / `random`."""

    fallbacks: int = Field(0, ge=0, le=8)  # extra endpoints for Envoy to retry on


_BUSY = tuple(BusyOptions.model_fields)
_COST = (
    "prefill_load_scale", "medium_credit", "credit_decay", "stale_credit", "duplicate_cost",
    "speculative", "unit", "decode_ms_per_block", "block_life", "life_rate", "life_window_s",
    "life_fade",
    "continuity", "continuity_own_blocks", "continuity_min_match", "session_spread",
    "session_weight",
    "session_live_s", "session_rebalance", "queue_weight", "step_share", "step_budget_tokens",
    "shared_copy",
    "infer_conversations", "conversation_spread", "max_conversations", "continuity_evicted",
)  # fmt: skip


def _cache_spec(o: CostOptions, source: str, extra: dict[str, Any]) -> ProfileSpec:
    busy = BusyOptions(**o.model_dump(include=set(_BUSY)))
    cost = DynamoCostOptions(source=source, **o.model_dump(include=set(_COST)), **extra)  # type: ignore[arg-type]
    return ProfileSpec(
        filters=[(BusyFilter, busy)],
        scorers=[(DynamoCost, cost, 1.0)],
        picker=(MaxScore, MaxScoreOptions(temperature=o.temperature, tiebreak="load")),
        fallbacks=o.fallbacks,
        waiting_request_blocks=o.waiting_request_blocks,
        options=o,
    )


def kv(raw: dict[str, Any]) -> ProfileSpec:
    o = KvOptions.model_validate(raw)
    return _cache_spec(o, "events", {"stale_events_grace_s": o.stale_events_grace_s})


def approx(raw: dict[str, Any]) -> ProfileSpec:
    o = ApproxOptions.model_validate(raw)
    return _cache_spec(o, "decisions", {"ttl_s": o.ttl_s, "max_keys": o.max_keys})


def least_loaded(raw: dict[str, Any]) -> ProfileSpec:
    o = SimpleOptions.model_validate(raw)
    return ProfileSpec(
        scorers=[(Inflight, PluginOptions(), 1.0)],
        picker=(MaxScore, MaxScoreOptions(tiebreak="queue")),
        fallbacks=o.fallbacks,
        options=o,
    )


def round_robin(raw: dict[str, Any]) -> ProfileSpec:
    o = SimpleOptions.model_validate(raw)
    return ProfileSpec(picker=(RoundRobinPicker, PluginOptions()), fallbacks=o.fallbacks, options=o)


def random(raw: dict[str, Any]) -> ProfileSpec:
    o = SimpleOptions.model_validate(raw)
    return ProfileSpec(picker=(RandomPicker, PluginOptions()), fallbacks=o.fallbacks, options=o)


SHIPPED: dict[str, Callable[[dict[str, Any]], ProfileSpec]] = {
    "kv": kv,
    "approx": approx,
    "least_loaded": least_loaded,
    "round_robin": round_robin,
    "random": random,
}
