"""session (rendezvous, TTL, composition over kv), approx (TTL expiry), stale event streams."""

from __future__ import annotations

from collections import Counter

from kvpolicy_helpers import endpoint, hold, keys, make, request

from scorer.events.subscriber import StreamStatus as Status
from scorer.policy.session import SessionPolicy, rendezvous
from scorer.routing import Reason


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


# ---- session --------------------------------------------------------------------------


def test_rendezvous_removing_one_of_three_moves_only_its_sessions() -> None:
    s = make(3, policy="session")
    workers = list(s.pool)
    before = {f"s{i}": rendezvous(f"s{i}", workers).endpoint for i in range(300)}
    spread = Counter(before.values())
    assert len(spread) == 3 and min(spread.values()) > 60  # roughly even
    gone = endpoint(1)
    after = {
        sid: rendezvous(sid, [w for w in workers if w.endpoint != gone]).endpoint for sid in before
    }
    moved = [sid for sid in before if before[sid] != after[sid]]
    assert moved and all(before[sid] == gone for sid in moved)
    assert len(moved) == spread[gone]


def test_session_policy_bindings_survive_a_worker_leaving() -> None:
    s = make(3, policy="session")
    pol = s.policy
    placed = {}
    for i in range(300):
        d = pol.decide(request(None, session_id=f"s{i}"), list(s.pool))
        assert d.reason is Reason.SESSION_NEW
        placed[f"s{i}"] = d.endpoint
    # Same sessions again: bound.
    d = pol.decide(request(None, session_id="s0"), list(s.pool))
    assert d.reason is Reason.SESSION and d.endpoint == placed["s0"]
    # Worker 1 goes unhealthy: only its sessions move.
    s.pool.workers[endpoint(1)].healthy = False
    cands = s.pool.eligible("m", None)
    moved = 0
    for sid, ep in placed.items():
        d = pol.decide(request(None, session_id=sid), cands)
        if ep == endpoint(1):
            moved += 1
            assert d.endpoint != ep and "session_moved" in d.notes
        else:
            assert d.endpoint == ep and d.reason is Reason.SESSION
    assert moved == Counter(placed.values())[endpoint(1)] > 0


def test_session_idle_ttl_expires_bindings() -> None:
    s = make(2, policy="session", options={"idle_ttl_s": 10})
    pol = s.policy
    assert isinstance(pol, SessionPolicy)
    clock = Clock()
    pol.clock = clock
    pol.decide(request(None, session_id="a"), list(s.pool))
    assert "a" in pol.bindings
    clock.t += 5
    assert pol.decide(request(None, session_id="a"), list(s.pool)).reason is Reason.SESSION
    clock.t += 11
    pol.decide(request(None, session_id="b"), list(s.pool))
    assert "a" not in pol.bindings  # idle for 11 s > 10 s


def test_session_over_kv_busy_binding_spills_and_keeps_binding() -> None:
    s = make(2, policy="session", options={"over": "kv"}, policies={"kv": {"credit_decay": 0}})
    pol = s.policy
    assert pol.needs_tokens  # tokenized because kv is underneath
    k = keys(8)
    d = pol.decide(request(k, session_id="chat-1"), list(s.pool))
    home = d.endpoint
    assert d.reason is Reason.SESSION_NEW and "over:kv" in d.notes
    # The kv policy underneath inserted the prompt speculatively on the bound worker.
    assert s.index.match(k)[home].blocks == 8
    d = pol.decide(request(k + keys(4, base=5000), session_id="chat-1"), list(s.pool))
    assert d.reason is Reason.SESSION and d.endpoint == home
    assert d.matched_tokens == 8 * 16  # explanation carries the cache match
    # Home gets busy: this request goes where kv sends it, the binding is kept.
    sc = s.pool.workers[home].scraped
    sc.waiting, sc.at = 9, pol.clock()
    d = pol.decide(request(k, session_id="chat-1"), list(s.pool))
    assert d.endpoint != home and any(n.startswith("session_busy") for n in d.notes)
    assert pol.bindings["chat-1"].endpoint == home
    sc.waiting = 0
    d = pol.decide(request(k, session_id="chat-1"), list(s.pool))
    assert d.endpoint == home and d.reason is Reason.SESSION


def test_session_without_id_uses_the_policy_underneath() -> None:
    s = make(2, policy="session", options={"over": "least_loaded"})
    s.pool.workers[endpoint(0)].inflight.requests = 3
    d = s.policy.decide(request(None), list(s.pool))
    assert d.endpoint == endpoint(1) and d.reason is Reason.LOAD and d.policy == "session"


