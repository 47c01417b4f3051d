"""The response path on both transports: every body chunk answered at once, in order, in
the form Envoy's announced mode requires; trailers answered; usage read on the side."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import grpc
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from extproc_helpers import PM, body_msg, headers_msg

from scorer.director import Completion

EOF_ = grpc.aio.EOF
USAGE = {"prompt_tokens": 12, "completion_tokens": 5, "prompt_tokens_details": {"cached_tokens": 8}}


# `harness` (tests/extproc/conftest.py) runs every test here on both transports.


async def read(call: Any) -> ep.ProcessingResponse:
    msg = await asyncio.wait_for(call.read(), 5)
    assert msg is not EOF_, "stream closed early"
    return msg  # type: ignore[no-any-return]


def resp_headers(ctype: str, status: str = "200") -> ep.ProcessingRequest:
    m = ep.ProcessingRequest()
    for k, v in ((":status", status), ("content-type", ctype)):
        m.response_headers.headers.headers.append(base_pb2.HeaderValue(key=k, raw_value=v.encode()))
    return m


def resp_body(data: bytes, end: bool) -> ep.ProcessingRequest:
    m = ep.ProcessingRequest()
    m.response_body.body = data
    m.response_body.end_of_stream = end
    return m


def resp_trailers() -> ep.ProcessingRequest:
    m = ep.ProcessingRequest()
    m.response_trailers.SetInParent()
    return m


async def routed(h: Any, response_mode: int) -> Any:
    call = h.stream()
    hm = headers_msg({"x-request-id": "q1"})
    hm.protocol_config.response_body_mode = response_mode  # type: ignore[assignment]
    await call.write(hm)
    await call.write(body_msg(json.dumps({"model": "m", "prompt": "hi"}).encode(), True))
    await read(call)  # routing answer
    await read(call)  # request body streamed back
    return call


def hooked(h: Any) -> list[Completion]:
    done: list[Completion] = []
    h.app.director.completion_hooks.append(done.append)
    return done


async def until(cond: Any) -> None:
    for _ in range(3000):  # bounded (~30 s) for a loaded machine
        if cond():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached")


async def test_full_duplex_chunks_answered_with_the_same_bytes_in_order(harness: Any) -> None:
    h = await harness()
    done = hooked(h)
    call = await routed(h, PM.FULL_DUPLEX_STREAMED)
    await call.write(resp_headers("application/json"))
    assert (await read(call)).WhichOneof("response") == "response_headers"
    payload = json.dumps({"choices": [{"text": "x" * 3000}], "usage": USAGE}).encode()
    parts = [payload[:1000], payload[1000:2500], payload[2500:]]
    for i, part in enumerate(parts):
        await call.write(resp_body(part, i == len(parts) - 1))
    for i, part in enumerate(parts):
        r = await read(call)
        sr = r.response_body.response.body_mutation.streamed_response
        assert (sr.body, sr.end_of_stream) == (part, i == len(parts) - 1)
        assert r.response_body.response.status == ep.CommonResponse.CONTINUE
    # The request ended with the last chunk: released, usage read.
    await until(lambda: len(h.app.director) == 0 and done)
    c = done[0]
    assert (c.input_tokens, c.output_tokens, c.cached_tokens) == (12, 5, 8)
    assert c.response_bytes == len(payload) and c.status == 200
    assert len(h.app.pool.inflight) == 0
    await call.done_writing()


async def test_full_duplex_with_trailers_and_sse_usage(harness: Any) -> None:
    h = await harness()
    done = hooked(h)
    call = await routed(h, PM.FULL_DUPLEX_STREAMED)
    await call.write(resp_headers("text/event-stream"))
    await read(call)
    events = [
        f"data: {json.dumps({'choices': [{'text': str(i)}], 'usage': None})}\n\n" for i in range(40)
    ]
    events.append(f"data: {json.dumps({'choices': [], 'usage': USAGE})}\n\n")
    events.append("data: [DONE]\n\n")
    stream = "".join(events).encode()
    chunks = [stream[a : a + 97] for a in range(0, len(stream), 97)]  # cut mid-event
    for c in chunks:
        await call.write(resp_body(c, False))  # end_of_stream comes with the trailers
    got = b""
    for _ in chunks:
        r = await read(call)
        sr = r.response_body.response.body_mutation.streamed_response
        assert not sr.end_of_stream
        got += sr.body
    assert got == stream
    assert len(h.app.director) == 1  # not over yet: trailers end it
    await call.write(resp_trailers())
    assert (await read(call)).WhichOneof("response") == "response_trailers"
    await until(lambda: len(h.app.director) == 0 and done)
    assert (done[0].input_tokens, done[0].output_tokens, done[0].cached_tokens) == (12, 5, 8)
    await call.done_writing()


@pytest.mark.parametrize("mode", [PM.STREAMED, PM.BUFFERED, PM.BUFFERED_PARTIAL])
async def test_other_modes_get_plain_continue_per_message(harness: Any, mode: int) -> None:
    h = await harness()
    done = hooked(h)
    call = await routed(h, mode)
    await call.write(resp_headers("text/plain"))
    await read(call)
    chunks = [b"not json {", b"at all"] if mode != PM.BUFFERED else [b"not json {at all"]
    for i, c in enumerate(chunks):
        await call.write(resp_body(c, i == len(chunks) - 1))
        r = await read(call)
        assert r.WhichOneof("response") == "response_body"
        assert r.response_body.response.status == ep.CommonResponse.CONTINUE
        assert not r.response_body.response.HasField("body_mutation")
    await until(lambda: len(h.app.director) == 0 and done)
    assert done[0].input_tokens is None and done[0].response_bytes == 16
    await call.done_writing()


async def test_malformed_json_passes_untouched_and_is_counted(harness: Any) -> None:
    from prometheus_client import REGISTRY

    def count() -> float:
        v = REGISTRY.get_sample_value("kv_scorer_response_usage_total", {"outcome": "malformed"})
        return v or 0.0

    h = await harness()
    before = count()
    call = await routed(h, PM.FULL_DUPLEX_STREAMED)
    await call.write(resp_headers("application/json"))
    await read(call)
    await call.write(resp_body(b'{"usage": {"prompt_tokens": 3', True))
    sr = (await read(call)).response_body.response.body_mutation.streamed_response
    assert sr.body == b'{"usage": {"prompt_tokens": 3' and sr.end_of_stream
    await until(lambda: count() == before + 1)
    await call.done_writing()
