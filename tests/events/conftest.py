"""Fixtures shared by the KV-event tests."""

from __future__ import annotations

import gc
from collections.abc import AsyncIterator

import pytest
import zmq.asyncio


@pytest.fixture
async def ctx() -> AsyncIterator[zmq.asyncio.Context]:
    """One asyncio ZMQ context per test, destroyed after it.

    `Context.term()` blocks in libzmq until every socket is closed, so one socket left open
    (a test that failed before its cleanup, a task that never ran its `finally`) would hang
    the run. Teardown closes the leftovers with linger 0 instead, then fails the test
    naming them: a leak is a bug, never a hang.
    """
    c = zmq.asyncio.Context()
    try:
        yield c
    finally:
        gc.collect()  # an unreachable socket is closed by its finalizer, not a leak
        # pyzmq keeps a weak set of the context's sockets (what `destroy()` closes).
        left = [s for s in list(getattr(c, "_sockets", ())) if not s.closed]
        kinds = sorted(zmq.SocketType(s.type).name for s in left)
        c.destroy(linger=0)
    if left:
        pytest.fail(f"test left {len(left)} ZMQ socket(s) open: {kinds}")
