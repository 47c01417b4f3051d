"""The cost's step-sharing term (`step_share`): a long first chunk is priced by the requests
it would hold back on a worker where they wait for their first token."""

from __future__ import annotations

import pytest
from kvpolicy_helpers import endpoint, hold, keys, make, request

from scorer.pool.inflight import InflightTracker

# pls 10, no decay, budget 64 tokens = 4 blocks of 16.
BASE = {"credit_decay": 0, "prefill_load_scale": 10.0, "step_budget_tokens": 64}


def costs_and_winner(
    share: float, pending: int = 1, waiting: float | None = None, prefill: float = 1.0, **opts
):
    """A 10-block new prompt; W0 holds a short request before its first token (1 block
    of prefill), W1 decodes 20 blocks. Plain cost: W0 = 10 x (1 + 10) + 10 = 120, W1 =
    10 x 10 + 20 + 10 = 130."""
    s = make(2, options={**BASE, "step_share": share, **opts})
    w0 = s.pool.workers[endpoint(0)].inflight
    w0.prefill_blocks, w0.prefill_requests, w0.requests = prefill, pending, pending
    s.pool.workers[endpoint(1)].inflight.decode_blocks = 20.0
    if waiting is not None:
        sc = s.pool.workers[endpoint(0)].scraped
        sc.waiting, sc.at = waiting, s.policy.clock()
    d = s.policy.decide(request(keys(10)), list(s.pool))
    rows = {c.endpoint: c for c in d.candidates}
    return (
        [rows[endpoint(i)].cost for i in range(2)],
        [rows[endpoint(i)].as_dict()["share_blocks"] for i in range(2)],
        d.endpoint,
    )


def test_long_first_chunk_avoids_a_worker_where_a_request_waits_for_its_first_token() -> None:
    """Off: W0 wins (120 against 130) and its waiting request shares the new prompt's
    first step. step_share 1: W0 pays 10 x 1 request x 4 blocks (the first chunk, capped
    at the step budget, not the 10-block prompt) = 40 more, and the idle W1 wins."""
    assert costs_and_winner(0.0) == ([120.0, 130.0], [0.0, 0.0], endpoint(0))
    assert costs_and_winner(1.0) == ([160.0, 130.0], [4.0, 0.0], endpoint(1))
    # Two requests waiting there: each of them would wait for that chunk.
    assert costs_and_winner(0.5, pending=2)[0] == [160.0, 130.0]


def test_fresh_scraped_waiting_counts_when_it_is_larger() -> None:
    """The engine's queue (a fresh scrape) shows 3 waiting where the router counts 1
    (waiting_request_blocks 1: W0's active prefill max(1, 3 x 1) = 3 blocks): 3 requests
    x 4 blocks = 12, x 10 x 0.5 = 60 more on W0 (10 x 13 + 10 + 60 = 200)."""
    got, shown, winner = costs_and_winner(0.5, waiting=3.0, waiting_request_blocks=1.0)
    assert shown == [12.0, 0.0]
    assert got == [200.0, 130.0]
    assert winner == endpoint(1)


def test_only_the_requests_in_the_last_step_ahead_count() -> None:
    """With more than a step's budget queued (W0: 4 requests, 16 blocks of prefill, the
    budget 4 blocks), the new prompt's first chunk shares its step with the last budget
    of that queue only: 4 x 4 / 16 = 1 request, x 4 blocks = 4 (not 16). The queue
    itself is the prefill term's: 10 x (16 + 10) + 10 = 270, + 10 x 4 = 310."""
    got, shown, _ = costs_and_winner(1.0, pending=4, prefill=16.0)
    assert shown == [4.0, 0.0]
    assert got == [310.0, 130.0]


def test_cached_continuation_adds_no_chunk_and_is_not_moved() -> None:
    """A turn whose whole prompt is cached on W0 has no first chunk to add there: the
    term costs it nothing, whatever waits on W0; W1 (nothing cached, idle) pays nothing
    either, so the costs are the plain ones."""
    for share in (0.0, 2.0):
        s = make(2, options={**BASE, "step_share": share})
        k = keys(10)
        hold(s.index, endpoint(0), k)
        w0 = s.pool.workers[endpoint(0)].inflight
        w0.prefill_blocks, w0.prefill_requests, w0.requests = 3.0, 3, 3
        d = s.policy.decide(request(k), list(s.pool))
        rows = {c.endpoint: c for c in d.candidates}
        assert [rows[endpoint(i)].cost for i in range(2)] == [10 * 3 + 10, 10 * 10 + 10]
        assert rows[endpoint(0)].share_blocks == 0.0
        assert d.endpoint == endpoint(0)


