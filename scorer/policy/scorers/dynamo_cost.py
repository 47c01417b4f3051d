"""`dynamo_cost`: Dynamo's KV-router cost (scorer.policy.cost), as a score (-cost).

Cached prefix from the event-fed index (`source: events`) or from our own decisions
(`source: decisions`, for fleets without KV events: Dynamo's ApproxKvIndexer), load from
the load view, event-stream health from `events`. On commit the winner's uncached blocks
are inserted into the index speculatively (events) or all its blocks remembered for
`ttl_s` (decisions).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Literal

from pydantic import Field

from scorer.policy.approx_index import ApproxIndex
from scorer.policy.cost import CostModelOptions, CostParams, FleetInputs, dynamo_costs
from scorer.policy.fleet import CacheLife, Conversations, Sessions, life_factor, own_blocks
from scorer.policy.parts import IndexLike, MatchLike
from scorer.policy.plugin import Cycle, Scorer, plugin
from scorer.pool.prefill import PrefillModel

if TYPE_CHECKING:
    from scorer.policy.base import PolicyContext
    from scorer.pool.workers import PoolChange, Worker


class DynamoCostOptions(CostModelOptions):
    """The cost model's options plus where the cached prefix comes from."""

    source: Literal["events", "decisions"] = "events"
    # Insert the winner's uncached blocks into the index speculatively so a burst of the
    # same prefix hits before the engine's events arrive (source: events).
    speculative: bool = True
    # A stream silent since a request was routed to its worker gets its credit cut only
    # once that request is older than this (its events had time to come).
    stale_events_grace_s: float = Field(1.0, ge=0)
    # source: decisions — how long a routed prefix counts as cached, and the key bound.
    ttl_s: float = Field(120.0, gt=0)
    max_keys: int = Field(1_000_000, ge=1)


# Prompt tokens vLLM prefills per engine step by default (max_num_batched_tokens: 8,192
# for the OpenAI server on a >= 70 GiB GPU, 2,048 on smaller ones; EngineArgs.
# get_batch_defaults in vllm/engine/arg_utils.py): a long prompt's blocks are stored, and
# their BlockStored published, one step's worth at a time.
STEP_TOKENS = 8192


