"""The decision path's hand-written loops and conditionals against the builtins they
replace (issue 14: `min` / `max` parse keyword arguments, `rng.choice` is two Python
frames, options are read once): the same winner, the same rng state after, the same
float objects' bits (`repr`), including NaN, -0.0 and infinities, and every option
carried over."""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from typing import Any

import pytest
from hypo import scaled
from hypothesis import example, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from scorer.index.match import Match
from scorer.policy.cost import (
    BusyOptions,
    BusyRule,
    CostModelOptions,
    CostParams,
    FleetInputs,
    pick,
)
from scorer.policy.fleet import life_factor, own_blocks

# Floats the costs could hold at the edges: signed zeros, NaN, infinities, ties.
_edge = st.sampled_from([0.0, -0.0, 1.0, 1.0 + 1e-12, 2.0, -3.5, math.nan, math.inf, -math.inf])
_cost = st.one_of(_edge, st.floats(-1e6, 1e6, allow_nan=False), st.floats(allow_nan=True))


def _pick_reference(
    costs: Sequence[float],
    tiebreak: Callable[[int], tuple[float, ...]],
    temperature: float,
    rng: random.Random,
) -> int:
    """`cost.pick` as it was written with the builtins (before issue 14's loops)."""
    n = len(costs)
    if n == 1:
        return 0
    c_min = min(costs)
    if temperature > 0.0:
        c_max = max(costs)
        if c_max > c_min:
            scale = (c_max - c_min) * temperature
            weights = [math.exp(-(c - c_min) / scale) for c in costs]
            return rng.choices(range(n), weights=weights)[0]
    limit = c_min + 1e-9 * max(1.0, abs(c_min))
    j = costs.index(c_min)
    if min([*costs[:j], *costs[j + 1 :]]) > limit:
        return j
    tied = [i for i in range(n) if costs[i] <= limit]
    keyed = [(tiebreak(i), i) for i in tied]
    best = min(k for k, _ in keyed)
    tied = [i for k, i in keyed if k == best]
    return tied[0] if len(tied) == 1 else rng.choice(tied)


@settings(max_examples=scaled(300))
@given(
    costs=st.lists(_cost, min_size=1, max_size=9),
    loads=st.lists(st.tuples(st.sampled_from([0.0, 1.0, 2.0]), st.integers(0, 2)), min_size=9),
    temperature=st.sampled_from([0.0, 0.0, 0.5]),
    seed=st.integers(0, 2**32),
)
@example(costs=[4.0, 4.0], loads=[(1.0, 0)] * 9, temperature=0.0, seed=1)  # a tie: the rng
@example(costs=[math.nan, 1.0], loads=[(0.0, 0)] * 9, temperature=0.0, seed=1)
@example(costs=[1.0, math.nan, 0.5], loads=[(0.0, 0)] * 9, temperature=0.0, seed=1)
@example(costs=[0.0, -0.0, 0.0], loads=[(0.0, 0)] * 9, temperature=0.0, seed=3)
@example(costs=[-0.0, 0.0], loads=[(1.0, 1), (1.0, 0)] + [(0.0, 0)] * 7, temperature=0.0, seed=3)
@example(costs=[5.0, 5.0, 5.0, 5.0, 5.0], loads=[(0.0, 0)] * 9, temperature=0.0, seed=7)
def test_pick_is_the_builtins_pick(
    costs: list[float], loads: list[tuple[float, int]], temperature: float, seed: int
) -> None:
    # The compiled pick (temperature 0), the Python one, the builtins' one: the same winner
    # and the same draws (later decisions stay the same).
    rngs = [random.Random(seed) for _ in range(3)]
    out: list[int | type[Exception]] = []
    for run, rng in zip(
        (
            lambda r: pick(costs, loads.__getitem__, temperature, r),
            lambda r: pick(costs, loads.__getitem__, temperature, r, native=False),
            lambda r: _pick_reference(costs, loads.__getitem__, temperature, r),
        ),
        rngs,
        strict=True,
    ):
        try:
            out.append(run(rng))
        except ValueError as e:  # (a NaN lowest cost: min() of nothing tied)
            out.append(type(e))
    assert out[0] == out[1] == out[2]
    assert rngs[0].getstate() == rngs[1].getstate() == rngs[2].getstate()


class _Counted(random.Random):
    """A Random subclass (its own `choice`): pick must call it, not inline Random's."""

    chosen = 0

    def choice(self, seq: Sequence[Any]) -> Any:
        self.chosen += 1
        return seq[-1]


