"""One engine step's admission (vLLM's scheduler), shared by the simulator and the replay.

The live simulated worker (`engine.Engine`, wall clock) and the routing benchmark's
discrete-event replay (`kvscorer_tools.bench.replay`, simulated time) both admit requests
with this function, so the two cannot drift apart. What each does with the result
(metrics and KV events in the worker; store events and step timing in the replay) stays
with the caller.

The rules, from vLLM's v1 scheduler (`vllm/v1/core/sched/scheduler.py`): the waiting queue
is served in FIFO order while the running batch has room (`max_num_seqs`) and the step's
token budget (`max_num_batched_tokens`) holds the uncached prompt tokens; the first
request always fits the budget (vLLM chunks it; we prefill it in one step); a head whose
blocks cannot be allocated blocks the queue until running requests free blocks; the
prefix hit is capped so that the last prompt token is always computed.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

from kvscorer_tools.sim.cache import PrefixCache


class Schedulable(Protocol):
    """What the scheduler reads from a request."""

    @property
    def prompt_tokens(self) -> int: ...

    @property
    def extra_blocks(self) -> int: ...


R = TypeVar("R", bound=Schedulable)


@dataclass(frozen=True, slots=True)
class Admission(Generic[R]):
    """One request admitted into this step."""

    request: R
    keys: list[int]  # the request's block keys (as `block_keys` returned them)
    cached_tokens: int  # prompt tokens found in the prefix cache
    stored: list[int]  # keys newly stored in the cache by this admission


@dataclass(slots=True)
class Step(Generic[R]):
    """The requests admitted into one engine step and the tokens they prefill."""

    admitted: list[Admission[R]] = field(default_factory=list)
    prefill_tokens: int = 0  # uncached prompt tokens of the admitted requests


def schedule_step(
    waiting: deque[R],
    running: int,
    cache: PrefixCache,
    *,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    block_keys: Callable[[R], list[int]],
    on_admit: Callable[[Admission[R]], None],
) -> Step[R]:
    """Admit requests from the head of `waiting` (popped) into the next step.

    `running`: requests already in the batch. The cache's hit counters are updated and the
    admitted requests' blocks allocated (pinned) in `cache`. `on_admit` runs right after
    each admission, before the next one, so what it emits (KV events) stays in the order
    of the cache's own eviction callbacks.
    """
    step: Step[R] = Step()
    bs = cache.block_size
    while waiting and running + len(step.admitted) < max_num_seqs:
        head = waiting[0]
        keys = block_keys(head)
        # vLLM caps the hit so the last prompt token is always computed.
        lookup = keys[: (head.prompt_tokens - 1) // bs]
        matched = cache.match(lookup)
        uncached = head.prompt_tokens - matched * bs
        if step.admitted and step.prefill_tokens + uncached > max_num_batched_tokens:
            break
        if not cache.can_admit(keys, head.extra_blocks):
            break  # wait for running requests to free their blocks (FIFO head)
        waiting.popleft()
        cache.lookup(lookup, head.prompt_tokens)  # the worker's hit counters
        stored = cache.admit(keys, head.extra_blocks)
        admission = Admission(head, keys, matched * bs, stored)
        on_admit(admission)
        step.admitted.append(admission)
        step.prefill_tokens += uncached
    return step
