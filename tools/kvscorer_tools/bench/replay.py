"""Deterministic discrete-event replay: our policies in-process against simulated workers.

Nothing here touches the network or the wall clock. Time is simulated: a heap of events
(arrivals, engine-step ends, metric scrapes). Each simulated worker is stepped like the
simulated worker's engine (`kvscorer_tools.sim.engine.Engine`), over the same
`kvscorer_tools.sim.cache.PrefixCache` (capacity, pinning, LRU eviction, hit counters) and
`kvscorer_tools.sim.timing.TimingModel`:

* a step is scheduled by the simulated worker's own function
  (`kvscorer_tools.sim.scheduler.schedule_step`, vLLM v1's chunked prefill): a budget of
  `max_num_batched_tokens` tokens, running requests first (1 token per decode, the next
  chunk of an unfinished prompt), then waiting requests FIFO (never skipping the head)
  while fewer than `max_num_seqs` run and the KV pool can hold their blocks (full prompt
  blocks, cached or new, plus anonymous blocks for the partial last block and every
  output token, reserved up front); a long prompt is prefilled over several steps, its
  full blocks stored (and fed to the index) chunk by chunk; a step lasts
  `prefill_ms(prompt tokens of the step) + decode_ms_per_token(decodes of the step)`;
* the hit is the longest cached prefix of full blocks at admission, capped so that one
  prompt token is computed (as vLLM does); queries and hits are counted in tokens when a
  request is admitted (`vllm:prefix_cache_queries` / `_hits`);
* the step that computes a prompt's last chunk gives its first token (TTFT), every
  scheduled decode one token; a request that has all its output tokens finishes and
  unpins its blocks (tail first); consecutive decode-only steps with nothing to change
  are one event;
* a request whose blocks exceed the worker's KV pool is rejected (an error).

The routing side is the real one: `scorer.policy.build_policy` with a real `Pool`,
`PolicyContext` and `BlockIndex` (``ctx.parts.index``), decided and accounted by the
data path's own `scorer.director.Director` driven by the simulated lifecycle (request
received at arrival, response started at the end of prefill, ended at the last token) and
the scraped load refreshed every `scrape_interval_s` of simulated time. The index is fed
from the simulated workers' stores and evictions — what their KV-event streams would
carry — through a direct apply path with our own block keys (no ZMQ, no engine-hash
mapping; the simulated worker's "engine hash" *is* our key), `event_delay_s` after the
fact.

Same workload, settings and seed → the same results, bit for bit.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvscorer_tools.bench.peer_models import MODELS, build_model
from kvscorer_tools.bench.workloads import Workload
from kvscorer_tools.sim.cache import PrefixCache
from kvscorer_tools.sim.scheduler import Admission, Progress, release, schedule_step
from kvscorer_tools.sim.timing import TimingModel
from scorer.blocks import BlockHasher
from scorer.config import Config
from scorer.director import Director
from scorer.index import BlockIndex
from scorer.policy.base import Policy, PolicyContext, build_policy
from scorer.policy.parts import Parts
from scorer.pool.workers import Pool
from scorer.routing import RoutingRequest

UNBOUNDED_BLOCKS = 1 << 40  # "unbounded" capacity: more blocks than any trace can use
MODEL = "bench-model"
CLOCK_BASE = 1000.0  # simulated clock = CLOCK_BASE + simulated seconds


@dataclass(slots=True)
class ReplaySettings:
    """The simulated fleet and how the router sees it."""

    workers: int = 8
    capacity_blocks: int | None = 1000  # per worker; None = unbounded
    block_size: int = 512
    max_num_seqs: int = 256  # vLLM's default for a GPU (SchedulerConfig.max_num_seqs)
    # Token budget of an engine step (decodes + prompt chunks; vLLM's chunked prefill).
    max_num_batched_tokens: int = 8192
    # vLLM's long_prefill_token_threshold: most prompt tokens per request per step (0: no cap).
    long_prefill_token_threshold: int = 0
    seed: int = 0
    scrape_interval_s: float = 0.2  # like config load.scrape_interval_s
    event_delay_s: float = 0.0  # store/evict → index latency (simulated seconds)
    # The router as an e2e run at `--time-scale X` has it (issue 13): its clock runs X
    # times slower than the trace's (model) time, so its scrape interval, staleness,
    # speculative TTLs and prefill estimates, wall seconds there, are X times longer in
    # model time. 1: the router lives in model time (the replay's default).
    router_time_scale: float = 1.0
    # Envoy's lean shape (envoy.yaml): the router sees no response, so a request counts
    # as prefilling until the scrape's first-token counters (`before_first`) or its
    # estimate end it, as end to end. False: prefill ends at its first token (exact, as
    # with response bodies).
    lean_view: bool = False
    timing: TimingModel = field(default_factory=TimingModel)
    # Options per policy name (the `policies.NAME` config section), e.g. a bench config.
    policy_options: dict[str, dict[str, Any]] = field(default_factory=dict)


@dataclass(slots=True)
class PolicyResult:
    """One policy's numbers on one workload (the results.json entry)."""

    hit_rate: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    throughput_rps: float
    imbalance: float
    requests: int
    errors: int
    extra: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        """The results.json shape (extra keys after the required ones)."""
        out: dict[str, Any] = {
            "hit_rate": round(self.hit_rate, 4),
            "ttft_p50_ms": round(self.ttft_p50_ms, 2),
            "ttft_p99_ms": round(self.ttft_p99_ms, 2),
            "throughput_rps": round(self.throughput_rps, 3),
            "imbalance": round(self.imbalance, 3),
            "requests": self.requests,
            "errors": self.errors,
        }
        out.update(self.extra)
        return out


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100), linear interpolation; 0.0 for no values."""
    if not values:
        return 0.0
    return float(np.percentile(np.asarray(values, dtype=np.float64), q))


def imbalance(per_worker: Sequence[float]) -> float:
    """max / mean of per-worker prompt tokens (1.0 = perfectly even; 0 when idle)."""
    if not per_worker:
        return 0.0
    mean = sum(per_worker) / len(per_worker)
    return max(per_worker) / mean if mean > 0 else 0.0


class RequestKeys:
    """Block keys of every request of a workload, computed once with our BlockHasher.

    One array of tokens per request, built and dropped in turn, so the whole Mooncake trace
    (145M prompt tokens) never sits in memory as tokens.
    """

    def __init__(self, workload: Workload, block_size: int, algo: str = "xxh3") -> None:
        self.hasher = BlockHasher(block_size, algo)  # type: ignore[arg-type]
        self.keys: list[list[int]] = []
        for r in workload.requests:
            arr = r.token_array().astype("<u4", copy=False)
            self.keys.append(self.hasher.keys_from_bytes(arr.tobytes()))


@dataclass(slots=True, eq=False)
class _Req:
    idx: int
    rid: str
    arrival: float
    prompt_tokens: int
    output_tokens: int
    keys: list[int]
    extra_blocks: int
    worker: _SimWorker | None = None
    first: float = -1.0
    done: float = -1.0
    remaining: int = 0
    admitted: float = -1.0  # start of its first prefill step (queue = admitted - arrival)
    # On arrival: requests already waiting there, and whether a prefill step was running.
    ahead: int = 0
    in_prefill: bool = False
    progress: Progress | None = None  # the scheduler's (computed tokens, blocks)


def _request_keys(r: _Req) -> list[int]:
    return r.keys


class _SimWorker:
    """One simulated engine, stepped like `kvscorer_tools.sim.engine.Engine` on simulated time."""

    def __init__(self, sim: _Replay, endpoint: str, capacity: int) -> None:
        self.sim = sim
        self.endpoint = endpoint
        self.cache = PrefixCache(capacity, sim.settings.block_size, on_evict=self._evicted)
        self.waiting: deque[_Req] = deque()
        self.running: list[_Req] = []  # admitted: prefilling or decoding, admission order
        self.out: list[_Req] = []  # get a token at the end of the current step
        self.first: list[_Req] = []  # of which: their prompt finished in this step
        self.prefilling = False  # the current step computes prompt tokens
        self.step_start = 0.0
        self.step_s = 0.0  # duration of one step of the current run
        self.steps = 0  # steps in the current run (decode-only runs may be > 1)
        self.step_end = -1.0  # < 0: idle
        self.gen = 0  # invalidates stale step-end events
        self.prompt_tokens = 0  # routed here (imbalance)

    # --- events ------------------------------------------------------------------------

    def _evicted(self, hashes: list[int]) -> None:
        self.sim.feed_remove(self.endpoint, hashes)

    def arrive(self, r: _Req, now: float) -> None:
        """A routed request reaches the engine's waiting queue (or is rejected)."""
        self.prompt_tokens += r.prompt_tokens
        if len(r.keys) + r.extra_blocks > self.cache.capacity_blocks:
            # The engine rejects what can never fit its KV pool (HTTP 400 in the sim).
            self.sim.error(r, now)
            return
        r.ahead = len(self.waiting)
        r.in_prefill = self.prefilling
        self.waiting.append(r)
        if self.step_end < 0:
            self.start_step(now)
        elif not self.prefilling and self.steps > 1:
            # Cut a multi-step decode run at the next step boundary so the scheduler
            # can look at the new request there (as the real engine loop would).
            done = math.floor((now - self.step_start) / self.step_s + 1e-12)
            steps = min(done + 1, self.steps)
            if steps < self.steps:
                self.steps = steps
                self._schedule(self.step_start + steps * self.step_s)

    def step_done(self, now: float) -> None:
        """The current step (or run of decode steps) has ended at `now`."""
        self.step_end = -1.0
        for r in self.first:
            r.first = now  # the step that finished the prompt produced the first token
            self.sim.tracker_first_byte(r)
        done = set()
        for r in self.out:
            r.remaining -= self.steps
            if r.remaining <= 0:
                self.finish(r, now)
                done.add(r.idx)
        if done:
            self.running = [r for r in self.running if r.idx not in done]
        self.out = []
        self.first = []
        self.prefilling = False
        self.start_step(now)

    def finish(self, r: _Req, now: float) -> None:
        r.done = now
        release(self.cache, r)
        self.sim.tracker_finished(r)

    def start_step(self, now: float) -> None:
        """Schedule the next engine step (`kvscorer_tools.sim.scheduler`, as the sim)."""
        st = self.sim.settings
        step = schedule_step(
            self.waiting,
            self.running,
            self.cache,
            max_num_seqs=st.max_num_seqs,
            max_num_batched_tokens=st.max_num_batched_tokens,
            long_prefill_token_threshold=st.long_prefill_token_threshold,
            block_keys=_request_keys,
            on_admit=self._admitted,
            on_store=self._stored,
        )
        if step.empty:
            return  # idle (a blocked head cannot happen with nothing running)
        self.running.extend(a.request for a in step.admitted)
        timing = st.timing
        self.step_start = now
        self.out = step.tokens_out
        self.first = step.first
        self.prefilling = bool(step.chunks)
        if step.chunks or len(step.decodes) < len(self.running):
            self.step_s = timing.step_ms(step.prefill_tokens, len(step.decodes)) / 1000.0
            self.steps = 1
        else:
            # Every running request decodes; nothing changes until the first finishes.
            self.step_s = timing.decode_ms_per_token(len(step.decodes)) / 1000.0
            self.steps = max(min(r.remaining for r in self.running), 1)
        self._schedule(now + self.steps * self.step_s)

    def _admitted(self, a: Admission[_Req]) -> None:
        a.request.remaining = a.request.output_tokens
        a.request.admitted = self.sim.now

    def _stored(self, r: _Req, keys: list[int]) -> None:
        self.sim.feed_store(self.endpoint, keys)

    def _schedule(self, end: float) -> None:
        self.step_end = end
        self.gen += 1
        self.sim.push(end, _STEP, (self, self.gen))


