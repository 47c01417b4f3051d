"""vLLM's Prometheus metrics, one registry per simulated worker, rendered cheaply.

Names, types, labels and TTFT buckets follow vLLM v1 (vllm/v1/metrics/loggers.py
`PrometheusStatLogger`): labels `model_name` and `engine` (engine index "0");
counters end in `_total` with a `_created` sample, as prometheus_client writes vLLM's own
exposition (`vllm:prefix_cache_queries_total`). A per-worker registry lets many workers live
in one process (tests, the demo, the benchmark).

Why not prometheus_client's registry and `generate_latest`: in vLLM the API server renders
/metrics in its own process, beside an engine core that never waits for it; the simulated
engine shares one event loop (and, in the e2e benchmark, two cores) with its HTTP server,
and `generate_latest` took ~0.8-1.3 ms per scrape here (label-name validation and escaping
per sample): a router scraping 8 workers every 0.2 s slowed the simulated engines, which a
GPU engine is not. `SimRegistry` keeps plain floats and renders the same bytes from
prebuilt label strings (~20x less work); tests/sim/test_sim_metrics.py holds it byte for
byte to `generate_latest` over the same metrics and operations.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Sequence

from prometheus_client.utils import floatToGoString

# prometheus_client's spelling of a sample value (Go's: `+Inf`, exponents from 1e+07), so the
# bytes match its exposition; typed here (the library's function is not annotated).
_go_float: Callable[[float], str] = floatToGoString

# vLLM's TTFT buckets (seconds).
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
E2E_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)


def _escape_label(value: str) -> str:
    # The text format's label-value escapes (prometheus_client openmetrics._escape).
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labelstr(names: Sequence[str], values: Sequence[str]) -> str:
    """`{a="x",b="y"}` with the names sorted, as prometheus_client writes samples."""
    pairs = sorted(zip(names, values, strict=True))
    return "{" + ",".join(f'{k}="{_escape_label(v)}"' for k, v in pairs) + "}"


class _Child:
    """One labelled series: a counter's or gauge's value, or a histogram's bucket counts
    (not cumulative) and sum."""

    __slots__ = ("bounds", "buckets", "created", "family", "key", "sum", "value")

    def __init__(self, family: _Family, key: tuple[str, ...]) -> None:
        self.family = family
        self.key = key
        self.value = 0.0
        self.sum = 0.0
        self.created = time.time()
        self.bounds = family.bounds
        self.buckets = [0.0] * (len(self.bounds) + 1)  # the last: +Inf

    def inc(self, amount: float = 1.0) -> None:
        """Add `amount` (counters: never negative)."""
        if amount < 0:
            raise ValueError("counters can only be incremented by non-negative amounts")
        self.value += amount

    def set(self, value: float) -> None:
        """Set a gauge."""
        self.value = float(value)

    def observe(self, value: float) -> None:
        """Count a histogram observation in the first bucket whose bound holds it."""
        self.sum += value
        self.buckets[bisect.bisect_left(self.bounds, value)] += 1.0


class _Family:
    """A metric: name, help, type and label names; its series in creation order."""

    def __init__(
        self,
        registry: SimRegistry,
        name: str,
        doc: str,
        kind: str,
        labelnames: Sequence[str],
        buckets: Sequence[float] = (),
    ) -> None:
        self.name = name
        self.doc = doc.replace("\\", r"\\").replace("\n", r"\n")
        self.kind = kind
        self.labelnames = tuple(labelnames)
        self.bounds = [float(b) for b in buckets]
        self.children: dict[tuple[str, ...], _Child] = {}
        self._labels: dict[tuple[str, ...], str] = {}
        self._buckets: dict[tuple[str, ...], list[str]] = {}  # a histogram's line prefixes
        # prometheus_client's naming: counters as NAME_total, `_created` as its own gauge.
        self._sample = name + "_total" if kind == "counter" else name
        self._head = f"# HELP {self._sample} {self.doc}\n# TYPE {self._sample} {kind}\n"
        created = name + "_created"
        self._created_head = f"# HELP {created} {self.doc}\n# TYPE {created} gauge\n"
        registry.families.append(self)

    def labels(self, *values: str) -> _Child:
        """The series of these label values (made on first use)."""
        child = self.children.get(values)
        if child is None:
            if len(values) != len(self.labelnames):
                raise ValueError(f"{self.name}: expected {len(self.labelnames)} label values")
            child = self.children[values] = _Child(self, values)
            self._labels[values] = _labelstr(self.labelnames, values)
        return child

    def remove(self, *values: str) -> None:
        """Drop a series."""
        self.children.pop(values, None)
        self._labels.pop(values, None)
        self._buckets.pop(values, None)

    def render(self, out: list[str]) -> None:
        """This metric's lines, as prometheus_client's `generate_latest` writes them."""
        fmt = _go_float
        out.append(self._head)
        if self.kind == "histogram":
            for key, c in self.children.items():
                prefixes = self._buckets.get(key)
                if prefixes is None:
                    prefixes = self._buckets[key] = self._bucket_prefixes(key)
                n = 0.0
                for prefix, count in zip(prefixes, c.buckets, strict=True):
                    n += count
                    out.append(f"{prefix}{fmt(n)}\n")
                labels = self._labels[key]
                out.append(f"{self.name}_count{labels} {fmt(n)}\n")
                out.append(f"{self.name}_sum{labels} {fmt(c.sum)}\n")
        else:
            sample = self._sample
            for key, c in self.children.items():
                out.append(f"{sample}{self._labels[key]} {fmt(c.value)}\n")
        if self.kind != "gauge" and self.children:
            out.append(self._created_head)
            created = self.name + "_created"
            for key, c in self.children.items():
                out.append(f"{created}{self._labels[key]} {fmt(c.created)}\n")

    def _bucket_prefixes(self, key: tuple[str, ...]) -> list[str]:
        names = (*self.labelnames, "le")
        les = [*(_go_float(b) for b in self.bounds), "+Inf"]
        return [f"{self.name}_bucket{_labelstr(names, (*key, le))} " for le in les]


class SimRegistry:
    """The worker's metrics, in registration order."""

    def __init__(self) -> None:
        self.families: list[_Family] = []

    def exposition(self) -> bytes:
        """The Prometheus text format (what `generate_latest` gives for the same metrics)."""
        out: list[str] = []
        for f in self.families:
            f.render(out)
        return "".join(out).encode()


