"""Engine-true load accounting: prefill ends when the engine says so (first body chunk of a
stream), or at the fitted estimate when nothing will say so in time; decode grows with
generated tokens; the request ends at end of stream."""

from __future__ import annotations

import json

import pytest
from configs import run_on_default_loop

from scorer.config import load_config
from scorer.director import Director
from scorer.policy.base import PolicyContext, build_policy
from scorer.pool.prefill import PrefillModel, scrape_correction
from scorer.pool.scrape import LoadScraper, ParsedMetrics
from scorer.pool.workers import Pool

EP = "127.0.0.1:7001"


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def director() -> tuple[Director, Clock]:
    cfg = load_config(
        overrides={"pool": {"workers": [EP], "block_size": 16}, "policy": "round_robin"},
        environ={},
    )
    pool = Pool.from_config(cfg)
    d = Director(cfg, pool, build_policy("round_robin", PolicyContext(pool=pool, config=cfg), {}))
    clock = Clock()
    d.clock = clock
    return d, clock


def route(d: Director, rid: str, stream: bool) -> None:
    body = json.dumps({"model": "m", "prompt": "x" * 640, "stream": stream}).encode()
    req = d.new_request({"x-request-id": rid})
    dec = run_on_default_loop(d.request_received(req, body))
    assert dec.endpoints == [EP]


def test_prefill_model_fits_the_observed_line() -> None:
    m = PrefillModel()
    assert m.estimate(1000) == pytest.approx(0.02 + 0.1)  # defaults before min_samples
    for tokens in [100, 400, 800, 1600, 3200, 50, 2500, 1200, 900, 3000]:
        m.observe(tokens, 0.05 + 0.001 * tokens)
    assert m.estimate(2000) == pytest.approx(2.05, rel=1e-6)
    m.observe(100, -1.0)  # nonsense is ignored
    assert m.estimate(0) == pytest.approx(0.05, rel=1e-6)


def test_stream_prefill_ends_at_the_first_body_chunk_and_decode_grows() -> None:
    d, clock = director()
    load = d.pool.inflight.load(EP)
    route(d, "s1", stream=True)
    assert load.prefill_tokens > 0
    # Headers of a stream come before prefill ends: still prefilling.
    d.response_started("s1", 200, None, "text/event-stream", bodies=True)
    assert load.prefill_tokens > 0 and load.decode_blocks == 0
    clock.t += 0.5
    d.response_chunk("s1", b'data: {"t": 1}\n\n', False)
    assert load.prefill_tokens == 0
    decode0 = load.decode_blocks
    assert d.prefill.samples == 1
    d.response_chunk("s1", b'data: {"t": 2}\n\n' * 32, False)  # 32 tokens = 2 blocks
    assert load.decode_blocks == pytest.approx(decode0 + 2.0)
    d.response_chunk("s1", b"data: [DONE]\n\n", True)
    assert len(d) == 0 and load.requests == 0
    assert load.decode_blocks == pytest.approx(0.0, abs=1e-9)


def test_non_streaming_prefill_ends_at_the_estimate_before_headers() -> None:
    d, clock = director()
    load = d.pool.inflight.load(EP)
    route(d, "n1", stream=False)
    assert d.expire_prefill() == 0 and load.prefill_tokens > 0
    clock.t += d.prefill.estimate(10_000)  # past the estimate for this prompt
    assert d.expire_prefill() == 1
    assert load.prefill_tokens == 0 and load.decode_blocks > 0
    # vLLM sends a non-streaming response's headers at the end: nothing changes then.
    d.response_started("n1", 200, None, "application/json", bodies=False)
    d.response_ended("n1")
    assert load.requests == 0 and load.decode_blocks == pytest.approx(0.0, abs=1e-9)


def test_stream_without_bodies_waits_for_the_estimate_not_the_headers() -> None:
    d, clock = director()
    load = d.pool.inflight.load(EP)
    route(d, "s2", stream=True)
    d.response_started("s2", 200, None, "text/event-stream", bodies=False)
    assert load.prefill_tokens > 0
    clock.t += 3600
    route(d, "s3", stream=True)  # a decision runs the expiry first
    assert d.pool.inflight._flights["s2"].in_prefill is False