_ARRIVE, _STEP, _SCRAPE, _FEED = 0, 1, 2, 3


class _Replay:
    """One policy on one workload."""

    def __init__(
        self,
        workload: Workload,
        keys: RequestKeys,
        policy_name: str,
        settings: ReplaySettings,
    ) -> None:
        self.workload = workload
        self.keys = keys
        self.settings = settings
        self.heap: list[tuple[float, int, int, Any]] = []
        self.seq = itertools.count()
        self.now = 0.0
        cap = settings.capacity_blocks or UNBOUNDED_BLOCKS
        endpoints = [f"10.0.{i // 250}.{i % 250 + 1}:8000" for i in range(settings.workers)]
        raw = {
            "pool": {
                "workers": [{"endpoint": e} for e in endpoints],
                "block_size": settings.block_size,
            },
            "policy": policy_name,
            "policies": settings.policy_options,
        }
        self.config = Config.model_validate(raw)
        self.pool = Pool.from_config(self.config)
        self.index = BlockIndex(self.config.index)
        # Simulated time for everything that expires or judges freshness (speculative
        # entries, approx TTLs, session idle TTL, scrape freshness). Offset so that the
        # first instant is not 0 ("never scraped" in ScrapedLoad.at).
        self.index.clock = self.clock
        self.ctx = PolicyContext(
            pool=self.pool,
            config=self.config,
            rng=random.Random(settings.seed),
            parts=Parts(index=self.index, hasher=keys.hasher),
        )
        opts = settings.policy_options.get(policy_name)
        self.policy: Policy = (
            build_model(policy_name, self.ctx, opts)
            if policy_name in MODELS
            else build_policy(policy_name, self.ctx, opts)
        )
        set_clock(self.policy, self.clock)
        self.director = Director(self.config, self.pool, self.policy)
        if settings.lean_view:
            # Its estimates and page ages then run on the simulated (router) clock.
            self.director.clock = self.clock
        self.workers = {e: _SimWorker(self, e, cap) for e in endpoints}
        self.reqs: list[_Req] = []
        self.errors = 0
        self.reasons: dict[str, int] = {}
        # Per request in arrival order: (endpoint or "", reason, notes) when recording
        # (bench/record_decisions.py pins decisions across refactors with it).
        self.decided: list[tuple[str, str, str]] | None = None
        for w in self.pool:
            w.scraped.block_size = settings.block_size
            w.scraped.num_gpu_blocks = settings.capacity_blocks

    def clock(self) -> float:
        """The simulated clock as policies and the index read it (seconds; the router's
        own seconds with `router_time_scale`)."""
        return CLOCK_BASE + self.now / self.settings.router_time_scale

    def push(self, t: float, kind: int, obj: Any) -> None:
        heapq.heappush(self.heap, (t, next(self.seq), kind, obj))

    # --- index feed (what the KV-event streams would carry) ------------------------------

    def feed_store(self, endpoint: str, keys: list[int]) -> None:
        if self.settings.event_delay_s > 0:
            self.push(self.now + self.settings.event_delay_s, _FEED, (endpoint, keys, True))
        else:
            index_store(self.index, endpoint, keys)

    def feed_remove(self, endpoint: str, keys: list[int]) -> None:
        if self.settings.event_delay_s > 0:
            self.push(self.now + self.settings.event_delay_s, _FEED, (endpoint, keys, False))
        else:
            index_remove(self.index, endpoint, keys)

    # --- router lifecycle -------------------------------------------------------------

    def tracker_first_byte(self, r: _Req) -> None:
        if not self.settings.lean_view:
            self.director.response_started(r.rid, 200)

    def tracker_finished(self, r: _Req) -> None:
        self.director.response_ended(r.rid)

    def error(self, r: _Req, now: float) -> None:
        self.errors += 1
        r.done = now
        self.director.response_started(r.rid, 400)
        self.director.response_ended(r.rid)

    def scrape(self) -> None:
        """Refresh every worker's scraped load from its simulated engine."""
        at = self.clock()
        for w in self.pool:
            sw = self.workers[w.endpoint]
            sc = w.scraped
            sc.running = float(len(sw.running))
            sc.waiting = float(len(sw.waiting))
            sc.kv_usage = sw.cache.usage if self.settings.capacity_blocks else 0.0
            if self.settings.lean_view:
                # vLLM's counters: requests held before their first token.
                sc.before_first = float(len(sw.waiting) + sum(1 for q in sw.running if q.first < 0))
            sc.at = at
            sc.pages += 1  # as LoadScraper.apply: the director orders pages by it

    def route(self, r: _Req, token_ids: Callable[[], list[int]], session: str | None) -> None:
        bs = self.settings.block_size
        req = RoutingRequest(
            request_id=r.rid,
            model=MODEL,
            path="/v1/completions",
            session_id=session,
            block_size=bs,
            prompt_tokens=r.prompt_tokens,
        )
        if self.policy.needs_tokens:
            req.token_ids = token_ids()
            req.block_keys = r.keys
        if self.settings.lean_view:
            # A streamed request with a body: the director estimates its prefill end.
            req.body = {"model": MODEL, "stream": True}
        d = self.director.decide_prepared(req)
        self.reasons[str(d.reason)] = self.reasons.get(str(d.reason), 0) + 1
        if self.decided is not None:
            self.decided.append((d.endpoint or "", str(d.reason), ",".join(d.notes)))
        if not d.endpoints:
            self.error(r, self.now)
            return
        w = self.workers[d.endpoints[0]]
        r.worker = w
        w.arrive(r, self.now)

    def run(self) -> PolicyResult:
        bs = self.settings.block_size
        wl = self.workload
        for i, br in enumerate(wl.requests):
            keys = self.keys.keys[i]
            tail = br.prompt_tokens - len(keys) * bs  # partial last block (tokens)
            extra = math.ceil((tail + br.output_tokens) / bs)
            r = _Req(i, f"r{i}", br.arrival_s, br.prompt_tokens, br.output_tokens, keys, extra)
            self.reqs.append(r)
            self.push(br.arrival_s, _ARRIVE, i)
        if self.reqs:
            self.push(self.reqs[0].arrival, _SCRAPE, None)
        pending = len(self.reqs)
        while self.heap:
            t, _, kind, obj = heapq.heappop(self.heap)
            self.now = t
            if kind == _ARRIVE:
                br = wl.requests[obj]
                self.route(self.reqs[obj], br.token_ids, br.session)
                pending -= 1
            elif kind == _STEP:
                w, gen = obj
                if gen == w.gen:
                    w.step_done(t)
            elif kind == _SCRAPE:
                self.scrape()
                busy = any(w.step_end >= 0 or w.waiting for w in self.workers.values())
                if pending or busy:
                    every = self.settings.scrape_interval_s * self.settings.router_time_scale
                    self.push(t + every, _SCRAPE, None)
            else:
                ep, keys, store = obj
                (index_store if store else index_remove)(self.index, ep, keys)
        return self.result()

    def result(self) -> PolicyResult:
        done = [r for r in self.reqs if r.first >= 0]
        ttft = [(r.first - r.arrival) * 1000.0 for r in done]
        # Where the TTFT went: waiting in the engine's queue for a step, then the step.
        queue = [(r.admitted - r.arrival) * 1000.0 for r in done]
        step = [(r.first - r.admitted) * 1000.0 for r in done]
        q = sum(w.cache.queries_tokens for w in self.workers.values())
        h = sum(w.cache.hits_tokens for w in self.workers.values())
        t0 = min((r.arrival for r in self.reqs), default=0.0)
        t1 = max((r.done for r in self.reqs), default=0.0)
        span = t1 - t0
        per_worker = [float(w.prompt_tokens) for w in self.workers.values()]
        return PolicyResult(
            hit_rate=h / q if q else 0.0,
            ttft_p50_ms=percentile(ttft, 50),
            ttft_p99_ms=percentile(ttft, 99),
            throughput_rps=len(done) / span if span > 0 else 0.0,
            imbalance=imbalance(per_worker),
            requests=len(self.reqs),
            errors=self.errors,
            extra={
                "ttft_mean_ms": round(sum(ttft) / len(ttft), 2) if ttft else 0.0,
                "queue_p50_ms": round(percentile(queue, 50), 2),
                "queue_mean_ms": round(sum(queue) / len(queue), 2) if queue else 0.0,
                "queued_share": (
                    round(sum(q > 0.0 for q in queue) / len(queue), 3) if queue else 0.0
                ),
                "queue_p90_ms": round(percentile(queue, 90), 2),
                # Arrived behind another request's prefill: waiting ones, or a prefill step.
                "behind_prefill_share": (
                    round(sum(r.ahead > 0 or r.in_prefill for r in done) / len(done), 3)
                    if done
                    else 0.0
                ),
                "prefill_p50_ms": round(percentile(step, 50), 2),
                "prefill_mean_ms": round(sum(step) / len(step), 2) if step else 0.0,
                "reasons": dict(sorted(self.reasons.items())),
                "prompt_tokens_per_worker": [int(x) for x in per_worker],
                "evictions": sum(w.cache.evictions for w in self.workers.values()),
                "sim_duration_s": round(span, 3),
            },
        )


