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
* ``agentic``: coding-agent sessions (ours, shaped after coding agents' loops): a shared
  agent system prompt and tool definitions, a task, then turns that each append the
  model's reply (a tool call) and the tool's result, from ~20k to up to 200k tokens;
  tool runs of seconds to minutes between turns, sub-agents that share the parent's
  system prompt and tools, many sessions at once.
* ``rag``: retrieval-augmented chat (ours): a few long application system prompts,
  passages drawn from a corpus with a Zipf popularity skew, short user questions and
  short follow-up turns.
* ``trace``: any trace in the Mooncake format (``--trace FILE``): one JSON object a line
  with ``timestamp`` (ms), ``input_length``, ``output_length``, ``hash_ids``, optional
  ``block_tokens`` (tokens one hash id stands for, default 512) and optional
  ``session_id`` (sent as the session header).
"""

from __future__ import annotations

import inspect
import itertools
import json
import math
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
_AGENT = 4 << 40
_RAG = 5 << 40


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
        return self.token_array().tolist()  # type: ignore[no-any-return]


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
    """A Mooncake-format trace's rows; ValueError naming the file and line on a bad row.

    Each row: ``timestamp`` (ms, int or float), ``input_length``, ``output_length``,
    ``hash_ids`` (a list of ints), optional ``block_tokens`` (tokens one hash id stands
    for, default 512) and optional ``session_id`` (string or int).
    """
    p = Path(path) if path is not None else default_trace_path()
    rows = []
    try:
        f = p.open()
    except OSError as e:
        raise ValueError(f"trace {p}: {e.strerror or e}") from e
    with f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            rows.append(_trace_row(p, lineno, line))
    if not rows:
        raise ValueError(f"trace {p}: no requests")
    return rows


def _trace_row(p: Path, lineno: int, line: str) -> dict[str, Any]:
    where = f"{p}:{lineno}"
    try:
        row = json.loads(line)
    except ValueError as e:
        raise ValueError(f"{where}: not JSON: {e}") from e
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
    required = ("timestamp", "input_length", "output_length", "hash_ids")
    missing = [k for k in required if k not in row]
    if missing:
        raise ValueError(f"{where}: not a Mooncake trace row: missing {', '.join(missing)}")
    hids = row["hash_ids"]
    try:
        ts = float(row["timestamp"])
        n_in, n_out = _int(row["input_length"]), _int(row["output_length"])
        bt = _int(row.get("block_tokens", MOONCAKE_BLOCK))
        if not isinstance(hids, list):
            raise TypeError("hash_ids must be a list")
        hids = [_int(h) for h in hids]
    except (ValueError, TypeError) as e:
        raise ValueError(f"{where}: not a Mooncake trace row: {e}") from e
    if not math.isfinite(ts) or ts < 0:
        raise ValueError(f"{where}: timestamp {row['timestamp']!r} is not a time in ms")
    if bt < 1:
        raise ValueError(f"{where}: block_tokens {bt} must be >= 1")
    if n_out < 0:
        raise ValueError(f"{where}: output_length {n_out} must be >= 0")
    if n_in <= 0 or n_in > len(hids) * bt:
        raise ValueError(f"{where}: input_length {n_in} does not fit {len(hids)} hash ids")
    sid = row.get("session_id")
    if sid is not None and not isinstance(sid, (str, int)):
        raise ValueError(f"{where}: session_id must be a string or an integer")
    return {
        "timestamp": ts,
        "input": n_in,
        "output": n_out,
        "hash_ids": hids,
        "block_tokens": bt,
        "session": None if sid is None else str(sid),
    }


def _int(v: Any) -> int:
    # JSON numbers only: bool is an int in Python and "12" is not a number in the trace.
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v != int(v):
        raise TypeError(f"{v!r} is not an integer")
    return int(v)


def _from_trace(name: str, path: str | Path | None, params: dict[str, Any]) -> Workload:
    rows = read_mooncake(path)
    t0 = min(row["timestamp"] for row in rows)
    reqs = []
    hids: list[tuple[int, ...]] = []
    for i, row in enumerate(rows):
        h = tuple(row["hash_ids"])
        reqs.append(
            BenchRequest(
                index=i,
                arrival_s=(row["timestamp"] - t0) / 1000.0,  # the trace's timestamps are in ms
                prompt_tokens=row["input"],
                output_tokens=max(int(row["output"]), 1),
                group=row["session"] or (str(h[0]) if h else ""),
                segments=tuple((hid, row["block_tokens"]) for hid in h),
                session=row["session"],
            )
        )
        hids.append(h)
    # Traces are usually in timestamp order; a stable sort keeps ties in file order.
    order = sorted(range(len(reqs)), key=lambda i: reqs[i].arrival_s)
    reqs = [reqs[i] for i in order]
    hids = [hids[i] for i in order]
    for i, r in enumerate(reqs):
        r.index = i
    return Workload(name, reqs, params, hids)


def mooncake_conversation(seed: int = 0, path: str | Path | None = None) -> Workload:
    """The Mooncake conversation trace; `seed` is unused (the trace is the trace)."""
    params = {"trace": "conversation_trace.jsonl", "segment_tokens": MOONCAKE_BLOCK}
    return _from_trace("mooncake-conversation", path, params)


def trace(seed: int = 0, path: str | None = None) -> Workload:
    """Any Mooncake-format trace (`--trace FILE`); `seed` is unused."""
    if not path:
        raise ValueError("workload trace: needs a file (--trace FILE)")
    return _from_trace("trace", path, {"trace": str(path)})


def _lognormal(rng: random.Random, median: float, sigma: float, lo: float, hi: float) -> float:
    return min(max(rng.lognormvariate(math.log(median), sigma), lo), hi)


def agentic(
    seed: int = 0,
    sessions: int = 40,
    agents: int = 2,
    system_tokens: int = 12_000,
    tools_tokens: int = 6_000,
    min_context: int = 20_000,
    max_context: int = 200_000,
    tool_result_tokens: float = 2_500.0,
    reply_tokens: float = 250.0,
    tool_s: float = 8.0,
    user_turn_prob: float = 0.08,
    user_think_s: float = 90.0,
    subagent_prob: float = 0.06,
    subagent_turns: int = 8,
    start_window_s: float = 600.0,
    decode_s_per_token: float = 0.02,
) -> Workload:
    """Coding-agent sessions: contexts grow from ~`min_context` to up to `max_context`.

    Session = agent system prompt + tool definitions (one pair per agent kind, shared by
    every session of that kind) + a task (~`min_context` in all), then turns: each turn's
    prompt is the previous one plus the model's reply (a tool call, lognormal around
    `reply_tokens`) and the tool's result (lognormal around `tool_result_tokens`). The
    next turn arrives after the reply's generation (`decode_s_per_token` a token) and the
    tool's run (lognormal around `tool_s`, 1 s to 5 min) — or, with `user_turn_prob`,
    after a user's reply (exponential, mean `user_think_s`). Each session stops at a
    context drawn log-uniformly in [2 x `min_context`, `max_context`]. With
    `subagent_prob` a turn spawns a sub-agent (the same system prompt and tools, its own
    task, up to `subagent_turns` turns) whose summary is the parent's next tool result.
    Sessions start uniformly over `start_window_s`; every request carries its session id.
    """
    rng = random.Random(seed)
    seg_ids = itertools.count(_AGENT + (seed << 32))
    reqs: list[BenchRequest] = []
    subs: dict[str, int] = {}

    def run(sid: str, segs: list[tuple[int, int]], t: float, stop: int, turns: int) -> float:
        """Append a session's turns from time `t`; the time its last reply is done."""
        ctx = sum(n for _, n in segs)
        done_at = t
        for _turn in range(turns):
            out = int(_lognormal(rng, reply_tokens, 0.8, 20, 4_000))
            reqs.append(BenchRequest(0, t, ctx, out, sid, tuple(segs), session=sid))
            done_at = t + out * decode_s_per_token
            segs.append((next(seg_ids), out))
            if ctx >= stop:
                break
            if sid.count("/") == 0 and rng.random() < subagent_prob:
                subs[sid] = subs.get(sid, 0) + 1
                sub_sid = f"{sid}/sub{subs[sid]}"
                sub_segs = [*segs[:2], (next(seg_ids), int(rng.uniform(1_000, 4_000)))]
                sub_stop = min(stop, int(min_context * 3))
                t_end = run(sub_sid, sub_segs, done_at + 1.0, sub_stop, subagent_turns)
                result = int(_lognormal(rng, 1_000, 0.5, 200, 4_000))
                t = t_end + 1.0
            elif rng.random() < user_turn_prob:
                result = int(rng.uniform(30, 400))
                t = done_at + rng.expovariate(1.0 / user_think_s)
            else:
                result = int(_lognormal(rng, tool_result_tokens, 1.0, 50, 30_000))
                t = done_at + _lognormal(rng, tool_s, 1.2, 1.0, 300.0)
            segs.append((next(seg_ids), result))
            ctx += out + result
            if ctx > max_context:  # the agent compacts or stops before the window is full
                break
        return done_at

    systems = [(next(seg_ids), system_tokens) for _ in range(agents)]
    tools = [(next(seg_ids), tools_tokens) for _ in range(agents)]
    for s in range(sessions):
        kind = s % agents
        start = rng.uniform(0.0, start_window_s)
        task = max(min_context - system_tokens - tools_tokens, 100) + int(rng.uniform(0, 4_000))
        stop = int(math.exp(rng.uniform(math.log(2 * min_context), math.log(max_context))))
        segs = [systems[kind], tools[kind], (next(seg_ids), task)]
        run(f"agent-{seed}-{s}", segs, start, stop, 10_000)
    params = dict(
        seed=seed, sessions=sessions, agents=agents, system_tokens=system_tokens,
        tools_tokens=tools_tokens, min_context=min_context, max_context=max_context,
        tool_result_tokens=tool_result_tokens, reply_tokens=reply_tokens, tool_s=tool_s,
        user_turn_prob=user_turn_prob, user_think_s=user_think_s,
        subagent_prob=subagent_prob, subagent_turns=subagent_turns,
        start_window_s=start_window_s, decode_s_per_token=decode_s_per_token,
    )  # fmt: skip
    return _finish("agentic", reqs, params)


