"""THE list of scheduling plugins. A new plugin is one file plus one line here.

Profiles name plugins by their `@plugin("name")`; a name not listed here is a
configuration error at start-up.
"""

from __future__ import annotations

from scorer.policy.filters.busy import BusyFilter
from scorer.policy.filters.lora import LoraFilter
from scorer.policy.pickers.max_score import MaxScore
from scorer.policy.pickers.random import RandomPicker
from scorer.policy.pickers.round_robin import RoundRobinPicker
from scorer.policy.plugin import Plugin
from scorer.policy.scorers.dynamo_cost import DynamoCost
from scorer.policy.scorers.inflight import Inflight
from scorer.policy.scorers.kv_overlap import KvOverlap
from scorer.policy.scorers.kv_usage import KvUsage
from scorer.policy.scorers.queue_depth import QueueDepth
from scorer.policy.scorers.session_affinity import SessionAffinity

PLUGINS: tuple[type[Plugin], ...] = (
    # filters
    BusyFilter,
    LoraFilter,
    # scorers
    DynamoCost,
    KvOverlap,
    QueueDepth,
    KvUsage,
    Inflight,
    SessionAffinity,
    # pickers
    MaxScore,
    RoundRobinPicker,
    RandomPicker,
)


def by_kind(kind: str) -> dict[str, type[Plugin]]:
    """The listed plugins of one kind ("filter", "scorer", "picker") by name."""
    return {p.name: p for p in PLUGINS if p.kind == kind}
