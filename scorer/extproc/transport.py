"""A minimal gRPC-over-HTTP/2 server on asyncio, for the ext_proc stream only.

Why: grpcio's per-stream cost (completion-queue batches handed from its poller thread to
the event loop, ~70 µs each, 7-8 per stream) is 500-700 µs of CPU per ext_proc stream on
our 2-core bench, against 50-60 µs for our own routing. This server speaks just what
Envoy's gRPC client needs for a bidi stream, parses frames with `struct` and decodes
request headers with `hpack`, and writes all frames produced in one event-loop turn with
one `transport.write`. `server.extproc_transport: grpcio` keeps the grpcio server.

Sources:
- HTTP/2, RFC 9113: frame layout (§4.1), DATA/HEADERS/RST_STREAM/SETTINGS/PING/GOAWAY/
  WINDOW_UPDATE/CONTINUATION (§6), flow control (§5.2, §6.9), connection preface (§3.4),
  a server may answer and then RST_STREAM(NO_ERROR) a request still being sent (§8.1).
- HPACK, RFC 7541: static table indexes and integer/string encoding (§5.1, §5.2,
  §6.1, §6.2.2, Appendix A).
- gRPC over HTTP/2 (grpc/grpc doc/PROTOCOL-HTTP2.md): `:status 200`,
  `content-type: application/grpc`, length-prefixed messages (1-byte compressed flag,
  4-byte big-endian length), trailers `grpc-status` / `grpc-message` (percent-encoded),
  Trailers-Only responses.

Not supported (Envoy does not use them towards ext_proc): message compression (a
compressed message ends the stream with UNIMPLEMENTED), TLS, server push.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any, NoReturn, Protocol, cast

import grpc
from hpack import Decoder as HpackDecoder  # type: ignore[import-untyped]
from hpack import OversizedHeaderListError

log = logging.getLogger("scorer.extproc.transport")

EOF: object = grpc.aio.EOF  # type: ignore[attr-defined]  # same sentinel as grpc.aio's read()

# Frame types and flags (RFC 9113 §6).
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY = range(8)
WINDOW_UPDATE, CONTINUATION = 8, 9
END_STREAM = 0x1
ACK = 0x1
END_HEADERS = 0x4
PADDED = 0x8
PRIORITY_FLAG = 0x20
# Error codes (RFC 9113 §7).
NO_ERROR, PROTOCOL_ERROR, FLOW_CONTROL_ERROR, REFUSED_STREAM, CANCEL = 0x0, 0x1, 0x3, 0x7, 0x8
FRAME_SIZE_ERROR, COMPRESSION_ERROR, ENHANCE_YOUR_CALM = 0x6, 0x9, 0xB
# SETTINGS identifiers (RFC 9113 §6.5.2).
S_HEADER_TABLE_SIZE, S_MAX_CONCURRENT_STREAMS, S_INITIAL_WINDOW_SIZE = 0x1, 0x3, 0x4
S_MAX_FRAME_SIZE, S_MAX_HEADER_LIST_SIZE = 0x5, 0x6

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
_HDR = struct.Struct(">IBI")  # (length << 8 | type), flags, stream id
_U32 = struct.Struct(">I")
_MSG = struct.Struct(">BI")  # gRPC message prefix: compressed flag, length
MAX_WINDOW = 2**31 - 1
# What we let a peer send before we return credit: big enough that an 8 MB body never
# waits, bounded so a peer cannot queue unbounded data we have not read yet.
RECV_WINDOW = 16 * 1024 * 1024
CONN_RECV_WINDOW = 64 * 1024 * 1024
OUR_MAX_FRAME = 1024 * 1024  # fewer frames for large bodies (peer default is 16,384)

# Resource bounds (defaults of H2GrpcServer; see docs/envoy.md, "Resource bounds").
# Streams open at once per connection, advertised as SETTINGS_MAX_CONCURRENT_STREAMS;
# one more is refused with RST_STREAM(REFUSED_STREAM) before any handler runs (RFC 9113
# §5.1.2). Envoy opens one stream per request on a pool of connections.
MAX_STREAMS = 1024
# Header section bound, advertised as SETTINGS_MAX_HEADER_LIST_SIZE (RFC 9113 §6.5.2,
# RFC 7541 §4.1 sizes: name + value + 32 per field). It bounds both the compressed
# HEADERS + CONTINUATION block we buffer (checked before buffering a frame, against
# CONTINUATION floods, CVE-2024-27316) and the decoded list (hpack's decoder limit).
# Exceeding either is a connection error GOAWAY(ENHANCE_YOUR_CALM): the block cannot be
# skipped undecoded without losing the HPACK dynamic table state. Envoy's ext_proc
# request headers are ~200 bytes.
MAX_HEADER_LIST = 64 * 1024
# Rapid reset (CVE-2023-44487): a client reset of a stream whose handler had started
# and which got no response yet costs one unit of a per-connection balance; each answered
# stream earns one back, time earns RESET_REFILL_PER_S; the balance is capped at
# RESET_BUDGET. Below zero: GOAWAY(ENHANCE_YOUR_CALM), no new streams, the connection
# closes once its open streams end. Envoy resets followed streams only after our answer.
RESET_BUDGET = 1000
RESET_REFILL_PER_S = 100.0


def frame(ftype: int, flags: int, sid: int, payload: bytes = b"") -> bytes:
    """One HTTP/2 frame (RFC 9113 §4.1)."""
    return _HDR.pack((len(payload) << 8) | ftype, flags, sid) + payload


def _hpack_int(value: int, prefix_bits: int, first: int) -> bytes:
    """HPACK integer (RFC 7541 §5.1) with `first` holding the pattern bits above the prefix."""
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes([first | value])
    out = bytearray([first | limit])
    value -= limit
    while value >= 128:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _literal(name: bytes, value: bytes) -> bytes:
    """Literal header field without indexing, new name, no Huffman (RFC 7541 §6.2.2)."""
    return b"\x00" + _hpack_int(len(name), 7, 0) + name + _hpack_int(len(value), 7, 0) + value


# `:status: 200` is static index 8 (indexed field 0x88); `content-type` is static name
# index 31, sent as a literal without indexing (RFC 7541 Appendix A, §6.2.2). No dynamic
# table is used for what we send, so the peer's HEADER_TABLE_SIZE does not concern us.
_RESPONSE_HEADERS = b"\x88" + _hpack_int(31, 4, 0) + _hpack_int(16, 7, 0) + b"application/grpc"
_OK_TRAILERS = _literal(b"grpc-status", b"0")


def _skip_int(block: bytes, i: int, prefix_bits: int) -> tuple[int, int]:
    """Decode an HPACK integer at block[i] (RFC 7541 §5.1): (value, next index)."""
    limit = (1 << prefix_bits) - 1
    value = block[i] & limit
    i += 1
    if value < limit:
        return value, i
    shift = 0
    while True:
        b = block[i]
        i += 1
        value += (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return value, i


def table_neutral(block: bytes) -> bool:
    """True when decoding `block` leaves the HPACK dynamic table unchanged: only indexed
    fields and literals without / never indexing (RFC 7541 §6.1, §6.2.2, §6.2.3); false
    for incremental indexing (§6.2.1) and table size updates (§6.3)."""
    i = 0
    n = len(block)
    try:
        while i < n:
            b = block[i]
            if b & 0x80:  # indexed field
                _, i = _skip_int(block, i, 7)
                continue
            if b & 0xE0 != 0:  # 01xxxxxx incremental indexing, 001xxxxx size update
                return False
            name_index, i = _skip_int(block, i, 4)
            if name_index == 0:  # literal name
                length, i = _skip_int(block, i, 7)
                i += length
            length, i = _skip_int(block, i, 7)
            i += length
        return i == n
    except IndexError:
        return False


def _percent_encode(text: str) -> bytes:
    """grpc-message encoding: bytes outside 0x20-0x7E and '%' as %XX (PROTOCOL-HTTP2.md)."""
    out = bytearray()
    for b in text.encode("utf-8"):
        if 0x20 <= b <= 0x7E and b != 0x25:
            out.append(b)
        else:
            out += b"%%%02X" % b
    return bytes(out)


def status_trailers(code: int, message: str | None = None) -> bytes:
    """The HPACK block of `grpc-status` (+ `grpc-message`)."""
    if code == 0 and not message:
        return _OK_TRAILERS
    block = _literal(b"grpc-status", str(code).encode())
    if message:
        block += _literal(b"grpc-message", _percent_encode(message))
    return block


class AbortStream(Exception):
    """Raised by `H2Stream.abort`: end the RPC with a non-OK status."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


