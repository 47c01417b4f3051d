"""The director through the real data path: response status in the decision log, dry runs
that change no state, request headers reaching the policy, completion hooks, one error
shape on every surface."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import grpc
import pytest
from configs import make_config
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from extproc_helpers import WORKERS, body_msg, headers_msg

from scorer.api.v1 import scorer_pb2, scorer_pb2_grpc
from scorer.director import Completion, Director
from scorer.policy.base import PolicyContext, build_policy
from scorer.policy.session import rendezvous
from scorer.pool.workers import Pool
from scorer.routing import RoutingRequest

EOF_ = grpc.aio.EOF


def completion(model: str = "m", prompt: str = "hello") -> bytes:
    return json.dumps({"model": model, "prompt": prompt}).encode()


def response_headers(status: str) -> ep.ProcessingRequest:
    m = ep.ProcessingRequest()
    m.response_headers.headers.headers.append(
        base_pb2.HeaderValue(key=":status", raw_value=status.encode())
    )
    return m


async def read(call: object) -> ep.ProcessingResponse:
    msg = await asyncio.wait_for(call.read(), 5)  # type: ignore[attr-defined]
    assert msg is not EOF_, "stream closed early"
    return msg


async def routed(h: object, rid: str, prompt: str = "hello") -> object:
    call = h.stream()  # type: ignore[attr-defined]
    await call.write(headers_msg({"x-request-id": rid, "x-tenant": "blue"}))
    await call.write(body_msg(completion(prompt=prompt), True))
    await read(call)  # routing answer
    await read(call)  # body streamed back
    return call


async def test_decision_log_records_the_status_the_client_got(harness) -> None:
    h = await harness()
    done: list[Completion] = []
    h.app.director.completion_hooks.append(done.append)
    call = await routed(h, "s503")
    (d,) = h.app.decisions.query(limit=1)
    assert (d["status"], d["status_from"]) == (200, "decision")
    await call.write(response_headers("503"))
    await read(call)
    (d,) = h.app.decisions.query(limit=1)
    assert (d["request_id"], d["status"], d["status_from"]) == ("s503", 503, "response")
    await call.done_writing()
    assert await asyncio.wait_for(call.read(), 5) is EOF_
    # The completion hook (request metrics attach here) saw the same facts, once.
    for _ in range(3000):  # bounded (~30 s) for a loaded machine
        if done:
            break
        await asyncio.sleep(0.01)
    assert len(done) == 1
    c = done[0]
    assert (c.request_id, c.model, c.status, c.endpoint) == ("s503", "m", 503, d["endpoint"])
    assert c.duration_s >= 0 and len(h.app.director) == 0


async def test_policy_sees_request_headers(harness) -> None:
    seen: list[dict[str, str]] = []
    h = await harness(policy="least_loaded")
    real = h.app.policy.decide

    def spy(request, candidates):  # type: ignore[no-untyped-def]
        seen.append(dict(request.headers))
        return real(request, candidates)

    h.app.policy.decide = spy
    call = await routed(h, "hdr")
    await call.done_writing()
    assert seen and seen[0]["x-tenant"] == "blue" and seen[0][":path"] == "/v1/completions"


async def test_score_rpc_is_a_dry_run(harness) -> None:
    h = await harness(
        policy="session",
        policies={"session": {"over": "round_robin"}, "round_robin": {}},
    )
    stub = scorer_pb2_grpc.ScorerStub(h.channel)
    seen = set()
    for _ in range(4):
        r = await stub.Score(scorer_pb2.ScoreRequest(model="m", prompt="x", session_id="s1"))
        seen.add(r.endpoints[0])
        r = await stub.Score(scorer_pb2.ScoreRequest(model="m", prompt="x"))
        seen.add(r.endpoints[0])
    # No session bound, the round-robin position never moved, nothing in flight.
    assert h.app.policy.bindings == {} and h.app.policy.inner.picker._next == 0
    assert len(h.app.pool.inflight) == 0 and len(h.app.director) == 0
    # The rendezvous worker of s1, and round robin's first worker, every time.
    assert seen == {rendezvous("s1", list(h.app.pool)).endpoint, WORKERS[0]}
    # The data path, by contrast, moves round robin on and binds the session.
    call = await routed(h, "real")
    await call.done_writing()
    assert h.app.policy.inner.picker._next == 1


async def test_kv_dry_run_inserts_nothing_speculatively(harness) -> None:
    h = await harness(policy="kv")
    stub = scorer_pb2_grpc.ScorerStub(h.channel)
    index = h.app.parts.index
    ids = list(range(1, 200))
    r = await stub.Score(scorer_pb2.ScoreRequest(model="m", token_ids=scorer_pb2.TokenIds(ids=ids)))
    assert r.status == 200 and r.endpoints
    assert all(index.stats(w)["speculative"] == 0 for w in WORKERS)
    # /debug/score shows the decision too, as a dry run.
    url = f"http://127.0.0.1:{h.app.admin_port}/debug/score"
    async with (
        aiohttp.ClientSession() as s,
        s.post(url, json={"model": "m", "token_ids": ids}) as rr,
    ):
        doc = await rr.json()
    assert doc["decision"]["policy"] == "kv" and doc["decision"]["endpoint"] in WORKERS
    assert all(index.stats(w)["speculative"] == 0 for w in WORKERS)
    assert len(h.app.pool.inflight) == 0


async def test_admin_errors_use_the_openai_error_shape(harness) -> None:
    h = await harness()
    base = f"http://127.0.0.1:{h.app.admin_port}"
    async with aiohttp.ClientSession() as s:
        async with s.get(base + "/debug/decisions?limit=lots") as r:
            assert r.status == 400
            err = (await r.json())["error"]
        async with s.post(base + "/debug/score", data=b"{nope") as r:
            assert r.status == 400
            err2 = (await r.json())["error"]
    for e in (err, err2):
        assert set(e) == {"message", "type", "param", "code"}
        assert e["type"] == "invalid_request_error"
    assert err["param"] == "limit"


async def test_body_over_limit_is_recorded_once(harness) -> None:
    h = await harness(extproc={"max_body_bytes": 1024})
    call = h.stream()
    await call.write(headers_msg({"x-request-id": "big"}))
    await call.write(body_msg(b"x" * 2000, False))
    resp = await read(call)
    assert resp.immediate_response.status.code == 413
    err = json.loads(resp.immediate_response.body)["error"]
    assert err["code"] == "too_large"
    (d,) = h.app.decisions.query(limit=1, reason="too_large")
    assert d["request_id"] == "big" and d["status"] == 413


class _PoolChangingPreparer:
    """Stands in for the tokens stage: while a request is "tokenized", the pool loses
    `gone` (as discovery may remove a worker during the thread-pool hop)."""

    def __init__(self, pool: Pool, gone: str | None) -> None:
        self.pool = pool
        self.gone = gone

    async def prepare(self, request: RoutingRequest) -> None:
        if self.gone is not None:
            self.pool.remove(self.gone, "deleted")


@pytest.mark.parametrize("gone", [None, "127.0.0.1:9002"])
async def test_a_worker_that_left_while_tokenizing_is_never_decided_for(gone: str | None) -> None:
    eps = ["127.0.0.1:9001", "127.0.0.1:9002"]
    cfg = make_config(eps, policy="kv")
    pool = Pool.from_config(cfg)
    policy = build_policy("kv", PolicyContext(pool=pool, config=cfg), {})
    director = Director(cfg, pool, policy, preparer=_PoolChangingPreparer(pool, gone))
    for i in range(4):  # the load decides (no tokens): every candidate gets picked in turn
        req = director.new_request({":path": "/v1/completions", "x-request-id": f"r{i}"})
        d = await director.request_received(req, completion())
        shown = {row.endpoint for row in d.candidates}
        assert shown == ({eps[0]} if gone else set(eps))
        assert d.endpoint in shown
