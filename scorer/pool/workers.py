"""The worker pool (static from configuration, or kept by scorer.pool.discovery) and each
worker's live view.

Membership changes go through `Pool.add` / `Pool.remove`, each with a reason; parts that
keep per-worker state (event subscriptions, the index, the scraper) subscribe with
`Pool.subscribe(listener)` and are told synchronously, on the event loop, so a removed
worker is gone from every part before the next request is decided.
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Literal

from prometheus_client import Counter, Gauge

from scorer.config import Config, WorkerConfig
from scorer.pool.inflight import InflightTracker, WorkerLoad
from scorer.pool.prefill import PrefillModel

log = logging.getLogger(__name__)

# Why a worker joined or left the pool (the `reason` label of kv_scorer_pool_changes_total).
ADD_REASONS = ("config", "ready", "replaced")
REMOVE_REASONS = ("not_ready", "deleted", "deleting", "deselected", "replaced", "port_removed")

POOL_CHANGES = Counter(
    "kv_scorer_pool_changes_total",
    "Workers added to or removed from the pool, by change and reason",
    ["change", "reason"],
)
POOL_WORKERS = Gauge("kv_scorer_pool_workers", "Workers in the pool")


@dataclass(slots=True)
class ScrapedLoad:
    """The engine's own view of its load, from its Prometheus endpoint (scorer.pool.scrape)."""

    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float = 0.0  # 0..1
    block_size: int | None = None
    num_gpu_blocks: int | None = None
    at: float = 0.0  # monotonic time of the last good scrape; 0 = never
    error: str | None = None
    failures: int = 0
    # Added by scorer.pool.scrape (issue 5): what else the engine told us.
    engine: str | None = None  # "vllm" or "sglang", from the metric names seen
    block_size_mismatch: bool = False  # engine block size != config.pool.block_size
    lora_running: list[str] = field(default_factory=list)
    lora_waiting: list[str] = field(default_factory=list)
    cache_hit_rate: float | None = None  # SGLang's gauge, or vLLM hits/queries counters
    # Requests the engine holds that have not had their first token (vLLM's counters:
    # running + waiting + finished - first tokens; load.first_token_counts); None: unknown.
    before_first: float | None = None
    first_token_base: float = 0.0  # the counters' drift from that count (scorer.pool.scrape)
    attempts: int = 0  # scrapes tried (success or not)
    # Good pages applied. Scrapes of a worker run one after another, so page p + 2 was
    # requested after page p was applied: the director orders pages against routing by it.
    pages: int = 0


@dataclass(slots=True)
class HealthState:
    """Why a worker is out of rotation (scorer.pool.health); shown by /debug/pool."""

    reason: str | None = None  # the evidence that ejected it; None while healthy
    detail: str = ""
    since: float = 0.0  # monotonic time of the ejection
    ejections: int = 0
    probes: int = 0  # probes since the ejection
    last_probe: str | None = None  # what the newest failed probe saw
    last_evidence: str | None = None  # newest evidence, confirmed or not
    dismissed: int = 0  # evidence a probe found the worker alive for


# (endpoint, evidence kind, detail): how any part reports a failure seen on a worker.
EvidenceSink = Callable[[str, str, str], None]


def _no_sink(endpoint: str, kind: str, detail: str) -> None:
    return None