def rag(
    seed: int = 0,
    queries: int = 2_000,
    rate: float = 4.0,
    apps: int = 3,
    system_tokens: int = 4_000,
    corpus: int = 5_000,
    passages: int = 8,
    passage_tokens: int = 500,
    zipf: float = 1.1,
    question_tokens: int = 60,
    output_tokens: int = 200,
    followup_prob: float = 0.3,
    think_s: float = 20.0,
) -> Workload:
    """Retrieval-augmented chat: app system prompt + retrieved passages + a short question.

    `apps` applications, each with its own long system prompt (0.5-1.5 x `system_tokens`)
    and corpus of `corpus` passages (0.5-1.5 x `passage_tokens` each); app i is chosen
    with weight 1/(i+1). A query retrieves `passages` distinct passages drawn with Zipf
    popularity (weight rank^-`zipf`), in the order drawn (so popular passages tend to come
    first), then a short question (~`question_tokens`). Queries arrive as a Poisson
    process at `rate`/s; with `followup_prob` (again after each follow-up) the user asks a
    short follow-up `think_s` (exponential) after the answer: the previous prompt + the
    answer + the new question. Every request carries its session id.
    """
    rng = random.Random(seed)
    nprng = np.random.default_rng(seed)
    seg_ids = itertools.count(_RAG + (seed << 32))
    sys_segs = [(next(seg_ids), int(system_tokens * rng.uniform(0.5, 1.5))) for _ in range(apps)]
    base = next(seg_ids)
    for _ in range(apps * corpus):  # reserve the passages' segment ids
        next(seg_ids)
    lengths = [max(int(passage_tokens * rng.uniform(0.5, 1.5)), 1) for _ in range(corpus)]
    weights = np.arange(1, corpus + 1, dtype=np.float64) ** -zipf
    weights /= weights.sum()
    app_w = [1.0 / (i + 1) for i in range(apps)]
    k = min(passages, corpus)
    reqs: list[BenchRequest] = []
    t = 0.0
    for q in range(queries):
        t += rng.expovariate(rate)
        app = rng.choices(range(apps), app_w)[0]
        picked = nprng.choice(corpus, size=k, replace=False, p=weights)
        segs = [sys_segs[app]]
        segs += [(base + app * corpus + int(p), lengths[int(p)]) for p in picked]
        sid = f"rag-{seed}-{q}"
        at = t
        while True:
            segs.append((next(seg_ids), max(int(rng.uniform(0.5, 1.5) * question_tokens), 1)))
            out = max(int(rng.uniform(0.5, 1.5) * output_tokens), 1)
            ctx = sum(n for _, n in segs)
            reqs.append(BenchRequest(0, at, ctx, out, sid, tuple(segs), session=sid))
            if rng.random() >= followup_prob:
                break
            segs.append((next(seg_ids), out))
            at += out * 0.02 + rng.expovariate(1.0 / think_s)
    params = dict(
        seed=seed, queries=queries, rate=rate, apps=apps, system_tokens=system_tokens,
        corpus=corpus, passages=passages, passage_tokens=passage_tokens, zipf=zipf,
        question_tokens=question_tokens, output_tokens=output_tokens,
        followup_prob=followup_prob, think_s=think_s,
    )  # fmt: skip
    return _finish("rag", reqs, params)


