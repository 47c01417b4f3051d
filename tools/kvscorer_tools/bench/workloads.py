"""Benchmark workloads, by name, as token-id prompts (no tokenizer needed).

A prompt is a chain of *segments*; segment ``s`` of length ``n`` expands to ``n``
deterministic pseudo-random token ids that depend only on ``(s, position)``. Two prompts
that start with the same segments therefore start with exactly the same tokens, and a
prefix cache (ours, a simulated worker's, a peer router's) sees exactly the sharing the
workload intends — no more, no less.

Workloads:

* ``shared-prefix``: SGLang's "generated-shared-prefix" benchmark
  (sglang/python/sglang/bench_serving.py, ``--dataset-name generated-shared-prefix``;
  defaults 64 groups x 16 prompts, 2,048-token system prompt, 128-token question, 256
  output tokens, every request at t=0).
* ``prefix-groups``: llm-d's prefix-cache-aware scenario (inference-perf
  ``shared_prefix`` data: 150 groups x 5 prompts, 6,000-token system prompt, 1,200-token
  question, 1,000 output tokens, Poisson arrivals). llm-d drives it at 3-60 req/s against
  real GPUs; on this 2-core machine the default rate is 4 req/s (``rate``), which keeps 8
  simulated workers busy but not saturated; the lengths are unchanged.
* ``mooncake-conversation``: the Mooncake FAST'25 conversation trace (12,031 requests over
  one hour, bundled in kvscorer_tools/bench/data/, see PROVENANCE.md). Each hash id becomes one
  512-token segment, so requests that share hash ids share tokens exactly; timestamps,
  input and output lengths come from the trace (the prompt is the hash ids' tokens cut
  to ``input_length``, so the last block is usually partial, as in the trace).
* ``chat``: multi-turn sessions for the ``session`` policy (the demo's chat workload):
  each turn's prompt is the previous turn's prompt plus a reply and a new user message.
"""

from __future__ import annotations

import inspect
import json
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

MOONCAKE_BLOCK = 512  # tokens per hash id (Mooncake trace README: "The block size is 512")
# Token ids are drawn from [TOKEN_LO, TOKEN_HI): inside any real vocabulary, clear of the
# special tokens most tokenizers put at the very start or end.
TOKEN_LO = 1000
TOKEN_HI = 31000

# Segment-id spaces, so that the segments of different roles never collide.
_SYSTEM = 1 << 40
_QUESTION = 2 << 40
_TURN = 3 << 40


def segment_tokens(segment: int, length: int, start: int = 0) -> npt.NDArray[np.uint32]:
    """Tokens ``start .. start+length`` of segment ``segment`` (uint32).

    splitmix64 of (segment, position): deterministic, uniform, independent of numpy's RNG
    (splitmix64 constants from Steele, Lea & Flood, "Fast splittable pseudorandom number
    generators", OOPSLA 2014).
    """
    pos = np.arange(start, start + length, dtype=np.uint64)
    seg = np.uint64(segment & 0xFFFFFFFFFFFFFFFF)
    with np.errstate(over="ignore"):
        x: npt.NDArray[np.uint64] = seg * np.uint64(0x9E3779B97F4A7C15) + pos * np.uint64(
            0xBF58476D1CE4E5B9
        )
        x = x + np.uint64(0x94D049BB133111EB)
        x ^= x >> np.uint64(30)
        x = x * np.uint64(0xBF58476D1CE4E5B9)
        x ^= x >> np.uint64(27)
        x = x * np.uint64(0x94D049BB133111EB)
        x ^= x >> np.uint64(31)
    span = np.uint64(TOKEN_HI - TOKEN_LO)
    out: npt.NDArray[np.uint32] = (x % span + np.uint64(TOKEN_LO)).astype(np.uint32)
    return out


