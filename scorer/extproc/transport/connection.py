"""One HTTP/2 connection from a gRPC client (Envoy): the frame loop, stream table,
SETTINGS, flow control both ways, GOAWAY and connection errors.

RFC 9113: frame layout (§4.1), DATA/HEADERS/RST_STREAM/SETTINGS/PING/GOAWAY/
WINDOW_UPDATE/CONTINUATION (§6), flow control (§5.2, §6.9), connection preface (§3.4),
a server may answer and then RST_STREAM(NO_ERROR) a request still being sent (§8.1).
Everything sent in one event-loop turn leaves in one `transport.write`.

Reads go into one buffer per connection (`asyncio.BufferedProtocol`): a plain Protocol
gets a new bytes object per read, which asyncio allocates at its 256 KiB read size and
shrinks: an mmap, mremap and munmap (and page faults) per message, ~35 µs of kernel time
per ext_proc message on the machine measured (bench/bench_loop_floor.py, strace).
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

from scorer.extproc.transport.frames import (
    ACK,
    COMPRESSION_ERROR,
    CONTINUATION,
    DATA,
    END_HEADERS,
    END_STREAM,
    ENHANCE_YOUR_CALM,
    FLOW_CONTROL_ERROR,
    FRAME_SIZE_ERROR,
    GOAWAY,
    HDR,
    HEADERS,
    MAX_WINDOW,
    NO_ERROR,
    PADDED,
    PING,
    PREFACE,
    PRIORITY,
    PRIORITY_FLAG,
    PROTOCOL_ERROR,
    PUSH_PROMISE,
    REFUSED_STREAM,
    RST_STREAM,
    S_ENABLE_PUSH,
    S_INITIAL_WINDOW_SIZE,
    S_MAX_CONCURRENT_STREAMS,
    S_MAX_FRAME_SIZE,
    S_MAX_HEADER_LIST_SIZE,
    SETTING,
    SETTINGS,
    STREAM_CLOSED,
    U32,
    WINDOW_UPDATE,
    frame,
    goaway,
    rst_stream,
    settings_payload,
    window_update,
)
from scorer.extproc.transport.hpack_codec import HeaderDecoder, OversizedHeaderListError
from scorer.extproc.transport.limits import (
    CONN_RECV_WINDOW,
    OUR_MAX_FRAME,
    READ_BUFFER,
    RECV_WINDOW,
)
from scorer.extproc.transport.stream import H2Stream
from scorer.native import NATIVE

if TYPE_CHECKING:
    from scorer.extproc.transport.server import H2GrpcServer

log = logging.getLogger("scorer.extproc.transport")

# The compiled response-chunk lane (scorer/native/_speedups.pyx `chunk_lane`): one_message
# plus the servicer's answerer for Envoy's common body-chunk frame; None: Python only.
CHUNK_LANE: Callable[..., bool] | None = NATIVE.chunk_lane if NATIVE is not None else None
# The compiled frame loop (`frame_lane`): `receive`'s loop with `queue_message` compiled in
# (the request messages); every other frame goes to the same Python handlers. None: Python.
FRAME_LANE: Callable[[H2Connection, bytes], bool] | None = (
    NATIVE.frame_lane if NATIVE is not None else None
)
# The end of `H2Stream.read` compiled (`take_lane`). None: Python.
TAKE_LANE: Callable[[H2Stream], Any] | None = NATIVE.take_lane if NATIVE is not None else None
# `H2Stream.write_now` compiled (`write_lane`), as `H2Stream.write` runs it. None: Python.
WRITE_LANE: Callable[[H2Stream, bytes], bool] | None = (
    NATIVE.write_lane if NATIVE is not None else None
)


# Ended streams remembered per connection (bounded memory; older ones are ignored as any
# closed stream's late frames are).
ENDED_KEPT = 128


class H2Connection(asyncio.BufferedProtocol):
    """One HTTP/2 connection from a gRPC client (Envoy). The socket reads into a buffer
    of its own (`get_buffer` / `buffer_updated`); `data_received` takes bytes from
    elsewhere (the TLS layer, tests)."""

    def __init__(self, server: H2GrpcServer) -> None:
        self.server = server
        self.limits = limits = server.limits
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        # What the socket reads into (bounded: READ_BUFFER per connection).
        self.rbuf = memoryview(bytearray(READ_BUFFER))
        self.need = 9  # bytes the next frame needs before parsing is worth it
        self.preface_ok = False
        self.settings_seen = False  # the client's first SETTINGS (end of its handshake)
        self.streams: dict[int, H2Stream] = {}
        self.last_sid = 0
        # Streams the peer had ended (END_STREAM) before we dropped them, newest last,
        # at most ENDED_KEPT: DATA on one is STREAM_CLOSED, not a late frame to ignore.
        self.ended: dict[int, None] = {}
        # Envoy sends the same header block for every ext_proc stream (indexed fields plus
        # a literal `:path` it never indexes): the decoder caches table-neutral blocks.
        self.decoder = HeaderDecoder(limits.max_header_list)
        self.peer_initial_window = 65_535
        self.peer_max_frame = 16_384
        self.send_window = 65_535  # connection-level, ours towards the peer
        # Upper bound of every stream's send_credit (raised by WINDOW_UPDATEs, tightened
        # by a scan): a SETTINGS change needs the scan only when it may overflow a window.
        self.max_send_credit = 0
        self.conn_credit = 0  # connection window released, not yet sent as WINDOW_UPDATE
        # Connection window the peer has used and we have not returned (RFC 9113 §6.9.1):
        # received DATA minus WINDOW_UPDATEs sent. Our window is CONN_RECV_WINDOW (the
        # WINDOW_UPDATE sent with our SETTINGS); more is a FLOW_CONTROL_ERROR.
        self.recv_unacked = 0
        # Message bytes held by the streams (see Limits.max_buffered), credit withheld
        # past it, the one stream allowed past it to complete a large message.
        self.buffered = 0
        self.owed = 0
        self.owing: set[H2Stream] = set()
        self.big_sid = 0
        now = self.loop.time()
        # Rapid reset balance (see RESET_BUDGET): +1 per answered stream, -1 per reset of
        # a started, unanswered stream, refilled over time and capped when it is spent.
        self.reset_balance = float(limits.reset_budget)
        self.reset_at = now
        self.control_balance = float(limits.control_budget)  # PING + SETTINGS
        self.control_at = now
        self.hpack_balance = float(limits.hpack_budget)
        self.hpack_at = now
        self.last_active = now
        self.write_paused_at = 0.0
        self.timer: asyncio.TimerHandle | None = None
        self.out: list[bytes] = []
        self.flush_scheduled = False
        self.receiving = False  # inside data_received: it flushes at its end
        # Work to run once this data_received's answers are written (H2Stream.after_write):
        # bookkeeping that must not delay the answers it follows.
        self.deferred: list[tuple[H2Stream, Callable[..., object], tuple[Any, ...]]] = []
        # Streams whose task-less handler has something to do once this read is parsed
        # (H2Stream.step): it then answers in this read's one write.
        self.ready: list[H2Stream] = []
        self.goaway_sent = False
        self.closed = False
        self.broken = False
        self.cont_sid = 0  # stream of a header block continued by CONTINUATION frames
        self.cont_flags = 0
        self.cont_count = 0
        self.cont_block = bytearray()
        self.window_waiters: list[asyncio.Future[None]] = []
        self.write_paused: asyncio.Future[None] | None = None
        self.chunk_lane = CHUNK_LANE  # None in the tests' reference runs
        self.frame_lane = FRAME_LANE  # likewise
        self.write_lane = WRITE_LANE  # likewise
        self.take_lane = TAKE_LANE  # likewise

    # ------------------------------------------------------------ asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A cast, not an isinstance check: uvloop's transports implement asyncio.Transport
        # without subclassing it (the check failed every connection: Envoy's 500s).
        transport = cast(asyncio.Transport, transport)
        self.transport = transport
        server = self.server
        if len(server.connections) >= self.limits.max_connections:
            # Over the connection cap: closed before any HTTP/2 (the client retries).
            server.count("refused")
            self.closed = True
            transport.close()
            return
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        server.connections.add(self)
        settings = settings_payload(
            (
                (S_MAX_CONCURRENT_STREAMS, self.limits.max_streams),
                (S_INITIAL_WINDOW_SIZE, RECV_WINDOW),
                (S_MAX_FRAME_SIZE, OUR_MAX_FRAME),
                (S_MAX_HEADER_LIST_SIZE, self.limits.max_header_list),
            )
        )
        self.send(frame(SETTINGS, 0, 0, settings))
        self.send(window_update(0, CONN_RECV_WINDOW - 65_535))
        self.timer = self.loop.call_later(self.limits.handshake_timeout, self.on_timer)
        if server.draining:
            self.goaway()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.server.connections.discard(self)
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        for s in list(self.streams.values()):
            s.on_reset()
        self.streams.clear()
        for w in self.window_waiters:
            if not w.done():
                w.set_result(None)
        if self.write_paused is not None and not self.write_paused.done():
            self.write_paused.set_result(None)

    def pause_writing(self) -> None:
        # The peer does not read what we send: stop reading what it sends, so that our
        # answers to it (PING and SETTINGS ACKs, resets, responses) cannot pile up.
        if self.write_paused is None:
            self.write_paused = self.loop.create_future()
            self.write_paused_at = self.loop.time()
            if self.transport is not None and not self.closed:
                self.transport.pause_reading()

    def resume_writing(self) -> None:
        w = self.write_paused
        self.write_paused = None
        if self.transport is not None and not self.closed:
            self.transport.resume_reading()
        if w is not None and not w.done():
            w.set_result(None)

    def on_timer(self) -> None:
        """Handshake timeout, then idle and write-stall checks every idle_timeout."""
        self.timer = None
        if self.closed:
            return
        now = self.loop.time()
        idle = self.limits.idle_timeout
        if not self.settings_seen:
            self.server.count("handshake_timeout")
            self.abort_connection("no HTTP/2 handshake in time", quiet=True)
            return
        if self.write_paused is not None and now - self.write_paused_at >= idle:
            self.server.count("write_stalled")
            self.abort_connection("the peer reads nothing we send", quiet=True)
            return
        if not self.streams and now - self.last_active >= idle:
            self.server.count("idle")
            self.goaway(NO_ERROR, "idle")
            return
        wait = idle - (now - self.last_active) if not self.streams else idle
        self.timer = self.loop.call_later(max(wait, 0.01 * idle), self.on_timer)

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.rbuf

    def buffer_updated(self, nbytes: int) -> None:
        # A copy of what was read (the buffer is reused by the next read): the frame
        # parser slices and keeps partial frames.
        self.data_received(bytes(self.rbuf[:nbytes]))

    def data_received(self, data: bytes) -> None:
        if self.broken or self.closed:
            return  # a connection error was answered with GOAWAY; closing
        # Everything answered while these bytes are parsed (WINDOW_UPDATEs, ACKs, messages
        # answered by a stream's `on_message`) leaves in one write at the end.
        self.receiving = True
        try:
            self.receive(data)
            if self.ready:
                if self.deferred:
                    # A stream's messages answered in the frame loop keep their order
                    # before what its handler does next (e.g. the end of the response).
                    self.flush()
                    self.run_deferred()
                self.step_ready()
        finally:
            self.receiving = False
            if self.out:
                self.flush()
            if self.deferred:
                self.run_deferred()

    def step_ready(self) -> None:
        """Run the task-less handlers this read woke (or started), in the order they
        became ready, until none is left."""
        while self.ready:
            ready, self.ready = self.ready, []
            for s in ready:
                s.step()

    def run_deferred(self) -> None:
        """Run what the streams deferred until their answers were written, in order. A
        failure ends its stream as a failing handler would (UNKNOWN)."""
        calls, self.deferred = self.deferred, []
        for s, fn, args in calls:
            try:
                fn(*args)
            except Exception:
                log.exception("ext_proc message handler failed")
                s.finish(2, "Unexpected error")
                s.cancel_handler()
        if self.out:
            self.flush()

    def receive(self, data: bytes) -> None:
        """Parse the frames in `data` (plus what an earlier call left incomplete)."""
        self.last_active = self.loop.time()
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
        frame_lane = self.frame_lane
        if frame_lane is not None and frame_lane(self, data):
            return  # the loop below, compiled
        pos = 0
        n = len(data)
        # Slices of a memoryview over immutable bytes: no copy per frame.
        view = memoryview(data)
        streams = self.streams
        lane = self.chunk_lane
        while n - pos >= 9:
            lt, flags, sid = HDR.unpack_from(data, pos)
            length = lt >> 8
            if length > OUR_MAX_FRAME:
                self.abort_connection("frame too large", FRAME_SIZE_ERROR)
                return
            if n - pos < 9 + length:
                self.need = 9 + length
                break
            end = pos + 9 + length
            if lt & 0xFF == DATA and not flags and length > 5 and not self.cont_sid:
                # The one-message lane: a DATA frame without flags holding one whole
                # message, Envoy's usual frame. For a stream answered in the frame loop
                # (H2Stream.on_message: a response chunk) the compiled `chunk_lane`, then
                # `one_message`, answers it, else `queue_message` queues it for the
                # handler; each changes nothing when it does not apply (then the next, or
                # on_frame, takes the same frame).
                s = streams.get(sid & 0x7FFFFFFF)
                if s is not None and (
                    (
                        s.lane is not None
                        and lane is not None
                        and lane(self, s, data, pos + 9, end, s.lane)
                    )
                    or self.one_message(s, data, pos + 9, end)
                    if s.fast is not None
                    else self.queue_message(s, data, pos + 9, end)
                ):
                    pos = end
                    continue
            payload = view[pos + 9 : end]
            pos = end
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
            return self.on_continuation(flags, sid, payload)
        if ftype == SETTINGS:
            return self.on_settings(flags, sid, payload)
        if not self.settings_seen:
            # The client preface is the magic then a SETTINGS frame (RFC 9113 §3.4).
            return self.abort_connection("the first frame must be SETTINGS")
        if ftype == WINDOW_UPDATE:
            return self.on_window_update(sid, payload)
        if ftype == PING:
            if sid:
                return self.abort_connection("PING on a stream")  # RFC 9113 §6.7
            if len(payload) != 8:
                return self.abort_connection("PING length", FRAME_SIZE_ERROR)
            if not flags & ACK:
                if not self.charge_control():
                    return False
                self.send(frame(PING, ACK, 0, bytes(payload)))
            return True
        if ftype == RST_STREAM:
            if len(payload) != 4:
                return self.abort_connection("bad RST_STREAM", FRAME_SIZE_ERROR)
            if sid == 0 or sid > self.last_sid:
                # Stream 0, or a stream in state idle (RFC 9113 §6.4, §5.1).
                return self.abort_connection("RST_STREAM on an idle stream")
            s = self.streams.get(sid)
            if s is not None:
                self.drop(s)
                s.on_reset()
                if s.handler is None and not s._headers_sent:  # started, unanswered
                    return self.premature_reset()
            return True
        if ftype == GOAWAY:
            # The peer opens no new streams here; the open ones run to their end.
            if sid:
                return self.abort_connection("GOAWAY on a stream")
            return True
        if ftype == PRIORITY:
            if sid == 0:
                return self.abort_connection("PRIORITY on stream 0")
            if len(payload) != 5:  # a stream error (RFC 9113 §6.3)
                return self.stream_error(sid, FRAME_SIZE_ERROR)
            return True  # deprecated (RFC 9113 §5.3.2): ignored
        if ftype == PUSH_PROMISE:
            return self.abort_connection("PUSH_PROMISE from a client")
        return True  # unknown frame types are ignored (RFC 9113 §4.1, §5.5)

    def on_continuation(self, flags: int, sid: int, payload: memoryview) -> bool:
        if sid != self.cont_sid or not sid:
            return self.abort_connection("unexpected CONTINUATION")
        if len(self.cont_block) + len(payload) > self.limits.max_header_list:
            return self.abort_connection("header block too large", ENHANCE_YOUR_CALM)
        self.cont_count += 1
        if self.cont_count > self.limits.max_continuations:
            return self.abort_connection("too many CONTINUATION frames", ENHANCE_YOUR_CALM)
        self.cont_block += payload
        if flags & END_HEADERS:
            block = bytes(self.cont_block)
            self.cont_sid = 0
            self.cont_block.clear()
            return self.on_header_block(sid, self.cont_flags, block)
        return True

    def on_window_update(self, sid: int, payload: memoryview) -> bool:
        if len(payload) != 4:
            return self.abort_connection("bad WINDOW_UPDATE", FRAME_SIZE_ERROR)
        inc = U32.unpack(payload)[0] & 0x7FFFFFFF
        if sid == 0:
            if inc == 0:  # RFC 9113 §6.9
                return self.abort_connection("WINDOW_UPDATE of 0")
            self.send_window += inc
            if self.send_window > MAX_WINDOW:
                return self.abort_connection("window overflow", FLOW_CONTROL_ERROR)
        else:
            if sid > self.last_sid:
                return self.abort_connection("WINDOW_UPDATE on an idle stream")
            s = self.streams.get(sid)
            if s is None:
                return True  # a closed stream: ignored (RFC 9113 §6.9)
            if inc == 0:
                return self.stream_error(sid, PROTOCOL_ERROR)
            credit = s.send_credit + inc
            if self.peer_initial_window + credit > MAX_WINDOW:
                return self.stream_error(sid, FLOW_CONTROL_ERROR)  # RFC 9113 §6.9.1
            s.send_credit = credit
            if credit > self.max_send_credit:
                self.max_send_credit = credit
        self.wake_writers()
        return True

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
            if sid > self.last_sid:
                return self.abort_connection("DATA on an idle stream")  # RFC 9113 §5.1
            # A stream we closed (or reset): the data still used connection window.
            self.conn_credit_add(flow_len)
            if sid in self.ended:
                # The peer ended it: no DATA can follow (RFC 9113 §5.1, §6.1).
                return self.stream_error(sid, STREAM_CLOSED)
            return True
        if s._half_closed:
            # DATA after the peer's END_STREAM (RFC 9113 §5.1, half-closed (remote)).
            self.conn_credit_add(flow_len)
            return self.stream_error(sid, STREAM_CLOSED)
        if s._unacked + flow_len > RECV_WINDOW:
            # More than the stream window we granted (RFC 9113 §6.9): stream error.
            self.conn_credit_add(flow_len)
            return self.stream_error(sid, FLOW_CONTROL_ERROR)
        s._unacked += flow_len
        n = len(data)
        if flow_len != n:
            self.grant(s, flow_len - n)  # padding: returned at once
        s._held += n
        self.buffered += n
        err = s.on_data(data, bool(flags & END_STREAM))
        if err is not None:
            # UNIMPLEMENTED / RESOURCE_EXHAUSTED / INTERNAL, then stop the handler: a bad
            # message ends its stream, not the connection (its bytes are released as the
            # stream is dropped).
            self.conn_credit_add(n)
            code = 12 if err.startswith("compressed") else 8 if "larger" in err else 13
            s.finish(code, err)
            s.cancel_handler()
            return True
        if n:
            # Message bytes: credit is returned now while the connection holds at most
            # max_buffered, or to the one stream let past it to complete a message;
            # otherwise it is owed until memory is released (the peer stops at its window).
            if self.buffered <= self.limits.max_buffered or self.big_sid == sid:
                self.grant(s, n)
            elif self.big_sid == 0 and s._buf:
                self.big_sid = sid
                self.grant(s, n)
            else:
                s._owed += n
                self.owed += n
                self.owing.add(s)
            if self.big_sid == sid and not s._buf:
                self.big_sid = 0  # its message is complete
        return True

    def one_message(self, s: H2Stream, data: bytes, start: int, end: int) -> bool:
        """`on_data_frame` + `H2Stream.on_data` for one DATA frame without flags (payload
        `data[start:end]`) holding exactly one whole uncompressed gRPC message,
        while the stream's handler is parked in read() with nothing queued: the stream's
        answerer gets the message at once. Returns False, having changed nothing, when any
        of that does not hold, a window check would fail, or the answerer leaves the
        message to the handler (it decides from the bytes and the send windows alone, so
        the general path, asked again, decides the same). The accounting below is the
        general path's for that case: the bytes are held and released in the same call,
        their credit granted (or owed) as `on_data_frame` does."""
        flow_len = end - start
        if (
            data[start]
            or int.from_bytes(data[start + 1 : start + 5], "big") + 5 != flow_len
            or flow_len - 5 > self.server.max_message
            or s._half_closed
            or s._buf
            or s._msgs
            or s._sizes is None
            or s._unacked + flow_len > RECV_WINDOW
            or self.recv_unacked + flow_len > CONN_RECV_WINDOW
        ):
            return False
        w = s._waiter
        fast = s.fast
        if w is None or w.done() or fast is None:
            return False
        failed = False
        try:
            if not fast(bytes(data[start + 5 : end])):  # bytes(bytes) is no copy
                return False
        except Exception:
            log.exception("ext_proc message handler failed")
            failed = True
        self.recv_unacked += flow_len
        s._unacked += flow_len
        if self.owed:
            self.release(s, 0)  # held and released at once: only the owed credit moves
        if failed:
            s.finish(2, "Unexpected error")  # UNKNOWN, as for a handler
            s.cancel_handler()
        sid = s.sid
        if self.buffered <= self.limits.max_buffered or self.big_sid == sid:
            self.grant(s, flow_len)
        else:
            s._owed += flow_len
            self.owed += flow_len
            self.owing.add(s)
        if self.big_sid == sid:
            self.big_sid = 0  # its message is complete
        return True

    def queue_message(self, s: H2Stream, data: bytes, start: int, end: int) -> bool:
        """`on_data_frame` + `H2Stream.on_data` for one DATA frame without flags (payload
        `data[start:end]`) holding exactly one whole uncompressed gRPC message on a
        stream with nothing buffered: the message is parsed and queued for the handler
        (started or woken as `on_data` does). Returns False, having changed nothing,
        when any of that does not hold, a window or memory bound is in the way, or the
        message does not parse (the general path then takes the frame and decides the
        same). The accounting is the general path's for that case, in one place."""
        flow_len = end - start
        n = flow_len - 5
        if (
            data[start]
            or int.from_bytes(data[start + 1 : start + 5], "big") != n
            or n > self.server.max_message
            or s._half_closed
            or s._buf
            or s._sizes is None
            or s._unacked + flow_len > RECV_WINDOW
            or self.recv_unacked + flow_len > CONN_RECV_WINDOW
            or self.buffered + flow_len > self.limits.max_buffered
        ):
            return False
        deserialize = s._deserialize
        if deserialize is None:
            msg: Any = data[start + 5 : end]
        else:
            try:
                msg = deserialize(data[start + 5 : end])
            except Exception:
                return False  # the general path reports it
        self.recv_unacked += flow_len
        s._unacked += flow_len
        s._held += flow_len
        self.buffered += flow_len
        s._msgs.append(msg)
        s._sizes.append(flow_len)
        self.grant(s, flow_len)
        if self.big_sid == s.sid:
            self.big_sid = 0  # its message is complete
        if s.handler is not None:
            s.start()
        else:
            s._wake()
        return True

    def grant(self, s: H2Stream, n: int) -> None:
        """Return `n` bytes of credit on the connection and on stream `s` (batched)."""
        self.conn_credit_add(n)
        c = s._credit + n
        if c >= RECV_WINDOW // 4 and not s._half_closed and s.sid in self.streams:
            self.send(window_update(s.sid, c))
            s._unacked -= c
            c = 0
        s._credit = c

    def release(self, s: H2Stream, n: int) -> None:
        """Stream `s` no longer holds `n` message bytes (read by its handler, or gone)."""
        s._held -= n
        self.buffered -= n
        if self.owed and self.buffered <= self.limits.max_buffered // 2:
            owing = self.owing
            self.owing = set()
            self.owed = 0
            for o in owing:
                owed, o._owed = o._owed, 0
                if o.sid in self.streams:
                    self.grant(o, owed)
                else:
                    self.conn_credit_add(owed)

    def release_stream(self, s: H2Stream) -> None:
        """Stream `s` left the connection: release its bytes, return its owed credit."""
        if s._owed:
            self.owed -= s._owed
            self.owing.discard(s)
            self.conn_credit_add(s._owed)
            s._owed = 0
        if self.big_sid == s.sid:
            self.big_sid = 0
        if s._held:
            self.release(s, s._held)

    def stream_error(self, sid: int, code: int) -> bool:
        """RST_STREAM(code) and stop the stream's handler (RFC 9113 §5.4.2)."""
        self.send(rst_stream(sid, code))
        s = self.streams.get(sid)
        if s is not None:
            self.drop(s)
            s.on_reset()
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
        if end - start > self.limits.max_header_list:
            return self.abort_connection("header block too large", ENHANCE_YOUR_CALM)
        if not self.settings_seen:
            return self.abort_connection("the first frame must be SETTINGS")
        block = bytes(payload[start:end])
        if not flags & END_HEADERS:
            self.cont_sid = sid
            self.cont_flags = flags
            self.cont_count = 0
            self.cont_block = bytearray(block)
            return True
        return self.on_header_block(sid, flags, block)

    def on_header_block(self, sid: int, flags: int, block: bytes) -> bool:
        decoder = self.decoder
        misses = decoder.decoded_bytes
        try:
            # The decoder must see every block in order: it keeps the dynamic table.
            headers = decoder.decode(block)
        except OversizedHeaderListError:
            return self.abort_connection("header list too large", ENHANCE_YOUR_CALM)
        except Exception as e:  # hpack raises its own error types
            return self.abort_connection(f"HPACK: {e}", COMPRESSION_ERROR)
        if decoder.decoded_bytes != misses and not self.charge_hpack(len(block)):
            return False
        end = bool(flags & END_STREAM)
        s = self.streams.get(sid)
        if s is not None:  # trailers from the client end its side
            if s._half_closed:
                return self.stream_error(sid, STREAM_CLOSED)  # RFC 9113 §5.1
            if end:
                err = s.on_data(b"", True)
                if err is not None:
                    s.finish(13, err)  # INTERNAL: the request ended inside a message
                    s.cancel_handler()
            return True
        if sid % 2 == 0:  # client streams are odd (RFC 9113 §5.1.1)
            return self.abort_connection("even stream id")
        if sid <= self.last_sid:
            # Trailers of a stream we already closed (we may have reset it: §5.1 says to
            # ignore such frames); a new stream cannot reuse or go below a used id.
            return True
        self.last_sid = sid
        if self.goaway_sent or len(self.streams) >= self.limits.max_streams:
            # Over SETTINGS_MAX_CONCURRENT_STREAMS (RFC 9113 §5.1.2) or going away: refused
            # (the client may retry it elsewhere, §8.7); no handler runs.
            self.send(rst_stream(sid, REFUSED_STREAM))
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
            stream.on_data(b"", True)
        return True

    def on_settings(self, flags: int, sid: int, payload: memoryview) -> bool:
        if sid != 0:
            return self.abort_connection("SETTINGS on a stream")  # RFC 9113 §6.5
        if len(payload) % 6:
            return self.abort_connection("bad SETTINGS length", FRAME_SIZE_ERROR)
        if flags & ACK:
            if payload:  # RFC 9113 §6.5
                return self.abort_connection("SETTINGS ACK with a payload", FRAME_SIZE_ERROR)
            if not self.settings_seen:
                return self.abort_connection("the first frame must be SETTINGS")
            return True
        if len(payload) > 6 * self.limits.max_settings_entries:
            return self.abort_connection("too many SETTINGS entries", ENHANCE_YOUR_CALM)
        if self.settings_seen and not self.charge_control():
            return False
        if not self.settings_seen:
            self.settings_seen = True  # the handshake is done: the idle timer takes over
            if self.timer is not None:
                self.timer.cancel()
            self.timer = self.loop.call_later(self.limits.idle_timeout, self.on_timer)
        initial = self.peer_initial_window
        for key, value in SETTING.iter_unpack(payload):
            if key == S_INITIAL_WINDOW_SIZE:
                if value > MAX_WINDOW:
                    return self.abort_connection("bad window", FLOW_CONTROL_ERROR)
                initial = value
            elif key == S_MAX_FRAME_SIZE:
                if not 16_384 <= value <= 16_777_215:
                    return self.abort_connection("bad max frame size")
                self.peer_max_frame = value
            elif key == S_ENABLE_PUSH and value > 1:
                return self.abort_connection("bad ENABLE_PUSH")
        if initial != self.peer_initial_window:
            # Stream windows are initial + credit: one assignment moves them all (RFC 9113
            # §6.9.2); only a window that would pass 2^31-1 needs a look at each stream.
            if initial + self.max_send_credit > MAX_WINDOW:
                top = max((s.send_credit for s in self.streams.values()), default=0)
                if initial + top > MAX_WINDOW:
                    return self.abort_connection("SETTINGS overflow a window", FLOW_CONTROL_ERROR)
                self.max_send_credit = top
            self.peer_initial_window = initial
        self.send(frame(SETTINGS, ACK, 0))
        self.wake_writers()
        return True

    def charge_control(self) -> bool:
        """One PING or SETTINGS frame against the connection's control balance."""
        now = self.loop.time()
        limits = self.limits
        balance = self.control_balance + (now - self.control_at) * limits.control_refill_per_s
        self.control_balance = min(balance, float(limits.control_budget)) - 1.0
        self.control_at = now
        if self.control_balance < 0:
            return self.abort_connection("PING/SETTINGS flood", ENHANCE_YOUR_CALM)
        return True

    def charge_hpack(self, n: int) -> bool:
        """`n` bytes of header block decoded (cache miss) against the HPACK balance."""
        now = self.loop.time()
        limits = self.limits
        balance = self.hpack_balance + (now - self.hpack_at) * limits.hpack_refill_per_s
        self.hpack_balance = min(balance, float(limits.hpack_budget)) - n
        self.hpack_at = now
        if self.hpack_balance < 0:
            return self.abort_connection("header decoding over budget", ENHANCE_YOUR_CALM)
        return True

    # ------------------------------------------------------------ frames out

    def send(self, data: bytes) -> None:
        """Queue bytes; everything queued in one event-loop turn goes out in one write."""
        if self.closed:
            return
        self.out.append(data)
        if not self.flush_scheduled and not self.receiving:
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
            window = self.peer_initial_window + s.send_credit
            room = min(self.send_window, window, self.peer_max_frame, n - pos)
            if room <= 0:
                w = self.loop.create_future()
                self.window_waiters.append(w)
                await w
                continue
            chunk = data[pos : pos + room] if (pos or room < n) else data
            self.send(frame(DATA, 0, s.sid, chunk))
            self.send_window -= room
            s.send_credit -= room
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
            self.send(window_update(0, self.conn_credit))
            self.recv_unacked -= self.conn_credit
            self.conn_credit = 0

    def drop(self, s: H2Stream) -> None:
        """Remove a stream that ended (or was reset) and return its connection window."""
        self.streams.pop(s.sid, None)
        if s._half_closed:
            ended = self.ended
            ended[s.sid] = None
            if len(ended) > ENDED_KEPT:
                del ended[next(iter(ended))]
        s.release()
        if self.goaway_sent and not self.streams:
            self.close_soon()

    def premature_reset(self) -> bool:
        """Account a client reset of a started, unanswered stream (rapid reset,
        CVE-2023-44487). Over the budget: GOAWAY(ENHANCE_YOUR_CALM); streams already open
        run to their end, new ones are refused, then the connection closes."""
        now = self.loop.time()
        limits = self.limits
        balance = self.reset_balance + (now - self.reset_at) * limits.reset_refill_per_s
        self.reset_balance = min(balance, float(limits.reset_budget)) - 1.0
        self.reset_at = now
        if self.reset_balance < 0 and not self.goaway_sent:
            log.warning("ext_proc HTTP/2: too many streams reset before an answer; GOAWAY")
            self.goaway(ENHANCE_YOUR_CALM, "too many resets")
        return True

    def goaway(self, code: int = NO_ERROR, text: str = "") -> None:
        if not self.goaway_sent:
            self.goaway_sent = True
            self.send(goaway(self.last_sid, code, text.encode()[:256]))
            if not self.streams:
                self.close_soon()

    def close_soon(self) -> None:
        def close() -> None:
            self.flush()
            if self.transport is not None:
                self.transport.close()

        self.loop.call_soon(close)

    def abort_connection(self, why: str, code: int = PROTOCOL_ERROR, quiet: bool = False) -> bool:
        """Connection error: GOAWAY(code), every stream cancelled, socket closed."""
        if not quiet:
            self.server.count("connection_error")
            log.info("ext_proc HTTP/2 connection error: %s", why)
        self.broken = True
        self.goaway_sent = False
        self.goaway(code, why)
        for s in list(self.streams.values()):
            s.on_reset()
        self.streams.clear()
        self.close_soon()
        return False
