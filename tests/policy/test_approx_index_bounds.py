"""The decision-fed index (policy `approx`) is bounded by the live pool: a worker that
leaves takes what it was sent along (at once for lookups, at a key's next touch for
memory), a hot key never grows with every pod ever routed to it, and a worker joining
again at an address starts empty."""

from __future__ import annotations

from kvpolicy_helpers import endpoint, keys, make, request

from scorer.policy.approx_index import ApproxIndex
from scorer.routing import Reason


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_a_hot_key_holds_only_live_workers_through_pod_churn() -> None:
    """Before: every pod ever routed a hot prefix stayed in its holder list (200 pods x 8
    keys); now the holders are bounded by the live pool x keys."""
    s = make(2, policy="approx", options={"ttl_s": 120})
    approx = s.policy.scorers[0].approx
    assert approx is not None
    wc = s.pool.workers[endpoint(0)].config
    hot = keys(8)
    s.policy.decide(request(hot), [s.pool.workers[endpoint(0)]])
    for i in range(2, 202):
        ep = endpoint(i)
        w = s.pool.add(wc.model_copy(update={"endpoint": ep}), "ready")
        d = s.policy.decide(request(hot), [w])
        assert d.endpoint == ep
        s.pool.remove(ep, "deleted")
    assert len(approx) == len(hot)
    assert sum(map(len, approx._entries.values())) <= len(s.pool.workers) * len(hot)
    assert approx.match(hot).keys() == {endpoint(0)}


def test_a_worker_that_rejoins_at_its_address_inherits_nothing() -> None:
    s = make(2, policy="approx", options={"ttl_s": 120, "credit_decay": 0})
    k = keys(20)
    d1 = s.policy.decide(request(k), list(s.pool))
    gone = d1.endpoint
    wc = s.pool.workers[gone].config
    assert s.policy.decide(request(k), list(s.pool)).reason is Reason.KV_HIT
    s.pool.remove(gone, "deleted")
    s.pool.add(wc, "ready")  # a new pod at the same address: an empty cache
    d3 = s.policy.decide(request(k), list(s.pool))
    assert d3.reason is Reason.LOAD and d3.matched_tokens == 0


def test_touching_a_key_drops_expired_and_dead_holders() -> None:
    clock = Clock()
    ix = ApproxIndex(ttl_s=10.0, max_keys=100, clock=clock)
    for ep in ("a", "b", "c"):
        ix.insert(ep, [1, 2])
    ix._holders["c"].live = False  # left without a sweep (as while one runs)
    del ix._holders["c"]
    clock.t += 11  # a's and b's entries expire
    ix.insert("a", [1])
    # Key 1: more holders than live workers when touched, so the dead and expired left.
    assert {h.endpoint for h in ix._entries[1]} == {"a"}
    assert len(ix._entries[2]) == 3  # untouched
    # a holds 1 again, 2 no more (expired); b's expired and c's dead holders never count.
    assert {ep: m.blocks for ep, m in ix.match([1, 2]).items()} == {"a": 1}


def test_forget_is_at_once_for_lookups_and_in_place_at_the_next_touch() -> None:
    clock = Clock()
    ix = ApproxIndex(ttl_s=100.0, max_keys=1000, clock=clock)
    ix.insert("a", list(range(10)))
    ix.insert("b", list(range(10)))
    ix.forget("a")
    ix.forget("never-seen")  # nothing to do
    assert ix.match(list(range(10))).keys() == {"b"}
    assert ix.holders() == 20  # O(1): no scan of every key
    ix.insert("c", list(range(5)))  # touched keys drop a's dead holder
    for k in range(5):
        assert {h.endpoint for h in ix._entries[k]} == {"b", "c"}
    for k in range(5, 10):
        assert len(ix._entries[k]) == 2  # untouched: a's holder stays, never counted
    assert {e: m.blocks for e, m in ix.match(list(range(10))).items()} == {"b": 10, "c": 5}
    ix.insert("a", [7])  # a new worker at a's address: only what it is sent now
    assert {e: m.blocks for e, m in ix.match([7, 8]).items()} == {"a": 1, "b": 2}
    assert ix.holders() == 10 + 5 + 5 + 1