@dataclass(slots=True)
class BenchRequest:
    """One request of a workload.

    ``segments`` is the prompt as (segment id, token count) pairs; the prompt is their
    tokens in order, cut to ``prompt_tokens``. Token ids are built on demand
    (``token_array``/``token_ids``) so a whole trace never sits in memory as tokens.
    """

    index: int
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    group: str  # session / group / conversation id ("" when the workload has none)
    segments: tuple[tuple[int, int], ...]
    session: str | None = None  # sent as the session id (session policy); None = none

    def token_array(self) -> npt.NDArray[np.uint32]:
        """The prompt's token ids as a uint32 array."""
        parts = [segment_tokens(s, n) for s, n in self.segments]
        arr = np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint32)
        return arr[: self.prompt_tokens]

    def token_ids(self) -> list[int]:
        """The prompt's token ids as python ints (what goes into a request body)."""
        return [int(t) for t in self.token_array().tolist()]


@dataclass(slots=True)
class Workload:
    """A named list of requests (sorted by arrival) plus what generated them."""

    name: str
    requests: list[BenchRequest]
    params: dict[str, Any] = field(default_factory=dict)
    # Mooncake only: each request's hash ids, for the trace's own block-level oracle.
    hash_ids: list[tuple[int, ...]] | None = None

    def __len__(self) -> int:
        return len(self.requests)

    def __iter__(self) -> Iterator[BenchRequest]:
        return iter(self.requests)

    @property
    def duration_s(self) -> float:
        """Time between the first and the last arrival."""
        if not self.requests:
            return 0.0
        return self.requests[-1].arrival_s - self.requests[0].arrival_s

    def slice(self, max_requests: int | None = None, time_scale: float = 1.0) -> Workload:
        """The first `max_requests` requests with arrivals divided by `time_scale`.

        `time_scale` > 1 compresses time (10 = ten times faster than the trace).
        """
        if time_scale <= 0:
            raise ValueError(f"time_scale must be > 0, got {time_scale}")
        reqs = self.requests if max_requests is None else self.requests[:max_requests]
        t0 = reqs[0].arrival_s if reqs else 0.0
        out = [
            BenchRequest(
                index=i,
                arrival_s=(r.arrival_s - t0) / time_scale,
                prompt_tokens=r.prompt_tokens,
                output_tokens=r.output_tokens,
                group=r.group,
                segments=r.segments,
                session=r.session,
            )
            for i, r in enumerate(reqs)
        ]
        hids = None if self.hash_ids is None else self.hash_ids[: len(out)]
        params = dict(self.params, max_requests=max_requests, time_scale=time_scale)
        return Workload(self.name, out, params, hids)


def _finish(name: str, reqs: list[BenchRequest], params: dict[str, Any]) -> Workload:
    reqs.sort(key=lambda r: (r.arrival_s, r.index))
    for i, r in enumerate(reqs):
        r.index = i
    return Workload(name, reqs, params)


def _grouped(
    name: str,
    seed: int,
    groups: int,
    prompts_per_group: int,
    system_tokens: int,
    question_tokens: int,
    output_tokens: int,
    rate: float | None,
    id_offset: int,
) -> Workload:
    """`groups` system prompts x `prompts_per_group` questions, in a shuffled order (one
    group's prompts are not adjacent); all at t=0, or Poisson arrivals at `rate` req/s.
    `id_offset` keeps each workload's synthetic token ids apart."""
    rng = random.Random(seed)
    reqs = []
    for g in range(groups):
        for q in range(prompts_per_group):
            qid = g * prompts_per_group + q
            reqs.append(
                BenchRequest(
                    index=qid,
                    arrival_s=0.0,
                    prompt_tokens=system_tokens + question_tokens,
                    output_tokens=output_tokens,
                    group=f"g{g}",
                    segments=(
                        (_SYSTEM + seed * 100_000 + id_offset + g, system_tokens),
                        (_QUESTION + seed * 1_000_000 + 10 * id_offset + qid, question_tokens),
                    ),
                )
            )
    rng.shuffle(reqs)
    t = 0.0
    for i, r in enumerate(reqs):
        r.index = i
        if rate:
            t += rng.expovariate(rate)
            r.arrival_s = t
    params = dict(
        seed=seed,
        groups=groups,
        prompts_per_group=prompts_per_group,
        system_tokens=system_tokens,
        question_tokens=question_tokens,
        output_tokens=output_tokens,
        rate=rate,
    )
    return Workload(name, reqs, params)


