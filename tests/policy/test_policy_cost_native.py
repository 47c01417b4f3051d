"""The cost function's compiled columns (scorer/native/_speedups.pyx: load_columns,
decay_credit, cost_column, cost_core) against their Python reference in
scorer.policy.cost: on random fleets the load table and every cost column are the same
objects' types and the same bits (`repr` of a float round-trips), so decisions cannot
differ."""

from __future__ import annotations

from typing import Any

import pytest
from hypo import scaled
from hypothesis import example, given, settings
from hypothesis import strategies as st

from scorer.config import WorkerConfig
from scorer.index.match import Match
from scorer.native import NATIVE
from scorer.policy.cost import BusyOptions, CostModelOptions, FleetInputs, dynamo_costs, load_table
from scorer.pool.inflight import WorkerLoad
from scorer.pool.workers import Worker

NOW = 1000.0
STALE_AFTER = 5.0

# Counts arrive as floats from the accounting, but an int must pass through unchanged too.
_num = st.one_of(st.integers(0, 5000), st.floats(0.0, 5000.0, allow_nan=False))
worker_st = st.fixed_dictionaries(
    {
        "prefill": _num,
        "decode": _num,
        "requests": st.integers(0, 12),
        # None: never scraped; else the scrape's age (fresh, at the edge, stale).
        "age": st.one_of(st.none(), st.sampled_from([0.0, STALE_AFTER]), st.floats(0.0, 50.0)),
        "waiting": st.floats(0.0, 10.0),
        "kv_usage": st.floats(0.0, 1.0),
        "gpu_blocks": st.sampled_from([None, 0, 100, 8192]),
        # Cached prefix: None, or (blocks, weighted overlap).
        "match": st.one_of(st.none(), st.tuples(st.integers(0, 600), st.floats(0.0, 600.0))),
        "stale": st.booleans(),
        "eligible": st.booleans(),
        # Requests before their first token (step sharing's count; an int, as counted).
        "prefill_requests": st.integers(0, 5),
    }
)
options_st = st.fixed_dictionaries(
    {
        "prefill_load_scale": st.sampled_from([0.0, 1.0, 2.5, 10.0]),
        "credit_decay": st.sampled_from([0.0, 0.05, 0.1, 1.0]),
        "duplicate_cost": st.sampled_from([0.0, 0.5, 12.0]),
        "stale_credit": st.sampled_from([0.5, 1.0]),
        "step_share": st.sampled_from([0.0, 1.0, 2.5]),
        "step_budget_tokens": st.sampled_from([16, 100, 8192]),
    }
)
busy_st = st.one_of(
    st.none(),
    st.fixed_dictionaries(
        {
            "busy_waiting": st.sampled_from([None, 3.0, 5]),
            "busy_kv_usage": st.sampled_from([None, 0.5, 0.8]),
            "busy_inflight": st.sampled_from([None, 1, 4]),
        }
    ),
)


def _workers(specs: list[dict[str, Any]]) -> list[Worker]:
    out = []
    for i, spec in enumerate(specs):
        w = Worker(WorkerConfig(endpoint=f"10.0.0.{i + 1}:8000"), WorkerLoad())
        w.inflight.prefill_blocks = spec["prefill"]
        w.inflight.decode_blocks = spec["decode"]
        w.inflight.requests = spec["requests"]
        w.inflight.prefill_requests = spec.get("prefill_requests", 0)
        if spec["age"] is not None:
            w.scraped.at = NOW - spec["age"]
            w.scraped.waiting = spec["waiting"]
            w.scraped.kv_usage = spec["kv_usage"]
            w.scraped.num_gpu_blocks = spec["gpu_blocks"]
        out.append(w)
    return out


def _same(a: list[Any] | None, b: list[Any] | None) -> None:
    assert (a is None) == (b is None)
    if a is not None and b is not None:
        assert [(type(x), repr(x)) for x in a] == [(type(x), repr(x)) for x in b]


_ONE = {
    "prefill": 3,
    "decode": 10.5,
    "requests": 4,
    "age": STALE_AFTER,
    "waiting": 5.0,
    "kv_usage": 0.8,
    "gpu_blocks": 100,
    "match": (4, 4.0),
    "stale": True,
    "eligible": True,
}


