"""The prefill model fitted from vLLM's counters when no response body reaches the scorer
(the lean Envoy shape, issue 13): a request the scrape correction ends had its first token
between two pages, and that bracket teaches the model (load.fit_prefill_from_scrapes)."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest
from configs import run_on_default_loop

from scorer.config import load_config
from scorer.director import Director
from scorer.policy.base import PolicyContext, build_policy
from scorer.pool.prefill import PrefillModel, bracketed_prefill
from scorer.pool.scrape import LoadScraper, ParsedMetrics
from scorer.pool.workers import Pool

EP = "127.0.0.1:7001"
INTERVAL = 0.2  # seconds between pages (load.scrape_interval_s)
ENGINE_PREFILL = 0.05  # the fake engine's real prefill of every prompt below
DECODE = 1.0  # and its decode, first token to finish


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def director(fit: bool = True) -> tuple[Director, Clock, LoadScraper]:
    cfg = load_config(
        overrides={
            "pool": {"workers": [EP], "block_size": 16},
            "policy": "round_robin",
            "load": {"fit_prefill_from_scrapes": fit},
        },
        environ={},
    )
    pool = Pool.from_config(cfg)
    d = Director(cfg, pool, build_policy("round_robin", PolicyContext(pool=pool, config=cfg), {}))
    clock = Clock()
    d.clock = clock
    return d, clock, LoadScraper(cfg, pool, clock=clock)


def route(d: Director, rid: str, stream: bool = True, chars: int = 40_000) -> None:
    # ~10,000 prompt tokens: the default estimate (20 ms + 0.1 ms/token) is ~1 s.
    body = json.dumps({"model": "m", "prompt": "x" * chars, "stream": stream}).encode()
    dec = run_on_default_loop(d.request_received(d.new_request({"x-request-id": rid}), body))
    assert dec.endpoints == [EP]


def lean_run(
    d: Director,
    clock: Clock,
    scraper: LoadScraper,
    pages: int,
    sizes: tuple[int, ...] = (40_000,),
    prefill: Callable[[int], float] = lambda chars: ENGINE_PREFILL,
) -> None:
    """A fake engine and its scrape sequence: one request routed every 0.1 s (streams whose
    body never reaches us, prompts of `sizes` characters in turn), each prefilled in
    `prefill(chars)` and done DECODE later (first come, first served); a page every
    INTERVAL with vLLM's counters as they would read."""
    w = d.pool.get(EP)
    assert w is not None
    routed: list[float] = []
    firsts_at: list[float] = []
    t0 = clock.t
    for step in range(pages * 2):
        clock.t = t0 + step * 0.1
        if step % 2 == 0:
            now = clock.t
            firsts = sum(1 for f in firsts_at if f <= now)
            finished = sum(1 for f in firsts_at if f + DECODE <= now)
            scraper.apply(
                w,
                ParsedMetrics(
                    engine="vllm",
                    running=len(routed) - finished,
                    waiting=0,
                    first_tokens=firsts,
                    finished=finished,
                ),
            )
        chars = sizes[step % len(sizes)]
        route(d, f"r{step}", chars=chars)
        # First come, first served: prefill starts when the one before has its first token.
        start = max(clock.t, firsts_at[-1] if firsts_at else 0.0)
        firsts_at.append(start + prefill(chars))
        routed.append(clock.t)
        d.response_started(f"r{step}", 200, None, "text/event-stream", bodies=False)


def test_bracketed_prefill_is_the_middle_of_the_pages_interval() -> None:
    # Held by the page at 10.2, over by the page at 10.4: 10.3 - 10.0.
    assert bracketed_prefill(10.0, 10.4, 10.2) == pytest.approx(0.3)
    # No page held it: anywhere since it was routed.
    assert bracketed_prefill(10.0, 10.4, None) == pytest.approx(0.2)
    # A page from before the routing bounds nothing.
    assert bracketed_prefill(10.0, 10.4, 9.0) == pytest.approx(0.2)
    assert bracketed_prefill(10.0, 9.0, None) == 0.0


def test_the_lean_shape_fits_the_prefill_from_the_counters() -> None:
    d, clock, scraper = director()
    tokens = 40_000 // 4
    assert d.prefill.estimate(tokens) == pytest.approx(1.02, rel=0.01)  # default, 20x slow
    lean_run(d, clock, scraper, pages=40)
    assert d.prefill.bracketed >= d.prefill.min_samples and d.prefill.exact == 0
    # Within one scrape interval of the engine's 50 ms, where the default said 1 s.
    assert d.prefill.estimate(tokens) <= ENGINE_PREFILL + INTERVAL
    # The estimate ends prefill now: requests routed a scrape interval ago decode.
    assert len([f for f in d.pool.inflight._flights.values() if f.in_prefill]) <= 3
    # /debug/pool shows the fit.
    assert d.pool.prefill is d.prefill
    resp = run_on_default_loop(scraper._debug_pool(None))  # type: ignore[arg-type]
    shown = json.loads(resp.text)["prefill"]
    assert shown["bracketed"] == d.prefill.bracketed
    assert shown["ms_per_token"] == pytest.approx(d.prefill.b * 1e3, abs=1e-6)