# ---- approx ---------------------------------------------------------------------------


def test_approx_learns_from_decisions_and_expires_after_ttl() -> None:
    s = make(3, policy="approx", options={"ttl_s": 120, "credit_decay": 0})
    pol = s.policy
    clock = Clock()
    pol.clock = clock
    k = keys(20)
    d1 = pol.decide(request(k), list(s.pool))
    assert d1.reason is Reason.LOAD
    clock.t += 60
    d2 = pol.decide(request(k[:10] + keys(5, base=9000)), list(s.pool))
    assert d2.endpoint == d1.endpoint and d2.reason is Reason.KV_HIT
    assert d2.matched_tokens == 10 * 16
    # 121 s after the last use of the tail blocks (refreshed at t+60 for the first 10).
    clock.t += 121
    d3 = pol.decide(request(k), list(s.pool))
    assert d3.reason is Reason.LOAD and d3.matched_tokens == 0
    assert s.index.total_entries() == 0  # approx never touches the event-fed index


# ---- event-stream health --------------------------------------------------------------


class Events:
    def __init__(self) -> None:
        self.st: dict[str, Status] = {}

    def status(self, ep: str) -> Status:
        return self.st[ep]


def test_stale_stream_gets_reduced_credit_until_it_recovers() -> None:
    opts = {"credit_decay": 0, "stale_credit": 0.5, "speculative": False, "prefill_load_scale": 1.0}
    s = make(2, events=True, options=opts)
    pol = s.policy
    clock = Clock()
    pol.clock = clock
    ev = Events()
    for i in range(2):
        ev.st[endpoint(i)] = Status(last_event_at=clock.t)
    s.ctx.parts.events = ev
    k = keys(10)
    hold(s.index, endpoint(0), k)
    s.pool.workers[endpoint(0)].inflight.decode_blocks = 6  # warm worker a bit loaded
    # Routed there with 2 blocks it does not hold: it must store (and announce) them.
    d = pol.decide(request(k + keys(2, base=7000)), list(s.pool))
    assert d.endpoint == endpoint(0) and d.reason is Reason.KV_HIT and not d.notes
    # Silence: routed there at t, no event since; 40 s later (> events.stale_after_s 30).
    clock.t += 40
    d = pol.decide(request(k), list(s.pool))
    c = {x.endpoint: x for x in d.candidates}
    assert c[endpoint(0)].note == "stale_events" and c[endpoint(0)].credit == 0.5
    # warm: (10 - 5) + 6 + 10 = 21 > cold: 10 + 10 = 20 → spill, and the reason says why.
    assert d.endpoint == endpoint(1) and d.reason is Reason.STALE_EVENTS
    # The stream speaks again: full credit.
    ev.st[endpoint(0)].last_event_at = clock.t
    d = pol.decide(request(k), list(s.pool))
    assert d.endpoint == endpoint(0) and d.reason is Reason.KV_HIT
    assert {x.endpoint: x for x in d.candidates}[endpoint(0)].credit == 1.0


def test_silent_stream_of_an_idle_worker_is_not_stale() -> None:
    s = make(1, events=True)
    pol = s.policy
    clock = Clock()
    pol.clock = clock
    ev = Events()
    ev.st[endpoint(0)] = Status(last_event_at=clock.t - 500)  # silent, but nobody sent work
    s.ctx.parts.events = ev
    hold(s.index, endpoint(0), keys(4))
    w = s.pool.workers[endpoint(0)]
    assert not pol.plugin("dynamo_cost").stream_stale(w, clock.t)


def test_unrecovered_gap_cuts_credit() -> None:
    s = make(2, events=True, options={"credit_decay": 0})
    ev = Events()
    ev.st[endpoint(0)] = Status(last_event_at=s.policy.clock(), unrecovered_gap=True)
    ev.st[endpoint(1)] = Status(last_event_at=s.policy.clock())
    s.ctx.parts.events = ev
    k = keys(10)
    hold(s.index, endpoint(0), k)
    hold(s.index, endpoint(1), k[:8])
    d = s.policy.decide(request(k), list(s.pool))
    # gapped: (10 - 5) + 10 = 15 vs healthy: (10 - 8) + 10 = 12
    assert d.endpoint == endpoint(1) and d.reason is Reason.STALE_EVENTS
