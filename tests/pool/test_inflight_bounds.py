"""The in-flight tracker's memory: bounded by the pool and the requests in flight."""

from __future__ import annotations

from configs import make_config

from scorer.pool.workers import Pool

EPS = ["127.0.0.1:8001", "127.0.0.1:8002"]


def test_served_elsewhere_counts_only_while_in_flight() -> None:
    """Envoy may serve a request on a host outside the pool (a fallback, a worker that
    just left): that host is counted while the request is in flight, then forgotten; a
    pool worker keeps its counters (the object its Worker reads)."""
    pool = Pool.from_config(make_config(EPS))
    tracker = pool.inflight
    member = pool.workers[EPS[0]].inflight
    for i in range(500):
        rid = f"r{i}"
        tracker.routed(rid, EPS[0], prompt_tokens=10, prefill_blocks=1.0, total_blocks=2.0)
        outside = f"10.9.{i // 250}.{i % 250}:8000"
        tracker.moved(rid, outside)
        assert tracker.loads[outside].requests == 1 and member.requests == 0
        if i % 2:
            tracker.first_byte(rid)
            tracker.generated(rid, 3.0)
            assert tracker.loads[outside].decode_blocks == 5.0
        tracker.finished(rid)
        assert outside not in tracker.loads
    assert set(tracker.loads) == set(EPS)
    assert tracker.loads[EPS[0]] is member and member.routed_total == 500
    # A worker that left the pool and is then reported as the served host: the same.
    pool.remove(EPS[1], "deleted")
    tracker.routed("late", EPS[0])
    tracker.moved("late", EPS[1])
    tracker.finished("late")
    assert set(tracker.loads) == {EPS[0]} and len(tracker) == 0
