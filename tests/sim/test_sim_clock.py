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


def test_gauges_set_once_per_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each step sets the gauges once (at its end, as vLLM logs its scheduler stats), and
    what they say then is the engine's state after the step."""
    clock = FakeClock()
    real_sleep = asyncio.sleep

    async def sleep(delay: float) -> None:
        clock.now += max(delay, 0.0)
        await real_sleep(0)

    monkeypatch.setattr(engine_mod.time, "monotonic", clock.monotonic)
    monkeypatch.setattr(engine_mod.asyncio, "sleep", sleep)
    seen: list[tuple[int, int, float]] = []

    async def go() -> int:
        metrics = SimMetrics("m", 16, 64, 0)
        eng = Engine(
            block_size=16, capacity_blocks=64, max_num_seqs=1, max_num_batched_tokens=8192,
            max_model_len=4096, vocab_size=32000, timing=TimingModel(speed=1.0),
            metrics=metrics, publisher=None, era="map", seed=0,
        )  # fmt: skip
        update = eng._update_gauges

        def counted() -> None:
            update()
            seen.append((int(metrics.running.value), int(metrics.waiting.value),
                         metrics.kv_usage.value))  # fmt: skip

        monkeypatch.setattr(eng, "_update_gauges", counted)
        eng.start()
        prompts = (list(range(32)), list(range(1000, 1032)))
        reqs = [SimRequest(f"r{i}", p, 3, arrival=clock.now) for i, p in enumerate(prompts)]
        for r in reqs:
            eng.submit(r)
        for r in reqs:
            await asyncio.wait_for(r.done.wait(), 5.0)
        await eng.stop()
        return eng.steps

    steps = asyncio.run(go())
    assert steps == 6  # max_num_seqs 1: three steps each, one after the other
    assert len(seen) == steps
    # After each step: the first request runs its 3 steps while the second waits, then
    # the second runs; a finished request is out of the batch and its blocks unpinned.
    assert [(r, w) for r, w, _ in seen] == [(1, 1), (1, 1), (0, 1), (1, 0), (1, 0), (0, 0)]
    assert seen[-1][2] == 0.0 and all(u > 0 for _, _, u in seen[:2])