# -- the scrape corrects the estimate (scorer.pool.prefill.scrape_correction) -------------


def test_scrape_correction_rule() -> None:
    # The engine holds fewer requests than the seen ones we count as prefilling: end the
    # surplus (oldest first); waiting requests hold that many of the newest.
    assert scrape_correction(seen=3, prefilling=4, running=1, waiting=0) == (2, 0)
    assert scrape_correction(seen=3, prefilling=4, running=2, waiting=1) == (0, 1)
    assert scrape_correction(seen=0, prefilling=4, running=0, waiting=0) == (0, 0)
    assert scrape_correction(seen=2, prefilling=2, running=0, waiting=5) == (0, 2)
    assert scrape_correction(seen=5, prefilling=5, running=0, waiting=0) == (5, 0)


def page(d: Director, running: float, waiting: float) -> None:
    """One good metrics page of the worker, through the scraper's own apply."""
    scraper = LoadScraper(d.config, d.pool)
    w = d.pool.get(EP)
    assert w is not None
    scraper.apply(w, ParsedMetrics(engine="vllm", running=running, waiting=waiting))


def prefilling(d: Director) -> list[str]:
    return [rid for rid, f in d.pool.inflight._flights.items() if f.in_prefill]


def test_scrape_ends_the_oldest_estimates_the_engine_no_longer_holds() -> None:
    d, _clock = director()
    page(d, 0, 0)
    for rid in ("a", "b", "c"):
        route(d, rid, stream=False)
    # Page 2 may have been requested before they were routed: it proves nothing.
    page(d, 0, 0)
    assert d.expire_prefill() == 0 and prefilling(d) == ["a", "b", "c"]
    # Page 3 was requested after: the engine holds 1 request, so 2 of ours are done.
    page(d, 1, 0)
    assert d.expire_prefill() == 2 and prefilling(d) == ["c"]
    load = d.pool.inflight.load(EP)
    assert load.requests == 3 and load.decode_blocks > 0
    # The same page again changes nothing; a newer one that holds c keeps it.
    assert d.expire_prefill() == 0
    page(d, 1, 0)
    assert d.expire_prefill() == 0 and prefilling(d) == ["c"]
    for rid in ("a", "b", "c"):
        d.response_started(rid, 200, None, "application/json")
        d.response_ended(rid)
    assert len(d) == 0 and load.requests == 0 and d._prefilling == {}


def test_waiting_requests_are_not_ended_by_the_estimate_alone() -> None:
    d, clock = director()
    page(d, 0, 0)
    route(d, "a", stream=False)
    route(d, "b", stream=False)
    page(d, 0, 0)
    page(d, 1, 1)  # one running, one queued: the newest of ours waits
    clock.t += 3600  # far past both estimates
    assert d.expire_prefill() == 1 and prefilling(d) == ["b"]
    # Still queued on the next page: still held, rechecked a scrape interval later.
    page(d, 1, 1)
    clock.t += d.config.load.scrape_interval_s
    assert d.expire_prefill() == 0 and prefilling(d) == ["b"]
    # The queue drained: the estimate (long past) ends it at the recheck.
    page(d, 1, 0)
    clock.t += d.config.load.scrape_interval_s
    assert d.expire_prefill() == 1 and prefilling(d) == []


def test_a_stale_page_holds_nothing() -> None:
    d, clock = director()
    page(d, 0, 0)
    route(d, "a", stream=False)
    page(d, 0, 0)
    page(d, 0, 3)
    clock.t += 1.0
    assert d.expire_prefill() == 0 and prefilling(d) == ["a"]  # held
    # No page since for longer than load.stale_after_s: the estimate alone decides.
    clock.t += d.config.load.stale_after_s + 1.0
    assert d.expire_prefill() == 1 and prefilling(d) == []


# -- vLLM's counters say how many it holds before the first token (issue 13) -------------


