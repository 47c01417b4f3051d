"""The router's own load accounting, from each request's lifecycle on the data path.

routed → (response headers: prefill done, first byte) → end of stream. Like Dynamo's
active-sequence tracking, this sees a burst before the next metrics scrape does.
All methods run on the event loop thread; no locks are needed.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class WorkerLoad:
    """In-flight counters for one worker (router's view)."""

    requests: int = 0  # routed, not yet finished
    prefill_tokens: int = 0  # prompt tokens of requests still waiting for their first byte
    prefill_blocks: float = 0.0  # uncached prompt blocks still in prefill
    prefill_requests: int = 0  # requests still waiting for their first byte
    decode_blocks: float = 0.0  # blocks held by requests that are decoding
    routed_total: int = 0


@dataclass(slots=True)
class _Flight:
    endpoint: str
    prompt_tokens: int
    prefill_blocks: float
    total_blocks: float
    in_prefill: bool = True


@dataclass
class InflightTracker:
    """Per-worker in-flight requests and prompt work, keyed by request id."""

    loads: dict[str, WorkerLoad] = field(default_factory=dict)
    _flights: dict[str, _Flight] = field(default_factory=dict)
    # Endpoints whose counters a pool worker holds (`load`), kept until `forget`. Any other
    # endpoint a request is served on (a fallback host outside the pool, a worker that just
    # left) has counters only while requests are in flight there: memory stays bounded by
    # the pool and the requests in flight.
    _members: set[str] = field(default_factory=set)

    def load(self, endpoint: str) -> WorkerLoad:
        """The counters of pool worker `endpoint` (created empty on first use)."""
        self._members.add(endpoint)
        return self._counters(endpoint)

    def _counters(self, endpoint: str) -> WorkerLoad:
        wl = self.loads.get(endpoint)
        if wl is None:
            wl = self.loads[endpoint] = WorkerLoad()
        return wl

    def routed(
        self,
        request_id: str,
        endpoint: str,
        prompt_tokens: int = 0,
        prefill_blocks: float = 0.0,
        total_blocks: float = 0.0,
    ) -> None:
        """A request was sent to `endpoint`; its prompt work counts until its first byte."""
        if request_id in self._flights:
            self.finished(request_id)
        wl = self.loads.get(endpoint)  # (_counters, inlined: once per request)
        if wl is None:
            wl = self.loads[endpoint] = WorkerLoad()
        wl.requests += 1
        wl.routed_total += 1
        wl.prefill_tokens += prompt_tokens
        wl.prefill_blocks += prefill_blocks
        wl.prefill_requests += 1
        self._flights[request_id] = _Flight(endpoint, prompt_tokens, prefill_blocks, total_blocks)

    def first_byte(self, request_id: str) -> None:
        """Prefill is over (the first token came, or its estimate says so): the request
        now decodes."""
        f = self._flights.get(request_id)
        if f is None or not f.in_prefill:
            return
        f.in_prefill = False
        wl = self._counters(f.endpoint)
        wl.prefill_tokens -= f.prompt_tokens
        wl.prefill_blocks -= f.prefill_blocks
        wl.prefill_requests -= 1
        wl.decode_blocks += f.total_blocks

    def generated(self, request_id: str, blocks: float) -> None:
        """The request generated `blocks` more KV blocks of output (decode load grows)."""
        f = self._flights.get(request_id)
        if f is None or blocks <= 0.0:
            return
        f.total_blocks += blocks
        if not f.in_prefill:
            self._counters(f.endpoint).decode_blocks += blocks

    def moved(self, request_id: str, endpoint: str) -> None:
        """Envoy reported it served the request on another endpoint (a fallback)."""
        f = self._flights.get(request_id)
        if f is None or f.endpoint == endpoint:
            return
        in_prefill = f.in_prefill
        self.finished(request_id)
        self.routed(request_id, endpoint, f.prompt_tokens, f.prefill_blocks, f.total_blocks)
        if not in_prefill:
            self.first_byte(request_id)

    def finished(self, request_id: str) -> str | None:
        """The stream ended (normally, by error or by client reset). Returns the endpoint
        it was in flight on (None: not in flight), as `endpoint_of` said before the call."""
        f = self._flights.pop(request_id, None)
        if f is None:
            return None
        wl = self.loads.get(f.endpoint)  # (_counters, inlined: once per request)
        if wl is None:
            wl = self.loads[f.endpoint] = WorkerLoad()
        wl.requests -= 1
        if f.in_prefill:
            wl.prefill_tokens -= f.prompt_tokens
            wl.prefill_blocks -= f.prefill_blocks
            wl.prefill_requests -= 1
        else:
            wl.decode_blocks -= f.total_blocks
        if wl.requests <= 0 and f.endpoint not in self._members:
            del self.loads[f.endpoint]
        return f.endpoint

    def drop_endpoint(self, endpoint: str) -> int:
        """Forget every in-flight request on `endpoint` (the worker was ejected): its counters
        go to zero and the streams' later `finished` calls are no-ops. Returns how many."""
        gone = [rid for rid, f in self._flights.items() if f.endpoint == endpoint]
        for rid in gone:
            del self._flights[rid]
        wl = self.loads.get(endpoint)
        if wl is not None:
            wl.requests = 0
            wl.prefill_tokens = 0
            wl.prefill_blocks = 0.0
            wl.prefill_requests = 0
            wl.decode_blocks = 0.0
        return len(gone)

    def forget(self, endpoint: str) -> None:
        """The worker left the pool: drop every flight routed to it (their ends, if they
        come, are then no-ops) and its counters, so a new worker at the address starts
        clean."""
        self.drop_endpoint(endpoint)
        self.loads.pop(endpoint, None)
        self._members.discard(endpoint)

    def endpoint_of(self, request_id: str) -> str | None:
        """Where an in-flight request was routed, if it is still in flight."""
        f = self._flights.get(request_id)
        return None if f is None else f.endpoint

    def __len__(self) -> int:
        return len(self._flights)
