"""Fixtures for the ext_proc contract tests: a real App on loopback ports + a real channel."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from extproc_helpers import make_config

from scorer.app import App


class Harness:
    def __init__(self, app: App, channel: grpc.aio.Channel) -> None:
        self.app = app
        self.channel = channel
        self.stub = ep_grpc.ExternalProcessorStub(channel)

    def stream(self) -> Any:
        return self.stub.Process()


@pytest.fixture
async def harness() -> AsyncIterator[Callable[..., Awaitable[Harness]]]:
    """`h = await harness(**config_overrides)`: a started App and a channel to its port."""
    started: list[tuple[App, grpc.aio.Channel]] = []

    async def make(**over: Any) -> Harness:
        app = App(make_config(**over))
        await app.start()
        ch = grpc.aio.insecure_channel(f"127.0.0.1:{app.extproc_port}")
        started.append((app, ch))
        return Harness(app, ch)

    try:
        yield make
    finally:
        for app, ch in started:
            await ch.close()
            app.config.server.grace_period_s = 0.5
            await app.stop()
