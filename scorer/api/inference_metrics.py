"""The inference extension's metric families, exported next to `kv_scorer_*`.

Dashboards and alerts built for the reference endpoint picker read these names, so an
install that swaps the picker for kv-scorer keeps its graphs. Names, label names and
histogram buckets are the reference's: gateway-api-inference-extension v1.5.0
`pkg/epp/metrics/metrics.go` (request and pool families) and
`pkg/epp/metrics/collectors/inference_pool.go` (`inference_pool_per_pod_queue_size`);
where the reference records them: `pkg/epp/handlers/server.go` (request count and size
when the request is scheduled, error count once per request) and
`pkg/epp/handlers/response.go` (tokens from the response's `usage`, duration and response
size at the end of the response).

Two halves:

- Pool gauges (`inference_pool_*`) are produced by `PoolCollector` at scrape time from
  the pool's in-memory state (no per-request cost). Averages cover workers whose last
  metrics scrape is fresh (`load.stale_after_s`), as the reference's average over pods
  with fresh metrics; `ready_pods` counts workers that routing may choose.
- Request families (`inference_objective_*`) are recorded by `observe_request`, called
  once per finished request by the data path.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prometheus_client import REGISTRY
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from scorer.histogram import LoopCounter, LoopHistogram
from scorer.pool.scrape import fresh_scrape
from scorer.pool.workers import Pool

if TYPE_CHECKING:
    from scorer.director import Completion

# ---------------------------------------------------------------- request families

_MODEL_LABELS = ["model_name", "target_model_name"]
# The histograms are LoopHistograms (scorer.histogram): a finished request observes up to
# six, on the event loop, where /metrics is collected too.

# generalLatencyBuckets: 5 ms to 1 h (long generations).
_LATENCY_BUCKETS = (
    0.005, 0.025, 0.05, 0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 1.25, 1.5, 2, 3, 4, 5, 6, 8, 10,
    15, 20, 30, 45, 60, 120, 180, 240, 300, 360, 480, 600, 900, 1200, 1800, 2700, 3600,
)  # fmt: skip
_REQUEST_SIZE_BUCKETS = (
    64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072, 262144,
    524288, 1048576, 2097152, 4194304, 8388608, 16777216, 33554432, 67108864, 134217728,
    268435456, 536870912, 1073741824,
)  # fmt: skip
# The reference's list, including its 32778 (sic).
_RESPONSE_SIZE_BUCKETS = (
    1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32778, 65536,
)  # fmt: skip
_INPUT_TOKEN_BUCKETS = (
    1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32778, 65536, 131072,
    262144, 524288, 1048576,
)  # fmt: skip
_OUTPUT_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)

# LoopCounters: counted once per finished request on the event loop (a director
# completion hook), ~100 instructions an increment instead of prometheus_client's ~4,600.
REQUESTS = LoopCounter(
    "inference_objective_request_total",
    "Requests scheduled, by model and target model (inference extension family)",
    [*_MODEL_LABELS, "priority"],
)
REQUEST_ERRORS = LoopCounter(
    "inference_objective_request_error_total",
    "Requests that ended in an error, by model, target model and error code "
    "(BadRequest, ResourceExhausted, ServiceUnavailable, ModelServerError, Internal)",
    [*_MODEL_LABELS, "error_code"],
)
DURATION = LoopHistogram(
    "inference_objective_request_duration_seconds",
    "Request latency from the request's headers to the end of its response, seconds",
    _MODEL_LABELS,
    buckets=_LATENCY_BUCKETS,
)
REQUEST_SIZES = LoopHistogram(
    "inference_objective_request_sizes",
    "Request body size in bytes",
    _MODEL_LABELS,
    buckets=_REQUEST_SIZE_BUCKETS,
)
RESPONSE_SIZES = LoopHistogram(
    "inference_objective_response_sizes",
    "Response body size in bytes",
    _MODEL_LABELS,
    buckets=_RESPONSE_SIZE_BUCKETS,
)
INPUT_TOKENS = LoopHistogram(
    "inference_objective_input_tokens",
    "Prompt tokens per request (the response's usage.prompt_tokens)",
    _MODEL_LABELS,
    buckets=_INPUT_TOKEN_BUCKETS,
)
OUTPUT_TOKENS = LoopHistogram(
    "inference_objective_output_tokens",
    "Generated tokens per request (the response's usage.completion_tokens)",
    _MODEL_LABELS,
    buckets=_OUTPUT_TOKEN_BUCKETS,
)
CACHED_TOKENS = LoopHistogram(
    "inference_objective_prompt_cached_tokens",
    "Prompt tokens the engine served from its cache (usage.prompt_tokens_details.cached_tokens)",
    _MODEL_LABELS,
    buckets=_INPUT_TOKEN_BUCKETS,
)

# Error codes of the reference (pkg/common/error/error.go) by the HTTP status we answered.
_ERROR_CODES = {400: "BadRequest", 413: "BadRequest", 429: "ResourceExhausted"}


def error_code(status: int, from_model_server: bool) -> str | None:
    """The reference's error code for a request that ended with `status` (None: success).

    A non-2xx status from the model server is "ModelServerError" (the reference marks any
    status but 200 so); statuses the picker answered itself map to their reason.
    """
    if 200 <= status < 300 or status == 0:
        return None
    if from_model_server:
        return "ModelServerError"
    if status in _ERROR_CODES:
        return _ERROR_CODES[status]
    if status == 503:
        return "ServiceUnavailable"
    return "Internal"


@dataclass(slots=True)
class RequestRecord:
    """What the data path knows about one request when it is over.

    None means "not known" and is not recorded (token counts without a parsed usage,
    duration of a request that was refused before it was routed)."""

    model: str
    target_model: str | None = None  # the model after any rewrite; None = `model`
    routed: bool = False  # an endpoint was picked (counts in request_total)
    status: int = 0  # final HTTP status (0 = unknown)
    from_model_server: bool = False  # `status` came from the worker, not from us
    priority: int = 0
    duration_s: float | None = None
    request_bytes: int | None = None
    response_bytes: int | None = None
    input_tokens: int | None = None
    output_tokens: int | None = None
    cached_tokens: int | None = None


_children: dict[tuple[Any, ...], Any] = {}
# Model names come from request bodies; when the pool lists no models any name is
# accepted, so the label values are bounded here (later names share one label value).
_MAX_MODELS = 256
_models: set[str] = set()
OTHER_MODEL = "__other__"


def _model_label(model: str) -> str:
    if model in _models:
        return model
    if len(_models) >= _MAX_MODELS or len(model) > 256:
        return OTHER_MODEL
    _models.add(model)
    return model


def _child(metric: Any, *labels: str) -> Any:
    # labels() takes a lock and builds a tuple key; cache the children per label set.
    # Bounded: model label values are capped by _model_label.
    key = (id(metric), *labels)
    c = _children.get(key)
    if c is None:
        c = _children[key] = metric.labels(*labels)
    return c


def observe_request(r: RequestRecord) -> None:
    """Record one finished request in the inference_objective_* families."""
    model = _model_label(r.model)
    target = model if r.target_model is None else _model_label(r.target_model)
    if r.routed:
        _child(REQUESTS, model, target, str(r.priority)).inc()
        if r.request_bytes is not None:
            _child(REQUEST_SIZES, model, target).observe(r.request_bytes)
    code = error_code(r.status, r.from_model_server)
    if code is not None:
        _child(REQUEST_ERRORS, model, target, code).inc()
    if r.duration_s is not None and r.duration_s > 0:
        _child(DURATION, model, target).observe(r.duration_s)
    if r.response_bytes is not None:
        _child(RESPONSE_SIZES, model, target).observe(r.response_bytes)
    # The reference records token counts only when positive.
    if r.input_tokens:
        _child(INPUT_TOKENS, model, target).observe(r.input_tokens)
    if r.output_tokens:
        _child(OUTPUT_TOKENS, model, target).observe(r.output_tokens)
    if r.cached_tokens is not None:
        _child(CACHED_TOKENS, model, target).observe(r.cached_tokens)


class _ModelChildren:
    """One model label's children of the request families, resolved on first use (a label
    set appears once it is observed, as with labels())."""

    __slots__ = ("cached", "duration", "input", "model", "output", "requests", "response", "sizes")

    def __init__(self, model: str) -> None:
        self.model = model
        self.requests: Any = None
        self.sizes: Any = None
        self.duration: Any = None
        self.response: Any = None
        self.input: Any = None
        self.output: Any = None
        self.cached: Any = None


_by_model: dict[str, _ModelChildren] = {}  # keys: label values only (bounded, _MAX_MODELS+1)


def observe_completion(c: Completion) -> None:
    """A director completion hook (scorer.director): one finished request → the
    inference_objective_* families. The same samples as `observe_request` of its
    RequestRecord (tests/api compare them), with the children cached per model."""
    m = c.model or ""
    mc = _by_model.get(m)
    if mc is None:
        label = _model_label(m)
        mc = _by_model.get(label)
        if mc is None:
            mc = _by_model[label] = _ModelChildren(label)
    model = mc.model
    if c.routed:
        if mc.requests is None:
            mc.requests = _child(REQUESTS, model, model, "0")
        mc.requests.value += 1.0
        if c.request_bytes is not None:
            if mc.sizes is None:
                mc.sizes = _child(REQUEST_SIZES, model, model)
            mc.sizes.observe(c.request_bytes)
    status = c.status or 0
    if not (200 <= status < 300 or status == 0):
        code = error_code(status, c.from_model_server)
        if code is not None:
            _child(REQUEST_ERRORS, model, model, code).inc()
    d = c.duration_s
    if d is not None and d > 0:
        if mc.duration is None:
            mc.duration = _child(DURATION, model, model)
        mc.duration.observe(d)
    if c.response_bytes is not None:
        if mc.response is None:
            mc.response = _child(RESPONSE_SIZES, model, model)
        mc.response.observe(c.response_bytes)
    # The reference records token counts only when positive.
    if c.input_tokens:
        if mc.input is None:
            mc.input = _child(INPUT_TOKENS, model, model)
        mc.input.observe(c.input_tokens)
    if c.output_tokens:
        if mc.output is None:
            mc.output = _child(OUTPUT_TOKENS, model, model)
        mc.output.observe(c.output_tokens)
    if c.cached_tokens is not None:
        if mc.cached is None:
            mc.cached = _child(CACHED_TOKENS, model, model)
        mc.cached.observe(c.cached_tokens)


# ---------------------------------------------------------------- pool gauges


@dataclass(slots=True)
class _PoolSource:
    name: str
    pool: Pool
    stale_after_s: float


class PoolCollector(Collector):
    """`inference_pool_*` gauges computed from the registered pools at scrape time.

    One collector serves every pool in the process (tests run several apps in one
    process); each app registers its pool on start and removes it on stop.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._sources: dict[int, _PoolSource] = {}
        self._lock = threading.Lock()  # /metrics may be served from another thread

    def add(self, name: str, pool: Pool, stale_after_s: float) -> None:
        """Export `pool` under label name=`name`."""
        with self._lock:
            self._sources[id(pool)] = _PoolSource(name, pool, stale_after_s)

    def remove(self, pool: Pool) -> None:
        """Stop exporting `pool`."""
        with self._lock:
            self._sources.pop(id(pool), None)

    def describe(self) -> list[Any]:
        # Registered once at import; an empty describe keeps the registry from calling
        # collect() at registration time.
        return []

    def collect(self) -> Iterator[GaugeMetricFamily]:
        """Build the gauges from the pools' current state."""
        kv = GaugeMetricFamily(
            "inference_pool_average_kv_cache_utilization",
            "Average KV-cache utilization (0..1) of the pool's workers with fresh metrics",
            labels=["name"],
        )
        queue = GaugeMetricFamily(
            "inference_pool_average_queue_size",
            "Average number of requests waiting in the engines' queues",
            labels=["name"],
        )
        running = GaugeMetricFamily(
            "inference_pool_average_running_requests",
            "Average number of requests running in the engines",
            labels=["name"],
        )
        ready = GaugeMetricFamily(
            "inference_pool_ready_pods",
            "Workers routing may choose (healthy)",
            labels=["name"],
        )
        per_pod = GaugeMetricFamily(
            "inference_pool_per_pod_queue_size",
            "Requests waiting in each worker's engine queue (last scrape)",
            labels=["name", "model_server_pod"],
        )
        with self._lock:
            sources = list(self._sources.values())
        now = self.clock()
        for src in sources:
            workers = list(src.pool)
            ready.add_metric([src.name], sum(1 for w in workers if w.healthy))
            fresh = [w for w in workers if fresh_scrape(w.scraped, now, src.stale_after_s)]
            if fresh:
                n = len(fresh)
                kv.add_metric([src.name], sum(w.scraped.kv_usage for w in fresh) / n)
                queue.add_metric([src.name], sum(w.scraped.waiting for w in fresh) / n)
                running.add_metric([src.name], sum(w.scraped.running for w in fresh) / n)
            for w in workers:
                pod = getattr(w, "pod_name", None) or w.endpoint
                per_pod.add_metric([src.name, pod], w.scraped.waiting)
        yield kv
        yield queue
        yield running
        yield ready
        yield per_pod


POOLS = PoolCollector()
REGISTRY.register(POOLS)
