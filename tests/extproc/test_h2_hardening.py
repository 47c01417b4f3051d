"""The HTTP/2 edge under attack (issue 11, item 5): each attack is driven with raw frames
against the asyncio transport; each test then checks that memory held for the connection
stayed bounded (server-side byte counts, not timings) and that a normal gRPC call on a new
connection is still answered.
"""

from __future__ import annotations

import asyncio
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import pytest
import pytest_asyncio
from grpc_health.v1 import health_pb2
from h2_reference import Raw, goaway_code
from hpack import Encoder

from scorer.extproc.transport import EOF, H2GrpcServer, StreamContext
from scorer.extproc.transport import frames as F
from scorer.extproc.transport import limits as L

PATH = "/t.S/Echo"
HEALTH = "/t.S/Health"
MiB = 1024 * 1024


async def echo(_: Any, stream: StreamContext) -> None:
    """Answers each message with its length (4 bytes); ends at EOF."""
    while (m := await stream.read()) is not EOF:
        if m == b"hang":
            await asyncio.Event().wait()  # stops reading (cancelled with the stream)
        await stream.write(struct.pack(">I", len(m)))


async def health(_: Any, stream: StreamContext) -> None:
    """A typed method: malformed protobuf must end only its own stream."""
    while (m := await stream.read()) is not EOF:
        await stream.write(health_pb2.HealthCheckResponse(status=1 if m.service == "" else 2))


@pytest_asyncio.fixture
async def server() -> AsyncIterator[Callable[..., Awaitable[tuple[H2GrpcServer, int]]]]:
    servers: list[H2GrpcServer] = []

    async def make(**bounds: Any) -> tuple[H2GrpcServer, int]:
        s = H2GrpcServer(max_message=bounds.pop("max_message", 100 * MiB), **bounds)
        s.add_handler(PATH, echo)
        s.add_handler(HEALTH, health, health_pb2.HealthCheckRequest.FromString)
        servers.append(s)
        return s, await s.start("127.0.0.1", 0)

    try:
        yield make
    finally:
        for s in servers:
            await s.stop(0.1)


async def normal_call(port: int, size: int = 10) -> None:
    """A fresh gRPC client still gets an answer (the attack did not take the server)."""
    async with grpc.aio.insecure_channel(
        f"127.0.0.1:{port}", options=[("grpc.max_send_message_length", -1)]
    ) as ch:
        call = ch.stream_stream(PATH, request_serializer=None, response_deserializer=None)
        got = await call(iter([b"x" * size]), timeout=30).read()
        assert got == struct.pack(">I", size)


def held(server: H2GrpcServer) -> int:
    """Bytes the server holds for its connections: message buffers, unparsed input,
    queued and unsent output."""
    total = 0
    for c in server.connections:
        total += c.buffered + len(c.buf) + sum(map(len, c.out))
        if c.transport is not None:
            total += c.transport.get_write_buffer_size()
    return total


def block(enc: Encoder, path: str = PATH, extra: tuple[tuple[str, str], ...] = ()) -> bytes:
    return bytes(
        enc.encode(
            [
                (":method", "POST"),
                (":scheme", "http"),
                (":path", path),
                (":authority", "t"),
                ("content-type", "application/grpc"),
                *extra,
            ]
        )
    )


def headers(enc: Encoder, sid: int, end: bool = False) -> bytes:
    return F.frame(F.HEADERS, F.END_HEADERS | (F.END_STREAM if end else 0), sid, block(enc))


def message(sid: int, body: bytes, end: bool = False) -> bytes:
    return F.frame(F.DATA, F.END_STREAM if end else 0, sid, struct.pack(">BI", 0, len(body)) + body)


# ---------------------------------------------------------------- SETTINGS


