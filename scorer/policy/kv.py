"""The `kv` policy: precise cache-aware routing over the event-fed block index.

Reads `ctx.services["index"]` (scorer.index.BlockIndex) for each candidate's cached prefix,
the load view (scorer.pool) for its load, `ctx.services["events"]` for event-stream health,
and scores with the cost model of scorer.policy.cost. The winner's uncached blocks are
inserted into the index speculatively so that a burst of the same prefix all hit it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

from pydantic import Field

from scorer.policy.base import Policy, PolicyContext, register
from scorer.policy.cost import (
    CostOptions,
    busy_reason,
    cost,
    decayed_credit,
    load_terms,
    pick,
)
from scorer.pool.workers import Worker
from scorer.routing import CandidateScore, Decision, Reason, RoutingRequest, refuse


class MatchLike(Protocol):
    """scorer.index.Match as the policy reads it."""

    blocks: int
    by_medium: dict[str, int]
    weighted: float


class IndexLike(Protocol):
    """The part of scorer.index.BlockIndex the policies use."""

    def match(
        self, keys: Sequence[int], endpoints: Iterable[str] | None = None
    ) -> dict[str, Any]: ...

    def insert_speculative(
        self, endpoint: str, keys: Sequence[int], ttl_s: float | None = None
    ) -> None: ...


class KvOptions(CostOptions):
    """`policies.kv`: the cost options plus event-stream health."""

    # A stream that has been silent since a request was routed to its worker gets its
    # credit cut only once that request is older than this (its events had time to come).
    stale_events_grace_s: float = Field(1.0, ge=0)


def no_token_reason(request: RoutingRequest) -> Reason | None:
    """Why a request has no block keys (routed by load), or None when it has them."""
    if request.block_keys is not None:
        return None
    if request.body is None:
        return Reason.NO_BODY
    if request.tokenize_error is not None:
        return Reason.TOKENIZE_ERROR
    return Reason.NO_TOKENIZER


class CacheAwarePolicy(Policy):
    """Shared scoring of `kv` and `approx`; subclasses say where matches come from."""

    options: CostOptions
    needs_tokens = True

    def __init__(self, ctx: PolicyContext, options: CostOptions) -> None:  # type: ignore[override]
        super().__init__(ctx, options)
        self.clock: Callable[[], float] = time.monotonic
        self._born = self.clock()
        # endpoint -> (the stream's last_event_at when we first routed there since it,
        #              the time of that first routing): "served while silent".
        self._routed_since: dict[str, tuple[float | None, float]] = {}

    # -- hooks for subclasses ------------------------------------------------------------
    def index(self) -> IndexLike | None:
        """Where matches come from (None: route by load)."""
        idx: IndexLike | None = self.ctx.services.get("index")
        return idx

    def stream_stale(self, w: Worker, now: float) -> bool:
        """True when `w`'s cache signal is not to be trusted right now."""
        return False

    def after_decision(self, winner: str, keys: Sequence[int] | None, matched: int) -> None:
        """Record the routing (stream health) and insert the uncached blocks speculatively."""
        events = self.ctx.services.get("events")
        if events is not None:
            try:
                last = events.status(winner).last_event_at
            except LookupError:
                last = None
            seen = self._routed_since.get(winner)
            if seen is None or seen[0] != last:
                self._routed_since[winner] = (last, self.clock())
        if self.options.speculative and keys and len(keys) > matched:
            idx = self.index()
            if idx is not None:
                idx.insert_speculative(winner, keys[matched:])

    # -- the decision ----------------------------------------------------------------------
    def decide(self, request: RoutingRequest, candidates: Sequence[Worker]) -> Decision:
        """Score every candidate with the cost model; see scorer.policy.cost."""
        t0 = time.perf_counter()
        opts = self.options
        config = self.ctx.config
        now = self.clock()
        block_size = request.block_size or config.pool.block_size
        fallback = no_token_reason(request)
        keys = request.block_keys
        if request.prompt_tokens:
            req_blocks = float(math.ceil(request.prompt_tokens / block_size))
        else:
            req_blocks = float(len(keys or ()))
        matches: dict[str, Any] = {}
        idx = self.index() if keys else None
        if idx is not None and keys:
            matches = idx.match(keys, [w.endpoint for w in candidates])
        t_match = time.perf_counter()

        wrb = opts.waiting_request_blocks
        if wrb is None:
            wrb = max(req_blocks, 1.0)
        stale_after = config.load.stale_after_s
        scores: list[CandidateScore] = []
        terms = []
        eligible: list[int] = []
        for i, w in enumerate(candidates):
            t = load_terms(w, now, stale_after, wrb)
            terms.append(t)
            cs = CandidateScore(
                endpoint=w.endpoint,
                inflight=w.inflight.requests,
                prefill_blocks=t.prefill,
                decode_blocks=t.decode,
                waiting=t.waiting,
                kv_usage=t.kv_usage,
            )
            m = matches.get(w.endpoint)
            if m is not None:
                cs.matched_blocks = m.blocks
                cs.matched_tokens = m.blocks * block_size
                cs.overlap_by_medium = m.by_medium
            busy = busy_reason(w, t, opts)
            if busy is None:
                eligible.append(i)
            else:
                cs.filtered = busy
            scores.append(cs)

        all_busy = not eligible
        if all_busy:
            if request.sheddable and opts.shed_when_busy:
                d = refuse(self.name, Reason.SHED, 429, "every eligible worker is busy")
                d.candidates = scores
                d.stages["match"] = t_match - t0
                d.stages["score"] = time.perf_counter() - t_match
                return d
            eligible = list(range(len(candidates)))

        load_min = min(terms[i].total for i in eligible)
        mcredit = opts.medium_credit
        pls = opts.prefill_load_scale
        decay = opts.credit_decay
        costs: list[float] = []
        loads: list[tuple[float, int]] = []
        stale_any = False
        for i in eligible:
            cs = scores[i]
            t = terms[i]
            overlap = 0.0
            if cs.matched_blocks:
                credit = decayed_credit(t.total, load_min, req_blocks, decay)
                if self.stream_stale(candidates[i], now):
                    credit *= opts.stale_credit
                    cs.note = "stale_events"
                    stale_any = True
                m = matches[cs.endpoint]
                if mcredit is None:
                    weighted = float(m.weighted)
                else:
                    gpu = mcredit.get("GPU", 1.0)
                    weighted = sum(mcredit.get(k, gpu) * n for k, n in m.by_medium.items())
                cs.weighted_overlap = weighted
                cs.credit = credit
                overlap = credit * weighted
            c = cost(pls, t.prefill, t.decode, req_blocks, overlap)
            cs.cost = c
            costs.append(c)
            loads.append((t.total, cs.inflight))

        j = pick(costs, loads, opts.temperature, self.ctx.rng)
        win = scores[eligible[j]]
        endpoints = [win.endpoint]
        if opts.fallbacks:
            rest = sorted((c, k) for k, c in enumerate(costs) if k != j)
            endpoints += [scores[eligible[k]].endpoint for _, k in rest[: opts.fallbacks]]

        notes: list[str] = []
        if all_busy:
            reason = Reason.BUSY_ALL
            if fallback is not None:
                notes.append(str(fallback))
        elif fallback is not None:
            reason = fallback
        elif stale_any and (
            win.note == "stale_events"
            or any(
                scores[i].note == "stale_events" and scores[i].matched_blocks > win.matched_blocks
                for i in eligible
            )
        ):
            reason = Reason.STALE_EVENTS
        elif win.matched_blocks > 0:
            reason = Reason.KV_HIT
        else:
            reason = Reason.LOAD
        if stale_any and reason is not Reason.STALE_EVENTS:
            notes.append(str(Reason.STALE_EVENTS))

        self.after_decision(win.endpoint, keys, win.matched_blocks)
        d = Decision(
            endpoints=endpoints,
            reason=reason,
            policy=self.name,
            candidates=scores,
            matched_tokens=win.matched_tokens,
            request_tokens=request.prompt_tokens,
            notes=notes,
        )
        d.stages["match"] = t_match - t0
        d.stages["score"] = time.perf_counter() - t_match
        return d


@register
class KvPolicy(CacheAwarePolicy):
    """Precise: the event-fed index (`ctx.services["index"]`)."""

    name = "kv"
    Options = KvOptions
    options: KvOptions

    def stream_stale(self, w: Worker, now: float) -> bool:
        """True when `w`'s event stream went silent while serving, or has an unrecovered gap."""
        events = self.ctx.services.get("events")
        if events is None or w.config.events is None:
            return False
        try:
            st = events.status(w.endpoint)
        except LookupError:
            return False
        if st.unrecovered_gap:
            return True
        seen = self._routed_since.get(w.endpoint)
        if seen is None or seen[0] != st.last_event_at:
            return False  # no routing since the last event we know of
        last = st.last_event_at if st.last_event_at is not None else self._born
        return (
            now - last > self.ctx.config.events.stale_after_s
            and now - seen[1] > self.options.stale_events_grace_s
        )
