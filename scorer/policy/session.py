"""The `session` policy: session affinity layered over another policy.

A request with a session id (the data path fills `RoutingRequest.session_id` from the
`x-session-affinity` header by default) goes to the worker its session is bound to, unless
that worker is busy (this request then goes where the `over` policy sends it; the binding
stays) or gone (the session is placed again). New sessions are placed by rendezvous
(highest-random-weight) hashing over the eligible workers: each (session, worker) pair
gets a pseudo-random weight and the highest wins, so removing one of N workers moves only
the sessions that were on it (Thaler & Ravishankar, "Using name-based mappings to increase
hit rates", IEEE/ACM ToN 1998). Bindings expire after `idle_ttl_s` without a request.
Requests without a session id are decided by the `over` policy.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import xxhash
from pydantic import Field, field_validator

from scorer.policy.base import Policy, PolicyContext, build_policy
from scorer.policy.cost import BusyOptions, BusyRule, load_table
from scorer.pool.workers import Worker
from scorer.routing import Decision, Reason, RoutingRequest

if TYPE_CHECKING:
    from scorer.config import Config


SESSION_HEADER = "x-session-affinity"


class SessionOptions(BusyOptions):
    """`policies.session`."""

    # Request header carrying the session id. The director reads it into
    # RoutingRequest.session_id (see session_header), whatever the policy.
    header: str = SESSION_HEADER
    # A binding unused for this long is forgotten (the next request is placed anew).
    idle_ttl_s: float = Field(600.0, gt=0)
    # Bound on remembered sessions; the least recently used are dropped first.
    max_sessions: int = Field(100_000, ge=1)
    # The policy for requests without a session, and while a bound worker is busy.
    # Its own options come from `policies.<over>`.
    over: str = "least_loaded"
    # How a new session is placed: rendezvous hashing, or wherever `over` decides.
    place: Literal["rendezvous", "over"] = "rendezvous"

    @field_validator("over")
    @classmethod
    def _not_self(cls, v: str) -> str:
        if v == "session":
            raise ValueError("session cannot be layered over itself")
        return v


def session_header(config: Config) -> str:
    """The request header that carries the session id (`policies.session.header`)."""
    raw = config.policies.get("session") or {}
    header = raw.get("header", SESSION_HEADER) if isinstance(raw, dict) else SESSION_HEADER
    return str(header).lower()


@dataclass(slots=True)
class Binding:
    endpoint: str
    last_used: float


def hrw_weight(session_id: str, endpoint: str) -> int:
    """Rendezvous weight of (session, worker): a 64-bit hash of both."""
    return xxhash.xxh3_64_intdigest(f"{session_id}\x00{endpoint}".encode())


def rendezvous(session_id: str, workers: Sequence[Worker]) -> Worker:
    """The highest-random-weight worker for `session_id`."""
    return max(workers, key=lambda w: hrw_weight(session_id, w.endpoint))


class SessionPolicy(Policy):
    """Session affinity (bindings + rendezvous placement) over another policy."""

    name = "session"
    Options = SessionOptions
    options: SessionOptions

    def __init__(self, ctx: PolicyContext, options: SessionOptions) -> None:  # type: ignore[override]
        super().__init__(ctx, options)
        self.inner = build_policy(options.over, ctx, ctx.config.policies.get(options.over))
        # Tokenize only when the policy underneath uses tokens (the director reads this).
        self.needs_tokens = self.inner.needs_tokens
        self.clock: Callable[[], float] = time.monotonic
        self.bindings: OrderedDict[str, Binding] = OrderedDict()
        self._busy_rule = BusyRule(options)  # (read once: see cost.BusyRule)

    def _expire(self, now: float) -> None:
        # Oldest-used first (move_to_end on use), so expiry stops at the first live one.
        ttl = self.options.idle_ttl_s
        b = self.bindings
        while b:
            first = next(iter(b.values()))
            if now - first.last_used <= ttl and len(b) <= self.options.max_sessions:
                break
            b.popitem(last=False)

    def _bind(self, sid: str, endpoint: str, now: float) -> None:
        self.bindings[sid] = Binding(endpoint, now)
        self.bindings.move_to_end(sid)

    def _busy(self, w: Worker, now: float) -> str | None:
        table = load_table([w], now, self.ctx.config.load.stale_after_s, 1.0, self._busy_rule)
        assert table.busy is not None
        return table.busy[0]

    def _over(self, request: RoutingRequest, candidates: Sequence[Worker]) -> Decision:
        d = self.inner.decide(request, candidates)
        d.notes.insert(0, f"over:{self.inner.name}")
        d.policy = self.name
        return d

    def decide(self, request: RoutingRequest, candidates: Sequence[Worker]) -> Decision:
        """Binding → bound worker; busy → `over` (binding kept); gone/new → placement."""
        sid = request.session_id
        if not sid:
            return self._over(request, candidates)
        now = self.clock()
        dry = request.dry_run
        if not dry:
            self._expire(now)
        notes: list[str] = []
        b = self.bindings.get(sid)
        if b is not None and dry and now - b.last_used > self.options.idle_ttl_s:
            b = None  # expired (a dry run reads, never expires)
        if b is not None:
            bound = next((w for w in candidates if w.endpoint == b.endpoint), None)
            if bound is None:
                notes.append("session_moved")  # its worker is gone (or outside the subset)
            else:
                busy = self._busy(bound, now)
                if busy is None:
                    if not dry:
                        b.last_used = now
                        self.bindings.move_to_end(sid)
                    return self._decision(request, bound, Reason.SESSION, notes)
                d = self._over(request, candidates)
                d.notes.append(f"session_busy:{busy}")
                if not dry:
                    b.last_used = now
                return d
        if self.options.place == "over":
            d = self._over(request, candidates)
            if d.endpoint is not None:
                if not dry:
                    self._bind(sid, d.endpoint, now)
                d.notes.append(f"{Reason.SESSION_NEW}:{d.reason}")
                d.notes.extend(notes)
            return d
        free = [w for w in candidates if self._busy(w, now) is None]
        if not free:
            notes.append(str(Reason.BUSY_ALL))
        w = rendezvous(sid, free or candidates)
        if not dry:
            self._bind(sid, w.endpoint, now)
        return self._decision(request, w, Reason.SESSION_NEW, notes)

    def _decision(
        self, request: RoutingRequest, w: Worker, reason: Reason, notes: list[str]
    ) -> Decision:
        # Let the policy underneath score the chosen worker alone: the decision then
        # carries its cache match and load terms, and a cache-aware policy inserts the
        # request's blocks speculatively as for any other decision it makes.
        d = self.inner.decide(request, [w])
        d.notes[:0] = [f"over:{self.inner.name}", f"{self.inner.name}:{d.reason}", *notes]
        d.reason = reason
        d.policy = self.name
        d.status = 200
        d.message = ""
        d.endpoints = [w.endpoint]
        return d
