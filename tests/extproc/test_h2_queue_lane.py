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
from configs import new_default_loop, run_on_default_loop
from grpc_health.v1 import health_pb2
from hpack import Encoder
from hypo import scaled
from hypothesis import example, given, settings
from hypothesis import strategies as st

from scorer.extproc.transport import EOF, H2Connection, H2GrpcServer, H2Stream, StreamContext
from scorer.extproc.transport import frames as F
from scorer.extproc.transport.connection import FRAME_LANE
from scorer.native import NATIVE

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
    await stop_handlers(server)
    assert not server.calls
    # The cancelled handlers' closing frames come in the order of the server's call set
    # (object addresses): compared as a set of frames, not as a byte sequence.
    closing = b"".join(sorted(split_frames(sink.data[len(before) :])))
    return before + closing, states, got, general


async def stop_handlers(server: H2GrpcServer) -> None:
    """Interrupt every running handler and let each end (a loop turn or two each)."""
    for s in list(server.calls):
        s.interrupt()
    for _ in range(100):  # bounded
        if not server.calls:
            break
        await asyncio.sleep(0)


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
    # (KV_SCORER_PURE_PYTHON=1 runs: nothing compiled to compare.)
    compiled = await run("compiled" if FRAME_LANE is not None else "python", monkeypatch)
    without = await run("off", monkeypatch)
    for got in (with_lane, compiled):
        assert got[0] == without[0]
        assert got[1] == without[1]
        assert got[2] == without[2]
    assert ("raw", b"one") in with_lane[2] and ("typed", "s") in with_lane[2]
    # The compiled lane queued what the Python one did: the rest went the general way
    # (but the empty END_STREAM, which the compiled loop takes itself).
    assert compiled[3] == [n for n in with_lane[3] if n or FRAME_LANE is None]
    assert len(with_lane[3]) < len(without[3])


# ------------------------------------------------------------------ the compiled lane

