"""The inference extension's metric families: recorded per request through the real
ext_proc stream, pool gauges at scrape time, and the Grafana dashboard's names."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import aiohttp
import grpc
from extproc_helpers import body_msg, headers_msg, response_headers_msg
from prometheus_client import REGISTRY

from scorer.api import inference_metrics
from scorer.api.inference_metrics import (
    OTHER_MODEL,
    PoolCollector,
    RequestRecord,
    error_code,
    observe_request,
)
from scorer.config import WorkerConfig
from scorer.pool.workers import Pool

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "kv-scorer.json"


def value(metric: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(metric, labels) or 0.0


def test_error_codes_follow_the_reference() -> None:
    assert error_code(200, False) is None and error_code(0, False) is None
    assert error_code(400, False) == "BadRequest" and error_code(413, False) == "BadRequest"
    assert error_code(429, False) == "ResourceExhausted"
    assert error_code(503, False) == "ServiceUnavailable"
    assert error_code(500, False) == "Internal"
    assert error_code(503, True) == "ModelServerError"
    assert error_code(404, True) == "ModelServerError"


def test_observe_request_records_every_known_field() -> None:
    m = "metrics-unit-model"
    lab = {"model_name": m, "target_model_name": m}
    before = value("inference_objective_request_total", **lab, priority="0")
    observe_request(
        RequestRecord(
            model=m,
            routed=True,
            status=200,
            from_model_server=True,
            duration_s=1.5,
            request_bytes=1000,
            response_bytes=300,
            input_tokens=50,
            output_tokens=7,
            cached_tokens=32,
        )
    )
    assert value("inference_objective_request_total", **lab, priority="0") == before + 1
    assert value("inference_objective_request_duration_seconds_sum", **lab) >= 1.5
    assert value("inference_objective_request_sizes_bucket", **lab, le="1024.0") >= 1
    assert value("inference_objective_response_sizes_count", **lab) >= 1
    assert value("inference_objective_input_tokens_sum", **lab) >= 50
    assert value("inference_objective_output_tokens_sum", **lab) >= 7
    assert value("inference_objective_prompt_cached_tokens_sum", **lab) >= 32
    # Zero token counts are not observed (the reference records only positive ones).
    n = value("inference_objective_output_tokens_count", **lab)
    observe_request(RequestRecord(model=m, routed=True, output_tokens=0))
    assert value("inference_objective_output_tokens_count", **lab) == n
    # A refusal counts as an error, not as a scheduled request.
    observe_request(RequestRecord(model=m, status=503))
    assert value("inference_objective_request_total", **lab, priority="0") == before + 2
    assert (
        value("inference_objective_request_error_total", **lab, error_code="ServiceUnavailable")
        >= 1
    )


def test_model_label_values_are_bounded(monkeypatch: Any) -> None:
    # A private set of seen names, so the flood does not use up other tests' labels.
    monkeypatch.setattr(inference_metrics, "_models", set())
    for i in range(300):
        observe_request(RequestRecord(model=f"flood-{i}", status=400))
    other = {
        "model_name": OTHER_MODEL,
        "target_model_name": OTHER_MODEL,
        "error_code": "BadRequest",
    }
    assert value("inference_objective_request_error_total", **other) >= 1
    observe_request(RequestRecord(model="x" * 1000, status=400))
    got = REGISTRY.get_sample_value(
        "inference_objective_request_error_total",
        {"model_name": "x" * 1000, "target_model_name": "x" * 1000, "error_code": "BadRequest"},
    )
    assert got is None


def test_pool_collector_reads_the_pool_at_scrape_time() -> None:
    now = [1000.0]
    c = PoolCollector(clock=lambda: now[0])
    pool = Pool([WorkerConfig(endpoint=f"10.0.0.{i}:8000") for i in (1, 2, 3)])
    c.add("pool-a", pool, stale_after_s=2.0)
    w1, w2, w3 = pool
    w1.scraped.at, w1.scraped.waiting, w1.scraped.kv_usage, w1.scraped.running = 999.5, 4, 0.5, 2
    w2.scraped.at, w2.scraped.waiting, w2.scraped.kv_usage, w2.scraped.running = 999.0, 2, 0.3, 4
    w3.scraped.at, w3.scraped.waiting = 990.0, 50  # stale: not in the averages
    w3.healthy = False

    def samples() -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        out = {}
        for fam in c.collect():
            for s in fam.samples:
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
        return out

    got = samples()
    name = (("name", "pool-a"),)
    assert got[("inference_pool_average_kv_cache_utilization", name)] == 0.4
    assert got[("inference_pool_average_queue_size", name)] == 3.0
    assert got[("inference_pool_average_running_requests", name)] == 3.0
    assert got[("inference_pool_ready_pods", name)] == 2
    pod = (("model_server_pod", "10.0.0.3:8000"), ("name", "pool-a"))
    assert got[("inference_pool_per_pod_queue_size", pod)] == 50
    # State changes are seen at the next scrape, with no per-request recording.
    w1.scraped.waiting = 10
    assert samples()[("inference_pool_average_queue_size", name)] == 6.0
    # Nothing fresh: no averages (unknown is not zero); ready pods still reported.
    now[0] = 2000.0
    got = samples()
    assert ("inference_pool_average_queue_size", name) not in got
    assert got[("inference_pool_ready_pods", name)] == 2
    c.remove(pool)
    assert samples() == {}


def dashboard_metric_names() -> set[str]:
    doc = json.loads(DASHBOARD.read_text())
    exprs: list[str] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                if k in ("expr", "query") and isinstance(v, str):
                    exprs.append(v)
                else:
                    walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(doc)
    names = set()
    for e in exprs:
        for n in re.findall(r"\b((?:inference_|kv_scorer_)[a-z0-9_]+)", e):
            names.add(re.sub(r"_(bucket|sum|count)$", "", n))
    return names


async def test_dashboard_names_are_exported_by_a_running_scorer(harness: Any) -> None:
    """Every metric the Grafana dashboard queries is on a running scorer's /metrics, and
    requests through the real ext_proc stream move the request families."""
    names = dashboard_metric_names()
    assert {
        "inference_objective_request_total",
        "inference_objective_request_error_total",
        "inference_objective_request_duration_seconds",
        "inference_objective_input_tokens",
        "inference_objective_output_tokens",
        "inference_pool_average_kv_cache_utilization",
        "inference_pool_average_queue_size",
        "inference_pool_per_pod_queue_size",
        "inference_pool_ready_pods",
    } <= names
    h = await harness(pool={"name": "dash-pool"})
    for w in h.app.pool:  # as if scraped just now
        w.scraped.at, w.scraped.waiting, w.scraped.kv_usage = time.monotonic(), 1, 0.25
    m = "dash-model"
    lab = {"model_name": m, "target_model_name": m}
    before = value("inference_objective_request_total", **lab, priority="0")
    dur_before = value("inference_objective_request_duration_seconds_count", **lab)

    call = h.stream()
    await call.write(headers_msg({"x-request-id": "dash-1"}))
    await call.write(body_msg(json.dumps({"model": m, "prompt": "hi"}).encode(), True))
    await call.read()  # the routing answer
    await call.read()  # the body streamed back
    await call.write(response_headers_msg())
    await call.read()
    await call.done_writing()
    assert await call.read() is grpc.aio.EOF  # the server's handler has finished

    bad = h.stream()
    await bad.write(headers_msg({}))
    await bad.write(body_msg(b'{"model": "dash-model", "prompt": ', True))  # cut: 400
    await bad.read()
    await bad.done_writing()
    assert await bad.read() is grpc.aio.EOF

    url = f"http://127.0.0.1:{h.app.admin_port}/metrics"
    async with aiohttp.ClientSession() as s, s.get(url) as r:
        text = await r.text()
    # Every family is declared (TYPE) even before it has a sample; prometheus_client
    # declares a counter without its _total suffix.
    exported = set(re.findall(r"^# TYPE (\S+) ", text, re.M))
    exported |= {n + "_total" for n in exported}
    missing = sorted(n for n in names if n not in exported)
    assert not missing, f"dashboard queries metrics the scorer does not export: {missing}"
    assert value("inference_objective_request_total", **lab, priority="0") == before + 1
    assert value("inference_objective_request_duration_seconds_count", **lab) == dur_before + 1
    assert (
        value(
            "inference_objective_request_error_total",
            error_code="BadRequest",
            model_name="",
            target_model_name="",
        )
        >= 1
    )
    assert value("inference_pool_ready_pods", name="dash-pool") == 3
    assert value("inference_pool_average_kv_cache_utilization", name="dash-pool") == 0.25