WORKLOADS: dict[str, Callable[..., Workload]] = {
    "shared-prefix": shared_prefix,
    "prefix-groups": prefix_groups,
    "mooncake-conversation": mooncake_conversation,
    "chat": chat,
    "agentic": agentic,
    "rag": rag,
    "trace": trace,
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
        intern: dict[Any, int] = {}
        chains = (_block_ids(r, block_size, intern) for r in workload.requests)
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


def _block_ids(r: BenchRequest, block_size: int, intern: dict[Any, int]) -> tuple[int, ...]:
    # A full block is identified by the whole prefix up to its end (prefix caching):
    # (id of the previous block, the segment pieces this block covers), interned to an int,
    # so identity is exact and the cost is linear in the prompt.
    out = []
    prev = -1
    segs = iter(r.segments)
    seg, left, off = -1, 0, 0
    for _ in range(r.prompt_tokens // block_size):
        pieces: list[tuple[int, int, int]] = []
        need = block_size
        while need:
            if not left:
                seg, left = next(segs)
                off = 0
                continue
            take = min(left, need)
            pieces.append((seg, off, take))
            off += take
            left -= take
            need -= take
        key = (prev, tuple(pieces))
        bid = intern.get(key)
        if bid is None:
            bid = intern[key] = len(intern)
        out.append(bid)
        prev = bid
    return tuple(out)
