"""The director: one request's life between the data path and the decision.

The inference extension splits its picker the same way (pkg/epp/handlers/server.go speaks
ext_proc; pkg/epp/requestcontrol/director.go owns the request). Every caller goes through
here: the ext_proc servicer, the `scorer.v1` Score RPC and `/debug/score` (dry runs), and
the replay benchmark. Nothing else admits, refuses, decides or counts a request in flight.

    request received (headers, body) ─▶ admission: body size, parse (400/413)
        ─▶ eligible workers (model, health, subset; 503) ─▶ tokens (when the policy needs
        them, in a thread pool; 413 past the prompt budget) ─▶ policy.decide ─▶ record
        (decision log + metrics, once) ─▶ in flight (unless dry run)
    response started (status, served endpoint) ─▶ prefill over, the status the client got
        (never called with the lean envoy/envoy.yaml: Envoy skips the response headers)
    response ended / reset ─▶ in flight released, completion hooks called (the lean
        shape's only response signal: the ext_proc stream's end, when Envoy's HTTP
        stream is over; docs/envoy.md "The lean shape")

Refusals carry their status from `scorer.routing.REFUSAL_STATUS` and their body in the one
OpenAI error shape (`scorer.errors`).
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import msgspec
from prometheus_client import Counter

from scorer import body as body_json
from scorer.config import Config
from scorer.decisions import DecisionLog
from scorer.errors import error_body
from scorer.policy.base import Policy
from scorer.policy.metrics import observe_decision
from scorer.policy.profile import Profile
from scorer.policy.profiles import least_loaded
from scorer.policy.session import session_header
from scorer.pool.prefill import ARRIVAL_S, PrefillModel, bracketed_prefill, scrape_correction
from scorer.pool.workers import Pool, PoolChange
from scorer.routing import Decision, Reason, RoutingRequest, refuse
from scorer.usage import OUTCOMES as USAGE_OUTCOMES
from scorer.usage import Usage, UsageReader

if TYPE_CHECKING:
    from scorer.pool.workers import Worker

log = logging.getLogger("scorer.director")
_json_encoder = msgspec.json.Encoder()


class BadRequest(Exception):
    """The request body cannot be routed (400 in the OpenAI error shape)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


def parse_body(body: bytes, native: bool = True) -> dict[str, Any]:
    """Decode an OpenAI request body once; raise BadRequest (400) when it cannot be routed.

    A large body's token-id `prompt` stays packed (`scorer.body.PackedIds`); `native=False`
    is the reference decode (tests/test_parse_body.py compares both).
    """
    try:
        doc = body_json.decode(body, native)
    except (msgspec.DecodeError, UnicodeDecodeError) as e:
        raise BadRequest(f"request body is not valid JSON: {e}") from None
    except RecursionError:  # JSON nested ~1,000 deep: the client's error, not ours
        raise BadRequest("request body is nested too deeply") from None
    if not isinstance(doc, dict):
        raise BadRequest("request body must be a JSON object")
    model = doc.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("you must provide a model parameter", param="model")
    return doc


def truthy(value: str | None) -> bool:
    """A header flag: "1", "true", "yes", "on" (any case) are true."""
    return value is not None and value.strip().lower() in ("1", "true", "yes", "on")


class RequestPreparer(Protocol):
    """Fills `token_ids`, `block_keys`, `block_size` and `prompt_tokens` of a request.

    Implemented by scorer.tokens. Leaves `token_ids` None when the model has no tokenizer
    (the policy then routes by load with reason no_tokenizer), sets `tokenize_error`
    when the body cannot be rendered and `over_budget` when the prompt is past the
    per-request budget (`tokens.max_prompt_tokens`, `tokens.max_tokenize_bytes`: 413).
    """

    async def prepare(self, request: RoutingRequest) -> None: ...


@dataclass(slots=True)
class Completion:
    """One request the data path is done with, as completion hooks see it (metrics).

    Emitted once per request that got a decision (never for dry runs): at the refusal, at
    the routing answer when responses are not followed, else at the response's end.
    """

    request_id: str
    model: str | None
    endpoint: str | None  # None when refused
    routed: bool
    # The HTTP status: the refusal's, or the worker's from the response headers; None
    # when unknown (responses not followed, or reset before the response began).
    status: int | None
    from_model_server: bool  # `status` came from the worker's response
    duration_s: float | None  # request headers → end of the response (followed only)
    request_bytes: int | None
    reset: bool = False  # ended by a reset (client gone, upstream failure)
    # From the response body (followed responses with bodies only; None: unknown).
    response_bytes: int | None = None
    input_tokens: int | None = None  # usage.prompt_tokens
    output_tokens: int | None = None  # usage.completion_tokens
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens


