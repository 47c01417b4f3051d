"""The asyncio HTTP/2 transport (`server.extproc_transport: asyncio`).

1. The contract and API suites run on both transports through the parametrized
   `transport` fixture (tests/conftest.py); the asyncio-specific tests here use
   `h2harness`.
2. Transport behaviour a gRPC client relies on: many concurrent streams, 8 MB bodies both
   ways (flow control against grpcio's small windows), status codes and percent-encoded
   messages, cancellation, unknown methods, size limits, graceful stop.
3. Frame-level checks with a raw socket: one write per answer, RST_STREAM(NO_ERROR) after
   an early answer, PING, bad preface, GOAWAY, and the HPACK block cache staying correct
   when the dynamic table changes.
"""

from __future__ import annotations

import asyncio
import socket
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import pytest
from extproc_helpers import (
    PM,
    WORKERS,
    Harness,
    body_msg,
    harnesses,
    headers_msg,
)
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hpack import Encoder
from test_extproc_contract import completion, read

from scorer.api.v1 import scorer_pb2, scorer_pb2_grpc
from scorer.extproc.transport import H2GrpcServer, H2Stream
from scorer.extproc.transport import frames as T
from scorer.extproc.transport import hpack_codec as HP
from scorer.extproc.transport import limits as L

EOF_ = grpc.aio.EOF


@pytest.fixture
async def h2harness() -> AsyncIterator[Callable[..., Awaitable[Harness]]]:
    """The harness on the asyncio transport only (what this module tests)."""
    async with harnesses("asyncio") as make:
        yield make


# ---------------------------------------------------------------- through the App