def shared_prefix(
    seed: int = 0,
    groups: int = 64,
    prompts_per_group: int = 16,
    system_tokens: int = 2048,
    question_tokens: int = 128,
    output_tokens: int = 256,
    rate: float | None = None,
) -> Workload:
    """SGLang's generated-shared-prefix: every group shares a system prompt.

    All requests arrive at t=0 (SGLang's default request rate is infinite); `rate` (req/s)
    spaces them as a Poisson process instead.
    """
    return _grouped(
        "shared-prefix", seed, groups, prompts_per_group, system_tokens, question_tokens,
        output_tokens, rate, id_offset=0,
    )  # fmt: skip


def prefix_groups(
    seed: int = 0,
    groups: int = 150,
    prompts_per_group: int = 5,
    system_tokens: int = 6000,
    question_tokens: int = 1200,
    output_tokens: int = 1000,
    rate: float = 4.0,
) -> Workload:
    """llm-d's prefix-cache scenario: random group order, Poisson arrivals at `rate` req/s."""
    return _grouped(
        "prefix-groups", seed, groups, prompts_per_group, system_tokens, question_tokens,
        output_tokens, rate, id_offset=50_000,
    )  # fmt: skip


def chat(
    seed: int = 0,
    sessions: int = 16,
    turns: int = 6,
    system_tokens: int = 1024,
    user_tokens: int = 128,
    reply_tokens: int = 128,
    think_s: float = 2.0,
) -> Workload:
    """Multi-turn chat: turn k's prompt = system + (user, reply) * (k-1) + user.

    Sessions start staggered; each next turn arrives `think_s` (exponential) later. The
    request carries its session id, so the `session` policy can keep a conversation on one
    worker. (Replies are modelled as fixed segments: in the real system the reply the
    worker generated would be sent back verbatim, with the same effect on the cache.)
    """
    rng = random.Random(seed)
    reqs = []
    for s in range(sessions):
        t = rng.uniform(0.0, think_s)
        segs: list[tuple[int, int]] = [(_SYSTEM + 900_000 + seed, system_tokens)]
        for k in range(turns):
            segs.append((_TURN + ((seed * 10_000 + s) * 1000 + k) * 2, user_tokens))
            reqs.append(
                BenchRequest(
                    index=0,
                    arrival_s=t,
                    prompt_tokens=sum(n for _, n in segs),
                    output_tokens=reply_tokens,
                    group=f"s{s}",
                    segments=tuple(segs),
                    session=f"chat-{seed}-{s}",
                )
            )
            segs.append((_TURN + ((seed * 10_000 + s) * 1000 + k) * 2 + 1, reply_tokens))
            t += rng.expovariate(1.0 / think_s)
    params = dict(
        seed=seed,
        sessions=sessions,
        turns=turns,
        system_tokens=system_tokens,
        user_tokens=user_tokens,
        reply_tokens=reply_tokens,
        think_s=think_s,
    )
    return _finish("chat", reqs, params)


def default_trace_path() -> Path:
    """The bundled Mooncake conversation trace."""
    return Path(str(resources.files("kvscorer_tools.bench") / "data" / "conversation_trace.jsonl"))


def read_mooncake(path: str | Path | None = None) -> list[dict[str, Any]]:
    """The trace's rows; raises ValueError naming the line on a malformed row."""
    p = Path(path) if path is not None else default_trace_path()
    rows = []
    with p.open() as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                ts, n_in, n_out = (
                    int(row["timestamp"]),
                    int(row["input_length"]),
                    int(row["output_length"]),
                )
                hids = [int(h) for h in row["hash_ids"]]
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{p}:{lineno}: not a Mooncake trace row: {e}") from e
            if n_in <= 0 or n_in > len(hids) * MOONCAKE_BLOCK:
                raise ValueError(
                    f"{p}:{lineno}: input_length {n_in} does not fit {len(hids)} hash ids"
                )
            rows.append({"timestamp": ts, "input": n_in, "output": n_out, "hash_ids": hids})
    return rows