@dataclass(slots=True)
class _Live:
    decision: Decision
    started: float  # perf_counter at the request headers
    request_bytes: int | None
    routed_at: float = 0.0  # director clock at the decision
    uncached_tokens: float = 0.0  # prompt tokens the decision expected to prefill
    stream: bool = False  # the request asked for a streamed response
    block_size: int = 16
    status: int | None = None
    reader: UsageReader | None = None  # set when the response headers arrive
    prefill_over: bool = False
    estimated: bool = False  # a prefill end estimate is scheduled
    bodies: bool = False  # its response body chunks reach the director
    routed_page: int = 0  # the worker's scrape page count at the decision
    tracked: str | None = None  # endpoint whose prefilling map holds it (scrape correction)
    fitting: str | None = None  # endpoint whose pages will date its first token (the fit)
    held_at: float = 0.0  # director clock of the last page that held it before its first token


USAGE = Counter(
    "kv_scorer_response_usage_total",
    "Followed responses by what reading their usage found "
    "(ok, absent, malformed, not_json, too_large, empty)",
    ["outcome"],
)
TOKENS = Counter(
    "kv_scorer_response_tokens_total",
    "Tokens reported by responses' usage, by model, endpoint and kind (input, output, "
    "cached = prompt_tokens_details.cached_tokens)",
    ["model", "endpoint", "kind"],
)
_USAGE_COUNTERS = {o: USAGE.labels(o) for o in USAGE_OUTCOMES}
# Model names come from request bodies: label values are capped (later names share one).
_MAX_MODELS = 256
_OTHER_MODEL = "__other__"


CompletionHook = Callable[[Completion], None]


def _drop_flight(table: dict[str, dict[str, _Live]], ep: str, request_id: str) -> bool:
    """Drop `request_id` from `ep`'s flights in `table`; True when that emptied them
    (the endpoint's entry is then gone)."""
    flights = table.get(ep)
    if flights is None:
        return False
    flights.pop(request_id, None)
    if flights:
        return False
    del table[ep]
    return True


