"""The request pipeline shared by the Envoy data path and the scorer.v1 API.

eligible workers (model, health, subset) → tokens + block keys (only when the policy
needs them, in a thread pool) → policy.decide → bookkeeping (decision log, in-flight).
"""

from __future__ import annotations

import time
from typing import Protocol

from scorer.decisions import DecisionLog
from scorer.policy.base import Policy
from scorer.policy.metrics import observe_decision
from scorer.pool.workers import Pool
from scorer.routing import Decision, Reason, RoutingRequest, refuse


class RequestPreparer(Protocol):
    """Fills `token_ids`, `block_keys`, `block_size` and `prompt_tokens` of a request.

    Implemented by scorer.tokens. Leaves `token_ids` None when the model has no tokenizer
    (the policy then routes by load with reason no_tokenizer) and sets `tokenize_error`
    when the body cannot be rendered.
    """

    async def prepare(self, request: RoutingRequest) -> None: ...


class Router:
    """Turns a RoutingRequest into a Decision and records it."""

    def __init__(
        self,
        pool: Pool,
        policy: Policy,
        decisions: DecisionLog | None = None,
        preparer: RequestPreparer | None = None,
    ) -> None:
        self.pool = pool
        self.policy = policy
        self.decisions = decisions if decisions is not None else DecisionLog()
        self.preparer = preparer

    async def route(self, request: RoutingRequest) -> Decision:
        """Decide where `request` goes; never raises for a routable request."""
        t0 = time.perf_counter()
        candidates = self.pool.eligible(request.model, request.subset)
        if not candidates:
            if request.subset is not None and self.pool.eligible(request.model, None):
                d = refuse(
                    self.policy.name,
                    Reason.SUBSET_EMPTY,
                    503,
                    "no eligible endpoint matches the subset hint",
                )
            else:
                d = refuse(
                    self.policy.name,
                    Reason.NO_WORKERS,
                    503,
                    f"no healthy endpoint serves model {request.model!r}",
                )
        else:
            t_tok = time.perf_counter()
            prepared = False
            if self.policy.needs_tokens and self.preparer is not None and request.body:
                await self.preparer.prepare(request)
                prepared = True
                # The pool can change while the prompt is tokenized (scorer.pool.discovery):
                # never decide for a worker that has left it since.
                candidates = [w for w in candidates if self.pool.workers.get(w.endpoint) is w]
            t_dec = time.perf_counter()
            if candidates:
                d = self.policy.decide(request, candidates)
            else:
                d = refuse(self.policy.name, Reason.NO_WORKERS, 503, "every candidate left")
            t_end = time.perf_counter()
            # Stages measured upstream (parse: data path; tokenize/hash: scorer.tokens).
            for stage, seconds in request.stages.items():
                d.stages.setdefault(stage, seconds)
            if prepared:
                d.stages.setdefault("tokenize", t_dec - t_tok)
            d.stages.setdefault("policy", t_end - t_dec)
        d.request_id = request.request_id
        d.model = request.model
        d.request_tokens = d.request_tokens or request.prompt_tokens
        # total = parse → endpoint: the data path's parse time plus the pipeline above.
        d.stages["total"] = time.perf_counter() - t0 + request.stages.get("parse", 0.0)
        self.record(d)
        return d

    def record(self, d: Decision) -> None:
        """Log and count a decision. Every decision goes through here exactly once,
        including those the data path makes without the policy (400, bodyless)."""
        self.decisions.add(d)
        observe_decision(d)
