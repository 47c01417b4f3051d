"""One engine step's schedule (vLLM v1's scheduler), shared by the simulator and the replay.

The live simulated worker (`engine.Engine`, wall clock) and the routing benchmark's
discrete-event replay (`kvscorer_tools.bench.replay`, simulated time) both schedule their
steps with `schedule_step`, so the two cannot drift apart. What each does with the result
(metrics, tokens and KV events in the worker; index feed and step timing in the replay)
stays with the caller.

The rules, from vLLM's v1 scheduler (`vllm/v1/core/sched/scheduler.py`, `schedule()`):

* every step has a token budget, `max_num_batched_tokens`;
* running requests are served first, in the order they were admitted, while budget is
  left: a decoding request takes 1 token; a request whose prompt is not computed yet
  takes the rest of its prompt, at most `long_prefill_token_threshold` (0: no cap) and at
  most the budget left (chunked prefill). A running request reached after the budget is
  spent is not scheduled this step (vLLM's loop stops at `token_budget == 0`);
* then waiting requests, FIFO and never skipping the head, while budget is left and fewer
  than `max_num_seqs` run: a new request's prefix-cache hit is its longest cached prefix
  of full blocks, capped so the last prompt token is always computed; it takes a chunk of
  its uncached tokens under the same caps; a head whose blocks cannot be had blocks the
  queue until running requests free blocks;
* a request's computed tokens advance when its chunk is scheduled (vLLM's
  `num_computed_tokens` moves in `_update_after_schedule`), and the full blocks they cover
  are cached at once: `KVCacheManager.allocate_slots` (`vllm/v1/core/kv_cache_manager.py`)
  calls `coordinator.cache_blocks(request, min(num_computed + num_new, num_tokens))`,
  which caches only full blocks (`single_type_kv_cache_manager.py` `cache_blocks`) and
  emits their `BlockStored` (`block_pool.py` `cache_full_blocks`). So a long prompt's
  blocks enter the prefix cache (and the event stream) chunk by chunk, step by step;
* the step that computes a prompt's last chunk samples its first token; later steps
  decode one token each.

Where we differ from vLLM, on purpose: a request reserves all the blocks it will ever
need (prompt and `max_tokens` output) when admitted, so nothing is ever preempted; the
reserved blocks are taken from the pool (evicting least recently freed cached blocks) only
when the step that fills them is scheduled, as vLLM allocates them, with the partial
last block and the output blocks taken at the prompt's last chunk.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

from kvscorer_tools.sim.cache import PrefixCache


@dataclass(slots=True, eq=False)
class Progress:
    """Where one admitted request stands (vLLM's `num_computed_tokens` and its blocks)."""

    keys: list[int]  # the request's full-block keys (as `block_keys` returned them)
    cached_tokens: int  # prompt tokens found in the prefix cache at admission
    computed: int  # prompt tokens computed or cached so far (scheduled chunks included)
    committed: int  # leading blocks of `keys` pinned in the cache (hit or stored)
    reserved: int  # blocks the cache keeps for it, not taken from the pool yet
    extra_taken: bool = False  # partial last block + output blocks taken (prompt done)


class Schedulable(Protocol):
    """What the scheduler reads from a request, and where it keeps its progress."""

    @property
    def prompt_tokens(self) -> int: ...

    @property
    def extra_blocks(self) -> int: ...

    progress: Progress | None


R = TypeVar("R", bound=Schedulable)


@dataclass(frozen=True, slots=True)
class Admission(Generic[R]):
    """One request admitted (moved from waiting to running) in this step."""

    request: R
    keys: list[int]  # the request's block keys (as `block_keys` returned them)
    cached_tokens: int  # prompt tokens found in the prefix cache


@dataclass(slots=True)
class Step(Generic[R]):
    """What one engine step computes."""

    admitted: list[Admission[R]] = field(default_factory=list)
    # (request, prompt tokens computed this step), running requests first, in step order.
    chunks: list[tuple[R, int]] = field(default_factory=list)
    decodes: list[R] = field(default_factory=list)  # one output token each
    first: list[R] = field(default_factory=list)  # prompt finished: first token at the end
    prefill_tokens: int = 0  # prompt tokens of all chunks

    @property
    def empty(self) -> bool:
        """True when nothing was scheduled."""
        return not self.chunks and not self.decodes

    @property
    def tokens_out(self) -> list[R]:
        """Requests that get an output token at the end of the step (decodes, then first)."""
        return [*self.decodes, *self.first]


def _chunk(left: int, budget: int, threshold: int) -> int:
    # vLLM: cap by long_prefill_token_threshold (when > 0), then by the budget left.
    n = left
    if 0 < threshold < n:
        n = threshold
    return min(n, budget)


def _compute(
    cache: PrefixCache,
    req: R,
    n: int,
    step: Step[R],
    on_store: Callable[[R, list[int]], None],
) -> None:
    """Schedule `n` prompt tokens of `req`: advance it, cache the full blocks they fill."""
    p = req.progress
    assert p is not None
    p.computed += n
    done = p.computed >= req.prompt_tokens
    full = min(p.computed // cache.block_size, len(p.keys))
    extra = max(req.extra_blocks, 0) if done else 0
    if full > p.committed or extra:
        stored = cache.commit(p.keys[p.committed : full], extra)
        p.reserved -= full - p.committed + extra
        p.committed = full
        if stored:
            on_store(req, stored)
    if done:
        p.extra_taken = True
        step.first.append(req)
    step.chunks.append((req, n))
    step.prefill_tokens += n


def schedule_step(
    waiting: deque[R],
    running: Sequence[R],
    cache: PrefixCache,
    *,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    block_keys: Callable[[R], list[int]],
    on_admit: Callable[[Admission[R]], None],
    on_store: Callable[[R, list[int]], None],
    long_prefill_token_threshold: int = 0,
) -> Step[R]:
    """Schedule the next engine step: `running` (admitted earlier, in admission order)
    first, then new requests from the head of `waiting` (popped).

    The caller appends the admitted requests to its running list. The cache's hit counters
    are updated at admission; blocks are pinned, reserved and stored in `cache` as chunks
    are scheduled. `on_admit` runs at each admission, before its first chunk; `on_store`
    runs with the keys each chunk newly stored, right after the cache's own eviction
    callback for that chunk, so KV events keep the pool's order.
    """
    step: Step[R] = Step()
    budget = max_num_batched_tokens
    bs = cache.block_size
    for req in running:
        if budget <= 0:
            break  # vLLM: `while req_index < len(self.running) and token_budget > 0`
        p = req.progress
        assert p is not None, "a running request was admitted by schedule_step"
        if p.computed < req.prompt_tokens:
            n = _chunk(req.prompt_tokens - p.computed, budget, long_prefill_token_threshold)
            _compute(cache, req, n, step, on_store)
            budget -= n
        else:
            step.decodes.append(req)
            budget -= 1
    while waiting and budget > 0 and len(running) + len(step.admitted) < max_num_seqs:
        head = waiting[0]
        keys = block_keys(head)
        # vLLM caps the hit so the last prompt token is always computed.
        lookup = keys[: (head.prompt_tokens - 1) // bs]
        matched = cache.match(lookup)
        if not cache.can_start(keys, matched, head.extra_blocks):
            break  # wait for running requests to free their blocks (FIFO head)
        waiting.popleft()
        cache.lookup(lookup, head.prompt_tokens)  # the worker's hit counters
        reserved = cache.start(keys, matched, head.extra_blocks)
        cached = matched * bs
        head.progress = Progress(keys, cached, cached, matched, reserved)
        admission = Admission(head, keys, cached)
        on_admit(admission)
        step.admitted.append(admission)
        n = _chunk(head.prompt_tokens - cached, budget, long_prefill_token_threshold)
        _compute(cache, head, n, step, on_store)
        budget -= n
    return step


def release(cache: PrefixCache, req: Schedulable) -> None:
    """Give back everything `req` holds in `cache` (finished or aborted, at any point):
    its pinned blocks (they stay cached, tail first), its output blocks, its reservation."""
    p = req.progress
    if p is None:
        return  # never admitted
    extra = max(req.extra_blocks, 0) if p.extra_taken else 0
    cache.release_blocks(p.keys[: p.committed], extra, p.reserved)
    p.committed = 0
    p.reserved = 0
    p.extra_taken = False
