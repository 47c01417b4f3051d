"""Where one request's time goes in the ext_proc data path, per message and per stage.

    .venv/bin/python bench/profile_datapath.py [--requests 300] [--chunks 20]
        [--policy round_robin] [--request-mode FULL_DUPLEX_STREAMED|BUFFERED] [--reference]
        [--shape streamed|lean] [--event-loop asyncio|uvloop] [--tls]

In-process and without Envoy, so the stages can be timed where they run: a real `App`
(asyncio transport, `extproc.track_responses` on, the policy asked for) gets one HTTP/2
connection whose transport writes to a real loopback TCP socket. Per request the driver
sends the messages Envoy 1.40 sends for a streamed completion (request headers with the
processing modes, a 2 KB body, response headers, `--chunks` SSE body chunks, the last one
with end_of_stream, the end of the stream), each in its own `data_received` as Envoy's
frames arrive, and waits until it is answered before sending the next.

`--shape lean`: what Envoy 1.40 sends with the local envoy/envoy.yaml (captured from its
frames): one read with the stream's HEADERS and three messages (request headers, the body
without end_of_stream, an empty body message with end_of_stream), answered with the routing
answer and the body; then one read with an empty END_STREAM DATA frame and RST_STREAM
(no answer: the stream is over). Row `request` is the first read, `stream_end` the second;
`total` includes the event-loop turns until the answer is written (`stream_end`: until the
handler is done). `--event-loop uvloop` runs it on uvloop (the server default).

Stages (µs per message, median over the messages of a kind; exclusive time, perf_counter;
each timed call adds the timer's own ~0.5 µs):
- frame:    HTTP/2 frame loop and gRPC message framing (data_received minus what it calls)
- decode:   protobuf parse (ProcessingRequest.FromString) or the wire reader (wire.py)
- director: the director's hooks (new_request, request_received, response_started,
            response_chunk, response_ended)
- encode:   protobuf serialization + DATA framing of the answers (H2Stream.write /
            write_now) or the wire encoder; a response chunk's compiled lane
            (scorer/native/_speedups.pyx `chunk_lane`: its read, answer and accounting)
- write:    transport.write (one per batch of frames: a send() on the TCP socket)
- other:    the rest until the answer was written: event-loop turns, task switches, the
            servicer's own code
- tls:      scorer.extproc.transport.tls_transport.TlsTransport's own work (`--tls`: the
            connection behind TLS as the kgateway / Envoy AI Gateway shapes have it; the
            driver encrypts each read with an `ssl` client before the clock starts)
`--reference`: the fast path (H2Stream.on_message) switched off, every message through the
protobuf path, for comparison. Prints a table and writes bench/out/datapath_stages.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import ssl
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from envoy.config.core.v3 import base_pb2  # noqa: E402
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2  # noqa: E402
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep  # noqa: E402
from hpack import Encoder  # noqa: E402

from scorer import director as director_mod  # noqa: E402
from scorer.app import App  # noqa: E402
from scorer.config import Config, load_config  # noqa: E402
from scorer.extproc import wire  # noqa: E402
from scorer.extproc.servicer import PROCESS_PATH  # noqa: E402
from scorer.extproc.tls import self_signed, server_context  # noqa: E402
from scorer.extproc.transport import H2Connection, H2Stream  # noqa: E402
from scorer.extproc.transport import connection as conn_mod  # noqa: E402
from scorer.extproc.transport import frames as F  # noqa: E402
from scorer.extproc.transport.tls_transport import TlsTransport  # noqa: E402

PM = processing_mode_pb2.ProcessingMode
# The ext_proc call's request headers, as a gRPC client (Envoy) opens the stream.
CALL_HEADERS = [
    (":method", "POST"),
    (":scheme", "http"),
    (":path", PROCESS_PATH),
    (":authority", "ext_proc"),
    ("content-type", "application/grpc"),
    ("te", "trailers"),
]
STAGES = ("frame", "decode", "director", "encode", "tls", "write", "other")
WORKERS = ["127.0.0.1:7001", "127.0.0.1:7002"]


class Clock:
    """Exclusive time per (message kind, stage): nested timed calls are subtracted."""

    def __init__(self) -> None:
        self.kind = "?"
        self.stack: list[float] = []
        self.us: dict[tuple[str, str], float] = defaultdict(float)

    def enter(self) -> float:
        self.stack.append(0.0)
        return time.perf_counter()

    def leave(self, stage: str, t0: float) -> None:
        dt = time.perf_counter() - t0
        child = self.stack.pop()
        if self.stack:
            self.stack[-1] += dt
        self.us[(self.kind, stage)] += (dt - child) * 1e6

    def wrap(self, stage: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*a: Any, **k: Any) -> Any:
            t0 = self.enter()
            try:
                return fn(*a, **k)
            finally:
                self.leave(stage, t0)

        return timed

    def wrap_async(self, stage: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        # Times the whole await: the hooks timed so do not suspend with round_robin/kv
        # without a tokenizer (a tokens thread hand-off would be counted here).
        async def timed(*a: Any, **k: Any) -> Any:
            t0 = self.enter()
            try:
                return await fn(*a, **k)
            finally:
                self.leave(stage, t0)

        return timed


class QuietTransport(asyncio.Transport):
    """A transport with no peer behind it: never closes, never pauses; subclasses say
    what a write does."""

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default

    def close(self) -> None:
        pass

    def is_closing(self) -> bool:
        return False

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


class SocketTransport(QuietTransport):
    """The connection's transport: writes go to a real loopback TCP socket."""

    def __init__(self, sock: socket.socket, clock: Clock) -> None:
        super().__init__()
        self.sock = sock
        self.clock = clock
        self.writes = 0

    def write(self, data: bytes | bytearray | memoryview) -> None:
        t0 = self.clock.enter()
        self.sock.sendall(data)
        self.writes += 1
        self.clock.leave("write", t0)


