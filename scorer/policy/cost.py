"""THE cost function (the `dynamo_cost` scorer of `kv` and `approx`), the load view it
reads and the busy rule. Nothing else computes these numbers; explanation rows show them.

Per candidate worker, in KV blocks (Dynamo's current router cost; see its "Routing
Concepts" page, docs.nvidia.com/dynamo/dev/components/router/routing-concepts):

    cost = prefill_load_scale * max(active_prefill + request_blocks - overlap_credit, 0)
           + active_decode + request_blocks
    overlap_credit = credit * sum over media m of medium_credit[m] * overlap_blocks[m]

Lowest cost wins; ties go to the least loaded (active_prefill + active_decode, then
in-flight requests), then to a random one. With temperature T > 0 the winner is sampled
with p_i ~ exp(-(c_i - c_min) / ((c_max - c_min) * T)).

Load terms (how the scrape and the router's own accounting combine):

    active_prefill = max(inflight.prefill_blocks, waiting * waiting_request_blocks)
    active_decode  = max(inflight.decode_blocks, kv_usage * num_gpu_blocks)

where `waiting` / `kv_usage` / `num_gpu_blocks` come from the last scrape ONLY when it is
fresh (`load.stale_after_s`), else only the in-flight terms count. `max`, not `+`: the
engine's queue already contains the requests this router sent, so adding would count them
twice; the router's view is ahead of the scrape during a burst, the scrape sees traffic
from other routers — each covers the other's blind spot.

Credit decay (caps how much traffic one hot prefix can pull onto one worker):

    load_i  = active_prefill_i + active_decode_i                       (blocks)
    excess  = (load_i - load_min) / max(load_min, request_blocks, 1)   (dimensionless)
    credit  = 1 / (1 + credit_decay * excess)      [* stale_credit for a stale stream]

i.e. excess counts how many "least-loaded loads" (or request sizes, on an idle pool) a
worker is above the least-loaded candidate.

Duplicate cost (what a decision costs the fleet, not only the request; option
`duplicate_cost`, issue 13):

    duplicate_i = max(best_overlap - weighted_overlap_i, 0)      (blocks)
    cost_i     += duplicate_cost * duplicate_i

where best_overlap is the longest weighted cached prefix among the eligible candidates
(a stale stream's overlap times stale_credit).
Sending a request away from the worker that holds its prefix recomputes those blocks —
the prefill term prices that, for this request — and also writes them a second time: the
new worker evicts as many of its own cached blocks (under memory pressure every write
evicts one), so the fleet holds one copy fewer of something else. The prefill term is cut
by credit decay on a loaded worker; this one is not, so it is also the "keep a
conversation where its previous turn ran" term (the worker with the longest prefix is,
by the prefix itself, the one that served the previous turn). It costs nothing when no
candidate has the prefix or when the best one wins anyway.

Queue term (option `queue_weight`, off by default; issue 13, TTFT end to end):

    queue_i = active_prefill_i - min over eligible j of active_prefill_j     (blocks)
    cost_i += queue_weight * prefill_load_scale * queue_i       (after the fleet terms)

The prefill term prices this request's TTFT linearly: a block of queue ahead and a block
of uncached prompt weigh the same, so a cached block pays for one block of queue. The
duplicate term (12 per block of the best cached prefix against 10 per prefill block)
and the continuity discount (x 0.4 on the whole cost, queue included) then let a cached
worker win with a queue up to ~2.2 x (duplicate) or ~2.5 x (continuity) the blocks its
cache saves. Added after both, this term restores the queue's price; it is not cut by
credit decay. It buys TTFT p50 with hit rate on Mooncake (docs/policy.md, "Queue term").

Step sharing (option `step_share`; issue 13, TTFT end to end):

    chunk_i  = min(uncached_i, step_budget_tokens / block_size)            (blocks)
    share_i  = pending_i * chunk_i
    cost_i  += step_share * prefill_load_scale * share_i  (before continuity and spreads)

pending_i: the requests candidate i holds before their first token (the router's count,
or the fresh scrape's waiting when larger). With vLLM v1's chunked prefill a step computes
every scheduled prompt chunk together and each request in it gets its token when the
whole step ends (vllm/v1/core/sched/scheduler.py `schedule()`): this request's first
chunk joins the step of every request waiting there (or their last chunk), and each of
their first tokens waits for it. The prefill term prices only this request's own TTFT;
this prices what its first chunk adds to the others'. A fully cached continuation adds
~nothing; a long new prompt is kept away from a worker where short cached turns wait.
With more than a step's budget queued, only the requests in the last budget of the queue
share its step: pending_i x= min(1, budget_blocks / active_prefill_i). The term enters
the cost before the continuity discount and the session / conversation spreads (with the
fleet terms; without them, alone): the previous turn's worker gets its discount on it
too, and a worker hosting more conversations pays it scaled like the rest of its cost.
Added after them it cost hit rate: it moved conversations whose context was evicted off
their worker and put new prompts among conversations between turns, whose contexts the
new prompts' writes then evicted (docs/policy.md, "Step sharing"). On in `kv` (1), off
in the base options and `approx`.

Shared-prefix copy (option `shared_copy`, off by default; issue 13, the rag workload):

    copy_i  = best_overlap - weighted_overlap_i                        (blocks)
    cost_i += shared_copy / turns * prefill_load_scale * copy_i   (after the fleet terms)

only for a request opening a named session (the one the duplicate term skips and
session_spread places; not a session_rebalance move); turns: the mean requests per named
session this router has seen. Spreading new sessions copies a shared prefix (an app's
system prompt) onto every worker they open on; the spread multiplies the whole cost, so
with few live sessions (x 2 per session at the start) it outweighs any recompute. This
prices the copy once per session, outside the spread; a session of many turns spreads
its load over all of them and pays it once, hence the amortisation.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from operator import add
from typing import Any, Literal

from pydantic import Field

from scorer.native import NATIVE
from scorer.policy.base import PolicyOptions
from scorer.policy.parts import MatchLike
from scorer.pool.workers import Worker

# The compiled columns (scorer/native/_speedups.pyx: load_columns, decay_credit, cost_column)
# when built, else None; the Python code below is their reference (tests/policy/
# test_policy_cost_native.py compares both on random fleets, bit for bit).
_NATIVE_COST = NATIVE if NATIVE is not None and hasattr(NATIVE, "cost_column") else None

# Busy thresholds: the Gateway API Inference Extension's saturation detector defaults
# (pkg/epp/saturationdetector/config.go: queue depth 5, KV cache utilisation 0.8).
DEFAULT_BUSY_WAITING = 5.0
DEFAULT_BUSY_KV_USAGE = 0.8


class BusyOptions(PolicyOptions):
    """Busy filter: workers over a threshold are removed before scoring."""

    # Scraped waiting queue at or above this → busy (only a fresh scrape counts). None: off.
    busy_waiting: float | None = Field(DEFAULT_BUSY_WAITING, ge=0)
    # Scraped KV usage (0..1) at or above this → busy (fresh scrape only). None: off.
    busy_kv_usage: float | None = Field(DEFAULT_BUSY_KV_USAGE, ge=0, le=1)
    # Router in-flight requests at or above this → busy (always current). None: off.
    busy_inflight: int | None = Field(None, ge=1)
    # All candidates busy: a request marked sheddable is refused with 429 (reason shed)
    # instead of going to the least-bad worker (reason busy_all).
    shed_when_busy: bool = True


class CostModelOptions(PolicyOptions):
    """The cost function's own options (scorer `dynamo_cost`)."""

    # Weight of the prefill term against the decode term (Dynamo: prefill_load_scale,
    # formerly overlap_score_weight; Dynamo's default is 1.0). Ours is 10: the decode term
    # counts every running request's whole prompt, shared prefix included, so at 1.0 a warm
    # worker running one request already outweighs a fully cached prompt and conversations
    # drift away from their KV. Measured on the Mooncake conversation replay (8 workers,
    # bench/routing/README.md): hit rate 0.138 → 0.161 at 1,000 blocks, 0.274 → 0.323 at
    # 5,000, imbalance unchanged (1.04); the prefill queue term still spills hot prefixes.
    prefill_load_scale: float = Field(10.0, ge=0)
    # Credit per cached block by medium. None: the index's `index.medium_weights`
    # (GPU 1.0, CPU 0.3, DISK 0.05 by default).
    medium_credit: dict[str, float] | None = None
    # Credit decay on workers above the least loaded (see the module docstring). 0: off.
    credit_decay: float = Field(0.1, ge=0)
    # Credit multiplier for a worker whose event stream is stale or has an unrecovered gap.
    stale_credit: float = Field(0.5, ge=0, le=1)
    # Cost per block of the best candidate's cached prefix that another candidate would
    # write a second time (module doc, "Duplicate cost"). 0: off.
    duplicate_cost: float = Field(0.0, ge=0)
    # The cost's unit: "blocks" (Dynamo's) or "ms" (predicted time to first token plus the
    # fleet terms converted to ms; module doc, "Predicted TTFT").
    unit: Literal["blocks", "ms"] = "blocks"
    # ms mode: ms one block of the running batch adds (the batch the request joins).
    # None: the fitted prefill ms per block / prefill_load_scale (Dynamo's ratio).
    decode_ms_per_block: float | None = Field(None, ge=0)
    # Expected block life (module doc, "Block life"): a cached chain about to be evicted
    # is worth less. Off: every cached block counts fully.
    block_life: bool = False
    # Where a worker's eviction rate comes from: "events" (the GPU blocks its BlockRemoved
    # events removed, counted by the index; falls back to "routed" without an event-fed
    # index) or "routed" (the blocks this router wrote there while its cache was full).
    life_rate: Literal["events", "routed"] = "events"
    # Time constant (s) of the smoothed per-worker eviction rate.
    life_window_s: float = Field(60.0, gt=0)
    # A chain is worth its full credit while more than this fraction of the worker's
    # block life is left when the request reaches it, then linearly less down to 0.
    life_fade: float = Field(0.25, ge=0, le=1)
    # Conversation continuity: the previous turn's worker is kept unless another costs
    # less than (1 - continuity) x its cost. 0: off.
    continuity: float = Field(0.0, ge=0, lt=1)
    # Continuity only while the previous turn's worker holds blocks of the prompt no other
    # eligible worker holds (the conversation's own context; module doc, "Continuity"):
    # a turn whose cached prefix is all shared (a system prompt) is placed on cost alone.
    continuity_own_blocks: bool = False
    # Without a session id, the previous turn's worker is the one with the longest cached
    # prefix when that covers at least this fraction of the prompt.
    continuity_min_match: float = Field(0.5, ge=0, le=1)
    # A request opening a new session: cost x (1 + session_spread x excess), excess the
    # worker's live sessions above the fewest, in units of max(fewest, 1) (module doc,
    # "Session spread"). 0: off.
    session_spread: float = Field(0.0, ge=0)
    # What a live session weighs in session_spread: "sessions" (1 each) or "blocks" (its
    # last request's blocks: its context, the prefill every later turn repeats).
    session_weight: Literal["sessions", "blocks"] = "sessions"
    # Without a session id, recognise conversations by their prompts' block chains (a
    # turn extends the previous turn's whole prompt; scorer.policy.fleet.Conversations):
    # they then count in session_spread's live weight like named sessions, know the
    # worker of their previous turn (continuity), and a prompt no eligible worker holds
    # any block of opens one, spread by session_spread (docs/policy.md, "Conversations
    # without a session id"). Off: such requests are placed by cost alone.
    infer_conversations: bool = False
    # A recognised conversation opening on a prompt no eligible worker holds:
    # cost x (1 + conversation_spread x excess),
    # excess its worker's live weight above the fewest in units of ONE conversation (of
    # its blocks with session_weight: blocks), not of the fewest as session_spread's: the
    # worker hosting the fewest wins unless another is far less loaded (sglang-router's
    # "smallest tree" for a prompt it cannot match, made a margin). 0: off.
    conversation_spread: float = Field(0.0, ge=0)
    # Bound on the recognised conversations (and on the anchors remembered for them).
    max_conversations: int = Field(100_000, ge=1)
    # A recognised conversation (infer_conversations) whose previous worker holds none of
    # its own blocks any more (evicted) gets this discount there (cost x (1 - this),
    # continuity's rule with its own margin): it stays unless another worker is clearly
    # better, instead of following the momentary load. 0 (off): continuity_own_blocks
    # drops the discount and the turn goes where the cost says. (A named session's turns
    # need not extend each other, so own blocks 0 there may be a shared prefix: unchanged.)
    continuity_evicted: float = Field(0.0, ge=0, lt=1)
    # A session idle longer than this (s) no longer counts in session_spread (it has most
    # likely ended); it is still remembered for continuity for 600 s.
    session_live_s: float = Field(600.0, gt=0)
    # A continuing session leaves its worker when that worker's live weight is over
    # (1 + this) x the eligible workers' mean and the move lowers the larger of the two
    # weights; it is then placed like a new session (the worker it leaves only as a last
    # resort). Trades hit rate and TTFT p99 (its context is prefilled again) for balance
    # (docs/policy.md, "Session spread"). 0: off.
    session_rebalance: float = Field(0.0, ge=0)
    # Queue ahead (module doc, "Queue term"): cost per block of active prefill a candidate
    # has beyond the least-queued eligible one, x prefill_load_scale, added after the
    # fleet terms so neither the continuity discount nor the duplicate term buys a place
    # in a deeper queue. 0: off.
    queue_weight: float = Field(0.0, ge=0)
    # Step sharing (module doc, "Step sharing"): cost per block of this request's first
    # prompt chunk per request the candidate holds before its first token, x
    # prefill_load_scale, added before continuity and the spreads. 0: off (kv: 1).
    step_share: float = Field(0.0, ge=0)
    # Prompt tokens an engine step computes at most (vLLM's max_num_batched_tokens: the
    # OpenAI server's default is 8192 on GPUs of >= 70 GiB other than A100, else 2048,
    # vllm/engine/arg_utils.py `get_batch_defaults`): the largest first chunk step_share
    # prices.
    step_budget_tokens: int = Field(8192, ge=1)
    # Shared-prefix copy (module doc, "Shared-prefix copy"): a request opening a new
    # session (where the duplicate term is off and session_spread places it) pays this
    # per block of the best eligible candidate's cached prefix it would write again
    # elsewhere, x prefill_load_scale, added after the spread. 0: off.
    shared_copy: float = Field(0.0, ge=0)


