"""The ext_proc servicer: one gRPC bidi stream per HTTP request.

State machine per stream (Envoy ext_proc v3, processing modes set in envoy/envoy.yaml):

    request_headers ──end_of_stream──▶ route by load (no body) ─▶ headers response
        │
        ├─ BUFFERED: headers response (strip forged destination) ─▶ request_body (whole)
        │            ─▶ route ─▶ body response with destination header + envoy.lb metadata
        │
        └─ FULL_DUPLEX_STREAMED: body chunks (no answer yet) ─▶ end of body ─▶ route
                     ─▶ headers response with destination + metadata
                     ─▶ body back in chunks ≤ 62,000 bytes (end_of_stream on the last)
                     ─▶ trailers response when the request had trailers

    then, with extproc.track_responses: response_headers ─▶ director.response_started
    (envoy-full.yaml and the gateways; the lean envoy.yaml sends none: Envoy does not wait
    on us for the response); stream end ─▶ director.response_ended (also on error /
    cancel): Envoy closes the stream when the HTTP stream is over, which in the lean shape
    is the only response signal and is enough for in-flight accounting. Without
    track_responses the stream is closed right after the routing answer (Envoy then
    continues the request without further calls; see docs/envoy.md "track_responses").

Everything about the request itself (admission, refusal, decision, in-flight accounting)
is scorer.director's; this module translates. Refusals become ImmediateResponses with the
director's status and OpenAI error body: 400 bad body, 413 body too large, 503 no eligible
endpoint, 429 shed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from google.protobuf.message import DecodeError  # type: ignore[import-untyped]
from prometheus_client import Counter, Gauge

from scorer.config import Config
from scorer.director import Director
from scorer.extproc import conformance, wire
from scorer.extproc import protocol as P
from scorer.extproc.transport import AbortStream, H2GrpcServer, H2Stream, StreamContext
from scorer.histogram import LoopCounter, LoopHistogram
from scorer.routing import Decision

log = logging.getLogger("scorer.extproc")
_EOF: object = grpc.aio.EOF  # type: ignore[attr-defined]  # missing from grpc-stubs

# A LoopCounter (scorer.histogram): incremented once per stream on the event loop, where
# both transports run the servicer; prometheus_client's locked inc costs ~4,600
# instructions.
STREAMS = LoopCounter(
    "kv_scorer_extproc_streams_total",
    "ext_proc streams by outcome (routed, bad_request, too_large, no_endpoint, shed, "
    "refused, error, cancelled, empty)",
    ["outcome"],
)
ACTIVE = Gauge("kv_scorer_extproc_active_streams", "ext_proc streams open now")
# Counted in a plain list cell and read at scrape time: a Gauge's inc/dec take a lock each,
# twice per request on the data path.
_active = [0]
ACTIVE.set_function(lambda: _active[0])
# Observed on the event loop (both transports run the servicer there): plain-list buckets.
ROUTE_SECONDS = LoopHistogram(
    "kv_scorer_extproc_route_seconds",
    "Time from end of request body to routing answer (scorer side)",
    buckets=(0.00005, 0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.05, 0.25, 1.0),
)
SERVED_MOVED = Counter(
    "kv_scorer_extproc_served_elsewhere_total",
    "Requests Envoy reported served by an endpoint other than the primary (fallback used)",
)

_OUTCOME_BY_STATUS = {400: "bad_request", 413: "too_large", 429: "shed", 503: "no_endpoint"}
_OUTCOMES = ("routed", "bad_request", "too_large", "no_endpoint", "shed", "refused", "error")
# Labelled children resolved once: labels() costs a lock and a dict lookup per call.
_STREAM_COUNTERS = {o: STREAMS.labels(o) for o in (*_OUTCOMES, "cancelled", "empty")}


class ExtProcServicer(ep_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    """`envoy.service.ext_proc.v3.ExternalProcessor`: ext_proc messages → Director calls.

    It only translates: what to route, refuse or count is the director's.
    """

    def __init__(self, config: Config, director: Director) -> None:
        self.config = config
        self.director = director
        self.track_responses = director.follows_responses
        self.max_body = director.max_body_bytes
        self.decision_headers = config.extproc.decision_headers
        self.draining = False
        # Conformance test devices (scorer/extproc/conformance.py), off by default.
        self.test_selection = config.extproc.test_endpoint_selection
        self.echo_served = config.extproc.echo_served_endpoint
        # How to cancel each handler waiting in the response phase (Task.cancel, or
        # H2Stream.interrupt for a task-less one); release_streams() ends them cleanly.
        self._following: set[Callable[[], object]] = set()
        self._releasing = False
        # Prebuilt constant responses (no per-request allocation for the common answers).
        self._strip_forged = P.continue_headers(P.destination_mutation(None))
        self._skip_response = P.mode_override_skip_response()
        # Constant answers serialized once (written as bytes on both transports).
        self._continue_response_headers_wire = P.continue_headers(
            response_path=True
        ).SerializeToString()
        self._continue_response_body_wire = P.continue_response_body().SerializeToString()
        self._continue_response_trailers_wire = P.continue_response_trailers().SerializeToString()
        self._answers: dict[tuple[str, bool], ep.ProcessingResponse] = {}
        self._answers_wire: dict[tuple[str, bool], bytes] = {}
        self._continue_trailers_wire = P.continue_trailers().SerializeToString()
        # metadata_context values of response chunks that protobuf parsed (bounded).
        self._valid_meta: set[bytes] = set()

    # ------------------------------------------------------------------ the RPC

    async def Process(  # type: ignore[override]
        self,
        request_iterator: AsyncIterator[ep.ProcessingRequest] | None,
        context: StreamContext,
    ) -> None:
        if self.draining:
            _STREAM_COUNTERS["refused"].inc()
            await context.abort(grpc.StatusCode.UNAVAILABLE, "kv-scorer is shutting down")
        _active[0] += 1
        rid: str | None = None
        outcome = "error"
        ended = False  # the response ended in-band (end_of_stream or Envoy half-closed)
        try:
            rid, outcome, response_mode = await self._request_phase(context)
            if rid is not None and self.track_responses:
                ended = await self._response_phase(rid, context, response_mode)
        except (grpc.aio.AbortError, AbortStream):
            raise
        except asyncio.CancelledError:
            # Envoy or the client went away. Once routed (rid set) a cancel is how the
            # exchange normally ends: Envoy 1.40 resets a followed stream
            # (RST_STREAM INTERNAL_ERROR) at the end of the response instead of
            # half-closing it (measured), so the outcome stays "routed".
            if rid is None:
                outcome = "cancelled"
            raise
        except Exception:
            if context.cancelled():
                outcome = "cancelled"
            else:
                log.exception("ext_proc stream failed")
            raise
        finally:
            _active[0] -= 1
            _STREAM_COUNTERS[outcome].inc()
            if rid is not None:
                # End of stream, or a reset/cancel before it: the director releases the
                # request either way (reset when the response never completed here).
                self.director.response_ended(rid, reset=not ended)

    # ------------------------------------------------------------------ request path

    async def _request_phase(self, context: StreamContext) -> tuple[str | None, str, int]:
        """Read the request, answer with the destination. Returns (in-flight id, outcome,
        the response body mode Envoy announced: NONE when it announced none)."""
        msg = await context.read()
        if msg is _EOF:
            return None, "empty", 0
        assert isinstance(msg, ep.ProcessingRequest)
        kind = msg.WhichOneof("request")
        if kind != "request_headers":
            # Request processing skipped by the proxy config: nothing to route here.
            await self._passthrough(msg, context)
            return None, "empty", 0
        # Envoy announces its body modes on the first message (ProtocolConfiguration); the
        # response answers follow the announced mode (absent: an Envoy without
        # FULL_DUPLEX_STREAMED, so plain answers).
        # (Each protobuf field access builds an object: every one is read once.)
        if msg.HasField("protocol_config"):
            pc = msg.protocol_config
            response_mode = pc.response_body_mode
            full_duplex = pc.request_body_mode == P.FULL_DUPLEX
        else:
            response_mode = P.ProcessingMode.NONE
            full_duplex = True
        rh = msg.request_headers
        headers = P.header_map(rh)
        req = self.director.new_request(headers, self._subset(msg, headers))

        if rh.end_of_stream:
            d = await self.director.request_received(req, None)
            await context.write(self._headers_answer(d))
            return (*self._routed(d), response_mode)

        if not full_duplex:
            # BUFFERED: Envoy waits for this answer before it sends the body.
            await context.write(self._strip_forged)

        chunks: list[bytes] = []
        size = 0
        trailers = False
        while True:
            m = await context.read()
            if m is _EOF:
                return None, "cancelled", 0
            assert isinstance(m, ep.ProcessingRequest)
            k = m.WhichOneof("request")
            if k == "request_body":
                rb = m.request_body
                b = rb.body
                if b:
                    chunks.append(b)
                    size += len(b)
                if size > self.max_body:
                    await context.write(self._error_answer(self.director.too_large(req)))
                    return None, "too_large", 0
                if rb.end_of_stream or rb.end_of_stream_without_message:
                    break
            elif k == "request_trailers":
                trailers = True
                break
            else:
                # Unexpected order (e.g. response before request end): let it pass.
                await self._passthrough(m, context)
        body = chunks[0] if len(chunks) == 1 else b"".join(chunks)

        t0 = time.perf_counter()
        d = await self.director.request_received(req, body)
        ROUTE_SECONDS.observe(time.perf_counter() - t0)
        if not d.endpoints:
            await context.write(self._error_answer(d))
            return None, _OUTCOME_BY_STATUS.get(d.status, "no_endpoint"), 0

        # Wire bytes on both transports (add_to_server's serializer passes bytes through):
        # the cached answer's bytes and the body encoded by hand (scorer.extproc.wire,
        # checked against protocol.streamed_body in tests/extproc/test_wire.py).
        await context.write(self._routing_answer(d, full_duplex, as_wire=True))
        if full_duplex:
            for piece in wire.streamed_body(body, not trailers):
                await context.write(piece)
        if trailers:
            await context.write(self._continue_trailers_wire)
        return (*self._routed(d), response_mode)

    def _subset(self, msg: ep.ProcessingRequest, headers: dict[str, str]) -> frozenset[str] | None:
        """The gateway's subset hint, narrowed by the conformance selection header when
        `extproc.test_endpoint_selection` is on."""
        hint = P.subset_hint(msg)
        if not self.test_selection:
            return hint
        pairs = ((w.endpoint, w.ip) for w in self.director.pool)
        return conformance.restrict(hint, conformance.selection(headers), pairs)

    def _routing_answer(
        self, d: Decision, full_duplex: bool, as_wire: bool = False
    ) -> ep.ProcessingResponse | bytes:
        """The answer carrying the destination: headers answer (FULL_DUPLEX) or body answer
        (BUFFERED). Without decision headers it only depends on the endpoint list, so it is
        built once per endpoint list and reused (never mutated after it is cached), as is
        its serialized form (`as_wire`: returned for our transport)."""
        ends = P.join_endpoints(d.endpoints)
        key = (ends, full_duplex)
        if not self.decision_headers:
            if as_wire:
                data = self._answers_wire.get(key)
                if data is not None:
                    return data
            cached = self._answers.get(key)
            if cached is not None:
                if as_wire:
                    data = self._answers_wire[key] = cached.SerializeToString()
                    return data
                return cached
        mutation = self._mutation(d)
        metadata = P.destination_metadata(ends)
        if full_duplex:
            resp = P.continue_headers(mutation, metadata)
            if not self.track_responses:
                resp.mode_override.CopyFrom(self._skip_response)
        else:
            resp = P.continue_body(mutation, metadata)
        if not self.decision_headers:
            if len(self._answers) >= 4096:  # bounded: endpoint lists come from the pool
                self._answers.clear()
                self._answers_wire.clear()
            self._answers[key] = resp
            if as_wire:
                data = self._answers_wire[key] = resp.SerializeToString()
                return data
        return resp

    def _routed(self, d: Decision) -> tuple[str | None, str]:
        """(id of the followed request or None, outcome) after the routing answer."""
        if not d.endpoints:
            return None, _OUTCOME_BY_STATUS.get(d.status, "no_endpoint")
        rid = d.request_id if self.director.is_live(d.request_id) else None
        return rid, "routed"

    def _mutation(self, d: Decision) -> ep.HeaderMutation:
        extra = None
        if self.decision_headers:
            extra = {P.REASON_HEADER: str(d.reason), P.MATCHED_HEADER: str(d.matched_tokens)}
        return P.destination_mutation(P.join_endpoints(d.endpoints), extra)

    def _headers_answer(self, d: Decision) -> ep.ProcessingResponse:
        if not d.endpoints:
            return self._error_answer(d)
        ends = P.join_endpoints(d.endpoints)
        resp = P.continue_headers(self._mutation(d), P.destination_metadata(ends))
        if not self.track_responses:
            resp.mode_override.CopyFrom(self._skip_response)
        return resp

    @staticmethod
    def _error_answer(d: Decision) -> ep.ProcessingResponse:
        return P.immediate_response(d.status, Director.refusal_body(d), str(d.reason))

    # ------------------------------------------------------------------ response path

    async def _response_phase(
        self,
        rid: str,
        context: StreamContext,
        response_mode: int,
    ) -> bool:
        """Follow the response until Envoy closes the stream (end of the HTTP exchange).
        Returns True when it ended in-band."""
        # How to cancel this handler where it waits: our transport's stream knows (its
        # handler may run without a task); grpc.aio runs it on a task.
        stop: Callable[[], object] | None
        if isinstance(context, H2Stream):
            stop = context.interrupt
        else:
            task = asyncio.current_task()
            stop = task.cancel if task is not None else None
        if stop is None or self._releasing:
            return False
        self._following.add(stop)
        try:
            await self._follow(rid, context, response_mode)
            return True
        except asyncio.CancelledError:
            if not self._releasing:
                raise
            # Shutdown: end the stream with OK. Envoy then finishes the HTTP exchange
            # without us (a reset stream would make it abort a streaming response).
            return False
        finally:
            self._following.discard(stop)

    def release_streams(self) -> int:
        """Shutdown: close every stream that only waits for its response to end, with OK
        status, so long generations survive the scorer's exit. Returns how many."""
        self._releasing = True
        n = len(self._following)
        for stop in list(self._following):
            stop()
        return n

    async def _follow(
        self,
        rid: str,
        context: StreamContext,
        response_mode: int,
    ) -> None:
        """The response: headers, then body chunks (each answered at once, in order, with
        the same bytes: `streamed_response` in FULL_DUPLEX_STREAMED, CONTINUE otherwise),
        then trailers. The director sees every chunk after it has been answered."""
        director = self.director
        write = context.write
        duplex = response_mode == P.FULL_DUPLEX
        # Body chunks reach us in any mode but NONE (a mode Envoy did not announce: none).
        bodies = response_mode != P.ProcessingMode.NONE
        on_message = None
        if isinstance(context, H2Stream):  # our transport (grpc.aio has no such hook)
            on_message = context.on_message
            lane = (
                duplex,
                self._continue_response_body_wire,
                self._valid_meta,
                director.response_chunk,
                rid,
            )
            # The answerer is built on the first response message: the lean shape sends
            # none, so most streams never need it.
            on_message(_Lazy(self._answerer, rid, context, duplex, bodies), lane)
        try:
            while True:
                m = await context.read()
                if m is _EOF:
                    return
                assert isinstance(m, ep.ProcessingRequest)
                k = m.WhichOneof("request")
                if k == "response_body":
                    rb = m.response_body
                    data, end = rb.body, rb.end_of_stream
                    if duplex:
                        await write(P.streamed_response_body(data, end))
                    else:
                        await write(self._continue_response_body_wire)
                    director.response_chunk(rid, data, end)
                elif k == "response_headers":
                    self._response_started(rid, m, bodies)
                    if self.echo_served:
                        await write(conformance.served_response(m))
                    else:
                        await write(self._continue_response_headers_wire)
                    if m.response_headers.end_of_stream:
                        director.response_ended(rid)
                        return
                elif k == "response_trailers":
                    await write(self._continue_response_trailers_wire)
                    director.response_ended(rid)
                else:
                    await self._passthrough(m, context)
        finally:
            if on_message is not None:
                on_message(None)

    def _response_started(self, rid: str, m: ep.ProcessingRequest, bodies: bool) -> None:
        """Tell the director the response's status, content type and served endpoint."""
        status = P.response_status(m) or None
        ctype = P.header_value(m.response_headers, "content-type")
        if self.director.response_started(rid, status, P.served_endpoint(m), ctype, bodies):
            SERVED_MOVED.inc()

    def _answerer(
        self, rid: str, stream: H2Stream, duplex: bool, bodies: bool
    ) -> Callable[[bytes], bool]:
        """The response path answered inside our transport's frame loop (H2Stream
        `on_message`), no task switch per message: a body chunk is read from its wire
        bytes (scorer.extproc.wire) and answered with pre-encoded bytes, then the
        director sees it; response headers and trailers are answered at once, then read
        (protobuf) for the director. The director's part runs after the answers of the
        same read are written (`after_write`): the last chunk of a response carries its
        usage parse and the end-of-request bookkeeping, which Envoy would otherwise wait
        for. Anything else (end of stream on the headers, a shape
        the wire reader leaves to protobuf, a full send window) returns False and the
        `_follow` loop handles it, the reference path."""
        director = self.director
        write_now = stream.write_now
        after = stream.after_write  # the director's part runs once the answer is written
        continue_body = self._continue_response_body_wire
        continue_headers = self._continue_response_headers_wire
        continue_trailers = self._continue_response_trailers_wire
        headers_fast = not self.echo_served
        chunk = wire.body_chunk
        encode = wire.streamed_body_response
        resp_body = wire.RESP_RESPONSE_BODY
        headers_tag = wire.TAG_RESPONSE_HEADERS
        trailers_tag = wire.TAG_RESPONSE_TRAILERS

        valid_meta = self._valid_meta

        def answer(raw: bytes) -> bool:
            # Envoy writes the oneof member first: its tag byte says what the message is,
            # so headers and trailers go straight to protobuf (which decides as the
            # reference path does) and a body chunk to the wire reader.
            tag = raw[0] if raw else 0
            if tag == headers_tag:
                return headers_fast and answer_headers(raw)
            if tag == trailers_tag:
                return answer_trailers(raw)
            got = chunk(raw)
            if got is None:
                kind = wire.request_kind(raw)
                if kind == wire.REQ_RESPONSE_HEADERS and headers_fast:
                    return answer_headers(raw)
                if kind == wire.REQ_RESPONSE_TRAILERS:
                    return answer_trailers(raw)
                return False
            data, end, meta = got
            if meta and meta not in valid_meta:
                # The protobuf path would reject a malformed one: checked once per value
                # (Envoy sends the same few: the served endpoint's).
                try:
                    base_pb2.Metadata.FromString(meta)
                except DecodeError:
                    return False
                if len(valid_meta) >= 1024:  # bounded: a flood of new values does not grow it
                    valid_meta.clear()
                valid_meta.add(meta)
            if not write_now(encode(data, end, resp_body) if duplex else continue_body):
                return False
            after(director.response_chunk, rid, data, end)
            return True

        def answer_headers(raw: bytes) -> bool:
            try:
                m = ep.ProcessingRequest.FromString(raw)
            except DecodeError:
                return False
            if (
                m.WhichOneof("request") != "response_headers"
                or m.response_headers.end_of_stream
                or not write_now(continue_headers)
            ):
                return False
            after(self._response_started, rid, m, bodies)
            return True

        def answer_trailers(raw: bytes) -> bool:
            try:
                # The protobuf path would reject a bad one, or see another oneof member.
                m = ep.ProcessingRequest.FromString(raw)
            except DecodeError:
                return False
            if m.WhichOneof("request") != "response_trailers" or not write_now(continue_trailers):
                return False
            after(director.response_ended, rid)
            return True

        return answer

    async def _passthrough(
        self,
        m: ep.ProcessingRequest,
        context: StreamContext,
    ) -> None:
        """Answer a message we do not act on with an unchanged CONTINUE."""
        k = m.WhichOneof("request")
        resp = ep.ProcessingResponse()
        if k == "request_headers":
            resp.request_headers.response.status = ep.CommonResponse.CONTINUE
        elif k == "response_headers":
            resp.response_headers.response.status = ep.CommonResponse.CONTINUE
        elif k == "request_body":
            resp.request_body.response.status = ep.CommonResponse.CONTINUE
        elif k == "response_body":
            resp.response_body.response.status = ep.CommonResponse.CONTINUE
        elif k == "request_trailers":
            resp.request_trailers.SetInParent()
        elif k == "response_trailers":
            resp.response_trailers.SetInParent()
        else:
            return
        await context.write(resp)


