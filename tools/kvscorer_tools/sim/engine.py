"""The simulated engine: vLLM's scheduler, prefix cache, KV events, timing, metrics.

One asyncio task runs engine steps, as vLLM's engine core does:

1. schedule (`scheduler.schedule_step`, vLLM v1's rules, chunked prefill): within a budget
   of `max_num_batched_tokens` tokens, running requests first (a decode takes 1 token, an
   unfinished prompt its next chunk), then waiting requests (FIFO, never skipping the head)
   while fewer than `max_num_seqs` run and the KV pool can hold the request's blocks: its
   full prompt blocks (cached, re-used on a hit) plus anonymous blocks for the partial
   last block and all `max_tokens` output tokens (reserved up front, so there is no
   preemption). A long prompt is prefilled over several steps;
2. publish the step's KV events as one batch: for each chunk, BlockRemoved for the blocks
   evicted to make room, then BlockStored for the full blocks the chunk computes;
3. sleep for the step's model time / speed: prefill_ms(prompt tokens of the step's chunks)
   + decode_ms_per_token(number of decodes in the step);
4. a request whose prompt finished in the step gets its first token (TTFT), each decode one
   token; requests that reached `max_tokens` finish and unpin their blocks.

Prefix-cache accounting follows vLLM's scheduler: a request's hit is the longest cached
prefix of full blocks when it is admitted, capped so at least one prompt token is computed
(vLLM recomputes the last token to get logits); queries and hits are counted in tokens at
admission.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import logging
import random
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import msgspec

from kvscorer_tools.sim.cache import PrefixCache, VllmBlockHash, vllm_block_hashes
from kvscorer_tools.sim.kvevents import (
    Era,
    KVEventPublisher,
    all_blocks_cleared,
    block_removed,
    block_stored,
)
from kvscorer_tools.sim.metrics import SimMetrics
from kvscorer_tools.sim.scheduler import Admission, Progress, Step, schedule_step
from kvscorer_tools.sim.scheduler import release as release_blocks
from kvscorer_tools.sim.timing import TimingModel
from scorer.tasks import cancel_and_wait

log = logging.getLogger(__name__)


class RequestRejected(ValueError):
    """The request can never run here (too long for the model or the KV pool)."""


# Wall-clock seconds the engine may run behind its step deadlines and still catch up.
CATCH_UP_S = 0.005


@dataclass(eq=False)
class SimRequest:
    """One generation request inside the engine."""

    request_id: str
    prompt_ids: list[int]
    max_tokens: int
    lora_id: int | None = None
    lora_name: str | None = None
    cache_salt: str | None = None
    arrival: float = field(default_factory=time.monotonic)
    # Filled by the engine.
    hashes: list[VllmBlockHash] = field(default_factory=list)
    extra_blocks: int = 0
    cached_tokens: int = 0
    output_ids: list[int] = field(default_factory=list)
    ttft_s: float | None = None  # model seconds
    ahead: tuple[int, int] = (0, 0)  # (waiting, running) when it arrived
    admitted_at: float = 0.0  # wall clock (monotonic) its first prefill step started
    progress: Progress | None = None  # the scheduler's (computed tokens, blocks)
    finish_reason: str | None = None
    aborted_at: float | None = None  # wall clock (monotonic) it was aborted while running
    queue: asyncio.Queue[int | None] = field(default_factory=asyncio.Queue)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    rng: random.Random = field(default_factory=random.Random)

    @property
    def prompt_tokens(self) -> int:
        """Number of prompt tokens."""
        return len(self.prompt_ids)

    async def tokens(self) -> AsyncIterator[int]:
        """Output token ids as the engine produces them."""
        while True:
            tok = await self.queue.get()
            if tok is None:
                return
            yield tok


def _block_values(req: SimRequest) -> list[int]:
    return [h.value for h in req.hashes]


class Engine:
    """Scheduler + cache + event publisher + metrics of one simulated worker."""

    def __init__(
        self,
        *,
        block_size: int,
        capacity_blocks: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        vocab_size: int,
        timing: TimingModel,
        metrics: SimMetrics,
        publisher: KVEventPublisher | None,
        era: Era,
        seed: int,
        stream_interval: int = 1,
        long_prefill_token_threshold: int = 0,
    ) -> None:
        if stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1, got {stream_interval}")
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        # vLLM's --long-prefill-token-threshold: most prompt tokens per request per step.
        self.long_prefill_token_threshold = long_prefill_token_threshold
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.timing = timing
        self.metrics = metrics
        self.publisher = publisher
        self.era: Era = era
        self.seed = seed
        # Up to this many consecutive decode-only steps run in one wake-up (1: one per step).
        self.stream_interval = stream_interval
        self.cache = PrefixCache(capacity_blocks, block_size, on_evict=self._on_evict)
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self._events: list[msgspec.Struct] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._clock = 0.0  # the deadline the last step ended on (wall clock)
        self._ids = itertools.count()
        self.steps = 0
        # Called at a request's first token with (request, step start, step end), wall clock.
        self.on_first_token: Callable[[SimRequest, float, float], None] | None = None

    # --- lifecycle -------------------------------------------------------------------

    def start(self) -> None:
        """Start the engine loop in the running event loop."""
        self._task = asyncio.create_task(self._loop(), name="sim-engine")

    async def stop(self) -> None:
        """Stop the loop; unfinished requests end with finish_reason "abort"."""
        if self._task is not None:
            # cancel_and_wait: the caller's own cancellation is not swallowed (scorer.tasks).
            await cancel_and_wait(self._task)
            self._task = None
        for req in [*self.waiting, *self.running]:
            self._finish(req, "abort", release=False)
        self.waiting.clear()
        self.running.clear()

    # --- requests --------------------------------------------------------------------

    def next_id(self, prefix: str) -> str:
        """Deterministic request id (seed and a per-worker counter)."""
        return f"{prefix}-{self.seed:x}-{next(self._ids)}"

    def submit(self, req: SimRequest) -> None:
        """Queue a request; raises `RequestRejected` if it can never run."""
        total = req.prompt_tokens + req.max_tokens
        if req.prompt_tokens == 0:
            raise RequestRejected("the prompt is empty")
        if req.max_tokens < 1:
            raise RequestRejected("max_tokens must be at least 1")
        if total > self.max_model_len:
            raise RequestRejected(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"you requested {total} tokens ({req.prompt_tokens} in the messages, "
                f"{req.max_tokens} in the completion). Please reduce the length of the "
                "messages or completion."
            )
        bs = self.block_size
        blocks = -(-total // bs)
        if blocks > self.cache.capacity_blocks:
            raise RequestRejected(
                f"request needs {blocks} KV blocks of {bs} tokens; the worker has "
                f"{self.cache.capacity_blocks}"
            )
        req.hashes = vllm_block_hashes(
            req.prompt_ids, bs, lora_name=req.lora_name, cache_salt=req.cache_salt
        )
        req.extra_blocks = blocks - len(req.hashes)
        digest = hashlib.blake2b(repr((self.seed, req.prompt_ids)).encode(), digest_size=8).digest()
        req.rng = random.Random(int.from_bytes(digest, "big"))
        req.ahead = (len(self.waiting), len(self.running))
        self.waiting.append(req)
        self._wake.set()

    def abort(self, req: SimRequest) -> None:
        """Drop a request (client went away): out of the queue, blocks unpinned."""
        if req.finish_reason is not None:
            return
        if req in self.waiting:
            self.waiting.remove(req)
            self._finish(req, "abort", release=False)
        elif req in self.running:
            self.running.remove(req)
            req.aborted_at = time.monotonic()
            self._finish(req, "abort", release=True)
            # The batch shrank: a merged decode run must end at the current step.
            self._wake.set()

    def reset_prefix_cache(self) -> bool:
        """Drop all cached blocks (refused while requests run); emits AllBlocksCleared."""
        if not self.cache.reset():
            log.warning("reset_prefix_cache refused: %d blocks in use", self.cache.pinned_blocks)
            return False
        self._events.append(all_blocks_cleared(self.era))
        self._flush_events()
        return True

    # --- engine loop -----------------------------------------------------------------

    def _on_evict(self, hashes: list[int]) -> None:
        # vLLM's block pool emits one BlockRemoved per evicted block.
        for h in hashes:
            self._events.append(block_removed(self.era, [h]))

    def _flush_events(self) -> None:
        if self._events and self.publisher is not None:
            self.publisher.publish(self._events)
        self._events = []

    def _stored_events(self, req: SimRequest, stored: list[int]) -> None:
        # One BlockStored per run of consecutive new blocks, chained to the block before
        # (called per scheduled chunk, after that chunk's evictions).
        new = set(stored)
        bs = self.block_size
        i, n = 0, len(req.hashes)
        while i < n:
            if req.hashes[i].value not in new:
                i += 1
                continue
            j = i
            while j < n and req.hashes[j].value in new:
                j += 1
            run = req.hashes[i:j]
            self._events.append(
                block_stored(
                    self.era,
                    [h.value for h in run],
                    req.hashes[i - 1].value if i > 0 else None,
                    req.prompt_ids[i * bs : j * bs],
                    bs,
                    lora_id=req.lora_id,
                    lora_name=req.lora_name,
                    extra_keys=[h.extra for h in run],
                )
            )
            i = j

    def _schedule(self) -> Step[SimRequest]:
        return schedule_step(
            self.waiting,
            self.running,
            self.cache,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            long_prefill_token_threshold=self.long_prefill_token_threshold,
            block_keys=_block_values,
            on_admit=self._admitted,
            on_store=self._stored_events,
        )

    def _admitted(self, a: Admission[SimRequest]) -> None:
        req = a.request
        req.cached_tokens = a.cached_tokens
        self.metrics.prefix_queries.inc(req.prompt_tokens)
        self.metrics.prefix_hits.inc(req.cached_tokens)
        self.metrics.prompt_tokens.inc(req.prompt_tokens)

    async def _loop(self) -> None:
        while True:
            if not self.waiting and not self.running:
                self._wake.clear()
                await self._wake.wait()
                continue
            step = self._schedule()
            self._flush_events()
            if step.empty:
                # Cannot happen (submit rejects what never fits); do not spin if it does.
                self._wake.clear()
                await self._wake.wait()
                continue
            admitted = [a.request for a in step.admitted]
            self.running.extend(admitted)
            # The gauges are set once per step, at its end (vLLM logs its scheduler stats
            # after each step); a scrape in between refreshes them (probes._metrics).
            decode_only = not step.chunks and len(step.decodes) == len(self.running)
            if decode_only and self.stream_interval > 1:
                await self._decode_run(step.decodes)
                continue
            ms = self.timing.step_ms(step.prefill_tokens, len(step.decodes))
            # Steps end on absolute deadlines: asyncio wakes at 1 ms granularity, so a short
            # step (8 ms of decode at --speed 20 = 0.4 ms) oversleeps, and the next steps
            # start from the deadline, not from the late wake-up, to make it up. Without
            # this, model time stretched up to 3x at --speed 20. A step never starts before
            # its newest request arrived, and a debt over CATCH_UP_S (idle, or a starved
            # CPU) is dropped.
            now = time.monotonic()
            start = self._clock if now - self._clock <= CATCH_UP_S else now
            start = max([start, *(r.arrival for r in admitted)])
            end = start + self.timing.wall_s(ms)
            for req in admitted:
                req.admitted_at = start
            await asyncio.sleep(max(end - time.monotonic(), 0.0))
            self._clock = end
            self.steps += 1
            for req in step.first:
                if req.finish_reason is not None:
                    continue  # aborted during the step
                # TTFT in model seconds, from the step's scheduled end (no loop jitter).
                req.ttft_s = self.timing.model_s(end - req.arrival)
                self.metrics.ttft.observe(req.ttft_s)
                if self.on_first_token is not None:
                    self.on_first_token(req, req.admitted_at, end)
            for req in step.tokens_out:
                if req.finish_reason is not None:
                    continue  # aborted during the step
                tok = req.rng.randrange(1000, self.vocab_size)
                req.output_ids.append(tok)
                req.queue.put_nowait(tok)
                self.metrics.generation_tokens.inc()
                if len(req.output_ids) >= req.max_tokens:
                    self.running.remove(req)
                    self.metrics.e2e.observe(self.timing.model_s(end - req.arrival))
                    self._finish(req, "length", release=True)
            self._update_gauges()

    async def _decode_run(self, batch: list[SimRequest]) -> None:
        """Run up to `stream_interval` decode-only steps of `batch` in one wake-up.

        Nothing observable changes between the steps of a run: it ends at the first step
        where a request finishes (so the batch, the gauges and the cache stay as they are
        until its last step), and a new request or an abort (`_wake`) cuts it at the step in
        progress, which completes first, as a step does. Each step keeps its own deadline
        (`self._clock` advances by whole steps), so admission, TTFT and the e2e latency are
        those of the step-by-step loop; only the tokens of the run's steps are handed to
        the streams together, at the wake-up.
        """
        now = time.monotonic()
        start = self._clock if now - self._clock <= CATCH_UP_S else now
        step_s = self.timing.wall_s(self.timing.step_ms(0, len(batch)))
        left = min(r.max_tokens - len(r.output_ids) for r in batch)
        steps = max(1, min(self.stream_interval, left))
        # Step deadlines added one by one, as the step-by-step loop does (same floats).
        ends: list[float] = []
        end = start
        for _ in range(steps):
            end += step_s
            ends.append(end)
        self._wake.clear()
        sleep = asyncio.ensure_future(asyncio.sleep(max(end - now, 0.0)))
        wake = asyncio.ensure_future(self._wake.wait())
        try:
            await asyncio.wait((sleep, wake), return_when=asyncio.FIRST_COMPLETED)
        finally:
            sleep.cancel()
            wake.cancel()
        if self._wake.is_set():
            # Finish the step in progress (the first deadline not yet passed), then stop.
            woke = time.monotonic()
            steps = next((i + 1 for i, e in enumerate(ends) if e >= woke), steps)
            end = ends[steps - 1]
            await asyncio.sleep(max(end - time.monotonic(), 0.0))
        self._clock = end
        self.steps += steps
        produced = 0
        for req in batch:
            if req.finish_reason is not None:
                # Aborted during the run: the steps that ended before still made its tokens
                # (counted, as the step-by-step loop does; nobody reads them any more).
                at = req.aborted_at if req.aborted_at is not None else start
                made = sum(1 for e in ends[:steps] if e <= at)
                req.output_ids.extend(req.rng.randrange(1000, self.vocab_size) for _ in range(made))
                produced += made
                continue
            for _ in range(steps):
                tok = req.rng.randrange(1000, self.vocab_size)
                req.output_ids.append(tok)
                req.queue.put_nowait(tok)
            produced += steps
            if len(req.output_ids) >= req.max_tokens:
                self.running.remove(req)
                self.metrics.e2e.observe(self.timing.model_s(end - req.arrival))
                self._finish(req, "length", release=True)
        if produced:
            self.metrics.generation_tokens.inc(produced)
        self._update_gauges()

    def _finish(self, req: SimRequest, reason: str, *, release: bool) -> None:
        if release:
            release_blocks(self.cache, req)
        req.finish_reason = reason
        if reason != "abort":
            self.metrics.finished(reason)
        req.queue.put_nowait(None)
        req.done.set()

    def _update_gauges(self) -> None:
        m = self.metrics
        m.running.set(len(self.running))
        m.waiting.set(len(self.waiting))
        m.kv_usage.set(self.cache.usage)
        m.set_lora_state(
            [r.lora_name for r in self.waiting if r.lora_name],
            [r.lora_name for r in self.running if r.lora_name],
        )
