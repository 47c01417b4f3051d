"""The `h2` library as a reference HTTP/2 server, and a raw-frame driver that reports the
outcome class of a frame sequence against any server: accepted, stream error(s) with
their codes, or a connection error with its GOAWAY code.

The reference server advertises the same SETTINGS and connection window as ours
(scorer.extproc.transport.limits), returns flow-control credit as data arrives, answers
each stream with a gRPC OK when the request ends, and turns every h2 ProtocolError into
GOAWAY with the exception's error code (h2 itself resets streams for stream errors).
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import cast

import h2.config
import h2.connection
import h2.events
import h2.exceptions
import h2.settings

from scorer.extproc.transport import frames as F
from scorer.extproc.transport import limits as L

END_PING = b"diffdone"


class RefProtocol(asyncio.Protocol):
    """One connection of the h2-based reference server."""

    def __init__(self) -> None:
        self.conn = h2.connection.H2Connection(
            h2.config.H2Configuration(client_side=False, header_encoding=None)
        )
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A cast, not an isinstance check: uvloop's transports do not subclass asyncio's.
        self.transport = cast(asyncio.Transport, transport)
        c = self.conn
        c.local_settings = h2.settings.Settings(
            client=False,
            initial_values={
                h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: L.MAX_STREAMS,
                h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: L.RECV_WINDOW,
                h2.settings.SettingCodes.MAX_FRAME_SIZE: L.OUR_MAX_FRAME,
                h2.settings.SettingCodes.MAX_HEADER_LIST_SIZE: L.MAX_HEADER_LIST,
            },
        )
        c.initiate_connection()
        c.increment_flow_control_window(L.CONN_RECV_WINDOW - 65_535)
        transport.write(c.data_to_send())

    def data_received(self, data: bytes) -> None:
        assert self.transport is not None
        c = self.conn
        try:
            events = c.receive_data(data)
        except h2.exceptions.ProtocolError as e:
            c.close_connection(error_code=int(e.error_code))
            self.transport.write(c.data_to_send())
            self.transport.close()
            return
        for ev in events:
            if isinstance(ev, h2.events.DataReceived) and ev.flow_controlled_length:
                with contextlib.suppress(h2.exceptions.StreamClosedError):
                    c.acknowledge_received_data(ev.flow_controlled_length, ev.stream_id)
            ended = getattr(ev, "stream_ended", None)
            if isinstance(ev, h2.events.StreamEnded) or (
                isinstance(ev, h2.events.RequestReceived) and ended is not None
            ):
                sid = ev.stream_id
                try:
                    c.send_headers(
                        sid, [(b":status", b"200"), (b"content-type", b"application/grpc")]
                    )
                    c.send_headers(sid, [(b"grpc-status", b"0")], end_stream=True)
                except h2.exceptions.ProtocolError:
                    pass
        self.transport.write(c.data_to_send())


async def start_reference() -> tuple[asyncio.Server, int]:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(RefProtocol, "127.0.0.1", 0)
    return server, int(server.sockets[0].getsockname()[1])


@dataclass
class Outcome:
    """What the server did with a frame sequence."""

    goaway: int | None = None  # GOAWAY error code (None: no GOAWAY)
    resets: dict[int, int] = field(default_factory=dict)  # stream → RST_STREAM code
    closed: bool = False  # the server closed the connection before the final PING's ACK

    def kind(self) -> tuple[str, int | None]:
        """("connection", code) | ("stream", None) | ("accepted", None)."""
        if self.goaway not in (None, F.NO_ERROR):
            return ("connection", self.goaway)
        if any(code != F.NO_ERROR for code in self.resets.values()):
            return ("stream", None)
        if self.closed:
            return ("connection", self.goaway)
        return ("accepted", None)

    def stream_codes(self) -> dict[int, int]:
        return {s: c for s, c in self.resets.items() if c != F.NO_ERROR}


async def drive(port: int, payload: bytes, timeout: float = 10.0) -> Outcome:
    """Connect, send the preface, empty SETTINGS, `payload` and a PING; read until that
    PING's ACK (everything before it was processed) or until the server closes."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    out = Outcome()
    try:
        writer.write(
            F.PREFACE + F.frame(F.SETTINGS, 0, 0) + payload + F.frame(F.PING, 0, 0, END_PING)
        )
        buf = b""
        async with asyncio.timeout(timeout):
            while True:
                try:
                    chunk = await reader.read(65536)
                except ConnectionResetError:
                    chunk = b""
                if not chunk:
                    out.closed = True
                    return out
                buf += chunk
                while len(buf) >= 9:
                    lt, flags, sid = F.HDR.unpack_from(buf)
                    n = lt >> 8
                    if len(buf) < 9 + n:
                        break
                    body, buf = buf[9 : 9 + n], buf[9 + n :]
                    ftype = lt & 0xFF
                    if ftype == F.GOAWAY:
                        out.goaway = struct.unpack(">I", body[4:8])[0]
                    elif ftype == F.RST_STREAM:
                        out.resets.setdefault(sid, struct.unpack(">I", body)[0])
                    elif ftype == F.PING and flags & F.ACK and body == END_PING:
                        return out
    finally:
        writer.close()


class Raw:
    """An asyncio raw HTTP/2 client for attack tests: send bytes, read frames."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.buf = b""
        self.eof = False

    @classmethod
    async def connect(cls, port: int, handshake: bool = True) -> Raw:
        reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=1 << 22)
        raw = cls(reader, writer)
        if handshake:
            raw.send(F.PREFACE + F.frame(F.SETTINGS, 0, 0))
        return raw

    def send(self, data: bytes) -> None:
        self.writer.write(data)

    async def frames(
        self, until: Callable[[int, int, int, bytes], bool] | None = None, timeout: float = 10.0
    ) -> list[tuple[int, int, int, bytes]]:
        """Frames read until `until(type, flags, sid, payload)` is true or EOF."""
        out: list[tuple[int, int, int, bytes]] = []
        async with asyncio.timeout(timeout):
            while True:
                pos, buf = 0, self.buf
                while len(buf) - pos >= 9:
                    lt, flags, sid = F.HDR.unpack_from(buf, pos)
                    n = lt >> 8
                    if len(buf) - pos < 9 + n:
                        break
                    f = (lt & 0xFF, flags, sid, buf[pos + 9 : pos + 9 + n])
                    pos += 9 + n
                    out.append(f)
                    if until is not None and until(*f):
                        self.buf = buf[pos:]
                        return out
                self.buf = buf[pos:]
                if self.eof:
                    return out
                try:
                    chunk = await self.reader.read(1 << 20)
                except ConnectionResetError:
                    chunk = b""
                if not chunk:
                    self.eof = True
                self.buf += chunk

    async def until_eof(self) -> list[tuple[int, int, int, bytes]]:
        return await self.frames(None)

    async def ping(self, tag: bytes = b"12345678") -> list[tuple[int, int, int, bytes]]:
        self.send(F.frame(F.PING, 0, 0, tag))
        return await self.frames(lambda t, fl, s, p: t == F.PING and fl & F.ACK and p == tag)

    def close(self) -> None:
        self.writer.close()


def goaway_code(fs: list[tuple[int, int, int, bytes]]) -> int | None:
    for t, _, _, p in reversed(fs):
        if t == F.GOAWAY:
            return int(struct.unpack(">I", p[4:8])[0])
    return None