class _Lazy:
    """A stream's response answerer, built (`make(*args)`) on its first response message:
    the lean shape sends none, so most streams never need one."""

    __slots__ = ("answer", "args", "make")

    def __init__(self, make: Callable[..., Callable[[bytes], bool]], *args: Any) -> None:
        self.make = make
        self.args = args
        self.answer: Callable[[bytes], bool] | None = None

    def __call__(self, raw: bytes) -> bool:
        answer = self.answer
        if answer is None:
            answer = self.answer = self.make(*self.args)
        return answer(raw)


def _serialize(message: ep.ProcessingResponse | bytes) -> bytes:
    # Pre-serialized answers (cached routing answers, wire-encoded bodies) pass through.
    return message if isinstance(message, bytes) else message.SerializeToString()


def add_to_server(servicer: ExtProcServicer, server: grpc.aio.Server) -> None:
    """Register the servicer on a grpc.aio server (the generated registration's method
    and deserializer; a serializer that also takes already-serialized answers)."""
    handler = grpc.stream_stream_rpc_method_handler(
        servicer.Process,
        request_deserializer=ep.ProcessingRequest.FromString,
        response_serializer=_serialize,
    )
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                "envoy.service.ext_proc.v3.ExternalProcessor", {"Process": handler}
            ),
        )
    )


PROCESS_PATH = "/envoy.service.ext_proc.v3.ExternalProcessor/Process"


def add_to_h2_server(servicer: ExtProcServicer, server: H2GrpcServer) -> None:
    """Register the servicer on our asyncio HTTP/2 server (server.extproc_transport)."""
    server.add_handler(PROCESS_PATH, servicer.Process, ep.ProcessingRequest.FromString)