class SimMetrics:
    """The worker's vLLM-named metrics."""

    def __init__(self, model: str, block_size: int, num_gpu_blocks: int, max_loras: int) -> None:
        self.registry = r = SimRegistry()
        names = ("model_name", "engine")
        lv = (model, "0")
        self.running = _Family(
            r, "vllm:num_requests_running", "Number of requests in model execution batches.",
            "gauge", names,
        ).labels(*lv)  # fmt: skip
        self.waiting = _Family(
            r, "vllm:num_requests_waiting", "Number of requests waiting to be processed.",
            "gauge", names,
        ).labels(*lv)  # fmt: skip
        self.kv_usage = _Family(
            r, "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
            "gauge", names,
        ).labels(*lv)  # fmt: skip
        self.prefix_queries = _Family(
            r, "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.", "counter", names,
        ).labels(*lv)  # fmt: skip
        self.prefix_hits = _Family(
            r, "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
            "counter", names,
        ).labels(*lv)  # fmt: skip
        self.preemptions = _Family(
            r, "vllm:num_preemptions", "Cumulative number of preemption from the engine.",
            "counter", names,
        ).labels(*lv)  # fmt: skip
        self.prompt_tokens = _Family(
            r, "vllm:prompt_tokens", "Number of prefill tokens processed.", "counter", names
        ).labels(*lv)
        self.generation_tokens = _Family(
            r, "vllm:generation_tokens", "Number of generation tokens processed.", "counter", names
        ).labels(*lv)
        self.request_success = _Family(
            r, "vllm:request_success", "Count of successfully processed requests.", "counter",
            (*names, "finished_reason"),
        )  # fmt: skip
        self._lv = lv
        self.ttft = _Family(
            r, "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
            "histogram", names, TTFT_BUCKETS,
        ).labels(*lv)  # fmt: skip
        self.e2e = _Family(
            r, "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
            "histogram", names, E2E_BUCKETS,
        ).labels(*lv)  # fmt: skip
        # vLLM: an "info" gauge whose labels carry the cache configuration, value 1.
        _Family(
            r, "vllm:cache_config_info", "Information of the LLMEngine CacheConfig", "gauge",
            ("block_size", "num_gpu_blocks", "enable_prefix_caching", "cache_dtype",
             "model_name", "engine"),
        ).labels(str(block_size), str(num_gpu_blocks), "True", "auto", *lv).set(1)  # fmt: skip
        self.max_loras = max_loras
        # vLLM: labels list the adapters; the value is the time of the last update.
        self.lora_info = _Family(
            r, "vllm:lora_requests_info", "Running stats on lora requests.", "gauge",
            ("max_lora", "waiting_lora_adapters", "running_lora_adapters"),
        )  # fmt: skip
        self._lora_labels: tuple[str, str, str] | None = None
        self.set_lora_state([], [])

    def finished(self, reason: str) -> None:
        """Count a finished request."""
        self.request_success.labels(*self._lv, reason).inc()

    def set_lora_state(self, waiting: list[str], running: list[str]) -> None:
        """Publish the adapters of waiting and running requests (vLLM's lora_requests_info)."""
        labels = (
            str(self.max_loras),
            ",".join(sorted(set(waiting))),
            ",".join(sorted(set(running))),
        )
        if labels != self._lora_labels:
            if self._lora_labels is not None:
                self.lora_info.remove(*self._lora_labels)
            self._lora_labels = labels
        self.lora_info.labels(*labels).set(time.time())

    def value(self, name: str) -> float:
        """The sum of a metric's series (a counter by its `_total` name or a gauge's)."""
        base = name.removesuffix("_total")
        return sum(
            c.value for f in self.registry.families if f.name == base for c in f.children.values()
        )

    def exposition(self) -> bytes:
        """Prometheus text format of this worker's metrics."""
        return self.registry.exposition()
