"""Stopping asyncio tasks without losing the stopper's own cancellation.

`t.cancel(); with suppress(CancelledError): await t` cannot tell the task's cancellation
from the caller's: when the caller is cancelled while it waits (a loop being stopped in the
middle of a reconnect), the cancel is swallowed and the loop runs on, so the `stop()`
awaiting it never returns. `asyncio.wait` never raises a task's outcome, so only the
caller's own cancellation comes out of it.
"""

from __future__ import annotations

import asyncio
from typing import Any


async def cancel_and_wait(*tasks: asyncio.Task[Any]) -> None:
    """Cancel `tasks` and wait until each has finished, whatever it raised (its outcome is
    retrieved and dropped). A cancellation of the caller meanwhile propagates."""
    pending = [t for t in tasks if not t.done()]
    for t in pending:
        t.cancel()
    if pending:
        await asyncio.wait(pending)
    for t in tasks:
        if not t.cancelled():
            t.exception()


async def wait_all(*tasks: asyncio.Task[Any]) -> None:
    """Wait until each of `tasks` has finished, without cancelling them (a close in
    progress must end); their outcome is retrieved and dropped. A cancellation of the
    caller meanwhile propagates and leaves them running."""
    pending = [t for t in tasks if not t.done()]
    if pending:
        await asyncio.wait(pending)
    for t in tasks:
        if not t.cancelled():
            t.exception()