def test_ms_unit_prices_a_block_of_chunk_at_the_fitted_ms_per_block() -> None:
    """unit ms: one block of shared chunk costs step_share x the prefill model's ms per
    block (the defaults: 0.1 ms per token x 16 = 1.6 ms), as the queue term does."""
    got = []
    for share in (0.0, 1.0):
        s = make(2, options={**BASE, "unit": "ms", "step_share": share})
        w0 = s.pool.workers[endpoint(0)].inflight
        w0.prefill_blocks, w0.prefill_requests, w0.requests = 1.0, 1, 1
        d = s.policy.decide(request(keys(10)), list(s.pool))
        got.append({c.endpoint: c.cost for c in d.candidates})
    assert got[1][endpoint(0)] - got[0][endpoint(0)] == pytest.approx(4 * 1.6)
    assert got[1][endpoint(1)] == got[0][endpoint(1)]


def test_tracker_counts_requests_before_their_first_byte() -> None:
    t = InflightTracker()
    a, b = t.load("a:1"), t.load("b:1")
    t.routed("r1", "a:1", 32, 2.0, 2.0)
    t.routed("r2", "a:1", 32, 2.0, 2.0)
    t.routed("r3", "a:1", 32, 2.0, 2.0)
    assert a.prefill_requests == 3
    t.first_byte("r1")
    t.first_byte("r1")  # once only
    assert a.prefill_requests == 2
    t.finished("r1")  # decoding when it ended: not in prefill
    t.finished("r2")  # ended before its first byte
    assert a.prefill_requests == 1
    t.moved("r3", "b:1")  # a fallback served it, still before its first byte
    assert (a.prefill_requests, b.prefill_requests) == (0, 1)
    t.routed("r4", "b:1", 32, 2.0, 2.0)
    assert t.drop_endpoint("b:1") == 2
    assert b.prefill_requests == 0


def test_evicted_conversation_pays_the_term_inside_its_continuity_discount() -> None:
    """kv's defaults (continuity_evicted 0.3), a conversation whose 12-block turn finds
    its context evicted; its previous worker holds one short request before its first
    token, the other worker is idle. Plain: previous 0.7 x (10 x (1 + 12) + 12) = 99.4,
    other 10 x 12 + 12 = 132. The term (1 request x the 4-block chunk x 10 = 40) enters
    before the discount: 0.7 x 182 = 127.4, and the turn stays (added after it, 139.4
    moved the conversation off its worker: the new prompts' writes there then evicted
    the contexts of the conversations between turns, docs/policy.md "Step sharing")."""
    got = []
    for share in (0.0, 1.0):
        s = make(
            2,
            options={"speculative": False, "step_budget_tokens": 64, "step_share": share},
            plain=False,
        )
        k = keys(12)
        prev = s.endpoints.index(s.policy.decide(request(k[:10]), list(s.pool)).endpoint)
        w = s.pool.workers[endpoint(prev)].inflight
        w.prefill_blocks, w.prefill_requests, w.requests = 1.0, 1, 1
        d = s.policy.decide(request(k), list(s.pool))
        rows = {c.endpoint: c for c in d.candidates}
        assert rows[endpoint(prev)].as_dict()["terms"]["evicted"] is True
        got.append((rows[endpoint(prev)].cost, rows[endpoint(1 - prev)].cost, d.endpoint))
        assert d.endpoint == endpoint(prev)
    assert got[0][:2] == (pytest.approx(99.4), pytest.approx(132.0))
    assert got[1][:2] == (pytest.approx(127.4), pytest.approx(132.0))


def test_kv_prices_step_sharing_by_default() -> None:
    """kv's shipped options: a new 10-block prompt leaves the worker where a short
    request waits for its first token (cheaper by 2 blocks of decode without the term)
    for the idle one; `approx` keeps the plain cost."""
    for policy, want in (("kv", 1), ("approx", 0)):
        s = make(2, policy, options={"step_budget_tokens": 64}, plain=False)
        w = s.pool.workers[endpoint(0)].inflight
        w.prefill_blocks, w.prefill_requests, w.requests = 1.0, 1, 1
        s.pool.workers[endpoint(1)].inflight.decode_blocks = 20.0
        d = s.policy.decide(request(keys(10, base=77)), list(s.pool))
        assert d.endpoint == endpoint(want)
        assert {c.endpoint: c.share_blocks for c in d.candidates}[endpoint(0)] == 4.0 * want