class StreamContext(Protocol):
    """What the ext_proc servicer uses of a call: grpc.aio's context or an H2Stream."""

    async def read(self) -> Any: ...

    async def write(self, message: Any) -> None: ...

    async def abort(self, code: grpc.StatusCode, details: str = "") -> NoReturn: ...

    def cancelled(self) -> bool: ...


# A stream handler: `await handler(None, stream)`, same shape as a grpc.aio bidi method.
Handler = Callable[[Any, StreamContext], Awaitable[None]]


class H2Stream:
    """One gRPC call: the servicer's `context` (read / write / abort / cancelled)."""

    __slots__ = (
        "_buf",
        "_cancelled",
        "_credit",
        "_deserialize",
        "_done",
        "_half_closed",
        "_headers_sent",
        "_held",
        "_msgs",
        "_sizes",
        "_waiter",
        "conn",
        "handler",
        "headers",
        "path",
        "send_window",
        "sid",
        "task",
    )  # fmt: skip

    def __init__(
        self,
        conn: H2Connection,
        sid: int,
        path: str,
        headers: list[tuple[str, str]],
        deserialize: Callable[[bytes], Any] | None,
    ) -> None:
        self.conn = conn
        self.sid = sid
        self.path = path
        self.headers = headers
        self.send_window = conn.peer_initial_window
        self.task: asyncio.Task[None] | None = None
        self._msgs: deque[Any] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._buf = bytearray()
        self._half_closed = False  # the peer sent END_STREAM
        self._headers_sent = False
        self._done = False  # we sent our trailers or reset the stream
        self._cancelled = False
        self._credit = 0  # received bytes not yet returned with WINDOW_UPDATE
        # Connection window held by this stream: message bytes buffered and not read yet.
        # `_sizes` has the wire size of each queued message (None once the stream is
        # dropped and its bytes were returned to the connection window).
        self._held = 0
        self._sizes: deque[int] | None = deque()
        self._deserialize = deserialize
        self.handler: Handler | None = None  # set until the handler task starts

    # ------------------------------------------------------------ servicer side

    async def read(self) -> Any:
        """The next request message, or EOF once the peer half-closed."""
        while not self._msgs:
            if self._cancelled:
                raise asyncio.CancelledError()
            self._waiter = self.conn.loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        m = self._msgs.popleft()
        sizes = self._sizes
        if sizes and m is not EOF:
            n = sizes.popleft()
            self._held -= n
            self.conn.conn_credit_add(n)
        if self._credit >= RECV_WINDOW // 2:
            # Return stream credit only for data the handler has taken (back-pressure).
            self.conn.stream_credit(self.sid, self._credit)
            self._credit = 0
        return m

    async def write(self, message: Any) -> None:
        """Send one response message (a protobuf, or already serialized bytes)."""
        data = message if isinstance(message, bytes) else message.SerializeToString()
        if self._done:
            raise asyncio.CancelledError()
        conn = self.conn
        if not self._headers_sent:
            self._headers_sent = True
            conn.reset_balance += 1  # an answered stream (rapid reset accounting)
            conn.send(frame(HEADERS, END_HEADERS, self.sid, _RESPONSE_HEADERS))
        n = len(data) + 5
        if (
            n <= conn.peer_max_frame
            and n <= conn.send_window
            and n <= self.send_window
            and conn.write_paused is None
        ):
            # Fast path (every ext_proc answer but large bodies): one DATA frame, no waits.
            conn.send(_HDR.pack((n << 8) | DATA, 0, self.sid) + _MSG.pack(0, n - 5) + data)
            conn.send_window -= n
            self.send_window -= n
            return
        await conn.send_data(self, _MSG.pack(0, len(data)) + data)

    async def abort(self, code: grpc.StatusCode, details: str = "") -> NoReturn:
        """End the call with `code` (like grpc.aio's context.abort)."""
        raise AbortStream(code, details)

    def cancelled(self) -> bool:
        """True when the peer reset the stream or the connection was lost."""
        return self._cancelled

    def invocation_metadata(self) -> list[tuple[str, str]]:
        """Request headers other than pseudo-headers (grpc.aio API shape)."""
        return [(k, v) for k, v in self.headers if not k.startswith(":")]

    # ------------------------------------------------------------ connection side

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def on_data(self, data: memoryview | bytes, flow_len: int, end: bool) -> str | None:
        """Buffer DATA; queue whole messages. Returns an error text for a bad message."""
        self._credit += flow_len
        if data:
            self._held += len(data)
            buf = self._buf
            buf += data
            while len(buf) >= 5:
                compressed, n = _MSG.unpack_from(buf)
                if compressed:
                    return "compressed messages are not supported"
                if n > self.conn.server.max_message:
                    return f"message larger than {self.conn.server.max_message} bytes"
                if len(buf) < 5 + n:
                    break
                raw = bytes(buf[5 : 5 + n])
                del buf[: 5 + n]
                self._msgs.append(self._deserialize(raw) if self._deserialize else raw)
                if self._sizes is not None:
                    self._sizes.append(5 + n)
        if end:
            self._half_closed = True
            if self._buf:
                return "stream ended inside a message"
            self._msgs.append(EOF)
        if self._msgs:
            if self.handler is not None:
                self.task = self.conn.loop.create_task(self.conn.server.run(self, self.handler))
                self.handler = None
            else:
                self._wake()
        return None

    def on_reset(self) -> None:
        """The peer reset the stream (or the connection is gone): cancel the handler."""
        if self._done:
            return
        self._done = True  # nothing more can be sent
        if self._half_closed:
            # The request side had ended (EOF queued): Envoy resets right after its
            # END_STREAM once the HTTP exchange is over. Let the handler see EOF and end
            # normally instead of counting a finished request as cancelled.
            return
        self.cancel_handler()

    def cancel_handler(self) -> None:
        """Stop the handler: pending and later reads raise CancelledError."""
        self._cancelled = True
        self._wake()
        if self.task is not None and not self.task.done():
            self.task.cancel()

    def finish(self, code: int, message: str | None = None) -> None:
        """Send trailers (or a Trailers-Only response) and close our side."""
        if self._done:
            return
        self._done = True
        conn = self.conn
        block = status_trailers(code, message)
        if not self._headers_sent:
            block = _RESPONSE_HEADERS + block
            conn.reset_balance += 1
        conn.send_headers(self.sid, block, END_STREAM)
        if not self._half_closed:
            # The peer is still sending (e.g. track_responses off): stop it without error
            # (RFC 9113 §8.1).
            conn.send(frame(RST_STREAM, 0, self.sid, _U32.pack(NO_ERROR)))
        conn.drop(self)

    def release(self) -> None:
        """The stream left the connection: return what its unread data holds of the
        connection window (read() returns nothing more from now on)."""
        if self._sizes is not None:
            self._sizes = None
            if self._held:
                self.conn.conn_credit_add(self._held)
                self._held = 0