class BusyRule:
    """A `BusyOptions`' thresholds as plain attributes, read once (an attribute of a
    pydantic model goes through its `__getattr__` hook, ~350 instructions a read; options
    are frozen, so a copy cannot go out of date)."""

    __slots__ = ("busy_inflight", "busy_kv_usage", "busy_waiting", "shed_when_busy")

    def __init__(self, o: BusyOptions) -> None:
        self.busy_waiting: float | None = o.busy_waiting
        self.busy_kv_usage: float | None = o.busy_kv_usage
        self.busy_inflight: int | None = o.busy_inflight
        self.shed_when_busy: bool = o.shed_when_busy


class CostParams:
    """A `CostModelOptions`' values as plain attributes, read once per scorer, not per
    decision (see BusyRule). `dynamo_costs` reads these; every option is here
    (tests/policy/test_policy_cost.py holds the two field lists equal)."""

    __slots__ = (
        "block_life",
        "continuity",
        "continuity_evicted",
        "continuity_min_match",
        "continuity_own_blocks",
        "conversation_spread",
        "credit_decay",
        "decode_ms_per_block",
        "duplicate_cost",
        "infer_conversations",
        "life_fade",
        "life_rate",
        "life_window_s",
        "max_conversations",
        "medium_credit",
        "prefill_load_scale",
        "queue_weight",
        "session_live_s",
        "session_rebalance",
        "session_spread",
        "session_weight",
        "shared_copy",
        "stale_credit",
        "step_budget_tokens",
        "step_share",
        "unit",
    )

    def __init__(self, o: CostModelOptions) -> None:
        self.prefill_load_scale: float = o.prefill_load_scale
        self.medium_credit: dict[str, float] | None = o.medium_credit
        self.credit_decay: float = o.credit_decay
        self.stale_credit: float = o.stale_credit
        self.duplicate_cost: float = o.duplicate_cost
        self.unit: str = o.unit
        self.decode_ms_per_block: float | None = o.decode_ms_per_block
        self.block_life: bool = o.block_life
        self.life_rate: str = o.life_rate
        self.life_window_s: float = o.life_window_s
        self.life_fade: float = o.life_fade
        self.continuity: float = o.continuity
        self.continuity_own_blocks: bool = o.continuity_own_blocks
        self.continuity_min_match: float = o.continuity_min_match
        self.session_spread: float = o.session_spread
        self.session_weight: str = o.session_weight
        self.infer_conversations: bool = o.infer_conversations
        self.conversation_spread: float = o.conversation_spread
        self.max_conversations: int = o.max_conversations
        self.continuity_evicted: float = o.continuity_evicted
        self.session_live_s: float = o.session_live_s
        self.session_rebalance: float = o.session_rebalance
        self.queue_weight: float = o.queue_weight
        self.step_share: float = o.step_share
        self.step_budget_tokens: int = o.step_budget_tokens
        self.shared_copy: float = o.shared_copy


