"""The one-message lane's queueing (`H2Connection.queue_message`, and the compiled frame
loop `frame_lane` with its compiled copy) against the general path (`on_data_frame` +
`H2Stream.on_data`): the same frames, fed read by read with the lane on (Python or
compiled) and off, give the same bytes out, the same flow-control and memory accounting
after every read, and the same messages to the handler."""

from __future__ import annotations

import asyncio
import struct
from typing import Any

import pytest
from grpc_health.v1 import health_pb2
from hpack import Encoder

from scorer.extproc.transport import EOF, H2Connection, H2GrpcServer, StreamContext
from scorer.extproc.transport import frames as F

PATH = "/t.S/Keep"
# The methods the runs spy on (each run patches the class again: not the last run's spy).
QUEUE_MESSAGE = H2Connection.queue_message
ON_DATA_FRAME = H2Connection.on_data_frame
TYPED = "/t.S/Typed"


class Sink(asyncio.Transport):
    """A transport that keeps what is written."""

    def __init__(self) -> None:
        super().__init__()
        self.data = bytearray()

    def write(self, data: Any) -> None:
        self.data += data

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default

    def is_closing(self) -> bool:
        return False

    def close(self) -> None:
        pass

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


def headers(enc: Encoder, sid: int, path: str) -> bytes:
    block = enc.encode(
        [
            (":method", "POST"),
            (":scheme", "http"),
            (":path", path),
            (":authority", "t"),
            ("content-type", "application/grpc"),
        ]
    )
    return F.frame(F.HEADERS, F.END_HEADERS, sid, block)


def msg(body: bytes, compressed: int = 0) -> bytes:
    return struct.pack(">BI", compressed, len(body)) + body


def data(sid: int, payload: bytes, flags: int = 0) -> bytes:
    return F.frame(F.DATA, flags, sid, payload)


def reads() -> list[bytes]:
    """Reads mixing what the lane takes (one whole message per frame) with what it
    leaves: split messages, two messages in a frame, padding, END_STREAM, a compressed
    flag, a malformed typed message, a stream over the memory bound."""
    enc = Encoder()
    check = health_pb2.HealthCheckRequest(service="s").SerializeToString()
    big = b"b" * 3000
    return [
        F.PREFACE + F.frame(F.SETTINGS, 0, 0),
        headers(enc, 1, PATH) + data(1, msg(b"one")) + data(1, msg(b"two")),
        data(1, msg(b"x" * 40)[:20]) + data(1, msg(b"x" * 40)[20:]),
        data(1, msg(b"a") + msg(b"b")),
        data(1, msg(big)) + data(1, msg(big)),  # the second passes max_buffered
        headers(enc, 3, TYPED) + data(3, msg(check)),
        data(3, msg(b"\xff\xff")),
        headers(enc, 5, PATH) + data(5, msg(b"z", compressed=1)),
        headers(enc, 7, PATH) + data(7, b"\x02" + msg(b"padded") + b"\x00\x00", F.PADDED),
        data(1, msg(b"last")) + data(1, b"", F.END_STREAM),
        headers(enc, 9, PATH) + data(9, msg(b"")) + data(9, msg(b"nine")),
    ]


def state(conn: H2Connection) -> tuple[Any, ...]:
    streams = tuple(
        (sid, s._unacked, s._credit, s._owed, s._held, bytes(s._buf), s._half_closed)
        for sid, s in sorted(conn.streams.items())
    )
    return (
        conn.recv_unacked,
        conn.conn_credit,
        conn.buffered,
        conn.owed,
        conn.big_sid,
        streams,
    )


async def run(lane: str, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, ...]:
    """`lane`: "python" (queue_message), "compiled" (frame_lane) or "off"."""
    got: list[tuple[str, Any]] = []

    async def keep(_: Any, stream: StreamContext) -> None:
        while (m := await stream.read()) is not EOF:
            got.append(("raw", bytes(m)))
        got.append(("eof", None))

    async def typed(_: Any, stream: StreamContext) -> None:
        while (m := await stream.read()) is not EOF:
            got.append(("typed", m.service))

    used = []
    queue = QUEUE_MESSAGE

    def spy(self: H2Connection, *a: Any) -> bool:
        taken = queue(self, *a) if lane == "python" else False
        used.append(taken)
        return taken

    general: list[int] = []  # DATA frames the general path took
    on_data_frame = ON_DATA_FRAME

    def counted(self: H2Connection, *a: Any) -> bool:
        general.append(len(a[2]))
        return on_data_frame(self, *a)

    monkeypatch.setattr(H2Connection, "queue_message", spy)
    monkeypatch.setattr(H2Connection, "on_data_frame", counted)
    server = H2GrpcServer(max_buffered=4000)
    server.add_handler(PATH, keep)
    server.add_handler(TYPED, typed, health_pb2.HealthCheckRequest.FromString)
    conn = H2Connection(server)
    if lane == "compiled":
        assert conn.frame_lane is not None  # `make` builds it
    else:
        conn.frame_lane = None
    sink = Sink()
    conn.connection_made(sink)
    states = []
    for r in reads():
        conn.data_received(r)
        states.append(state(conn))
        for _ in range(5):  # bounded: the handlers read what was queued
            await asyncio.sleep(0)
        states.append(state(conn))
    assert any(used) == (lane == "python")
    before = bytes(sink.data)
    for s in list(server.calls):
        s.interrupt()
    for _ in range(100):  # bounded: each cancelled handler ends in a loop turn or two
        if not server.calls:
            break
        await asyncio.sleep(0)
    assert not server.calls
    # The cancelled handlers' closing frames come in the order of the server's call set
    # (object addresses): compared as a set of frames, not as a byte sequence.
    closing = b"".join(sorted(split_frames(sink.data[len(before) :])))
    return before + closing, states, got, general


def split_frames(data: bytes | bytearray) -> list[bytes]:
    """Whole frames of `data` (9-byte header + payload), in order."""
    out, i = [], 0
    while i + 9 <= len(data):
        end = i + 9 + int.from_bytes(data[i : i + 3], "big")
        out.append(bytes(data[i:end]))
        i = end
    assert i == len(data)
    return out


async def test_queue_lane_matches_the_general_path(monkeypatch: pytest.MonkeyPatch) -> None:
    with_lane = await run("python", monkeypatch)
    compiled = await run("compiled", monkeypatch)
    without = await run("off", monkeypatch)
    for got in (with_lane, compiled):
        assert got[0] == without[0]
        assert got[1] == without[1]
        assert got[2] == without[2]
    assert ("raw", b"one") in with_lane[2] and ("typed", "s") in with_lane[2]
    # The compiled lane queued what the Python one did: the rest went the general way.
    assert compiled[3] == with_lane[3]
    assert len(with_lane[3]) < len(without[3])
