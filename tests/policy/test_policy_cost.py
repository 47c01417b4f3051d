"""The kv policy's cost function on worked examples, credit decay, busy filter, temperature."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from cost_spec import cost, decayed_credit
from kvpolicy_helpers import endpoint, hold, keys, make, request

from scorer.policy.cost import pick, softmax_probabilities
from scorer.routing import Reason


def set_load(s, i: int, prefill: float = 0.0, decode: float = 0.0, requests: int = 0) -> None:
    wl = s.pool.workers[endpoint(i)].inflight
    wl.prefill_blocks = prefill
    wl.decode_blocks = decode
    wl.requests = requests


def fresh_scrape(s, i: int, waiting: float = 0.0, kv_usage: float = 0.0, gpu_blocks=None):
    sc = s.pool.workers[endpoint(i)].scraped
    sc.waiting = waiting
    sc.kv_usage = kv_usage
    sc.num_gpu_blocks = gpu_blocks
    sc.at = s.policy.clock()


def by_ep(d):
    return {c.endpoint: c for c in d.candidates}


def test_dynamo_design_doc_example_w2_wins() -> None:
    """Dynamo's router design doc: W1 = 8 + 10, W2 = 5 + 5 (chosen), W3 = 2 + 9.

    Reconstructed in our form (request of 4 blocks, prefill_load_scale 1):
    W1 caches nothing, 4 prefill blocks queued, 6 decoding → (4+4-0) + (6+4) = 8 + 10
    W2 caches 2 blocks, 3 queued, 1 decoding           → (3+4-2) + (1+4) = 5 + 5
    W3 caches the whole prompt, 2 queued, 5 decoding   → (2+4-4) + (5+4) = 2 + 9
    """
    s = make(3, options={"credit_decay": 0, "prefill_load_scale": 1.0})
    k = keys(4)
    hold(s.index, endpoint(1), k[:2])
    hold(s.index, endpoint(2), k)
    set_load(s, 0, prefill=4, decode=6)
    set_load(s, 1, prefill=3, decode=1)
    set_load(s, 2, prefill=2, decode=5)
    d = s.policy.decide(request(k), list(s.pool))
    c = by_ep(d)
    assert [c[endpoint(i)].cost for i in range(3)] == [18.0, 10.0, 11.0]
    assert [c[endpoint(i)].matched_blocks for i in range(3)] == [0, 2, 4]
    assert d.endpoint == endpoint(1)
    assert d.reason is Reason.KV_HIT
    assert d.matched_tokens == 2 * 16
    # The terms as printed in the diagram: prefill term + decode term.
    assert cost(1.0, 4, 6, 4, 0) == 8 + 10
    assert cost(1.0, 3, 1, 4, 2) == 5 + 5
    assert cost(1.0, 2, 5, 4, 4) == 2 + 9


def test_vllm_router_medium_example_gpu_beats_disk() -> None:
    """vllm-router v0.13: 12 blocks on DISK vs 10 on GPU — the GPU worker wins (weights
    GPU 1.0, DISK 0.05: 12 x 0.05 = 0.6 block of credit vs 10)."""
    s = make(2, options={"credit_decay": 0, "prefill_load_scale": 1.0})
    k = keys(12)
    hold(s.index, endpoint(0), k, medium="DISK")
    hold(s.index, endpoint(1), k[:10], medium="GPU")
    d = s.policy.decide(request(k), list(s.pool))
    c = by_ep(d)
    assert c[endpoint(0)].matched_blocks == 12
    assert c[endpoint(0)].overlap_by_medium == {"DISK": 12}
    assert c[endpoint(1)].overlap_by_medium == {"GPU": 10}
    assert c[endpoint(0)].cost == pytest.approx((12 - 0.6) + 12)
    assert c[endpoint(1)].cost == pytest.approx((12 - 10) + 12)
    assert d.endpoint == endpoint(1)
    assert d.reason is Reason.KV_HIT


def test_medium_credit_option_overrides_index_weights() -> None:
    s = make(2, options={"credit_decay": 0, "medium_credit": {"GPU": 1.0, "DISK": 1.0}})
    k = keys(12)
    hold(s.index, endpoint(0), k, medium="DISK")
    hold(s.index, endpoint(1), k[:10])
    d = s.policy.decide(request(k), list(s.pool))
    assert d.endpoint == endpoint(0)  # disk counts as much as GPU now: 12 > 10


def test_credit_decay_caps_a_hot_prefix() -> None:
    k = keys(10)

    def run(decay: float):
        s = make(2, options={"credit_decay": decay, "prefill_load_scale": 2.0})
        hold(s.index, endpoint(0), k)
        set_load(s, 0, decode=15)
        return s.policy.decide(request(k), list(s.pool))

    # Without decay the warm worker wins despite its load: 2·0 + 15 + 10 = 25 < 2·10 + 10.
    d0 = run(0.0)
    assert d0.endpoint == endpoint(0) and d0.reason is Reason.KV_HIT
    assert by_ep(d0)[endpoint(0)].cost == 25.0
    # decay 1: excess = (15 - 0) / max(0, 10, 1) = 1.5 → credit 1 / 2.5 = 0.4 → 4 blocks.
    d1 = run(1.0)
    w = by_ep(d1)[endpoint(0)]
    assert w.credit == pytest.approx(0.4)
    assert w.cost == pytest.approx(2 * (10 - 4) + 15 + 10)
    assert d1.endpoint == endpoint(1) and d1.reason is Reason.LOAD


def test_decayed_credit_definition() -> None:
    assert decayed_credit(5, 5, 10, 1.0) == 1.0  # the least loaded keeps full credit
    assert decayed_credit(30, 10, 4, 0.5) == pytest.approx(1 / (1 + 0.5 * 2))  # /max(10,4)
    assert decayed_credit(30, 0, 0, 1.0) == pytest.approx(1 / 31)  # /max(0,0,1)
    assert decayed_credit(30, 0, 10, 0.0) == 1.0


def test_ties_go_to_least_loaded_then_random() -> None:
    rng = random.Random(1)
    # Equal cost: the one with less load wins every time.
    assert pick([10.0, 10.0], [(5.0, 1), (3.0, 1)].__getitem__, 0.0, rng) == 1
    # Equal cost and load: both win sometimes.
    loads = [(1.0, 0), (1.0, 0), (0.0, 0)]
    wins = Counter(pick([4.0, 4.0, 9.0], loads.__getitem__, 0.0, rng) for _ in range(200))
    assert set(wins) == {0, 1} and min(wins.values()) > 50


def test_busy_filter_removes_worker_over_waiting_threshold() -> None:
    s = make(2, options={"credit_decay": 0})
    k = keys(8)
    hold(s.index, endpoint(0), k)
    fresh_scrape(s, 0, waiting=6)  # >= busy_waiting 5
    d = s.policy.decide(request(k), list(s.pool))
    c = by_ep(d)
    assert c[endpoint(0)].filtered == "busy_waiting" and c[endpoint(0)].cost is None
    assert d.endpoint == endpoint(1) and d.reason is Reason.LOAD
    assert d.notes == ["spilled:busy_waiting"]  # the warm worker was skipped: say so


def test_busy_filter_kv_usage_and_inflight() -> None:
    s = make(3, options={"busy_inflight": 4})
    fresh_scrape(s, 0, kv_usage=0.85)
    set_load(s, 1, requests=4)
    d = s.policy.decide(request(keys(4)), list(s.pool))
    c = by_ep(d)
    assert c[endpoint(0)].filtered == "busy_kv_usage"
    assert c[endpoint(1)].filtered == "busy_inflight"
    assert d.endpoint == endpoint(2)


def test_stale_scrape_is_ignored_not_saturated() -> None:
    """A scrape older than load.stale_after_s does not make a worker busy (documented rule)."""
    s = make(2, options={"credit_decay": 0})
    k = keys(8)
    hold(s.index, endpoint(0), k)
    fresh_scrape(s, 0, waiting=50, kv_usage=0.99)
    s.pool.workers[endpoint(0)].scraped.at -= s.config.load.stale_after_s + 1
    d = s.policy.decide(request(k), list(s.pool))
    c = by_ep(d)[endpoint(0)]
    assert c.filtered is None and c.waiting == 0.0
    assert d.endpoint == endpoint(0) and d.reason is Reason.KV_HIT


def test_scraped_load_combines_with_inflight_by_max() -> None:
    s = make(2, options={"credit_decay": 0, "waiting_request_blocks": 10})
    set_load(s, 0, prefill=5, decode=100)
    fresh_scrape(s, 0, waiting=2, kv_usage=0.1, gpu_blocks=2000)
    d = s.policy.decide(request(keys(4)), list(s.pool))
    c = by_ep(d)[endpoint(0)]
    assert c.prefill_blocks == 20.0  # max(5 in flight, 2 waiting x 10)
    assert c.decode_blocks == 200.0  # max(100 in flight, 0.1 x 2000)
    assert d.endpoint == endpoint(1)


def test_all_busy_least_bad_wins_with_reason() -> None:
    s = make(2, options={"credit_decay": 0})
    fresh_scrape(s, 0, waiting=9)
    fresh_scrape(s, 1, waiting=7)
    set_load(s, 0, decode=50)
    d = s.policy.decide(request(keys(4)), list(s.pool))
    assert d.reason is Reason.BUSY_ALL and d.status == 200
    assert d.endpoint == endpoint(1)  # lower cost among the busy ones
    assert all(c.filtered is not None for c in d.candidates)


def test_all_busy_sheddable_gets_429_unless_disabled() -> None:
    s = make(2)
    for i in range(2):
        fresh_scrape(s, i, waiting=9)
    d = s.policy.decide(request(keys(4), sheddable=True), list(s.pool))
    assert d.status == 429 and d.reason is Reason.SHED and d.endpoints == []
    assert len(d.candidates) == 2
    s2 = make(2, options={"shed_when_busy": False})
    for i in range(2):
        fresh_scrape(s2, i, waiting=9)
    d2 = s2.policy.decide(request(keys(4), sheddable=True), list(s2.pool))
    assert d2.status == 200 and d2.reason is Reason.BUSY_ALL


def test_requests_without_tokens_route_by_load_with_reason() -> None:
    s = make(2)
    set_load(s, 0, decode=10)
    d = s.policy.decide(request(None, token_ids=None, prompt_tokens=64), list(s.pool))
    assert d.reason is Reason.NO_TOKENIZER and d.endpoint == endpoint(1)
    d = s.policy.decide(request(None, tokenize_error="bad template"), list(s.pool))
    assert d.reason is Reason.TOKENIZE_ERROR
    d = s.policy.decide(request(None, body=None, prompt_tokens=0), list(s.pool))
    assert d.reason is Reason.NO_BODY and d.endpoint == endpoint(1)


def test_speculative_insert_makes_a_burst_hit_the_same_worker() -> None:
    s = make(4)
    k = keys(32)
    first = s.policy.decide(request(k), list(s.pool))
    assert first.reason is Reason.LOAD
    # No events arrived yet; the next identical prompts still find the speculative blocks.
    for _ in range(3):
        d = s.policy.decide(request(k), list(s.pool))
        assert d.endpoint == first.endpoint and d.reason is Reason.KV_HIT
        assert d.matched_tokens == 32 * 16


def test_speculative_blocks_of_a_long_prompt_behind_a_queue_outlive_its_prefill() -> None:
    """The engine stores a long prompt step by step after the queue ahead: each block's
    TTL starts when the decision predicts it is prefilled (default prefill line: 20 ms +
    0.1 ms per token; queue 3,000 blocks = 4.82 s; 1.6 ms per block of 16 tokens; steps of
    8,192 tokens = 512 blocks end at +7.64, +8.46, +9.28, +10.02 s with the 2 s TTL)."""
    s = make(1)
    now = [50.0]
    s.index.clock = lambda: now[0]
    set_load(s, 0, prefill=3000)
    k = keys(2000)
    s.policy.decide(request(k), list(s.pool))
    now[0] += 2.5  # past the plain TTL: nothing is prefilled yet, so nothing expired
    assert s.index.match(k)[endpoint(0)].blocks == 2000
    now[0] = 58.0
    hold(s.index, endpoint(0), k[:1024])  # the first two steps' BlockStored
    now[0] = 59.0
    assert s.index.match(k)[endpoint(0)].blocks == 2000
    now[0] = 59.5  # the third step's blocks were never confirmed
    assert s.index.match(k)[endpoint(0)].blocks == 1024
    # index.speculative_ttl_max_s bounds the wait.
    s = make(1, index={"speculative_ttl_max_s": 5.0})
    s.index.clock = lambda: now[0]
    set_load(s, 0, prefill=3000)
    s.policy.decide(request(k), list(s.pool))
    now[0] += 4.9
    assert s.index.match(k)[endpoint(0)].blocks == 2000
    now[0] += 0.2
    assert s.index.match(k) == {}


def test_fallbacks_are_next_cheapest() -> None:
    s = make(3, options={"fallbacks": 2, "credit_decay": 0})
    set_load(s, 0, decode=30)
    set_load(s, 1, decode=10)
    d = s.policy.decide(request(keys(2)), list(s.pool))
    assert d.endpoints == [endpoint(2), endpoint(1), endpoint(0)]


def test_temperature_sampling_matches_softmax() -> None:
    """p_i ∝ exp(-(c_i - c_min) / ((c_max - c_min)·T)); seeded, chi-square bound."""
    costs = [10.0, 12.0, 20.0]
    loads = [(0.0, 0)] * 3
    temp = 0.5
    probs = softmax_probabilities(costs, temp)
    assert probs[0] > probs[1] > probs[2]
    n = 6000
    rng = random.Random(12345)
    counts = Counter(pick(costs, loads.__getitem__, temp, rng) for _ in range(n))
    chi2 = sum((counts[i] - n * p) ** 2 / (n * p) for i, p in enumerate(probs))
    assert chi2 < 13.8  # df = 2, p = 0.001
    # T = 0 is deterministic.
    assert {pick(costs, loads.__getitem__, 0.0, rng) for _ in range(50)} == {0}


def test_temperature_in_policy_spreads_decisions() -> None:
    s = make(3, options={"temperature": 1.0, "credit_decay": 0})
    set_load(s, 0, decode=0)
    set_load(s, 1, decode=5)
    set_load(s, 2, decode=10)
    wins = Counter(
        s.policy.decide(request(None, token_ids=None, prompt_tokens=32), list(s.pool)).endpoint
        for _ in range(600)
    )
    assert wins[endpoint(0)] > wins[endpoint(1)] > wins[endpoint(2)] > 0


def test_options_reject_unknown_keys() -> None:
    with pytest.raises(ValueError, match="bogus"):
        make(1, options={"bogus": 1})


def test_duplicate_cost_keeps_a_prefix_on_its_loaded_worker() -> None:
    """W0 holds 8 of 10 blocks but is loaded; W1 is idle and holds nothing.

    prefill_load_scale 1, no decay: W0 = (6 + 10 - 8) + (4 + 10) = 22, W1 = 10 + 10 = 20,
    so W1 wins and writes W0's 8 blocks a second time. With duplicate_cost 0.5 W1 pays
    0.5 x 8 = 4 more (24) and W0 (nothing duplicated) wins; the rows say why.
    """
    base = {"credit_decay": 0, "prefill_load_scale": 1.0}
    for dup, winner, costs in ((0.0, 1, [22.0, 20.0]), (0.5, 0, [22.0, 24.0])):
        s = make(2, options={**base, "duplicate_cost": dup})
        k = keys(10)
        hold(s.index, endpoint(0), k[:8])
        set_load(s, 0, prefill=6, decode=4)
        d = s.policy.decide(request(k), list(s.pool))
        c = by_ep(d)
        assert [c[endpoint(i)].cost for i in range(2)] == costs
        assert d.endpoint == endpoint(winner)
        shown = [c[endpoint(i)].as_dict()["duplicate_blocks"] for i in range(2)]
        assert shown == ([0.0, 0.0] if dup == 0 else [0.0, 8.0])


def test_queue_weight_prices_the_queue_the_duplicate_term_would_buy() -> None:
    """The duplicate-cost example above: W0 (8 of 10 blocks cached, 6 prefill blocks
    queued) wins 22 against 24. With queue_weight 0.5 its queue beyond W1's (6 blocks)
    costs 0.5 x 1 x 6 = 3 more (25): the idle W1 wins; the rows show the queue blocks.
    Off (0): the same costs as without the term and no queue shown."""
    base = {"credit_decay": 0, "prefill_load_scale": 1.0, "duplicate_cost": 0.5}
    for qw, winner, costs, queue in (
        (0.0, 0, [22.0, 24.0], [0.0, 0.0]),
        (0.5, 1, [25.0, 24.0], [6.0, 0.0]),
    ):
        s = make(2, options={**base, "queue_weight": qw})
        k = keys(10)
        hold(s.index, endpoint(0), k[:8])
        set_load(s, 0, prefill=6, decode=4)
        d = s.policy.decide(request(k), list(s.pool))
        c = by_ep(d)
        assert [c[endpoint(i)].cost for i in range(2)] == costs
        assert d.endpoint == endpoint(winner)
        assert [c[endpoint(i)].as_dict()["queue_blocks"] for i in range(2)] == queue


def test_queue_weight_is_not_cut_by_the_continuity_discount() -> None:
    """Continuity multiplies the previous turn's worker's cost by 1 - continuity, queue
    included; the queue term comes after it, at full price. W0 holds the whole 10-block
    prompt (the previous turn, no session id) with 30 prefill blocks queued; W1 is idle.
    Without the term W0 wins: 0.4 x ((30 + 10 - 10) + 10) = 16 against 20. With
    queue_weight 1: 16 + 30 = 46, and W1 wins."""
    base = {"credit_decay": 0, "prefill_load_scale": 1.0, "continuity": 0.6}
    for qw, winner in ((0.0, 0), (1.0, 1)):
        s = make(2, options={**base, "queue_weight": qw})
        k = keys(10)
        hold(s.index, endpoint(0), k)
        set_load(s, 0, prefill=30)
        d = s.policy.decide(request(k), list(s.pool))
        c = by_ep(d)
        assert c[endpoint(0)].cost == pytest.approx(16.0 + 30.0 * qw)
        assert c[endpoint(1)].cost == pytest.approx(20.0)
        assert d.endpoint == endpoint(winner)
