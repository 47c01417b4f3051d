"""TLS between the socket and an HTTP/2 connection, on `ssl.MemoryBIO` (what asyncio's
own SSL transport does), so that a failed or slow handshake is seen and counted here:
asyncio's built-in server TLS drops handshake failures silently (debug log only).

`TlsTransport` is the socket's protocol and the inner protocol's transport: it decrypts
what arrives into `inner.data_received` and encrypts what `inner` writes. Flow control
passes through: the socket's pause/resume_writing reach the inner protocol, and
pause/resume_reading reach the socket.

Both directions of reading go through buffers kept per connection (the socket reads into
one, `asyncio.BufferedProtocol`; decrypted bytes are read into another): a new bytes
object per read, of the 256 KiB asked for, costs an mmap, mremap and munmap each
(see scorer/extproc/transport/connection.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from collections.abc import Callable
from typing import Any, Protocol, cast

from scorer.extproc.transport.limits import READ_BUFFER

log = logging.getLogger("scorer.extproc.transport")


class Inner(Protocol):
    """What TlsTransport drives: the HTTP/2 connection's protocol side."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None: ...

    def data_received(self, data: bytes) -> None: ...

    def connection_lost(self, exc: Exception | None) -> None: ...

    def pause_writing(self) -> None: ...

    def resume_writing(self) -> None: ...


def handshake_failure_reason(exc: BaseException) -> str:
    """A short label for a failed handshake: certificate / protocol."""
    text = str(exc).upper()
    if "CERTIFICATE" in text or "UNKNOWN_CA" in text or "BAD_CERT" in text:
        return "certificate"
    return "protocol"


class TlsTransport(asyncio.BufferedProtocol, asyncio.Transport):
    """Server-side TLS for one accepted connection, wrapping the inner protocol."""

    def __init__(
        self,
        context: ssl.SSLContext,
        inner: Inner,
        on_failure: Callable[[str], None],
        handshake_timeout: float,
    ) -> None:
        asyncio.Transport.__init__(self)
        self._ctx = context
        self._inner = inner
        self._on_failure = on_failure
        self._timeout = handshake_timeout
        self._in = ssl.MemoryBIO()
        self._out = ssl.MemoryBIO()
        self._ssl = context.wrap_bio(self._in, self._out, server_side=True)
        self._raw: asyncio.Transport | None = None
        self._ready = False  # handshake done, inner protocol connected
        self._closing = False
        self._timer: asyncio.TimerHandle | None = None
        self._rbuf = memoryview(bytearray(READ_BUFFER))  # ciphertext from the socket
        self._pbuf = bytearray(READ_BUFFER)  # plaintext from the TLS layer
        self._pview = memoryview(self._pbuf)

    # ------------------------------------------------------------ socket side

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A cast, not an isinstance check: uvloop's transports implement asyncio.Transport
        # without subclassing it (the check failed every connection: Envoy's 500s).
        transport = cast(asyncio.Transport, transport)
        self._raw = transport
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later(self._timeout, self._handshake_timeout)

    def _handshake_timeout(self) -> None:
        if not self._ready and not self._closing:
            self._on_failure("timeout")
            self._abort_raw()

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._rbuf

    def buffer_updated(self, nbytes: int) -> None:
        self.data_received(self._rbuf[:nbytes])  # MemoryBIO.write copies it

    def data_received(self, data: bytes | memoryview) -> None:
        if self._closing and not self._ready:
            return
        self._in.write(data)
        if not self._ready:
            try:
                self._ssl.do_handshake()
            except ssl.SSLWantReadError:
                self._flush()
                return
            except (ssl.SSLError, OSError) as e:
                self._on_failure(handshake_failure_reason(e))
                log.info("ext_proc TLS handshake failed: %s", e)
                self._flush()  # the alert, so the peer sees why
                self._abort_raw()
                return
            self._ready = True
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            self._flush()
            self._inner.connection_made(self)
        self._pump()

    def _pump(self) -> None:
        """Hand decrypted bytes to the inner protocol: every whole record of this read in
        one `data_received` (so what the inner answers to all of them leaves in one
        write), then what ended the read (close_notify, an error)."""
        view = self._pview
        size = len(view)
        got = 0
        ended: Callable[[], None] | None = None
        while not self._closing:
            try:
                # With a buffer, read() returns the count (typeshed says bytes).
                n = cast(int, self._ssl.read(size - got, view[got:]))
            except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
                break
            except ssl.SSLZeroReturnError:  # close_notify
                ended = self.close
                break
            except (ssl.SSLError, OSError) as e:
                log.info("ext_proc TLS error: %s", e)
                ended = self._abort_raw
                break
            if not n:
                break
            got += n
            if got == size:  # the buffer is full: hand it over, read on
                self._inner.data_received(bytes(view))
                got = 0
            if not self._in.pending and not self._ssl.pending():
                break  # nothing left to decrypt: no read ending in SSLWantReadError
        if got:
            self._inner.data_received(bytes(view[:got]))
        if ended is not None:
            ended()
        self._flush()  # renegotiation / key-update records, if any

    def eof_received(self) -> bool | None:
        return False  # close the socket

    def connection_lost(self, exc: Exception | None) -> None:
        self._closing = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._ready:
            self._inner.connection_lost(exc)

    def pause_writing(self) -> None:
        if self._ready:
            self._inner.pause_writing()

    def resume_writing(self) -> None:
        if self._ready:
            self._inner.resume_writing()

    # ------------------------------------------------------------ inner protocol side

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self._closing or not self._ready:
            return
        view = memoryview(data)
        try:
            while view:
                n = self._ssl.write(view)
                view = view[n:]
        except (ssl.SSLError, OSError) as e:
            log.info("ext_proc TLS write failed: %s", e)
            self._abort_raw()
            return
        self._flush()

    def _flush(self) -> None:
        if self._out.pending and self._raw is not None:
            self._raw.write(self._out.read())

    def close(self) -> None:
        if self._closing:
            return
        self._closing = True
        if self._ready:
            with contextlib.suppress(ssl.SSLError, OSError):
                self._ssl.unwrap()  # close_notify
            self._flush()
        if self._raw is not None:
            self._raw.close()

    def _abort_raw(self) -> None:
        self._closing = True
        if self._raw is not None:
            self._raw.close()

    def abort(self) -> None:
        self._abort_raw()

    def is_closing(self) -> bool:
        return self._closing

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        if name == "ssl_object":
            return self._ssl
        if name == "sslcontext":
            return self._ctx
        if self._raw is None:
            return default
        return self._raw.get_extra_info(name, default)

    def pause_reading(self) -> None:
        if self._raw is not None:
            self._raw.pause_reading()

    def resume_reading(self) -> None:
        if self._raw is not None:
            self._raw.resume_reading()

    def is_reading(self) -> bool:
        return self._raw is not None and self._raw.is_reading()

    def get_write_buffer_size(self) -> int:
        return 0 if self._raw is None else self._raw.get_write_buffer_size()

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        if self._raw is not None:
            self._raw.set_write_buffer_limits(high, low)
