"""What a routing decision takes in and gives back.

`RoutingRequest` is built by the data path (`scorer.extproc`) or the `scorer.v1` gRPC API;
`Decision` is returned by a policy and carries its own explanation, so every consumer
(headers, `/debug/decisions`, metrics, the `Score` RPC) reports the same facts.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any


class Reason(StrEnum):
    """Why the winner won (or why nobody did). Stable strings: they are metric labels."""

    KV_HIT = "kv_hit"  # the winner holds the most useful cached prefix
    LOAD = "load"  # no useful cache anywhere: the least loaded won
    SESSION = "session"  # an existing session binding was honoured
    SESSION_NEW = "session_new"  # a new session was placed (rendezvous hashing)
    BUSY_ALL = "busy_all"  # every candidate was over a busy threshold: least-bad won
    NO_TOKENIZER = "no_tokenizer"  # no tokenizer for the model: routed by load
    STALE_EVENTS = "stale_events"  # cache credit reduced: a stream is silent or has a gap
    SUBSET_EMPTY = "subset_empty"  # the subset hint matched no eligible worker (503)
    NO_WORKERS = "no_workers"  # no healthy worker serves the model (503)
    NO_BODY = "no_body"  # request without a body (GET /v1/models): routed by load
    ROUND_ROBIN = "round_robin"
    RANDOM = "random"
    SHED = "shed"  # sheddable request refused because every worker is busy (429)
    BAD_REQUEST = "bad_request"  # unparseable body or missing model (400)
    TOO_LARGE = "too_large"  # request body over extproc.max_body_bytes (413)
    TOKENIZE_ERROR = "tokenize_error"  # the prompt could not be rendered: routed by load
    # The prompt is over the tokens stage's CPU budget (tokens.max_prompt_tokens or
    # tokens.max_tokenize_bytes): refused (413) rather than tokenized or hashed.
    PROMPT_TOO_LARGE = "prompt_too_large"


@dataclass(slots=True)
class RoutingRequest:
    """One request as the policies see it. Token and block fields are filled lazily."""

    request_id: str
    # The request's HTTP headers, lower-case names (pseudo-headers included): what a
    # header-driven filter or scorer reads. Empty for the Score RPC and the replay.
    headers: Mapping[str, str] = field(default_factory=dict)
    model: str | None = None
    path: str = "/"
    method: str = "POST"
    body: dict[str, Any] | None = None
    # Subset hint from Envoy: exact "ip:port" entries and IP-only entries. None = no hint.
    subset: frozenset[str] | None = None
    session_id: str | None = None
    lora: str | None = None
    cache_salt: str | None = None
    sheddable: bool = False
    # Filled by the tokens stage (None until then, or when no tokenizer applies); the
    # tokens stage gives an `array("I")` (no per-id list built on the request path).
    token_ids: Sequence[int] | None = None
    block_keys: list[int] | None = None
    block_size: int = 0
    prompt_tokens: int = 0  # exact when tokenized, else an estimate from the body size
    tokenize_error: str | None = None
    # Set by the tokens stage when the prompt is past its budget: the refusal's message.
    over_budget: str | None = None
    body_bytes: int = 0  # size of the request body as received
    # A dry run (Score RPC, /debug/score) decides without changing any state: no
    # speculative inserts, no session binding, no round-robin step, no in-flight entry.
    dry_run: bool = False
    started: float = field(default_factory=time.perf_counter)
    # Seconds spent per stage before the policy ran, keyed like Decision.stages:
    # "parse" (data path), "tokenize" and "hash" (scorer.tokens). The router copies them
    # into the decision and the decision-latency histogram.
    stages: dict[str, float] = field(default_factory=dict)


@dataclass(slots=True)
class CandidateScore:
    """One worker's view in a decision: what it had cached, how loaded it was, its cost."""

    endpoint: str
    matched_blocks: int = 0
    matched_tokens: int = 0
    overlap_by_medium: dict[str, int] = field(default_factory=dict)
    weighted_overlap: float = 0.0
    credit: float = 1.0  # multiplier on cache credit (decay, stale stream penalty)
    inflight: int = 0
    prefill_blocks: float = 0.0
    decode_blocks: float = 0.0
    waiting: float = 0.0
    kv_usage: float = 0.0
    cost: float | None = None
    filtered: str | None = None  # why it was removed before scoring (busy, subset, ...)
    note: str | None = None  # e.g. "stale_events" when its credit was reduced
    # Blocks of the best candidate's cached prefix this one would write a second time
    # (the cost's duplicate_cost term; 0 when that term is off).
    duplicate_blocks: float = 0.0
    # Active prefill blocks beyond the least-queued candidate's (the cost's queue_weight
    # term; 0 when that term is off).
    queue_blocks: float = 0.0
    # Requests before their first token there x this request's first chunk in blocks (the
    # cost's step_share term; 0 when that term is off).
    share_blocks: float = 0.0
    # Blocks of the best cached prefix a request opening a new session would write again
    # here (the cost's shared_copy term; 0 when that term is off or did not apply).
    copy_blocks: float = 0.0
    # The cost's fleet terms (predicted TTFT, block life, previous turn), when the cost
    # computed them: (scorer.policy.cost.CostTable, candidate index), built into a
    # CandidateTerms only when the row is shown.
    terms: Any = None

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready view (used by /debug/decisions and the Score RPC)."""
        return {
            "endpoint": self.endpoint,
            "matched_blocks": self.matched_blocks,
            "matched_tokens": self.matched_tokens,
            "overlap_by_medium": dict(self.overlap_by_medium),
            "weighted_overlap": round(self.weighted_overlap, 3),
            "credit": round(self.credit, 4),
            "inflight": self.inflight,
            "prefill_blocks": round(self.prefill_blocks, 2),
            "decode_blocks": round(self.decode_blocks, 2),
            "waiting": self.waiting,
            "kv_usage": round(self.kv_usage, 4),
            "cost": None if self.cost is None else round(self.cost, 3),
            "filtered": self.filtered,
            "note": self.note,
            "duplicate_blocks": round(self.duplicate_blocks, 2),
            "queue_blocks": round(self.queue_blocks, 2),
            "share_blocks": round(self.share_blocks, 2),
            "copy_blocks": round(self.copy_blocks, 2),
            **self._terms(),
        }

    def _terms(self) -> dict[str, Any]:
        # The cost's fleet terms, under one key, only when the cost computed them.
        t = self.terms
        if t is None:
            return {}
        table, i = t
        return {"terms": table.terms(i).as_dict()}


@dataclass(slots=True)
class Decision:
    """A policy's answer. `endpoints[0]` is primary, the rest are fallbacks.

    An empty `endpoints` means the request is refused with `status` (503 or 429).
    """

    endpoints: list[str]
    reason: Reason
    policy: str
    matched_tokens: int = 0
    request_tokens: int = 0
    status: int = 200
    message: str = ""
    param: str | None = None  # the request field a 400 is about (OpenAI error `param`)
    notes: list[str] = field(default_factory=list)  # secondary reasons (e.g. stale_events)
    stages: dict[str, float] = field(default_factory=dict)  # stage -> seconds
    request_id: str = ""
    model: str | None = None
    at: float = field(default_factory=time.time)
    # The HTTP status the client got, once the response headers said so (None: unknown,
    # e.g. responses not followed; then the decided `status` is what the log shows).
    response_status: int | None = None
    # The explanation rows, or the function that builds them on first read (`candidates`):
    # most decisions are never shown, so a policy may defer building them.
    _rows: list[CandidateScore] | Callable[[], list[CandidateScore]] | None = None

    @property
    def candidates(self) -> list[CandidateScore]:
        """One explanation row per candidate (built on first read when deferred)."""
        rows = self._rows
        if rows is None:
            rows = self._rows = []
        elif callable(rows):
            rows = self._rows = rows()
        return rows

    @candidates.setter
    def candidates(self, rows: list[CandidateScore] | Callable[[], list[CandidateScore]]) -> None:
        """The rows, or a function building them from numbers that no longer change."""
        self._rows = rows

    @property
    def endpoint(self) -> str | None:
        """The primary endpoint, or None when refused."""
        return self.endpoints[0] if self.endpoints else None

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready view for /debug/decisions."""
        return {
            "at": self.at,
            "request_id": self.request_id,
            "model": self.model,
            "policy": self.policy,
            "endpoint": self.endpoint,
            "endpoints": list(self.endpoints),
            "reason": str(self.reason),
            "notes": list(self.notes),
            "status": self.status if self.response_status is None else self.response_status,
            "status_from": "decision" if self.response_status is None else "response",
            "message": self.message,
            "matched_tokens": self.matched_tokens,
            "request_tokens": self.request_tokens,
            "stages_us": {k: round(v * 1e6, 1) for k, v in self.stages.items()},
            "candidates": [c.as_dict() for c in self.candidates],
        }


# Every refusal's HTTP status, by reason: the one table (the director answers with it).
REFUSAL_STATUS: dict[Reason, int] = {
    Reason.BAD_REQUEST: 400,
    Reason.TOO_LARGE: 413,
    Reason.PROMPT_TOO_LARGE: 413,
    Reason.SHED: 429,
    Reason.NO_WORKERS: 503,
    Reason.SUBSET_EMPTY: 503,
}


def refuse(policy: str, reason: Reason, message: str) -> Decision:
    """A decision that routes nowhere; its status comes from REFUSAL_STATUS."""
    return Decision(
        endpoints=[],
        reason=reason,
        policy=policy,
        status=REFUSAL_STATUS[reason],
        message=message,
    )