async def test_settings_cost_does_not_grow_with_open_streams(server: Any) -> None:
    """1,024 open streams and repeated SETTINGS that move every stream window: each is
    one assignment; windows still follow (a write waits at window 0, goes on at 64 KiB).
    A SETTINGS frame of 1 MiB (174k entries) is refused at once."""
    srv, port = await server()
    c = await Raw.connect(port)
    enc = Encoder()
    try:
        c.send(b"".join(headers(enc, sid) + message(sid, b"open") for sid in range(1, 2049, 2)))
        await c.frames(lambda t, fl, s, p: t == F.DATA and s == 2047)
        conn = next(iter(srv.connections))
        assert len(conn.streams) == 1024
        c.send(F.frame(F.SETTINGS, 0, 0, F.settings_payload(((F.S_INITIAL_WINDOW_SIZE, 0),))))
        await c.frames(lambda t, fl, s, p: t == F.SETTINGS and fl & F.ACK)
        c.send(message(1, b"y" * 10))  # the answer (9 bytes) waits for window
        await c.ping(b"waiting1")
        assert conn.peer_initial_window == 0
        for v in (1, 5, 100, 65_535):
            c.send(F.frame(F.SETTINGS, 0, 0, F.settings_payload(((F.S_INITIAL_WINDOW_SIZE, v),))))
        fs = await c.frames(lambda t, fl, s, p: t == F.DATA and s == 1)
        assert fs[-1][3] == b"\0\0\0\0\4" + struct.pack(">I", 10)
        huge = F.settings_payload(tuple((F.S_INITIAL_WINDOW_SIZE, 70_000) for _ in range(174_762)))
        c.send(F.frame(F.SETTINGS, 0, 0, huge))
        assert goaway_code(await c.until_eof()) == F.ENHANCE_YOUR_CALM
    finally:
        c.close()
    await normal_call(port)


async def test_ping_and_settings_floods_get_goaway(server: Any) -> None:
    _srv, port = await server(control_budget=50, control_refill_per_s=0.0)
    for kind in ("ping", "settings"):
        c = await Raw.connect(port)
        try:
            f = (
                F.frame(F.PING, 0, 0, b"8 bytes!")
                if kind == "ping"
                else F.frame(F.SETTINGS, 0, 0, F.settings_payload(((F.S_MAX_FRAME_SIZE, 16_384),)))
            )
            c.send(f * 50)
            c.send(F.frame(F.PING, 0, 0, b"over...."))  # the 51st: over the balance
            fs = await c.until_eof()
            assert goaway_code(fs) == F.ENHANCE_YOUR_CALM, kind
        finally:
            c.close()
    await normal_call(port)


@pytest.mark.slow
async def test_ping_answers_to_a_peer_that_does_not_read_stay_bounded(server: Any) -> None:
    """Pings echoed to a client that reads nothing: once the socket's write buffer is
    full the server stops reading that connection, so its answers cannot pile up (the
    issue measured +45 MB for 51 MB of PINGs)."""
    srv, port = await server(control_budget=10**9)
    c = await Raw.connect(port)
    try:
        c.writer.transport.set_write_buffer_limits(high=256 * MiB)
        pings = F.frame(F.PING, 0, 0, b"12345678") * 4096  # 68 KB
        conn = None
        for _ in range(3000):  # at most 200 MB offered; bounded wait on a condition
            conn = conn or next(iter(srv.connections), None)
            if conn is not None and conn.write_paused is not None:
                break
            c.send(pings)
            await asyncio.sleep(0.001)
        assert conn is not None and conn.write_paused is not None
        assert held(srv) < 2 * MiB
        # The client reads again: the backlog drains and the connection goes on.
        await c.ping(b"lastping")
        assert conn.write_paused is None
    finally:
        c.close()
    await normal_call(port)


# ---------------------------------------------------------------- flow control and memory