@pytest.mark.parametrize("native", [True, False])
def test_pick_calls_a_subclass_choice(native: bool) -> None:
    rng = _Counted(1)
    assert pick([2.0, 2.0, 2.0], lambda i: (), 0.0, rng, native) == 2
    assert rng.chosen == 1


def test_pick_refuses_what_the_reference_refuses() -> None:
    for native in (True, False):
        with pytest.raises(IndexError):
            pick([], lambda i: (), 0.0, random.Random(1), native)
        with pytest.raises(ValueError):  # a NaN lowest cost ties nothing
            pick([math.nan, 1.0], lambda i: (), 0.0, random.Random(1), native)


def _minmax(x: float, lo: float, hi: float) -> float:
    return min(max(x, lo), hi)


@settings(max_examples=scaled(300))
@given(a=_cost, b=_cost, lo=_cost, hi=_cost, q=_cost)
@example(a=-0.0, b=0.0, lo=0.0, hi=1.0, q=0.0)
@example(a=0.0, b=0.0, lo=-0.0, hi=1.0, q=0.0)
@example(a=math.nan, b=0.0, lo=0.0, hi=1.0, q=1.0)
@example(a=2.0, b=0.0, lo=0.0, hi=math.nan, q=1.0)
def test_clamps_are_the_builtins(a: float, b: float, lo: float, hi: float, q: float) -> None:
    fleet = FleetInputs((a, b, lo, hi), 1.0, 16, {})
    qq = q if q > 0.0 else 0.0
    assert repr(fleet.ttft_ms(q)) == repr(1000.0 * _minmax(a + b * qq, lo, hi))
    # life_factor: min(max(left / span, 0.0), 1.0) whenever span > 0
    span = 0.5 * (abs(hi) if hi == hi else 1.0)
    if span > 0.0 and math.isfinite(span):
        want = _minmax((a - b) / span, 0.0, 1.0)
        assert repr(life_factor(a, b, abs(hi) if hi == hi else 1.0, 0.5)) == repr(want)


@settings(max_examples=scaled(200))
@given(
    held=st.dictionaries(st.sampled_from("abcdef"), st.integers(0, 9), min_size=1),
    previous=st.sampled_from("abcdefg"),
)
@example(held={"a": 3, "b": 3}, previous="a")
@example(held={"a": 0}, previous="a")
def test_own_blocks_is_the_builtins(held: dict[str, int], previous: str) -> None:
    matches = {e: Match(b, {"GPU": b}, float(b)) for e, b in held.items()}
    eps = [*held, "g"]
    m = matches.get(previous)
    if m is None:
        want = 0
    else:
        other = max((x.blocks for e in eps if e != previous and (x := matches.get(e))), default=0)
        want = max(m.blocks - other, 0)
    assert own_blocks(previous, matches, eps) == want


def test_cost_params_carry_every_option() -> None:
    # A new option must be read into CostParams too (dynamo_costs reads only CostParams).
    assert set(CostParams.__slots__) == set(CostModelOptions.model_fields)
    assert set(BusyRule.__slots__) == set(BusyOptions.model_fields)
    # Values that are no field's default, so a crossed wire shows.
    raw: dict[str, Any] = {
        "prefill_load_scale": 3.0, "medium_credit": {"GPU": 0.9}, "credit_decay": 0.2,
        "stale_credit": 0.25, "duplicate_cost": 4.0, "unit": "ms",
        "decode_ms_per_block": 0.7, "block_life": True, "life_rate": "routed",
        "life_window_s": 11.0, "life_fade": 0.1, "continuity": 0.3,
        "continuity_own_blocks": True, "continuity_min_match": 0.05, "session_spread": 2.0,
        "session_weight": "blocks", "infer_conversations": True,
        "conversation_spread": 3.0, "max_conversations": 17, "continuity_evicted": 0.15,
        "session_live_s": 12.0, "session_rebalance": 0.4, "queue_weight": 0.6,
        "step_share": 0.8, "step_budget_tokens": 123, "shared_copy": 0.9,
    }  # fmt: skip
    assert set(raw) == set(CostModelOptions.model_fields)
    o = CostModelOptions(**raw)
    p = CostParams(o)
    assert {k: getattr(p, k) for k in CostParams.__slots__} == raw
    b = BusyOptions(busy_waiting=2.0, busy_kv_usage=0.5, busy_inflight=3, shed_when_busy=False)
    r = BusyRule(b)
    assert {k: getattr(r, k) for k in BusyRule.__slots__} == b.model_dump()


def test_options_are_frozen() -> None:
    # Read once at construction: a later change could not be seen, so it is refused.
    o = CostModelOptions()
    with pytest.raises(ValidationError):
        o.credit_decay = 0.5  # type: ignore[misc]
