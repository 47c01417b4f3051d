"""The fast response path (scorer.extproc.wire + H2Stream.on_message) against the protobuf
path it stands in for.

- the encoder gives the bytes protobuf's SerializeToString gives;
- the reader accepts only messages protobuf parses, with the same body and end_of_stream;
- end to end, on our HTTP/2 transport: the same client bytes (response headers, body
  chunks with unknown fields, metadata, malformed messages, gRPC messages split across
  DATA frames and DATA frames split across reads) into a connection with the fast path and
  into one with it switched off give byte-identical answers and the same director calls.

Property tests are derandomized in `make test`; counterexamples are kept as @example.
"""

from __future__ import annotations

import asyncio
import itertools
import struct
from collections.abc import Iterator
from typing import Any

import pytest
from configs import make_config, new_default_loop
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from hpack import Encoder
from hypo import scaled
from hypothesis import example, given, settings
from hypothesis import strategies as st

from scorer.app import App
from scorer.extproc import protocol as P
from scorer.extproc import wire
from scorer.extproc.servicer import PROCESS_PATH
from scorer.extproc.transport import H2Connection, H2Stream
from scorer.extproc.transport import frames as F
from scorer.extproc.transport.connection import FRAME_LANE
from scorer.extproc.transport.limits import CONN_RECV_WINDOW, RECV_WINDOW
from scorer.native import NATIVE

PM = processing_mode_pb2.ProcessingMode
SIZES = st.one_of(st.integers(0, 300), st.sampled_from([127, 128, 16_379, 16_384, 70_000]))


def _body(n: int, seed: int = 0) -> bytes:
    return bytes((seed + i) % 251 for i in range(n))


# ------------------------------------------------------------------ encoder


@settings(max_examples=scaled(200))
@given(n=SIZES, end=st.booleans(), seed=st.integers(0, 250))
@example(n=0, end=False, seed=0)  # empty chunk: the nested messages still present
@example(n=0, end=True, seed=0)
@example(n=127, end=True, seed=0)  # the varint length boundaries
@example(n=128, end=False, seed=0)
@example(n=16_384, end=True, seed=0)
def test_encoder_bytes_equal_protobuf(n: int, end: bool, seed: int) -> None:
    body = _body(n, seed)
    ours = wire.streamed_body_response(body, end, wire.RESP_RESPONSE_BODY)
    assert ours == P.streamed_response_body(body, end).SerializeToString()
    # The same encoder for the request body streamed back (FULL_DUPLEX_STREAMED).
    if n <= P.BODY_CHUNK_BYTES:
        ref = P.streamed_body(body, end)[0].SerializeToString()
        assert wire.streamed_body_response(body, end, wire.RESP_REQUEST_BODY) == ref


@pytest.mark.parametrize("n", [0, 1, 62_000, 62_001, 124_000, 130_000])
@pytest.mark.parametrize("end", [True, False])
def test_request_body_streamed_back_bytes_equal_protobuf(n: int, end: bool) -> None:
    body = _body(n)
    ref = [r.SerializeToString() for r in P.streamed_body(body, end_of_stream=end)]
    assert wire.streamed_body(body, end) == ref


# ------------------------------------------------------------------ reader


def _field(number: int, wt: int, value: bytes) -> bytes:
    return wire.varint(number << 3 | wt) + value


def _len_field(number: int, value: bytes) -> bytes:
    return _field(number, 2, wire.varint(len(value)) + value)


_META_SERVED = base_pb2.Metadata(
    filter_metadata={"envoy.lb": {"fields": {P.SERVED_KEY: {"string_value": "1.2.3.4:8"}}}}
).SerializeToString()
_META_LONG = base_pb2.Metadata(
    filter_metadata={
        "envoy.lb": {"fields": {P.SERVED_KEY: {"string_value": ",".join(["10.0.0.1:8000"] * 20)}}}
    }
).SerializeToString()

# Bytes appended to a response_body message: unknown fields of each wire type, a group,
# the oneof switched or repeated, HttpBody's other flags, metadata good and bad, junk.
EXTRAS = {
    "none": b"",
    "unknown varint": _field(15, 0, b"\x01"),
    "unknown len": _len_field(100, b"abc"),
    "unknown fixed32": _field(12, 5, b"\x01\x02\x03\x04"),
    "unknown fixed64": _field(13, 1, b"\x00" * 8),
    "unknown group": _field(15, 3, b"") + _field(15, 4, b""),
    "old async_mode": _field(1, 0, b"\x01"),
    "observability_mode": _field(10, 0, b"\x01"),
    "observability_mode as len": _len_field(10, b""),
    "response_body again": _len_field(5, _len_field(1, b"zz")),
    "oneof switched": _len_field(4, b""),
    "end_of_stream_without_message": _len_field(5, _field(3, 0, b"\x01")),
    "metadata served": _len_field(8, _META_SERVED),
    "metadata malformed": _len_field(8, _len_field(1, b"\xff")),
    # A two-byte length (Envoy's metadata with a long served list), a length written in
    # three bytes (valid protobuf, not Envoy's), metadata then another field.
    "metadata long": _len_field(8, _META_LONG),
    "metadata padded length": _field(
        8, 2, bytes((0x80 | len(_META_SERVED), 0x80, 0x00)) + _META_SERVED
    ),
    "metadata then unknown": _len_field(8, _META_SERVED) + _field(15, 0, b"\x01"),
    "metadata twice": _len_field(8, _META_SERVED) + _len_field(8, _META_SERVED),
    "attributes": _len_field(9, b""),
    "protocol_config": _len_field(11, b""),
    "truncated length": b"\x2a\x05ab",
    "bad varint": b"\x78" + b"\xff" * 11,
    "field zero": b"\x00\x01",
}