def mooncake_conversation(seed: int = 0, path: str | Path | None = None) -> Workload:
    """The Mooncake conversation trace; `seed` is unused (the trace is the trace)."""
    rows = read_mooncake(path)
    reqs = []
    hids: list[tuple[int, ...]] = []
    for i, row in enumerate(rows):
        h = tuple(row["hash_ids"])
        reqs.append(
            BenchRequest(
                index=i,
                arrival_s=row["timestamp"] / 1000.0,  # the trace's timestamps are in ms
                prompt_tokens=row["input"],
                output_tokens=max(int(row["output"]), 1),
                group=str(h[0]) if h else "",
                segments=tuple((hid, MOONCAKE_BLOCK) for hid in h),
            )
        )
        hids.append(h)
    # The trace is already in timestamp order; a stable sort keeps ties in file order.
    order = sorted(range(len(reqs)), key=lambda i: reqs[i].arrival_s)
    reqs = [reqs[i] for i in order]
    hids = [hids[i] for i in order]
    for i, r in enumerate(reqs):
        r.index = i
    params = {"trace": "conversation_trace.jsonl", "segment_tokens": MOONCAKE_BLOCK}
    return Workload("mooncake-conversation", reqs, params, hids)


WORKLOADS: dict[str, Callable[..., Workload]] = {
    "shared-prefix": shared_prefix,
    "prefix-groups": prefix_groups,
    "mooncake-conversation": mooncake_conversation,
    "chat": chat,
}


def load_workload(name: str, seed: int = 0, **params: Any) -> Workload:
    """Build workload `name` (see WORKLOADS); unknown names raise ValueError."""
    fn = WORKLOADS.get(name)
    if fn is None:
        raise ValueError(f"unknown workload {name!r} (known: {', '.join(WORKLOADS)})")
    accepted = [p for p in inspect.signature(fn).parameters if p != "seed"]
    bad = [k for k in params if k not in accepted]
    if bad:
        raise ValueError(
            f"workload {name}: unknown parameter(s) {', '.join(bad)} (known: {', '.join(accepted)})"
        )
    return fn(seed=seed, **params)


def oracle_block_hit_rate(workload: Workload, block_size: int) -> float:
    """Infinite-cache hit ratio at block level: leading blocks already seen / all blocks.

    For Mooncake the blocks are the trace's hash ids (the trace's own definition, which
    counts a partial last block as a block: 0.366 for the conversation trace). Otherwise
    they are the prompt's full `block_size` blocks, identified by their segment content.
    """
    seen: set[Any] = set()
    hit = total = 0
    chains: Iterator[tuple[Any, ...]]
    if workload.hash_ids is not None:
        chains = iter(workload.hash_ids)
    else:
        chains = (_block_ids(r, block_size) for r in workload.requests)
    for chain in chains:
        k = 0
        for b in chain:
            if b not in seen:
                break
            k += 1
        hit += k
        total += len(chain)
        seen.update(chain)
    return hit / total if total else 0.0


def _block_ids(r: BenchRequest, block_size: int) -> tuple[Any, ...]:
    # A full block is identified by the whole prefix up to its end (prefix caching):
    # the tuple of (segment, length) pairs it covers, which is hashable and exact.
    out = []
    for b in range(r.prompt_tokens // block_size):
        end = (b + 1) * block_size
        prefix: list[tuple[int, int]] = []
        acc = 0
        for s, n in r.segments:
            take = min(n, end - acc)
            prefix.append((s, take))
            acc += take
            if acc >= end:
                break
        out.append(tuple(prefix))
    return tuple(out)