class CostOptions(BusyOptions, CostModelOptions):
    """The `kv` / `approx` policy options (config `policies.kv` / `policies.approx`):
    the busy filter's, the cost function's, and the picker's."""

    # Softmax sampling temperature over normalised costs; 0 = always the lowest cost.
    temperature: float = Field(0.0, ge=0)
    # Blocks assumed per request waiting in an engine queue (for active_prefill from the
    # scraped waiting count). None: the incoming request's own block count.
    waiting_request_blocks: float | None = Field(None, ge=0)
    # Insert the winner's uncached blocks into the index speculatively so a burst of the
    # same prefix hits before the engine's events arrive.
    speculative: bool = True
    # Extra endpoints (lowest cost first) after the winner, for Envoy to retry on.
    fallbacks: int = Field(0, ge=0, le=8)


@dataclass(slots=True)
class LoadTable:
    """Every candidate's load in blocks, as the cost function sees it (one row each).

    `waiting` / `kv_usage` are the scraped values when the scrape is fresh, else 0.
    `busy` is why each candidate is over a busy threshold (None: not busy), when the
    table was built with thresholds (the busy filter's), else None.
    """

    prefill: list[float]
    decode: list[float]
    waiting: list[float]
    kv_usage: list[float]
    busy: list[str | None] | None = None