def chunk_raw(body: bytes, end: bool, extra: str, inner: bytes = b"") -> bytes:
    """A response_body ProcessingRequest as protobuf writes it, then `extra` appended, with
    `inner` bytes added inside the HttpBody."""
    hb = ep.HttpBody(body=body, end_of_stream=end).SerializeToString() + inner
    return _len_field(5, hb) + EXTRAS[extra]


INNER = st.sampled_from(
    [
        b"",
        _field(4, 0, b"\x01"),  # grpc_message_compressed
        _field(2, 0, b"\x00"),  # end_of_stream again: the last one wins
        _field(2, 0, b"\x85\x80\x00"),  # end_of_stream as a 3-byte varint (true)
        _len_field(1, b"second body"),  # body twice: the last one wins
        _len_field(7, b"x"),  # unknown inside HttpBody
        _field(2, 2, b"\x00"),  # end_of_stream with the wrong wire type
    ]
)


def reference(raw: bytes) -> tuple[bytes, bool] | None:
    """What the protobuf path makes of `raw` for a response body: (body, end) or None."""
    try:
        m = ep.ProcessingRequest.FromString(raw)
    except Exception:
        return None
    if m.WhichOneof("request") != "response_body":
        return None
    return m.response_body.body, m.response_body.end_of_stream


def parses(raw: bytes) -> bool:
    try:
        ep.ProcessingRequest.FromString(raw)
    except Exception:
        return False
    return True


def accepted(raw: bytes) -> tuple[bytes, bool] | None:
    """What the fast path takes (the servicer checks a metadata_context with protobuf)."""
    got = wire.body_chunk(raw)
    if got is None:
        return None
    body, end, meta = got
    if meta:
        try:
            base_pb2.Metadata.FromString(meta)
        except Exception:
            return None
    return body, end


@settings(max_examples=scaled(300))
@given(
    n=SIZES,
    end=st.booleans(),
    extra=st.sampled_from(sorted(EXTRAS)),
    inner=INNER,
    junk=st.binary(max_size=24),
    use_junk=st.booleans(),
)
@example(n=0, end=False, extra="none", inner=b"", junk=b"", use_junk=False)
@example(n=5, end=True, extra="metadata served", inner=b"", junk=b"", use_junk=False)
@example(n=5, end=True, extra="metadata malformed", inner=b"", junk=b"", use_junk=False)
@example(n=5, end=False, extra="response_body again", inner=b"", junk=b"", use_junk=False)
@example(n=0, end=True, extra="metadata padded length", inner=b"", junk=b"", use_junk=False)
@example(n=0, end=True, extra="metadata then unknown", inner=b"", junk=b"", use_junk=False)
@example(n=3, end=True, extra="metadata twice", inner=b"", junk=b"", use_junk=False)
@example(n=0, end=True, extra="metadata long", inner=b"\x10\x01", junk=b"", use_junk=False)
def test_reader_takes_only_what_protobuf_parses_the_same(
    n: int, end: bool, extra: str, inner: bytes, junk: bytes, use_junk: bool
) -> None:
    raw = junk if use_junk else chunk_raw(_body(n), end, extra, inner)
    ours = accepted(raw)
    if ours is not None:
        assert reference(raw) == ours
    # The plain shapes Envoy sends are taken (the fast path is used, not only safe).
    plain = ("none", "metadata served", "metadata long", "unknown varint")
    if not use_junk and not inner and extra in plain:
        assert ours == (_body(n), end)


@pytest.mark.parametrize("extra", ["none", "metadata served", "metadata long"])
@pytest.mark.parametrize("n", [0, 1, 127, 128, 16_000])
@pytest.mark.parametrize("end", [False, True])
def test_envoy_chunk_shapes_are_read_without_the_field_loop(
    monkeypatch: pytest.MonkeyPatch, extra: str, n: int, end: bool
) -> None:
    """What Envoy sends for a chunk (a body, the empty last chunk with end_of_stream,
    metadata_context after the HttpBody when the gateway forwards a namespace) is read by
    the short path, not field by field; the same values as protobuf."""
    raw = chunk_raw(_body(n), end, extra)
    if n == 0 and not end:
        return  # an empty HttpBody: not a shape Envoy sends mid-stream (the loop reads it)

    def no_loop(*a: object) -> tuple[int, int]:
        raise AssertionError("the general field loop was used")

    monkeypatch.setattr(wire, "_read_varint", no_loop)
    got = wire.body_chunk(raw)
    assert got is not None
    assert got[:2] == reference(raw) == (_body(n), end)
    meta = b"" if extra == "none" else (_META_LONG if extra == "metadata long" else _META_SERVED)
    assert got[2] == meta


def test_request_kind() -> None:
    assert wire.request_kind(_len_field(3, b"") + EXTRAS["metadata served"]) == 3
    assert wire.request_kind(_len_field(3, b"") + _len_field(5, b"")) == 0  # two members
    assert wire.request_kind(EXTRAS["bad varint"]) == 0
    assert wire.request_kind(b"") == 0


