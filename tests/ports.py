"""Loopback ports that nothing listens on, kept that way for as long as a test needs.

Choosing a "closed" port by bind-and-close races: whatever binds port 0 in between (an
Envoy listener, another test's server, any process) may be given that port, and the "dead"
worker then answers (seen: Envoy reached itself through a ghost worker and answered 502).
A `HeldPort` keeps the port bound, not listening, until closed: a connection to it is
refused and the kernel never hands it to a port-0 bind. It is bound with SO_REUSEADDR, so
the test itself (or ZMQ, which sets it on its listeners) can still bind and listen on that
exact port, e.g. to bring a "killed" worker back; once that listener closes, connections
are refused again. Tests take them from the `closed_port` fixture (tests/conftest.py),
which closes them when the test ends; module-scoped set-ups hold a `HeldPort` themselves.
"""

from __future__ import annotations

import socket
from types import TracebackType


class HeldPort:
    """A loopback TCP port bound (SO_REUSEADDR) and not listening until `close()`."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, 0))
        self.host = host
        self.port = int(self.sock.getsockname()[1])

    @property
    def endpoint(self) -> str:
        """`host:port`, as a pool entry names a worker."""
        return f"{self.host}:{self.port}"

    def close(self) -> None:
        """Release the port."""
        self.sock.close()

    def __enter__(self) -> HeldPort:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