def tcp_pair() -> tuple[socket.socket, socket.socket]:
    srv = socket.create_server(("127.0.0.1", 0))
    a = socket.create_connection(srv.getsockname())
    b, _ = srv.accept()
    srv.close()
    b.setblocking(False)
    return a, b


def message(kind: str, chunk: int = 0, last: bool = False, mode: int = 0) -> bytes:
    """One ProcessingRequest as Envoy 1.40 sends it (values in raw_value)."""
    m = ep.ProcessingRequest()
    if kind == "request_headers":
        hs = {
            ":method": "POST",
            ":path": "/v1/completions",
            ":authority": "bench",
            "content-type": "application/json",
            "x-request-id": f"req-{chunk}",
        }
        for k, v in hs.items():
            m.request_headers.headers.headers.append(
                base_pb2.HeaderValue(key=k, raw_value=v.encode())
            )
        m.protocol_config.request_body_mode = mode  # type: ignore[assignment]
        m.protocol_config.response_body_mode = PM.FULL_DUPLEX_STREAMED
    elif kind == "request_body":
        prompt = "x" * 1990
        m.request_body.body = json.dumps(
            {"model": "m", "prompt": prompt, "stream": True, "max_tokens": 16}
        ).encode()
        m.request_body.end_of_stream = not chunk  # chunk=1: more follows (the lean shape)
    elif kind == "request_end":
        m.request_body.end_of_stream = True
    elif kind == "response_headers":
        for k, v in ((":status", "200"), ("content-type", "text/event-stream")):
            m.response_headers.headers.headers.append(
                base_pb2.HeaderValue(key=k, raw_value=v.encode())
            )
    else:
        text = b'data: {"choices":[{"index":0,"text":" tok"}],"i":%d}\n\n' % chunk
        if last:
            text += b'data: {"choices":[],"usage":{"prompt_tokens":9,"completion_tokens":16}}\n\n'
            text += b"data: [DONE]\n\n"
        m.response_body.body = text
        m.response_body.end_of_stream = last
    return m.SerializeToString()


def data_frame(sid: int, msg: bytes, end: bool = False) -> bytes:
    payload = b"\x00" + len(msg).to_bytes(4, "big") + msg
    return F.frame(F.DATA, F.END_STREAM if end else 0, sid, payload)


def inprocess_config(policy: str) -> Config:
    """The scorer on loopback, ports picked by the OS, our HTTP/2 transport, responses
    tracked, the two stand-in workers (shared with profile_chunk_loop.py)."""
    return load_config(
        overrides={
            "server": {
                "host": "127.0.0.1",
                "extproc_port": 0,
                "health_port": 0,
                "admin_port": 0,
                "grace_period_s": 0.5,
                "extproc_transport": "asyncio",
            },
            "pool": {"workers": WORKERS},
            "policy": policy,
            "extproc": {"track_responses": True},
        },
        environ={},
    )


