"""Decision metrics: matched-token ratio and decision latency by stage.

Every decision, from the data path or the Score RPC, goes through `Director` bookkeeping, which
calls `observe_decision` once: decisions by policy and reason, matched-token ratio and
stage latencies. The histograms are `scorer.histogram.LoopHistogram`s (observed on the
event loop, ~0.15 µs each instead of prometheus_client's ~1.5 µs; same families), the
counter a `LoopCounter` (~100 instructions an increment instead of ~4,600).
"""

from __future__ import annotations

from collections.abc import Callable

from scorer.histogram import FOLD_AT, CounterChild, HistogramChild, LoopCounter, LoopHistogram
from scorer.native import NATIVE
from scorer.routing import Decision

DECISIONS = LoopCounter(
    "kv_scorer_decisions_total", "Routing decisions by policy and reason", ["policy", "reason"]
)
# Labelled children resolved once (below): labels() costs a lock and a dict lookup per call.
MATCHED_RATIO = LoopHistogram(
    "kv_scorer_matched_token_ratio",
    "Matched (cached) prompt tokens on the chosen worker / prompt tokens, per decision",
    ["policy"],
    buckets=(0.0, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99, 1.0),
)
STAGE_SECONDS = LoopHistogram(
    "kv_scorer_decision_stage_seconds",
    "Decision latency by stage (parse, tokenize, hash, match, score, explain, total)",
    ["stage"],
    buckets=(
        5e-6,
        1e-5,
        2.5e-5,
        5e-5,
        1e-4,
        2.5e-4,
        5e-4,
        1e-3,
        1.5e-3,
        2.5e-3,
        5e-3,
        1e-2,
        2.5e-2,
        0.1,
        0.5,
    ),
)
# Stages reported in the histogram (Decision.stages keys). "policy" (match + score +
# explain + bookkeeping, as the router times it) stays in the decision log only.
STAGES = ("parse", "tokenize", "hash", "match", "score", "explain", "total")
_stage_children = {s: STAGE_SECONDS.labels(s) for s in STAGES}
# Stage -> its child's pending list (a fold clears the list in place: it stays the child's).
_stage_pending = {s: c.pending for s, c in _stage_children.items()}

# Per (policy, reason): its counter child and the policy's ratio child (created on first
# use, as labels() would: a label set appears once it is observed).
_by_key: dict[tuple[str, str], tuple[CounterChild, list[HistogramChild | None]]] = {}
_ratio_children: dict[str, list[HistogramChild | None]] = {}


def _resolve(key: tuple[str, str]) -> tuple[CounterChild, list[HistogramChild | None]]:
    ratio = _ratio_children.get(key[0])
    if ratio is None:
        ratio = _ratio_children[key[0]] = [None]
    got = _by_key[key] = (DECISIONS.labels(key[0], str(key[1])), ratio)
    return got


def observe_decision(d: Decision) -> None:
    """Record one decision: count by policy and reason, matched-token ratio, stages."""
    # A Reason is a StrEnum: it hashes and compares as its value (no str() per decision).
    key = (d.policy, d.reason)
    got = _by_key.get(key)
    if got is None:
        got = _resolve(key)
    got[0].value += 1.0
    # HistogramChild.observe per stage, the loop compiled when built (~1,200
    # instructions a stage in Python).
    if _append_stages(d.stages, _stage_pending, FOLD_AT):
        for child in _stage_children.values():
            if len(child.pending) >= FOLD_AT:
                child.fold()
    if d.endpoints and d.request_tokens > 0:
        slot = got[1]
        ratio = slot[0]
        if ratio is None:
            ratio = slot[0] = MATCHED_RATIO.labels(d.policy)
        r = d.matched_tokens / d.request_tokens
        ratio.observe(1.0 if r > 1.0 else r)  # min(r, 1.0), without the builtin's arg parse


def append_stages(stages: dict[str, float], pending: dict[str, list[float]], fold_at: int) -> bool:
    """Each (stage, seconds) of `stages` whose stage has a list in `pending` appended to
    it; True when one of those lists holds `fold_at` values or more. The reference of the
    compiled `append_stages` (tests/test_histogram.py compares both)."""
    full = False
    for stage, seconds in stages.items():
        p = pending.get(stage)
        if p is not None:
            p.append(seconds)
            if len(p) >= fold_at:
                full = True
    return full


_append_stages: Callable[[dict[str, float], dict[str, list[float]], int], bool] = (
    getattr(NATIVE, "append_stages", None) or append_stages
)
