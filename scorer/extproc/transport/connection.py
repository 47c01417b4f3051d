"""One HTTP/2 connection from a gRPC client (Envoy): the frame loop, stream table,
SETTINGS, flow control both ways, GOAWAY and connection errors.

RFC 9113: frame layout (§4.1), DATA/HEADERS/RST_STREAM/SETTINGS/PING/GOAWAY/
WINDOW_UPDATE/CONTINUATION (§6), flow control (§5.2, §6.9), connection preface (§3.4),
a server may answer and then RST_STREAM(NO_ERROR) a request still being sent (§8.1).
Everything sent in one event-loop turn leaves in one `transport.write`.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from typing import TYPE_CHECKING

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
    PRIORITY_FLAG,
    PROTOCOL_ERROR,
    PUSH_PROMISE,
    REFUSED_STREAM,
    RST_STREAM,
    S_INITIAL_WINDOW_SIZE,
    S_MAX_CONCURRENT_STREAMS,
    S_MAX_FRAME_SIZE,
    S_MAX_HEADER_LIST_SIZE,
    SETTING,
    SETTINGS,
    U32,
    WINDOW_UPDATE,
    frame,
    goaway,
    rst_stream,
    settings_payload,
    window_update,
)
from scorer.extproc.transport.hpack_codec import HeaderDecoder, OversizedHeaderListError
from scorer.extproc.transport.limits import CONN_RECV_WINDOW, OUR_MAX_FRAME, RECV_WINDOW
from scorer.extproc.transport.stream import H2Stream

if TYPE_CHECKING:
    from scorer.extproc.transport.server import H2GrpcServer

log = logging.getLogger("scorer.extproc.transport")


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
        # Envoy sends the same header block for every ext_proc stream (indexed fields plus
        # a literal `:path` it never indexes): the decoder caches table-neutral blocks.
        self.decoder = HeaderDecoder(server.max_header_list)
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
        settings = settings_payload(
            (
                (S_MAX_CONCURRENT_STREAMS, self.server.max_streams),
                (S_INITIAL_WINDOW_SIZE, RECV_WINDOW),
                (S_MAX_FRAME_SIZE, OUR_MAX_FRAME),
                (S_MAX_HEADER_LIST_SIZE, self.server.max_header_list),
            )
        )
        self.send(frame(SETTINGS, 0, 0, settings))
        self.send(window_update(0, CONN_RECV_WINDOW - 65_535))
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
            lt, flags, sid = HDR.unpack_from(data, pos)
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
            inc = U32.unpack(payload)[0] & 0x7FFFFFFF
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
            self.send(rst_stream(sid, FLOW_CONTROL_ERROR))
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
        try:
            # The decoder must see every block in order: it keeps the dynamic table.
            headers = self.decoder.decode(block)
        except OversizedHeaderListError:
            return self.abort_connection("header list too large", ENHANCE_YOUR_CALM)
        except Exception as e:  # hpack raises its own error types
            return self.abort_connection(f"HPACK: {e}", COMPRESSION_ERROR)
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
            key, value = SETTING.unpack_from(payload, i)
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
            self.send(window_update(0, self.conn_credit))
            self.recv_unacked -= self.conn_credit
            self.conn_credit = 0

    def stream_credit(self, sid: int, n: int) -> None:
        if sid in self.streams and not self.closed:
            self.send(window_update(sid, n))

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
            self.send(goaway(self.last_sid, code, text.encode()[:256]))
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
