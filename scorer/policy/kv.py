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
from scorer.policy.cost import CostOptions, pick
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

    def checks_streams(self) -> bool:
        """Whether `stream_stale` can ever be True for this decision (saves a call per
        candidate when there is no event stream to watch)."""
        return False

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
        busy_w = opts.busy_waiting
        busy_k = opts.busy_kv_usage
        busy_i = opts.busy_inflight
        # Pass 1: load terms (scorer.policy.cost.load_terms) and the busy filter
        # (busy_reason), written out inline into flat lists because this runs once per
        # candidate per request. The explanation rows are built after the pick.
        n = len(candidates)
        pfs: list[float] = []
        dcs: list[float] = []
        wqs: list[float] = []
        kus: list[float] = []
        busys: list[str | None] = []
        eligible: list[int] = []
        # Bound methods and a precomputed freshness bound: this loop is the hot spot.
        add_pf, add_dc, add_wq, add_ku = pfs.append, dcs.append, wqs.append, kus.append
        add_busy, add_eligible = busys.append, eligible.append
        fresh_since = now - stale_after
        for i, w in enumerate(candidates):
            fl = w.inflight
            sc = w.scraped
            pf = fl.prefill_blocks
            dc = fl.decode_blocks
            busy: str | None = None
            at = sc.at
            if at > 0.0 and at >= fresh_since:
                wq = sc.waiting
                ku = sc.kv_usage
                x = wq * wrb
                if x > pf:
                    pf = x
                if sc.num_gpu_blocks:
                    x = ku * sc.num_gpu_blocks
                    if x > dc:
                        dc = x
                if busy_w is not None and wq >= busy_w:
                    busy = "busy_waiting"
                elif busy_k is not None and ku >= busy_k:
                    busy = "busy_kv_usage"
            else:
                wq = ku = 0.0
            if busy is None:
                if busy_i is not None and fl.requests >= busy_i:
                    busy = "busy_inflight"
                else:
                    add_eligible(i)
            add_pf(pf)
            add_dc(dc)
            add_wq(wq)
            add_ku(ku)
            add_busy(busy)

        all_busy = not eligible
        costs: list[float] = []
        # Per matched candidate: (match, weighted overlap, credit, stale?).
        credit_of: dict[int, tuple[Any, float, float, bool]] = {}
        stale_any = False
        if all_busy and request.sheddable and opts.shed_when_busy:
            j = -1
        else:
            if all_busy:
                eligible = list(range(n))
            load_min = min([pfs[i] + dcs[i] for i in eligible])
            mcredit = opts.medium_credit
            pls = opts.prefill_load_scale
            decay = opts.credit_decay
            excess_unit = max(load_min, req_blocks, 1.0)
            check_stale = self.checks_streams()
            # Pass 2: cost (scorer.policy.cost.cost, inline) of every eligible candidate.
            for i in eligible:
                w = candidates[i]
                total = pfs[i] + dcs[i]
                p = pfs[i] + req_blocks
                m = matches.get(w.endpoint) if matches else None
                if m is not None:
                    # decayed_credit(total, load_min, req_blocks, decay), inline.
                    if decay > 0.0 and total > load_min:
                        credit = 1.0 / (1.0 + decay * (total - load_min) / excess_unit)
                    else:
                        credit = 1.0
                    stale = check_stale and self.stream_stale(w, now)
                    if stale:
                        credit *= opts.stale_credit
                        stale_any = True
                    if mcredit is None:
                        weighted = float(m.weighted)
                    else:
                        gpu = mcredit.get("GPU", 1.0)
                        weighted = sum(mcredit.get(k, gpu) * v for k, v in m.by_medium.items())
                    credit_of[i] = (m, weighted, credit, stale)
                    p -= credit * weighted
                costs.append(pls * (p if p > 0.0 else 0.0) + dcs[i] + req_blocks)
            elig = eligible

            def tiebreak(k: int) -> tuple[float, int]:
                i = elig[k]
                return (pfs[i] + dcs[i], candidates[i].inflight.requests)

            j = pick(costs, tiebreak, opts.temperature, self.ctx.rng)
        t_score = time.perf_counter()

        # The explanation: one row per candidate, filtered ones included.
        cost_of = dict(zip(eligible, costs, strict=True)) if costs else {}
        scores: list[CandidateScore] = []
        for i, w in enumerate(candidates):
            got = credit_of.get(i)
            if got is None:
                mm = matches.get(w.endpoint) if matches else None
                mb = 0 if mm is None else mm.blocks
                scores.append(
                    CandidateScore(
                        w.endpoint,
                        mb,
                        mb * block_size,
                        {} if mm is None else mm.by_medium,
                        0.0,
                        1.0,
                        w.inflight.requests,
                        pfs[i],
                        dcs[i],
                        wqs[i],
                        kus[i],
                        cost_of.get(i),
                        busys[i],
                        None,
                    )
                )
            else:
                m, weighted, credit, stale = got
                scores.append(
                    CandidateScore(
                        w.endpoint,
                        m.blocks,
                        m.blocks * block_size,
                        m.by_medium,
                        weighted,
                        credit,
                        w.inflight.requests,
                        pfs[i],
                        dcs[i],
                        wqs[i],
                        kus[i],
                        cost_of.get(i),
                        busys[i],
                        "stale_events" if stale else None,
                    )
                )
        if j < 0:
            d = refuse(self.name, Reason.SHED, "every eligible worker is busy")
            d.candidates = scores
            d.stages["match"] = t_match - t0
            d.stages["score"] = t_score - t_match
            d.stages["explain"] = time.perf_counter() - t_score
            return d

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
        if not all_busy:
            # A busy worker held more of the prompt than the winner: say the request spilled.
            spilled = max(
                (c for c in scores if c.filtered is not None),
                key=lambda c: c.matched_blocks,
                default=None,
            )
            if spilled is not None and spilled.matched_blocks > win.matched_blocks:
                notes.append(f"spilled:{spilled.filtered}")

        if not request.dry_run:
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
        d.stages["score"] = t_score - t_match
        d.stages["explain"] = time.perf_counter() - t_score
        return d


@register
class KvPolicy(CacheAwarePolicy):
    """Precise: the event-fed index (`ctx.services["index"]`)."""

    name = "kv"
    Options = KvOptions
    options: KvOptions

    def checks_streams(self) -> bool:
        return self.ctx.services.get("events") is not None

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