async def test_unread_data_is_bounded_by_withheld_credit(server: Any) -> None:
    """Handlers that read nothing: past max_buffered the server returns no credit, so a
    peer that respects windows stops; one that does not gets FLOW_CONTROL_ERROR. What the
    connection holds stays within max_buffered + the connection window."""
    srv, port = await server(max_buffered=2 * MiB)
    c = await Raw.connect(port)
    enc = Encoder()
    chunk = b"m" * (MiB - 5)
    try:
        c.send(b"".join(headers(enc, sid) + message(sid, b"hang") for sid in (1, 3, 5, 7)))
        await c.ping(b"opened..")
        # 20 MiB over four streams, more than the 16 MiB window: the connection closes.
        for i in range(20):
            c.send(message(1 + 2 * (i % 4), chunk))
        fs = await c.until_eof()
        assert goaway_code(fs) == F.FLOW_CONTROL_ERROR
        credited = sum(
            struct.unpack(">I", p)[0] for t, _, s, p in fs if t == F.WINDOW_UPDATE and s == 0
        )
        assert credited <= 2 * MiB + L.CONN_RECV_WINDOW // 4  # no credit past the bound
    finally:
        c.close()
    assert held(srv) == 0
    await normal_call(port)


@pytest.mark.slow
async def test_messages_over_the_stream_window_complete(server: Any) -> None:
    """A 40 MiB message (over the 16 MiB stream and connection windows): credit returns as
    its bytes arrive, so it completes (it never could before)."""
    _srv, port = await server()
    await normal_call(port, size=40 * MiB)
    # Even with a small memory bound: the one large message in progress may pass it.
    srv2, port2 = await server(max_buffered=MiB)
    await normal_call(port2, size=20 * MiB)
    assert held(srv2) == 0


async def test_zero_and_overflowing_window_updates(server: Any) -> None:
    _srv, port = await server()
    c = await Raw.connect(port)
    enc = Encoder()
    try:
        wu = lambda sid, inc: F.frame(F.WINDOW_UPDATE, 0, sid, struct.pack(">I", inc))  # noqa: E731
        c.send(headers(enc, 1) + message(1, b"a") + wu(1, 0))
        fs = await c.frames(lambda t, fl, s, p: t == F.RST_STREAM)
        assert fs[-1][2:] == (1, struct.pack(">I", F.PROTOCOL_ERROR))  # RFC 9113 §6.9
        c.send(headers(enc, 3) + message(3, b"b") + wu(3, 2**31 - 1))
        fs = await c.frames(lambda t, fl, s, p: t == F.RST_STREAM)
        assert fs[-1][2:] == (3, struct.pack(">I", F.FLOW_CONTROL_ERROR))  # §6.9.1
        c.send(headers(enc, 5) + message(5, b"c", end=True))  # the connection lives on
        await c.frames(lambda t, fl, s, p: s == 5 and t == F.HEADERS and fl & F.END_STREAM)
        c.send(wu(0, 0))
        assert goaway_code(await c.until_eof()) == F.PROTOCOL_ERROR
    finally:
        c.close()
    await normal_call(port)


# ---------------------------------------------------------------- connections and timeouts


async def test_connection_cap(server: Any) -> None:
    srv, port = await server(max_connections=4)
    clients = [await Raw.connect(port) for _ in range(6)]
    try:
        for c in clients[:4]:
            await c.ping()
        for c in clients[4:]:
            assert await c.until_eof() == []  # closed at accept, nothing sent
        assert srv.closed_by["refused"] == 2
    finally:
        for c in clients:
            c.close()
    for _ in range(3000):  # the server sees the closes (bounded wait on a condition)
        if len(srv.connections) == 0:
            break
        await asyncio.sleep(0.01)
    await normal_call(port)


async def test_handshake_and_idle_timeouts(server: Any) -> None:
    srv, port = await server(handshake_timeout=0.2, idle_timeout=0.3)
    silent = await Raw.connect(port, handshake=False)
    half = await Raw.connect(port, handshake=False)
    half.send(F.PREFACE[:10])
    idle = await Raw.connect(port)
    try:
        for c in (silent, half):  # closed by the server
            await c.until_eof()
            assert c.eof
        fs = await idle.until_eof()
        assert goaway_code(fs) == F.NO_ERROR
        assert srv.closed_by["handshake_timeout"] == 2 and srv.closed_by["idle"] == 1
    finally:
        for c in (silent, half, idle):
            c.close()
    await normal_call(port)


