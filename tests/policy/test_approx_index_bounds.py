"""The decision-fed index (policy `approx`) is bounded by the live pool: a worker that
leaves takes what it was sent along (at once for lookups, in chunks for memory), a hot key
never grows with every pod ever routed to it, and a worker joining again at an address
starts empty."""

from __future__ import annotations

import asyncio

import pytest
from kvpolicy_helpers import endpoint, keys, make, request

from scorer.policy import approx_index
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
    assert approx.holders() <= len(s.pool.workers) * len(hot)
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


def test_forget_sweeps_in_chunks_and_keeps_a_new_incarnations_keys(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(approx_index, "SWEEP_CHUNK", 10)
    clock = Clock()
    ix = ApproxIndex(ttl_s=100.0, max_keys=1000, clock=clock)
    ix.insert("a", list(range(100)))
    ix.insert("b", list(range(50)))

    async def run() -> None:
        ix.forget("a")
        # No lookup counts a from the departure on, before the sweep reaches its keys.
        assert ix.match(list(range(100))).keys() == {"b"}
        assert ix.holders() == 150 - 10  # one chunk so far
        ix.insert("a", [0, 1, 99])  # a new pod at a's address, routed during the sweep
        for _ in range(100):  # bounded: 10 keys per loop turn
            if ix._sweep is None:
                break
            await asyncio.sleep(0)
        assert ix._sweep is None

    asyncio.run(run())
    assert ix.holders() == 50 + 3
    assert ix.match([0, 1]).keys() == {"a", "b"}
    assert ix.match([99]).keys() == {"a"}
    assert len(ix) == 51


def test_forget_without_a_loop_sweeps_at_once_and_departures_during_a_sweep_are_swept() -> None:
    clock = Clock()
    ix = ApproxIndex(ttl_s=100.0, max_keys=1000, clock=clock)
    for ep in ("a", "b", "c"):
        ix.insert(ep, list(range(30)))
    ix.forget("a")
    assert ix.holders() == 60 and ix._sweep is None

    async def run() -> None:
        approx_index.SWEEP_CHUNK, chunk = 5, approx_index.SWEEP_CHUNK
        try:
            ix.forget("b")
            ix.forget("c")  # while b's sweep runs: swept after it
            for _ in range(100):
                if ix._sweep is None:
                    break
                await asyncio.sleep(0)
        finally:
            approx_index.SWEEP_CHUNK = chunk

    asyncio.run(run())
    assert ix.holders() == 0 and len(ix) == 0
