"""vLLM's Prometheus metrics, one `CollectorRegistry` per simulated worker.

Names, types, labels and TTFT buckets follow vLLM v1 (vllm/v1/metrics/loggers.py
`PrometheusStatLogger`): labels `model_name` and `engine` (engine index "0");
prometheus_client appends `_total` to counters exactly as in vLLM's own exposition
(`vllm:prefix_cache_queries_total`). A per-worker registry lets many workers live in one
process (tests, the demo, the benchmark).
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

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


class SimMetrics:
    """The worker's vLLM-named metrics."""

    def __init__(self, model: str, block_size: int, num_gpu_blocks: int, max_loras: int) -> None:
        self.registry = r = CollectorRegistry(auto_describe=True)
        names = ["model_name", "engine"]
        lv = (model, "0")
        self.running = Gauge(
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            names,
            registry=r,
        ).labels(*lv)
        self.waiting = Gauge(
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            names,
            registry=r,
        ).labels(*lv)
        self.kv_usage = Gauge(
            "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.",
            names,
            registry=r,
        ).labels(*lv)
        self.prefix_queries = Counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            names,
            registry=r,
        ).labels(*lv)
        self.prefix_hits = Counter(
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            names,
            registry=r,
        ).labels(*lv)
        self.preemptions = Counter(
            "vllm:num_preemptions",
            "Cumulative number of preemption from the engine.",
            names,
            registry=r,
        ).labels(*lv)
        self.prompt_tokens = Counter(
            "vllm:prompt_tokens", "Number of prefill tokens processed.", names, registry=r
        ).labels(*lv)
        self.generation_tokens = Counter(
            "vllm:generation_tokens", "Number of generation tokens processed.", names, registry=r
        ).labels(*lv)
        self.request_success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            [*names, "finished_reason"],
            registry=r,
        )
        self._lv = lv
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            names,
            buckets=TTFT_BUCKETS,
            registry=r,
        ).labels(*lv)
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            names,
            buckets=E2E_BUCKETS,
            registry=r,
        ).labels(*lv)
        # vLLM: an "info" gauge whose labels carry the cache configuration, value 1.
        Gauge(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            [
                "block_size",
                "num_gpu_blocks",
                "enable_prefix_caching",
                "cache_dtype",
                "model_name",
                "engine",
            ],
            registry=r,
        ).labels(str(block_size), str(num_gpu_blocks), "True", "auto", *lv).set(1)
        self.max_loras = max_loras
        # vLLM: labels list the adapters; the value is the time of the last update.
        self.lora_info = Gauge(
            "vllm:lora_requests_info",
            "Running stats on lora requests.",
            ["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
            registry=r,
        )
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

    def exposition(self) -> bytes:
        """Prometheus text format of this worker's registry."""
        return generate_latest(self.registry)