class H2Connection(asyncio.Protocol):
    """One HTTP/2 connection from a gRPC client (Envoy)."""

    def __init__(self, server: H2GrpcServer) -> None:
        self.server = server
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.need = 9  # bytes the next frame needs before parsing is worth it
        self.preface_ok = False
        self.streams: dict[int, H2Stream] = {}
        self.last_sid = 0
        self.decoder = HpackDecoder(max_header_list_size=server.max_header_list)
        # Envoy sends the same header block for every ext_proc stream (indexed fields plus
        # a literal `:path` it never indexes). A block that does not change the dynamic
        # table decodes to the same headers for as long as the table is unchanged.
        self.header_cache: dict[bytes, tuple[int, list[tuple[str, str]]]] = {}
        self.table_gen = 0
        self.peer_initial_window = 65_535
        self.peer_max_frame = 16_384
        self.send_window = 65_535  # connection-level, ours towards the peer
        self.conn_credit = 0  # connection window released, not yet sent as WINDOW_UPDATE
        # Connection window the peer has used and we have not returned (RFC 9113 §6.9.1):
        # received DATA minus WINDOW_UPDATEs sent. Our window is CONN_RECV_WINDOW (the
        # WINDOW_UPDATE sent with our SETTINGS); more is a FLOW_CONTROL_ERROR.
        self.recv_unacked = 0
        # Rapid reset balance (see RESET_BUDGET): +1 per answered stream, -1 per reset of
        # a started, unanswered stream, refilled over time and capped when it is spent.
        self.reset_balance = float(server.reset_budget)
        self.reset_at = self.loop.time()
        self.out: list[bytes] = []
        self.flush_scheduled = False
        self.goaway_sent = False
        self.closed = False
        self.broken = False
        self.cont_sid = 0  # stream of a header block continued by CONTINUATION frames
        self.cont_flags = 0
        self.cont_block = bytearray()
        self.window_waiters: list[asyncio.Future[None]] = []
        self.write_paused: asyncio.Future[None] | None = None

    # ------------------------------------------------------------ asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.server.connections.add(self)
        settings = b"".join(
            struct.pack(">HI", k, v)
            for k, v in (
                (S_MAX_CONCURRENT_STREAMS, self.server.max_streams),
                (S_INITIAL_WINDOW_SIZE, RECV_WINDOW),
                (S_MAX_FRAME_SIZE, OUR_MAX_FRAME),
                (S_MAX_HEADER_LIST_SIZE, self.server.max_header_list),
            )
        )
        self.send(frame(SETTINGS, 0, 0, settings))
        self.send(frame(WINDOW_UPDATE, 0, 0, _U32.pack(CONN_RECV_WINDOW - 65_535)))
        if self.server.draining:
            self.goaway()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.server.connections.discard(self)
        for s in list(self.streams.values()):
            s.on_reset()
        self.streams.clear()
        for w in self.window_waiters:
            if not w.done():
                w.set_result(None)
        if self.write_paused is not None and not self.write_paused.done():
            self.write_paused.set_result(None)

    def pause_writing(self) -> None:
        if self.write_paused is None:
            self.write_paused = self.loop.create_future()

    def resume_writing(self) -> None:
        w = self.write_paused
        self.write_paused = None
        if w is not None and not w.done():
            w.set_result(None)

    def data_received(self, data: bytes) -> None:
        if self.broken:
            return  # a connection error was answered with GOAWAY; closing
        buf = self.buf
        if buf:
            buf += data
            if len(buf) < self.need:
                return  # a large frame still arriving: no parsing, no copy
            data = bytes(buf)
            buf.clear()
        if not self.preface_ok:
            if len(data) < len(PREFACE):
                if not PREFACE.startswith(data):
                    self.abort_connection("bad connection preface")
                    return
                buf += data
                return
            if not data.startswith(PREFACE):
                self.abort_connection("bad connection preface")
                return
            data = data[len(PREFACE) :]
            self.preface_ok = True
        pos = 0
        n = len(data)
        # Slices of a memoryview over immutable bytes: no copy per frame.
        view = memoryview(data)
        while n - pos >= 9:
            lt, flags, sid = _HDR.unpack_from(data, pos)
            length = lt >> 8
            if length > OUR_MAX_FRAME:
                self.abort_connection("frame too large", FRAME_SIZE_ERROR)
                return
            if n - pos < 9 + length:
                self.need = 9 + length
                break
            payload = view[pos + 9 : pos + 9 + length]
            pos += 9 + length
            if self.on_frame(lt & 0xFF, flags, sid & 0x7FFFFFFF, payload) is False:
                return
        else:
            self.need = 9
        if pos < n:
            buf += view[pos:]

    # ------------------------------------------------------------ frames in

    def on_frame(self, ftype: int, flags: int, sid: int, payload: memoryview) -> bool:
        if self.cont_sid and ftype != CONTINUATION:
            return self.abort_connection("expected CONTINUATION")
        if ftype == DATA:
            return self.on_data_frame(flags, sid, payload)
        if ftype == HEADERS:
            return self.on_headers_frame(flags, sid, payload)
        if ftype == CONTINUATION:
            if sid != self.cont_sid or not sid:
                return self.abort_connection("unexpected CONTINUATION")
            if len(self.cont_block) + len(payload) > self.server.max_header_list:
                return self.abort_connection("header block too large", ENHANCE_YOUR_CALM)
            self.cont_block += payload
            if flags & END_HEADERS:
                block = bytes(self.cont_block)
                self.cont_sid = 0
                self.cont_block.clear()
                return self.on_header_block(sid, self.cont_flags, block)
            return True
        if ftype == SETTINGS:
            return self.on_settings(flags, sid, payload)
        if ftype == WINDOW_UPDATE:
            if len(payload) != 4:
                return self.abort_connection("bad WINDOW_UPDATE", FRAME_SIZE_ERROR)
            inc = _U32.unpack(payload)[0] & 0x7FFFFFFF
            if sid == 0:
                self.send_window += inc
                if self.send_window > MAX_WINDOW:
                    return self.abort_connection("window overflow", FLOW_CONTROL_ERROR)
            else:
                s = self.streams.get(sid)
                if s is not None:
                    s.send_window += inc
            self.wake_writers()
            return True
        if ftype == PING:
            if not flags & ACK:
                self.send(frame(PING, ACK, 0, bytes(payload)))
            return True
        if ftype == RST_STREAM:
            s = self.streams.get(sid)
            if s is not None:
                self.drop(s)
                s.on_reset()
                if s.task is not None and not s._headers_sent:
                    return self.premature_reset()
            return True
        if ftype == GOAWAY:
            # The peer opens no new streams here; the open ones run to their end.
            return True
        if ftype == PUSH_PROMISE:
            return self.abort_connection("PUSH_PROMISE from a client")
        return True  # PRIORITY and unknown frame types are ignored (RFC 9113 §4.1, §5.5)

    def on_data_frame(self, flags: int, sid: int, payload: memoryview) -> bool:
        if sid == 0:
            return self.abort_connection("DATA on stream 0")  # RFC 9113 §6.1
        flow_len = len(payload)
        data: memoryview = payload
        if flags & PADDED:
            if not payload:
                return self.abort_connection("bad padding")
            pad = payload[0]
            if pad >= len(payload):
                return self.abort_connection("bad padding")
            data = payload[1 : len(payload) - pad]
        # Flow control counts the whole payload, padding included (RFC 9113 §6.1, §6.9.1),
        # as the credit we return does.
        self.recv_unacked += flow_len
        if self.recv_unacked > CONN_RECV_WINDOW:
            return self.abort_connection("connection window exceeded", FLOW_CONTROL_ERROR)
        s = self.streams.get(sid)
        if s is None:
            # A stream we closed (or reset): the data still used connection window.
            self.conn_credit_add(flow_len)
            return True
        if s._credit + flow_len > RECV_WINDOW:
            # More than the stream window we granted (RFC 9113 §6.9): stream error.
            self.send(frame(RST_STREAM, 0, sid, _U32.pack(FLOW_CONTROL_ERROR)))
            self.conn_credit_add(flow_len)
            self.drop(s)
            s.on_reset()
            s.cancel_handler()
            return True
        # Connection credit for message bytes is returned as the handler reads them (or
        # when the stream goes), so the connection window bounds what we buffer; padding
        # is returned at once. Streams get their credit back when read.
        if flow_len != len(data):
            self.conn_credit_add(flow_len - len(data))
        err = s.on_data(data, flow_len, bool(flags & END_STREAM))
        if err is not None:
            # UNIMPLEMENTED / RESOURCE_EXHAUSTED / INTERNAL, then stop the handler.
            code = 12 if err.startswith("compressed") else 8 if "larger" in err else 13
            s.finish(code, err)
            s.cancel_handler()
        return True

    def on_headers_frame(self, flags: int, sid: int, payload: memoryview) -> bool:
        start = 0
        end = len(payload)
        if flags & PADDED:
            if not payload:
                return self.abort_connection("bad padding")
            start = 1
            end -= payload[0]
        if flags & PRIORITY_FLAG:
            start += 5
        if start > end or sid == 0:
            return self.abort_connection("bad HEADERS frame")
        if end - start > self.server.max_header_list:
            return self.abort_connection("header block too large", ENHANCE_YOUR_CALM)
        block = bytes(payload[start:end])
        if not flags & END_HEADERS:
            self.cont_sid = sid
            self.cont_flags = flags
            self.cont_block = bytearray(block)
            return True
        return self.on_header_block(sid, flags, block)

    def on_header_block(self, sid: int, flags: int, block: bytes) -> bool:
        cached = self.header_cache.get(block)
        if cached is not None and cached[0] == self.table_gen:
            headers = cached[1]
        else:
            try:
                # The decoder must see every block in order: it keeps the dynamic table.
                headers = cast(list[tuple[str, str]], self.decoder.decode(block, raw=False))
            except OversizedHeaderListError:
                return self.abort_connection("header list too large", ENHANCE_YOUR_CALM)
            except Exception as e:  # hpack raises its own error types
                return self.abort_connection(f"HPACK: {e}", COMPRESSION_ERROR)
            if table_neutral(block):
                if len(self.header_cache) >= 64:
                    self.header_cache.clear()
                self.header_cache[block] = (self.table_gen, headers)
            else:
                self.table_gen += 1  # entries decoded before may now mean something else
        end = bool(flags & END_STREAM)
        s = self.streams.get(sid)
        if s is not None:  # trailers from the client end its side
            if end:
                s.on_data(b"", 0, True)
            return True
        if sid % 2 == 0:  # client streams are odd (RFC 9113 §5.1.1)
            return self.abort_connection("even stream id")
        if sid <= self.last_sid:
            # Trailers of a stream we already closed (we may have reset it: §5.1 says to
            # ignore such frames); a new stream cannot reuse or go below a used id.
            return True
        self.last_sid = sid
        if self.goaway_sent or len(self.streams) >= self.server.max_streams:
            # Over SETTINGS_MAX_CONCURRENT_STREAMS (RFC 9113 §5.1.2) or going away: refused
            # (the client may retry it elsewhere, §8.7); no handler runs.
            self.send(frame(RST_STREAM, 0, sid, _U32.pack(REFUSED_STREAM)))
            return True
        path = ""
        for k, v in headers:
            if k == ":path":
                path = v
                break
        target = self.server.handlers.get(path)
        stream = H2Stream(self, sid, path, headers, target[1] if target else None)
        self.streams[sid] = stream
        if target is None:
            stream._half_closed = end
            stream.finish(12, f"method {path} not implemented")  # UNIMPLEMENTED
            return True
        # The handler starts with the first message (or the end of the request), as
        # grpcio does: an answer never races the client's first write.
        stream.handler = target[0]
        if end:
            stream.on_data(b"", 0, True)
        return True

    def on_settings(self, flags: int, sid: int, payload: memoryview) -> bool:
        if sid != 0 or len(payload) % 6:
            return self.abort_connection("bad SETTINGS", FRAME_SIZE_ERROR)
        if flags & ACK:
            if payload:  # RFC 9113 §6.5
                return self.abort_connection("SETTINGS ACK with a payload", FRAME_SIZE_ERROR)
            return True
        for i in range(0, len(payload), 6):
            key, value = struct.unpack_from(">HI", payload, i)
            if key == S_INITIAL_WINDOW_SIZE:
                if value > MAX_WINDOW:
                    return self.abort_connection("bad window", FLOW_CONTROL_ERROR)
                delta = value - self.peer_initial_window
                self.peer_initial_window = value
                for s in self.streams.values():
                    s.send_window += delta
            elif key == S_MAX_FRAME_SIZE:
                if not 16_384 <= value <= 16_777_215:
                    return self.abort_connection("bad max frame size")
                self.peer_max_frame = value
        self.send(frame(SETTINGS, ACK, 0))
        self.wake_writers()
        return True

    # ------------------------------------------------------------ frames out

    def send(self, data: bytes) -> None:
        """Queue bytes; everything queued in one event-loop turn goes out in one write."""
        if self.closed:
            return
        self.out.append(data)
        if not self.flush_scheduled:
            self.flush_scheduled = True
            self.loop.call_soon(self.flush)

    def flush(self) -> None:
        self.flush_scheduled = False
        if self.out and self.transport is not None and not self.closed:
            data = b"".join(self.out) if len(self.out) > 1 else self.out[0]
            self.out.clear()
            self.transport.write(data)
        else:
            self.out.clear()

    def send_headers(self, sid: int, block: bytes, flags: int) -> None:
        mx = self.peer_max_frame
        if len(block) <= mx:
            self.send(frame(HEADERS, flags | END_HEADERS, sid, block))
            return
        self.send(frame(HEADERS, flags, sid, block[:mx]))
        for i in range(mx, len(block), mx):
            last = i + mx >= len(block)
            self.send(frame(CONTINUATION, END_HEADERS if last else 0, sid, block[i : i + mx]))

    async def send_data(self, s: H2Stream, data: bytes) -> None:
        """DATA frames within the peer's frame size and flow-control windows."""
        pos = 0
        n = len(data)
        while pos < n:
            if s._done or self.closed:
                raise asyncio.CancelledError()
            room = min(self.send_window, s.send_window, self.peer_max_frame, n - pos)
            if room <= 0:
                w = self.loop.create_future()
                self.window_waiters.append(w)
                await w
                continue
            chunk = data[pos : pos + room] if (pos or room < n) else data
            self.send(frame(DATA, 0, s.sid, chunk))
            self.send_window -= room
            s.send_window -= room
            pos += room
            if self.write_paused is not None:
                await self.write_paused

    def wake_writers(self) -> None:
        ws = self.window_waiters
        if ws:
            self.window_waiters = []
            for w in ws:
                if not w.done():
                    w.set_result(None)

    def conn_credit_add(self, n: int) -> None:
        """Release `n` bytes of our connection receive window (sent back in batches)."""
        self.conn_credit += n
        if self.conn_credit >= CONN_RECV_WINDOW // 4:
            self.send(frame(WINDOW_UPDATE, 0, 0, _U32.pack(self.conn_credit)))
            self.recv_unacked -= self.conn_credit
            self.conn_credit = 0

    def stream_credit(self, sid: int, n: int) -> None:
        if sid in self.streams and not self.closed:
            self.send(frame(WINDOW_UPDATE, 0, sid, _U32.pack(n)))

    def drop(self, s: H2Stream) -> None:
        """Remove a stream that ended (or was reset) and return its connection window."""
        self.streams.pop(s.sid, None)
        s.release()
        if self.goaway_sent and not self.streams:
            self.close_soon()

    def premature_reset(self) -> bool:
        """Account a client reset of a started, unanswered stream (rapid reset,
        CVE-2023-44487). Over the budget: GOAWAY(ENHANCE_YOUR_CALM); streams already open
        run to their end, new ones are refused, then the connection closes."""
        now = self.loop.time()
        server = self.server
        balance = self.reset_balance + (now - self.reset_at) * server.reset_refill_per_s
        self.reset_balance = min(balance, float(server.reset_budget)) - 1.0
        self.reset_at = now
        if self.reset_balance < 0 and not self.goaway_sent:
            log.warning("ext_proc HTTP/2: too many streams reset before an answer; GOAWAY")
            self.goaway(ENHANCE_YOUR_CALM, "too many resets")
        return True

    def goaway(self, code: int = NO_ERROR, text: str = "") -> None:
        if not self.goaway_sent:
            self.goaway_sent = True
            payload = struct.pack(">II", self.last_sid, code) + text.encode()[:256]
            self.send(frame(GOAWAY, 0, 0, payload))
            if not self.streams:
                self.close_soon()

    def close_soon(self) -> None:
        def close() -> None:
            self.flush()
            if self.transport is not None:
                self.transport.close()

        self.loop.call_soon(close)

    def abort_connection(self, why: str, code: int = PROTOCOL_ERROR) -> bool:
        log.warning("ext_proc HTTP/2 connection error: %s", why)
        self.broken = True
        self.goaway_sent = False
        self.goaway(code, why)
        for s in list(self.streams.values()):
            s.on_reset()
        self.streams.clear()
        self.close_soon()
        return False


