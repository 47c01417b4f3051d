"""The engine keeps model time when its steps are shorter than asyncio's sleep granularity.

A fake clock stands in for time.monotonic and a fake sleep wakes on whole milliseconds, as
an epoll-based loop does: deterministic, no timing of the real machine.
"""

from __future__ import annotations

import asyncio
import math

import pytest

from kvscorer_tools.sim import engine as engine_mod
from kvscorer_tools.sim.engine import Engine, SimRequest
from kvscorer_tools.sim.metrics import SimMetrics
from kvscorer_tools.sim.timing import TimingModel


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def monotonic(self) -> float:
        return self.now


def run_one(monkeypatch: pytest.MonkeyPatch, speed: float, tokens: int) -> tuple[float, float]:
    """(wall seconds the request took on the fake clock, what the timing model says)."""
    clock = FakeClock()
    real_sleep = asyncio.sleep

    async def sleep_ms_granular(delay: float) -> None:
        if delay > 0:  # epoll_wait: whole milliseconds, rounded up
            clock.now += math.ceil(delay * 1000) / 1000
        await real_sleep(0)

    monkeypatch.setattr(engine_mod.time, "monotonic", clock.monotonic)
    monkeypatch.setattr(engine_mod.asyncio, "sleep", sleep_ms_granular)
    timing = TimingModel(speed=speed)

    async def go() -> float:
        eng = Engine(
            block_size=16, capacity_blocks=64, max_num_seqs=8, max_num_batched_tokens=8192,
            max_model_len=4096, vocab_size=32000, timing=timing,
            metrics=SimMetrics("m", 16, 64, 0), publisher=None, era="map", seed=0,
        )  # fmt: skip
        eng.start()
        req = SimRequest("r", list(range(1000, 1064)), tokens, arrival=clock.now)
        eng.submit(req)
        await asyncio.wait_for(req.done.wait(), 5.0)
        await eng.stop()
        return clock.now - req.arrival

    took = asyncio.run(go())
    # The first step prefills (and yields the first token); each further token is a step.
    model_ms = timing.prefill_ms(64) + (tokens - 1) * timing.decode_ms_per_token(1)
    return took, timing.wall_s(model_ms)


def test_short_steps_keep_model_time(monkeypatch: pytest.MonkeyPatch) -> None:
    # 200 decode steps of 8.25 model ms at speed 20 = 0.41 ms each: every sleep wakes a
    # whole millisecond late, and the deadlines make it up (before: 200 ms for 83 ms).
    took, expected = run_one(monkeypatch, speed=20.0, tokens=200)
    assert expected < took <= expected + 0.002


def test_long_steps_unchanged(monkeypatch: pytest.MonkeyPatch) -> None:
    took, expected = run_one(monkeypatch, speed=1.0, tokens=5)
    assert expected <= took <= expected + 0.002
