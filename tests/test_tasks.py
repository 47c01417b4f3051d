"""scorer.tasks.cancel_and_wait: children are stopped, the caller's cancel is kept."""

from __future__ import annotations

import asyncio

import pytest

from scorer.tasks import cancel_and_wait, wait_all


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


async def test_wait_all_lets_the_tasks_finish_and_keeps_the_callers_cancel() -> None:
    """A close in progress is waited for, not cancelled; a cancel of the waiter ends the
    wait (raised) and leaves the close running."""
    release = asyncio.Event()

    async def closing() -> None:
        await release.wait()

    async def fails() -> None:
        raise RuntimeError("boom")

    close, failed = asyncio.create_task(closing()), asyncio.create_task(fails())
    waiter = asyncio.create_task(wait_all(close, failed))
    await asyncio.sleep(0)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        async with asyncio.timeout(10):
            await waiter
    assert not close.done()  # still closing: not cancelled by the waiter's cancel
    release.set()
    async with asyncio.timeout(10):
        await wait_all(close, failed)  # the failure is retrieved, not raised
    assert close.done() and not close.cancelled() and failed.done()
