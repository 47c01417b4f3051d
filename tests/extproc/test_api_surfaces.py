"""scorer.v1 Score RPC, gRPC health names and the admin HTTP endpoints, over real sockets."""

from __future__ import annotations

import json

import aiohttp
import grpc
from extproc_helpers import WORKERS, body_msg, headers_msg
from grpc_health.v1 import health_pb2, health_pb2_grpc

from scorer.api.v1 import scorer_pb2, scorer_pb2_grpc

NAMES = [
    "",
    "liveness",
    "readiness",
    "inference-extension",
    "envoy.service.ext_proc.v3.ExternalProcessor",
]


async def test_score_rpc_ranks_endpoints_with_reasons(harness) -> None:
    h = await harness(policy="least_loaded")
    stub = scorer_pb2_grpc.ScorerStub(h.channel)
    resp = await stub.Score(scorer_pb2.ScoreRequest(model="m", prompt="hello world"))
    assert resp.status == 200 and resp.policy == "least_loaded" and resp.reason == "load"
    assert resp.ranked[0].endpoint == resp.endpoints[0]
    assert {r.endpoint for r in resp.ranked} == set(WORKERS)
    assert resp.ranked[0].rank == 0 and resp.ranked[0].reason == "load"
    assert all(r.rank == -1 and r.reason == "candidate" for r in resp.ranked[1:])
    assert json.loads(resp.decision_json)["endpoint"] == resp.endpoints[0]
    # Score does not count as in flight.
    assert len(h.app.pool.inflight) == 0

    chat = scorer_pb2.ScoreRequest(
        model="m",
        messages=scorer_pb2.ChatMessages(
            messages=[scorer_pb2.ChatMessage(role="user", content="hi")]
        ),
        subset=["127.0.0.2"],
    )
    r2 = await stub.Score(chat)
    assert list(r2.endpoints) == ["127.0.0.2:7003"]
    r3 = await stub.Score(
        scorer_pb2.ScoreRequest(model="m", token_ids=scorer_pb2.TokenIds(ids=[1, 2, 3]))
    )
    assert r3.request_tokens == 3
    r4 = await stub.Score(scorer_pb2.ScoreRequest(model="m", prompt="x", subset=["9.9.9.9"]))
    assert r4.status == 503 and r4.reason == "subset_empty" and not r4.endpoints


async def test_score_rpc_requires_model(harness) -> None:
    h = await harness()
    stub = scorer_pb2_grpc.ScorerStub(h.channel)
    try:
        await stub.Score(scorer_pb2.ScoreRequest(prompt="x"))
    except grpc.aio.AioRpcError as e:
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT
    else:
        raise AssertionError("expected INVALID_ARGUMENT")


async def test_health_names_follow_readiness(harness) -> None:
    h = await harness()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{h.app.health_port}") as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        for name in NAMES:
            r = await stub.Check(health_pb2.HealthCheckRequest(service=name))
            assert r.status == health_pb2.HealthCheckResponse.SERVING, name
        await h.app.set_ready(False)
        for name in NAMES:
            r = await stub.Check(health_pb2.HealthCheckRequest(service=name))
            want = "SERVING" if name == "liveness" else "NOT_SERVING"
            assert health_pb2.HealthCheckResponse.ServingStatus.Name(r.status) == want, name


async def test_admin_endpoints(harness) -> None:
    h = await harness()
    for i, model in enumerate(["a", "b", "a"]):
        call = h.stream()
        await call.write(headers_msg({"x-request-id": f"q{i}"}))
        await call.write(body_msg(json.dumps({"model": model, "prompt": "p"}).encode(), True))
        await call.read()
        await call.done_writing()
    call = h.stream()
    await call.write(headers_msg({}))
    await call.write(body_msg(b"{bad", True))
    await call.read()
    base = f"http://127.0.0.1:{h.app.admin_port}"
    async with aiohttp.ClientSession() as s:
        async with s.get(base + "/healthz") as r:
            assert r.status == 200
        async with s.get(base + "/readyz") as r:
            assert r.status == 200
        async with s.get(base + "/debug/decisions?model=a") as r:
            doc = await r.json()
            assert doc["count"] == 2 and {d["model"] for d in doc["decisions"]} == {"a"}
            assert doc["decisions"][0]["request_id"] == "q2"  # newest first
        async with s.get(base + "/debug/decisions?limit=1") as r:
            assert (await r.json())["count"] == 1
        async with s.get(base + "/debug/decisions?reason=bad_request") as r:
            assert (await r.json())["decisions"][0]["status"] == 400
        ep = WORKERS[0]
        async with s.get(base + f"/debug/decisions?endpoint={ep}") as r:
            assert all(d["endpoint"] == ep for d in (await r.json())["decisions"])
        async with s.get(base + "/debug/decisions?limit=x") as r:
            assert r.status == 400
        async with s.get(base + "/metrics") as r:
            text = await r.text()
            assert 'kv_scorer_extproc_streams_total{outcome="routed"}' in text
            # Routed streams observed their routing time (a loop-kept histogram).
            count = next(
                float(line.split()[-1])
                for line in text.splitlines()
                if line.startswith("kv_scorer_extproc_route_seconds_count")
            )
            assert count >= 1 and 'kv_scorer_extproc_route_seconds_bucket{le="+Inf"}' in text
            assert 'kv_scorer_decisions_total{policy="round_robin",reason="round_robin"}' in text
        await h.app.set_ready(False)
        async with s.get(base + "/readyz") as r:
            assert r.status == 503