async def run(args: argparse.Namespace) -> dict[str, Any]:
    cfg = inprocess_config(args.policy)
    app = App(cfg)
    await app.start()
    clock = Clock()
    server = app.extproc_h2
    assert server is not None
    # Timed seams: the deserializer, the wire reader/encoder, the director's hooks,
    # H2Stream's writes, the frame loop and the socket write.
    handler, deserialize = server.handlers[PROCESS_PATH]
    assert deserialize is not None
    server.handlers[PROCESS_PATH] = (handler, clock.wrap("decode", deserialize))
    wire.body_chunk = clock.wrap("decode", wire.body_chunk)  # type: ignore[assignment]
    wire.request_kind = clock.wrap("decode", wire.request_kind)  # type: ignore[assignment]
    wire.streamed_body_response = clock.wrap("encode", wire.streamed_body_response)  # type: ignore[assignment]
    d = app.director
    for name in ("new_request", "response_started", "response_chunk", "response_ended"):
        setattr(d, name, clock.wrap("director", getattr(d, name)))
    d.request_received = clock.wrap_async("director", d.request_received)  # type: ignore[method-assign]
    H2Stream.write = clock.wrap_async("encode", H2Stream.write)  # type: ignore[method-assign]
    H2Stream.write_now = clock.wrap("encode", H2Stream.write_now)  # type: ignore[method-assign]
    if conn_mod.CHUNK_LANE is not None:
        # The compiled chunk lane reads the chunk, builds its answer and queues it in one
        # call: timed as encode.
        conn_mod.CHUNK_LANE = clock.wrap("encode", conn_mod.CHUNK_LANE)
    if args.reference:
        H2Stream.on_message = lambda self, fast, lane=None: None  # type: ignore[method-assign]
    H2Connection.data_received = clock.wrap("frame", H2Connection.data_received)  # type: ignore[method-assign]
    # The handlers a read woke run at its end (H2Stream.step): their own code is "other"
    # (a stage of that name is not summed: other = total minus the timed stages).
    H2Connection.step_ready = clock.wrap("other", H2Connection.step_ready)  # type: ignore[method-assign]
    assert director_mod  # the module stays imported for its hooks

    ours, peer = tcp_pair()
    transport = SocketTransport(ours, clock)
    conn = H2Connection(server)
    enc = Encoder()
    mode = PM.FULL_DUPLEX_STREAMED if args.request_mode == "FULL_DUPLEX_STREAMED" else PM.BUFFERED
    peer_bytes = 0

    def drain() -> None:
        nonlocal peer_bytes
        while True:
            try:
                got = peer.recv(1 << 20)
            except BlockingIOError:
                return
            peer_bytes += len(got)
            if client is not None:
                cin.write(got)  # handshake records; answers are not decrypted (not timed)

    # The bytes of one read as the scorer's socket gets them: plain, or TLS records
    # encrypted by a client before the clock starts (`--tls`).
    wrap: Callable[[bytes], bytes] = lambda b: b  # noqa: E731
    feed: Callable[[bytes], None] = conn.data_received
    client: ssl.SSLObject | None = None
    cin, cout = ssl.MemoryBIO(), ssl.MemoryBIO()
    if args.tls:
        TlsTransport.data_received = clock.wrap("tls", TlsTransport.data_received)  # type: ignore[method-assign]
        TlsTransport.write = clock.wrap("tls", TlsTransport.write)  # type: ignore[method-assign]
        tls = TlsTransport(server_context(*self_signed(), None), conn, lambda r: None, 10.0)
        tls.connection_made(transport)
        cctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        cctx.check_hostname = False
        cctx.verify_mode = ssl.CERT_NONE
        cctx.set_alpn_protocols(["h2"])
        client = cctx.wrap_bio(cin, cout, server_hostname="kv-scorer")
        peer.setblocking(True)
        for _ in range(20):  # bounded: a TLS 1.3 handshake is two flights
            try:
                client.do_handshake()
                break
            except ssl.SSLWantReadError:
                tls.data_received(cout.read())
                cin.write(peer.recv(1 << 20))
        else:
            raise RuntimeError("no TLS handshake")
        tls.data_received(cout.read())  # the client's Finished: the connection is made
        peer.setblocking(False)

        def wrap(b: bytes) -> bytes:
            assert client is not None
            client.write(b)
            return cout.read()

        feed = tls.data_received
    else:
        conn.connection_made(transport)
    feed(wrap(F.PREFACE + F.frame(F.SETTINGS, 0, 0)))

    async def answered(writes: int) -> None:
        # The answer went out once the transport wrote again; bounded wait, no sleeps.
        for _ in range(10_000):
            if transport.writes > writes:
                return
            await asyncio.sleep(0)
        raise RuntimeError("no answer")

    # Per message: its stages' µs and its total (the median is reported: the machine's
    # other load lands on a few messages, not on every one).
    samples: dict[str, list[dict[str, float]]] = defaultdict(list)
    us = clock.us

    async def send(kind: str, data: bytes, expect_answer: bool = True) -> None:
        clock.kind = kind
        before = [us[(kind, s)] for s in STAGES[:-1]]
        w = transport.writes
        data = wrap(data)
        t0 = time.perf_counter()
        feed(data)
        if expect_answer:
            await answered(w)
        else:
            for _ in range(3):
                await asyncio.sleep(0)
        total = (time.perf_counter() - t0) * 1e6
        row = {s: us[(kind, s)] - b for s, b in zip(STAGES[:-1], before, strict=True)}
        row["other"] = max(total - sum(row.values()), 0.0)
        row["total"] = total
        samples[kind].append(row)
        drain()

    lean = args.shape == "lean"
    chunks = [message("response_body", i, i == args.chunks - 1) for i in range(args.chunks)]
    lean_body = message("request_body", 1) if lean else b""
    lean_end = message("request_end") if lean else b""
    handlers_done = server.calls
    body = message("request_body")
    rheaders = message("response_headers")
    sid = 1
    for r in range(args.requests + args.warmup):
        if r == args.warmup:
            samples.clear()
        block = enc.encode(CALL_HEADERS)
        head = F.frame(F.HEADERS, F.END_HEADERS, sid, block)
        # FULL_DUPLEX_STREAMED: the headers are answered after the body (the routing
        # answer, then the body streamed back); BUFFERED: at once.
        hmsg = message("request_headers", r, mode=mode)
        if lean:
            first = head + data_frame(sid, hmsg) + data_frame(sid, lean_body)
            await send("request", first + data_frame(sid, lean_end))
            end = F.frame(F.DATA, F.END_STREAM, sid) + F.frame(F.RST_STREAM, 0, sid, bytes(4))
            await send("stream_end", end, False)
            for _ in range(100):  # bounded: the handler ends within a few loop turns
                if not handlers_done:
                    break
                await asyncio.sleep(0)
            feed(wrap(F.window_update(0, 1 << 20)))
            sid += 2
            continue
        await send("request_headers", head + data_frame(sid, hmsg), mode == PM.BUFFERED)
        await send("request_body", data_frame(sid, body))
        await send("response_headers", data_frame(sid, rheaders))
        for c in chunks:
            await send("response_body", data_frame(sid, c))
        await send("end_of_stream", F.frame(F.DATA, F.END_STREAM, sid))
        # Envoy returns the window our answers used (it reads them).
        feed(wrap(F.window_update(0, 1 << 20) + F.window_update(sid, 1 << 20)))
        sid += 2
    await app.stop()
    ours.close()
    peer.close()
    rows = []
    for kind, rs in samples.items():
        med = {s: statistics.median(r[s] for r in rs) for s in (*STAGES, "total")}
        mean = statistics.fmean(r["total"] for r in rs)
        rows.append(
            {
                "message": kind,
                "count": len(rs),
                "total_us_median": med.pop("total"),
                "total_us_mean": mean,
                "stages_us_median": med,
            }
        )
    return {
        "benchmark": "datapath_stages",
        "policy": args.policy,
        "request_mode": args.request_mode,
        "shape": args.shape,
        "event_loop": args.event_loop,
        "tls": args.tls,
        "reference": args.reference,
        "requests": args.requests,
        "chunks_per_request": args.chunks,
        "rows": rows,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--chunks", type=int, default=20)
    ap.add_argument("--policy", default="round_robin")
    ap.add_argument(
        "--request-mode",
        default="FULL_DUPLEX_STREAMED",
        choices=["FULL_DUPLEX_STREAMED", "BUFFERED"],
    )
    ap.add_argument("--reference", action="store_true", help="fast path off (protobuf path)")
    ap.add_argument("--shape", default="streamed", choices=["streamed", "lean"])
    ap.add_argument("--event-loop", default="asyncio", choices=["asyncio", "uvloop"])
    ap.add_argument("--tls", action="store_true", help="the connection behind TLS")
    ap.add_argument("--out", default=str(ROOT / "bench" / "out" / "datapath_stages.json"))
    args = ap.parse_args()
    if args.event_loop == "uvloop":
        import uvloop

        doc = uvloop.run(run(args))
    else:
        doc = asyncio.run(run(args))
    path = "reference (protobuf) path" if args.reference else "fast path"
    what = "lean shape" if args.shape == "lean" else f"x {args.chunks} chunks"
    print(
        f"µs per message (median), {args.requests} requests {what}, "
        f"{args.policy}, {args.request_mode}, {path}, {args.event_loop}"
        + (", TLS" if args.tls else "")
    )
    print(
        f"{'message':>17} {'count':>6} | "
        + " ".join(f"{s:>8}" for s in STAGES)
        + f" | {'total':>7} {'mean':>7}"
    )
    for r in doc["rows"]:
        st = r["stages_us_median"]
        print(
            f"{r['message']:>17} {r['count']:>6} | "
            + " ".join(f"{st[s]:>8.1f}" for s in STAGES)
            + f" | {r['total_us_median']:>7.1f} {r['total_us_mean']:>7.1f}"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
