"""The cost's fleet terms: block life, predicted TTFT (ms unit), conversation continuity."""

from __future__ import annotations

import math

import pytest
from kvpolicy_helpers import endpoint, hold, keys, make, request

from scorer.policy.fleet import CacheLife, Sessions, life_factor, own_blocks
from scorer.pool.prefill import PrefillModel


def set_load(s, i: int, prefill: float = 0.0, decode: float = 0.0) -> None:
    wl = s.pool.workers[endpoint(i)].inflight
    wl.prefill_blocks = prefill
    wl.decode_blocks = decode


def by_ep(d):
    return {c.endpoint: c for c in d.candidates}


BASE = {"credit_decay": 0, "prefill_load_scale": 1.0}


def test_eviction_rate_counts_only_full_caches_and_decays() -> None:
    cl = CacheLife(window_s=10.0)
    cl.routed("a", [1, 2], written=50.0, now=0.0, full=False)
    assert cl.eviction_rate("a", 0.0) == 0.0
    assert cl.life_s("a", 1000.0, 0.0) is None  # nothing evicted: blocks live forever
    cl.routed("a", [1, 2], written=50.0, now=0.0, full=True)
    assert cl.eviction_rate("a", 0.0) == pytest.approx(5.0)  # 50 blocks / 10 s window
    assert cl.life_s("a", 1000.0, 0.0) == pytest.approx(200.0)
    assert cl.eviction_rate("a", 10.0) == pytest.approx(5.0 / math.e)
    assert cl.life_s("a", 0.0, 0.0) is None  # capacity unknown


def test_chain_age_at_the_deepest_remembered_position() -> None:
    cl = CacheLife(stride=4, max_entries=100)
    k = list(range(100, 110))  # 10 blocks: remembered at positions 3, 7 and 9 (the last)
    cl.routed("a", k, 0.0, now=5.0, full=False)
    cl.routed("a", k[:4], 0.0, now=8.0, full=False)  # refreshes positions 3
    assert cl.age_s("a", k, 10, 10.0) == pytest.approx(5.0)  # last block, routed at 5
    assert cl.age_s("a", k, 9, 10.0) == pytest.approx(5.0)  # position 7, routed at 5
    assert cl.age_s("a", k, 5, 10.0) == pytest.approx(2.0)  # position 3, refreshed at 8
    assert cl.age_s("a", k, 3, 10.0) is None  # below the first remembered position
    assert cl.age_s("b", k, 10, 10.0) is None
    assert cl.age_s("a", k, 0, 10.0) is None


def test_chain_ages_are_bounded() -> None:
    cl = CacheLife(stride=1, max_entries=5)
    cl.routed("a", list(range(20)), 0.0, now=1.0, full=False)
    assert cl.age_s("a", list(range(20)), 20, 2.0) == pytest.approx(1.0)
    assert cl.age_s("a", list(range(20)), 3, 2.0) is None  # oldest entries dropped


def test_life_factor_fades_over_the_last_part_of_life() -> None:
    assert life_factor(100.0, 0.0, 100.0, 0.25) == 1.0
    assert life_factor(20.0, 0.0, 100.0, 0.25) == pytest.approx(0.8)
    assert life_factor(20.0, 10.0, 100.0, 0.25) == pytest.approx(0.4)  # reached later
    assert life_factor(-5.0, 0.0, 100.0, 0.25) == 0.0
    assert life_factor(1.0, 0.0, 100.0, 0.0) == 1.0


def test_sessions_bounded_and_expiring() -> None:
    ss = Sessions(max_sessions=2, ttl_s=10.0)
    ss.put("s1", "a", 0.0)
    ss.put("s2", "b", 1.0)
    ss.put("s3", "c", 2.0)  # s1 dropped: bound
    assert ss.get("s1", 2.0) is None
    assert ss.get("s2", 2.0) == "b"
    assert ss.get("s3", 20.0) is None  # idle too long


