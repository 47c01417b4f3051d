"""The ext_proc suites' fixture: a real App on loopback ports + a real gRPC channel."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from extproc_helpers import Harness, harnesses


@pytest.fixture
async def harness(transport: str) -> AsyncIterator[Callable[..., Awaitable[Harness]]]:
    """`h = await harness(**config_sections)`; once per transport (tests/conftest.py)."""
    async with harnesses(transport) as make:
        yield make