def load_table(
    candidates: Sequence[Worker],
    now: float,
    stale_after_s: float,
    waiting_request_blocks: float,
    busy: BusyOptions | BusyRule | None = None,
    native: bool = True,
) -> LoadTable:
    """Combine the router's in-flight accounting with a fresh scrape (module doc) and, with
    `busy`, apply the busy rule in the same pass: fresh scraped waiting >= busy_waiting,
    else fresh scraped KV usage >= busy_kv_usage, else router in-flight >= busy_inflight.

    The hot loop of every decision: flat lists and bound methods on purpose; the compiled
    `load_columns` runs the same pass when built (`native=False`: this code, the reference).
    `busy`: a caller deciding often passes the `BusyRule` it read once.
    """
    if busy is not None and not isinstance(busy, BusyRule):
        busy = BusyRule(busy)
    if native and _NATIVE_COST is not None:
        if busy is None:
            return LoadTable(
                *_NATIVE_COST.load_columns(
                    candidates, now - stale_after_s, waiting_request_blocks, None, None, None, False
                )
            )
        return LoadTable(
            *_NATIVE_COST.load_columns(
                candidates,
                now - stale_after_s,
                waiting_request_blocks,
                busy.busy_waiting,
                busy.busy_kv_usage,
                busy.busy_inflight,
                True,
            )
        )
    pfs: list[float] = []
    dcs: list[float] = []
    wqs: list[float] = []
    kus: list[float] = []
    busys: list[str | None] = []
    add_pf, add_dc, add_wq, add_ku = pfs.append, dcs.append, wqs.append, kus.append
    add_busy = busys.append
    fresh_since = now - stale_after_s
    wrb = waiting_request_blocks
    check = busy is not None
    busy_w = busy.busy_waiting if busy is not None else None
    busy_k = busy.busy_kv_usage if busy is not None else None
    busy_i = busy.busy_inflight if busy is not None else None
    for w in candidates:
        fl = w.inflight
        sc = w.scraped
        pf = fl.prefill_blocks
        dc = fl.decode_blocks
        b: str | None = None
        at = sc.at
        if at > 0.0 and at >= fresh_since:
            wq = sc.waiting
            ku = sc.kv_usage
            x = wq * wrb
            if x > pf:
                pf = x
            if sc.num_gpu_blocks:
                x = ku * sc.num_gpu_blocks
                if x > dc:
                    dc = x
            if busy_w is not None and wq >= busy_w:
                b = "busy_waiting"
            elif busy_k is not None and ku >= busy_k:
                b = "busy_kv_usage"
        else:
            wq = ku = 0.0
        if b is None and busy_i is not None and fl.requests >= busy_i:
            b = "busy_inflight"
        add_pf(pf)
        add_dc(dc)
        add_wq(wq)
        add_ku(ku)
        add_busy(b)
    return LoadTable(pfs, dcs, wqs, kus, busys if check else None)


@dataclass(slots=True)
class FleetInputs:
    """What the fleet terms read for one decision (built by the scorer from its state).

    `prefill_line`: the fitted prefill model's line in seconds (intercept, per token, min,
    max; scorer.pool.prefill.PrefillModel.estimate), `ms_per_block` its marginal ms per
    block. `life`: per candidate index with a cached prefix, (worth factor 0..1, block
    life s, chain age s) — absent: full worth. `previous`: candidate index of the previous
    turn's worker (None: unknown or not eligible).
    """

    prefill_line: tuple[float, float, float, float]
    ms_per_block: float
    block_size: int
    life: dict[int, tuple[float, float | None, float | None, float]]
    previous: int | None = None
    # Blocks the previous turn's worker holds beyond every other eligible candidate (when
    # continuity_own_blocks computed them; 0 there: no discount); None: not computed.
    own: int | None = None
    # Live session weight per eligible candidate (parallel to eligible) when the request
    # opens a new session and session_spread is on; else None.
    sessions: list[float] | None = None
    # Candidate index the session leaves for balance (session_rebalance; `sessions` is
    # then set and continuity off); None: no move.
    left: int | None = None
    # continuity_evicted: the previous worker holds none of the conversation's own
    # blocks; the discount applies anyway (own is 0).
    evicted: bool = False
    # A request without a session id, recognised (infer_conversations): "new" (it opens a
    # conversation) or "continued"; None: a session id, or inference off.
    conversation: str | None = None
    # Mean requests per named session (shared_copy amortises a new session's copy over
    # them; 1.0: not a new session, or none seen).
    session_turns: float = 1.0

    def ttft_ms(self, queued_tokens: float) -> float:
        """Predicted prefill ms of `queued_tokens` (PrefillModel.estimate's arithmetic)."""
        a, b, lo, hi = self.prefill_line
        q = queued_tokens if queued_tokens > 0.0 else 0.0
        x = a + b * q
        if lo > x:  # min(max(x, lo), hi), as the builtins choose
            x = lo
        if hi < x:
            x = hi
        return 1000.0 * x


