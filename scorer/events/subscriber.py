"""One ZMQ SUB per worker: sequence tracking, replay on gaps, purge on restart.

Protocol (vLLM `ZmqEventPublisher`, vllm/distributed/kv_events.py):

* PUB sends ``[topic, seq (8 bytes BE), payload]``; seq starts at 0 per publisher and
  restarts at 0 when the engine restarts;
* the replay ROUTER answers a DEALER's ``[b"", start_seq (8 bytes BE)]`` with every buffered
  message from start_seq: ``[b"", seq, payload]`` up to 0.25, ``[b"", topic, seq, payload]``
  from 0.26, then an end marker whose seq is 0xFF x 8 with an empty payload;
* vLLM binds its PUB for ``tcp://*:PORT`` (we connect) and connects for ``tcp://host:PORT``
  (we bind).

Per (worker, dp_rank): the next seq applies; a jump forward is a gap, replayed from the
worker's replay endpoint (or the worker is purged when there is none, it times out, or its
buffer no longer reaches back); a seq that goes backwards means the engine restarted, so
the worker is purged and the stream starts over. Ingestion runs on the event loop in small
bursts (the loop is yielded between them) so request handling is never starved.

Receiving: a `Reader` reads the SUB from the loop's reader callback and hands each message
to `Subscriber.offer`, which handles it right there when nothing is in progress (the common
case: one message per engine step, no task, no loop turn) and otherwise queues it behind
what is (a sync, a gap's replay, earlier queued messages) for the async path, which takes
them in order under the lock the sync holds.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio
from prometheus_client import Counter, Gauge

from scorer.config import EventsConfig, EventsEndpointConfig
from scorer.events.apply import Applier
from scorer.events.decode import (
    END_SEQ,
    ERROR_KINDS,
    AllBlocksCleared,
    DecodeError,
    EventBatch,
    Message,
    decode_message,
    decode_payload,
    decode_seq,
    split_replay_reply,
)
from scorer.tasks import cancel_and_wait

log = logging.getLogger(__name__)

DECODE_ERRORS = Counter(
    "kv_scorer_event_decode_errors_total", "Malformed KV-event messages or events", ["kind"]
)
GAPS = Counter("kv_scorer_event_gaps_total", "Sequence gaps seen on KV-event streams")
REPLAYS = Counter(
    "kv_scorer_event_replays_total",
    "Replay requests by outcome (ok, unavailable, timeout, too_old, error)",
    ["outcome"],
)
PURGES = Counter(
    "kv_scorer_event_purges_total",
    "Workers purged from the index, by cause (restart, gap, cleared)",
    ["cause"],
)
DROPS = Counter(
    "kv_scorer_event_drops_total",
    "KV-event messages or events dropped by a bound or a failure, by reason (ranks: a dp "
    "rank past events.max_ranks_per_worker; event_blocks: an event past "
    "events.max_blocks_per_event; rate: past events.max_events_per_s; internal: applying "
    "it raised)",
    ["reason"],
)
RESTARTS = Counter(
    "kv_scorer_event_subscriber_restarts_total",
    "KV-event subscriber tasks restarted after a failure",
)
SYNCS = Counter(
    "kv_scorer_event_syncs_total",
    "Replay-socket syncs on (re)connection by outcome (ok, unavailable, timeout, error)",
    ["outcome"],
)
SYNC_MESSAGES = Counter(
    "kv_scorer_event_sync_messages_total",
    "Messages read from a replay buffer on (re)connection, by outcome (applied; skipped: "
    "before the buffer's last AllBlocksCleared on a warm start, an earlier history)",
    ["outcome"],
)
CONNECTED = Gauge(
    "kv_scorer_event_streams_connected", "KV-event streams with a live ZMQ connection"
)
_ERR = {k: DECODE_ERRORS.labels(k) for k in ERROR_KINDS}

# Messages handled before yielding to the event loop (bounded time per burst).
BURST = 32
# Messages a subscriber queues behind a sync or a gap's replay before its reader stops
# reading (ZMQ then keeps them, within the SUB's RCVHWM, as before).
_BACKLOG = BURST
# Plain ints: pyzmq's enums cost an enum call per use (getsockopt, `&`).
_EVENTS, _POLLIN, _NOBLOCK = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.NOBLOCK)
# Replay replies a DEALER may queue: vLLM's replay buffer (buffer_steps, 10,000 by
# default, vllm/distributed/kv_events.py ZmqEventPublisher) and its end marker, with room.
_REPLAY_RCVHWM = 20_000
# Replay requests one sync may make to get a whole buffer (see Subscriber._fetch_replay).
_REPLAY_ROUNDS = 20


class Reader:
    """Hands every message of a ZMQ socket to `handle`, in order, from the event loop's
    reader callback on the socket's `zmq.FD`: no task, Future or awaited recv per message
    (pyzmq's asyncio recv costs a Future, its poller bookkeeping, an EVENTS read and call_soon
    hops: most of a lone message's cost, and vLLM publishes one message per engine step).

    ZMQ's FD is edge-triggered in effect: it signals a change, not "messages are queued",
    and any call that processes the socket's commands (a recv, an EVENTS read) may take
    the signal. So a drain reads until the queue is empty: an EVENTS read after a lone
    message, a recv's zmq.Again in a burst (cheaper than EVENTS per message); a drain that
    stops early (BURST messages or 2 ms: a flood must not starve the request path)
    schedules itself with call_soon, as no new signal would come for what is already
    queued. `handle` returns False when it took the message but cannot take more for now
    (its backlog is full): reading stops, ZMQ keeps the rest (its RCVHWM the bound), until
    `resume()`."""

    def __init__(self, sock: zmq.Socket[Any], handle: Callable[[list[bytes]], bool]) -> None:
        # Plain non-blocking calls on the same socket: an asyncio socket's methods return
        # Futures, and pyzmq's own FD reader is never registered (nothing awaits on it).
        self._sock: zmq.Socket[bytes] = zmq.Socket.shadow(sock.underlying)
        self._events: Callable[[int], int] = self._sock.get  # type: ignore[assignment]
        self._handle = handle
        self._loop: asyncio.AbstractEventLoop | None = None
        self._fd = -1
        self._paused = False
        self._soon: asyncio.Handle | None = None
        self._done: asyncio.Future[None] | None = None

    async def run(self) -> None:
        """Read until `close()` (returns) or a socket error (raised); unregisters on exit,
        so the socket may be closed after."""
        loop = asyncio.get_running_loop()
        self._loop = loop
        self._done = done = loop.create_future()
        self._fd = self._sock.FD
        loop.add_reader(self._fd, self._drain)
        self._schedule()  # what was queued before the reader existed raises no signal
        try:
            await done
        finally:
            self.close()

    def close(self) -> None:
        """Stop reading now (synchronously): no `handle` call after this returns."""
        if self._loop is not None and self._fd >= 0:
            self._loop.remove_reader(self._fd)
            self._fd = -1
        if self._soon is not None:
            self._soon.cancel()
            self._soon = None
        if self._done is not None and not self._done.done():
            self._done.set_result(None)

    def resume(self) -> None:
        """Read again after `handle` returned False (its backlog has room again)."""
        if self._paused:
            self._paused = False
            self._schedule()

    def _schedule(self) -> None:
        if self._soon is None and self._fd >= 0 and self._loop is not None:
            self._soon = self._loop.call_soon(self._scheduled)

    def _scheduled(self) -> None:
        self._soon = None
        self._drain()

    def _drain(self) -> None:
        if self._fd < 0:
            return
        events = self._events
        try:
            if self._paused:
                events(_EVENTS)  # clears the FD's signal: no busy loop while paused
                return
            recv = self._sock.recv
            handle = self._handle
            n = 0
            start = time.monotonic()
            while True:
                # Frames (copy=False) say whether more follow: no RCVMORE read per frame.
                try:
                    f = recv(_NOBLOCK, False)
                except zmq.Again:
                    return  # nothing (left): the failed recv read the FD's signal
                frames = [f.bytes]
                while f.more:
                    f = recv(_NOBLOCK, False)
                    frames.append(f.bytes)
                if not handle(frames):
                    self._paused = True
                    return
                n += 1
                # One EVENTS read after a lone message (it reads the FD's signal); in a
                # burst the next recv's zmq.Again ends the drain instead (EVENTS per
                # message would cost more than one exception per burst).
                if n == 1 and not events(_EVENTS) & _POLLIN:
                    return
                if n >= BURST or time.monotonic() - start > 0.002:
                    self._schedule()  # more is queued: the loop's other callbacks first
                    return
        except Exception as e:  # the socket failed (or a handler raised): the caller's
            if self._done is not None and not self._done.done():
                self._done.set_exception(e)
            self.close()  # nothing more is read (or handled) from this reader


@dataclass(slots=True)
class StreamStatus:
    """What a policy needs to know about a worker's event stream."""

    connected: bool = False
    last_event_at: float | None = None  # time.monotonic() of the last applied message
    unrecovered_gap: bool = False  # a gap could not be replayed (worker purged)
    purges: int = 0


@dataclass(slots=True)
class StreamStats:
    """Counters for /debug/index."""

    last_seq: dict[int, int] = field(default_factory=dict)  # per dp_rank
    messages: int = 0
    gaps: int = 0
    replays: dict[str, int] = field(default_factory=dict)
    purges: dict[str, int] = field(default_factory=dict)
    decode_errors: dict[str, int] = field(default_factory=dict)
    drops: dict[str, int] = field(default_factory=dict)  # by reason (see DROPS)
    restarts: int = 0
    syncs: dict[str, int] = field(default_factory=dict)  # by outcome (see SYNCS)
    warm_messages: int = 0  # messages a sync applied for ranks we knew nothing about
    sync_skipped: int = 0  # ...and skipped: before the buffer's last AllBlocksCleared
    bind_error: str | None = None


class Subscriber:
    """Subscribes to one worker's KV events and applies them to the index."""

    def __init__(
        self,
        endpoint: str,
        events: EventsEndpointConfig,
        applier: Applier,
        config: EventsConfig,
        context: zmq.asyncio.Context,
        on_message: Callable[[Message], None] | None = None,
        on_disconnect: Callable[[str], None] | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.events = events
        self.applier = applier
        self.config = config
        self.context = context
        self.on_message = on_message
        # Called with the endpoint when the stream's last ZMQ peer disconnects (evidence
        # for scorer.pool.health; it probes the worker before acting on it).
        self.on_disconnect = on_disconnect
        self.status = StreamStatus()
        self.stats = StreamStats()
        self._logged: set[str] = set()
        self._sub: zmq.asyncio.Socket | None = None
        self._mon: zmq.asyncio.Socket | None = None  # the reading end of _sub's monitor
        self._tasks: list[asyncio.Task[None]] = []
        self._ready = asyncio.Event()
        self.bound_endpoint: str | None = None  # after bind mode: the real address
        self.clock: Callable[[], float] = time.monotonic
        # Token bucket of events per second (one second of burst).
        self._tokens = config.max_events_per_s
        self._tokens_at: float | None = None
        # Handling a message and syncing with the replay socket never interleave.
        self._lock = asyncio.Lock()
        self._syncing: set[asyncio.Task[None]] = set()
        # Messages waiting for the async path (a sync or a gap's replay in progress, or
        # earlier messages waiting): raw frames, or a decoded message that needs a replay.
        # While it is not empty every new message queues behind it (order is the stream's).
        self._backlog: deque[list[bytes] | Message] = deque()
        self._worker: asyncio.Task[None] | None = None
        self._cancelled = False
        # The reader feeding `offer` (our own socket's, or the pool socket's): resumed when
        # the backlog is empty again after a full one stopped it.
        self._reader: Reader | None = None
        self.resume_reader: Callable[[], None] | None = None
        # Per rank: the batch timestamp of the last applied message (tells the engine that
        # sent seq N from a new engine's seq N) and, after a sync, seq → timestamp of what
        # the buffer held: a live message equal to one of them is a duplicate (the SUB
        # buffered it during the sync); one that differs is a new engine's.
        self._last_ts: dict[int, float] = {}
        self._synced: dict[int, dict[int, float]] = {}

    # ---- lifecycle ---------------------------------------------------------------------

    async def start(self) -> None:
        """Open the SUB socket (retrying a failed bind) and start receiving."""
        self._tasks.append(
            asyncio.create_task(self._supervise(), name=f"kv-events {self.endpoint}")
        )
        # Bind mode: wait for the first bind attempt so a caller can read bound_endpoint.
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(5.0):
                await self._ready.wait()

    def cancel(self) -> None:
        """Stop applying now (synchronously: the worker left the pool); `stop()` closes."""
        self._cancelled = True
        if self._reader is not None:
            self._reader.close()  # its callback could run before the task sees the cancel
        self._backlog.clear()
        for t in (*self._syncing, *self._tasks):
            t.cancel()
        if self._worker is not None:
            self._worker.cancel()  # its exit resumes a shared reader its backlog stopped

    async def stop(self) -> None:
        """Cancel every task and wait for them, so no socket of ours (a sync's DEALER
        included) is open when the caller terminates the ZMQ context."""
        try:
            worker = () if self._worker is None else (self._worker,)
            await cancel_and_wait(*self._syncing, *self._tasks, *worker)
        finally:
            self._tasks.clear()
            self._backlog.clear()
            self._close()

    def _close(self) -> None:
        if self._sub is not None:
            if self.status.connected:
                CONNECTED.dec()
            self.status.connected = False
            # Stop the monitor while its reading end is still open, then close that end.
            # Closed first, libzmq's I/O thread blocks for ever sending the next event (a
            # reconnect) to a PAIR with no peer, holding the lock disable_monitor() waits
            # on: the context's I/O stops and so does the scorer (tests/events/
            # test_events_monitor.py).
            with contextlib.suppress(zmq.ZMQError):
                self._sub.disable_monitor()
            if self._mon is not None:
                self._mon.close(linger=0)
                self._mon = None
            self._sub.close(linger=0)
            self._sub = None

    def _open(self) -> tuple[zmq.asyncio.Socket, zmq.asyncio.Socket]:
        sub = self.context.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, 100_000)
        # A frame past the bound disconnects the peer before it is buffered (ZMQ checks the
        # declared length), so one huge frame cannot grow our memory.
        sub.setsockopt(zmq.MAXMSGSIZE, self.config.max_message_bytes)
        sub.setsockopt(zmq.RECONNECT_IVL, max(1, int(self.config.reconnect_interval_s * 1000)))
        sub.setsockopt(zmq.SUBSCRIBE, self.events.topic.encode("utf-8"))
        # The monitor must exist before connect/bind, or the first CONNECTED is missed.
        mon = sub.get_monitor_socket(
            zmq.EVENT_CONNECTED | zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED
        )
        try:
            if self.events.mode == "bind":
                sub.bind(self.events.endpoint)
                last = sub.getsockopt(zmq.LAST_ENDPOINT)
                self.bound_endpoint = last.decode() if isinstance(last, bytes) else str(last)
            else:
                sub.connect(self.events.endpoint)
        except zmq.ZMQError:
            with contextlib.suppress(zmq.ZMQError):
                sub.disable_monitor()
            mon.close(linger=0)
            sub.close(linger=0)
            raise
        return sub, mon

    async def _supervise(self) -> None:
        """Run the receive loop; if it fails, log, count and restart it with backoff (a
        stream must never die silently). The backoff resets once a run lasted a minute."""
        backoff = self.config.restart_backoff_s
        while True:
            began = self.clock()
            try:
                await self._run()
            except asyncio.CancelledError:
                raise
            except Exception:
                RESTARTS.inc()
                self.stats.restarts += 1
                log.exception(
                    "KV-event subscriber for %s failed; restarting in %.1fs",
                    self.endpoint,
                    backoff,
                )
            if self.clock() - began > 60.0:
                backoff = self.config.restart_backoff_s
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 30.0)

    async def _run(self) -> None:
        while True:
            try:
                self._sub, mon = self._open()
                self._mon = mon
                self.stats.bind_error = None
            except zmq.ZMQError as e:
                # Bind errors (address in use, bad address): report and retry; ZMQ itself
                # reconnects connect-mode sockets, so this loop only matters for bind mode.
                self.stats.bind_error = str(e)
                self._log_once("bind", f"cannot open {self.events.endpoint}: {e}")
                self._ready.set()
                await asyncio.sleep(self.config.reconnect_interval_s)
                continue
            self._ready.set()
            monitor = asyncio.create_task(self._monitor(mon))
            receive = asyncio.create_task(self._receive(self._sub))
            try:
                await asyncio.wait({monitor, receive}, return_when=asyncio.FIRST_COMPLETED)
                if receive.done():
                    receive.result()  # a failure goes to the supervisor
            finally:
                # Our own cancel (stop() during a reconnect) must come out of here.
                try:
                    await cancel_and_wait(monitor, receive)
                finally:
                    self._close()
            # The monitor saw the connection drop (connect mode): open a new socket. ZMQ
            # reconnects by itself after a network error but never after a protocol error
            # (e.g. a frame past MAXMSGSIZE), which would leave the stream dead.
            await asyncio.sleep(self.config.reconnect_interval_s)

    async def _monitor(self, mon: zmq.asyncio.Socket) -> None:
        """Track connected/disconnected from ZMQ's socket monitor; returns when a connect-mode
        connection drops."""
        from zmq.utils.monitor import parse_monitor_message

        peers = 0
        # `mon` is closed by _close(), after the monitor is stopped.
        while True:
            msg = parse_monitor_message(await mon.recv_multipart())
            ev = msg["event"]
            before = peers > 0
            if ev in (zmq.EVENT_CONNECTED, zmq.EVENT_ACCEPTED):
                peers += 1
            elif ev == zmq.EVENT_DISCONNECTED:
                peers = max(0, peers - 1)
            now = peers > 0
            if now != before:
                self.status.connected = now
                CONNECTED.inc() if now else CONNECTED.dec()
                if now and self.events.replay_endpoint:
                    t = asyncio.create_task(self._locked_sync())
                    self._syncing.add(t)
                    t.add_done_callback(self._syncing.discard)
                if not now and self.on_disconnect is not None:
                    self.on_disconnect(self.endpoint)
            if ev == zmq.EVENT_DISCONNECTED and self.events.mode != "bind":
                self._log_once("disconnect", f"KV-event stream {self.endpoint} dropped")
                return  # _run opens a new socket

    # ---- receiving ---------------------------------------------------------------------

    async def _receive(self, sub: zmq.asyncio.Socket) -> None:
        self._reader = reader = Reader(sub, self.offer)
        self.resume_reader = reader.resume
        try:
            await reader.run()
        finally:
            if self._reader is reader:
                self._reader = self.resume_reader = None

    def _error(self, e: DecodeError) -> None:
        _ERR.get(e.kind, DECODE_ERRORS.labels(e.kind)).inc()
        de = self.stats.decode_errors
        de[e.kind] = de.get(e.kind, 0) + 1
        self._log_once(e.kind, f"bad KV event from {self.endpoint}: {e}")

    def _log_once(self, kind: str, text: str) -> None:
        if kind not in self._logged:
            self._logged.add(kind)
            log.warning("%s (logged once per kind)", text)

    def _drop(self, reason: str, n: int = 1, detail: str = "") -> None:
        DROPS.labels(reason).inc(n)
        self._count(self.stats.drops, reason, n)
        self._log_once(
            f"drop-{reason}", f"dropped KV events from {self.endpoint}: {reason} {detail}"
        )

    def _within_rate(self, n: int) -> bool:
        """Take `n` events from the token bucket. A message passes when the bucket has room
        for it or is full (so one large message is never starved); the debt it leaves makes
        the average rate the bound."""
        cap = self.config.max_events_per_s
        now = self.clock()
        if self._tokens_at is not None:
            self._tokens = min(cap, self._tokens + (now - self._tokens_at) * cap)
        self._tokens_at = now
        if self._tokens >= n or self._tokens >= cap:
            self._tokens -= n
            return True
        return False

    def offer(self, frames: list[bytes]) -> bool:
        """Take one message from the reader: handled at once when nothing is in progress
        (no sync, no replay, nothing queued), else queued behind what is, for the async
        path (under the lock, in order). Never raises: a message that cannot be read or
        applied is counted and dropped. False: queued, and the backlog is full (the reader
        stops until `resume_reader` is called)."""
        if self._backlog or self._syncing or self._lock.locked():
            return self._queue(frames)
        if self._cancelled:
            return True
        try:
            msg = self._decode(frames)
            if msg is None or self._handle_now(msg):
                return True
        except Exception as e:
            self._internal(e)
            return True
        return self._queue(msg)  # a gap: replayed on the async path, nothing changed yet

    async def handle(self, frames: list[bytes]) -> None:
        """`offer` one message and wait until it (and every message before it) is handled."""
        self.offer(frames)
        while (worker := self._worker) is not None and not worker.done():
            await asyncio.wait({worker})

    def _queue(self, item: list[bytes] | Message) -> bool:
        if self._cancelled:
            return True
        self._backlog.append(item)
        if self._worker is None:
            self._worker = asyncio.get_running_loop().create_task(
                self._work(), name=f"kv-events backlog {self.endpoint}"
            )
        return len(self._backlog) < _BACKLOG

    async def _work(self) -> None:
        """Handle the backlog in order, each message under the lock (a sync waiting for it
        goes between two messages), the loop yielded after BURST messages or 2 ms. A
        message stays at the head while it is handled, so `offer` queues behind it."""
        backlog = self._backlog
        n = 0
        start = time.monotonic()
        try:
            while backlog:
                item = backlog[0]
                try:
                    async with self._lock:
                        msg = self._decode(item) if isinstance(item, list) else item
                        if msg is not None and not self._handle_now(msg):
                            await self._handle_gap(msg)
                except Exception as e:
                    self._internal(e)
                if backlog and backlog[0] is item:
                    backlog.popleft()
                n += 1
                if n >= BURST or time.monotonic() - start > 0.002:
                    await asyncio.sleep(0)
                    n = 0
                    start = time.monotonic()
        finally:
            if self._worker is asyncio.current_task():
                self._worker = None
            if self.resume_reader is not None:
                self.resume_reader()

    def _internal(self, e: Exception) -> None:
        # A bug or an input no check anticipated must cost one message, not the stream.
        self._drop("internal", detail=f"({type(e).__name__}: {str(e)[:200]})")

    def _decode(self, frames: list[bytes]) -> Message | None:
        try:
            return decode_message(frames)
        except DecodeError as e:
            self._error(e)
            return None

    def _handle_now(self, msg: Message) -> bool:
        """Check the sequence and apply `msg` (or drop it: a bound, a duplicate of what a
        sync applied); False, having changed nothing, when a gap must be replayed first
        (`_handle_gap`, which awaits the replay)."""
        rank = msg.batch.dp_rank or 0
        idx = self.applier.index
        if (
            not idx.has_rank(self.endpoint, rank)
            and idx.ranks(self.endpoint) >= self.config.max_ranks_per_worker
        ):
            self._drop("ranks", detail=f"(rank {rank} past {self.config.max_ranks_per_worker})")
            return True
        synced = self._synced.get(rank)
        if synced is not None and synced.get(msg.seq) == msg.batch.ts:
            return True  # the sync saw it already (the SUB buffered it meanwhile)
        last = self.stats.last_seq.get(rank)
        if last is not None and msg.seq > last + 1:
            return False
        if synced is not None:
            del self._synced[rank]
        for err in msg.batch.errors:
            self._error(err)
        if last is not None and msg.seq <= last:
            # The engine restarted (seq starts over at 0): everything we knew is gone.
            self._restarted()
        self._admit(msg, rank)
        return True

    async def _handle_gap(self, msg: Message) -> None:
        """`msg` comes after a gap (`_handle_now` said so, under the same lock hold):
        replay what is missing (or purge the worker), then apply it."""
        rank = msg.batch.dp_rank or 0
        self._synced.pop(rank, None)
        for err in msg.batch.errors:
            self._error(err)
        GAPS.inc()
        self.stats.gaps += 1
        await self._recover(rank, self.stats.last_seq[rank] + 1, msg.seq)
        self._admit(msg, rank)

    def _admit(self, msg: Message, rank: int) -> None:
        """Apply `msg` within the events-per-second bound (past it: dropped, counted)."""
        if not self._within_rate(len(msg.batch.events)):
            self._drop("rate", len(msg.batch.events))
            self.stats.last_seq[rank] = msg.seq  # consumed: not a gap to replay
            return
        self._apply(msg, rank)

    def _apply(self, msg: Message, rank: int) -> None:
        cap = self.config.max_blocks_per_event
        events = msg.batch.events
        cleared = over = False
        for e in events:  # one plain pass (a batch holds one or two events, as a rule)
            if isinstance(e, AllBlocksCleared):
                cleared = True
            elif len(e.block_hashes) > cap:
                over = True
        if over:
            kept = [
                e for e in events if isinstance(e, AllBlocksCleared) or len(e.block_hashes) <= cap
            ]
            self._drop("event_blocks", len(events) - len(kept), f"(more than {cap} blocks)")
            msg.batch.events = kept
        if self.on_message is not None:
            self.on_message(msg)
        self.applier.apply(self.endpoint, msg.batch, rank)
        if cleared:
            PURGES.labels("cleared").inc()
            self._count(self.stats.purges, "cleared")
            self.status.purges += 1
            self.status.unrecovered_gap = False
        self.stats.last_seq[rank] = msg.seq
        self._last_ts[rank] = msg.batch.ts
        self.stats.messages += 1
        self.status.last_event_at = time.monotonic()

    def _restarted(self) -> None:
        """The publisher is a new engine: everything the old one held is gone."""
        self._purge("restart")
        self.status.unrecovered_gap = False
        self.stats.last_seq.clear()
        self._last_ts.clear()
        self._synced.clear()

    async def _locked_sync(self) -> None:
        try:
            async with self._lock:
                await self._sync()
        except Exception:
            log.exception("KV-event replay sync for %s failed", self.endpoint)

    async def _sync(self) -> None:
        """On every (re)connection: read everything the worker's replay socket keeps.

        * warm start: a rank we know nothing about gets the buffered messages applied from
          its last `AllBlocksCleared` on (what came before it is gone from the engine's
          cache: an earlier run's history, e.g. before `/reset_prefix_cache`; vLLM never
          empties its replay buffer), so a scorer started next to a warm fleet knows what
          the buffers cover at once and one started after a reset starts clean;
        * restart: the buffer is empty while we applied messages before, or it has no
          message with our last seq, or that message's batch timestamp differs from the one
          we applied — a new engine: purge now, then apply its buffer (a restarted engine
          that has not published yet no longer keeps the dead engine's blocks);
        * reconnect: messages after our last seq are applied; if the buffer no longer
          reaches back to it, the worker is purged first (gap) and rebuilt from the buffer.

        A worker we already follow is asked from our last seq (the lowest over its ranks),
        not from 0: vLLM's replay socket sends every buffered message with seq >= the one
        asked (`ZmqEventPublisher._service_replay`, vllm/distributed/kv_events.py), so the
        reply is what we missed plus the message at our last seq (its timestamp tells a
        restart), and the lock live messages wait on is held for that much only. Only when
        that reply shows a restart (empty, or our last seq with another batch) is the whole
        buffer asked for, to rebuild from the new engine's history.

        The buffer (up to vLLM's 10,000 batches, each with the token ids of its blocks) is
        decoded in a worker thread and applied in bursts, so a sync never holds the event
        loop: a stalled loop let speculative entries expire before the BlockStored
        confirming them was read (docs/policy.md, "lost events").
        """
        known = self.stats.last_seq
        start = min(known.values()) if known else 0
        outcome, raw = await self._fetch_replay(start)
        msgs = await self._decode_sync(raw) if outcome == "ok" else []
        if outcome == "ok" and start > 0 and self._restart_in(msgs):
            outcome, raw = await self._fetch_replay(0)
            msgs = await self._decode_sync(raw) if outcome == "ok" else []
        if outcome == "ok":
            await self._apply_sync(msgs)
        # Counted once applied: a count in /debug/index says the sync is over.
        SYNCS.labels(outcome).inc()
        self._count(self.stats.syncs, outcome)

    async def _decode_sync(self, raw: list[tuple[str | None, int, bytes]]) -> list[Message]:
        """A replay reply's messages, decoded in a worker thread (errors counted)."""
        msgs: list[Message] = []
        for m in await asyncio.to_thread(_decode_replies, raw):
            if isinstance(m, DecodeError):
                self._error(m)
            else:
                msgs.append(m)
        return msgs

    @staticmethod
    def _by_rank(msgs: list[Message]) -> dict[int, list[Message]]:
        by_rank: dict[int, list[Message]] = {}
        for m in msgs:
            by_rank.setdefault(m.batch.dp_rank or 0, []).append(m)
        for ms in by_rank.values():
            ms.sort(key=lambda m: m.seq)
        return by_rank

    def _restarted_rank(self, rank: int, ms: list[Message]) -> bool:
        """A rank's replayed messages (sorted) come from a new engine: the message with
        our last seq is another batch, or the buffer ends before our last seq."""
        last = self.stats.last_seq.get(rank)
        if last is None:
            return False
        same = next((m for m in ms if m.seq == last), None)
        if same is not None:
            return same.batch.ts != self._last_ts.get(rank)
        return ms[-1].seq < last

    def _restart_in(self, msgs: list[Message]) -> bool:
        """A reply asked from our last seq shows a new engine (nothing, not even the
        message at our last seq, or that seq holding another batch)."""
        if not msgs:
            return True
        return any(self._restarted_rank(r, ms) for r, ms in self._by_rank(msgs).items())

    async def _apply_sync(self, msgs: list[Message]) -> None:
        """Apply a replay reply's (decoded) messages as `_sync` says."""
        known = self.stats.last_seq
        if not msgs:
            if known:
                self._restarted()
            return
        by_rank = self._by_rank(msgs)
        idx = self.applier.index
        applied = 0
        for rank, ms in by_rank.items():
            if (
                not idx.has_rank(self.endpoint, rank)
                and idx.ranks(self.endpoint) >= self.config.max_ranks_per_worker
            ):
                self._drop("ranks", len(ms))
                continue
            last = known.get(rank)
            if last is not None:
                if self._restarted_rank(rank, ms):
                    self._restarted()
                    last = None
                elif ms[0].seq > last + 1:
                    self._purge("gap")
                    known.pop(rank, None)
                    last = None
            if last is None:
                todo = _since_last_clear(ms)
                skipped = len(ms) - len(todo)
                if skipped:
                    SYNC_MESSAGES.labels("skipped").inc(skipped)
                    self.stats.sync_skipped += skipped
                self.stats.warm_messages += len(todo)
            else:
                todo = [m for m in ms if m.seq > last]
            for m in todo:
                for err in m.batch.errors:
                    self._error(err)
                self._apply(m, rank)
                applied += 1
                if applied % BURST == 0:
                    await asyncio.sleep(0)  # requests run between bursts
            if todo:
                SYNC_MESSAGES.labels("applied").inc(len(todo))
            # Skipped to the end (the buffer ends with a clear): the stream is at its last
            # message all the same, so the next live one is not taken for a gap.
            if ms[-1].seq > self.stats.last_seq.get(rank, -1):
                self.stats.last_seq[rank] = ms[-1].seq
                self._last_ts[rank] = ms[-1].batch.ts
            self._synced[rank] = {m.seq: m.batch.ts for m in ms}

    async def _fetch_replay(self, start: int) -> tuple[str, list[tuple[str | None, int, bytes]]]:
        """Every message the replay socket keeps from `start` (bounded by its buffer), as
        (topic, seq, payload) sorted by seq and still encoded (decoding is the caller's,
        off the loop).

        vLLM's ROUTER sends the whole buffer at once and drops what is past its send HWM
        (1,000 messages by default) without a word, the end marker too: a long buffer
        arrives with holes, or ends in silence. So the fetch is repeated from the first
        missing seq until a reply is whole (contiguous up to the end marker); a round that
        brings nothing new ends it ("timeout")."""
        if not self.events.replay_endpoint:
            return "unavailable", []
        got: dict[int, tuple[str | None, bytes]] = {}
        want = start
        for _ in range(_REPLAY_ROUNDS):
            outcome, ended, part = await self._fetch_round(want)
            if outcome != "ok":
                return outcome, []
            new = [q for q in part if q not in got]
            got.update(part)
            if not got:
                return ("ok" if ended else "timeout"), []
            # The first missing seq after the earliest one we hold (the buffer's first).
            first = min(got)
            hole = first
            while hole in got:
                hole += 1
            if ended and hole > max(got):
                return "ok", [(got[q][0], q, got[q][1]) for q in sorted(got)]
            if not new:
                return "timeout", []
            want = hole
        return "timeout", []

    async def _fetch_round(
        self, start: int
    ) -> tuple[str, bool, dict[int, tuple[str | None, bytes]]]:
        """One replay request from `start`: (outcome, end marker seen, seq → (topic,
        payload)). Silence for replay_timeout_s ends the round without the marker."""
        assert self.events.replay_endpoint
        dealer = self.context.socket(zmq.DEALER)  # a fresh one: no late reply of a round before
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.MAXMSGSIZE, self.config.max_message_bytes)
        # Queue the whole reply in ZMQ's I/O thread while the loop is busy (bounded: the
        # HWM x events.max_message_bytes), so fewer replies back up to the sender's HWM.
        dealer.setsockopt(zmq.RCVHWM, _REPLAY_RCVHWM)
        out: dict[int, tuple[str | None, bytes]] = {}
        try:
            dealer.connect(self.events.replay_endpoint)
            await dealer.send_multipart([b"", start.to_bytes(8, "big")])
            while len(out) < _REPLAY_RCVHWM:
                try:
                    async with asyncio.timeout(self.config.replay_timeout_s):
                        frames = await dealer.recv_multipart()
                except TimeoutError:
                    return "ok", False, out
                try:
                    topic, seq_b, payload = split_replay_reply(frames)
                    if seq_b == END_SEQ:
                        return "ok", True, out
                    seq = decode_seq(seq_b)
                except DecodeError as e:
                    self._error(e)
                    continue
                if seq >= start:
                    out[seq] = (topic, payload)
                if len(out) % BURST == 0:
                    # A ready message is returned without yielding: the loop stays ours.
                    await asyncio.sleep(0)
            return "ok", False, out
        except zmq.ZMQError as e:
            self._log_once("replay", f"replay from {self.events.replay_endpoint} failed: {e}")
            return "error", False, {}
        finally:
            dealer.close(linger=0)

    def _purge(self, cause: str) -> None:
        self.applier.index.purge(self.endpoint)
        PURGES.labels(cause).inc()
        self._count(self.stats.purges, cause)
        self.status.purges += 1

    @staticmethod
    def _count(d: dict[str, int], key: str, n: int = 1) -> None:
        d[key] = d.get(key, 0) + n

    async def _recover(self, rank: int, start: int, until: int) -> None:
        """Replay [start, until) from the worker's replay endpoint, or purge the worker."""
        outcome = await self._replay(rank, start, until)
        REPLAYS.labels(outcome).inc()
        self._count(self.stats.replays, outcome)
        if outcome != "ok":
            self._purge("gap")
            self.status.unrecovered_gap = True
            self.stats.last_seq.pop(rank, None)

    async def _replay(self, rank: int, start: int, until: int) -> str:
        """Apply [start, until) from the replay buffer: fetched as a sync fetches (again
        from the first missing seq when the ROUTER cut its reply, instead of a purge),
        decoded off the loop, applied in bursts."""
        if not self.events.replay_endpoint:
            return "unavailable"
        outcome, raw = await self._fetch_replay(start)
        if outcome != "ok":
            return outcome
        # Contiguous from the buffer's first seq >= start: it must reach back to `start`
        # and on to the live message that showed the gap.
        if not raw or raw[0][1] != start or raw[-1][1] < until - 1:
            return "too_old"
        need = [r for r in raw if r[1] < until]
        for i, m in enumerate(await asyncio.to_thread(_decode_replies, need)):
            if isinstance(m, DecodeError):
                self._error(m)
                return "error"
            for err in m.batch.errors:
                self._error(err)
            self._apply(m, rank)
            if (i + 1) % BURST == 0:
                await asyncio.sleep(0)  # a long gap is applied in bursts, as live
        return "ok"


def _decode_replies(raw: list[tuple[str | None, int, bytes]]) -> list[Message | DecodeError]:
    """Decode a replay's payloads (runs in a worker thread: no shared state)."""
    out: list[Message | DecodeError] = []
    for topic, seq, payload in raw:
        try:
            out.append(Message(topic or "", seq, decode_payload(payload)))
        except DecodeError as e:
            out.append(e)
    return out


def _since_last_clear(ms: list[Message]) -> list[Message]:
    """The messages (sorted by seq) after the last `AllBlocksCleared`; the message holding
    it keeps only the events that follow it. All of them when there is none."""
    for i in range(len(ms) - 1, -1, -1):
        events = ms[i].batch.events
        cut = next(
            (j for j in range(len(events) - 1, -1, -1) if isinstance(events[j], AllBlocksCleared)),
            None,
        )
        if cut is None:
            continue
        rest = events[cut + 1 :]
        if not rest:
            return ms[i + 1 :]
        b = ms[i].batch
        head = Message(ms[i].topic, ms[i].seq, EventBatch(b.ts, rest, b.dp_rank, b.errors))
        return [head, *ms[i + 1 :]]
    return ms
