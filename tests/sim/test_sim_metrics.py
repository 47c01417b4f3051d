"""The simulated worker's /metrics (kvscorer_tools.sim.metrics) against prometheus_client:
the same metrics, fed the same operations, render the same bytes as `generate_latest`."""

from __future__ import annotations

import time
from typing import Any

import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvscorer_tools.sim.metrics import E2E_BUCKETS, TTFT_BUCKETS, SimMetrics

NOW = 1_795_927_368.6777217  # every series' `_created` and the LoRA gauge's value


class Reference:
    """vLLM's metrics as prometheus_client builds them (the sim's metrics before its own
    registry): names, help, types, labels, buckets."""

    def __init__(self, model: str, block_size: int, num_gpu_blocks: int, max_loras: int) -> None:
        self.registry = r = CollectorRegistry(auto_describe=True)
        names = ["model_name", "engine"]
        lv = (model, "0")
        self.running = Gauge(
            "vllm:num_requests_running", "Number of requests in model execution batches.",
            names, registry=r,
        ).labels(*lv)  # fmt: skip
        self.waiting = Gauge(
            "vllm:num_requests_waiting", "Number of requests waiting to be processed.",
            names, registry=r,
        ).labels(*lv)  # fmt: skip
        self.kv_usage = Gauge(
            "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
            names, registry=r,
        ).labels(*lv)  # fmt: skip
        self.prefix_queries = Counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.", names, registry=r,
        ).labels(*lv)  # fmt: skip
        self.prefix_hits = Counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
            names, registry=r,
        ).labels(*lv)  # fmt: skip
        self.preemptions = Counter(
            "vllm:num_preemptions", "Cumulative number of preemption from the engine.",
            names, registry=r,
        ).labels(*lv)  # fmt: skip
        self.prompt_tokens = Counter(
            "vllm:prompt_tokens", "Number of prefill tokens processed.", names, registry=r
        ).labels(*lv)
        self.generation_tokens = Counter(
            "vllm:generation_tokens", "Number of generation tokens processed.", names, registry=r
        ).labels(*lv)
        self.request_success = Counter(
            "vllm:request_success", "Count of successfully processed requests.",
            [*names, "finished_reason"], registry=r,
        )  # fmt: skip
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
            names, buckets=TTFT_BUCKETS, registry=r,
        ).labels(*lv)  # fmt: skip
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
            names, buckets=E2E_BUCKETS, registry=r,
        ).labels(*lv)  # fmt: skip
        Gauge(
            "vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
            ["block_size", "num_gpu_blocks", "enable_prefix_caching", "cache_dtype",
             "model_name", "engine"],
            registry=r,
        ).labels(str(block_size), str(num_gpu_blocks), "True", "auto", *lv).set(1)  # fmt: skip
        self.lora_info = Gauge(
            "vllm:lora_requests_info", "Running stats on lora requests.",
            ["max_lora", "waiting_lora_adapters", "running_lora_adapters"], registry=r,
        )  # fmt: skip
        self._lv = lv
        self.max_loras = max_loras
        self._lora: tuple[str, str, str] | None = None
        self.set_lora_state([], [])

    def finished(self, reason: str) -> None:
        self.request_success.labels(*self._lv, reason).inc()

    def set_lora_state(self, waiting: list[str], running: list[str]) -> None:
        labels = (
            str(self.max_loras),
            ",".join(sorted(set(waiting))),
            ",".join(sorted(set(running))),
        )
        if labels != self._lora:
            if self._lora is not None:
                self.lora_info.remove(*self._lora)
            self._lora = labels
        self.lora_info.labels(*labels).set(time.time())

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


GAUGES = ("running", "waiting", "kv_usage")
COUNTERS = ("prefix_queries", "prefix_hits", "preemptions", "prompt_tokens", "generation_tokens")
HISTOGRAMS = ("ttft", "e2e")
values = st.one_of(
    st.sampled_from([0.0, 1.0, 0.001, 0.1, 2560.0, 7680.0, 1e-9, 123456789.0, 1e22]),
    st.floats(min_value=0, max_value=1e12, allow_nan=False),
)
ops = st.lists(
    st.one_of(
        st.tuples(st.just("set"), st.sampled_from(GAUGES), values),
        st.tuples(st.just("inc"), st.sampled_from(COUNTERS), values),
        st.tuples(st.just("observe"), st.sampled_from(HISTOGRAMS), values),
        st.tuples(st.just("finished"), st.sampled_from(["length", "stop", "abort"]), st.none()),
        st.tuples(
            st.just("lora"),
            st.lists(st.sampled_from(["a", "b", 'q"\\x\n'])),
            st.lists(st.sampled_from(["a", "c"])),
        ),
    ),
    max_size=40,
)


def apply(m: Any, op: tuple[Any, ...]) -> None:
    kind, what, v = op
    if kind == "set":
        getattr(m, what).set(v)
    elif kind == "inc":
        getattr(m, what).inc(v)
    elif kind == "observe":
        getattr(m, what).observe(v)
    elif kind == "finished":
        m.finished(what)
    else:
        m.set_lora_state(what, v)


@pytest.fixture(autouse=True)
def frozen_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(time, "time", lambda: NOW)


@given(ops=ops, model=st.sampled_from(["m", "org/Model-7B", 'we"ird\\name']))
@example(
    ops=[("observe", "ttft", 0.001), ("observe", "ttft", 2560.0), ("observe", "e2e", 1e22)],
    model="m",
)
@example(ops=[("lora", ["a"], []), ("lora", [], ["c"]), ("finished", "stop", None)], model="m")
def test_same_bytes_as_prometheus_client(ops: list[tuple[Any, ...]], model: str) -> None:
    ours, ref = SimMetrics(model, 16, 1000, 2), Reference(model, 16, 1000, 2)
    for op in ops:
        apply(ours, op)
        apply(ref, op)
    assert ours.exposition() == ref.exposition()


def test_value_sums_a_metrics_series() -> None:
    m = SimMetrics("m", 16, 64, 0)
    m.finished("length")
    m.finished("stop")
    m.finished("stop")
    m.running.set(3)
    assert m.value("vllm:request_success_total") == 3.0
    assert m.value("vllm:num_requests_running") == 3.0


def test_counters_refuse_to_go_down() -> None:
    with pytest.raises(ValueError):
        SimMetrics("m", 16, 64, 0).prompt_tokens.inc(-1)