def test_old_chain_on_a_full_cache_is_worth_less() -> None:
    """W0 holds the whole 10-block prompt, W1 nothing; W0 carries 3 queued blocks.

    Without block life W0 wins (3 + 10 - 10 = 3 vs 10). W0's cache (20 blocks) is full and
    100 blocks were written there 3 s ago (10-s window: 10 blocks/s then, 7.4/s now, so a
    block lives 2.7 s) by the request that last used this chain: no life left, so it
    earns no credit and the idle W1 wins.
    """
    k = keys(10)
    for life, winner in ((False, 0), (True, 1)):
        opts = {**BASE, "block_life": life, "life_window_s": 10.0, "life_rate": "routed"}
        s = make(2, options=opts)
        hold(s.index, endpoint(0), k)
        set_load(s, 0, prefill=3)
        w0 = s.pool.workers[endpoint(0)]
        w0.scraped.num_gpu_blocks = 20
        now = s.policy.clock()
        scorer = s.policy.scorers[0]
        if life:
            scorer.life.routed(endpoint(0), k, 100.0, now - 3.0, full=True)
        d = s.policy.decide(request(k), list(s.pool))
        assert d.endpoint == endpoint(winner)
        row = by_ep(d)[endpoint(0)].as_dict()
        if life:
            t = row["terms"]
            assert t["life_factor"] == 0.0
            assert t["chain_age_s"] == pytest.approx(3.0, abs=0.1)
            assert t["block_life_s"] == pytest.approx(20.0 / (10.0 * math.exp(-0.3)), rel=0.05)
        else:
            assert "terms" not in row


def test_eviction_rate_from_block_removed_counts() -> None:
    """`life_rate: events`: the rate is the worker's BlockRemoved count over time, as the
    index applied it (not the router's own writes). W0 holds the 10-block prompt and has
    removed 100 other blocks 3 s ago (10-s window): its 20-block cache turns over in
    ~2.7 s, the chain (routed 3 s ago) is gone by the block-life estimate, and W1 wins."""
    k = keys(10)
    s = make(2, options={**BASE, "block_life": True, "life_window_s": 10.0})
    scorer = s.policy.scorers[0]
    assert scorer.life.from_events
    hold(s.index, endpoint(0), k)
    set_load(s, 0, prefill=3)
    s.pool.workers[endpoint(0)].scraped.num_gpu_blocks = 20
    now = s.policy.clock()
    # A routed chain with many written blocks does not move the rate any more.
    scorer.life.routed(endpoint(0), k, 100.0, now - 3.0, full=True)
    assert scorer.life.eviction_rate(endpoint(0), now) == 0.0
    scorer.life.removed(endpoint(0), s.index.removed_total(endpoint(0)), now)
    assert scorer.life.life_s(endpoint(0), 20.0, now) is None  # nothing removed: no limit
    # The engine evicts 100 blocks (its BlockRemoved events, applied by the index).
    other = keys(100, base=9000)
    hold(s.index, endpoint(0), other)
    assert s.index.remove(endpoint(0), None, [x ^ 0x5A5A for x in other]) == (100, 0)
    assert s.index.removed_total(endpoint(0)) == 100
    assert s.index.stats(endpoint(0))["removed"] == 100
    d = s.policy.decide(request(k), list(s.pool))
    t = by_ep(d)[endpoint(0)].as_dict()["terms"]
    assert t["evictions_per_s"] == pytest.approx(10.0)  # 100 blocks / 10 s window
    assert t["block_life_s"] == pytest.approx(2.0)
    assert t["life_factor"] == 0.0  # routed 3 s ago: past its 2 s life
    assert d.endpoint == endpoint(1)


def test_approx_block_life_falls_back_to_routed_blocks() -> None:
    s = make(2, policy="approx", options={**BASE, "block_life": True})
    assert not s.policy.scorers[0].life.from_events


def test_ms_unit_prices_the_queue_and_the_uncached_prefill() -> None:
    """Predicted TTFT = the prefill model over (queued + uncached) tokens."""
    s = make(2, options={**BASE, "unit": "ms", "decode_ms_per_block": 0.0})
    model = PrefillModel(a=0.01, b=0.001)  # 10 ms + 1 ms per token: 16 ms per block
    s.ctx.parts.prefill = model
    k = keys(10)
    hold(s.index, endpoint(0), k[:6])
    set_load(s, 0, prefill=2)
    d = s.policy.decide(request(k), list(s.pool))
    c = by_ep(d)
    # W0: 2 queued + 4 uncached blocks = 96 tokens; W1: 10 blocks = 160 tokens.
    assert c[endpoint(0)].cost == pytest.approx(10.0 + 96.0)
    assert c[endpoint(1)].cost == pytest.approx(10.0 + 160.0)
    assert c[endpoint(0)].as_dict()["terms"]["predicted_ttft_ms"] == pytest.approx(106.0)
    assert d.endpoint == endpoint(0)