def test_scrape_correction_counts_only_requests_before_their_first_token() -> None:
    # Two held, both decoding (before_first 0): the seen ones are past prefill.
    assert scrape_correction(seen=2, prefilling=2, running=2, waiting=0, before_first=0) == (2, 0)
    # One of the two still prefilling: the older is done (first come, first served).
    assert scrape_correction(seen=2, prefilling=3, running=2, waiting=0, before_first=1) == (1, 0)
    # Unknown (SGLang, or the option off): every held request may be prefilling.
    assert scrape_correction(seen=2, prefilling=2, running=2, waiting=0) == (0, 0)


def counters_page(
    d: Director, running: float, waiting: float, firsts: float, finished: float
) -> None:
    """A metrics page with vLLM's first-token and finished counters."""
    scraper = LoadScraper(d.config, d.pool)
    w = d.pool.get(EP)
    assert w is not None
    scraper.apply(
        w,
        ParsedMetrics(
            engine="vllm", running=running, waiting=waiting, first_tokens=firsts, finished=finished
        ),
    )


def test_first_token_counts_end_prefill_of_requests_that_now_decode() -> None:
    d, _clock = director()
    counters_page(d, 0, 0, firsts=10, finished=10)
    for rid in ("a", "b", "c"):
        route(d, rid, stream=False)
    counters_page(d, 3, 0, firsts=10, finished=10)  # maybe requested before the routing
    assert d.expire_prefill() == 0
    # All three running; two have had their first token (12 - 10): a and b decode.
    counters_page(d, 3, 0, firsts=12, finished=10)
    w = d.pool.get(EP)
    assert w is not None and w.scraped.before_first == 1
    assert d.expire_prefill() == 2 and prefilling(d) == ["c"]
    # The running count alone (the old rule) would have ended none: all three are held.
    d2, _ = director()
    page(d2, 0, 0)
    for rid in ("a", "b", "c"):
        route(d2, rid, stream=False)
    page(d2, 3, 0)
    page(d2, 3, 0)
    assert d2.expire_prefill() == 0 and prefilling(d2) == ["a", "b", "c"]


def test_before_first_is_bounded_by_what_the_engine_holds() -> None:
    d, _clock = director()
    w = d.pool.get(EP)
    assert w is not None
    # An abort before the first token (finished, never a first token) is bounded by held.
    counters_page(d, 1, 1, firsts=3, finished=9)
    assert w.scraped.before_first == 2
    # Waiting requests are before their first token whatever the counters say.
    counters_page(d, 0, 2, firsts=9, finished=3)
    assert w.scraped.before_first == 2
    # A page whose counters are not finite says nothing.
    counters_page(d, 1, 0, firsts=float("inf"), finished=float("inf"))
    assert w.scraped.before_first is None
    # Without the counters (SGLang) or with the option off: unknown.
    page(d, 1, 0)
    assert w.scraped.before_first is None
    d.config.load.first_token_counts = False
    counters_page(d, 1, 0, firsts=3, finished=3)
    assert w.scraped.before_first is None


def test_counter_drift_is_re_anchored_when_the_count_leaves_the_possible() -> None:
    d, _clock = director()
    w = d.pool.get(EP)
    assert w is not None
    # A client aborted a request after its first token and vLLM never counted it finished:
    # idle now, the counters say one fewer than none before the first token.
    counters_page(d, 0, 0, firsts=50, finished=49)
    assert w.scraped.before_first == 0 and w.scraped.first_token_base == -1
    # Two running, one past its first token: 1 before it (the raw count would say 0 and
    # end both of ours there).
    counters_page(d, 2, 0, firsts=51, finished=49)
    assert w.scraped.before_first == 1
    # An abort before the first token counted finished: too many until the count is
    # impossible (over what is held), then held.
    counters_page(d, 1, 0, firsts=51, finished=52)
    assert w.scraped.before_first == 1 and w.scraped.first_token_base == 1
    counters_page(d, 0, 0, firsts=51, finished=52)
    assert w.scraped.before_first == 0