@plugin("dynamo_cost")
class DynamoCost(Scorer):
    """-cost: cached prefix (by medium, decayed credit) against prefill and decode load."""

    Options = DynamoCostOptions
    options: DynamoCostOptions
    consumes = frozenset({"tokens", "index", "events", "load"})

    def __init__(
        self, ctx: PolicyContext, options: DynamoCostOptions, clock: Callable[[], float]
    ) -> None:
        super().__init__(ctx, options, clock)
        # The options and config each decision reads, read once (an attribute of a
        # pydantic model goes through its __getattr__ hook, ~350 instructions a read;
        # options are frozen).
        self.p = CostParams(options)
        self._speculative = options.speculative
        self._grace_s = options.stale_events_grace_s
        self._stale_after_s = ctx.config.events.stale_after_s
        self._now = 0.0  # the decision being scored (stream_stale's clock, _stale)
        self._born = time.monotonic()
        # endpoint -> (the stream's last_event_at when we first routed there since it,
        #              the time of that first routing): "served while silent".
        self._routed_since: dict[str, tuple[float | None, float]] = {}
        self.approx: ApproxIndex | None = None
        # Fleet terms' state (scorer.policy.fleet): block life and chain ages, sessions'
        # previous workers; the prefill model used until the director shares its fitted one.
        self.life = (
            CacheLife(options.life_window_s, rate_from=self._life_rate_from())
            if options.block_life
            else None
        )
        if options.source == "decisions":
            self.approx = ApproxIndex(options.ttl_s, options.max_keys, clock)
        if self.life is not None or self.approx is not None:
            # A worker leaving the pool takes its block-life state and what it was sent
            # along (both bounded by the live pool).
            ctx.pool.subscribe(self._pool_changed)
        sessions = (
            options.continuity > 0.0 or options.session_spread > 0.0
        ) or options.infer_conversations
        self.sessions = Sessions(live_s=options.session_live_s) if sessions else None
        # Conversations without a session id, recognised by their prompts' chains; the one
        # this decision found (cycle, id; None: it opens one), for commit.
        self.convos = (
            Conversations(options.max_conversations) if options.infer_conversations else None
        )
        self._conv: tuple[Cycle | None, int | None, bool] = (None, None, False)
        self._model = PrefillModel()
        # Named sessions opened and requests they sent (shared_copy's turns per session).
        self._opened = 0.0
        self._turns = 0.0
        self._fleet_on = options.unit == "ms" or options.block_life or sessions

    def _pool_changed(self, change: PoolChange) -> None:
        if change.change == "removed":
            if self.life is not None:
                self.life.forget(change.worker.endpoint)
            if self.approx is not None:
                self.approx.forget(change.worker.endpoint)

    def _life_rate_from(self) -> str:
        """`events` when asked for and the index counts BlockRemoved per worker, else
        `routed` (source: decisions has no engine events)."""
        o = self.options
        counts = callable(getattr(self.ctx.parts.index, "removed_total", None))
        return "events" if o.life_rate == "events" and o.source == "events" and counts else "routed"

    def index(self) -> IndexLike | None:
        """Where cached prefixes are looked up."""
        return self.approx if self.approx is not None else self.ctx.parts.index

    def prepare(self, cycle: Cycle) -> None:
        cycle.shown_matches = cycle.matches(self.index())

    def score(self, cycle: Cycle) -> list[float]:
        return [-c for c in self.costs(cycle)]

    def costs(self, cycle: Cycle) -> list[float]:
        """The cost of every eligible candidate (scorer.policy.cost.dynamo_costs)."""
        stale: Callable[[Worker], bool] | None = None
        if self.approx is None and self.ctx.parts.events is not None:
            self._now = cycle.now
            stale = self._stale  # (a bound method, not a closure per decision)
        matches = cycle.matches(self.index())
        table = dynamo_costs(
            cycle.candidates,
            cycle.endpoints,
            cycle.eligible,
            cycle.load,
            matches,
            cycle.request_blocks,
            self.p,
            stale,
            self.fleet(cycle, matches) if self._fleet_on else None,
            block_size=cycle.block_size,
        )
        cycle.cost = table
        cycle.stale_any = table.stale_any
        return table.costs

    def _stale(self, w: Worker) -> bool:
        """stream_stale at the decision being scored (`costs` sets `_now`)."""
        return self.stream_stale(w, self._now)

    def fleet(self, cycle: Cycle, matches: Mapping[str, MatchLike]) -> FleetInputs:
        """This decision's inputs of the fleet terms (scorer.policy.cost.FleetInputs)."""
        o = self.p
        model = self.ctx.parts.prefill or self._model
        bs = cycle.block_size
        now = cycle.now
        cands = cycle.candidates
        keys = cycle.request.block_keys
        life: dict[int, tuple[float, float | None, float | None, float]] = {}
        cl = self.life
        if cl is not None and matches and keys:
            pfs = cycle.load.prefill
            removed_total = getattr(self.index(), "removed_total", None) if cl.from_events else None
            for i in cycle.eligible:
                w = cands[i]
                m = matches.get(w.endpoint)
                if m is None or m.blocks <= 0:
                    continue
                if removed_total is not None:
                    cl.removed(w.endpoint, removed_total(w.endpoint), now)
                life_s = cl.life_s(w.endpoint, float(w.scraped.num_gpu_blocks or 0), now)
                if life_s is None:
                    continue
                age = cl.age_s(w.endpoint, keys, m.blocks, now)
                f = 1.0
                if age is not None:
                    wait = model.estimate(pfs[i] * bs) if pfs[i] > 0.0 else 0.0
                    f = life_factor(life_s - age, wait, life_s, o.life_fade)
                life[i] = (f, life_s, age, cl.eviction_rate(w.endpoint, now))
        ss = self.sessions
        sid = cycle.request.session_id
        # A request without a session id continues the conversation its chain extends, or
        # opens one (infer_conversations).
        conv: int | None = None
        label: str | None = None
        if self.convos is not None and not sid and keys and ss is not None:
            conv = self.convos.find(keys)
            if conv is not None and ss.get(conv, now) is None:
                conv = None  # its previous worker is forgotten: a new one
            label = "new" if conv is None else "continued"
        previous: int | None = None
        own: int | None = None
        if o.continuity > 0.0:
            previous, own_found = self._previous(cycle, matches, conv)
            if previous is not None and o.continuity_own_blocks:
                own = own_found
                if own is None:
                    eps = cycle.endpoints
                    own = own_blocks(eps[previous], matches, [eps[i] for i in cycle.eligible])
        live: list[float] | None = None
        left: int | None = None
        evicted = False
        cold = False  # a new conversation no eligible worker holds a block of
        if label is not None and ss is not None:
            eps = cycle.endpoints
            if conv is None and o.conversation_spread > 0.0:
                # A prompt no eligible worker holds any block of opens a conversation:
                # spread by live weight (one with a cached prefix is the cost's to place).
                held = bool(matches)
                if held and len(cycle.eligible) != len(eps):
                    held = not matches.keys().isdisjoint([eps[i] for i in cycle.eligible])
                if not held:  # (the index lists only endpoints holding a block)
                    cold = True
                    ss.expire(now)
                    live = [ss.live(eps[i]) for i in cycle.eligible]
            elif (
                conv is not None
                and previous is not None
                and own == 0
                and o.continuity_evicted > 0.0
            ):
                # Its previous worker evicted its own blocks: the continuity discount is
                # kept there (it stays unless another worker is clearly better).
                evicted = True
        if label is not None:
            self._conv = (cycle, conv, cold)
        elif ss is not None and sid and o.session_spread > 0.0:
            last = ss.get(sid, now)
            if last is None:
                ss.expire(now)
                eps = cycle.endpoints
                live = [ss.live(eps[i]) for i in cycle.eligible]
            elif o.session_rebalance > 0.0:
                left = self._rebalance(cycle, ss, sid, last, now)
                if left is not None:
                    eps = cycle.endpoints
                    live = [ss.live(eps[i]) for i in cycle.eligible]
        return FleetInputs(
            (model.a, model.b, model.min_s, model.max_s),
            1000.0 * model.b * bs,
            bs,
            life,
            previous,
            own,
            live,
            left,
            evicted,
            label,
            self.session_turns() if live is not None and left is None else 1.0,
        )

    def _count_turn(self, opened: bool) -> None:
        """One more request of a named session (`opened`: its first); both counts halve
        past 10,000 requests so the mean follows the traffic of the last few thousand."""
        self._turns += 1.0
        if opened:
            self._opened += 1.0
        if self._turns > 10_000.0:
            self._turns *= 0.5
            self._opened *= 0.5

    def session_turns(self) -> float:
        """Mean requests per named session so far (1.0 before any)."""
        return self._turns / self._opened if self._opened > 0.0 else 1.0

    def _rebalance(self, cycle: Cycle, ss: Sessions, sid: str, last: str, now: float) -> int | None:
        """Candidate index of the worker `sid` leaves for balance (session_rebalance), if
        any: its live weight is over (1 + session_rebalance) x the eligible workers' mean,
        and moving the session (its own weight) off it lowers the larger of the two
        workers' weights (a lone large session is never moved: that only moves the peak).
        """
        eps = cycle.endpoints
        eligible = cycle.eligible
        try:
            i = eps.index(last)
        except ValueError:
            return None
        if i not in eligible:
            return None  # it is leaving anyway
        ss.expire(now)
        live = [ss.live(eps[j]) for j in eligible]
        mine = ss.live(last)
        own = ss.weight(sid)
        mean = sum(live) / len(live)
        lo = live[0]  # min(live)
        for x in live:
            if x < lo:
                lo = x
        if mine > (1.0 + self.p.session_rebalance) * mean and mine - own > lo + own:
            return i
        return None

    def _previous(
        self, cycle: Cycle, matches: Mapping[str, MatchLike], conv: int | None = None
    ) -> tuple[int | None, int | None]:
        """Candidate index of the previous turn's worker (scorer.policy.fleet), if eligible,
        and, when the longest cached prefix named it, the blocks it holds beyond every other
        eligible candidate (fleet.own_blocks, found on the way; None: not computed).
        `conv`: the recognised conversation (infer_conversations), whose previous worker
        is remembered."""
        eps = cycle.endpoints
        eligible = cycle.eligible
        sid = cycle.request.session_id
        own: int | None = None
        if conv is not None and self.sessions is not None:
            ep = self.sessions.get(conv, cycle.now)
        elif sid and self.sessions is not None:
            # A session names its previous turn; a new one has none (its prefix may be a
            # system prompt shared with other sessions, not a previous turn).
            ep = self.sessions.get(sid, cycle.now)
        else:
            ep, own = self._longest_prefix(cycle, matches)
        if ep is None:
            return None, None
        # Its candidate index, if it is eligible.
        try:
            i = eps.index(ep)
        except ValueError:
            return None, None
        return (i, own) if len(eligible) == len(eps) or i in eligible else (None, None)

    def _longest_prefix(
        self, cycle: Cycle, matches: Mapping[str, MatchLike]
    ) -> tuple[str | None, int | None]:
        """The endpoint holding the longest cached prefix among the eligible candidates,
        when it is the only one that long and covers continuity_min_match of the prompt,
        and its blocks beyond the next longest (fleet.own_blocks: the lists are at hand)."""
        keys = cycle.request.block_keys
        if not matches or not keys:
            return None, None
        held = matches
        if len(cycle.eligible) != len(cycle.candidates):
            # Only the eligible candidates' prefixes count.
            eps = cycle.endpoints
            held = {e: m for i in cycle.eligible if (m := matches.get(e := eps[i])) is not None}
        if not held:
            return None, None
        # The longest (its first holder), whether another holds as much, and the longest
        # of the others (max over them, 0 when none): one loop, no list, no max().
        ep: str | None = None
        top = 0
        second: int | None = None
        tied = False
        for e, m in held.items():
            b = m.blocks
            if ep is None:
                ep, top = e, b
            elif b > top:
                ep, top, second, tied = e, b, top, False
            else:
                if b == top:
                    tied = True
                if second is None or b > second:
                    second = b
        # A prefix held by several workers (a shared system prompt) names no one turn.
        if ep is None or top <= 0 or tied or top < self.p.continuity_min_match * len(keys):
            return None, None
        own = top - (0 if second is None else second)
        return ep, (own if own > 0 else 0)

    def stream_stale(self, w: Worker, now: float) -> bool:
        """True when `w`'s event stream went silent while serving, or has an unrecovered gap."""
        events = self.ctx.parts.events
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
        return now - last > self._stale_after_s and now - seen[1] > self._grace_s

    def commit(self, cycle: Cycle, winner: int) -> None:
        keys = cycle.request.block_keys
        w = cycle.candidates[winner]
        ep = w.endpoint
        ss = self.sessions
        if ss is not None:
            weight = cycle.request_blocks if self.p.session_weight == "blocks" else 1.0
            if cycle.request.session_id:
                self._count_turn(ss.get(cycle.request.session_id, cycle.now) is None)
                ss.put(cycle.request.session_id, ep, cycle.now, weight)
            elif self.convos is not None and keys:
                found, conv, cold = self._conv
                if found is not cycle:  # (not scored with the fleet terms)
                    conv, cold = self.convos.find(keys), False
                self._conv = (None, None, False)
                if conv is None:
                    conv = self.convos.new()
                    if not cold:
                        # Opened behind a cached prefix (a shared system prompt): most such
                        # requests are one-shots; it counts as live once it continues.
                        weight = 0.0
                self.convos.record(keys, conv)
                ss.put(conv, ep, cycle.now, weight)
        if self.life is not None and keys:
            self._record_life(cycle, w, keys)
        if self.approx is not None:
            # All keys, also the matched ones: the winner just used them, refresh their TTL.
            if keys:
                self.approx.insert(ep, keys)
            return
        matched = 0
        if keys is not None:
            m = cycle.matches(self.index()).get(ep)
            matched = 0 if m is None else m.blocks
            if len(keys) <= matched:
                # Every full block is cached there (or none is full): the engine stores
                # nothing new, so it publishes no BlockStored; its silence then says
                # nothing about its stream. (Untokenized requests count as new work.)
                return
        events = self.ctx.parts.events
        if events is not None:
            try:
                last = events.status(ep).last_event_at
            except LookupError:
                last = None
            since = self._routed_since
            seen = since.get(ep)
            if seen is None or seen[0] != last:
                if seen is None and len(since) > 2 * len(self.ctx.pool.workers) + 16:
                    # Workers come and go: forget the clocks of those no longer in the
                    # pool (amortised: runs once the dict has doubled past the pool).
                    for gone in [e for e in since if e not in self.ctx.pool.workers]:
                        del since[gone]
                since[ep] = (last, self.clock())
        if self._speculative and keys:
            idx = self.index()
            if idx is not None:
                wait_s, block_s = self._prefill_timing(cycle, winner)
                idx.insert_speculative(
                    ep, keys[matched:], None, wait_s, block_s, STEP_TOKENS // cycle.block_size
                )

    def _prefill_timing(self, cycle: Cycle, winner: int) -> tuple[float, float]:
        """(seconds before the winner starts this request's prefill, seconds per block
        prefilled) as the decision predicted them: the prefill line the fleet terms used
        (else the fitted model) over the winner's active prefill blocks (the queue ahead)
        from the cost table. The speculative entries' TTL starts once their blocks are
        stored, step by step (BlockIndex.insert_speculative)."""
        table = cycle.cost
        k = None if table is None else table.position(winner)
        queue = 0.0 if table is None or k is None else table.prefill[k]
        if table is not None and table.fleet is not None:
            a, b, _lo, hi = table.fleet.prefill_line
        else:
            model = self.ctx.parts.prefill or self._model
            a, b, hi = model.a, model.b, model.max_s
        bs = cycle.block_size
        wait = a + b * queue * bs if queue > 0.0 else a
        # min(max(wait, 0.0), hi), max(b, 0.0), as the builtins choose (no keyword parse)
        if wait < 0.0:
            wait = 0.0
        if hi < wait:
            wait = hi
        return wait, (0.0 if b < 0.0 else b) * bs

    def _record_life(self, cycle: Cycle, w: Worker, keys: list[int]) -> None:
        """The winner's written blocks (its eviction rate once full) and chain time."""
        assert self.life is not None
        m = cycle.matches(self.index()).get(w.endpoint)
        written = float(len(keys) - (0 if m is None else m.blocks))
        if self.life.from_events:  # the rate comes from BlockRemoved: only the chain's time
            self.life.routed(w.endpoint, keys, written, cycle.now, False)
            return
        cap = float(w.scraped.num_gpu_blocks or 0)
        idx = self.index()
        stats = getattr(idx, "stats", None)
        if stats is not None:
            held = float(stats(w.endpoint)["blocks"]["GPU"])
        else:
            held = w.scraped.kv_usage * cap
        self.life.routed(w.endpoint, keys, written, cycle.now, self.life.is_full(held, cap))