def index_store(index: BlockIndex, endpoint: str, keys: list[int]) -> None:
    """Apply a BlockStored (GPU medium) for `endpoint`: engine hash = our key here."""
    index.add(endpoint, None, keys, keys, "GPU")


def index_remove(index: BlockIndex, endpoint: str, keys: list[int]) -> None:
    """Apply a BlockRemoved (GPU medium) for `endpoint`."""
    index.remove(endpoint, None, keys, "GPU")


def set_clock(obj: object, clock: Callable[[], float], depth: int = 0) -> None:
    """Point a policy's (and its inner policy's) `clock` at the simulated clock."""
    if hasattr(obj, "clock"):
        obj.clock = clock  # type: ignore[attr-defined]
    inner = getattr(obj, "inner", None)
    if inner is not None and depth < 4:
        set_clock(inner, clock, depth + 1)


def run_replay(
    workload: Workload,
    policy: str,
    settings: ReplaySettings,
    keys: RequestKeys | None = None,
) -> PolicyResult:
    """Replay `workload` routed by `policy` on the simulated fleet of `settings`."""
    if keys is None:
        keys = RequestKeys(workload, settings.block_size)
    t = time.perf_counter()
    res = _Replay(workload, keys, policy, settings).run()
    res.extra["wall_s"] = round(time.perf_counter() - t, 2)
    return res


