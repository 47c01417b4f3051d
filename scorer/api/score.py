"""The scorer.v1 `Scorer` gRPC service: ranked endpoints with the decision's explanation."""

from __future__ import annotations

import itertools
import json
from typing import Any

import grpc

from scorer.api.v1 import scorer_pb2, scorer_pb2_grpc
from scorer.blocks import BlockHasher, namespace_key
from scorer.director import Director
from scorer.routing import Decision, RoutingRequest


class ScorerService(scorer_pb2_grpc.ScorerServicer):
    """`Score`: the director's decision as a dry run (no state changes anywhere)."""

    def __init__(self, director: Director, hasher: BlockHasher | None = None) -> None:
        self.director = director
        self.hasher = hasher
        self._ids = itertools.count(1)

    async def Score(
        self,
        request: scorer_pb2.ScoreRequest,
        context: grpc.aio.ServicerContext[scorer_pb2.ScoreRequest, scorer_pb2.ScoreResponse],
    ) -> scorer_pb2.ScoreResponse:
        if not request.model:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "model is required")
        req = RoutingRequest(
            request_id=f"score-{next(self._ids)}",
            model=request.model,
            path="/scorer.v1.Scorer/Score",
            subset=frozenset(request.subset) if request.subset else None,
            session_id=request.session_id or None,
            cache_salt=request.cache_salt or None,
            lora=request.lora or self.director.config.tokens.adapter_of(request.model),
        )
        which = request.WhichOneof("input")
        # The tokens stage's byte budget (tokens.max_tokenize_bytes) reads this.
        req.body_bytes = request.ByteSize()
        body: dict[str, Any] = {"model": request.model}
        if req.cache_salt:
            body["cache_salt"] = req.cache_salt
        if which == "prompt":
            body["prompt"] = request.prompt
            req.body = body
            req.prompt_tokens = len(request.prompt) // 4
        elif which == "messages":
            body["messages"] = [
                {"role": m.role, "content": m.content} for m in request.messages.messages
            ]
            req.body = body
            req.prompt_tokens = sum(len(m.content) for m in request.messages.messages) // 4
        elif which == "token_ids":
            ids = list(request.token_ids.ids)
            req.prompt_tokens = len(ids)
            if len(ids) > self.director.config.tokens.max_prompt_tokens:
                # Past the budget: never hashed; the tokens stage refuses it (413), as on
                # the data path.
                body["prompt"] = ids
                req.body = body
            else:
                req.token_ids = ids
                self._block_keys(req)
        d = await self.director.decide(req, dry_run=True)
        return decision_to_proto(d)

    def _block_keys(self, req: RoutingRequest) -> None:
        """Token ids given directly: chain them into block keys when a hasher exists."""
        hasher = self.hasher
        if hasher is None or req.token_ids is None:
            return
        ns = namespace_key(req.lora, req.cache_salt)  # the one hash space (scorer.blocks)
        req.block_keys = hasher.keys(req.token_ids, ns)
        req.block_size = hasher.block_size


def decision_to_proto(d: Decision) -> scorer_pb2.ScoreResponse:
    """Decision → ScoreResponse: chosen endpoints first (primary, fallbacks), then the other
    candidates by cost (lowest first), then filtered ones."""
    resp = scorer_pb2.ScoreResponse(
        request_id=d.request_id,
        policy=d.policy,
        reason=str(d.reason),
        endpoints=list(d.endpoints),
        status=d.status,
        message=d.message,
        matched_tokens=d.matched_tokens,
        request_tokens=d.request_tokens,
        notes=list(d.notes),
        decision_json=json.dumps(d.as_dict(), separators=(",", ":")),
    )
    by_ep = {c.endpoint: c for c in d.candidates}
    order = list(d.endpoints)
    rest = [c for c in d.candidates if c.endpoint not in set(order)]
    rest.sort(key=lambda c: (c.filtered is not None, c.cost is None, c.cost or 0.0, c.endpoint))
    order += [c.endpoint for c in rest]
    for i, ep in enumerate(order):
        c = by_ep.get(ep)
        chosen = i < len(d.endpoints)
        se = scorer_pb2.ScoredEndpoint(
            endpoint=ep,
            rank=i if chosen else -1,
            reason=str(d.reason) if i == 0 else ("fallback" if chosen else "candidate"),
        )
        if c is not None:
            if c.cost is not None:
                se.has_cost = True
                se.cost = c.cost
            se.matched_tokens = c.matched_tokens
            se.matched_blocks = c.matched_blocks
            se.weighted_overlap = c.weighted_overlap
            se.inflight = c.inflight
            se.filtered = c.filtered or ""
            se.note = c.note or ""
        resp.ranked.append(se)
    return resp


def add_to_server(service: scorer_pb2_grpc.ScorerServicer, server: grpc.aio.Server) -> None:
    scorer_pb2_grpc.add_ScorerServicer_to_server(service, server)  # type: ignore[no-untyped-call]