def test_continuity_keeps_the_sessions_previous_worker_unless_clearly_better() -> None:
    k = keys(10)
    # (The discount alone: unrelated prompts, so the own-blocks gate is off here.)
    s = make(2, options={**BASE, "continuity": 0.3, "continuity_own_blocks": False})
    first = s.policy.decide(request(k, session_id="s"), list(s.pool))
    prev = first.endpoint
    other = 1 - s.endpoints.index(prev)
    # The previous worker is now a little more loaded: it is kept (cost x 0.7).
    set_load(s, 1 - other, decode=4)
    d = s.policy.decide(request(keys(10, base=5000), session_id="s"), list(s.pool))
    assert d.endpoint == prev
    assert by_ep(d)[prev].as_dict()["terms"]["previous_turn"] is True
    # Much more loaded: another worker is clearly better and wins.
    set_load(s, 1 - other, decode=40)
    d = s.policy.decide(request(keys(10, base=6000), session_id="s"), list(s.pool))
    assert d.endpoint == endpoint(other)


def test_continuity_needs_blocks_only_the_previous_worker_holds() -> None:
    """`continuity_own_blocks`: a turn whose cached prefix is all shared (a system prompt
    both workers hold) has nothing to lose by moving: no discount, the idle worker wins
    (without the gate the discount keeps it on the busier one). Once the previous worker
    holds the conversation's own blocks, it is kept."""
    system = keys(4)
    second = system + keys(1, base=200)
    for gate in (True, False):
        s = make(2, options={**BASE, "continuity": 0.6, "continuity_own_blocks": gate})
        first = s.policy.decide(request(system + keys(1, base=100), session_id="s"), list(s.pool))
        prev = s.endpoints.index(first.endpoint)
        hold(s.index, endpoint(0), system)
        hold(s.index, endpoint(1), system)
        set_load(s, prev, decode=4)  # the previous worker is busier than the other
        d = s.policy.decide(request(second, session_id="s"), list(s.pool))
        t = by_ep(d)[endpoint(prev)].as_dict()["terms"]
        if not gate:
            assert d.endpoint == endpoint(prev) and t["previous_turn"] is True
            assert t["own_blocks"] is None
            continue
        assert d.endpoint == endpoint(1 - prev)
        assert t["previous_turn"] is False and t["own_blocks"] == 0
        # The conversation's own block now on the new worker: kept there although busier.
        now = 1 - prev
        hold(s.index, endpoint(now), second)
        set_load(s, prev, decode=0)
        set_load(s, now, decode=6)
        d = s.policy.decide(request(second + keys(1, base=300), session_id="s"), list(s.pool))
        assert d.endpoint == endpoint(now)
        t = by_ep(d)[endpoint(now)].as_dict()["terms"]
        assert t["previous_turn"] is True and t["own_blocks"] == 1


def test_own_blocks() -> None:
    class M:
        def __init__(self, blocks: int) -> None:
            self.blocks = blocks

    m = {"a": M(5), "b": M(3)}
    assert own_blocks("a", m, ["a", "b", "c"]) == 2
    assert own_blocks("b", m, ["a", "b"]) == 0  # another holds more: nothing of its own
    assert own_blocks("a", m, ["a", "c"]) == 5  # only eligible ones count
    assert own_blocks("c", m, ["a", "b", "c"]) == 0


def test_continuity_from_the_prefix_needs_one_holder_of_most_of_the_prompt() -> None:
    k = keys(10)
    s = make(3, options={**BASE, "continuity": 0.5})
    hold(s.index, endpoint(0), k[:8])
    set_load(s, 0, decode=6)
    d = s.policy.decide(request(k), list(s.pool))
    assert by_ep(d)[endpoint(0)].as_dict()["terms"]["previous_turn"] is True
    # Two workers hold the same prefix: no one previous turn.
    s = make(3, options={**BASE, "continuity": 0.5})
    hold(s.index, endpoint(0), k[:8])
    hold(s.index, endpoint(1), k[:8])
    d = s.policy.decide(request(k), list(s.pool))
    assert not any(c.as_dict()["terms"]["previous_turn"] for c in d.candidates)
    # A short shared prefix (under continuity_min_match) names no previous turn either.
    s = make(2, options={**BASE, "continuity": 0.5})
    hold(s.index, endpoint(0), k[:2])
    d = s.policy.decide(request(k), list(s.pool))
    assert not any(c.as_dict()["terms"]["previous_turn"] for c in d.candidates)


