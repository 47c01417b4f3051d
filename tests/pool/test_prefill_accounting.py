"""Engine-true load accounting: prefill ends when the engine says so (first body chunk of a
stream), or at the fitted estimate when nothing will say so in time; decode grows with
generated tokens; the request ends at end of stream."""

from __future__ import annotations

import asyncio
import json

import pytest

from scorer.config import load_config
from scorer.director import Director
from scorer.policy.base import PolicyContext, build_policy
from scorer.pool.prefill import PrefillModel
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
    dec = asyncio.run(d.request_received(req, body))
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
