"""scorer.tasks.cancel_and_wait: children are stopped, the caller's cancel is kept."""

from __future__ import annotations

import asyncio

import pytest

from scorer.tasks import cancel_and_wait


async def _slow_to_stop(release: asyncio.Event, stopping: asyncio.Event) -> None:
    """A task that needs a while to finish once cancelled (closing sockets, say)."""
    try:
        await asyncio.Event().wait()
    except asyncio.CancelledError:
        stopping.set()
        await release.wait()
        raise


async def test_the_callers_cancel_is_not_swallowed() -> None:
    """The reconnect loop's shape: a loop stops its children between two rounds; a stop()
    arriving meanwhile must end the loop (with `suppress(CancelledError): await child` it
    was taken for the child's and the loop opened its next round: a hang)."""
    release, stopping = asyncio.Event(), asyncio.Event()
    rounds = 0

    async def loop() -> None:
        nonlocal rounds
        while True:
            rounds += 1
            child = asyncio.create_task(_slow_to_stop(release, stopping))
            await asyncio.sleep(0)
            await cancel_and_wait(child)

    task = asyncio.create_task(loop())
    async with asyncio.timeout(10):
        await stopping.wait()  # the loop is waiting for its child to stop
    task.cancel()
    release.set()
    with pytest.raises(asyncio.CancelledError):
        async with asyncio.timeout(10):
            await task
    assert rounds == 1


async def test_children_end_whatever_they_raise() -> None:
    async def fails() -> None:
        raise RuntimeError("boom")

    async def waits() -> None:
        await asyncio.Event().wait()

    failed, waiting = asyncio.create_task(fails()), asyncio.create_task(waits())
    await asyncio.sleep(0)
    done = asyncio.create_task(asyncio.sleep(0))
    await done
    await cancel_and_wait(failed, waiting, done)
    assert failed.done() and not failed.cancelled()  # finished before: not cancelled
    assert waiting.cancelled()
    assert done.done() and done.result() is None
