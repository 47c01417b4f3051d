"""The asyncio gRPC server: listen (optionally SO_REUSEPORT, optionally TLS), accept HTTP/2
connections, run each call's handler and end its stream with the handler's status, graceful stop."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import ssl
from collections.abc import Callable
from typing import Any

from prometheus_client import Counter

from scorer.extproc.transport.connection import H2Connection
from scorer.extproc.transport.limits import MAX_MESSAGE, Limits
from scorer.extproc.transport.stream import AbortStream, H2Stream, Handler
from scorer.extproc.transport.tls_transport import TlsTransport

log = logging.getLogger("scorer.extproc.transport")

CONNECTIONS_CLOSED = Counter(
    "kv_scorer_extproc_connections_closed_total",
    "ext_proc connections (asyncio transport) ended by a bound or an error, by cause: "
    "refused (connection cap), handshake_timeout, idle, write_stalled, connection_error.",
    ["cause"],
)


class H2GrpcServer:
    """gRPC bidi-stream server: `add_handler(path, handler, deserialize)`, `start`, `stop`."""

    def __init__(
        self, max_message: int = MAX_MESSAGE, *, limits: Limits | None = None, **bounds: Any
    ) -> None:
        """`bounds`: any field of `Limits` (max_streams=..., idle_timeout=...)."""
        self.max_message = max_message
        self.limits = dataclasses.replace(limits or Limits(), **bounds)
        self.handlers: dict[str, tuple[Handler, Callable[[bytes], Any] | None]] = {}
        self.connections: set[H2Connection] = set()
        # Calls whose handler runs (task-less or on a task: H2Stream.step).
        self.calls: set[H2Stream] = set()
        self.draining = False
        self._server: asyncio.Server | None = None
        self.tls_failures: dict[str, int] = {}  # failed TLS handshakes by reason
        self._on_tls_failure: Callable[[str], None] | None = None
        # Connections ended by a bound, by cause (refused, handshake_timeout, idle,
        # write_stalled, connection_error); tests and metrics read it.
        self.closed_by: dict[str, int] = {}

    def count(self, cause: str) -> None:
        """Count a connection ended by a bound or an error (see `closed_by`)."""
        self.closed_by[cause] = self.closed_by.get(cause, 0) + 1
        CONNECTIONS_CLOSED.labels(cause).inc()

    # Read by the connections (one attribute lookup on their paths).
    @property
    def max_streams(self) -> int:
        return self.limits.max_streams

    @property
    def max_header_list(self) -> int:
        return self.limits.max_header_list

    def add_handler(
        self, path: str, handler: Handler, deserialize: Callable[[bytes], Any] | None = None
    ) -> None:
        """Serve `path` ("/package.Service/Method") with a bidi-stream handler."""
        self.handlers[path] = (handler, deserialize)

    async def start(
        self,
        host: str,
        port: int,
        reuse_port: bool = False,
        *,
        tls: Callable[[], ssl.SSLContext] | None = None,
        on_tls_failure: Callable[[str], None] | None = None,
    ) -> int:
        """Listen; returns the bound port. `tls`: the SSLContext for each new connection
        (called per connection, so a reloaded certificate applies to new ones);
        `on_tls_failure(reason)` is told of each failed handshake."""
        loop = asyncio.get_running_loop()
        factory: Callable[[], asyncio.BaseProtocol]
        if tls is None:
            factory = lambda: H2Connection(self)  # noqa: E731
        else:
            get_ctx = tls

            def factory() -> asyncio.BaseProtocol:
                return TlsTransport(
                    get_ctx(),
                    H2Connection(self),
                    self._tls_failed,
                    self.limits.tls_handshake_timeout,
                )

        self._on_tls_failure = on_tls_failure
        self._server = await loop.create_server(
            factory, host, port, reuse_port=reuse_port or None, backlog=1024
        )
        return int(self._server.sockets[0].getsockname()[1])

    def _tls_failed(self, reason: str) -> None:
        self.tls_failures[reason] = self.tls_failures.get(reason, 0) + 1
        if self._on_tls_failure is not None:
            self._on_tls_failure(reason)

    async def run(self, stream: H2Stream, handler: Handler) -> None:
        """Run one call's handler and end the stream with its status."""
        self.calls.add(stream)
        try:
            await handler(None, stream)
        except AbortStream as e:
            stream.finish(e.code.value[0], e.details)
        except asyncio.CancelledError:
            if not stream.cancelled():
                stream.finish(1, "cancelled")  # CANCELLED (server shutdown)
        except Exception:
            log.exception("ext_proc handler failed")
            stream.finish(2, "Unexpected error")  # UNKNOWN, as grpcio reports it
        else:
            stream.finish(0)
        finally:
            self.calls.discard(stream)

    async def stop(self, grace: float | None) -> None:
        """Refuse new streams (GOAWAY), let open ones finish within `grace`, cancel the rest."""
        self.draining = True
        if self._server is not None:
            self._server.close()
        for c in list(self.connections):
            c.goaway()
        for s in list(self.calls):
            s.promote()  # a task-less handler gets a task to wait for and cancel
        tasks = {s.task for s in self.calls if s.task is not None}
        if tasks and grace:
            await asyncio.wait(tasks, timeout=grace)
        for t in tasks:
            if not t.done():
                t.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=1.0)
        for c in list(self.connections):
            c.flush()
            if c.transport is not None:
                c.transport.close()
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None