def record_decisions(
    workload: Workload,
    policy: str,
    settings: ReplaySettings,
    keys: RequestKeys | None = None,
) -> list[tuple[str, str, str]]:
    """Every decision of a replay, in arrival order: (endpoint, reason, notes)."""
    if keys is None:
        keys = RequestKeys(workload, settings.block_size)
    replay = _Replay(workload, keys, policy, settings)
    replay.decided = []
    replay.run()
    return replay.decided


def oracle_leading_blocks(keys: RequestKeys) -> list[int]:
    """Per request, in arrival order: how many of its leading blocks an infinite cache
    holds (every full block of every earlier request stays cached)."""
    seen: set[int] = set()
    out = []
    for ks in keys.keys:
        k = 0
        for key in ks:
            if key not in seen:
                break
            k += 1
        out.append(k)
        seen.update(ks)
    return out


def oracle_token_hit_rate(workload: Workload, keys: RequestKeys) -> float:
    """Infinite-cache hit ratio in tokens, counted like the workers' counters: a request
    hits its leading blocks already seen (x block_size tokens, at most its prompt) over its
    prompt tokens."""
    bs = keys.hasher.block_size
    hit = total = 0
    for r, k in zip(workload.requests, oracle_leading_blocks(keys), strict=True):
        hit += min(k * bs, r.prompt_tokens)
        total += r.prompt_tokens
    return hit / total if total else 0.0