class Director:
    """Owns admission, refusal, the decision, in-flight accounting and response hooks."""

    def __init__(
        self,
        config: Config,
        pool: Pool,
        policy: Policy,
        decisions: DecisionLog | None = None,
        preparer: RequestPreparer | None = None,
    ) -> None:
        self.config = config
        self.pool = pool
        self.policy = policy
        self.decisions = decisions if decisions is not None else DecisionLog()
        self.preparer = preparer
        self.inflight = pool.inflight
        ex = config.extproc
        # Without response tracking the data path never reports a response: nothing may be
        # counted in flight then (it would never be released).
        self.follows_responses = ex.track_responses
        self.max_body_bytes = ex.max_body_bytes
        self._sheddable_header = ex.sheddable_header.lower()
        self._session_header = session_header(config)
        self._block_size = config.pool.block_size
        # (bound once: each attribute read on a config model goes through pydantic's
        # __getattr__ hook, ~350 instructions)
        self._adapter_of = config.tokens.adapter_of
        # Bodyless requests (GET /v1/models) go to the least loaded, whatever the policy.
        self._bodyless = Profile(policy.ctx, policy.name, least_loaded({}))
        self._live: dict[str, _Live] = {}
        self._ids = itertools.count(1)
        self._models: set[str] = set()
        # Prefill end of requests the response will not tell about in time (non-streaming,
        # or streams whose body Envoy does not send): (deadline, request id), a heap.
        self.prefill = PrefillModel()
        # The cost's predicted TTFT reads the same fitted model (scorer.policy.cost).
        policy.ctx.parts.prefill = self.prefill
        self.clock: Callable[[], float] = time.perf_counter
        self._prefill_due: list[tuple[float, str]] = []
        # Requests with a body still prefilling, per endpoint, oldest first; and the scrape
        # page of each endpoint already applied to them (page count, director clock when
        # first seen). The scrape correction (scorer.pool.prefill) works on these.
        self._prefilling: dict[str, dict[str, _Live]] = {}
        self._pages: dict[str, tuple[int, float]] = {}
        self._stale_after_s = config.load.stale_after_s
        self._recheck_s = config.load.scrape_interval_s
        # Requests whose first token no page has dated yet, per endpoint, routing order;
        # and the page count of each endpoint already read for them (the fit from scrapes,
        # while no response body teaches the model: scorer.pool.prefill).
        self._fit_scrapes = config.load.fit_prefill_from_scrapes
        self._unfitted: dict[str, dict[str, _Live]] = {}
        # Every page as it is applied: read lazily (at the next decision) a page would be
        # dated late and the pages between two decisions lost, widening every bracket.
        pool.page_listeners.append(self._page_applied)
        pool.prefill = self.prefill  # shown in /debug/pool
        # TOKENS children per endpoint: {endpoint: {(model, kind): child}}, dropped (and the
        # series removed) when the worker leaves the pool: pods churn, series must not grow.
        self._token_counters: dict[str, dict[tuple[str, str], Any]] = {}
        pool.subscribe(self._pool_changed)
        # Called once per request that was routed and followed, when it ends. The hook point
        # for request metrics (model, endpoint, status, duration). Hooks must not raise.
        self.completion_hooks: list[CompletionHook] = []

    # ------------------------------------------------------------------ request

    def new_request(
        self, headers: Mapping[str, str], subset: frozenset[str] | None = None
    ) -> RoutingRequest:
        """A RoutingRequest from the request headers (lower-case names)."""
        get = headers.get
        shed = get(self._sheddable_header)
        # Positional, in RoutingRequest's field order (keywords cost a dict per call):
        # request_id, headers, model, path, method, body, subset, session_id, lora,
        # cache_salt, sheddable.
        return RoutingRequest(
            get("x-request-id") or f"r{next(self._ids)}",
            headers,
            None,
            get(":path", "/"),
            get(":method", "POST"),
            None,
            subset,
            get(self._session_header),
            None,
            None,
            shed is not None and truthy(shed),
        )

    def too_large(self, request: RoutingRequest) -> Decision:
        """Admission: the body grew over `extproc.max_body_bytes` (413, recorded)."""
        return self._refuse(
            request,
            Reason.TOO_LARGE,
            f"request body larger than {self.max_body_bytes} bytes",
        )

    async def request_received(
        self, request: RoutingRequest, body: bytes | None, dry_run: bool = False
    ) -> Decision:
        """The whole request is here: parse its body, decide, count it in flight."""
        if not body:
            return self.route_bodyless(request, dry_run)
        request.body_bytes = len(body)
        t0 = time.perf_counter()
        try:
            doc = parse_body(body)
        except BadRequest as e:
            return self._refuse(request, Reason.BAD_REQUEST, e.message, e.param)
        model: str = doc["model"]
        request.model = model
        request.body = doc
        salt = doc.get("cache_salt")
        if isinstance(salt, str) and salt:
            request.cache_salt = salt
        request.lora = self._adapter_of(model)
        # Estimate until the tokens stage knows better (~4 bytes per token of JSON).
        request.prompt_tokens = len(body) // 4
        # The body decode is this stage; the decision's total includes it.
        request.stages["parse"] = time.perf_counter() - t0
        if not self.pool.serves_model(model):
            request.dry_run = dry_run
            return self._refuse(
                request, Reason.NO_WORKERS, f"the model {model!r} is not served here"
            )
        if self.policy.needs_tokens and self.preparer is not None:
            return await self.decide(request, dry_run)
        # Nothing to tokenize: decide's path without its coroutine.
        return self.decide_prepared(request, dry_run)

    async def decide(self, request: RoutingRequest, dry_run: bool = False) -> Decision:
        """Decide where a parsed request goes (tokenizing first when the policy needs it)."""
        t0 = time.perf_counter()
        request.dry_run = dry_run
        pool = self.pool
        candidates = pool.eligible(request.model, request.subset)
        if not candidates:
            return self._no_candidates(request)
        if (
            self.policy.needs_tokens
            and self.preparer is not None
            and request.body
            and request.token_ids is None
        ):
            changes = pool.changes
            t_tok = time.perf_counter()
            await self.preparer.prepare(request)
            request.stages.setdefault("tokenize", time.perf_counter() - t_tok)
            if request.over_budget is not None:  # past the tokens stage's CPU budget
                param = "messages" if "messages" in request.body else "prompt"
                return self._refuse(request, Reason.PROMPT_TOO_LARGE, request.over_budget, param)
            if pool.changes != changes:
                # The pool changed while the prompt was tokenized (scorer.pool.discovery):
                # never decide for a worker that has left it since.
                workers = pool.workers
                candidates = [w for w in candidates if workers.get(w.endpoint) is w]
                if not candidates:
                    return self._no_candidates(request)
        return self._decide(request, candidates, t0)

    def decide_prepared(self, request: RoutingRequest, dry_run: bool = False) -> Decision:
        """Decide for a request whose tokens are filled (or not needed), synchronously.

        The replay benchmark calls this directly: its requests carry their block keys.
        """
        t0 = time.perf_counter()
        request.dry_run = dry_run
        candidates = self.pool.eligible(request.model, request.subset)
        if not candidates:
            return self._no_candidates(request)
        return self._decide(request, candidates, t0)

    def _no_candidates(self, request: RoutingRequest) -> Decision:
        if request.subset is not None and self.pool.eligible(request.model, None):
            return self._refuse(
                request, Reason.SUBSET_EMPTY, "no eligible endpoint matches the subset hint"
            )
        if request.model is None:
            return self._refuse(request, Reason.NO_WORKERS, "no healthy endpoint")
        return self._refuse(
            request, Reason.NO_WORKERS, f"no healthy endpoint serves model {request.model!r}"
        )

    def _decide(self, request: RoutingRequest, candidates: Sequence[Worker], t0: float) -> Decision:
        if self._prefill_due or self._prefilling:
            self.expire_prefill()
        policy = self.policy
        t_dec = time.perf_counter()
        if request.dry_run:
            rng = policy.ctx.rng
            state = rng.getstate()
            try:
                d = policy.decide(request, candidates)
            finally:
                rng.setstate(state)
        else:
            d = policy.decide(request, candidates)
        now = time.perf_counter()
        d.stages.setdefault("policy", now - t_dec)
        return self._decided(request, d, t0, now)

    def route_bodyless(self, request: RoutingRequest, dry_run: bool = False) -> Decision:
        """Requests without a body (GET /v1/models) go to the least-loaded eligible worker."""
        t0 = time.perf_counter()
        request.dry_run = dry_run
        candidates = self.pool.eligible(None, request.subset)
        if not candidates:
            return self._no_candidates(request)
        rng = self.policy.ctx.rng
        state = rng.getstate() if dry_run else None
        d = self._bodyless.decide(request, candidates)
        if state is not None:
            rng.setstate(state)
        d.reason = Reason.NO_BODY
        return self._decided(request, d, t0)

    def _refuse(
        self,
        request: RoutingRequest,
        reason: Reason,
        message: str,
        param: str | None = None,
    ) -> Decision:
        d = refuse(self.policy.name, reason, message)
        d.param = param
        return self._decided(request, d, time.perf_counter())

    def _decided(
        self, request: RoutingRequest, d: Decision, t0: float, now: float | None = None
    ) -> Decision:
        """Bookkeeping of every decision, exactly once: log, metrics, in flight. `now`:
        perf_counter at the decision's end, when the caller just read it."""
        if now is None:
            now = time.perf_counter()
        stages = d.stages
        rstages = request.stages
        for stage, seconds in rstages.items():
            stages.setdefault(stage, seconds)
        rid = d.request_id = request.request_id
        d.model = request.model
        d.request_tokens = d.request_tokens or request.prompt_tokens
        # total = parse → endpoint: the parse stage plus everything since t0.
        stages["total"] = now - t0 + rstages.get("parse", 0.0)
        self.decisions.add(d)
        observe_decision(d)
        if request.dry_run:
            return d
        size = request.body_bytes or None
        eps = d.endpoints
        if eps and self.follows_responses:
            ep = eps[0]
            bs = request.block_size or self._block_size
            tokens = request.prompt_tokens
            total = tokens / bs
            prefill = total - d.matched_tokens / bs
            if prefill < 0.0:  # (max(prefill, 0.0) without the builtin's argument parse)
                prefill = 0.0
            self.inflight.routed(rid, ep, tokens, prefill, total)
            body = request.body
            # (positional: decision, started, request_bytes, routed_at, uncached_tokens,
            # stream, block_size)
            clock = self.clock
            live = _Live(
                d,
                request.started,
                size,
                # (the decision's end is the director clock's now, unless a test swapped it)
                now if clock is time.perf_counter else clock(),
                prefill * bs,
                body is not None and body.get("stream") is True,
                bs,
            )
            self._live[rid] = live
            if body is not None:
                # Requests with a body get an estimated prefill end; the response ends it
                # earlier when it can (first body chunk of a stream, headers otherwise).
                live.estimated = True
                w = self.pool.workers.get(ep)
                live.routed_page = w.scraped.pages if w is not None else 0
                live.tracked = ep  # (_track, inlined)
                tracked = self._prefilling.get(ep)
                if tracked is None:
                    tracked = self._prefilling[ep] = {}
                tracked[rid] = live
                if self._fit_scrapes and not self.prefill.exact:
                    live.fitting = ep
                    flights = self._unfitted.get(ep)
                    if flights is None:
                        flights = self._unfitted[ep] = {}
                    flights[rid] = live
                due = live.routed_at + self.prefill.estimate(live.uncached_tokens)
                heapq.heappush(self._prefill_due, (due, rid))
        elif self.completion_hooks:
            routed = bool(d.endpoints)
            self._complete(
                Completion(
                    request_id=request.request_id,
                    model=request.model,
                    endpoint=d.endpoint,
                    routed=routed,
                    status=None if routed else d.status,
                    from_model_server=False,
                    duration_s=None,
                    request_bytes=size,
                )
            )
        return d

    def _complete(self, done: Completion) -> None:
        for hook in self.completion_hooks:
            try:
                hook(done)
            except Exception:  # a broken hook must not break the data path
                log.exception("completion hook %r failed", hook)

    async def dry_run(self, body: Mapping[str, Any]) -> Decision:
        """The decision for a request body, changing no state (`/debug/score`).

        `token_ids` stands for a prompt of token ids.
        """
        doc = dict(body)
        ids = doc.pop("token_ids", None)
        if ids is not None and "prompt" not in doc and "messages" not in doc:
            doc["prompt"] = ids
        req = RoutingRequest(request_id=f"dry-{next(self._ids)}", path="/debug/score")
        return await self.request_received(req, _json_encoder.encode(doc), dry_run=True)

    def expire_prefill(self) -> int:
        """Move requests to decode whose prefill is over by the scrape correction or by
        their estimate (unless a fresh scrape holds them: scorer.pool.prefill). Returns
        how many. Runs before each decision: per worker with prefilling requests a page
        count comparison, and a heap peek when nothing is due."""
        now = self.clock()
        n = 0
        for ep in list(self._prefilling) if self._prefilling else ():
            w = self.pool.get(ep)
            page = w.scraped.pages if w is not None else 0
            if w is None or page == 0:
                continue
            known = self._pages.get(ep)
            if known is not None and known[0] == page:
                continue
            self._pages[ep] = (page, now)
            sc = w.scraped
            n += self._scrape_correction(ep, page, sc.running, sc.waiting, sc.before_first)
        due = self._prefill_due
        while due and due[0][0] <= now:
            _, rid = heapq.heappop(due)
            live = self._live.get(rid)
            if live is None or live.prefill_over:
                continue
            if self._held(rid, live, now):
                # The engine has a queue: look again after the next scrape.
                heapq.heappush(due, (now + self._recheck_s, rid))
                continue
            self._prefill_over(rid, live)
            n += 1
        return n

    def _page_applied(self, w: Worker) -> None:
        """A new metrics page of `w`: date first tokens by it and fit the prefill model.

        The page's count of requests before their first token (`before_first`) holds the
        newest that many of ours routed there (first come, first served); the older ones
        had their first token since the last page that held them (`bracketed_prefill`).
        Requests routed within `ARRIVAL_S` of the page may not have reached the engine
        yet: they wait for the next page.
        """
        flights = self._unfitted.get(w.endpoint)
        if not flights:
            return
        if self.prefill.exact:
            # A response body taught the model: it is exact, brackets are not needed.
            for each in self._unfitted.values():
                for live in each.values():
                    live.fitting = None
            self._unfitted.clear()
            return
        bf = w.scraped.before_first
        if bf is None:
            return
        page_at = self.clock()
        counted = [rid for rid, live in flights.items() if live.routed_at <= page_at - ARRIVAL_S]
        over = max(len(counted) - int(bf), 0)
        for rid in counted[:over]:
            live = flights.pop(rid)
            live.fitting = None
            seconds = bracketed_prefill(live.routed_at, page_at, live.held_at)
            self.prefill.observe(live.uncached_tokens, seconds, exact=False)
        for rid in counted[over:]:
            flights[rid].held_at = page_at
        if not flights:
            del self._unfitted[w.endpoint]

    def _unfit(self, request_id: str, live: _Live) -> None:
        ep, live.fitting = live.fitting, None
        if ep is not None:
            _drop_flight(self._unfitted, ep, request_id)

    def _scrape_correction(
        self,
        ep: str,
        page: int,
        running: float,
        waiting: float,
        before_first: float | None,
    ) -> int:
        """A new metrics page of `ep`: end the prefill of our oldest requests there that
        the engine no longer holds before their first token."""
        flights = self._prefilling.get(ep)
        if not flights:
            return 0
        # Routing order is page order: the requests the page must have seen come first.
        seen = sum(1 for live in flights.values() if live.routed_page + 2 <= page)
        end, _ = scrape_correction(seen, len(flights), running, waiting, before_first)
        for rid in list(flights)[:end]:
            self._prefill_over(rid, flights[rid])
        return end

    def _held(self, request_id: str, live: _Live, now: float) -> bool:
        """True when a fresh page of the worker shows waiting requests and this is one of
        the newest that many of ours prefilling there: its estimate alone does not end it."""
        ep = live.tracked
        flights = self._prefilling.get(ep) if ep is not None else None
        known = self._pages.get(ep) if ep is not None else None
        w = self.pool.get(ep) if ep is not None else None
        if not flights or known is None or w is None or now - known[1] > self._stale_after_s:
            return False
        _, hold = scrape_correction(0, len(flights), w.scraped.running, w.scraped.waiting)
        return hold > 0 and request_id in list(flights)[-hold:]

    def _track(self, request_id: str, live: _Live, endpoint: str) -> None:
        live.tracked = endpoint
        flights = self._prefilling.get(endpoint)
        if flights is None:
            flights = self._prefilling[endpoint] = {}
        flights[request_id] = live

    def _untrack(self, request_id: str, live: _Live) -> None:
        ep, live.tracked = live.tracked, None
        if ep is not None and _drop_flight(self._prefilling, ep, request_id):
            self._pages.pop(ep, None)

    def _prefill_over(self, request_id: str, live: _Live) -> None:
        live.prefill_over = True
        self._untrack(request_id, live)
        self.inflight.first_byte(request_id)

    @staticmethod
    def refusal_body(d: Decision) -> bytes:
        """The OpenAI error body of a refused decision."""
        return error_body(d.status, d.message or str(d.reason), d.param, str(d.reason))

    # ------------------------------------------------------------------ response

    def is_live(self, request_id: str) -> bool:
        """Whether the request is counted in flight (its response is being followed)."""
        return request_id in self._live

    def endpoint_of(self, request_id: str) -> str | None:
        """Where an in-flight request was routed (moved by a served-endpoint report)."""
        return self.inflight.endpoint_of(request_id)

    def response_started(
        self,
        request_id: str,
        status: int | None = None,
        served: str | None = None,
        content_type: str | None = None,
        bodies: bool = False,
    ) -> bool:
        """Response headers arrived. Returns True when Envoy served another endpoint.

        `bodies`: the response body chunks will reach the director (response_chunk).
        """
        live = self._live.get(request_id)
        if live is None:
            return False
        live.reader = UsageReader(content_type)
        live.bodies = bodies
        moved = False
        if served is not None and served != self.inflight.endpoint_of(request_id):
            self.inflight.moved(request_id, served)
            moved = True
            self._unfit(request_id, live)  # another worker's pages: its bracket is lost
            if live.tracked is not None:
                # It is the served worker's newest: only its pages from now on count it.
                self._untrack(request_id, live)
                w = self.pool.get(served)
                live.routed_page = w.scraped.pages if w is not None else 0
                self._track(request_id, live, served)
        if status is not None:
            live.status = status
            live.decision.response_status = status
        # A stream's headers come before its prefill ends (vLLM): its first body chunk, or
        # the estimate when the body does not reach us, ends prefill. Other responses'
        # headers come after the generation (vLLM, non-streaming): prefill is over.
        streaming = live.reader.streaming or live.stream
        wait = streaming and (bodies or live.estimated)
        if not live.prefill_over and not wait:
            self._prefill_over(request_id, live)
        return moved

    def response_chunk(self, request_id: str, data: bytes, end: bool) -> None:
        """A response body chunk went to the client (already answered: never held here).
        `end`: it was the last one (the response then ends)."""
        live = self._live.get(request_id)
        if live is None:
            return
        reader = live.reader
        if reader is not None:
            reader.feed(data)
            if reader.streaming:
                if not live.prefill_over:
                    # The first token: prefill is over; it also teaches the prefill model.
                    self.prefill.observe(live.uncached_tokens, self.clock() - live.routed_at)
                    self._prefill_over(request_id, live)
                # Decode load grows with generated tokens (~one per SSE event).
                events = data.count(b"data:")
                if events:
                    self.inflight.generated(request_id, events / live.block_size)
        if end:
            self.response_ended(request_id)

    def response_ended(self, request_id: str, reset: bool = False) -> None:
        """The response ended (end of stream, trailers) or the exchange was reset."""
        live = self._live.pop(request_id, None)
        if live is None:
            return
        ep = live.tracked
        if ep is not None:  # (_untrack, inlined)
            live.tracked = None
            if _drop_flight(self._prefilling, ep, request_id):
                self._pages.pop(ep, None)
        if live.fitting is not None:
            self._unfit(request_id, live)
        # (finished returns where it was in flight: a fallback Envoy served counts there)
        endpoint = self.inflight.finished(request_id) or live.decision.endpoints[0]
        usage: Usage | None = None
        body_bytes: int | None = None
        reader = live.reader
        if reader is not None:
            usage, outcome = reader.finish()
            _USAGE_COUNTERS[outcome].inc()
            body_bytes = reader.body_bytes if reader.chunks else None
            if usage is not None:
                self._count_tokens(live.decision.model, endpoint, usage)
        if reset and live.status is None:
            live.decision.notes.append("reset_before_response")
        if self.completion_hooks:
            status = live.status
            # (positional, in Completion's field order: keywords cost a dict per call)
            self._complete(
                Completion(
                    request_id,
                    live.decision.model,
                    endpoint,
                    True,
                    status,
                    status is not None,
                    time.perf_counter() - live.started,
                    live.request_bytes,
                    reset,
                    body_bytes,
                    usage.prompt_tokens if usage else None,
                    usage.completion_tokens if usage else None,
                    usage.cached_tokens if usage else None,
                )
            )

    def _count_tokens(self, model: str | None, endpoint: str, usage: Usage) -> None:
        by_ep = self._token_counters.get(endpoint)
        if by_ep is None:
            if self.pool.workers.get(endpoint) is None:
                # It left the pool while this response ran: its series are gone, and one
                # made again now would never be removed.
                return
            by_ep = self._token_counters[endpoint] = {}
        m = model or ""
        if m not in self._models:
            if len(self._models) >= _MAX_MODELS:
                m = _OTHER_MODEL
            else:
                self._models.add(m)
        for kind, n in (
            ("input", usage.prompt_tokens),
            ("output", usage.completion_tokens),
            ("cached", usage.cached_tokens),
        ):
            if n:
                key = (m, kind)
                c = by_ep.get(key)
                if c is None:
                    c = by_ep[key] = TOKENS.labels(m, endpoint, kind)
                c.inc(n)

    def _pool_changed(self, change: PoolChange) -> None:
        """A worker left: drop its kv_scorer_response_tokens_total series."""
        if change.change != "removed":
            return
        ep = change.worker.endpoint
        for m, kind in self._token_counters.pop(ep, {}):
            with contextlib.suppress(KeyError):
                TOKENS.remove(m, ep, kind)

    def __len__(self) -> int:
        """Requests in flight (followed)."""
        return len(self._live)