# ------------------------------------------------------------------ end to end


class Recorder(asyncio.Transport):
    """A transport that keeps what the connection writes."""

    def __init__(self) -> None:
        super().__init__()
        self.out = bytearray()

    def write(self, data: Any) -> None:
        self.out += data

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default

    def close(self) -> None:
        pass

    def is_closing(self) -> bool:
        return False


def frames(data: bytes) -> Iterator[tuple[int, int, int, bytes]]:
    pos = 0
    while pos + 9 <= len(data):
        lt, flags, sid = F.HDR.unpack_from(data, pos)
        n = lt >> 8
        yield lt & 0xFF, flags, sid, data[pos + 9 : pos + 9 + n]
        pos += 9 + n
    assert pos == len(data)


def answers(data: bytes) -> tuple[list[tuple[int, int, int, bytes]], dict[int, int]]:
    """The frames but WINDOW_UPDATE, in order, and the window returned per stream (the
    fast path answers before the frame's credit is granted, the protobuf path after: the
    same frames, WINDOW_UPDATE placed differently)."""
    out = []
    credit: dict[int, int] = {}
    for ftype, flags, sid, payload in frames(data):
        if ftype == F.WINDOW_UPDATE:
            credit[sid] = credit.get(sid, 0) + struct.unpack(">I", payload)[0]
        else:
            out.append((ftype, flags, sid, payload))
    return out, credit


@pytest.fixture(scope="module")
def rig() -> Iterator[tuple[asyncio.AbstractEventLoop, App, list[tuple[Any, ...]]]]:
    """One App (one worker: every answer is the same) on a private loop; its director's
    response hooks recorded."""
    loop = new_default_loop()
    app = App(make_config(["127.0.0.1:7001"], extproc={"track_responses": True}))
    loop.run_until_complete(app.start())
    calls: list[tuple[Any, ...]] = []
    d = app.director
    for name in ("response_started", "response_chunk", "response_ended"):
        fn = getattr(d, name)

        def rec(*a: Any, _fn: Any = fn, _name: str = name, **k: Any) -> Any:
            calls.append((_name, a[1:], tuple(sorted(k.items()))))
            return _fn(*a, **k)

        setattr(d, name, rec)
    try:
        yield loop, app, calls
    finally:
        loop.run_until_complete(app.stop())
        loop.close()


async def settle(conn: H2Connection) -> None:
    """Until every handler is parked in read(), waits for the peer's window, or is gone,
    and nothing is left to flush; bounded."""
    for _ in range(2000):
        stalled = any(not w.done() for w in conn.window_waiters)  # waits for the peer's window
        busy = conn.flush_scheduled or any(
            s in conn.server.calls
            and not stalled
            and (s._ready or s._msgs or s._waiter is None or s._waiter.done())
            for s in conn.streams.values()
        )
        if not busy:
            return
        await asyncio.sleep(0)
    raise AssertionError("the connection did not settle")


def grpc_frames(sid: int, raw: bytes, cuts: list[int]) -> bytes:
    """One gRPC message as DATA frames cut at `cuts` (offsets into the framed message)."""
    framed = struct.pack(">BI", 0, len(raw)) + raw
    points = sorted({c % (len(framed) + 1) for c in cuts} - {0, len(framed)})
    out = b""
    prev = 0
    for p in [*points, len(framed)]:
        out += F.frame(F.DATA, 0, sid, framed[prev:p])
        prev = p
    return out


