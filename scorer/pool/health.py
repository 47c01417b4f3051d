"""Worker health from evidence: eject a worker that refuses connections, readmit it when
it answers again.

Evidence is what other parts saw fail on the worker itself, reported through
`Pool.report(endpoint, kind, detail)`:

- `request_failed`: Envoy answered 502/503 for a request routed to it (its local reply when
  the upstream connection is refused or reset before headers) — the director's completion
  hook (`HealthMonitor.on_completion`), or, with the lean envoy.yaml (response headers not
  sent), Envoy's access log of upstream failures (scorer.extproc.accesslog);
- `metrics_refused`: its metrics endpoint refused or reset the TCP connection (a slow or
  timed-out scrape is NOT evidence: a scrape outage of the whole fleet ejects nobody) —
  scorer.pool.scrape;
- `events_dropped`: its KV-event stream's ZMQ connection went down — scorer.events.

One piece of evidence is not enough on its own (a metrics port can fail while the serving
port is fine, and a publisher can restart without its server): it triggers one
confirmation probe of the serving endpoint, off the request path. A probe that fails
(refused, reset, timed out, non-2xx for the HTTP probe) ejects the worker: it gets no new
requests, its index entries and in-flight accounting are dropped. An ejected worker is
probed with backoff (`pool.health.probe_interval_s`, doubling up to
`probe_max_interval_s`) and readmitted when a probe succeeds; it starts with an empty
index and fills again from its events.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Protocol

import aiohttp
from prometheus_client import Counter, Gauge

from scorer.config import Config, HealthConfig
from scorer.pool.workers import Pool, PoolChange, Worker
from scorer.tasks import cancel_and_wait

if TYPE_CHECKING:
    from scorer.director import Completion

log = logging.getLogger(__name__)

REQUEST_FAILED = "request_failed"
METRICS_REFUSED = "metrics_refused"
EVENTS_DROPPED = "events_dropped"
EVIDENCE_KINDS = (REQUEST_FAILED, METRICS_REFUSED, EVENTS_DROPPED)
# Statuses Envoy answers itself when the upstream connection fails (503: refused or reset
# before headers, "upstream connect error"; 502: a protocol error).
UPSTREAM_FAILED = frozenset((502, 503))

EJECTIONS = Counter(
    "kv_scorer_worker_ejections",
    "Workers taken out of rotation, by the evidence that ejected them "
    "(request_failed, metrics_refused, events_dropped)",
    ["reason"],
)
EVIDENCE = Counter(
    "kv_scorer_worker_evidence",
    "Failure evidence reported per worker by kind and outcome (ejected: the probe "
    "confirmed it; dismissed: the worker answered; ignored: already ejected or probing)",
    ["kind", "outcome"],
)
PROBES = Counter(
    "kv_scorer_worker_probes", "Health probes of workers by result (ok, failed)", ["result"]
)
READMISSIONS = Counter(
    "kv_scorer_worker_readmissions", "Ejected workers readmitted after a successful probe"
)
HEALTHY = Gauge("kv_scorer_healthy_workers", "Workers in rotation (not ejected)")
EJECTED = Gauge("kv_scorer_worker_ejected", "1 while the worker is out of rotation", ["endpoint"])


class Index(Protocol):
    """What ejection needs of the block index (scorer.index.BlockIndex)."""

    def purge(self, endpoint: str) -> None: ...


Probe = Callable[[Worker], Awaitable[str | None]]


def _host_port(endpoint: str) -> tuple[str, int]:
    host, _, port = endpoint.rpartition(":")
    return host.strip("[]"), int(port)


class HealthMonitor:
    """App component: confirms evidence, ejects, probes with backoff, readmits."""

    def __init__(
        self,
        config: Config,
        pool: Pool,
        index: Index | None = None,
        probe: Probe | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config: HealthConfig = config.pool.health
        self.pool = pool
        self.index = index
        self.clock = clock
        self._probe_fn: Probe = probe if probe is not None else self.probe
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._session: aiohttp.ClientSession | None = None
        self._running = False
        # Set (and replaced) on every health change: eject, readmit, dismissed evidence.
        self._changed = asyncio.Event()
        if self.config.enabled:
            pool.evidence_sink = self.report
        pool.subscribe(self._pool_changed)
        self._set_healthy_gauge()

    def _pool_changed(self, change: PoolChange) -> None:
        """Removal (scorer.pool.discovery) ends the worker's probes and its series;
        ejection is a health state of a worker still in the pool."""
        ep = change.worker.endpoint
        if change.change == "removed":
            task = self._tasks.pop(ep, None)
            if task is not None:
                task.cancel()
            with contextlib.suppress(KeyError):
                EJECTED.remove(ep)
        self._set_healthy_gauge()

    # -- lifecycle -------------------------------------------------------------------
    async def start(self) -> None:
        """Accept evidence (before start it is only counted)."""
        self._running = True
        self._set_healthy_gauge()

    async def stop(self) -> None:
        """Cancel probes in progress and close the HTTP session."""
        self._running = False
        tasks = list(self._tasks.values())
        self._tasks.clear()
        await cancel_and_wait(*tasks)
        session, self._session = self._session, None
        if session is not None:
            await session.close()

    def _notify(self) -> None:
        ev, self._changed = self._changed, asyncio.Event()
        ev.set()

    async def wait_until(self, pred: Callable[[], bool], timeout: float) -> bool:
        """Wait (bounded) until `pred()` holds, re-checking after each health change.
        For tests and tools; returns pred()'s last value."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not pred():
            remaining = deadline - loop.time()
            if remaining <= 0:
                return False
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(remaining):
                    await self._changed.wait()
        return True

    # -- evidence --------------------------------------------------------------------
    def report(self, endpoint: str, kind: str, detail: str = "") -> None:
        """Evidence against `endpoint`: confirm it with one probe (in the background)."""
        w = self.pool.get(endpoint)
        if w is None:
            return
        w.health.last_evidence = f"{kind}: {detail}" if detail else kind
        if not self._running or not w.healthy or endpoint in self._tasks:
            EVIDENCE.labels(kind, "ignored").inc()
            return
        self._spawn(endpoint, self._confirm(w, kind, detail))

    def on_completion(self, done: Completion) -> None:
        """Director completion hook: a routed request answered 502/503 is evidence against
        its endpoint (Envoy's own answer when the connection was refused or reset before
        the response; a worker's own 502/503 is dismissed by the probe)."""
        if done.routed and done.endpoint is not None and done.status in UPSTREAM_FAILED:
            self.report(done.endpoint, REQUEST_FAILED, f"HTTP {done.status}")

    def _spawn(self, endpoint: str, coro: Any) -> None:
        task = asyncio.create_task(coro, name=f"health {endpoint}")
        self._tasks[endpoint] = task
        task.add_done_callback(lambda t: self._done(endpoint, t))

    def _done(self, endpoint: str, task: asyncio.Task[None]) -> None:
        if self._tasks.get(endpoint) is task:
            del self._tasks[endpoint]
        if not task.cancelled() and task.exception() is not None:
            log.error("health task for %s failed", endpoint, exc_info=task.exception())

    async def _confirm(self, w: Worker, kind: str, detail: str) -> None:
        error = await self._probe_fn(w)
        PROBES.labels("ok" if error is None else "failed").inc()
        if error is None:
            EVIDENCE.labels(kind, "dismissed").inc()
            w.health.dismissed += 1
            self._notify()
            return
        EVIDENCE.labels(kind, "ejected").inc()
        if self.pool.get(w.endpoint) is not w or not w.healthy:
            return  # removed from the pool (or ejected) meanwhile
        self.eject(w, kind, f"{detail}; probe: {error}" if detail else f"probe: {error}")
        await self._probe_until_back(w)

    # -- ejection and readmission ----------------------------------------------------
    def eject(self, w: Worker, reason: str, detail: str = "") -> None:
        """Take `w` out of rotation and forget its cache and in-flight state."""
        w.healthy = False
        h = w.health
        h.reason = reason
        h.detail = detail
        h.since = self.clock()
        h.ejections += 1
        h.probes = 0
        h.last_probe = None
        if self.index is not None:
            self.index.purge(w.endpoint)
        dropped = self.pool.inflight.drop_endpoint(w.endpoint)
        EJECTIONS.labels(reason).inc()
        EJECTED.labels(w.endpoint).set(1)
        self._set_healthy_gauge()
        self._notify()
        log.warning(
            "worker %s ejected (%s: %s); %d in-flight requests forgotten",
            w.endpoint,
            reason,
            detail,
            dropped,
        )

    def readmit(self, w: Worker) -> None:
        """Put `w` back in rotation; its index fills again from its events."""
        w.healthy = True
        w.health.reason = None
        w.health.detail = ""
        READMISSIONS.inc()
        EJECTED.labels(w.endpoint).set(0)
        self._set_healthy_gauge()
        self._notify()
        log.warning("worker %s readmitted after %d probes", w.endpoint, w.health.probes)

    async def _probe_until_back(self, w: Worker) -> None:
        delay = self.config.probe_interval_s
        # `_running` too: stop() awaits this task, and a cancel can be lost on the way (a
        # probe that finishes in the turn it is cancelled, as 3.11's wait_for did).
        while self._running and self.pool.get(w.endpoint) is w and not w.healthy:
            await asyncio.sleep(delay)
            w.health.probes += 1
            error = await self._probe_fn(w)
            PROBES.labels("ok" if error is None else "failed").inc()
            if error is None:
                self.readmit(w)
                return
            w.health.last_probe = error
            delay = min(delay * 2, self.config.probe_max_interval_s)

    def _set_healthy_gauge(self) -> None:
        HEALTHY.set(sum(1 for w in self.pool if w.healthy))

    # -- probes ----------------------------------------------------------------------
    async def probe(self, w: Worker) -> str | None:
        """Probe `w`'s serving endpoint; None when it answered, else what went wrong."""
        timeout = self.config.probe_timeout_s
        if self.config.probe == "http":
            return await self._probe_http(w, timeout)
        host, port = _host_port(w.endpoint)
        try:
            async with asyncio.timeout(timeout):
                _, writer = await asyncio.open_connection(host, port)
        except TimeoutError:
            return "connect timeout"
        except OSError as e:
            return f"{type(e).__name__}: {e.strerror or e}"
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
        return None

    async def _probe_http(self, w: Worker, timeout: float) -> str | None:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout))
        host, port = _host_port(w.endpoint)
        hostpart = f"[{host}]" if ":" in host else host
        url = f"http://{hostpart}:{port}{self.config.probe_path}"
        try:
            async with self._session.get(url) as resp:
                if 200 <= resp.status < 300:
                    return None
                return f"HTTP {resp.status}"
        except TimeoutError:
            return "timeout"
        except (aiohttp.ClientError, OSError) as e:
            return f"{type(e).__name__}: {e}"


def describe(w: Worker, now: float) -> dict[str, Any]:
    """The worker's health for /debug/pool: why it is out, since when, what was seen."""
    h = w.health
    return {
        "healthy": w.healthy,
        "reason": h.reason,
        "detail": h.detail,
        "ejected_for_s": None if w.healthy else round(now - h.since, 3),
        "ejections": h.ejections,
        "probes": h.probes,
        "last_probe": h.last_probe,
        "last_evidence": h.last_evidence,
        "dismissed": h.dismissed,
    }


def is_refusal(e: BaseException) -> bool:
    """True for a refused or reset TCP connection (evidence), False for anything else
    (timeouts, HTTP errors, bad payloads are not evidence)."""
    if isinstance(e, aiohttp.ClientConnectorError):
        e = e.os_error
    if isinstance(e, aiohttp.ServerDisconnectedError):
        return True
    if isinstance(e, aiohttp.ClientOSError) and e.errno is not None:
        import errno

        return e.errno in (errno.ECONNREFUSED, errno.ECONNRESET, errno.EPIPE)
    return isinstance(e, ConnectionRefusedError | ConnectionResetError | BrokenPipeError)
