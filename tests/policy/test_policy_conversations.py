"""Conversations without a session id (infer_conversations, continuity_evicted): recognised
by their prompts' block chains, spread when they open, kept on their worker when evicted."""

from __future__ import annotations

from collections import Counter

from kvpolicy_helpers import endpoint, hold, keys, make, request

from scorer.policy.fleet import _GRID, Conversations

# kv's shipped defaults; speculative inserts off so the index holds only what a test puts
# there (an empty index: every conversation's blocks evicted).
OPTS = {"speculative": False}


def set_load(s, i: int, prefill: float = 0.0, decode: float = 0.0) -> None:
    wl = s.pool.workers[endpoint(i)].inflight
    wl.prefill_blocks = prefill
    wl.decode_blocks = decode


def terms(d, i: int) -> dict:
    row = next(c for c in d.candidates if c.endpoint == endpoint(i))
    return row.as_dict()["terms"]


def test_eight_conversations_without_ids_open_four_and_four() -> None:
    """Worker 0 is always a little lighter when a conversation opens (load noise): by
    cost alone every conversation opens there. Counted as live conversations, they open
    4 / 4, and each one's later turns stay where it opened, although nothing of it is
    cached (evicted) and worker 0 stays the lighter one."""
    s = make(2, options=OPTS, plain=False)
    set_load(s, 1, decode=5)
    first = {}
    for c in range(8):
        d = s.policy.decide(request(keys(10, base=1000 * (c + 1))), list(s.pool))
        first[c] = d.endpoint
        assert terms(d, 0)["conversation"] == "new"
    assert Counter(first.values()) == {endpoint(0): 4, endpoint(1): 4}
    for turn in (12, 14):
        for c in range(8):
            d = s.policy.decide(request(keys(turn, base=1000 * (c + 1))), list(s.pool))
            assert d.endpoint == first[c]
            assert terms(d, 0)["conversation"] == "continued"
            i = s.endpoints.index(first[c])
            assert terms(d, i)["previous_turn"] is True and terms(d, i)["evicted"] is True


def test_evicted_conversation_stays_unless_another_is_clearly_better() -> None:
    s = make(2, options=OPTS, plain=False)
    k = keys(12)
    prev = s.endpoints.index(s.policy.decide(request(k[:10]), list(s.pool)).endpoint)
    # Its blocks are gone (nothing in the index); its worker is now somewhat busier.
    set_load(s, prev, decode=20)
    d = s.policy.decide(request(k), list(s.pool))
    assert d.endpoint == endpoint(prev)
    t = terms(d, prev)
    assert (t["previous_turn"], t["own_blocks"], t["evicted"]) == (True, 0, True)
    # Much busier (a deep prefill queue): the other worker is clearly better.
    set_load(s, prev, prefill=30, decode=20)
    d = s.policy.decide(request(k + keys(2, base=50)), list(s.pool))
    assert d.endpoint == endpoint(1 - prev)
    # Off (the old behaviour): the somewhat busier worker loses the evicted conversation.
    s = make(2, options={**OPTS, "continuity_evicted": 0.0}, plain=False)
    prev = s.endpoints.index(s.policy.decide(request(k[:10]), list(s.pool)).endpoint)
    set_load(s, prev, decode=20)
    assert s.policy.decide(request(k), list(s.pool)).endpoint == endpoint(1 - prev)


def test_shared_system_prompt_requests_still_spread_by_load() -> None:
    """Independent requests behind one system prompt (both workers hold it; some prompts
    are only the system prompt in full blocks) name no conversation of each other's: none
    is pinned to the worker of an earlier one, and they spread as the load grows."""
    system = keys(8)
    s = make(2, options=OPTS, plain=False)
    hold(s.index, endpoint(0), system)
    hold(s.index, endpoint(1), system)
    load = [0.0, 0.0]
    got: Counter[str] = Counter()
    labels: Counter[str] = Counter()
    for r in range(12):
        # Every third prompt is the system prompt alone (its question under a block).
        k = system if r % 3 == 0 else system + keys(2, base=100 * (r + 1))
        d = s.policy.decide(request(k), list(s.pool))
        got[d.endpoint] += 1
        labels[terms(d, 0)["conversation"]] += 1
        i = s.endpoints.index(d.endpoint)
        load[i] += 10.0
        set_load(s, i, prefill=load[i])
    assert got[endpoint(0)] == got[endpoint(1)] == 6
    # A prompt that is only the shared part may be taken for the first turn of the next
    # longer one (at most once each: 4 such prompts here), never more: no pinning.
    assert labels["continued"] <= 4


def test_identical_heads_are_a_shared_prefix_but_a_restart_is_not() -> None:
    cv = Conversations()
    system = keys(8)
    a, b = cv.new(), cv.new()
    cv.record(system, a)
    cv.record(system, b)  # two conversations end on the same chain: shared, names neither
    assert cv.find(system + keys(2, base=50)) is None
    # A conversation that went on past its first turn, replayed from the start (a client
    # restarting it): the new head is recognised on its next turn.
    k = keys(30, base=7000)
    c = cv.new()
    cv.record(k[:10], c)
    cv.record(k[:20], c)
    d = cv.new()
    cv.record(k[:10], d)
    assert cv.find(k[:20]) == d


def test_conversations_recognise_extensions_not_forks() -> None:
    cv = Conversations()
    a = keys(40)
    assert cv.find(a[:20]) is None
    c = cv.new()
    cv.record(a[:20], c)
    assert cv.find(a[:20]) is None  # no longer: not a continuation
    assert cv.find(a[:33]) == c
    cv.record(a[:33], c)
    assert cv.find(a) == c
    # A second extension of the old turn (a fork: another request behind the same 20
    # blocks) continues nothing.
    assert cv.find(a[:20] + keys(10, base=9000)) is None
    # A prompt that shares a long prefix but not the whole previous prompt: new.
    assert cv.find(a[:30] + keys(10, base=9000)) is None


def test_conversations_long_prompts_and_bounds() -> None:
    """Hostile input: many distinct prompts keep the state bounded; long prompts are found
    through the grid (every 16th block, then 4 a doubling)."""
    cv = Conversations(max_entries=50)
    long = keys(5000)
    c = cv.new()
    cv.record(long[:4321], c)
    assert cv.find(long) == c
    for j in range(1000):
        cv.record(keys(30, base=10_000 * (j + 2)), cv.new())
    assert len(cv) <= 50 and len(cv._anchors) <= 50
    assert sum(map(len, cv._anchors.values())) <= 50 * cv.bucket
    assert cv.find(long) is None  # forgotten (least recently used)
    # The grid: every 16th block below 256, then 4 positions a doubling.
    assert [g for g in _GRID if 255 <= g < 1000] == [255, 319, 383, 447, 511, 639, 767, 895]


def test_approx_and_plain_kv_infer_nothing() -> None:
    assert make(2, policy="approx").policy.scorers[0].convos is None
    assert make(2).policy.scorers[0].convos is None
    assert make(2, plain=False).policy.scorers[0].options.infer_conversations