async def exchange(
    app: App,
    fast: bool,
    rid: str,
    mode: int,
    msgs: list[bytes],
    cuts: list[int],
    reads: list[int],
    taken: list[bool] | None = None,
    window: int = 1 << 24,
    per_frame: bool = False,
    state: dict[str, int] | None = None,
    lane: bool = True,
    lane_taken: list[bool] | None = None,
) -> tuple[bytes, bytes]:
    """One ext_proc stream through a fresh connection: the request (routed), then `msgs`
    as the response phase, then the end of the stream. Returns (bytes written during the
    request phase, during the response phase). `taken`: what the fast path answered.
    `lane` False: the compiled chunk lane (`chunk_lane`) off, the Python answerer only;
    `lane_taken`: what the compiled lane answered."""
    taken = [] if taken is None else taken
    server = app.extproc_h2
    assert server is not None
    conn = H2Connection(server)
    compiled = conn.chunk_lane if lane and fast else None
    if compiled is not None:

        def lane_counted(*a: Any) -> bool:
            took = compiled(*a)
            if took:
                taken.append(True)
                if lane_taken is not None:
                    lane_taken.append(True)
            return took

        conn.chunk_lane = lane_counted
    else:
        conn.chunk_lane = None
    t = Recorder()
    conn.connection_made(t)
    settings_ = F.settings_payload(((F.S_INITIAL_WINDOW_SIZE, window),))
    conn.data_received(F.PREFACE + F.frame(F.SETTINGS, 0, 0, settings_))
    conn.data_received(F.window_update(0, 1 << 26))
    block = Encoder().encode(
        [
            (":method", "POST"),
            (":scheme", "http"),
            (":path", PROCESS_PATH),
            (":authority", "x"),
            ("content-type", "application/grpc"),
            ("te", "trailers"),
        ]
    )
    hm = ep.ProcessingRequest()
    for k, v in ((":method", "POST"), (":path", "/v1/completions"), ("x-request-id", rid)):
        hm.request_headers.headers.headers.append(base_pb2.HeaderValue(key=k, raw_value=v.encode()))
    hm.protocol_config.request_body_mode = PM.FULL_DUPLEX_STREAMED
    hm.protocol_config.response_body_mode = mode  # type: ignore[assignment]
    bm = ep.ProcessingRequest()
    bm.request_body.body = b'{"model": "m", "prompt": "hi"}'
    bm.request_body.end_of_stream = True
    conn.data_received(F.frame(F.HEADERS, F.END_HEADERS, 1, block))
    conn.data_received(grpc_frames(1, hm.SerializeToString(), []))
    await settle(conn)
    conn.data_received(grpc_frames(1, bm.SerializeToString(), []))
    await settle(conn)
    s = conn.streams[1]
    assert s.fast is not None  # in the response phase: the fast path is installed
    if not fast:
        s.on_message(None)
    else:
        answer = s.fast

        def counted(raw: bytes) -> bool:
            took = answer(raw)
            taken.append(took)
            return took

        s.fast = counted
    request_part = bytes(t.out)
    t.out.clear()
    at_request_end = accounting(conn, s)
    parts = [grpc_frames(1, m, cuts[i:] + cuts[:i]) for i, m in enumerate(msgs)]
    if window < 1 << 16:
        # A small stream window: answers wait for the peer's WINDOW_UPDATEs, sent after
        # each message (the fast path must step aside and keep the order).
        parts = [p + F.window_update(1, window // 4) for p in parts]
    stream = b"".join(parts) + F.frame(F.DATA, F.END_STREAM, 1)
    points_ = {r % (len(stream) + 1) for r in reads}
    if per_frame:
        # Also every frame in a read of its own, as Envoy's chunks arrive one by one
        # (the transport's one-frame lane, H2Connection.one_message).
        at = 0
        for _ in frames(stream):
            at += 9 + int.from_bytes(stream[at : at + 3], "big")
            points_.add(at)
    if not all(parses(m) for m in msgs):
        # A message protobuf rejects ends the stream at once, dropping what the protobuf
        # path had queued unanswered from the same read (the fast path had answered it):
        # such sequences are compared one message per read.
        ends = 0
        for part in parts:
            ends += len(part)
            points_.add(ends)
    points = sorted(points_)
    prev = 0
    for p in [*points, len(stream)]:
        if p > prev:
            conn.data_received(stream[prev:p])
            prev = p
            await settle(conn)
    await settle(conn)
    if state is not None:
        # What the response phase changed in the receive-side accounting (credit owed
        # back, bytes held): batched WINDOW_UPDATEs hide a difference of a few bytes from
        # the written frames.
        for k, v in accounting(conn, s).items():
            state[k] = v - at_request_end[k]
    running = [s for s in conn.streams.values() if s in conn.server.calls]
    conn.connection_lost(None)
    for _ in range(2000):  # bounded: their director calls land in this exchange
        if not any(s in conn.server.calls for s in running):
            break
        await asyncio.sleep(0)
    return request_part, bytes(t.out)


def accounting(conn: H2Connection, s: Any) -> dict[str, int]:
    """The receive-side accounting of a connection and one of its streams."""
    names = ("recv_unacked", "conn_credit", "buffered", "owed", "big_sid")
    got = {k: getattr(conn, k) for k in names}
    for k in ("_unacked", "_credit", "_held", "_owed"):
        got["stream" + k] = getattr(s, k)
    return got


def resp_headers_raw(status: str, eos: bool, served: str | None) -> bytes:
    m = ep.ProcessingRequest()
    for k, v in ((":status", status), ("content-type", "text/event-stream")):
        m.response_headers.headers.headers.append(base_pb2.HeaderValue(key=k, raw_value=v.encode()))
    m.response_headers.end_of_stream = eos
    if served is not None:
        m.metadata_context.filter_metadata["envoy.lb"].fields[P.SERVED_KEY].string_value = served
    return m.SerializeToString()


TRAILERS = _len_field(7, b"")

_chunk = st.tuples(SIZES, st.booleans(), st.sampled_from(sorted(EXTRAS)), INNER)


@settings(max_examples=scaled(60))
@given(
    duplex=st.booleans(),
    headers=st.tuples(st.sampled_from(["200", "500", "x"]), st.booleans(), st.booleans()),
    chunks=st.lists(_chunk, max_size=5),
    trailers=st.booleans(),
    cuts=st.lists(st.integers(0, 400), max_size=3),
    reads=st.lists(st.integers(0, 5000), max_size=4),
    window=st.sampled_from([1 << 24, 1 << 24, 400]),
    per_frame=st.booleans(),
)
@example(  # plain streamed response: headers, two chunks, the last with end_of_stream
    duplex=True,
    headers=("200", False, False),
    chunks=[(5, False, "none", b""), (7, True, "none", b"")],
    trailers=False,
    cuts=[],
    reads=[],
    window=1 << 24,
    per_frame=False,
)
@example(  # empty chunk, metadata on every chunk, unknown fields
    duplex=True,
    headers=("200", False, True),
    chunks=[
        (0, False, "metadata served", b""),
        (3, False, "unknown len", b""),
        (0, True, "none", b""),
    ],
    trailers=False,
    cuts=[],
    reads=[],
    window=1 << 24,
    per_frame=False,
)
@example(  # messages split across DATA frames and the frames across reads
    duplex=True,
    headers=("200", False, False),
    chunks=[(300, False, "none", b""), (70_000, True, "none", b"")],
    trailers=True,
    cuts=[3, 7, 120],
    reads=[10, 11, 200, 4000],
    window=1 << 24,
    per_frame=False,
)
@example(  # a small stream window: answers wait for WINDOW_UPDATEs, order kept
    duplex=True,
    headers=("200", False, False),
    chunks=[(100, False, "none", b""), (300, False, "none", b""), (5, True, "none", b"")],
    trailers=True,
    cuts=[],
    reads=[],
    window=400,
    per_frame=False,
)
@example(  # a malformed message ends the stream the same way on both
    duplex=True,
    headers=("200", False, False),
    chunks=[(4, False, "metadata malformed", b""), (2, False, "none", b"")],
    trailers=False,
    cuts=[],
    reads=[],
    window=1 << 24,
    per_frame=False,
)
@example(  # STREAMED / BUFFERED response modes: CONTINUE per chunk; headers ending the response
    duplex=False,
    headers=("200", True, False),
    chunks=[(4, False, "none", b"")],
    trailers=False,
    cuts=[],
    reads=[],
    window=1 << 24,
    per_frame=False,
)
@example(  # every chunk in a read of its own: the one-frame lane answers them
    duplex=True,
    headers=("200", False, True),
    chunks=[(5, False, "none", b""), (200, False, "metadata served", b""), (7, True, "none", b"")],
    trailers=True,
    cuts=[],
    reads=[],
    window=1 << 24,
    per_frame=True,
)
@example(  # one frame per read, a small stream window: the lane steps aside, order kept
    duplex=True,
    headers=("200", False, False),
    chunks=[(100, False, "none", b""), (300, False, "none", b""), (5, True, "none", b"")],
    trailers=False,
    cuts=[],
    reads=[],
    window=400,
    per_frame=True,
)
@example(  # one frame per read, a message split over frames and a malformed one
    duplex=True,
    headers=("200", False, False),
    chunks=[(300, False, "none", b""), (4, False, "metadata malformed", b"")],
    trailers=False,
    cuts=[40],
    reads=[],
    window=1 << 24,
    per_frame=True,
)
def test_fast_path_answers_byte_identical_to_protobuf_path(
    rig: Any,
    duplex: bool,
    headers: tuple[str, bool, bool],
    chunks: list[tuple[int, bool, str, bytes]],
    trailers: bool,
    cuts: list[int],
    reads: list[int],
    window: int,
    per_frame: bool,
) -> None:
    loop, app, calls = rig
    status, eos, served = headers
    msgs = [resp_headers_raw(status, eos, "1.2.3.4:8" if served else None)]
    msgs += [
        chunk_raw(_body(n, i), end, extra, inner) for i, (n, end, extra, inner) in enumerate(chunks)
    ]
    if trailers:
        msgs.append(TRAILERS)
    mode = PM.FULL_DUPLEX_STREAMED if duplex else PM.STREAMED
    results = []
    # The compiled chunk lane with the Python answerer, the Python answerer alone (the
    # lane's reference), the protobuf path (the answerer's reference).
    for fast, lane in ((True, True), (True, False), (False, False)):
        calls.clear()
        state: dict[str, int] = {}
        req, resp = loop.run_until_complete(
            exchange(
                app,
                fast,
                f"r-{fast}-{lane}",
                mode,
                msgs,
                cuts,
                reads,
                window=window,
                per_frame=per_frame,
                state=state,
                lane=lane,
            )
        )
        results.append((req, answers(resp), list(calls), state))
    (req_c, (ans_c, credit_c), calls_c, state_c) = results[0]
    for req_r, (ans_r, credit_r), calls_r, state_r in results[1:]:
        assert state_c == state_r
        assert req_c == req_r
        assert ans_c == ans_r
        assert credit_c == credit_r
        assert calls_c == calls_r


@settings(max_examples=scaled(80))
@given(
    duplex=st.booleans(),
    chunks=st.lists(_chunk, min_size=1, max_size=6),
    window=st.sampled_from([1 << 24, 1 << 24, 400]),
)
@example(duplex=True, chunks=[(0, True, "none", b"")], window=1 << 24)  # the empty last chunk
@example(  # Envoy's chunk shapes with metadata, one- and two-byte lengths
    duplex=True,
    chunks=[(127, False, "metadata long", b""), (128, False, "metadata served", b"")],
    window=1 << 24,
)
@example(duplex=False, chunks=[(5, False, "none", b""), (0, True, "none", b"")], window=400)
@example(  # shapes the lane leaves to the Python answerer, between ones it takes
    duplex=True,
    chunks=[(3, False, "unknown len", b""), (70_000, False, "none", b""), (4, True, "none", b"")],
    window=1 << 24,
)
def test_compiled_chunk_lane_matches_the_python_answerer(
    rig: Any, duplex: bool, chunks: list[tuple[int, bool, str, bytes]], window: int
) -> None:
    """Every chunk in a DATA frame and a read of its own (how Envoy forwards them), through
    the compiled lane (scorer/native/_speedups.pyx `chunk_lane`) and through the Python
    answerer alone: the same answer bytes, WINDOW_UPDATEs, accounting and director calls."""
    loop, app, calls = rig
    msgs = [resp_headers_raw("200", False, None)]
    msgs += [
        chunk_raw(_body(n, i), end, extra, inner) for i, (n, end, extra, inner) in enumerate(chunks)
    ]
    mode = PM.FULL_DUPLEX_STREAMED if duplex else PM.STREAMED
    results = []
    for lane in (True, False):
        calls.clear()
        state: dict[str, int] = {}
        req, resp = loop.run_until_complete(
            exchange(
                app, True, f"c-{lane}", mode, msgs, [], [], window=window, per_frame=True,
                state=state, lane=lane,
            )
        )  # fmt: skip
        results.append((req, answers(resp), list(calls), state))
    assert results[0] == results[1]


@pytest.mark.parametrize("duplex", [True, False])
def test_envoy_chunk_frames_take_the_compiled_lane(rig: Any, duplex: bool) -> None:
    """Envoy's chunk frames (body, metadata_context, the empty last chunk), one per read,
    are answered by the compiled lane, not only safely left to Python."""
    assert NATIVE is not None  # `make` builds it (tests/index/test_native.py checks the build)
    loop, app, calls = rig
    msgs = [resp_headers_raw("200", False, None)]
    msgs += [chunk_raw(_body(n, n), False, "none") for n in (1, 127, 128, 3000)]
    msgs += [chunk_raw(_body(9), False, "metadata served"), chunk_raw(b"", True, "none")]
    mode = PM.FULL_DUPLEX_STREAMED if duplex else PM.STREAMED
    app.extproc._valid_meta.clear()  # the metadata value is new to this test
    calls.clear()
    taken: list[bool] = []
    lane_taken: list[bool] = []
    loop.run_until_complete(
        exchange(
            app, True, "envoy", mode, msgs, [], [], taken, per_frame=True, lane_taken=lane_taken
        )
    )
    # The headers and the first metadata value (checked once by protobuf) go to Python.
    assert taken == [True] * len(msgs)
    assert len(lane_taken) == len(msgs) - 2
    bodies = [_body(n, n) for n in (1, 127, 128, 3000)] + [_body(9), b""]
    ends = [False] * 5 + [True]
    assert [c[1] for c in calls if c[0] == "response_chunk"] == list(zip(bodies, ends, strict=True))


@pytest.mark.parametrize("duplex", [True, False])
def test_plain_response_is_answered_entirely_by_the_fast_path(rig: Any, duplex: bool) -> None:
    loop, app, calls = rig
    msgs = [resp_headers_raw("200", False, "1.2.3.4:8")]
    msgs += [chunk_raw(_body(n, n), False, "metadata served") for n in (0, 10, 40)]
    msgs.append(TRAILERS)
    taken: list[bool] = []
    mode = PM.FULL_DUPLEX_STREAMED if duplex else PM.STREAMED
    _, resp = loop.run_until_complete(exchange(app, True, "plain", mode, msgs, [5], [], taken))
    assert taken == [True] * len(msgs)
    got = [f for f in answers(resp)[0] if f[0] == F.DATA]
    assert len(got) == len(msgs)
    assert ep.ProcessingResponse.FromString(got[0][3][5:]).HasField("response_headers")
    if duplex:
        sr = ep.ProcessingResponse.FromString(got[-2][3][5:]).response_body.response
        assert sr.body_mutation.streamed_response.body == _body(40, 40)
    assert ep.ProcessingResponse.FromString(got[-1][3][5:]).HasField("response_trailers")
    started = [c for c in calls if c[0] == "response_started"]
    assert started[-1][1] == (200, "1.2.3.4:8", "text/event-stream", True)
    assert calls[-1][0] == "response_ended"


def test_chunks_read_one_by_one_take_the_frame_loop_lane(rig: Any, monkeypatch: Any) -> None:
    """A chunk arriving alone (Envoy forwards each as it comes) is answered by the
    connection's one-frame lane (H2Connection.one_message; the request's two messages,
    before the answerer is installed, are queued by the same lane's `queue_message`):
    on_data_frame sees only the frame the lane leaves to it, the empty END_STREAM (which
    the compiled frame loop, when built, takes itself)."""
    loop, app, _ = rig
    msgs = [resp_headers_raw("200", False, None)]
    msgs += [chunk_raw(_body(n, n), n == 40, "none") for n in (3, 10, 40)]
    seen: list[int] = []
    general = H2Connection.on_data_frame

    def counted(self: H2Connection, flags: int, sid: int, payload: Any) -> bool:
        seen.append(len(payload))
        return general(self, flags, sid, payload)

    taken: list[bool] = []
    monkeypatch.setattr(H2Connection, "on_data_frame", counted)
    _, resp = loop.run_until_complete(
        exchange(app, True, "lane", PM.FULL_DUPLEX_STREAMED, msgs, [], [], taken, per_frame=True)
    )
    assert taken == [True] * len(msgs)
    assert seen == ([] if FRAME_LANE is not None else [0])
    got = [f for f in answers(resp)[0] if f[0] == F.DATA]
    assert len(got) == len(msgs)
    last = ep.ProcessingResponse.FromString(got[-1][3][5:])
    assert last.response_body.response.body_mutation.streamed_response.end_of_stream


def test_headers_and_trailers_are_told_by_their_first_byte(
    rig: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Envoy writes the oneof member first: response headers and trailers are recognised
    by their tag byte and parsed once by protobuf, without the wire reader's walks over
    the message (a body chunk still goes to the wire reader)."""
    loop, app, calls = rig
    msgs = [
        resp_headers_raw("200", False, "1.2.3.4:8"),
        chunk_raw(_body(5), True, "metadata served"),
        TRAILERS,
    ]
    walked: list[tuple[str, int]] = []
    kind, chunk = wire.request_kind, wire.body_chunk

    def kind_seen(raw: bytes) -> int:
        walked.append(("request_kind", raw[0]))
        return kind(raw)

    def chunk_seen(raw: bytes, *a: int) -> Any:
        walked.append(("body_chunk", raw[0]))
        return chunk(raw, *a)

    monkeypatch.setattr(wire, "request_kind", kind_seen)
    monkeypatch.setattr(wire, "body_chunk", chunk_seen)
    taken: list[bool] = []
    calls.clear()
    loop.run_until_complete(
        exchange(app, True, "tags", PM.FULL_DUPLEX_STREAMED, msgs, [], [], taken, lane=False)
    )
    assert taken == [True, True, True]
    assert walked == [("body_chunk", 0x2A)]
    # Then the director sees the response as the protobuf path would have shown it
    # (test_fast_path_answers_byte_identical_to_protobuf_path compares the two).
    assert [c[0] for c in calls][:3] == ["response_started", "response_chunk", "response_ended"]


# ------------------------------------------------------------------ the lane's state space

# What a stream in the response phase normally has, and the states the lane steps aside
# for (one per example, in about half of them, so most examples reach its accounting).
_LANE_GOOD = {
    "send_window": 1 << 20, "peer_max_frame": 16_384, "send_credit": 0, "recv_unacked": 0,
    "unacked": 0, "headers_sent": True, "done": False, "half_closed": False, "closed": False,
    "waiting": True, "receiving": True,
}  # fmt: skip
_LANE_ASIDE = {
    "small send window": ("send_window", 60),
    "no send window": ("send_window", 10),
    "small frames": ("peer_max_frame", 30),
    "stream window used": ("send_credit", -65_535 + 20),
    "connection window full": ("recv_unacked", CONN_RECV_WINDOW - 10),
    "stream window full": ("unacked", RECV_WINDOW - 10),
    "headers not sent": ("headers_sent", False),
    "stream done": ("done", True),
    "half closed": ("half_closed", True),
    "connection closed": ("closed", True),
    "handler not parked": ("waiting", False),
    "outside data_received": ("receiving", False),
}

# Mostly Envoy's shapes (the lane's), sometimes any other.
_LANE_CHUNK = st.tuples(
    SIZES,
    st.booleans(),
    st.sampled_from(
        ["none"] * 12 + ["metadata served"] * 6 + ["metadata long"] * 4 + sorted(EXTRAS)
    ),
    st.sampled_from(
        [b""] * 12 + [_field(4, 0, b"\x01"), _len_field(7, b"x"), _field(2, 2, b"\x00")]
    ),
)

_LANE_STATE = st.fixed_dictionaries(
    {
        # Accounting branches the lane takes itself or through grant / release.
        "buffered": st.sampled_from(["none", "none", "at limit", "over limit"]),
        "owed": st.sampled_from([0, 0, 100]),
        "big_sid": st.sampled_from([0, 0, 1, 3]),
        "conn_credit": st.sampled_from([0, CONN_RECV_WINDOW // 4 - 10]),
        "credit": st.sampled_from([0, RECV_WINDOW // 4 - 10]),
        "meta_known": st.sampled_from([True, True, False]),
        "aside": st.sampled_from([""] * 2 * len(_LANE_ASIDE) + sorted(_LANE_ASIDE)),
    }
)


def _lane_conn(app: App, loop: asyncio.AbstractEventLoop, duplex: bool, st_: dict[str, Any]) -> Any:
    """A connection with one stream in the response phase, in state `st_`."""
    st_ = {**_LANE_GOOD, **st_}
    if st_["aside"]:
        k, v = _LANE_ASIDE[st_["aside"]]
        st_[k] = v
    server = app.extproc_h2
    assert server is not None
    conn = H2Connection(server)
    conn.connection_made(Recorder())
    conn.data_received(F.PREFACE + F.frame(F.SETTINGS, 0, 0))
    conn.out.clear()
    s = H2Stream(conn, 1, PROCESS_PATH, [], None)
    conn.streams[1] = s
    conn.last_sid = 1
    s._waiter = loop.create_future()
    if not st_["waiting"]:
        s._waiter.set_result(None)
    svc = app.extproc
    svc._valid_meta.clear()
    if st_["meta_known"]:
        svc._valid_meta.add(_META_SERVED)
    lane = (
        duplex,
        svc._continue_response_body_wire,
        svc._valid_meta,
        app.director.response_chunk,
        "q",
    )
    s.on_message(svc._answerer("q", s, duplex, True), lane)
    limit = conn.limits.max_buffered
    conn.buffered = {"none": 0, "at limit": limit, "over limit": limit + 1}[st_["buffered"]]
    s._held = conn.buffered
    if st_["owed"]:
        conn.owed = s._owed = st_["owed"]
        conn.owing.add(s)
    conn.big_sid = st_["big_sid"]
    conn.conn_credit = st_["conn_credit"]
    s._credit = st_["credit"]
    conn.send_window = st_["send_window"]
    conn.peer_max_frame = st_["peer_max_frame"]
    s.send_credit = st_["send_credit"]
    conn.recv_unacked = st_["recv_unacked"]
    s._unacked = st_["unacked"]
    s._headers_sent = st_["headers_sent"]
    s._done = st_["done"]
    s._half_closed = st_["half_closed"]
    conn.closed = st_["closed"]
    conn.receiving = st_["receiving"]
    return conn, s


def _lane_snapshot(conn: Any, s: Any, took: bool) -> dict[str, Any]:
    names = ("recv_unacked", "conn_credit", "buffered", "owed", "big_sid", "send_window")
    got: dict[str, Any] = {k: getattr(conn, k) for k in names}
    for k in ("_unacked", "_credit", "_held", "_owed", "send_credit", "_headers_sent"):
        got["s" + k] = getattr(s, k)
    got["took"] = took
    got["owing"] = len(conn.owing)
    got["out"] = list(conn.out)
    got["deferred"] = [(fn, args) for _, fn, args in conn.deferred]
    got["valid_meta"] = sorted(s.lane[2]) if s.lane else None
    return got


@settings(max_examples=scaled(150))
@given(duplex=st.booleans(), chunk=_LANE_CHUNK, state=_LANE_STATE)
@example(  # the common case: credit batched, nothing owed
    duplex=True,
    chunk=(5, False, "none", b""),
    state={
        "buffered": "none", "owed": 0, "big_sid": 0, "conn_credit": 0, "credit": 0,
        "meta_known": True, "aside": "",
    },
)  # fmt: skip
@example(  # credit past a quarter window (WINDOW_UPDATEs), owed credit released, big stream
    duplex=False,
    chunk=(40, True, "metadata served", b""),
    state={
        "buffered": "none", "owed": 100, "big_sid": 1, "conn_credit": CONN_RECV_WINDOW // 4 - 10,
        "credit": RECV_WINDOW // 4 - 10, "meta_known": True, "aside": "",
    },
)  # fmt: skip
@example(  # over the connection's memory bound: the credit is owed
    duplex=True,
    chunk=(0, True, "none", b""),
    state={
        "buffered": "over limit", "owed": 0, "big_sid": 3, "conn_credit": 0, "credit": 0,
        "meta_known": False, "aside": "",
    },
)  # fmt: skip
def test_compiled_chunk_lane_state_space_matches_one_message(
    rig: Any, duplex: bool, chunk: tuple[int, bool, str, bytes], state: dict[str, Any]
) -> None:
    """`chunk_lane` then `one_message` (the frame loop's order) against `one_message` alone
    (the Python answerer), from the same connection and stream state (windows, credit near
    its batching thresholds, memory bound reached, credit owed, the big stream, headers not
    sent, a full send window, a closed connection, a handler not parked): the same result,
    frames queued, accounting and deferred director calls."""
    lane_compare(rig, duplex, chunk, state)


def lane_compare(
    rig: Any, duplex: bool, chunk: tuple[int, bool, str, bytes], state: dict[str, Any]
) -> bool:
    """One frame through `chunk_lane` then `one_message`, and through `one_message`
    alone, from the same state: asserts the same effects; returns whether the lane took it."""
    lane_took: list[bool] = []
    assert NATIVE is not None
    loop, app, _ = rig
    n, end, extra, inner = chunk
    raw = chunk_raw(_body(n), end, extra, inner)
    data = F.frame(F.DATA, 0, 1, b"\x00" + len(raw).to_bytes(4, "big") + raw)

    async def one(compiled: bool) -> dict[str, Any]:
        assert NATIVE is not None
        conn, s = _lane_conn(app, loop, duplex, state)
        took = bool(compiled and NATIVE.chunk_lane(conn, s, data, 9, len(data), s.lane))
        if compiled:
            lane_took.append(took)
        took = took or conn.one_message(s, data, 9, len(data))
        got = _lane_snapshot(conn, s, took)
        conn.deferred.clear()  # the director is not called: nothing of this stream is live
        conn.receiving = False
        conn.closed = True
        conn.streams.clear()
        return got

    assert loop.run_until_complete(one(True)) == loop.run_until_complete(one(False))
    return lane_took == [True]


def test_compiled_chunk_lane_accounting_branches(rig: Any) -> None:
    """Every combination of the accounting branches (memory bound, owed credit, the big
    stream, credit at its batching thresholds) with Envoy's chunk shapes, in a state the
    lane answers in: it takes the frame, with the Python answerer's effects."""
    accounting = itertools.product(
        ["none", "at limit", "over limit"],
        [0, 100],
        [0, 1, 3],
        [0, CONN_RECV_WINDOW // 4 - 10],
        [0, RECV_WINDOW // 4 - 10],
    )
    shapes = [(5, False, "none"), (0, True, "none"), (128, True, "metadata served")]
    for (buffered, owed, big, cc, credit), (n, end, extra), duplex in itertools.product(
        accounting, shapes, (True, False)
    ):
        state = {
            "buffered": buffered, "owed": owed, "big_sid": big, "conn_credit": cc,
            "credit": credit, "meta_known": True, "aside": "",
        }  # fmt: skip
        took = lane_compare(rig, duplex, (n, end, extra, b""), state)
        assert took, (state, n, end, extra, duplex)