@dataclass
class Worker:
    """One model server. `endpoint` is what Envoy connects to (`ip:port`)."""

    config: WorkerConfig
    inflight: WorkerLoad
    healthy: bool = True
    scraped: ScrapedLoad = field(default_factory=ScrapedLoad)
    health: HealthState = field(default_factory=HealthState)
    # Where it came from: "config", or the pod ("namespace/name", uid) that owns the address.
    pod: str | None = None
    pod_uid: str | None = None
    # config.endpoint and config.models as plain attributes: every decision reads them,
    # and each read of a pydantic model's attribute goes through its __getattr__ hook
    # (a property on top of that cost ~1,100 instructions a read).
    endpoint: str = field(init=False)
    models: list[str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.endpoint = self.config.endpoint
        self.models = self.config.models

    @property
    def ip(self) -> str:
        return self.endpoint.rsplit(":", 1)[0].strip("[]")

    def serves(self, model: str | None) -> bool:
        """True when the worker lists no models, or lists this one."""
        return model is None or not self.models or model in self.models


@dataclass(frozen=True, slots=True)
class PoolChange:
    """One membership change, handed to every listener."""

    change: Literal["added", "removed"]
    worker: Worker
    reason: str


PoolListener = Callable[[PoolChange], None]


class Pool:
    """All workers, plus the router's in-flight accounting shared with the data path."""

    def __init__(self, workers: Iterable[WorkerConfig], models: Sequence[str] = ()) -> None:
        self.inflight = InflightTracker()
        # The director's fitted prefill model, shown in /debug/pool (None: no director).
        self.prefill: PrefillModel | None = None
        # Called with the worker after each good metrics page is applied (the director's
        # prefill fit dates first tokens by them); listeners must not raise.
        self.page_listeners: list[Callable[[Worker], None]] = []
        self.models = frozenset(models)
        self.workers: dict[str, Worker] = {}
        self._listeners: list[PoolListener] = []
        # Membership changes so far (add, remove): a caller that awaited between reading
        # the pool and using it compares this instead of re-checking every worker.
        self.changes = 0
        for wc in workers:
            self.workers[wc.endpoint] = Worker(wc, self.inflight.load(wc.endpoint))
        POOL_WORKERS.set(len(self.workers))
        # scorer.pool.health installs itself here; until then evidence is ignored.
        self.evidence_sink: EvidenceSink = _no_sink

    def report(self, endpoint: str, kind: str, detail: str = "") -> None:
        """Evidence that `endpoint` failed (a refused connection, a dropped event stream, a
        failed request). Cheap and synchronous: the health monitor confirms it off the
        request path. Safe to call for unknown endpoints."""
        self.evidence_sink(endpoint, kind, detail)

    @classmethod
    def from_config(cls, config: Config) -> Pool:
        return cls(config.pool.workers, config.pool.models)

    def __iter__(self) -> Iterator[Worker]:
        return iter(self.workers.values())

    def __len__(self) -> int:
        return len(self.workers)

    def get(self, endpoint: str) -> Worker | None:
        return self.workers.get(endpoint)

    # ---- membership --------------------------------------------------------------------

    def subscribe(self, listener: PoolListener) -> Callable[[], None]:
        """Call `listener` on every add/remove from now on; returns an unsubscribe function."""
        self._listeners.append(listener)

        def unsubscribe() -> None:
            if listener in self._listeners:
                self._listeners.remove(listener)

        return unsubscribe

    def add(
        self,
        config: WorkerConfig,
        reason: str = "config",
        pod: str | None = None,
        pod_uid: str | None = None,
    ) -> Worker:
        """Add a worker (a worker already at that endpoint is removed first, "replaced")."""
        if config.endpoint in self.workers:
            self.remove(config.endpoint, "replaced")
        self.inflight.forget(config.endpoint)
        w = Worker(config, self.inflight.load(config.endpoint), pod=pod, pod_uid=pod_uid)
        self.workers[config.endpoint] = w
        self.changes += 1
        self._tell(PoolChange("added", w, reason))
        return w

    def remove(self, endpoint: str, reason: str) -> Worker | None:
        """Remove a worker: no new requests, its in-flight accounting dropped, listeners told
        (they close its event subscription and drop its index entries)."""
        w = self.workers.pop(endpoint, None)
        if w is None:
            return None
        self.changes += 1
        w.healthy = False  # a policy still holding the object never picks it
        self.inflight.forget(endpoint)
        self._tell(PoolChange("removed", w, reason))
        return w

    def _tell(self, change: PoolChange) -> None:
        POOL_CHANGES.labels(change.change, change.reason).inc()
        POOL_WORKERS.set(len(self.workers))
        log.info(
            "worker %s %s (%s%s)",
            change.worker.endpoint,
            change.change,
            change.reason,
            f", pod {change.worker.pod}" if change.worker.pod else "",
        )
        for listener in list(self._listeners):
            try:
                listener(change)
            except Exception:  # one broken part must not stop the others from hearing
                log.exception("pool listener %r failed on %s", listener, change)

    # ---- the request path --------------------------------------------------------------

    def serves_model(self, model: str | None) -> bool:
        """A pool that lists no models accepts any model name and lets the workers answer."""
        return model is None or not self.models or model in self.models

    def eligible(self, model: str | None, subset: frozenset[str] | None) -> list[Worker]:
        """Healthy workers that serve `model` and match the subset hint (if any)."""
        if subset is None:
            # Every request's first step: Worker.serves inlined (one comprehension).
            return [
                w
                for w in self.workers.values()
                if w.healthy and (model is None or not w.models or model in w.models)
            ]
        return [
            w
            for w in self.workers.values()
            if w.healthy and w.serves(model) and matches_subset(w, subset)
        ]


def matches_subset(worker: Worker, subset: frozenset[str]) -> bool:
    """Subset entries are exact `ip:port` or IP-only (any port on that IP)."""
    return worker.endpoint in subset or worker.ip in subset


def normalize_endpoint(value: str) -> str:
    """Validate `ip:port` (IPv6 as `[addr]:port`) and return it unchanged; raise ValueError."""
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"endpoint {value!r} must be ip:port")
    ipaddress.ip_address(host.strip("[]"))
    return value
