"""The socket monitor's shutdown order (scorer.events.subscriber, scorer.events.pool_socket).

libzmq sends each monitor event from the context's I/O thread with a blocking send on an
inproc PAIR, holding the lock `disable_monitor()` takes (libzmq src/socket_base.cpp,
`monitor_event`). With the reading end closed first, the next event (a reconnect, a
disconnect) blocks that thread for ever: every socket of the context stops and
`disable_monitor()` never returns. It hung `make test` twice, and would hang a scorer whose
event stream reconnects. So the monitor is always stopped before its reader closes; these
tests record the order over reconnect cycles and stops.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import zmq
import zmq.asyncio
from configs import make_config
from kvev_publisher import until

from scorer.blocks import BlockHasher
from scorer.events import EventIngest
from scorer.events.pool_socket import PoolEventSocket
from scorer.events.subscriber import Subscriber
from scorer.index import BlockIndex
from scorer.pool import Pool

EP = "10.0.0.1:8000"


class Calls:
    """Every `disable_monitor()` and async-socket `close()`, in order. The sockets
    themselves are kept (not their ids: a closed socket's id is reused)."""

    def __init__(self) -> None:
        self.log: list[tuple[str, object]] = []
        self.pairs: list[tuple[object, object]] = []  # (socket, its monitor reader)

    def _at(self, op: str, sock: object) -> int | None:
        return next((i for i, (o, s) in enumerate(self.log) if o == op and s is sock), None)

    def before(self, first: tuple[str, object], then: tuple[str, object]) -> bool:
        a, b = self._at(*first), self._at(*then)
        return a is not None and b is not None and a < b

    def check(self) -> None:
        assert self.pairs
        for sub, mon in self.pairs:
            assert self._at("close", mon) is not None, "monitor reader left open"
            assert self.before(("disable", sub), ("close", mon)), "reader closed first"


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[Calls]:
    c = Calls()
    disable, close = zmq.Socket.disable_monitor, zmq.asyncio.Socket.close
    get_monitor = zmq.Socket.get_monitor_socket

    def rec_disable(self: zmq.Socket[Any]) -> None:
        c.log.append(("disable", self))
        disable(self)

    def rec_close(self: zmq.asyncio.Socket, linger: int | None = None) -> None:
        c.log.append(("close", self))
        close(self, linger)

    def rec_monitor(self: zmq.Socket[Any], *a: Any, **kw: Any) -> Any:
        mon = get_monitor(self, *a, **kw)
        c.pairs.append((self, mon))
        return mon

    monkeypatch.setattr(zmq.Socket, "disable_monitor", rec_disable)
    monkeypatch.setattr(zmq.asyncio.Socket, "close", rec_close)
    monkeypatch.setattr(zmq.Socket, "get_monitor_socket", rec_monitor)
    yield c


async def _bind(ctx: zmq.asyncio.Context, address: str) -> zmq.asyncio.Socket:
    """A PUB on a fixed address (the previous one's listener closes asynchronously)."""
    for _ in range(500):
        pub = ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        try:
            pub.bind(address)
            return pub
        except zmq.ZMQError:
            pub.close(linger=0)
            await asyncio.sleep(0.01)
    raise AssertionError(f"cannot bind {address}")


async def test_subscriber_stops_its_monitor_before_closing_the_reader(
    ctx: zmq.asyncio.Context,
    calls: Calls,
    closed_port: Callable[[], int],
) -> None:
    """A connect-mode stream whose publisher goes away twice: each drop opens a new
    socket; every old socket (and the last, at stop) has its monitor stopped first."""
    address = f"tcp://127.0.0.1:{closed_port()}"
    config = make_config(
        [{"endpoint": EP, "events": address}], events={"reconnect_interval_s": 0.01}
    )
    ingest = EventIngest(
        config, Pool.from_config(config), BlockIndex(config.index), BlockHasher(16)
    )
    await ingest.start()
    pub = await _bind(ctx, address)
    try:
        sub: Subscriber = ingest.subscribers[EP]
        for cycle in range(1, 3):
            await until(lambda: sub.status.connected, 10)
            pub.close(linger=0)
            # The drop ends that socket: a new one is opened (and connects to the next PUB).
            await until(lambda c=cycle: len(calls.pairs) > c, 10)  # type: ignore[misc]
            pub = await _bind(ctx, address)
        await until(lambda: sub.status.connected, 10)
    finally:
        await ingest.stop()
        pub.close(linger=0)
    assert len(calls.pairs) == 3
    calls.check()


async def test_pool_socket_stops_its_monitor_before_closing_the_reader(
    ctx: zmq.asyncio.Context, calls: Calls
) -> None:
    config = make_config([EP], events={"bind": "tcp://127.0.0.1:0"})
    pool = Pool.from_config(config)
    ingest = EventIngest(config, pool, BlockIndex(config.index), BlockHasher(16))
    sock = PoolEventSocket(config, pool, ingest)
    await sock.start()
    try:
        pub = ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        assert sock.bound_endpoint is not None
        pub.connect(sock.bound_endpoint)
        await until(lambda: sock.report()["peers"] == 1, 10)
        pub.close(linger=0)
        await until(lambda: sock.report()["peers"] == 0, 10)
    finally:
        await sock.stop()
    calls.check()
