"""One gRPC call on an HTTP/2 stream: length-prefixed messages in and out, the status in
trailers, and the servicer-facing context (`StreamContext`, `AbortStream`, `unary`).

gRPC over HTTP/2 (grpc/grpc doc/PROTOCOL-HTTP2.md): `:status 200`,
`content-type: application/grpc`, length-prefixed messages (1-byte compressed flag,
4-byte big-endian length), trailers `grpc-status` / `grpc-message` (percent-encoded),
Trailers-Only responses.
"""

from __future__ import annotations

import asyncio
import collections.abc
import inspect
import logging
import struct
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine, Generator
from typing import TYPE_CHECKING, Any, NoReturn, Protocol

import grpc

from scorer.extproc.transport.frames import (
    DATA,
    END_HEADERS,
    END_STREAM,
    HEADERS,
    NO_ERROR,
    frame,
    rst_stream,
)
from scorer.extproc.transport.hpack_codec import RESPONSE_HEADERS, status_trailers

if TYPE_CHECKING:
    from scorer.extproc.transport.connection import H2Connection

log = logging.getLogger("scorer.extproc.transport")
EOF: object = grpc.aio.EOF  # type: ignore[attr-defined]  # same sentinel as grpc.aio's read()
MSG = struct.Struct(">BI")  # gRPC message prefix: compressed flag, length
DATA_MSG = struct.Struct(">IBIBI")  # a DATA frame header (frames.HDR) then MSG


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


def unary(fn: Callable[[Any, Any], Awaitable[Any]]) -> Handler:
    """A unary method `await fn(request, context) -> response` as a stream handler (the
    grpc.aio servicer signature, so scorer.v1.Scorer/Score and health Check run as is)."""

    async def handler(_: Any, stream: StreamContext) -> None:
        request = await stream.read()
        if request is EOF:
            await stream.abort(grpc.StatusCode.INTERNAL, "unary call without a request")
        await stream.write(await fn(request, stream))

    return handler


