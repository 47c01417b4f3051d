"""One ZMQ SUB socket for the whole pool: engines connect to us and name themselves.

llm-d's convention (llm-d `deploy/config/sim-epp-kvcache-config.yaml`: `zmqEndpoint:
"tcp://*:5557"`, `topicFilter: "kv@"`; engines publish with topic
`kv@<pod-ip>:<port>@<model>`): kv-scorer binds `events.bind` (e.g. `tcp://*:5557`), every
vLLM pod connects to the picker's Service with

    --kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq",
      "endpoint": "tcp://kv-scorer:5557", "topic": "kv@$(POD_IP):8000@MODEL"}'

and the topic says which worker (`ip:port`) the events belong to. A topic without a port
(`kv@<ip>@<model>`, llm-d's older form) names the pool's only worker on that IP.

Each known worker gets a `Subscriber` without a socket of its own (registered in
EventIngest, so `status()`, /debug/index and the readiness gate see it): its `handle()`
does the sequence tracking, gap replay (from the worker's `events.replay_endpoint`, i.e.
`tcp://<pod-ip>:<events_replay_port>` under discovery) and purge-on-restart, per topic.
A message whose topic names no worker yet is held (per topic, bounded in count, topics
and bytes) for `events.unknown_topic_hold_s`, since its pod may be discovered a moment
later, then counted and dropped. Workers with their own connect/bind `events` keep them.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio
from aiohttp import web
from prometheus_client import Counter, Gauge

from scorer.config import Config, EventsEndpointConfig
from scorer.events.ingest import EventIngest
from scorer.events.subscriber import Reader, Subscriber
from scorer.pool.workers import Pool, PoolChange, Worker, normalize_endpoint
from scorer.tasks import cancel_and_wait

log = logging.getLogger(__name__)

TOPIC_PREFIX = b"kv@"

POOL_MESSAGES = Counter(
    "kv_scorer_pool_socket_messages_total",
    "Messages on the pool's event socket, by outcome (applied, held, dropped_unknown, "
    "dropped_hold_full, bad_topic)",
    ["outcome"],
)
POOL_PEERS = Gauge("kv_scorer_pool_socket_peers", "Engines connected to the pool's event socket")
HELD_TOPICS = Gauge("kv_scorer_pool_socket_held_topics", "Unknown topics with held messages")
_OUT = {
    k: POOL_MESSAGES.labels(k)
    for k in ("applied", "held", "dropped_unknown", "dropped_hold_full", "bad_topic")
}


def topic_endpoint(topic: bytes) -> tuple[str, bool] | None:
    """`kv@10.0.0.5:8000@Qwen/Qwen3-8B` → ("10.0.0.5:8000", True); `kv@10.0.0.5@m` →
    ("10.0.0.5", False) (IP only); None when the topic is not of that shape."""
    if not topic.startswith(TOPIC_PREFIX):
        return None
    try:
        rest = topic[len(TOPIC_PREFIX) :].decode("utf-8")
    except UnicodeDecodeError:
        return None
    addr, sep, model = rest.partition("@")
    if not sep or not model or not addr:
        return None
    try:
        if addr.startswith("[") or addr.count(":") == 1:
            return normalize_endpoint(addr), True
        ipaddress.ip_address(addr)
        return (f"[{addr}]" if ":" in addr else addr), False
    except ValueError:
        return None


def served_by_pool_socket(worker: Worker) -> bool:
    """A worker without its own connect/bind events config publishes to the pool socket."""
    ev = worker.config.events
    return ev is None or ev.mode == "pool"


@dataclass
class _Held:
    first_at: float
    frames: deque[list[bytes]] = field(default_factory=deque)
    size: int = 0


class PoolEventSocket:
    """App component: binds `events.bind` and routes each message to its worker's stream."""

    def __init__(
        self,
        config: Config,
        pool: Pool,
        ingest: EventIngest,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        assert config.events.bind, "PoolEventSocket needs events.bind"
        self.config = config
        self.pool = pool
        self.ingest = ingest
        self.clock = clock
        self.bind = config.events.bind
        self.streams: dict[str, Subscriber] = {}  # endpoint → its topic stream
        self.held: dict[str, _Held] = {}  # topic → messages waiting for their worker
        self.held_bytes = 0
        self.counts: dict[str, int] = {k: 0 for k in _OUT}
        self.bound_endpoint: str | None = None
        self.bind_error: str | None = None
        self._context: zmq.asyncio.Context | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._sub: zmq.asyncio.Socket | None = None
        self._mon: zmq.asyncio.Socket | None = None  # the reading end of _sub's monitor
        self._peers = 0
        self._reader: Reader | None = None
        self._draining: set[str] = set()
        self._drains: set[asyncio.Task[None]] = set()
        pool.subscribe(self._pool_changed)

    # ---- lifecycle ---------------------------------------------------------------------

    async def start(self) -> None:
        """Bind the socket (a bad address stops start-up, naming the field)."""
        self._context = zmq.asyncio.Context()
        sub = self._context.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, 100_000)
        sub.setsockopt(zmq.SUBSCRIBE, TOPIC_PREFIX)
        mon = sub.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        try:
            sub.bind(self.bind)
        except zmq.ZMQError as e:
            sub.disable_monitor()
            mon.close(linger=0)
            sub.close(linger=0)
            self._context.term()
            self._context = None
            raise RuntimeError(f"events.bind: cannot bind {self.bind}: {e}") from e
        self._sub, self._mon = sub, mon
        last = sub.getsockopt(zmq.LAST_ENDPOINT)
        self.bound_endpoint = last.decode() if isinstance(last, bytes) else str(last)
        for w in list(self.pool):
            self._attach(w)
        self._tasks = [
            asyncio.create_task(self._receive(sub), name="kv-events pool socket"),
            asyncio.create_task(self._monitor(mon), name="kv-events pool monitor"),
            asyncio.create_task(self._sweeper(), name="kv-events pool hold sweep"),
        ]
        log.warning("KV events: pool socket bound at %s", self.bound_endpoint)

    async def stop(self) -> None:
        await cancel_and_wait(*self._tasks, *self._drains)
        self._tasks.clear()
        self.held.clear()
        self.held_bytes = 0
        HELD_TOPICS.set(0)
        if self._sub is not None:
            # Stop the monitor while its reading end is open, then close that end: see
            # Subscriber._close (a monitor event sent to a closed reader blocks libzmq's
            # I/O thread for ever, and with it every socket of the context).
            with contextlib.suppress(zmq.ZMQError):
                self._sub.disable_monitor()
            if self._mon is not None:
                self._mon.close(linger=0)
            self._sub.close(linger=0)
            self._sub = self._mon = None
        if self._context is not None:
            self._context.destroy(linger=0)
            self._context = None

    # ---- workers -----------------------------------------------------------------------

    def _attach(self, w: Worker) -> None:
        if not served_by_pool_socket(w) or self._context is None:
            return
        ev = w.config.events or EventsEndpointConfig(endpoint=self.bind, mode="pool")
        sub = Subscriber(w.endpoint, ev, self.ingest.applier, self.config.events, self._context)
        # A stream whose backlog filled stops the shared reader; its drain resumes it.
        sub.resume_reader = self._resume_reader
        self.streams[w.endpoint] = sub
        # Registered where policies, /debug/index and readiness look for streams.
        self.ingest.subscribers[w.endpoint] = sub

    def _pool_changed(self, change: PoolChange) -> None:
        ep = change.worker.endpoint
        self.streams.pop(ep, None)  # EventIngest closes it and purges the index
        if change.change == "added":
            self._attach(change.worker)
            # Whatever its pod sent before it was discovered applies now, in order.
            for topic in [t for t in self.held if self._resolve(t) == ep]:
                if topic not in self._draining:
                    self._draining.add(topic)
                    task = asyncio.get_running_loop().create_task(self._drain(topic))
                    self._drains.add(task)
                    task.add_done_callback(self._drains.discard)

    async def _drain(self, topic: str) -> None:
        """Apply a topic's held messages in order; live ones queue behind them meanwhile."""
        try:
            held = self.held.get(topic)
            while held is not None and held.frames:
                frames = held.frames.popleft()
                size = sum(len(f) for f in frames)
                held.size -= size
                self.held_bytes -= size
                await self._deliver(topic, frames)
        finally:
            self._draining.discard(topic)
            if topic in self.held and not self.held[topic].frames:
                del self.held[topic]
            HELD_TOPICS.set(len(self.held))

    def _resolve(self, topic: str) -> str | None:
        """The endpoint of a known worker the topic names, or None."""
        parsed = topic_endpoint(topic.encode("utf-8", "surrogateescape"))
        if parsed is None:
            return None
        addr, with_port = parsed
        if with_port:
            return addr if addr in self.streams else None
        on_ip = [ep for ep in self.streams if ep.rsplit(":", 1)[0] == addr]
        return on_ip[0] if len(on_ip) == 1 else None

    # ---- receiving ---------------------------------------------------------------------

    async def _receive(self, sock: zmq.asyncio.Socket) -> None:
        self._reader = Reader(sock, self._offer_safely)
        try:
            await self._reader.run()
        finally:
            self._reader = None
            sock.close(linger=0)

    def _resume_reader(self) -> None:
        if self._reader is not None:
            self._reader.resume()

    def _offer_safely(self, frames: list[bytes]) -> bool:
        try:
            return self.offer(frames)
        except Exception:  # the event path never dies on one message
            log.exception("KV event from the pool socket failed to apply")
            return True

    def _count(self, outcome: str, n: int = 1) -> None:
        _OUT[outcome].inc(n)
        self.counts[outcome] += n

    def offer(self, frames: list[bytes]) -> bool:
        """Route one `[topic, seq, payload]` message to its worker's stream (`Subscriber.
        offer`: handled now, or queued in order), or hold it. False: that stream's backlog
        is full, stop reading until it calls `_resume_reader`."""
        topic_b = frames[0] if frames else b""
        parsed = topic_endpoint(topic_b)
        if parsed is None or len(frames) != 3:
            self._count("bad_topic")
            return True
        topic = topic_b.decode("utf-8")
        if topic in self.held:  # older messages of this topic are still waiting: queue
            self._hold(topic, frames)
            return True
        ep = self._resolve(topic)
        sub = self.streams.get(ep) if ep is not None else None
        if sub is None:
            self._hold(topic, frames)
            return True
        sub.status.connected = True  # the engine reached us (connections are not per worker)
        self._count("applied")
        return sub.offer(frames)

    async def handle(self, frames: list[bytes]) -> None:
        """Route one `[topic, seq, payload]` message to its worker's stream, or hold it;
        returns once it is handled (tests; the reader uses `offer`)."""
        topic_b = frames[0] if frames else b""
        parsed = topic_endpoint(topic_b)
        if parsed is None or len(frames) != 3:
            self._count("bad_topic")
            return
        topic = topic_b.decode("utf-8")
        if topic in self.held:  # older messages of this topic are still waiting: queue
            self._hold(topic, frames)
            return
        if not await self._deliver(topic, frames):
            self._hold(topic, frames)

    async def _deliver(self, topic: str, frames: list[bytes]) -> bool:
        ep = self._resolve(topic)
        sub = self.streams.get(ep) if ep is not None else None
        if sub is None:
            return False
        sub.status.connected = True  # the engine reached us (connections are not per worker)
        await sub.handle(frames)
        self._count("applied")
        return True

    def _hold(self, topic: str, frames: list[bytes]) -> None:
        ev = self.config.events
        size = sum(len(f) for f in frames)
        held = self.held.get(topic)
        if held is None:
            if len(self.held) >= ev.hold_max_topics:
                self._count("dropped_hold_full")
                return
            held = self.held[topic] = _Held(self.clock())
            HELD_TOPICS.set(len(self.held))
        if len(held.frames) >= ev.hold_max_messages or self.held_bytes + size > ev.hold_max_bytes:
            self._count("dropped_hold_full")
            return
        held.frames.append(frames)
        held.size += size
        self.held_bytes += size
        self._count("held")

    def sweep(self) -> int:
        """Drop held messages older than `events.unknown_topic_hold_s`; returns how many."""
        limit = self.clock() - self.config.events.unknown_topic_hold_s
        dropped = 0
        expired = [t for t, h in self.held.items() if h.first_at <= limit]
        for topic in [t for t in expired if t not in self._draining]:
            held = self.held.pop(topic)
            self.held_bytes -= held.size
            dropped += len(held.frames)
            log.warning(
                "KV events: dropped %d message(s) from topic %r: no worker with that address",
                len(held.frames),
                topic,
            )
        if dropped:
            self._count("dropped_unknown", dropped)
            HELD_TOPICS.set(len(self.held))
        return dropped

    async def _sweeper(self) -> None:
        period = max(0.05, min(1.0, self.config.events.unknown_topic_hold_s / 4))
        while True:
            await asyncio.sleep(period)
            self.sweep()

    async def _monitor(self, mon: zmq.asyncio.Socket) -> None:
        from zmq.utils.monitor import parse_monitor_message

        # `mon` is closed by stop(), after the monitor is stopped.
        while True:
            msg = parse_monitor_message(await mon.recv_multipart())
            if msg["event"] == zmq.EVENT_ACCEPTED:
                self._peers += 1
            elif msg["event"] == zmq.EVENT_DISCONNECTED:
                self._peers = max(0, self._peers - 1)
            POOL_PEERS.set(self._peers)

    # ---- admin -------------------------------------------------------------------------

    def routes(self) -> list[tuple[str, str, Callable[[web.Request], Any]]]:
        """`GET /debug/events/pool`: the socket, its peers, topics held and counts."""
        return [("GET", "/debug/events/pool", self._debug)]

    def report(self) -> dict[str, Any]:
        return {
            "bind": self.bind,
            "bound_endpoint": self.bound_endpoint,
            "peers": self._peers,
            "workers": sorted(self.streams),
            "held": {t: len(h.frames) for t, h in self.held.items()},
            "held_bytes": self.held_bytes,
            "messages": dict(self.counts),
        }

    async def _debug(self, request: web.Request) -> web.Response:
        return web.json_response(self.report())