@dataclass(slots=True)
class CandidateTerms:
    """One candidate's fleet terms, for its explanation row."""

    predicted_ttft_ms: float = 0.0
    life_factor: float = 1.0
    block_life_s: float | None = None
    chain_age_s: float | None = None
    # The worker's smoothed eviction rate (blocks/s) the block life came from (None: the
    # block-life term did not apply).
    evictions_per_s: float | None = None
    previous_turn: bool = False
    # (continuity_own_blocks) the previous turn's worker: blocks of the prompt it holds
    # beyond every other candidate; None elsewhere or when not computed.
    own_blocks: int | None = None
    # session_spread's input: the candidate's live session weight (None: not applied).
    live_sessions: float | None = None
    left_for_balance: bool = False  # the session left this worker (session_rebalance)
    # infer_conversations: "new" / "continued" (FleetInputs.conversation); None: not used.
    conversation: str | None = None
    evicted: bool = False  # continuity_evicted applied here (the previous turn's worker)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready view (a candidate row's `terms` in /debug/decisions)."""
        return {
            "predicted_ttft_ms": round(self.predicted_ttft_ms, 1),
            "life_factor": round(self.life_factor, 3),
            "block_life_s": None if self.block_life_s is None else round(self.block_life_s, 1),
            "chain_age_s": None if self.chain_age_s is None else round(self.chain_age_s, 1),
            "evictions_per_s": (
                None if self.evictions_per_s is None else round(self.evictions_per_s, 2)
            ),
            "previous_turn": self.previous_turn,
            "own_blocks": self.own_blocks,
            "live_sessions": None if self.live_sessions is None else round(self.live_sessions, 1),
            "left_for_balance": self.left_for_balance,
            "conversation": self.conversation,
            "evicted": self.evicted,
        }


@dataclass(slots=True)
class CostTable:
    """One decision's cost, term by term, as columns parallel to `eligible` (position k
    is candidate `eligible[k]`). The picker reads `costs`; the explanation rows, built
    when the decision is first read, read the rest (`by_candidate`, `held`), and a row's
    fleet terms (`terms`) only when it is shown."""

    eligible: Sequence[int]
    costs: list[float]
    matches: list[MatchLike | None]  # cached prefix (None: nothing cached)
    weighted: list[float]  # overlap weighted by medium (0 where nothing is cached)
    credit: list[float]  # credit multiplier (decay, stale stream, block life)
    stale: list[bool] | None  # stream stale (None: no stream check)
    stale_any: bool  # a cached candidate's credit was cut for a stale stream
    prefill: Sequence[float]  # active prefill blocks
    request_blocks: float
    # Duplicate term (None: off): the best held overlap and each candidate's held overlap.
    best_held: float | None = None
    held: list[float] | None = None
    # Fleet terms (None: off); predicted TTFT per position when the cost used it (ms unit).
    fleet: FleetInputs | None = None
    ttft: list[float] | None = None
    previous: int | None = None  # candidate index whose cost got the continuity discount
    # Queue term (None: off): active prefill blocks beyond the least-queued candidate's.
    queue: list[float] | None = None
    # Step sharing (None: off): requests before their first token x this request's first
    # chunk, in blocks.
    share: list[float] | None = None
    # Shared-prefix copy (None: off or not a new session): blocks of the best cached
    # prefix this candidate would write again.
    copy: list[float] | None = None
    every: bool = False  # every candidate is eligible (position k is candidate k)
    _pos: dict[int, int] | None = None

    def position(self, i: int) -> int | None:
        """Candidate index `i`'s position in `eligible` (None: not eligible)."""
        if self.every:
            return i if 0 <= i < len(self.eligible) else None
        pos = self._pos
        if pos is None:
            pos = self._pos = {c: k for k, c in enumerate(self.eligible)}
        return pos.get(i)

    def by_candidate(
        self, n: int
    ) -> tuple[list[MatchLike | None], list[float], list[float], list[bool] | None]:
        """matches, weighted, credit and stale indexed by candidate index (of `n`
        candidates); a candidate not eligible has no match."""
        if self.every:
            return self.matches, self.weighted, self.credit, self.stale
        ms: list[MatchLike | None] = [None] * n
        wt, cr = [0.0] * n, [1.0] * n
        st: list[bool] | None = None if self.stale is None else [False] * n
        for k, i in enumerate(self.eligible):
            ms[i], wt[i], cr[i] = self.matches[k], self.weighted[k], self.credit[k]
            if st is not None and self.stale is not None:
                st[i] = self.stale[k]
        return ms, wt, cr, st

    def duplicate(self, k: int) -> float:
        """Blocks of the best cached prefix position k would write again (0: term off)."""
        if self.best_held is None or self.held is None:
            return 0.0
        return self.best_held - self.held[k]

    def uncached(self, k: int) -> float:
        """Position k's request blocks the prefill must compute."""
        u = self.request_blocks - self.credit[k] * self.weighted[k]
        return u if u > 0.0 else 0.0

    def terms(self, i: int) -> CandidateTerms:
        """Candidate index `i`'s fleet terms (i must be eligible, the fleet terms on)."""
        fleet = self.fleet
        assert fleet is not None
        k = self.position(i)
        assert k is not None
        if self.ttft is not None:
            ttft = self.ttft[k]
        else:
            ttft = fleet.ttft_ms((self.prefill[k] + self.uncached(k)) * fleet.block_size)
        t = CandidateTerms(predicted_ttft_ms=ttft, previous_turn=i == self.previous)
        if fleet.own is not None and i == fleet.previous:
            t.own_blocks = fleet.own
        if fleet.sessions is not None:
            t.live_sessions = fleet.sessions[k]
        t.left_for_balance = i == fleet.left
        t.conversation = fleet.conversation
        t.evicted = fleet.evicted and i == fleet.previous
        got = fleet.life.get(i)
        if got is not None:
            t.life_factor, t.block_life_s, t.chain_age_s, t.evictions_per_s = got
        return t