@settings(max_examples=scaled(200))
@given(
    specs=st.lists(worker_st, min_size=1, max_size=9),
    options=options_st,
    busy=busy_st,
    wrb=st.sampled_from([1.0, 12.0, 512.0]),
    rb=st.sampled_from([0.0, 1.0, 12.0, 512.0]),
    block_size=st.sampled_from([0, 16]),
    # The fleet terms' inputs: none, a continuing request, a new session (duplicate off).
    fleet=st.sampled_from([None, "continuing", "new_session"]),
)
@example(specs=[_ONE], options={}, busy={}, wrb=12.0, rb=12.0, block_size=0, fleet=None)
@example(
    specs=[_ONE, {**_ONE, "age": None, "match": None}],
    options={},
    busy=None,
    wrb=1.0,
    rb=0.0,
    block_size=0,
    fleet=None,
)
@example(  # step sharing over a queue deeper than the budget, a stale cached worker
    specs=[{**_ONE, "prefill": 40, "prefill_requests": 3}, {**_ONE, "stale": False}],
    options={"step_share": 1.0, "step_budget_tokens": 100, "duplicate_cost": 12.0},
    busy=None,
    wrb=1.0,
    rb=12.0,
    block_size=16,
    fleet="continuing",
)
@example(  # every cached overlap 0: the best held is the best cached one's
    specs=[{**_ONE, "match": (0, 0.0)}, {**_ONE, "match": None}],
    options={"duplicate_cost": 12.0},
    busy=None,
    wrb=1.0,
    rb=12.0,
    block_size=16,
    fleet=None,
)
def test_native_columns_are_the_reference_bits(
    specs: list[dict[str, Any]],
    options: dict[str, Any],
    busy: dict[str, Any] | None,
    wrb: float,
    rb: float,
    block_size: int,
    fleet: str | None,
) -> None:
    workers = _workers(specs)
    bo = None if busy is None else BusyOptions(**busy)
    ref = load_table(workers, NOW, STALE_AFTER, wrb, bo, native=False)
    nat = load_table(workers, NOW, STALE_AFTER, wrb, bo)
    for col in ("prefill", "decode", "waiting", "kv_usage", "busy"):
        _same(getattr(ref, col), getattr(nat, col))

    eps = [w.endpoint for w in workers]
    eligible = [i for i, s in enumerate(specs) if s["eligible"]] or list(range(len(specs)))
    matches = {
        eps[i]: Match(s["match"][0], {"GPU": s["match"][0]}, s["match"][1])
        for i, s in enumerate(specs)
        if s["match"] is not None
    }
    stale_of = {w.endpoint: s["stale"] for w, s in zip(workers, specs, strict=True)}

    def stale(w: Worker) -> bool:
        return stale_of[w.endpoint]

    opts = CostModelOptions(**options)

    def inputs() -> FleetInputs | None:
        if fleet is None:
            return None
        live = [float(i % 3) for i in eligible] if fleet == "new_session" else None
        return FleetInputs((0.01, 1e-5, 0.0, 5.0), 0.16, 16, {}, sessions=live)

    a = dynamo_costs(
        workers, eps, eligible, ref, matches, rb, opts, stale, inputs(), False, block_size
    )
    b = dynamo_costs(
        workers, eps, eligible, ref, matches, rb, opts, stale, inputs(), True, block_size
    )
    for col in ("costs", "weighted", "credit", "held", "share"):
        _same(getattr(a, col), getattr(b, col))
    _same([a.best_held], [b.best_held])
    assert (a.stale, a.stale_any, a.every) == (b.stale, b.stale_any, b.every)
    assert all(x is y for x, y in zip(a.matches, b.matches, strict=True))