# A stream in the request phase as the lane normally finds it, and one departure from it
# per example in about half of them (most examples still reach the accounting).
_Q_ASIDE = {
    "compressed": ("shape", "compressed"),
    "length short": ("shape", "short"),
    "length long": ("shape", "long"),
    "over max_message": ("max_message", 10),
    "half closed": ("half_closed", True),
    "partial message buffered": ("buf", b"\x00\x00"),
    "stream dropped": ("sizes", None),
    "stream window full": ("unacked", 8 * 1024 * 1024 - 10),
    "connection window full": ("recv_unacked", 16 * 1024 * 1024 - 10),
    "memory bound": ("buffered", 4000 - 10),
    "does not parse": ("parses", False),
    "outside data_received": ("receiving", False),
}
_Q_STATE = st.fixed_dictionaries(
    {
        "size": st.sampled_from([0, 1, 40, 127, 3000]),
        "typed": st.booleans(),
        "handler": st.booleans(),  # not started yet (else parked in read())
        "known": st.sampled_from([True, True, False]),  # in conn.streams
        # Below, past and (with a 40-byte untyped message: 45 bytes) at the thresholds.
        "conn_credit": st.sampled_from([0, 16 * 1024 * 1024 // 4 - 10, 16 * 1024 * 1024 // 4 - 45]),
        "credit": st.sampled_from([0, 8 * 1024 * 1024 // 4 - 10, 8 * 1024 * 1024 // 4 - 45]),
        "big_sid": st.sampled_from([0, 0, 1, 3]),
        "queued": st.sampled_from([0, 0, 2]),  # messages already waiting for read()
        "aside": st.sampled_from([""] * 2 * len(_Q_ASIDE) + sorted(_Q_ASIDE)),
    }
)


async def _keep(_: Any, stream: StreamContext) -> None:
    await stream.read()


def _q_case(loop: asyncio.AbstractEventLoop, st_: dict[str, Any]) -> tuple[Any, Any, bytes]:
    """A connection and one stream in state `st_`, and the DATA frame to queue."""
    st_ = {
        "shape": "ok", "max_message": 1 << 20, "half_closed": False, "buf": b"",
        "sizes": (), "unacked": 0, "recv_unacked": 0, "buffered": 0, "parses": True,
        "receiving": True, **st_,
    }  # fmt: skip
    if st_["aside"]:
        k, v = _Q_ASIDE[st_["aside"]]
        st_[k] = v
    server = H2GrpcServer(max_message=st_["max_message"], max_buffered=4000)
    conn = H2Connection(server)
    conn.connection_made(Sink())
    conn.data_received(F.PREFACE + F.frame(F.SETTINGS, 0, 0))
    conn.out.clear()
    body = b"q" * st_["size"]
    deserialize = None
    if st_["typed"]:
        deserialize = health_pb2.HealthCheckRequest.FromString
        body = health_pb2.HealthCheckRequest(service="s" * st_["size"]).SerializeToString()
        if not st_["parses"]:
            body = b"\xff\xff"
    s = H2Stream(conn, 1, PATH, [], deserialize)
    if st_["known"]:
        conn.streams[1] = s
    conn.last_sid = 1
    if st_["handler"]:
        s.handler = _keep
    else:
        s._waiter = loop.create_future()
    for i in range(st_["queued"]):
        s._msgs.append(b"m%d" % i)
        s._sizes.append(10)  # type: ignore[union-attr]
    s._half_closed = st_["half_closed"]
    s._buf += st_["buf"]
    if st_["sizes"] is None:
        s._sizes = None
    s._unacked = st_["unacked"]
    conn.recv_unacked = st_["recv_unacked"]
    conn.buffered = s._held = st_["buffered"]
    conn.conn_credit = st_["conn_credit"]
    s._credit = st_["credit"]
    conn.big_sid = st_["big_sid"]
    conn.receiving = st_["receiving"]
    flag, n = 0, len(body)
    if st_["shape"] == "compressed":
        flag = 1
    elif st_["shape"] == "short":
        n = n - 1 if n else 2
    elif st_["shape"] == "long":
        n += 1
    frame = F.frame(F.DATA, 0, 1, struct.pack(">BI", flag, n) + body)
    return conn, s, frame


def _q_snapshot(conn: Any, s: Any, took: bool) -> dict[str, Any]:
    names = ("recv_unacked", "conn_credit", "buffered", "owed", "big_sid")
    got: dict[str, Any] = {k: getattr(conn, k) for k in names}
    for k in ("_unacked", "_credit", "_held", "_owed", "_ready", "_half_closed"):
        got["s" + k] = getattr(s, k)
    got["took"] = took
    got["msgs"] = list(s._msgs)
    got["sizes"] = None if s._sizes is None else list(s._sizes)
    got["started"] = (s.handler is None, s._coro is not None)
    got["woken"] = s._waiter is not None and s._waiter.done()
    got["out"] = list(conn.out)
    got["ready"] = [r.sid for r in conn.ready]
    return got


@settings(max_examples=scaled(200))
@given(state=_Q_STATE)
@example(  # the common case: a handler started by its first message, credit batched
    state={
        "size": 40, "typed": True, "handler": True, "known": True, "conn_credit": 0,
        "credit": 0, "big_sid": 0, "queued": 0, "aside": "",
    },
)  # fmt: skip
@example(  # credit past a quarter window on both levels (WINDOW_UPDATEs), the big stream
    state={
        "size": 3000, "typed": False, "handler": False, "known": True,
        "conn_credit": 16 * 1024 * 1024 // 4 - 10, "credit": 8 * 1024 * 1024 // 4 - 10,
        "big_sid": 1, "queued": 2, "aside": "",
    },
)  # fmt: skip
@example(  # a message protobuf rejects: left to the general path
    state={
        "size": 1, "typed": True, "handler": False, "known": True, "conn_credit": 0,
        "credit": 0, "big_sid": 0, "queued": 0, "aside": "does not parse",
    },
)  # fmt: skip
def test_compiled_queue_lane_state_space_matches_queue_message(state: dict[str, Any]) -> None:
    """`queue_lane` then `queue_message` (so a frame the compiled lane leaves is still
    taken by Python, as `frame_lane` leaves it to `on_frame`) against `queue_message`
    alone, from the same connection and stream state (windows near full, credit at its
    batching thresholds, the memory bound, the big stream, a handler to start or a parked
    read to wake, a stream no longer in the table, bad message prefixes, a message that
    does not parse): the same result, accounting, queued messages, frames and wake-ups."""
    assert NATIVE is not None  # `make` builds it (tests/index/test_native.py checks the build)
    loop = new_default_loop()
    try:

        async def one(compiled: bool) -> dict[str, Any]:
            assert NATIVE is not None
            conn, s, frame = _q_case(loop, state)
            took = bool(compiled and NATIVE.queue_lane(conn, s, frame, 9, len(frame)))
            if compiled and not took:
                assert _q_snapshot(conn, s, False) == before  # changed nothing
            took = took or conn.queue_message(s, frame, 9, len(frame))
            got = _q_snapshot(conn, s, took)
            if s._coro is not None:
                s._coro.close()
            conn.connection_lost(None)
            return got

        async def both() -> tuple[dict[str, Any], dict[str, Any]]:
            nonlocal before
            conn, s, _ = _q_case(loop, state)
            before = _q_snapshot(conn, s, False)
            conn.connection_lost(None)
            return await one(True), await one(False)

        before: dict[str, Any] = {}
        compiled, python = loop.run_until_complete(both())
        assert compiled == python
    finally:
        loop.close()


# Frames a client may send, as the frame-loop property test draws them (stream ids 1-7).
_FRAME = st.one_of(
    st.tuples(st.just("headers"), st.sampled_from([1, 3, 5, 7]), st.sampled_from(range(4))),
    st.tuples(st.just("message"), st.sampled_from([1, 3, 5, 7]), st.sampled_from([0, 5, 40])),
    st.tuples(st.just("message"), st.sampled_from([1, 3]), st.sampled_from([3000])),
    st.tuples(st.just("typed"), st.sampled_from([1, 3]), st.sampled_from([0, 1])),
    st.tuples(st.just("odd"), st.sampled_from([1, 3, 0]), st.sampled_from(range(7))),
    st.tuples(st.just("end"), st.sampled_from([1, 3, 5, 0]), st.sampled_from(range(3))),
    st.tuples(st.just("control"), st.sampled_from([0, 1, 3]), st.sampled_from(range(11))),
)


def _frame(enc: Encoder, f: tuple[str, int, int]) -> bytes:
    kind, sid, arg = f
    if kind == "headers":  # a new stream (3: typed), ended at once, or in CONTINUATIONs
        if arg == 0:
            return headers(enc, sid, TYPED if sid == 3 else PATH)
        block = enc.encode([(":method", "POST"), (":path", PATH), (":scheme", "http")])
        if arg == 1:
            return F.frame(F.HEADERS, F.END_HEADERS | F.END_STREAM, sid, block)
        first = F.frame(F.HEADERS, 0, sid, block[:2])
        if arg == 2:
            return first + F.frame(F.CONTINUATION, F.END_HEADERS, sid, block[2:])
        return first  # what follows must be a CONTINUATION (a DATA is a connection error)
    if kind == "message":
        return data(sid, msg(b"m" * arg))
    if kind == "typed":  # one that parses, one protobuf rejects
        body = health_pb2.HealthCheckRequest(service="s").SerializeToString()
        return data(sid, msg(body if arg else b"\xff\xff"))
    if kind == "odd":  # DATA the lane leaves: split, two messages, padded, flags, compressed
        m = msg(b"x" * 30)
        return [
            data(sid, m[:12]) + data(sid, m[12:]),
            data(sid, msg(b"a") + msg(b"b")),
            data(sid, b"\x01" + msg(b"p") + b"\x00", F.PADDED),
            data(sid, msg(b"e"), F.END_STREAM),
            data(sid, msg(b"z", compressed=1)),
            data(sid, b"\x00\x00\x00"),
            data(sid, b"\x00\x00\x00\x00\x09" + b"y" * 9 + b"!"),  # a byte past the message
        ][arg]
    if kind == "end":  # the empty END_STREAM (Envoy's), trailers, a padded empty one
        block = enc.encode([("x-t", "1")])
        return [
            data(sid, b"", F.END_STREAM),
            F.frame(F.HEADERS, F.END_HEADERS | F.END_STREAM, sid, block),
            data(sid, b"\x00", F.END_STREAM | F.PADDED),
        ][arg]
    return [  # connection-level and stream-control frames
        F.window_update(sid, 1000),
        F.window_update(sid, 0),
        F.window_update(sid, 2**31 - 1),  # past the largest window
        F.frame(F.WINDOW_UPDATE, 0, sid, b"\x00\x01"),
        F.frame(F.HEADERS, F.END_HEADERS | F.PRIORITY_FLAG, sid, bytes(5) + b"\x82"),
        F.frame(F.PING, 0, 0, b"12345678"),
        F.frame(F.RST_STREAM, 0, sid, bytes(4)),
        F.frame(F.RST_STREAM, 0, sid, bytes(3)),
        F.frame(F.SETTINGS, 0, 0, F.settings_payload(((F.S_INITIAL_WINDOW_SIZE, 100),))),
        F.frame(0x42, 0, sid, b"ext"),  # unknown type: ignored
        F.HDR.pack(((1 << 20) + 1) << 8, 0, sid),  # over our max frame size
    ][arg]


@settings(max_examples=scaled(300))
@given(frames_=st.lists(_FRAME, min_size=1, max_size=14), cuts=st.lists(st.integers(0, 10**6)))
@example(  # one request as Envoy sends it, every frame in one read
    frames_=[("headers", 1, 0), ("message", 1, 40), ("message", 1, 5), ("message", 1, 0)],
    cuts=[],
)
@example(  # Envoy's lean request: then the empty END_STREAM, RST_STREAM, WINDOW_UPDATE
    frames_=[
        ("headers", 1, 0), ("message", 1, 40), ("message", 1, 0), ("end", 1, 0),
        ("control", 1, 6), ("control", 0, 0), ("headers", 3, 0), ("control", 3, 6),
    ],
    cuts=[],
)  # fmt: skip
@example(  # an answer larger than the stream window: the handler waits on a task for the
    # credit of the WINDOW_UPDATE in the next read (3065: where its frame starts)
    frames_=[("headers", 1, 0), ("control", 0, 8), ("message", 1, 3000), ("control", 1, 0)],
    cuts=[3065],
)
@example(frames_=[("headers", 1, 0), ("control", 0, 1)], cuts=[])  # a connection error
@example(frames_=[("headers", 1, 0), ("control", 0, 2)], cuts=[])  # the window overflows
@example(  # a started stream reset before its answer (rapid reset accounting)
    frames_=[("headers", 1, 0), ("message", 1, 5), ("control", 1, 6)], cuts=[]
)
@example(  # the same cut inside frame headers and payloads
    frames_=[("headers", 1, 0), ("message", 1, 40), ("typed", 3, 1), ("message", 1, 3000)],
    cuts=[5, 13, 60, 3001],
)
@example(  # frames the lane leaves, between ones it takes
    frames_=[
        ("headers", 1, 0), ("odd", 1, 0), ("message", 1, 5), ("odd", 1, 2), ("odd", 1, 6),
        ("control", 1, 6), ("message", 1, 5), ("headers", 3, 0), ("typed", 3, 0),
    ],
    cuts=[],
)  # fmt: skip
def test_compiled_frame_loop_matches_the_python_loop(
    frames_: list[tuple[str, int, int]], cuts: list[int]
) -> None:
    """Any sequence of frames (requests as Envoy sends them, frames the one-message lane
    leaves, control frames, protocol errors), cut into reads anywhere, through the
    compiled frame loop and through the Python one: the same bytes out, accounting after
    every read and messages to the handlers."""
    enc = Encoder()
    stream = b"".join(_frame(enc, f) for f in frames_)
    reads_ = [F.PREFACE + F.frame(F.SETTINGS, 0, 0)]
    prev = 0
    for c in sorted({c % (len(stream) + 1) for c in cuts} | {len(stream)}):
        if c > prev:
            reads_.append(stream[prev:c])
            prev = c
    got = [run_on_default_loop(feed(compiled, reads_)) for compiled in (True, False)]
    assert got[0] == got[1]


async def feed(compiled: bool, reads_: list[bytes]) -> tuple[Any, ...]:
    """`reads_` into a fresh connection, with the compiled lanes (frame loop, handler
    steps, answers) or without any: the bytes written, the accounting after each read,
    the messages the handlers read (the untyped one answers each, as ext_proc does)."""
    got: list[tuple[str, Any]] = []

    async def keep(_: Any, stream: StreamContext) -> None:
        while (m := await stream.read()) is not EOF:
            got.append(("raw", bytes(m)))
            await stream.write(b"re:" + bytes(m))
        got.append(("eof", None))

    async def typed(_: Any, stream: StreamContext) -> None:
        while (m := await stream.read()) is not EOF:
            got.append(("typed", m.service))

    server = H2GrpcServer(max_buffered=4000)
    server.add_handler(PATH, keep)
    server.add_handler(TYPED, typed, health_pb2.HealthCheckRequest.FromString)
    conn = H2Connection(server)
    lanes = ("frame_lane", "write_lane", "take_lane", "chunk_lane")
    for name in lanes:
        if compiled:
            assert getattr(conn, name) is not None
        else:
            setattr(conn, name, None)
    sink = Sink()
    conn.connection_made(sink)
    states = []
    for r in reads_:
        conn.data_received(r)
        more = (conn.need, bytes(conn.buf), conn.broken, conn.goaway_sent, conn.cont_sid)
        windows = (conn.send_window, conn.peer_initial_window, conn.reset_balance)
        states.append((state(conn), more, windows, conn.last_sid))
        for _ in range(3):  # bounded: the handlers read what was queued
            await asyncio.sleep(0)
    await stop_handlers(server)
    conn.connection_lost(None)
    return bytes(sink.data), states, got


def test_the_lanes_compiled_constants_are_the_transports() -> None:
    """The compiled lanes hard-code the windows and frame limit (C constants): a change in
    limits.py or frames.py that the .pyx did not follow would make the lanes decide
    differently from the Python methods only at those edges."""
    from scorer.extproc.transport import limits

    assert NATIVE is not None
    assert NATIVE.LANE_CONSTANTS == (
        limits.RECV_WINDOW,
        limits.CONN_RECV_WINDOW,
        limits.OUR_MAX_FRAME,
        F.MAX_WINDOW,
        F.FRAME_SIZE_ERROR,
    )