def test_the_fit_follows_the_prompt_size() -> None:
    d, clock, scraper = director()
    sizes = (8_000, 20_000, 40_000, 80_000)  # ~2k to ~20k prompt tokens

    def engine(chars: int) -> float:
        return 0.01 + 5e-6 * chars / 4  # 20 ms to 110 ms; the default says 0.2 s to 2 s

    lean_run(d, clock, scraper, pages=60, sizes=sizes, prefill=engine)
    assert d.prefill.bracketed >= d.prefill.min_samples
    for chars in sizes:
        # Within a scrape interval of the engine (the default was up to 1.9 s off).
        assert d.prefill.estimate(chars / 4) <= engine(chars) + INTERVAL
    assert d.prefill.estimate(20_000) > d.prefill.estimate(2_000)


def test_without_the_option_the_estimate_stays_the_default() -> None:
    d, clock, scraper = director(fit=False)
    lean_run(d, clock, scraper, pages=40)
    assert d.prefill.samples == 0
    assert d.prefill.estimate(10_000) == pytest.approx(1.02, rel=0.01)


def test_a_response_body_is_exact_and_brackets_are_ignored_after_it() -> None:
    d, clock, scraper = director()
    route(d, "s", stream=True)
    d.response_started("s", 200, None, "text/event-stream", bodies=True)
    clock.t += 0.05
    d.response_chunk("s", b'data: {"t": 1}\n\n', False)
    assert d.prefill.exact == 1
    lean_run(d, clock, scraper, pages=20)
    assert d.prefill.bracketed == 0 and d.prefill.samples == 1


def test_bracket_observations_feed_the_same_fit() -> None:
    m = PrefillModel()
    for tokens in [1000, 2000, 4000, 8000, 500, 3000, 6000, 7000]:
        m.observe(tokens, 0.01 + 1e-5 * tokens, exact=False)
    assert m.bracketed == 8 and m.exact == 0
    assert m.estimate(5000) == pytest.approx(0.06, rel=1e-6)
    assert m.view()["ms_per_token"] == pytest.approx(0.01)


def test_a_bracket_is_dated_by_the_pages_not_by_when_a_decision_notices_them() -> None:
    d, clock, scraper = director()
    w = d.pool.get(EP)
    assert w is not None

    def counters(firsts: int) -> None:
        held = ParsedMetrics(engine="vllm", running=1, waiting=0, first_tokens=firsts, finished=0)
        scraper.apply(w, held)

    scraper.apply(w, ParsedMetrics(engine="vllm", running=0, waiting=0, first_tokens=0, finished=0))
    clock.t += 0.01
    route(d, "a", stream=True)
    d.response_started("a", 200, None, "text/event-stream", bodies=False)
    clock.t += 0.19
    counters(0)  # +0.2: the engine holds a before its first token
    clock.t += 0.05
    assert d.expire_prefill() == 0
    clock.t += 0.15
    counters(1)  # +0.4: a had its first token since the last page
    clock.t += 0.6  # the next decision comes much later
    assert d.expire_prefill() == 1 and d.prefill.bracketed == 1
    # Held at +0.2, over by +0.4: the middle is 0.29 s after its routing at +0.01, not
    # (1.0 - 0.01) / 2 (when the decision noticed the page).
    assert d.prefill._sy == pytest.approx(0.29)
    # The fit's own bookkeeping keeps nothing of it.
    assert d._unfitted == {}


def test_a_request_younger_than_the_page_waits_for_the_next_one() -> None:
    d, clock, scraper = director()
    w = d.pool.get(EP)
    assert w is not None
    route(d, "a", stream=True)
    d.response_started("a", 200, None, "text/event-stream", bodies=False)
    clock.t += 0.01  # it may not have reached the engine: the page's 0 says nothing of it
    scraper.apply(w, ParsedMetrics(engine="vllm", running=0, waiting=0, first_tokens=0, finished=0))
    d.expire_prefill()
    assert d.prefill.samples == 0 and list(d._unfitted[EP]) == ["a"]
    # It ends with no page having dated its first token: nothing is learnt or kept.
    d.response_ended("a")
    assert d.prefill.samples == 0 and d._unfitted == {}