def dynamo_costs(
    candidates: Sequence[Worker],
    endpoints: Sequence[str],
    eligible: Sequence[int],
    table: LoadTable,
    matches: Mapping[str, MatchLike],
    request_blocks: float,
    opts: CostModelOptions | CostParams,
    stale: Callable[[Worker], bool] | None = None,
    fleet: FleetInputs | None = None,
    native: bool = True,
    block_size: int = 0,
) -> CostTable:
    """THE cost function (module doc) of each eligible candidate, term by term.

    `endpoints` are the candidates' endpoints (parallel to `candidates`); `eligible` the
    scored candidates' indices, ascending. `opts`: the options, read once into a
    `CostParams` by a caller that decides often (the scorer). `stale(w)` says whether w's
    cache signal is to be trusted less (a silent or gapped event stream). `fleet` feeds
    the block-life, predicted-TTFT, continuity and session-spread terms (None: off).
    `block_size`: tokens per block (the step-sharing term's budget in blocks; 0: uncapped).

    Evaluated a term at a time over all candidates (one list per term, no per-candidate
    objects): the per-decision constants are hoisted. The order of the float operations
    is the formula's, so the costs are the same bits as a candidate-at-a-time evaluation.
    The credit and cost columns run compiled when built (`native=False`: the Python
    columns, the reference). The glue around them is plain loops, not comprehensions or
    `min` / `max` calls: at a few candidates a comprehension's function object and frame
    cost more than its items (~2,000 instructions), and `min` / `max` parse keyword
    arguments (~1,300); the loops keep their semantics (first extreme, `<` / `>`).
    """
    p = opts if isinstance(opts, CostParams) else CostParams(opts)
    nat = _NATIVE_COST if native else None
    rb = request_blocks
    n = len(eligible)
    pfs, dcs = table.prefill, table.decode
    every = n == len(candidates)  # (eligible is ascending: position k is candidate k)
    if every:  # nothing filtered: the load table's own columns
        pf, dc, cands, eps = pfs, dcs, candidates, endpoints
    else:
        pf = [pfs[i] for i in eligible]
        dc = [dcs[i] for i in eligible]
        cands = [candidates[i] for i in eligible]
        eps = [endpoints[i] for i in eligible]
    life = fleet.life if fleet is not None else None
    share_on = p.step_share > 0.0 and n > 1
    # The step-sharing blocks go on the costs right after the cost column in the blocks
    # unit (with or without the fleet terms): the compiled pass adds them there.
    added = False
    if (
        nat is not None
        and p.medium_credit is None
        and not life
        and type(matches) is dict
        and type(cands) is list
        and type(eps) is list
    ):
        # The columns from the lookup to the costs (and the step-sharing blocks) in one
        # compiled pass: the code below, object for object and op for op.
        added = share_on and p.unit != "ms"
        ms, any_match, credit, stale_flags, stale_any, weighted, dup, held, best, costs, share = (
            nat.cost_core(
                cands,
                eps,
                pf,
                dc,
                matches if matches else None,
                rb,
                p.credit_decay,
                stale,
                p.stale_credit,
                p.duplicate_cost,
                fleet is not None and fleet.sessions is not None,
                p.prefill_load_scale,
                (table.waiting if every else [table.waiting[i] for i in eligible])
                if share_on
                else None,
                p.step_budget_tokens / block_size if block_size > 0 else math.inf,
                added,
                p.step_share,
            )
        )
        out = CostTable(eligible, costs, ms, weighted, credit, stale_flags, stale_any, pf, rb)
        out.every = every
        if dup > 0.0:
            out.best_held, out.held = best, held
        out.share = share
    else:
        out, dup, any_match = _columns(
            p, nat, cands, eps, eligible, every, pf, dc, table, matches, rb, stale, fleet, life,
            share_on, block_size,
        )  # fmt: skip
    if fleet is not None:
        _fleet_terms(out, dc, p, fleet, dup, added)
        if (
            p.shared_copy > 0.0
            and fleet.sessions is not None
            and fleet.left is None
            and any_match
            and n > 1
        ):
            _copy_term(out, p, fleet.session_turns)
    elif out.share is not None and not added:
        _add_prefill_blocks(out, p, p.step_share, out.share)
    if p.queue_weight > 0.0 and n > 1:
        _queue_term(out, p)
    return out


def _columns(
    p: CostParams,
    nat: Any,
    cands: Sequence[Worker],
    eps: Sequence[str],
    eligible: Sequence[int],
    every: bool,
    pf: list[float],
    dc: list[float],
    table: LoadTable,
    matches: Mapping[str, MatchLike],
    rb: float,
    stale: Callable[[Worker], bool] | None,
    fleet: FleetInputs | None,
    life: dict[int, tuple[float, float | None, float | None, float]] | None,
    share_on: bool,
    block_size: int,
) -> tuple[CostTable, float, bool]:
    """dynamo_costs' columns from the index lookup to the costs and the step-sharing
    blocks (the reference of the compiled `cost_core`, and the path of the options it
    leaves out: medium_credit, block life). Returns the table, the duplicate term's
    weight and whether an eligible candidate has a cached prefix."""
    n = len(eps)
    ms: list[MatchLike | None]
    if matches:
        ms = list(map(matches.get, eps))
        # Whether an eligible candidate is listed (an index lists holders only). (Not
        # ms.count(None): that compares each Match with None through its __eq__.)
        any_match = False
        for m in ms:
            if m is not None:
                any_match = True
                break
    else:
        ms = [None] * n
        any_match = False

    # Credit: 1 / (1 + decay * excess), excess in "least-loaded loads".
    decay = p.credit_decay
    if decay > 0.0 and nat is not None:
        credit = nat.decay_credit(pf, dc, rb, decay)
    elif decay > 0.0:
        load = list(map(add, pf, dc))
        load_min = min(load)
        unit = max(load_min, rb, 1.0)
        credit = [
            1.0 / (1.0 + decay * (x - load_min) / unit) if x > load_min else 1.0 for x in load
        ]
    else:
        credit = [1.0] * n
    stale_flags: list[bool] | None = None
    stale_any = False
    sc = p.stale_credit
    if stale is not None and any_match:
        stale_flags = []
        flag = stale_flags.append
        k = 0
        for m in ms:
            flag(m is not None and stale(cands[k]))
            k += 1
        stale_any = True in stale_flags
        if stale_any:
            credit = [c * sc if s else c for c, s in zip(credit, stale_flags, strict=True)]
    if life:
        pos = range(n) if every else {c: k for k, c in enumerate(eligible)}
        for i, got in life.items():
            k = pos[i]
            if ms[k] is not None:
                credit[k] *= got[0]

    # Overlap weighted by medium.
    mcredit = p.medium_credit
    weighted: list[float]
    if not any_match:
        weighted = [0.0] * n
    elif mcredit is None:
        weighted = []
        put = weighted.append
        for m in ms:
            put(0.0 if m is None else m.weighted)
    else:
        gpu = mcredit.get("GPU", 1.0)
        weighted = [
            0.0 if m is None else sum(mcredit.get(k, gpu) * v for k, v in m.by_medium.items())
            for m in ms
        ]
    out = CostTable(eligible, [], ms, weighted, credit, stale_flags, stale_any, pf, rb)
    out.every = every

    # Duplicate cost: duplicate_cost x (best held overlap - this one's). Off for a request
    # opening a new session: it continues no conversation, the prefix it shares (a system
    # prompt) is worth replicating, and where it lands is session_spread's call.
    dup = p.duplicate_cost
    if not any_match or (fleet is not None and fleet.sessions is not None):
        dup = 0.0
    held, best = weighted, 0.0
    if dup > 0.0:
        # A stale stream's blocks may be gone: they count with stale_credit here too.
        if stale_any and stale_flags is not None:
            held = [w * sc if s else w for w, s in zip(weighted, stale_flags, strict=True)]
        best = held[0]  # max(held)
        for h in held:
            if h > best:
                best = h
        if best <= 0.0:  # the 0.0 of an uncached candidate must not beat a cached one's
            # max over the cached candidates (any_match: there is one)
            top: float | None = None
            k = 0
            for m in ms:
                if m is not None and (top is None or held[k] > top):
                    top = held[k]
                k += 1
            assert top is not None
            best = top
        out.best_held, out.held = best, held

    # Dynamo's cost, + the duplicate term (dup 0: + 0.0, the same float):
    #   prefill_load_scale * max(prefill + request - credit * weighted, 0) + decode + request.
    pls = p.prefill_load_scale
    if nat is not None:
        out.costs = nat.cost_column(pf, dc, credit, weighted, held, rb, pls, dup, best)
    else:
        out.costs = [
            pls * (q if (q := a + rb - c * w) > 0.0 else 0.0) + d + rb + dup * (best - h)
            for a, d, c, w, h in zip(pf, dc, credit, weighted, held, strict=True)
        ]
    if share_on:
        wq = table.waiting if every else [table.waiting[i] for i in eligible]
        _share_term(out, p, cands, wq, block_size)
    return out, dup, any_match


