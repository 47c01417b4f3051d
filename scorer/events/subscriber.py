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
bursts (`await asyncio.sleep(0)` between them) so request handling is never starved.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

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
    Message,
    decode_message,
    decode_payload,
    decode_seq,
    split_replay_reply,
)

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
CONNECTED = Gauge(
    "kv_scorer_event_streams_connected", "KV-event streams with a live ZMQ connection"
)
_ERR = {k: DECODE_ERRORS.labels(k) for k in ERROR_KINDS}

# Messages handled before yielding to the event loop (bounded time per burst).
BURST = 32


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
        self._tasks: list[asyncio.Task[None]] = []
        self._ready = asyncio.Event()
        self.bound_endpoint: str | None = None  # after bind mode: the real address

    # ---- lifecycle ---------------------------------------------------------------------

    async def start(self) -> None:
        """Open the SUB socket (retrying a failed bind) and start receiving."""
        self._tasks.append(asyncio.create_task(self._run(), name=f"kv-events {self.endpoint}"))
        # Bind mode: wait for the first bind attempt so a caller can read bound_endpoint.
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._ready.wait(), 5.0)

    def cancel(self) -> None:
        """Stop applying now (synchronously: the worker left the pool); `stop()` closes."""
        for t in self._tasks:
            t.cancel()

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._tasks.clear()
        self._close()

    def _close(self) -> None:
        if self._sub is not None:
            if self.status.connected:
                CONNECTED.dec()
            self.status.connected = False
            with contextlib.suppress(zmq.ZMQError):
                self._sub.disable_monitor()
            self._sub.close(linger=0)
            self._sub = None

    def _open(self) -> tuple[zmq.asyncio.Socket, zmq.asyncio.Socket]:
        sub = self.context.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, 100_000)
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

    async def _run(self) -> None:
        while True:
            try:
                self._sub, mon = self._open()
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
            try:
                await self._receive(self._sub)
            finally:
                monitor.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await monitor
                self._close()

    async def _monitor(self, mon: zmq.asyncio.Socket) -> None:
        """Track connected/disconnected from ZMQ's socket monitor."""
        from zmq.utils.monitor import parse_monitor_message

        peers = 0
        try:
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
                    if not now and self.on_disconnect is not None:
                        self.on_disconnect(self.endpoint)
        finally:
            mon.close(linger=0)

    # ---- receiving ---------------------------------------------------------------------

    async def _receive(self, sub: zmq.asyncio.Socket) -> None:
        n = 0
        slice_start = time.monotonic()
        while True:
            frames = await sub.recv_multipart()
            await self.handle(frames)
            n += 1
            if n >= BURST or time.monotonic() - slice_start > 0.002:
                # A flood of events must not starve the request path on the same loop.
                await asyncio.sleep(0)
                n = 0
                slice_start = time.monotonic()

    def _error(self, e: DecodeError) -> None:
        _ERR.get(e.kind, DECODE_ERRORS.labels(e.kind)).inc()
        de = self.stats.decode_errors
        de[e.kind] = de.get(e.kind, 0) + 1
        self._log_once(e.kind, f"bad KV event from {self.endpoint}: {e}")

    def _log_once(self, kind: str, text: str) -> None:
        if kind not in self._logged:
            self._logged.add(kind)
            log.warning("%s (logged once per kind)", text)

    async def handle(self, frames: list[bytes]) -> None:
        """Decode, check the sequence (replay / purge as needed) and apply one message."""
        try:
            msg = decode_message(frames)
        except DecodeError as e:
            self._error(e)
            return
        for err in msg.batch.errors:
            self._error(err)
        rank = msg.batch.dp_rank or 0
        last = self.stats.last_seq.get(rank)
        if last is not None:
            if msg.seq <= last:
                # The engine restarted (seq starts over at 0): everything we knew is gone.
                self._purge("restart")
                self.status.unrecovered_gap = False
                self.stats.last_seq.clear()
            elif msg.seq > last + 1:
                GAPS.inc()
                self.stats.gaps += 1
                await self._recover(rank, last + 1, msg.seq)
        self._apply(msg, rank)

    def _apply(self, msg: Message, rank: int) -> None:
        if self.on_message is not None:
            self.on_message(msg)
        self.applier.apply(self.endpoint, msg.batch, rank)
        if any(isinstance(e, AllBlocksCleared) for e in msg.batch.events):
            PURGES.labels("cleared").inc()
            self._count(self.stats.purges, "cleared")
            self.status.purges += 1
            self.status.unrecovered_gap = False
        self.stats.last_seq[rank] = msg.seq
        self.stats.messages += 1
        self.status.last_event_at = time.monotonic()

    def _purge(self, cause: str) -> None:
        self.applier.index.purge(self.endpoint)
        PURGES.labels(cause).inc()
        self._count(self.stats.purges, cause)
        self.status.purges += 1

    @staticmethod
    def _count(d: dict[str, int], key: str) -> None:
        d[key] = d.get(key, 0) + 1

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
        if not self.events.replay_endpoint:
            return "unavailable"
        dealer = self.context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        timeout = self.config.replay_timeout_s
        expect = start
        try:
            dealer.connect(self.events.replay_endpoint)
            await dealer.send_multipart([b"", start.to_bytes(8, "big")])
            while True:
                try:
                    frames = await asyncio.wait_for(dealer.recv_multipart(), timeout)
                except TimeoutError:
                    return "timeout"
                try:
                    topic, seq_b, payload = split_replay_reply(frames)
                    if seq_b == END_SEQ:
                        return "ok" if expect >= until else "too_old"
                    seq = decode_seq(seq_b)
                except DecodeError as e:
                    self._error(e)
                    return "error"
                if seq < expect:
                    continue  # already applied
                if seq > expect:
                    return "too_old"  # the buffer no longer reaches back to `start`
                if seq >= until:
                    return "ok"  # the live stream carries the rest
                try:
                    batch = decode_payload(payload)
                except DecodeError as e:
                    self._error(e)
                    return "error"
                for err in batch.errors:
                    self._error(err)
                self._apply(Message(topic or "", seq, batch), rank)
                expect = seq + 1
        except zmq.ZMQError as e:
            self._log_once("replay", f"replay from {self.events.replay_endpoint} failed: {e}")
            return "error"
        finally:
            dealer.close(linger=0)
