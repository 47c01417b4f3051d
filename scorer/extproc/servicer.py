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

    then, with extproc.track_responses: response_headers ─▶ first byte; stream end ─▶
    finished (also on error / cancel). Without it the stream is closed right after the
    routing answer (Envoy then continues the request without further calls; see
    docs/envoy.md "track_responses").

Errors become ImmediateResponses in the OpenAI error shape: 400 bad body, 413 body too
large, 503 no eligible endpoint, 429 shed.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from prometheus_client import Counter, Gauge, Histogram

from scorer.api.inference_metrics import RequestRecord, observe_request
from scorer.config import Config
from scorer.extproc import protocol as P
from scorer.extproc.transport import AbortStream, H2GrpcServer, StreamContext
from scorer.policy.simple import least_loaded, load_score
from scorer.router import Router
from scorer.routing import Decision, Reason, RoutingRequest, refuse

log = logging.getLogger("scorer.extproc")
_EOF: object = grpc.aio.EOF  # type: ignore[attr-defined]  # missing from grpc-stubs

STREAMS = Counter(
    "kv_scorer_extproc_streams_total",
    "ext_proc streams by outcome (routed, bad_request, too_large, no_endpoint, shed, "
    "refused, error, cancelled, empty)",
    ["outcome"],
)
ACTIVE = Gauge("kv_scorer_extproc_active_streams", "ext_proc streams open now")
ROUTE_SECONDS = Histogram(
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
    """`envoy.service.ext_proc.v3.ExternalProcessor` backed by a Router."""

    def __init__(self, config: Config, router: Router) -> None:
        self.config = config
        self.router = router
        self.pool = router.pool
        self.inflight = router.pool.inflight
        self.track_responses = config.extproc.track_responses
        self.max_body = config.extproc.max_body_bytes
        self.sheddable_header = config.extproc.sheddable_header.lower()
        # The session policy's header option names the header we read the session id from.
        session_opts = config.policies.get("session") or {}
        self.session_header = str(session_opts.get("header", P.SESSION_HEADER)).lower()
        self.decision_headers = config.extproc.decision_headers
        self.block_size = config.pool.block_size
        self.lora_names = frozenset(config.tokens.lora_base)
        self.draining = False
        # Handler tasks waiting in the response phase; release_streams() ends them cleanly.
        self._following: set[asyncio.Task[Any]] = set()
        self._releasing = False
        self._ids = itertools.count(1)
        # Prebuilt constant responses (no per-request allocation for the common answers).
        self._strip_forged = P.continue_headers(P.destination_mutation(None))
        self._continue_response_headers = P.continue_headers(response_path=True)
        self._skip_response = P.mode_override_skip_response()
        self._answers: dict[tuple[str, bool], ep.ProcessingResponse] = {}

    # ------------------------------------------------------------------ the RPC

    async def Process(  # type: ignore[override]
        self,
        request_iterator: AsyncIterator[ep.ProcessingRequest] | None,
        context: StreamContext,
    ) -> None:
        if self.draining:
            _STREAM_COUNTERS["refused"].inc()
            await context.abort(grpc.StatusCode.UNAVAILABLE, "kv-scorer is shutting down")
        ACTIVE.inc()
        t0 = time.perf_counter()
        # The inference extension's request families (scorer/api/inference_metrics.py).
        rec = RequestRecord(model="")
        rid: str | None = None
        outcome = "error"
        try:
            rid, outcome = await self._request_phase(context, rec)
            if rid is not None and self.track_responses:
                await self._response_phase(rid, context, rec)
                rec.duration_s = time.perf_counter() - t0
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
            ACTIVE.dec()
            _STREAM_COUNTERS[outcome].inc()
            if rid is not None:
                self.inflight.finished(rid)
            if outcome not in ("empty", "refused") and (rec.routed or rec.status):
                observe_request(rec)

    # ------------------------------------------------------------------ request path

    async def _request_phase(
        self, context: StreamContext, rec: RequestRecord
    ) -> tuple[str | None, str]:
        """Read the request, answer with the destination. Returns (in-flight id, outcome)."""
        msg = await context.read()
        if msg is _EOF:
            return None, "empty"
        assert isinstance(msg, ep.ProcessingRequest)
        kind = msg.WhichOneof("request")
        if kind != "request_headers":
            # Request processing skipped by the proxy config: nothing to route here.
            await self._passthrough(msg, context)
            return None, "empty"
        headers = P.header_map(msg.request_headers)
        req = RoutingRequest(
            request_id=headers.get("x-request-id") or f"r{next(self._ids)}",
            path=headers.get(":path", "/"),
            method=headers.get(":method", "POST"),
            subset=P.subset_hint(msg),
            session_id=headers.get(self.session_header),
            sheddable=P.truthy(headers.get(self.sheddable_header)),
        )

        if msg.request_headers.end_of_stream:
            d = self.route_bodyless(req)
            rec.routed, rec.status = bool(d.endpoints), 0 if d.endpoints else d.status
            await context.write(self._headers_answer(d))
            return self._routed(req, d)

        full_duplex = True
        if msg.HasField("protocol_config"):
            full_duplex = msg.protocol_config.request_body_mode == P.FULL_DUPLEX
        if not full_duplex:
            # BUFFERED: Envoy waits for this answer before it sends the body.
            await context.write(self._strip_forged)

        chunks: list[bytes] = []
        size = 0
        trailers = False
        while True:
            m = await context.read()
            if m is _EOF:
                return None, "cancelled"
            assert isinstance(m, ep.ProcessingRequest)
            k = m.WhichOneof("request")
            if k == "request_body":
                b = m.request_body.body
                if b:
                    chunks.append(b)
                    size += len(b)
                if size > self.max_body:
                    rec.status = 413
                    await context.write(
                        P.immediate_error(
                            413,
                            f"request body larger than {self.max_body} bytes",
                            code="body_too_large",
                        )
                    )
                    return None, "too_large"
                if m.request_body.end_of_stream or m.request_body.end_of_stream_without_message:
                    break
            elif k == "request_trailers":
                trailers = True
                break
            else:
                # Unexpected order (e.g. response before request end): let it pass.
                await self._passthrough(m, context)
        body = chunks[0] if len(chunks) == 1 else b"".join(chunks)

        t0 = time.perf_counter()
        d = await self.route_body(req, body)
        ROUTE_SECONDS.observe(time.perf_counter() - t0)
        rec.model = req.model or ""
        rec.request_bytes = size
        rec.routed = bool(d.endpoints)
        if not d.endpoints:
            rec.status = d.status
            await context.write(self._error_answer(d))
            return None, _OUTCOME_BY_STATUS.get(d.status, "no_endpoint")

        await context.write(self._routing_answer(d, full_duplex))
        if full_duplex:
            for r in P.streamed_body(body, end_of_stream=not trailers):
                await context.write(r)
        if trailers:
            await context.write(P.continue_trailers())
        return self._routed(req, d)

    def _routing_answer(self, d: Decision, full_duplex: bool) -> ep.ProcessingResponse:
        """The answer carrying the destination: headers answer (FULL_DUPLEX) or body answer
        (BUFFERED). Without decision headers it only depends on the endpoint list, so it is
        built once per endpoint list and reused (never mutated after it is cached)."""
        ends = P.join_endpoints(d.endpoints)
        key = (ends, full_duplex)
        if not self.decision_headers:
            cached = self._answers.get(key)
            if cached is not None:
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
            self._answers[key] = resp
        return resp

    async def route_body(self, req: RoutingRequest, body: bytes) -> Decision:
        """Parse the body into `req` and route it (400 decision on a bad body)."""
        if not body:
            return self.route_bodyless(req)
        t0 = time.perf_counter()
        try:
            doc = P.parse_body(body)
        except P.BadRequest as e:
            d = refuse(self.router.policy.name, Reason.BAD_REQUEST, 400, e.message)
            d.notes.append(f"param={e.param}")
            d.request_id = req.request_id
            self.router.record(d)
            return d
        model: str = doc["model"]
        req.model = model
        req.body = doc
        salt = doc.get("cache_salt")
        if isinstance(salt, str) and salt:
            req.cache_salt = salt
        if model in self.lora_names:
            req.lora = model
        # Estimate until the tokens stage knows better (~4 bytes per token of JSON).
        req.prompt_tokens = len(body) // 4
        # The body decode is the data path's stage; the router merges it into the decision.
        req.stages["parse"] = time.perf_counter() - t0
        if self.pool.serves_model(model):
            return await self.router.route(req)
        d = refuse(
            self.router.policy.name,
            Reason.NO_WORKERS,
            503,
            f"the model {model!r} is not served here",
        )
        d.request_id = req.request_id
        d.model = model
        d.stages.update(req.stages)
        self.router.record(d)
        return d

    def route_bodyless(self, req: RoutingRequest) -> Decision:
        """Requests without a body (GET /v1/models) go to the least-loaded eligible worker."""
        t0 = time.perf_counter()
        candidates = self.pool.eligible(None, req.subset)
        if not candidates:
            reason = Reason.SUBSET_EMPTY if req.subset is not None else Reason.NO_WORKERS
            d = refuse(self.router.policy.name, reason, 503, "no eligible endpoint")
        else:
            w = least_loaded(candidates, self.router.policy.ctx)
            d = Decision(
                endpoints=[w.endpoint],
                reason=Reason.NO_BODY,
                policy=self.router.policy.name,
                candidates=[load_score(c) for c in candidates],
            )
        d.request_id = req.request_id
        d.stages["total"] = time.perf_counter() - t0
        self.router.record(d)
        return d

    def _routed(self, req: RoutingRequest, d: Decision) -> tuple[str | None, str]:
        if not d.endpoints:
            return None, _OUTCOME_BY_STATUS.get(d.status, "no_endpoint")
        if not self.track_responses:
            return None, "routed"
        bs = req.block_size or self.block_size
        total = req.prompt_tokens / bs
        prefill = max(total - d.matched_tokens / bs, 0.0)
        self.inflight.routed(req.request_id, d.endpoints[0], req.prompt_tokens, prefill, total)
        return req.request_id, "routed"

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
        param = None
        for n in d.notes:
            if n.startswith("param="):
                param = n[6:] if n[6:] != "None" else None
        return P.immediate_error(d.status, d.message or str(d.reason), param, str(d.reason))

    # ------------------------------------------------------------------ response path

    async def _response_phase(
        self,
        rid: str,
        context: StreamContext,
        rec: RequestRecord,
    ) -> None:
        """Follow the response until Envoy closes the stream (end of the HTTP exchange)."""
        task = asyncio.current_task()
        if task is None or self._releasing:
            return
        self._following.add(task)
        try:
            await self._follow(rid, context, rec)
        except asyncio.CancelledError:
            if not self._releasing:
                raise
            # Shutdown: end the stream with OK. Envoy then finishes the HTTP exchange
            # without us (a reset stream would make it abort a streaming response).
        finally:
            self._following.discard(task)

    def release_streams(self) -> int:
        """Shutdown: close every stream that only waits for its response to end, with OK
        status, so long generations survive the scorer's exit. Returns how many."""
        self._releasing = True
        n = len(self._following)
        for t in list(self._following):
            t.cancel()
        return n

    async def _follow(
        self,
        rid: str,
        context: StreamContext,
        rec: RequestRecord,
    ) -> None:
        while True:
            m = await context.read()
            if m is _EOF:
                return
            assert isinstance(m, ep.ProcessingRequest)
            k = m.WhichOneof("request")
            if k == "response_headers":
                status = P.response_status(m)
                if status:
                    rec.status, rec.from_model_server = status, True
                served = P.served_endpoint(m)
                if served is not None and served != self.inflight.endpoint_of(rid):
                    SERVED_MOVED.inc()
                    self.inflight.moved(rid, served)
                self.inflight.first_byte(rid)
                await context.write(self._continue_response_headers)
                if m.response_headers.end_of_stream:
                    return
            else:
                await self._passthrough(m, context)

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


def add_to_server(servicer: ExtProcServicer, server: grpc.aio.Server) -> None:
    """Register the servicer on a grpc.aio server."""
    ep_grpc.add_ExternalProcessorServicer_to_server(servicer, server)


PROCESS_PATH = "/envoy.service.ext_proc.v3.ExternalProcessor/Process"


def add_to_h2_server(servicer: ExtProcServicer, server: H2GrpcServer) -> None:
    """Register the servicer on our asyncio HTTP/2 server (server.extproc_transport)."""
    server.add_handler(PROCESS_PATH, servicer.Process, ep.ProcessingRequest.FromString)