async def test_score_and_health_check_on_the_extproc_port(h2harness) -> None:
    h = await h2harness()
    r = await scorer_pb2_grpc.ScorerStub(h.channel).Score(scorer_pb2.ScoreRequest(model="m"))
    assert r.status == 200 and r.endpoints[0] in WORKERS
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        await scorer_pb2_grpc.ScorerStub(h.channel).Score(scorer_pb2.ScoreRequest())
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    health = health_pb2_grpc.HealthStub(h.channel)
    for name in ("", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"):
        hc = await health.Check(health_pb2.HealthCheckRequest(service=name))
        assert hc.status == health_pb2.HealthCheckResponse.SERVING
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        await health.Check(health_pb2.HealthCheckRequest(service="nope"))
    assert ei.value.code() == grpc.StatusCode.NOT_FOUND
    await h.app.set_ready(False)
    hc = await health.Check(health_pb2.HealthCheckRequest(service="readiness"))
    assert hc.status == health_pb2.HealthCheckResponse.NOT_SERVING


async def test_many_concurrent_streams(h2harness) -> None:
    h = await h2harness()

    async def one(i: int) -> str:
        call = h.stream()
        await call.write(headers_msg({"x-request-id": f"c{i}"}))
        await call.write(body_msg(completion(), True))
        hr = await read(call)
        b = await read(call)
        assert b.request_body.response.body_mutation.streamed_response.body == completion()
        await call.done_writing()
        assert await asyncio.wait_for(call.read(), 5) is EOF_
        assert await call.code() == grpc.StatusCode.OK
        return hr.request_headers.response.header_mutation.set_headers[0].header.raw_value.decode()

    dests = await asyncio.gather(*(one(i) for i in range(120)))
    assert {dests.count(w) for w in set(dests)} == {40}  # round robin over 3 workers
    assert len(h.app.pool.inflight) == 0


async def test_8mb_body_both_ways_full_duplex(h2harness) -> None:
    h = await h2harness()
    payload = b'{"model": "m", "prompt": "' + bytes(range(97, 123)) * 322_638 + b'"}'
    assert len(payload) > 8 * 1024 * 1024
    call = h.stream()
    await call.write(headers_msg({}))
    step = 64 * 1024
    for i in range(0, len(payload), step):
        await call.write(body_msg(payload[i : i + step], i + step >= len(payload)))
    hr = await read(call)
    assert hr.HasField("request_headers")
    got = []
    for _ in range(len(payload) // 1000 + 2):  # bounded: chunks are far larger than 1 kB
        r = await read(call)
        sr = r.request_body.response.body_mutation.streamed_response
        assert len(sr.body) <= 62_000
        got.append(sr.body)
        if sr.end_of_stream:
            break
    assert b"".join(got) == payload
    await call.done_writing()
    assert await asyncio.wait_for(call.read(), 5) is EOF_


async def test_8mb_buffered_body_in_one_message(h2harness) -> None:
    h = await h2harness(extproc={"track_responses": False})
    payload = b'{"model": "m", "prompt": "' + b"x" * (8 * 1024 * 1024) + b'"}'
    call = h.stream()
    await call.write(headers_msg({}, body_mode=PM.BUFFERED))
    await read(call)
    await call.write(body_msg(payload, True))
    r = await read(call)
    assert r.request_body.response.header_mutation.set_headers[0].header.raw_value
    assert await asyncio.wait_for(call.read(), 5) is EOF_
    assert await call.code() == grpc.StatusCode.OK


# ---------------------------------------------------------------- the bare transport

PATH = "/test.Echo/Stream"


async def echo(_: Any, s: H2Stream) -> None:
    """Echo every message; b"abort" aborts, b"boom" raises, b"hang" waits forever."""
    while True:
        m = await s.read()
        if m is EOF_:
            return
        if m == b"abort":
            await s.abort(grpc.StatusCode.FAILED_PRECONDITION, "not now: héllo 100%")
        if m == b"boom":
            raise RuntimeError("boom")
        if m == b"hang":
            await asyncio.Event().wait()
        if m == b"header":
            await s.write(dict(s.headers).get("x-k", "").encode())
            continue
        await s.write(m)


@pytest.fixture
async def bare() -> AsyncIterator[tuple[H2GrpcServer, int]]:
    server = H2GrpcServer(max_message=1024 * 1024)
    server.add_handler(PATH, echo)
    port = await server.start("127.0.0.1", 0)
    try:
        yield server, port
    finally:
        await server.stop(0.1)


def raw_call(ch: grpc.aio.Channel, path: str = PATH) -> Any:
    return ch.stream_stream(path, request_serializer=None, response_deserializer=None)()


async def test_echo_status_and_messages(bare) -> None:
    _, port = bare
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        call = raw_call(ch)
        for m in (b"", b"a", b"b" * 100_000):
            await call.write(m)
            assert await call.read() == m
        await call.done_writing()
        assert await call.read() is EOF_
        assert await call.code() == grpc.StatusCode.OK

        async def status_of(msg: bytes | None, path: str = PATH) -> tuple[Any, str]:
            call = raw_call(ch, path)
            if msg is not None:
                await call.write(msg)
            await call.done_writing()
            with pytest.raises(grpc.aio.AioRpcError):
                await call.read()
            return await call.code(), await call.details()

        # grpc-message is percent-encoded on the wire and decoded by the client.
        code, details = await status_of(b"abort")
        assert (code, details) == (grpc.StatusCode.FAILED_PRECONDITION, "not now: héllo 100%")
        assert (await status_of(b"boom"))[0] == grpc.StatusCode.UNKNOWN
        code, _ = await status_of(b"x" * (1024 * 1024 + 1))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert (await status_of(None, "/test.Echo/Nope"))[0] == grpc.StatusCode.UNIMPLEMENTED


async def test_client_cancel_cancels_the_handler(bare) -> None:
    server, port = bare
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        call = raw_call(ch)
        await call.write(b"ping")
        assert await call.read() == b"ping"
        await call.write(b"hang")
        for _ in range(3000):  # bounded (~30 s) for a loaded machine
            if server.calls:
                break
            await asyncio.sleep(0.01)
        (stream,) = server.calls
        task = stream.task  # the handler awaits an event: it moved to a task
        assert task is not None
        call.cancel()
        await asyncio.wait_for(asyncio.wait({task}), 5)
        assert task.done() and not server.calls


async def test_graceful_stop_finishes_open_streams_and_refuses_new_ones(bare) -> None:
    server, port = bare
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        call = raw_call(ch)
        await call.write(b"a")
        assert await call.read() == b"a"
        stopping = asyncio.create_task(server.stop(5))
        # Wait (bounded) until stop() has sent GOAWAY: it sets `draining`, then sends
        # GOAWAY on every connection before its first await.
        for _ in range(3000):
            if server.draining:
                break
            await asyncio.sleep(0.01)
        assert server.draining
        await call.write(b"b")  # the open stream still works during the grace period
        assert await call.read() == b"b"
        await call.done_writing()
        assert await call.read() is EOF_
        assert await call.code() == grpc.StatusCode.OK
        await asyncio.wait_for(stopping, 5)
        call = raw_call(ch)
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await call.write(b"c")
            await call.read()
        assert ei.value.code() == grpc.StatusCode.UNAVAILABLE


class RawClient:
    """A bare HTTP/2 client: enough to look at the frames the server sends."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        self.enc = Encoder()
        self.buf = b""
        self.sock.sendall(T.PREFACE + T.frame(T.SETTINGS, 0, 0))

    def headers(self, sid: int, extra: list[tuple[str, str]], end: bool = False) -> bytes:
        hs = [(":method", "POST"), (":scheme", "http"), (":path", PATH),
              (":authority", "t"), ("content-type", "application/grpc"), *extra]  # fmt: skip
        block = self.enc.encode(hs)
        return T.frame(T.HEADERS, T.END_HEADERS | (T.END_STREAM if end else 0), sid, block)

    @staticmethod
    def message(sid: int, data: bytes, end: bool = False) -> bytes:
        return T.frame(
            T.DATA, T.END_STREAM if end else 0, sid, struct.pack(">BI", 0, len(data)) + data
        )

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def frames(
        self, until: Callable[[int, int, int, bytes], bool]
    ) -> list[tuple[int, int, int, bytes]]:
        out = []
        for _ in range(100_000):  # bounded: each recv has the socket's 5 s timeout too
            while len(self.buf) < 9 or len(self.buf) < 9 + (int.from_bytes(self.buf[:3], "big")):
                chunk = self.sock.recv(65536)
                if not chunk:
                    return out
                self.buf += chunk
            n = int.from_bytes(self.buf[:3], "big")
            f = (
                self.buf[3],
                self.buf[4],
                int.from_bytes(self.buf[5:9], "big"),
                self.buf[9 : 9 + n],
            )
            self.buf = self.buf[9 + n :]
            out.append(f)
            if until(*f):
                return out
        raise AssertionError("the server sent frames without end")

    def close(self) -> None:
        self.sock.close()


async def test_frames_of_an_early_answer(bare) -> None:
    _, port = bare
    c = RawClient(port)
    try:
        # The client does not half-close: the server answers, ends its side, then stops
        # the client's half with RST_STREAM(NO_ERROR) (RFC 9113 §8.1).
        await asyncio.to_thread(c.send, c.headers(1, []) + c.message(1, b"abort"))
        fs = await asyncio.to_thread(c.frames, lambda t, fl, sid, p: t == T.RST_STREAM)
        kinds = [(t, sid) for t, _, sid, _ in fs if t not in (T.SETTINGS, T.WINDOW_UPDATE)]
        assert kinds == [(T.HEADERS, 1), (T.RST_STREAM, 1)]  # Trailers-Only, then reset
        assert fs[-1][3] == struct.pack(">I", T.NO_ERROR)
        # PING is answered with the same payload.
        await asyncio.to_thread(c.send, T.frame(T.PING, 0, 0, b"12345678"))
        fs = await asyncio.to_thread(c.frames, lambda t, fl, sid, p: t == T.PING)
        assert fs[-1][1] == T.ACK and fs[-1][3] == b"12345678"
    finally:
        c.close()


async def test_hpack_cache_follows_dynamic_table_changes(bare) -> None:
    _, port = bare
    c = RawClient(port)
    try:
        got = []
        for sid, value in ((1, "v1"), (3, "v1"), (5, "v2"), (7, "v2"), (9, "v1")):
            # The encoder indexes x-k: the same value repeats as a one-byte indexed field
            # whose meaning depends on the dynamic table (cached until it changes).
            frames = c.headers(sid, [("x-k", value)]) + c.message(sid, b"header", end=True)
            await asyncio.to_thread(c.send, frames)
            fs = await asyncio.to_thread(
                c.frames,
                lambda t, fl, s, p, sid=sid: s == sid and t == T.HEADERS and fl & T.END_STREAM,
            )
            data = [p for t, _, s, p in fs if t == T.DATA and s == sid]
            got.append(data[0][5:].decode())
        assert got == ["v1", "v1", "v2", "v2", "v1"]
        assert HP.table_neutral(c.enc.encode([(":method", "POST"), ("x-k", "v1")]))
        assert not HP.table_neutral(c.enc.encode([("x-new", "1")]))
    finally:
        c.close()


async def test_bad_preface_closes_the_connection(bare) -> None:
    _, port = bare
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    try:
        await asyncio.to_thread(s.sendall, b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")

        def drain() -> bytes:
            out = b""
            while (chunk := s.recv(65536)) and len(out) < 1 << 20:  # bounded: an answer is small
                out += chunk
            return out

        data = await asyncio.to_thread(drain)
        assert struct.pack(">B", T.GOAWAY) in data[3:4] or T.GOAWAY in {
            data[i + 3] for i in range(0, len(data) - 9)
        }
    finally:
        s.close()


def test_status_trailers_encoding() -> None:
    assert HP.status_trailers(0) == b"\x00\x0bgrpc-status\x010"
    block = HP.status_trailers(14, "a%b\n")
    assert block.endswith(b"\x0cgrpc-message\x08a%25b%0A")
    assert HP.hpack_int(1337, 5, 0) == bytes([31, 154, 10])  # RFC 7541 C.1.2


async def test_reset_after_routing_counts_as_routed(h2harness) -> None:
    """Envoy ends a followed stream with RST_STREAM at the end of the exchange: that is a
    routed request, not a cancelled one (a reset before the answer is)."""
    from prometheus_client import REGISTRY

    def count(outcome: str) -> float:
        v = REGISTRY.get_sample_value("kv_scorer_extproc_streams_total", {"outcome": outcome})
        return v or 0.0

    h = await h2harness()
    routed, cancelled = count("routed"), count("cancelled")
    call = h.stream()
    await call.write(headers_msg({}))
    await call.write(body_msg(completion(), True))
    await read(call)
    await read(call)
    call.cancel()
    early = h.stream()
    await early.write(headers_msg({}))  # reset while the body is still awaited
    for _ in range(3000):  # bounded (~30 s) for a loaded machine
        if h.app.extproc_h2 is not None and h.app.extproc_h2.calls:
            break
        await asyncio.sleep(0.01)
    early.cancel()
    for _ in range(3000):  # bounded (~30 s) for a loaded machine
        if count("routed") == routed + 1 and count("cancelled") == cancelled + 1:
            break
        await asyncio.sleep(0.01)
    assert (count("routed"), count("cancelled")) == (routed + 1, cancelled + 1)


async def test_reuse_port_lets_two_servers_share_the_port() -> None:
    a, b, c = H2GrpcServer(), H2GrpcServer(), H2GrpcServer()
    for s in (a, b, c):
        s.add_handler(PATH, echo)
    port = await a.start("127.0.0.1", 0, reuse_port=True)
    try:
        assert await b.start("127.0.0.1", port, reuse_port=True) == port
        with pytest.raises(OSError):
            await c.start("127.0.0.1", port)  # without SO_REUSEPORT the port is taken
        await a.stop(0)  # the survivor keeps serving the port
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            call = raw_call(ch)
            await call.write(b"hi")
            assert await call.read() == b"hi"
            await call.done_writing()
    finally:
        await a.stop(0)
        await b.stop(0)


# ---------------------------------------------------------------- resource bounds

MiB = 1024 * 1024


def _until_eof(c: RawClient) -> list[tuple[int, int, int, bytes]]:
    """Every frame until the server closes the connection."""
    return c.frames(lambda t, fl, sid, p: False)


def _goaway_code(fs: list[tuple[int, int, int, bytes]]) -> int:
    """The error code of the last frame, which must be a GOAWAY (nothing after it)."""
    t, _, sid, p = fs[-1]
    assert (t, sid) == (T.GOAWAY, 0), fs[-3:]
    return int(struct.unpack(">I", p[4:8])[0])


def _ping(c: RawClient, tag: bytes) -> list[tuple[int, int, int, bytes]]:
    """Frames up to the answer of a PING: everything the server sent before it."""
    c.send(T.frame(T.PING, 0, 0, tag))
    return c.frames(lambda t, fl, sid, p: t == T.PING and p == tag)


def _rst(sid: int, code: int = T.CANCEL) -> bytes:
    return T.frame(T.RST_STREAM, 0, sid, struct.pack(">I", code))


def _msg_frame(sid: int, size: int, pad: int | None = None) -> bytes:
    """A DATA frame of `size` payload bytes (padding included) holding one whole message."""
    if pad is None:
        return T.frame(T.DATA, 0, sid, struct.pack(">BI", 0, size - 5) + b"m" * (size - 5))
    n = size - 1 - pad - 5
    body = bytes([pad]) + struct.pack(">BI", 0, n) + b"m" * n + b"\0" * pad
    return T.frame(T.DATA, T.PADDED, sid, body)


@pytest.fixture
async def server_with() -> AsyncIterator[Callable[..., Awaitable[tuple[H2GrpcServer, int]]]]:
    servers: list[H2GrpcServer] = []

    async def make(**kw: Any) -> tuple[H2GrpcServer, int]:
        s = H2GrpcServer(max_message=MiB, **kw)
        s.add_handler(PATH, echo)
        servers.append(s)
        return s, await s.start("127.0.0.1", 0)

    try:
        yield make
    finally:
        for s in servers:
            await s.stop(0.1)


async def test_max_concurrent_streams_is_advertised_and_enforced(server_with) -> None:
    server, port = await server_with(max_streams=2)
    c = RawClient(port)
    try:
        fs = await asyncio.to_thread(c.frames, lambda t, fl, sid, p: t == T.SETTINGS)
        settings = dict(struct.iter_unpack(">HI", fs[-1][3]))
        assert settings[T.S_MAX_CONCURRENT_STREAMS] == 2
        assert settings[T.S_MAX_HEADER_LIST_SIZE] == L.MAX_HEADER_LIST == 64 * 1024
        opened = b"".join(c.headers(sid, []) + c.message(sid, b"hang") for sid in (1, 3))
        third = c.headers(5, []) + c.message(5, b"x", end=True)
        await asyncio.to_thread(c.send, opened + third)
        fs = await asyncio.to_thread(c.frames, lambda t, fl, sid, p: t == T.RST_STREAM)
        assert fs[-1][2:] == (5, struct.pack(">I", T.REFUSED_STREAM))  # RFC 9113 §5.1.2
        assert len(server.calls) == 2  # the refused stream started no handler
        assert not [f for f in fs if f[2] == 5 and f[0] != T.RST_STREAM]
        # A slot freed by a reset is usable again.
        await asyncio.to_thread(c.send, _rst(1) + c.headers(7, []) + c.message(7, b"y", end=True))
        fs = await asyncio.to_thread(
            c.frames, lambda t, fl, sid, p: sid == 7 and t == T.HEADERS and fl & T.END_STREAM
        )
        assert [p[5:] for t, _, sid, p in fs if t == T.DATA and sid == 7] == [b"y"]
    finally:
        c.close()


def _big_literal_then_indexed(times: int) -> bytes:
    """A small HPACK block that decodes large: one 4,000-byte header added to the dynamic
    table (RFC 7541 §6.2.1), then indexed `times` more times (index 62, §2.3.3)."""
    literal = b"\x40" + HP.hpack_int(1, 7, 0) + b"x" + HP.hpack_int(4000, 7, 0) + b"a" * 4000
    return literal + b"\xbe" * times


@pytest.mark.parametrize(
    "shape", ["one_headers_frame", "continuation_flood", "decoded_list_too_large"]
)
async def test_header_block_bound_is_a_connection_error(bare, shape: str) -> None:
    """Over SETTINGS_MAX_HEADER_LIST_SIZE: GOAWAY(ENHANCE_YOUR_CALM) and close, without
    buffering the rest of a block (CONTINUATION flood, CVE-2024-27316)."""
    _, port = bare
    c = RawClient(port)
    try:
        if shape == "one_headers_frame":
            data = T.frame(T.HEADERS, T.END_HEADERS, 1, b"\x88" * (L.MAX_HEADER_LIST + 1))
        elif shape == "continuation_flood":
            # No END_HEADERS: the block stays open; 16 KiB pieces until one more would
            # pass 64 KiB. Nothing is sent after the frame that crosses the bound.
            data = T.frame(T.HEADERS, 0, 1, b"\x88" * 16_384)
            data += b"".join(T.frame(T.CONTINUATION, 0, 1, b"\x88" * 16_384) for _ in range(3))
            data += T.frame(T.CONTINUATION, 0, 1, b"\x88")
        else:
            block = _big_literal_then_indexed(20)  # ~4 KB on the wire, ~80 KB decoded
            assert len(block) < 5000
            data = T.frame(T.HEADERS, T.END_HEADERS | T.END_STREAM, 1, block)
        await asyncio.to_thread(c.send, data)
        fs = await asyncio.to_thread(_until_eof, c)
        assert _goaway_code(fs) == T.ENHANCE_YOUR_CALM
    finally:
        c.close()


async def test_stream_window_overrun_is_a_stream_flow_control_error(server_with) -> None:
    """DATA beyond the 8 MiB stream window we granted (padding counts, RFC 9113 §6.1):
    RST_STREAM(FLOW_CONTROL_ERROR); the connection lives on. (max_buffered 1: no credit
    is returned for message bytes, so the window is not refilled.)"""
    server, port = await server_with(max_buffered=1)
    c = RawClient(port)
    try:
        hang = c.message(1, b"hang")  # 9 flow-controlled bytes, read by the handler
        await asyncio.to_thread(c.send, c.headers(1, []) + hang)
        # Past max_buffered nothing is credited back. 7 padded 1 MiB frames
        # and one of 1 MiB - 9 fill the 8 MiB window exactly: allowed.
        full = b"".join(_msg_frame(1, MiB, pad=255) for _ in range(7))
        full += _msg_frame(1, MiB - 9, pad=255)
        await asyncio.to_thread(c.send, full)
        fs = await asyncio.to_thread(_ping, c, b"window=0")
        assert not [f for f in fs if f[0] in (T.RST_STREAM, T.GOAWAY)]
        assert not [f for f in fs if f[0] == T.WINDOW_UPDATE and f[2] == 1]
        await asyncio.to_thread(c.send, T.frame(T.DATA, 0, 1, b"\0"))  # one byte over
        fs = await asyncio.to_thread(c.frames, lambda t, fl, sid, p: t == T.RST_STREAM)
        assert fs[-1][2:] == (1, struct.pack(">I", T.FLOW_CONTROL_ERROR))
        for _ in range(3000):  # bounded (~30 s) for a loaded machine
            if not server.calls:
                break
            await asyncio.sleep(0.01)
        assert not server.calls  # the handler was cancelled
        await asyncio.to_thread(c.send, c.headers(3, []) + c.message(3, b"z", end=True))
        fs = await asyncio.to_thread(
            c.frames, lambda t, fl, sid, p: sid == 3 and t == T.HEADERS and fl & T.END_STREAM
        )
        assert [p[5:] for t, _, sid, p in fs if t == T.DATA and sid == 3] == [b"z"]
    finally:
        c.close()


async def test_connection_window_overrun_is_a_connection_flow_control_error(server_with) -> None:
    """Past max_buffered (here 1 byte) no credit is returned, so unread data holds the
    16 MiB connection window: streams within their own windows but over the connection's
    get GOAWAY(FLOW_CONTROL_ERROR); a peer ignoring flow control cannot make us buffer
    more than max_buffered + the connection window."""
    _, port = await server_with(max_buffered=1)
    c = RawClient(port)
    try:
        chunk = _msg_frame(0, MiB)[9:]
        for sid in (1, 3, 5):
            # 3 x 9 + 7 + 7 + 2 MiB > 16 MiB: the 2nd frame on stream 5 crosses.
            frames_ = b"".join(T.frame(T.DATA, 0, sid, chunk) for _ in range(7 if sid < 5 else 2))
            await asyncio.to_thread(c.send, c.headers(sid, []) + c.message(sid, b"hang") + frames_)
        fs = await asyncio.to_thread(_until_eof, c)
        assert _goaway_code(fs) == T.FLOW_CONTROL_ERROR
        assert not [f for f in fs if f[0] == T.RST_STREAM]
        assert not [f for f in fs if f[0] == T.WINDOW_UPDATE and f[2] == 0][1:]  # only the first
    finally:
        c.close()


async def test_rapid_reset_gets_goaway_but_resets_after_an_answer_do_not(server_with) -> None:
    server, port = await server_with(reset_budget=20, reset_refill_per_s=0.0)
    c = RawClient(port)
    c.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # 50 round trips below
    try:
        # Envoy's pattern: answer first, then the client resets the stream. Never counted.
        for sid in range(1, 101, 2):
            await asyncio.to_thread(c.send, c.headers(sid, []) + c.message(sid, b"a"))
            await asyncio.to_thread(c.frames, lambda t, fl, s, p, sid=sid: s == sid and t == T.DATA)
            await asyncio.to_thread(c.send, _rst(sid))
        # A long-lived stream that must survive the GOAWAY below.
        await asyncio.to_thread(c.send, c.headers(101, []) + c.message(101, b"keep"))
        await asyncio.to_thread(c.frames, lambda t, fl, s, p: s == 101 and t == T.DATA)

        def resets(sids: range) -> bytes:
            return b"".join(c.headers(s, []) + c.message(s, b"hang") + _rst(s) for s in sids)

        # Resets of started, unanswered streams: the budget (20) allows 20.
        await asyncio.to_thread(c.send, resets(range(103, 143, 2)))
        fs = await asyncio.to_thread(_ping, c, b"budget=0")
        assert not [f for f in fs if f[0] == T.GOAWAY]
        await asyncio.to_thread(c.send, resets(range(143, 145, 2)))  # the 21st
        fs = await asyncio.to_thread(c.frames, lambda t, fl, s, p: t == T.GOAWAY)
        last_sid, code = struct.unpack(">II", fs[-1][3][:8])
        assert (code, last_sid) == (T.ENHANCE_YOUR_CALM, 143)
        # Graceful: the open stream still works, new streams are refused, and the
        # connection closes when the last open stream ends.
        await asyncio.to_thread(c.send, c.headers(145, []) + c.message(101, b"b", end=True))
        fs = await asyncio.to_thread(_until_eof, c)
        assert (T.RST_STREAM, 145, struct.pack(">I", T.REFUSED_STREAM)) in [
            (t, s, p) for t, _, s, p in fs
        ]
        assert [p[5:] for t, _, s, p in fs if t == T.DATA and s == 101] == [b"b"]
        assert not server.calls
    finally:
        c.close()


@pytest.mark.parametrize(
    "case", ["settings_ack_with_payload", "headers_on_even_stream", "data_on_stream_0"]
)
async def test_protocol_errors_close_the_connection(bare, case: str) -> None:
    _, port = bare
    c = RawClient(port)
    try:
        if case == "settings_ack_with_payload":  # RFC 9113 §6.5: FRAME_SIZE_ERROR
            data, want = T.frame(T.SETTINGS, T.ACK, 0, struct.pack(">HI", 4, 1)), T.FRAME_SIZE_ERROR
        elif case == "data_on_stream_0":  # §6.1: PROTOCOL_ERROR
            data, want = c.message(0, b"x"), T.PROTOCOL_ERROR
        else:  # §5.1.1: client streams are odd; an even one is PROTOCOL_ERROR
            data = c.headers(3, []) + c.message(3, b"hang") + c.headers(2, [])
            want = T.PROTOCOL_ERROR
        await asyncio.to_thread(c.send, data)
        fs = await asyncio.to_thread(_until_eof, c)
        assert _goaway_code(fs) == want
    finally:
        c.close()


@pytest.mark.parametrize("read_size", [1, 7, 4096])
async def test_socket_reads_into_the_reused_buffer_parse_as_the_whole_bytes(read_size: int) -> None:
    """The socket reads into the connection's own buffer (BufferedProtocol), which the
    next read overwrites: frames cut across reads of any size give the same answers as
    the bytes handed over whole."""
    from test_wire import Recorder

    from scorer.extproc.transport import H2Connection

    block = Encoder().encode(
        [(":method", "POST"), (":scheme", "http"), (":path", PATH), (":authority", "x"),
         ("content-type", "application/grpc"), ("te", "trailers")]
    )  # fmt: skip
    msgs = b"".join(struct.pack(">BI", 0, len(m)) + m for m in (b"one", b"two" * 300))
    data = (
        T.PREFACE
        + T.frame(T.SETTINGS, 0, 0, b"")
        + T.frame(T.HEADERS, T.END_HEADERS, 1, block)
        + T.frame(T.DATA, 0, 1, msgs[:100])
        + T.frame(T.DATA, T.END_STREAM, 1, msgs[100:])
    )
    outs = []
    for size in (len(data), read_size):
        server = H2GrpcServer()
        server.add_handler(PATH, echo)
        conn = H2Connection(server)
        t = Recorder()
        conn.connection_made(t)
        for i in range(0, len(data), size):
            piece = data[i : i + size]
            buf = conn.get_buffer(-1)
            buf[: len(piece)] = piece
            conn.buffer_updated(len(piece))
            buf[: len(piece)] = b"\xff" * len(piece)  # what the next read would do
        for _ in range(100):  # bounded: the handler echoes, then the stream ends
            if 1 not in conn.streams and not conn.flush_scheduled:
                break
            await asyncio.sleep(0)
        outs.append(bytes(t.out))
    assert outs[0] == outs[1]
    assert b"two" * 300 in outs[0]


async def test_work_deferred_by_a_fast_answer_runs_after_the_answer_is_written() -> None:
    """`after_write` inside a `fast` answerer: the answer leaves in the read's one write
    first, then the deferred call runs (bookkeeping never holds an answer back); a
    deferred call that fails ends its stream with UNKNOWN, as a failing handler does."""
    from test_wire import Recorder

    from scorer.extproc.transport import H2Connection

    t = Recorder()
    seen: list[bytes] = []

    async def handler(_: Any, s: H2Stream) -> None:
        def fast(raw: bytes) -> bool:
            assert s.write_now(raw)

            def later() -> None:
                if raw == b"fail":
                    raise RuntimeError("bookkeeping failed")
                seen.append(bytes(t.out))

            s.after_write(later)
            return True

        await s.write(await s.read())
        s.on_message(fast)
        while await s.read() is not EOF_:
            pass

    server = H2GrpcServer()
    server.add_handler(PATH, handler)
    conn = H2Connection(server)
    conn.connection_made(t)
    block = Encoder().encode(
        [(":method", "POST"), (":scheme", "http"), (":path", PATH), (":authority", "x"),
         ("content-type", "application/grpc"), ("te", "trailers")]
    )  # fmt: skip

    def msg(m: bytes) -> bytes:
        return T.frame(T.DATA, 0, 1, struct.pack(">BI", 0, len(m)) + m)

    conn.data_received(
        T.PREFACE + T.frame(T.SETTINGS, 0, 0, b"") + T.frame(T.HEADERS, T.END_HEADERS, 1, block)
    )
    conn.data_received(msg(b"first"))
    for _ in range(100):  # bounded: until the handler has installed its answerer
        if conn.streams[1].fast is not None and not conn.flush_scheduled:
            break
        await asyncio.sleep(0)
    conn.data_received(msg(b"second"))
    assert len(seen) == 1 and seen[0].endswith(b"second")  # written before it ran
    assert seen[0] == bytes(t.out)
    conn.data_received(msg(b"fail"))
    assert 1 not in conn.streams  # the stream was ended, with trailers (UNKNOWN)
    ftype, flags, sid, payload = _frames(bytes(t.out))[-2]  # then RST_STREAM(NO_ERROR)
    assert (ftype, sid) == (T.HEADERS, 1) and flags & T.END_STREAM
    from hpack import Decoder

    assert ("grpc-status", "2") in Decoder().decode(payload)


async def test_a_fast_answerer_that_fails_ends_its_stream_with_unknown() -> None:
    """A `fast` answerer that raises on a message read alone (the frame loop's lane,
    H2Connection.one_message) or among other frames ends its stream with UNKNOWN, as a
    failing handler does; the message's bytes are released and its credit returned, and
    the connection keeps serving its other streams."""
    from test_wire import Recorder

    from scorer.extproc.transport import H2Connection

    async def handler(_: Any, s: H2Stream) -> None:
        def fast(raw: bytes) -> bool:
            if raw == b"boom":
                raise RuntimeError("answerer failed")
            assert s.write_now(raw)
            return True

        await s.write(await s.read())
        s.on_message(fast)
        while await s.read() is not EOF_:
            pass

    block = Encoder().encode(
        [(":method", "POST"), (":scheme", "http"), (":path", PATH), (":authority", "x"),
         ("content-type", "application/grpc"), ("te", "trailers")]
    )  # fmt: skip

    def msg(sid: int, m: bytes) -> bytes:
        return T.frame(T.DATA, 0, sid, struct.pack(">BI", 0, len(m)) + m)

    for alone in (True, False):
        t = Recorder()
        server = H2GrpcServer()
        server.add_handler(PATH, handler)
        conn = H2Connection(server)
        conn.connection_made(t)
        conn.data_received(T.PREFACE + T.frame(T.SETTINGS, 0, 0, b""))
        for sid in (1, 3):
            conn.data_received(T.frame(T.HEADERS, T.END_HEADERS, sid, block) + msg(sid, b"hi"))
        for _ in range(100):  # bounded: until both handlers have installed their answerer
            if all(s.fast is not None for s in conn.streams.values()):
                break
            await asyncio.sleep(0)
        assert len(conn.streams) == 2
        if alone:
            conn.data_received(msg(1, b"boom"))
        else:
            conn.data_received(msg(3, b"ok") + msg(1, b"boom"))
        assert 1 not in conn.streams and 3 in conn.streams
        assert conn.buffered == 0 and conn.recv_unacked == conn.conn_credit
        heads = [f for f in _frames(bytes(t.out)) if f[0] == T.HEADERS and f[2] == 1]
        from hpack import Decoder

        dec = Decoder()
        got = [dec.decode(f[3]) for f in heads]
        assert ("grpc-status", "2") in got[-1]
        conn.data_received(msg(3, b"still"))
        assert bytes(t.out).endswith(b"still")
        conn.connection_lost(None)
        await asyncio.sleep(0)


def _frames(data: bytes) -> list[tuple[int, int, int, bytes]]:
    out = []
    pos = 0
    while pos + 9 <= len(data):
        lt, flags, sid = T.HDR.unpack_from(data, pos)
        n = lt >> 8
        out.append((lt & 0xFF, flags, sid, data[pos + 9 : pos + 9 + n]))
        pos += 9 + n
    return out