# ---------------------------------------------------------------- headers


async def test_empty_continuation_flood(server: Any) -> None:
    _srv, port = await server()
    c = await Raw.connect(port)
    try:
        c.send(F.frame(F.HEADERS, 0, 1, block(Encoder())))
        c.send(F.frame(F.CONTINUATION, 0, 1, b"") * 10_000)
        fs = await c.until_eof()
        assert goaway_code(fs) == F.ENHANCE_YOUR_CALM
    finally:
        c.close()
    await normal_call(port)


@pytest.mark.slow
async def test_hpack_decoding_has_a_byte_budget(server: Any) -> None:
    """Blocks that miss the cache (each changes the dynamic table) cost their size; past
    the budget: GOAWAY(ENHANCE_YOUR_CALM). Envoy's repeated block hits the cache."""
    _srv, port = await server(hpack_budget=256 * 1024, hpack_refill_per_s=0.0)
    c = await Raw.connect(port)
    try:
        # The same block 1,000 times (cache hits) is free.
        same = Encoder()
        first = block(same)
        repeat = block(same)  # indexed fields only: table-neutral
        c.send(F.frame(F.HEADERS, F.END_HEADERS | F.END_STREAM, 1, first))
        c.send(
            b"".join(
                F.frame(F.HEADERS, F.END_HEADERS | F.END_STREAM, sid, repeat)
                for sid in range(3, 2003, 2)
            )
        )
        fs = await c.ping(b"cached..")
        assert goaway_code(fs) is None
        c.close()
        c = await Raw.connect(port)
        enc = Encoder()
        blocks = [
            F.frame(
                F.HEADERS,
                F.END_HEADERS | F.END_STREAM,
                sid,
                block(enc, extra=((f"x-{sid}", "v" * 8000),)),
            )
            for sid in range(1, 81, 2)
        ]
        c.send(b"".join(blocks))
        assert goaway_code(await c.until_eof()) == F.ENHANCE_YOUR_CALM
    finally:
        c.close()
    await normal_call(port)


# ---------------------------------------------------------------- messages


async def test_malformed_protobuf_ends_only_its_stream(server: Any) -> None:
    srv, port = await server()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        good = ch.stream_stream(
            HEALTH,
            request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
            response_deserializer=health_pb2.HealthCheckResponse.FromString,
        )()
        await good.write(health_pb2.HealthCheckRequest(service=""))
        assert (await good.read()).status == 1
        bad = ch.stream_stream(HEALTH, request_serializer=None, response_deserializer=None)()
        await bad.write(b"\xff\xff\xff\xff")  # not a protobuf
        assert await bad.code() == grpc.StatusCode.INTERNAL
        assert "parse" in (await bad.details())
        # The other stream on the same connection goes on.
        await good.write(health_pb2.HealthCheckRequest(service="x"))
        assert (await good.read()).status == 2
        await good.done_writing()
        assert await good.code() == grpc.StatusCode.OK
    assert len(srv.closed_by) == 0
    await normal_call(port)


async def test_ping_length_is_checked(server: Any) -> None:
    """A PING of other than 8 bytes is a FRAME_SIZE_ERROR (RFC 9113 §6.7), not echoed."""
    _, port = await server()
    for payload in (b"", b"1234567", b"x" * 60_000):
        c = await Raw.connect(port)
        try:
            c.send(F.frame(F.PING, 0, 0, payload))
            fs = await c.until_eof()
            assert goaway_code(fs) == F.FRAME_SIZE_ERROR
            assert not [f for f in fs if f[0] == F.PING]
        finally:
            c.close()
    await normal_call(port)