def _share_term(
    out: CostTable,
    p: CostParams,
    cands: Sequence[Worker],
    waiting: Sequence[float],
    block_size: int,
) -> None:
    """The step-sharing term's blocks per candidate (module doc, "Step sharing") into
    `out.share`; added to the costs with the fleet terms (before continuity and the
    spreads), or alone without them."""
    cap = p.step_budget_tokens / block_size if block_size > 0 else math.inf
    rb = out.request_blocks
    prefill, credit, weighted = out.prefill, out.credit, out.weighted
    share: list[float] = []
    add_share = share.append
    k = 0  # (a counter, not range(): a range object costs ~1,000 instructions)
    for w in cands:
        r: float = w.inflight.prefill_requests
        wq = waiting[k]
        if wq > r:
            r = wq
        u = rb - credit[k] * weighted[k]  # this request's uncached blocks there (uncached)
        if r > 0.0 and u > 0.0:
            # Only the requests whose last chunk shares this request's first step: with
            # more than a step's budget queued there, the ones in the last budget of it.
            q = prefill[k]
            if q > cap:
                r = r * cap / q
            add_share(r * (u if u < cap else cap))
        else:
            add_share(0.0)
        k += 1
    out.share = share


def _copy_term(out: CostTable, p: CostParams, turns: float) -> None:
    """The shared-prefix copy term (module doc, "Shared-prefix copy") on `out.costs`:
    a new session's blocks of the best cached prefix that a candidate would write again,
    priced after the session spread so the spread does not scale it."""
    held = out.weighted
    if out.stale_any and out.stale is not None:
        sc = p.stale_credit
        held = [w * sc if s else w for w, s in zip(held, out.stale, strict=True)]
    best = max(held)
    copy = [best - h for h in held]
    out.copy = copy
    _add_prefill_blocks(out, p, p.shared_copy / max(turns, 1.0), copy)


def _queue_term(out: CostTable, p: CostParams) -> None:
    """The queue term (module doc, "Queue term") on `out.costs`, after the fleet terms."""
    pf = out.prefill
    lo = min(pf)
    extra = [q - lo for q in pf]
    out.queue = extra
    _add_prefill_blocks(out, p, p.queue_weight, extra)


def _add_prefill_blocks(
    out: CostTable,
    p: CostParams,
    weight: float,
    blocks: Sequence[float],
    fleet: FleetInputs | None = None,
) -> None:
    """`out.costs` += weight x one prefill block's price x `blocks` (per candidate, in
    place): the queue term (after the fleet terms) and the step-sharing term (inside
    them)."""
    unit = p.prefill_load_scale
    fleet = fleet if fleet is not None else out.fleet
    if p.unit == "ms" and fleet is not None:
        # One prefill block in ms: the fitted prefill ms per block (the ms unit's scale).
        unit = fleet.ms_per_block
    w = weight * unit
    costs = out.costs
    if len(blocks) != len(costs):
        raise ValueError("cost columns differ in length")
    k = 0
    for x in blocks:
        if x > 0.0:
            costs[k] = costs[k] + w * x
        k += 1


