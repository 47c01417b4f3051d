"""The simulated worker's stop()s keep their caller's cancellation (scorer.tasks)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from kvscorer_tools.sim.engine import Engine
from kvscorer_tools.sim.kvevents import KVEventPublisher
from kvscorer_tools.sim.metrics import SimMetrics
from kvscorer_tools.sim.timing import TimingModel


async def _cancel_during(stop: Callable[[], Awaitable[None]]) -> asyncio.Task[None]:
    """Start `stop()`, cancel it while it waits for its task to end, return it."""

    async def run() -> None:
        await stop()

    stopper = asyncio.create_task(run())
    await asyncio.sleep(0)  # stop() has cancelled its task and waits for it
    stopper.cancel()
    return stopper


async def test_engine_stop_keeps_the_callers_cancel() -> None:
    eng = Engine(
        block_size=16, capacity_blocks=64, max_num_seqs=8, max_num_batched_tokens=8192,
        max_model_len=4096, vocab_size=32000, timing=TimingModel(speed=1.0),
        metrics=SimMetrics("m", 16, 64, 0), publisher=None, era="map", seed=0,
    )  # fmt: skip
    eng.start()
    await asyncio.sleep(0)  # the engine loop waits for work
    task = eng._task
    assert task is not None
    stopper = await _cancel_during(eng.stop)
    with pytest.raises(asyncio.CancelledError):
        async with asyncio.timeout(10):
            await stopper
    assert task.done()  # the engine loop ended all the same


async def test_publisher_stop_keeps_the_callers_cancel() -> None:
    pub = KVEventPublisher(None, "tcp://127.0.0.1:0")
    await pub.start()
    await asyncio.sleep(0)  # the replay server waits for a request
    task = pub._replay_task
    assert task is not None
    stopper = await _cancel_during(pub.stop)
    with pytest.raises(asyncio.CancelledError):
        async with asyncio.timeout(10):
            await stopper
    assert task.done()
    await pub.stop()  # a second stop() closes the sockets and contexts
    assert pub._router is None and pub._actx is None