def test_native_columns_refuse_what_the_reference_refuses() -> None:
    assert NATIVE is not None  # (tests/index/test_native.py says why when not)
    # Columns of different lengths (zip(strict=True) in the reference), an empty fleet (min()).
    with pytest.raises(ValueError):
        NATIVE.decay_credit([1.0], [1.0, 2.0], 1.0, 0.1)
    with pytest.raises(ValueError):
        NATIVE.decay_credit([], [], 1.0, 0.1)
    with pytest.raises(ValueError):
        NATIVE.cost_column([1.0], [1.0], [1.0], [1.0], [], 1.0, 1.0, 0.0, 0.0)
    # cost_core: columns of different lengths, a waiting column too short, an empty fleet
    # with credit decay (min() of nothing), matches that are not a dict.
    args: list[Any] = [[None], ["a"], [1.0], [1.0], None, 1.0, 0.1, None, 1.0, 0.0, False]
    with pytest.raises(ValueError):
        NATIVE.cost_core([None], ["a"], [1.0], [], *args[4:], 1.0, None, 1.0, False, 0.0)
    with pytest.raises(ValueError):
        NATIVE.cost_core(*args, 1.0, [], 1.0, False, 0.0)
    with pytest.raises(ValueError):
        NATIVE.cost_core([], [], [], [], *args[4:], 1.0, None, 1.0, False, 0.0)
    with pytest.raises(TypeError):
        NATIVE.cost_core(*args[:4], [("a", 1)], *args[5:], 1.0, None, 1.0, False, 0.0)


@settings(max_examples=scaled(100))
@given(
    held=st.lists(st.integers(0, 12), min_size=1, max_size=7),
    busy=st.lists(st.booleans(), min_size=7, max_size=7),
)
@example(held=[12, 12, 3], busy=[False] * 7)  # a shared prefix: no previous turn
@example(held=[9, 0, 0], busy=[False] * 7)  # no other holder: all its blocks are its own
@example(held=[9, 11, 4], busy=[False, True] + [False] * 5)  # the longest is filtered
def test_longest_prefix_finds_fleet_own_blocks(held: list[int], busy: list[bool]) -> None:
    # dynamo_cost names the previous turn's worker by the longest prefix and takes its own
    # blocks from the lists at hand; scorer.policy.fleet.own_blocks is the reference.
    from kvpolicy_helpers import endpoint, hold, keys, make, request

    from scorer.policy.fleet import own_blocks
    from scorer.policy.plugin import Cycle

    s = make(len(held), options={"continuity": 0.6, "continuity_min_match": 0.0})
    prompt = keys(12)
    for i, n in enumerate(held):
        if n:
            hold(s.index, endpoint(i), prompt[:n])
    workers = list(s.pool)
    scorer = s.policy.scorers[0]  # type: ignore[attr-defined]
    cycle = Cycle(request(prompt), workers, NOW, 16, 12.0, 5.0, 12.0, [None] * len(workers))
    cycle.eligible = [i for i in range(len(workers)) if not busy[i]] or [0]
    matches = cycle.matches(scorer.index())
    previous, own = scorer._previous(cycle, matches)
    if previous is None:
        assert own is None
        return
    eps = cycle.endpoints
    assert own == own_blocks(eps[previous], matches, [eps[i] for i in cycle.eligible])


def test_the_compiled_pass_is_the_one_taken(monkeypatch: pytest.MonkeyPatch) -> None:
    # The differential test above means something only if the native run takes cost_core.
    import types

    import scorer.policy.cost as cost

    assert cost._NATIVE_COST is not None
    calls: list[int] = []
    real = cost._NATIVE_COST

    def core(*args: Any) -> Any:
        calls.append(1)
        return real.cost_core(*args)

    workers = _workers([_ONE, {**_ONE, "match": None}])
    eps = [w.endpoint for w in workers]
    table = load_table(workers, NOW, STALE_AFTER, 1.0)
    proxy = types.SimpleNamespace(
        cost_core=core, decay_credit=real.decay_credit, cost_column=real.cost_column
    )
    monkeypatch.setattr(cost, "_NATIVE_COST", proxy)
    matches = {eps[0]: Match(4, {"GPU": 4}, 4.0)}
    opts = CostModelOptions(duplicate_cost=12.0, step_share=1.0)
    dynamo_costs(workers, eps, [0, 1], table, matches, 12.0, opts, None, None, True, 16)
    assert calls == [1]
    # medium_credit (weights per medium) is the Python columns' alone.
    opts = CostModelOptions(medium_credit={"GPU": 1.0})
    dynamo_costs(workers, eps, [0, 1], table, matches, 12.0, opts, None, None, True, 16)
    assert calls == [1]
