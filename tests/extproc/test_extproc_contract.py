"""gRPC contract tests: real ext_proc messages over a real channel to the real servicer."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from typing import ClassVar

import grpc
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from extproc_helpers import (
    PM,
    WORKERS,
    body_msg,
    headers_msg,
    lb_metadata,
    response_headers_msg,
    set_headers,
    trailers_msg,
)

from scorer.policy.base import Policy, register
from scorer.pool.workers import Worker
from scorer.routing import Decision, Reason, RoutingRequest

DEST = "x-gateway-destination-endpoint"
EOF_ = grpc.aio.EOF


@register
class RecordingPolicy(Policy):
    """Test policy: picks the first candidate and remembers what it was asked."""

    name = "test_recording"
    seen: ClassVar[list[RoutingRequest]] = []

    def decide(self, request: RoutingRequest, candidates: Sequence[Worker]) -> Decision:
        RecordingPolicy.seen.append(request)
        return Decision(endpoints=[candidates[0].endpoint], reason=Reason.LOAD, policy=self.name)


def completion(model: str = "m", **extra: object) -> bytes:
    return json.dumps({"model": model, "prompt": "hello", **extra}).encode()


async def read(call: object) -> ep.ProcessingResponse:
    msg = await asyncio.wait_for(call.read(), 5)  # type: ignore[attr-defined]
    assert msg is not EOF_, "stream closed early"
    return msg


def error_json(resp: ep.ProcessingResponse) -> dict[str, object]:
    ir = resp.immediate_response
    ct = {h.header.key: h.header.raw_value for h in ir.headers.set_headers}
    assert ct["content-type"] == b"application/json"
    doc = json.loads(ir.body)
    assert set(doc["error"]) == {"message", "type", "param", "code"}
    return doc["error"]  # type: ignore[no-any-return]


async def test_headers_only_request_routed_by_load(harness) -> None:
    h = await harness()
    call = h.stream()
    await call.write(headers_msg({":method": "GET", ":path": "/v1/models"}, end_of_stream=True))
    resp = await read(call)
    assert resp.WhichOneof("response") == "request_headers"
    hdrs = set_headers(resp.request_headers.response.header_mutation)
    assert hdrs[DEST].decode() in WORKERS
    assert lb_metadata(resp) == hdrs[DEST].decode()
    await call.done_writing()
    assert await call.read() is EOF_
    d = h.app.decisions.query(limit=1)[0]
    assert d["reason"] == "no_body"
    assert d["endpoint"] == hdrs[DEST].decode()


async def test_buffered_mode_strips_forged_header_then_routes_on_body(harness) -> None:
    h = await harness()
    call = h.stream()
    await call.write(headers_msg({DEST: "6.6.6.6:1"}, body_mode=PM.BUFFERED))
    first = await read(call)
    assert first.WhichOneof("response") == "request_headers"
    assert list(first.request_headers.response.header_mutation.remove_headers) == [DEST]
    await call.write(body_msg(completion(), True))
    resp = await read(call)
    assert resp.WhichOneof("response") == "request_body"
    common = resp.request_body.response
    assert not common.HasField("body_mutation")  # body unchanged → content-length stays right
    dest = set_headers(common.header_mutation)[DEST].decode()
    assert dest in WORKERS and dest != "6.6.6.6:1"
    assert lb_metadata(resp) == dest
    await call.done_writing()


async def test_full_duplex_multichunk_body_held_then_streamed_back(harness) -> None:
    h = await harness()
    call = h.stream()
    body = completion(prompt="x" * 150_000)
    await call.write(headers_msg({DEST: "6.6.6.6:1", "content-length": str(len(body))}))
    parts = [body[:1000], body[1000:90_000], body[90_000:]]
    for i, p in enumerate(parts):
        await call.write(body_msg(p, i == len(parts) - 1))
    hresp = await read(call)
    # The headers answer is held until the end of the body, and carries the destination.
    assert hresp.WhichOneof("response") == "request_headers"
    dest = set_headers(hresp.request_headers.response.header_mutation)[DEST].decode()
    assert dest in WORKERS
    assert lb_metadata(hresp) == dest
    got = b""
    for _ in range(len(body) // 1000 + 2):  # bounded: chunks are far larger than 1 kB
        r = await read(call)
        assert r.WhichOneof("response") == "request_body"
        sbr = r.request_body.response.body_mutation.streamed_response
        assert len(sbr.body) <= 62_000
        got += sbr.body
        if sbr.end_of_stream:
            break
    assert got == body
    await call.done_writing()


async def test_full_duplex_with_trailers(harness) -> None:
    h = await harness()
    call = h.stream()
    await call.write(headers_msg({}))
    await call.write(body_msg(completion(), False))
    await call.write(trailers_msg())
    assert (await read(call)).WhichOneof("response") == "request_headers"
    b = await read(call)
    sbr = b.request_body.response.body_mutation.streamed_response
    assert sbr.body == completion() and not sbr.end_of_stream  # trailers end the request
    assert (await read(call)).WhichOneof("response") == "request_trailers"
    await call.done_writing()


@pytest.mark.parametrize(
    ("subset", "expected"),
    [
        (["127.0.0.1:7002"], {"127.0.0.1:7002"}),
        ("127.0.0.1:7001, 127.0.0.1:7002", {"127.0.0.1:7001", "127.0.0.1:7002"}),
        (["127.0.0.2"], {"127.0.0.2:7003"}),
    ],
)
async def test_subset_hint_honoured(harness, subset, expected) -> None:
    h = await harness()
    seen = set()
    for _ in range(4):
        call = h.stream()
        await call.write(headers_msg({}, subset=subset))
        await call.write(body_msg(completion(), True))
        resp = await read(call)
        seen.add(set_headers(resp.request_headers.response.header_mutation)[DEST].decode())
        await call.done_writing()
    assert seen == expected


async def test_subset_matching_nothing_is_503(harness) -> None:
    h = await harness()
    call = h.stream()
    await call.write(headers_msg({}, subset=["10.9.9.9:1"]))
    await call.write(body_msg(completion(), True))
    resp = await read(call)
    assert resp.immediate_response.status.code == 503
    assert error_json(resp)["code"] == "subset_empty"


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        (b"{not json", 400, None),
        (b'{"prompt": "x"}', 400, "model"),
        (b"[1, 2]", 400, None),
        # nested past the decoder's recursion limit (was a 500 with two tracebacks)
        (b'{"model": "m", "messages": ' + b"[" * 1000 + b"]" * 1000 + b"}", 400, None),
        (b'{"model": "m", "prompt": ' + b'{"a":' * 100_000 + b"1" + b"}" * 100_001, 400, None),
    ],
)
async def test_bad_body_is_400_openai_error(harness, body, status, param) -> None:
    h = await harness()
    call = h.stream()
    await call.write(headers_msg({}))
    await call.write(body_msg(body, True))
    resp = await read(call)
    assert resp.immediate_response.status.code == status
    err = error_json(resp)
    assert err["type"] == "invalid_request_error"
    assert err["param"] == param
    assert h.app.decisions.query(limit=1, reason="bad_request")


async def test_unknown_model_is_503_and_no_workers_is_503(harness) -> None:
    h = await harness(pool={"models": ["llama"]})
    call = h.stream()
    await call.write(headers_msg({}))
    await call.write(body_msg(completion("other"), True))
    resp = await read(call)
    assert resp.immediate_response.status.code == 503
    assert error_json(resp)["type"] == "service_unavailable"
    h2 = await harness(pool={"workers": []})
    call = h2.stream()
    await call.write(headers_msg({":method": "GET"}, end_of_stream=True))
    assert (await read(call)).immediate_response.status.code == 503


async def test_body_over_limit_is_413(harness) -> None:
    h = await harness(extproc={"max_body_bytes": 2048})
    call = h.stream()
    await call.write(headers_msg({}))
    await call.write(body_msg(b"x" * 1500, False))
    await call.write(body_msg(b"x" * 1500, False))
    resp = await read(call)
    assert resp.immediate_response.status.code == 413
    error_json(resp)


async def test_request_fields_extracted(harness) -> None:
    h = await harness(policy="test_recording", tokens={"lora_base": {"my-adapter": "base"}})
    RecordingPolicy.seen.clear()
    call = h.stream()
    await call.write(
        headers_msg(
            {
                "x-session-affinity": "sess-1",
                "x-kv-scorer-sheddable": "true",
                "x-request-id": "rid-42",
            }
        )
    )
    await call.write(body_msg(completion("my-adapter", cache_salt="tenant-a"), True))
    await read(call)
    await call.done_writing()
    r = RecordingPolicy.seen[-1]
    assert (r.request_id, r.session_id, r.sheddable) == ("rid-42", "sess-1", True)
    assert (r.model, r.lora, r.cache_salt) == ("my-adapter", "my-adapter", "tenant-a")
    assert r.body is not None and r.body["prompt"] == "hello"
    assert r.prompt_tokens > 0


async def test_session_header_name_comes_from_the_session_policy_options(harness) -> None:
    h = await harness(policy="test_recording", policies={"session": {"header": "X-Conversation"}})
    RecordingPolicy.seen.clear()
    call = h.stream()
    await call.write(headers_msg({"x-conversation": "conv-7", "x-session-affinity": "other"}))
    await call.write(body_msg(completion("m"), True))
    await read(call)
    await call.done_writing()
    assert RecordingPolicy.seen[-1].session_id == "conv-7"


async def test_decision_headers(harness) -> None:
    h = await harness(extproc={"decision_headers": True})
    call = h.stream()
    await call.write(headers_msg({}))
    await call.write(body_msg(completion(), True))
    hdrs = set_headers((await read(call)).request_headers.response.header_mutation)
    assert hdrs["x-kv-scorer-reason"] == b"round_robin"
    assert hdrs["x-kv-scorer-matched-tokens"] == b"0"
    await call.done_writing()


async def test_inflight_lifecycle_and_served_endpoint(harness) -> None:
    h = await harness()
    inflight = h.app.pool.inflight
    call = h.stream()
    await call.write(headers_msg({"x-request-id": "a1"}))
    await call.write(body_msg(completion(prompt="y" * 4000), True))
    dest = set_headers((await read(call)).request_headers.response.header_mutation)[DEST].decode()
    await read(call)  # the streamed body
    load = inflight.load(dest)
    assert load.requests == 1 and load.prefill_tokens > 0
    other = next(w for w in WORKERS if w != dest)
    # Envoy reports a fallback served it: the accounting moves there.
    await call.write(response_headers_msg(served=other))
    r = await read(call)
    assert r.WhichOneof("response") == "response_headers"
    assert inflight.load(dest).requests == 0
    assert inflight.load(other).requests == 1 and inflight.load(other).prefill_tokens == 0
    await call.done_writing()  # Envoy closes the stream at the end of the HTTP exchange
    assert await call.read() is EOF_
    assert len(inflight) == 0 and inflight.load(other).requests == 0


async def test_inflight_released_on_cancel(harness) -> None:
    h = await harness()
    call = h.stream()
    await call.write(headers_msg({"x-request-id": "c1"}))
    await call.write(body_msg(completion(), True))
    await read(call)
    await read(call)
    assert len(h.app.pool.inflight) == 1
    call.cancel()
    for _ in range(3000):  # bounded (~30 s) for a loaded machine
        if len(h.app.pool.inflight) == 0:
            break
        await asyncio.sleep(0.01)
    assert len(h.app.pool.inflight) == 0


async def test_track_responses_off_closes_stream_after_answer(harness) -> None:
    h = await harness(extproc={"track_responses": False})
    call = h.stream()
    await call.write(headers_msg({}))
    await call.write(body_msg(completion(), True))
    hresp = await read(call)
    mo = hresp.mode_override
    assert mo.response_header_mode == PM.SKIP
    await read(call)
    # The server closes its side right after the routing answer, with status OK.
    assert await asyncio.wait_for(call.read(), 5) is EOF_
    assert await call.code() == grpc.StatusCode.OK
    assert len(h.app.pool.inflight) == 0


async def test_draining_refuses_new_streams(harness) -> None:
    h = await harness()
    h.app.extproc.draining = True
    call = h.stream()
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        if h.app.extproc_h2 is not None:
            # The asyncio transport answers a stream once its first message arrives.
            await call.write(headers_msg({}, end_of_stream=True))
        # grpcio refuses the stream before reading it; a client write racing that end turns
        # the status into a local INTERNAL "Failed execute_batch" (grpc/grpc#36066), so on
        # grpcio the probe only reads.
        await asyncio.wait_for(call.read(), 5)
    assert ei.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_prompt_over_the_token_budget_is_413(harness) -> None:
    from prometheus_client import REGISTRY

    def too_large_streams() -> float:
        labels = {"outcome": "too_large"}
        return REGISTRY.get_sample_value("kv_scorer_extproc_streams_total", labels) or 0.0

    h = await harness(policy="kv", tokens={"max_prompt_tokens": 32})
    before = too_large_streams()
    call = h.stream()
    await call.write(headers_msg({"x-request-id": "ids-33"}))
    await call.write(body_msg(json.dumps({"model": "m", "prompt": list(range(33))}).encode(), True))
    resp = await read(call)
    assert resp.immediate_response.status.code == 413
    err = error_json(resp)
    assert err["code"] == "prompt_too_large" and err["param"] == "prompt"
    assert "tokens.max_prompt_tokens" in str(err["message"])
    assert too_large_streams() - before == 1
    (d,) = h.app.decisions.query(limit=1, reason="prompt_too_large")
    assert (d["request_id"], d["status"]) == ("ids-33", 413)
    # A prompt at the limit is routed as before.
    call = h.stream()
    await call.write(headers_msg({"x-request-id": "ids-32"}))
    await call.write(body_msg(json.dumps({"model": "m", "prompt": list(range(32))}).encode(), True))
    resp = await read(call)
    assert resp.WhichOneof("response") != "immediate_response"
    assert lb_metadata(resp) in WORKERS
    await call.done_writing()
