"""scorer.decisions.DecisionLog: a bounded ring, newest first; size 0 keeps nothing."""

from __future__ import annotations

from scorer.decisions import DecisionLog
from scorer.routing import Decision, Reason


def _d(rid: str) -> Decision:
    d = Decision(["127.0.0.1:9001"], Reason.LOAD, "kv")
    d.request_id = rid
    return d


def test_ring_keeps_the_newest_and_a_disabled_log_nothing() -> None:
    log = DecisionLog(2)
    for rid in ("a", "b", "c"):
        log.add(_d(rid))
    assert len(log) == 2
    assert [q["request_id"] for q in log.query()] == ["c", "b"]
    off = DecisionLog(0)
    off.add(_d("a"))
    assert len(off) == 0 and off.query() == []