def _fleet_terms(
    out: CostTable,
    dc: Sequence[float],
    p: CostParams,
    fleet: FleetInputs,
    dup: float,
    added: bool = False,
) -> None:
    """The ms unit (predicted TTFT), continuity and session spread, on `out.costs`
    (`added`: the step-sharing blocks are on them already, as this would add them)."""
    costs = out.costs
    if p.unit == "ms":
        pls = p.prefill_load_scale
        # One cost block (a decode block; a prefill block is pls of them) in ms.
        per_block = fleet.ms_per_block / pls if pls > 0.0 else fleet.ms_per_block
        dms = p.decode_ms_per_block
        if dms is None:
            dms = per_block
        # Queue ahead (the prefill of what is routed there and not yet started) plus this
        # request's uncached tokens, through the fitted prefill model; + the batch it
        # joins (the decode blocks running there: Dynamo's decode term) + the duplicate
        # term, both converted to ms.
        rb, bs = out.request_blocks, fleet.block_size
        ttft = [fleet.ttft_ms((a + out.uncached(k)) * bs) for k, a in enumerate(out.prefill)]
        dup_cost = [dup * out.duplicate(k) for k in range(len(costs))]
        costs = [
            t + dms * (d + rb) + per_block * x for t, d, x in zip(ttft, dc, dup_cost, strict=True)
        ]
        out.ttft = ttft
    if out.share is not None and not added:
        # Step sharing, before continuity and the spreads: the previous turn's worker gets
        # the discount on it too, and a new conversation's spread scales it (docs/policy.md
        # "Step sharing": added after them it placed new prompts among the conversations
        # between turns, whose contexts they then evicted).
        out.costs = costs
        _add_prefill_blocks(out, p, p.step_share, out.share, fleet)
        costs = out.costs
    c = p.continuity
    prev = fleet.previous
    left = fleet.left
    if left is not None:
        # The worker the session leaves wins only when it is the one eligible.
        k = out.position(left)
        if k is not None and len(costs) > 1:
            top = costs[0]  # max(costs)
            for x in costs:
                if x > top:
                    top = x
            costs[k] += top + 1.0
    elif prev is not None and c > 0.0 and (fleet.own != 0 or fleet.evicted):
        k = out.position(prev)
        if k is not None:
            costs[k] *= 1.0 - (p.continuity_evicted if fleet.evicted else c)
            out.previous = prev
    live = fleet.sessions
    spread = p.session_spread
    if fleet.conversation is not None:
        spread = p.conversation_spread  # (a recognised conversation, no session id)
    if live is not None and spread > 0.0:
        lo = live[0]  # min(live)
        for s in live:
            if s < lo:
                lo = s
        # "blocks": at least the new session's own size (an empty worker is not infinitely
        # better than one holding one session like it). A recognised conversation: in
        # units of one conversation (or its blocks), not of the fewest.
        # unit = max(0.0 or lo, request blocks or 0.0, 1.0), first maximal as max() is:
        unit = 0.0 if fleet.conversation is not None else lo
        x = out.request_blocks if p.session_weight == "blocks" else 0.0
        if x > unit:
            unit = x
        if unit < 1.0:
            unit = 1.0
        if len(live) != len(costs):
            raise ValueError("cost columns differ in length")
        k = 0
        for s in live:
            if s > lo:
                costs[k] = costs[k] * (1.0 + spread * (s - lo) / unit)
            k += 1
    out.costs = costs
    out.fleet = fleet


def pick(
    costs: Sequence[float],
    tiebreak: Callable[[int], tuple[float, ...]],
    temperature: float,
    rng: random.Random,
    native: bool = True,
) -> int:
    """Index of the winner: lowest cost, then least load, then random; or softmax sampling.

    `tiebreak(i)` is candidate i's tie-break key (e.g. load in blocks, in-flight
    requests); it is only asked for when costs tie. (Loops, not `min` / `max` and
    comprehensions: the same comparisons, in the same order, without a builtin's keyword
    parsing or a comprehension's frame at a handful of candidates.) At temperature 0 the
    compiled `pick_lowest` runs this code when built (`native=False`: this code).
    """
    if native and _NATIVE_COST is not None and not temperature > 0.0 and type(costs) is list:
        lowest: int = _NATIVE_COST.pick_lowest(costs, tiebreak, rng, random.Random)
        return lowest
    n = len(costs)
    if n == 1:
        return 0
    # min(costs) and its first position (costs.index of it).
    c_min = costs[0]
    j = k = 0
    for c in costs:  # (a counter, not range(): a range object costs ~1,000 instructions)
        if c < c_min:
            c_min, j = c, k
        k += 1
    if temperature > 0.0:
        c_max = max(costs)
        if c_max > c_min:
            scale = (c_max - c_min) * temperature
            weights = [math.exp(-(c - c_min) / scale) for c in costs]
            return rng.choices(range(n), weights=weights)[0]
    # Costs equal within float noise are ties; none among the others: the lowest wins.
    a = c_min if c_min >= 0.0 else -c_min  # abs(c_min) (-0.0 and NaN end at 1.0 either way)
    limit = c_min + 1e-9 * (a if a > 1.0 else 1.0)
    other: float | None = None  # min over the others
    k = 0
    for c in costs:
        if k != j and (other is None or c < other):
            other = c
        k += 1
    if other is not None and other > limit:
        return j
    tied: list[int] = []
    keys: list[tuple[float, ...]] = []
    i = 0
    for c in costs:
        if c <= limit:
            tied.append(i)
            keys.append(tiebreak(i))
        i += 1
    if not keys:  # (a NaN lowest cost ties nothing: min()'s error, as before)
        raise ValueError("min() arg is an empty sequence")
    best = keys[0]  # min(keys)
    for key in keys:
        if key < best:
            best = key
    won: list[int] = []
    k = 0
    for key in keys:
        if key == best:
            won.append(tied[k])
        k += 1
    if len(won) == 1:
        return won[0]
    if type(rng) is random.Random:
        # rng.choice(won), inlined: Random.choice is won[_randbelow(len(won))] and
        # _randbelow draws getrandbits(n.bit_length()) until below n: the same draws, the
        # same state after (tests/policy/test_policy_cost.py).
        m = len(won)
        bits = m.bit_length()
        r = rng.getrandbits(bits)
        while r >= m:
            r = rng.getrandbits(bits)
        return won[r]
    return rng.choice(won)


def softmax_probabilities(costs: Sequence[float], temperature: float) -> list[float]:
    """The sampling distribution `pick` uses at temperature T (for tests and docs)."""
    c_min, c_max = min(costs), max(costs)
    if temperature <= 0.0 or c_max == c_min:
        raise ValueError("softmax needs T > 0 and distinct costs")
    scale = (c_max - c_min) * temperature
    w = [math.exp(-(c - c_min) / scale) for c in costs]
    s = sum(w)
    return [x / s for x in w]