class H2Stream:
    """One gRPC call: the servicer's `context` (read / write / abort / cancelled)."""

    __slots__ = (
        "_buf",
        "_cancelled",
        "_coro",
        "_credit",
        "_deserialize",
        "_done",
        "_half_closed",
        "_headers_sent",
        "_held",
        "_interrupted",
        "_msgs",
        "_owed",
        "_ready",
        "_sizes",
        "_unacked",
        "_waiter",
        "conn",
        "fast",
        "handler",
        "headers",
        "lane",
        "path",
        "send_credit",
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
        # Our send window is conn.peer_initial_window + send_credit (WINDOW_UPDATEs minus
        # data sent): a SETTINGS change of the initial window then costs O(1), not one
        # update per open stream (RFC 9113 §6.9.2).
        self.send_credit = 0
        # The handler runs without a task while it only waits for this stream's messages
        # (see `step`): `_coro` is its coroutine then; `task` once it awaits anything else.
        self.task: asyncio.Task[None] | None = None
        self._coro: Coroutine[Any, Any, None] | None = None
        self._ready = False  # queued on the connection's `ready` list
        self._interrupted = False  # CancelledError due at the handler's next step
        self._msgs: deque[Any] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._buf = bytearray()
        self._half_closed = False  # the peer sent END_STREAM
        self._headers_sent = False
        self._done = False  # we sent our trailers or reset the stream
        self._cancelled = False
        # Receive side (see H2Connection.on_data_frame): stream window used by the peer
        # and not returned yet; credit granted, to be sent with the next WINDOW_UPDATE;
        # credit withheld while the connection holds too much.
        self._unacked = 0
        self._credit = 0
        self._owed = 0
        # Message bytes this stream holds (partial message + messages not read yet).
        # `_sizes` has the wire size of each queued message (None once the stream is
        # dropped and its bytes were released).
        self._held = 0
        self._sizes: deque[int] | None = deque()
        self._deserialize = deserialize
        self.handler: Handler | None = None  # set until the handler task starts
        # Set by a handler (see `on_message`): answers a message synchronously on arrival.
        self.fast: Callable[[bytes], bool] | None = None
        # With `fast`: what the compiled chunk lane needs (see `on_message`), or None.
        self.lane: tuple[Any, ...] | None = None

    # ------------------------------------------------------------ servicer side

    async def read(self) -> Any:
        """The next request message, or EOF once the peer half-closed."""
        while not self._msgs:
            if self._cancelled:
                raise asyncio.CancelledError()
            conn = self.conn
            if conn.out and not conn.receiving:
                # The handler waits now: what it wrote leaves at once, in one write (the
                # flush already scheduled then finds nothing), not a loop turn later.
                conn.flush()
            self._waiter = conn.loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        take = self.conn.take_lane
        if take is not None:
            return take(self)  # the lines below, compiled
        m = self._msgs.popleft()
        sizes = self._sizes
        if sizes and m is not EOF:
            self.conn.release(self, sizes.popleft())
        return m

    async def write(self, message: Any) -> None:
        """Send one response message (a protobuf, or already serialized bytes)."""
        data = message if isinstance(message, bytes) else message.SerializeToString()
        if self._done:
            raise asyncio.CancelledError()
        lane = self.conn.write_lane  # write_now compiled (None: the Python method)
        if not (self.write_now(data) if lane is None else lane(self, data)):
            await self.conn.send_data(self, MSG.pack(0, len(data)) + data)

    def write_now(self, data: bytes) -> bool:
        """Send one serialized response message now if it fits one DATA frame within the
        flow-control windows and the peer reads what we send; False (nothing sent) when
        it has to wait (then `write` it)."""
        conn = self.conn
        n = len(data) + 5
        if (
            n > conn.peer_max_frame
            or n > conn.send_window
            or n > conn.peer_initial_window + self.send_credit
            or conn.write_paused is not None
            or self._done
        ):
            return False
        if not self._headers_sent:
            self._headers_sent = True
            conn.reset_balance += 1  # an answered stream (rapid reset accounting)
            conn.send(frame(HEADERS, END_HEADERS, self.sid, RESPONSE_HEADERS))
        # One DATA frame: every ext_proc answer but large bodies.
        conn.send(DATA_MSG.pack((n << 8) | DATA, 0, self.sid, 0, n - 5) + data)
        conn.send_window -= n
        self.send_credit -= n
        return True

    def after_write(self, fn: Callable[..., object], *args: Any) -> None:
        """Call `fn(*args)` once the answers queued so far have been written: at the end of
        the connection's current `data_received` (after its one write), or now when not
        inside one. For bookkeeping a `fast` answerer does after answering, so it does
        not hold the answer back."""
        conn = self.conn
        if conn.receiving:
            conn.deferred.append((self, fn, args))
        else:
            fn(*args)

    def on_message(
        self, fast: Callable[[bytes], bool] | None, lane: tuple[Any, ...] | None = None
    ) -> None:
        """Install (None: remove) a synchronous answerer for this stream's messages.

        `fast(raw)` gets each whole message's bytes as it arrives, while the handler is
        parked in `read()` with nothing queued (so every earlier message is answered and
        answers stay in order); it returns True when it answered and accounted for the
        message (with `write_now`), False to queue it for `read()` as usual. It must not
        block: it runs inside the connection's frame loop.

        `lane` = (duplex, CONTINUE body-response bytes, the answerer's set of checked
        metadata values, director.response_chunk, request id): the compiled
        `chunk_lane` (scorer/native/_speedups.pyx) then answers the common response-body
        chunk frames as `fast` would, before `fast` is asked."""
        self.fast = fast
        self.lane = lane if fast is not None else None

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
            if self._coro is not None:
                self.schedule()

    def on_data(self, data: memoryview | bytes, end: bool) -> str | None:
        """Buffer DATA (the connection accounted for it); queue whole messages. Returns
        an error text for a bad message: it ends this stream only."""
        if data:
            buf = self._buf
            # Messages are read straight from the frame's bytes (one copy each) unless a
            # partial one is buffered; what is left of a partial message is kept.
            if buf:
                buf += data
                src: memoryview | bytes | bytearray = buf
            else:
                src = data
            pos = 0
            size = len(src)
            while size - pos >= 5:
                compressed, n = MSG.unpack_from(src, pos)
                if compressed:
                    return "compressed messages are not supported"
                if n > self.conn.server.max_message:
                    return f"message larger than {self.conn.server.max_message} bytes"
                if size - pos < 5 + n:
                    break
                raw = bytes(src[pos + 5 : pos + 5 + n])
                pos += 5 + n
                fast = self.fast
                w = self._waiter
                if fast is not None and not self._msgs and w is not None and not w.done():
                    # The handler is parked in read(): answer here, no task switch.
                    try:
                        done = fast(raw)
                    except Exception:
                        log.exception("ext_proc message handler failed")
                        if self._sizes is not None:
                            self.conn.release(self, 5 + n)
                        self.finish(2, "Unexpected error")  # UNKNOWN, as for a handler
                        self.cancel_handler()
                        return None
                    if done:
                        if self._sizes is not None:
                            self.conn.release(self, 5 + n)
                        continue
                if self._deserialize is None:
                    self._msgs.append(raw)
                else:
                    try:
                        self._msgs.append(self._deserialize(raw))
                    except Exception as e:  # protobuf's DecodeError, or what a parser raises
                        # Its bytes left the buffer: release them with the error.
                        self.conn.release(self, 5 + n)
                        return f"could not parse the request message: {e}"
                if self._sizes is not None:
                    self._sizes.append(5 + n)
            if src is buf:
                del buf[:pos]
            elif pos < size:
                buf += src[pos:]
        if end:
            self._half_closed = True
            if self._buf:
                return "stream ended inside a message"
            self._msgs.append(EOF)
        if self._msgs:
            if self.handler is not None:
                self.start()
            else:
                self._wake()
        return None

    def start(self) -> None:
        """Start the handler (its first message is queued): it runs at the end of the
        connection's current read, when every message of that read is queued (see
        `step`)."""
        handler = self.handler
        assert handler is not None
        self.handler = None
        self._coro = self.conn.server.run(self, handler)
        self.schedule()

    def schedule(self) -> None:
        """Step the task-less handler once the connection's current read is parsed (or in
        the next loop turn outside a read)."""
        if self._ready:
            return
        self._ready = True
        conn = self.conn
        if conn.receiving:
            conn.ready.append(self)
        else:
            conn.loop.call_soon(self.step)

    def step(self) -> None:
        """Run the task-less handler until it waits again.

        An ext_proc handler mostly waits for its own stream's next message, which this
        stream knows the moment it arrives: the handler's coroutine is driven from here,
        inside the connection's read, so a request read in one `data_received` is
        answered in that read's one write, with no task created and no loop turn between
        the read and the answer. The first time the handler awaits anything else (a
        thread pool's future, flow-control credit, a sleep) its coroutine moves to a task
        (`_Resumed`), which drives it from there on as asyncio always would."""
        self._ready = False
        coro = self._coro
        if coro is None:
            return
        interrupted, self._interrupted = self._interrupted, False
        w = self._waiter
        if not interrupted and w is not None and not w.done():
            return  # not woken: nothing to resume it with
        if interrupted and inspect.getcoroutinestate(coro) == inspect.CORO_CREATED:
            # Cancelled before it ran (as a task cancelled before its first step).
            self._coro = None
            coro.close()
            return
        try:
            fut = coro.throw(asyncio.CancelledError()) if interrupted else coro.send(None)
        except StopIteration:
            self._coro = None
            return
        except BaseException:
            self._coro = None
            raise
        if fut is not self._waiter or fut is None:
            self.promote(fut)

    def promote(self, fut: Any = None) -> None:
        """Hand the task-less handler's coroutine to a task (`fut`: what it waits on now;
        None: its parked read's waiter). No-op when a task already runs it."""
        coro = self._coro
        if coro is None:
            return
        self._coro = None
        if fut is None:
            fut = self._waiter
        task = self.task = self.conn.loop.create_task(_Resumed(coro, fut))
        if self._interrupted:  # due at its next step: the task delivers it
            self._interrupted = False
            task.cancel()

    def interrupt(self) -> None:
        """Cancel the handler where it waits (Task.cancel for a task-less one): it sees
        CancelledError there, as a cancelled task's coroutine does."""
        if self._coro is not None:
            self._interrupted = True
            self.schedule()
        elif self.task is not None and not self.task.done():
            self.task.cancel()

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
        self.interrupt()

    def finish(self, code: int, message: str | None = None) -> None:
        """Send trailers (or a Trailers-Only response) and close our side."""
        if self._done:
            return
        self._done = True
        conn = self.conn
        block = status_trailers(code, message)
        if not self._headers_sent:
            block = RESPONSE_HEADERS + block
            conn.reset_balance += 1
        conn.send_headers(self.sid, block, END_STREAM)
        if not self._half_closed:
            # The peer is still sending (e.g. track_responses off): stop it without error
            # (RFC 9113 §8.1).
            conn.send(rst_stream(self.sid, NO_ERROR))
        conn.drop(self)

    def release(self) -> None:
        """The stream left the connection: release what its unread data holds (read()
        returns nothing more from now on)."""
        if self._sizes is not None:
            self._sizes = None
            self.conn.release_stream(self)


class _Resumed(collections.abc.Coroutine[Any, Any, None]):
    """A coroutine already started elsewhere (`H2Stream.step`), in the coroutine protocol
    a task drives: its first `send` returns what the coroutine waits on now (`fut`),
    then `send` and `throw` go straight to the coroutine, as they would had the task
    started it. A cancellation before the task's first step reaches the coroutine where
    it waits."""

    __slots__ = ("coro", "fut", "pending")

    def __init__(self, coro: Coroutine[Any, Any, None], fut: Any) -> None:
        self.coro = coro
        self.fut = fut
        self.pending = True  # `fut` not handed to the task yet

    def send(self, value: Any) -> Any:
        if self.pending:
            self.pending = False
            fut, self.fut = self.fut, None
            return fut
        return self.coro.send(value)

    def throw(self, typ: Any, val: Any = None, tb: Any = None) -> Any:
        self.pending = False
        self.fut = None
        if val is None and tb is None:
            return self.coro.throw(typ)
        return self.coro.throw(typ, val, tb)  # the legacy three-argument form

    def close(self) -> None:
        self.coro.close()

    def __await__(self) -> Generator[Any, None, None]:
        raise NotImplementedError  # driven by a task only
