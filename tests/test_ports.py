"""The held "closed" port of tests/ports.py: refused, never handed out, still usable."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable

import pytest
from ports import HeldPort


def test_a_held_port_refuses_and_cannot_be_taken() -> None:
    with HeldPort() as held:
        with socket.socket() as c, pytest.raises(ConnectionRefusedError):
            c.connect(("127.0.0.1", held.port))
        # Bind-and-close left the port free for anyone; held, a bind to it fails...
        with socket.socket() as other, pytest.raises(OSError):
            other.bind(("127.0.0.1", held.port))
        # ...and port-0 binds (an Envoy listener, another server) are never given it.
        for _ in range(200):
            with socket.socket() as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.bind(("127.0.0.1", 0))
                assert s.getsockname()[1] != held.port
    with socket.socket() as after:
        after.bind(("127.0.0.1", held.port))  # released


async def test_a_held_port_can_come_back_and_go_again(closed_port: Callable[[], int]) -> None:
    """A test brings its "killed" worker back on the same port, then kills it again."""
    port = closed_port()

    async def handle(_r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        w.close()

    server = await asyncio.start_server(handle, "127.0.0.1", port, reuse_address=True)
    _, w = await asyncio.open_connection("127.0.0.1", port)
    w.close()
    server.close()
    await server.wait_closed()
    with pytest.raises(ConnectionRefusedError):
        await asyncio.open_connection("127.0.0.1", port)
