"""Simulated time and bounded waits for the discovery tests."""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import Callable


class ManualClock:
    """Time that moves only when the test says so: `sleep` waits for `advance`."""

    def __init__(self) -> None:
        self.t = 0.0
        self._heap: list[tuple[float, int, asyncio.Future[None]]] = []
        self._seq = itertools.count()

    def now(self) -> float:
        return self.t

    async def sleep(self, seconds: float) -> None:
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._heap, (self.t + max(0.0, seconds), next(self._seq), fut))
        await fut

    def sleepers(self) -> int:
        return sum(1 for _, _, f in self._heap if not f.done())

    async def advance(self, seconds: float) -> None:
        """Move time forward, waking every sleeper whose deadline has passed."""
        self.t += seconds
        while self._heap and self._heap[0][0] <= self.t:
            _, _, fut = heapq.heappop(self._heap)
            if not fut.done():
                fut.set_result(None)
        for _ in range(5):  # let the woken tasks run up to their next await
            await asyncio.sleep(0)


async def until(cond: Callable[[], bool], timeout: float = 10.0, what: str = "") -> None:
    """Wait (bounded) for a condition reached by background tasks over real sockets."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not cond():
        if loop.time() > deadline:
            raise AssertionError(f"timed out waiting for {what or cond}")
        await asyncio.sleep(0.005)


async def until_advancing(
    clock: ManualClock, cond: Callable[[], bool], step: float = 1.0, timeout: float = 10.0
) -> float:
    """Advance simulated time in steps until `cond` holds; returns simulated time spent."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    spent = 0.0
    while not cond():
        if loop.time() > deadline:
            raise AssertionError(f"timed out (simulated {spent:.0f}s) waiting for {cond}")
        await clock.advance(step)
        spent += step
        await asyncio.sleep(0.005)
    return spent
