"""Fixtures shared by the KV-event tests."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import zmq.asyncio


@pytest.fixture
async def ctx() -> AsyncIterator[zmq.asyncio.Context]:
    """One asyncio ZMQ context per test, terminated after it (sockets closed by then)."""
    c = zmq.asyncio.Context()
    try:
        yield c
    finally:
        c.term()