def unary(fn: Callable[[Any, Any], Awaitable[Any]]) -> Handler:
    """A unary method `await fn(request, context) -> response` as a stream handler (the
    grpc.aio servicer signature, so scorer.v1.Scorer/Score and health Check run as is)."""

    async def handler(_: Any, stream: StreamContext) -> None:
        request = await stream.read()
        if request is EOF:
            await stream.abort(grpc.StatusCode.INTERNAL, "unary call without a request")
        await stream.write(await fn(request, stream))

    return handler


class H2GrpcServer:
    """gRPC bidi-stream server: `add_handler(path, handler, deserialize)`, `start`, `stop`."""

    def __init__(
        self,
        max_message: int = 80 * 1024 * 1024,
        *,
        max_streams: int = MAX_STREAMS,
        max_header_list: int = MAX_HEADER_LIST,
        reset_budget: int = RESET_BUDGET,
        reset_refill_per_s: float = RESET_REFILL_PER_S,
    ) -> None:
        self.max_message = max_message
        self.max_streams = max_streams
        self.max_header_list = max_header_list
        self.reset_budget = reset_budget
        self.reset_refill_per_s = reset_refill_per_s
        self.handlers: dict[str, tuple[Handler, Callable[[bytes], Any] | None]] = {}
        self.connections: set[H2Connection] = set()
        self.tasks: set[asyncio.Task[None]] = set()
        self.draining = False
        self._server: asyncio.Server | None = None

    def add_handler(
        self, path: str, handler: Handler, deserialize: Callable[[bytes], Any] | None = None
    ) -> None:
        """Serve `path` ("/package.Service/Method") with a bidi-stream handler."""
        self.handlers[path] = (handler, deserialize)

    async def start(self, host: str, port: int, reuse_port: bool = False) -> int:
        """Listen; returns the bound port."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: H2Connection(self), host, port, reuse_port=reuse_port or None, backlog=1024
        )
        return int(self._server.sockets[0].getsockname()[1])

    async def run(self, stream: H2Stream, handler: Handler) -> None:
        """Run one call's handler and end the stream with its status."""
        task = asyncio.current_task()
        assert task is not None
        self.tasks.add(task)
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
            self.tasks.discard(task)

    async def stop(self, grace: float | None) -> None:
        """Refuse new streams (GOAWAY), let open ones finish within `grace`, cancel the rest."""
        self.draining = True
        if self._server is not None:
            self._server.close()
        for c in list(self.connections):
            c.goaway()
        tasks = set(self.tasks)
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