def test_live_sessions_counted_per_worker() -> None:
    ss = Sessions(max_sessions=10, ttl_s=10.0)
    ss.put("s1", "a", 0.0)
    ss.put("s2", "a", 1.0)
    ss.put("s1", "b", 2.0)  # s1 moved
    assert (ss.live("a"), ss.live("b")) == (1, 1)
    ss.put("s3", "b", 12.0)  # s2 idle past the TTL: dropped
    assert (ss.live("a"), ss.live("b")) == (0, 2)


def test_live_sessions_weighted_and_expired_after_live_s() -> None:
    ss = Sessions(max_sessions=10, ttl_s=100.0, live_s=10.0)
    ss.put("big", "a", 0.0, weight=300.0)
    ss.put("s1", "b", 1.0, weight=40.0)
    ss.put("s2", "b", 2.0, weight=40.0)
    assert (ss.live("a"), ss.live("b")) == (300.0, 80.0)
    ss.put("big", "a", 5.0, weight=310.0)  # it grew: the new weight replaces the old
    assert ss.live("a") == 310.0
    ss.expire(12.5)  # s1, s2 idle past live_s: no longer counted, still remembered
    assert (ss.live("a"), ss.live("b")) == (310.0, 0.0)
    assert ss.get("s1", 12.5) == "b"
    ss.put("s1", "b", 13.0, weight=50.0)  # back: counted again
    assert ss.live("b") == 50.0


def test_session_spread_by_blocks_and_its_explanation() -> None:
    """W0 hosts one large session (300 blocks), W1 three small ones (3 x 10 blocks).

    Counting sessions, the new session goes to W0 (1 live vs 3); weighing them by their
    blocks, to W1 (30 vs 300). The rows show each candidate's live weight.
    """
    k = keys(10)
    for weight, winner, shown in (("sessions", 0, (1.0, 3.0)), ("blocks", 1, (300.0, 30.0))):
        opts = {**BASE, "session_spread": 1.0, "continuity": 0.1, "session_weight": weight}
        s = make(2, options=opts)
        scorer = s.policy.scorers[0]
        now = s.policy.clock()
        w = 1.0 if weight == "sessions" else 300.0
        scorer.sessions.put("big", endpoint(0), now, w)
        for j in range(3):
            scorer.sessions.put(f"small{j}", endpoint(1), now, 1.0 if w == 1.0 else 10.0)
        d = s.policy.decide(request(k, session_id="new"), list(s.pool))
        assert d.endpoint == endpoint(winner)
        rows = by_ep(d)
        got = tuple(rows[endpoint(i)].as_dict()["terms"]["live_sessions"] for i in (0, 1))
        assert got == shown
        # An old session's next turn is not spread: no live weight shown.
        d = s.policy.decide(request(keys(10, base=7000), session_id="big"), list(s.pool))
        assert all(c.as_dict()["terms"]["live_sessions"] is None for c in d.candidates)


def test_session_weight_blocks_records_the_request_blocks() -> None:
    s = make(2, options={**BASE, "session_spread": 1.0, "session_weight": "blocks"})
    d = s.policy.decide(request(keys(12), session_id="s"), list(s.pool))
    assert s.policy.scorers[0].sessions.live(d.endpoint) == 12.0


