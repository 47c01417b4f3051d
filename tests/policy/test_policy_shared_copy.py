"""The cost's shared-prefix copy term (`shared_copy`): a request opening a new session pays
for the blocks of a cached shared prefix (an app's system prompt) it would write again on
a worker that does not hold it, after the session spread, amortised over the mean
requests per named session."""

from __future__ import annotations

from kvpolicy_helpers import endpoint, hold, keys, make, request

# pls 1, no decay: the costs are small integers.
BASE = {"credit_decay": 0, "prefill_load_scale": 1.0, "session_spread": 1.0}


def setup(copy: float, **opts):
    """W0 holds the shared prefix (8 of 10 blocks) and serves two live sessions; W1 holds
    nothing and serves none."""
    s = make(2, options={**BASE, "shared_copy": copy, **opts})
    hold(s.index, endpoint(0), keys(10)[:8])
    now = s.policy.clock()
    scorer = s.policy.scorers[0]
    scorer.sessions.put("old1", endpoint(0), now)
    scorer.sessions.put("old2", endpoint(0), now)
    return s


def place(s, session: str | None = "new", k: list[int] | None = None):
    d = s.policy.decide(request(keys(10) if k is None else k, session_id=session), list(s.pool))
    rows = {c.endpoint: c for c in d.candidates}
    return (
        [rows[endpoint(i)].cost for i in range(2)],
        [rows[endpoint(i)].as_dict()["copy_blocks"] for i in range(2)],
        d.endpoint,
    )


def test_a_new_session_pays_for_copying_the_shared_prefix_after_the_spread() -> None:
    """Plain cost: W0 = 2 + 10 = 12, W1 = 10 + 10 = 20; the spread makes W0's x (1 + 2 /
    1) = 36 and the new session goes to W1, writing the 8 shared blocks a second time.
    shared_copy 3 (no session seen yet: 1 request per session): W1 pays 3 x 1 x 8 = 24
    more (not scaled by the spread), 44 against 36, and W0 keeps the prefix's sessions."""
    assert place(setup(0.0)) == ([36.0, 20.0], [0.0, 0.0], endpoint(1))
    assert place(setup(3.0)) == ([36.0, 44.0], [0.0, 8.0], endpoint(0))


def test_the_copy_is_amortised_over_the_requests_per_session() -> None:
    """Sessions that send 3 requests each (a coding agent's long ones send dozens) spread
    their load over their turns, the copy is written once: W1 pays 3 / 3 x 8 = 8, 28
    against 36, and the new session goes to W1 as without the term."""
    counted = make(2, options={**BASE, "shared_copy": 3.0})
    assert counted.policy.scorers[0].session_turns() == 1.0  # none seen yet
    for i in range(2):
        for _ in range(3):
            place(counted, session=f"seen{i}", k=keys(2, base=5000 + 100 * i))
    assert counted.policy.scorers[0].session_turns() == 3.0
    s = setup(3.0)
    for _ in range(2):
        s.policy.scorers[0]._count_turn(opened=True)
        s.policy.scorers[0]._count_turn(opened=False)
        s.policy.scorers[0]._count_turn(opened=False)
    assert place(s) == ([36.0, 28.0], [0.0, 8.0], endpoint(1))


def test_only_a_new_session_pays() -> None:
    """An old session's next turn (continuity's, not the spread's) and a request without
    a session id are placed by the cost as before: no copy term, the plain costs."""
    for session in ("old1", None):
        costs, shown, _ = place(setup(3.0), session=session)
        assert shown == [0.0, 0.0]
        assert costs == [12.0, 20.0]


def test_kv_ships_it_off() -> None:
    assert make(2, plain=False).policy.scorers[0].options.shared_copy == 0.0
