"""round_robin, random and least_loaded over a real Pool and its in-flight tracker."""

from __future__ import annotations

import random

from configs import make_config

from scorer.policy.base import PolicyContext, build_policy
from scorer.pool.workers import Pool
from scorer.routing import Reason, RoutingRequest

EPS = ["127.0.0.1:8001", "127.0.0.1:8002", "127.0.0.1:8003"]


def setup(name: str, **opts: object) -> tuple[Pool, object]:
    cfg = make_config(EPS, policy=name)
    pool = Pool.from_config(cfg)
    ctx = PolicyContext(pool=pool, config=cfg, rng=random.Random(7))
    return pool, build_policy(name, ctx, dict(opts))


def req(i: int = 0) -> RoutingRequest:
    return RoutingRequest(request_id=f"r{i}", model="m")


def test_round_robin_cycles() -> None:
    pool, pol = setup("round_robin")
    cands = pool.eligible("m", None)
    got = [pol.decide(req(i), cands).endpoint for i in range(6)]  # type: ignore[attr-defined]
    assert got == EPS + EPS


def test_random_spreads_and_reports_reason() -> None:
    pool, pol = setup("random")
    cands = pool.eligible("m", None)
    ds = [pol.decide(req(i), cands) for i in range(60)]  # type: ignore[attr-defined]
    assert {d.endpoint for d in ds} == set(EPS)
    assert {d.reason for d in ds} == {Reason.RANDOM}


def test_least_loaded_follows_inflight() -> None:
    pool, pol = setup("least_loaded", fallbacks=1)
    pool.inflight.routed("a", EPS[0], prompt_tokens=100)
    pool.inflight.routed("b", EPS[1], prompt_tokens=100)
    d = pol.decide(req(), pool.eligible("m", None))  # type: ignore[attr-defined]
    assert d.endpoint == EPS[2] and d.reason == Reason.LOAD
    assert len(d.endpoints) == 2  # one fallback
    assert {c.endpoint for c in d.candidates} == set(EPS)
    # Same request count: fewer prompt tokens waiting for the first byte wins.
    pool.inflight.routed("c", EPS[2], prompt_tokens=500)
    pool.inflight.first_byte("a")
    d = pol.decide(req(), pool.eligible("m", None))  # type: ignore[attr-defined]
    assert d.endpoint == EPS[0]
    pool.inflight.finished("b")
    d = pol.decide(req(), pool.eligible("m", None))  # type: ignore[attr-defined]
    assert d.endpoint == EPS[1]