def test_session_rebalance_moves_a_session_off_an_overloaded_worker() -> None:
    """W0 hosts three live sessions of 100 blocks, W1 none; "a"'s next turn is cached on W0.

    Off: continuity keeps "a" on W0. With session_rebalance 0.5, W0's 300 is over 1.5 x
    the mean (150) and moving "a" lowers the peak (200 > 0 + 100): it goes to W1, W0's row
    says why. With two sessions on W0 (200: 100 > 0 + 100 fails) it stays: moving would
    only move the peak.
    """
    k = keys(10)
    for n_sessions, rebalance, winner in ((3, 0.0, 0), (3, 0.5, 1), (2, 0.5, 0)):
        opts = {
            **BASE,
            "session_spread": 1.0,
            "continuity": 0.6,
            "session_weight": "blocks",
            "session_rebalance": rebalance,
        }
        s = make(2, options=opts)
        hold(s.index, endpoint(0), k[:9])
        scorer = s.policy.scorers[0]
        now = s.policy.clock()
        for name in ("a", "b", "c")[:n_sessions]:
            scorer.sessions.put(name, endpoint(0), now, 100.0)
        d = s.policy.decide(request(k, session_id="a"), list(s.pool))
        assert d.endpoint == endpoint(winner)
        left = by_ep(d)[endpoint(0)].as_dict()["terms"]["left_for_balance"]
        assert left == (winner == 1)
        assert scorer.sessions.weight("a") == 10.0  # its new weight: this request's blocks


def test_session_spread_places_a_new_session_away_from_busy_hosts() -> None:
    """W0 holds the shared system prompt (8 of 10 blocks) and already serves two sessions.

    Without spread the new session goes to W0 (cost 2 + 10 vs 10 + 10). With spread 1,
    W0's cost is x (1 + 2 / 1) = 36 and the new session goes to W1; an old session's next
    turn is not spread (it follows its previous worker).
    """
    k = keys(10)
    for spread, winner in ((0.0, 0), (1.0, 1)):
        opts = {**BASE, "session_spread": spread, "continuity": 0.1}
        s = make(2, options={**opts, "continuity_own_blocks": False})  # unrelated prompts
        hold(s.index, endpoint(0), k[:8])
        scorer = s.policy.scorers[0]
        now = s.policy.clock()
        scorer.sessions.put("old1", endpoint(0), now)
        scorer.sessions.put("old2", endpoint(0), now)
        d = s.policy.decide(request(k, session_id="new"), list(s.pool))
        assert d.endpoint == endpoint(winner)
        d = s.policy.decide(request(keys(10, base=7000), session_id="old1"), list(s.pool))
        assert d.endpoint == endpoint(0)


def test_kv_ships_the_fleet_terms_approx_keeps_the_plain_cost() -> None:
    kv = make(2, plain=False).policy.scorers[0].options
    approx = make(2, policy="approx").policy.scorers[0].options
    assert (kv.duplicate_cost, kv.continuity, kv.credit_decay) == (12.0, 0.6, 0.05)
    assert kv.session_spread > 0 and not kv.block_life and kv.unit == "blocks"
    assert kv.continuity_own_blocks and kv.life_rate == "events"
    assert (kv.session_weight, kv.session_live_s, kv.session_rebalance) == ("sessions", 600, 0)
    assert (approx.duplicate_cost, approx.continuity, approx.session_spread) == (0, 0, 0)
    assert approx.credit_decay == 0.1


def test_block_life_state_follows_the_pool() -> None:
    """A worker that leaves the pool takes its eviction rate and BlockRemoved count along:
    the block-life state is bounded by the live pool, not by every endpoint ever seen, and
    a worker that joins again at that address starts from no rate (as its index slot)."""
    s = make(2, options={**BASE, "block_life": True, "life_window_s": 10.0})
    life = s.policy.scorers[0].life
    gone = endpoint(1)
    wc = s.pool.workers[gone].config
    now = s.policy.clock()
    life.removed(gone, 100, now)
    life.removed(endpoint(0), 50, now)
    assert life.eviction_rate(gone, now) == pytest.approx(10.0)
    s.pool.remove(gone, "deleted")
    assert life.eviction_rate(gone, now) == 0.0
    assert life.eviction_rate(endpoint(0), now) == pytest.approx(5.0)  # stays
    s.pool.add(wc, "ready")
    life.removed(gone, 0, now)  # its new slot's count starts again at 0: no evictions
    assert life.eviction_rate(gone, now) == 0.0
    # Churn: many workers come and go; the state holds only the live ones.
    for i in range(2, 50):
        ep = endpoint(i)
        s.pool.add(wc.model_copy(update={"endpoint": ep}), "ready")
        life.removed(ep, i, now)
        life.routed(ep, [i], 1.0, now, full=True)
        s.pool.remove(ep, "deleted")
    assert set(life._rate) <= set(s.pool.workers)
    assert set(life._removed) <= set(s.pool.workers)
