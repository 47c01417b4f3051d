"""Models of the peer routers' algorithms, for the deterministic replay only.

The e2e benchmark runs the peers themselves (vllm-router 0.1.17, sglang-router 0.3.2);
these classes re-state their routing rules in our own code so the replay can put them on
the same simulated fleet, trace and seed as our policies and pair their requests with
ours. They are bench tools: not shipped in `scorer/`, not selectable in `kv-scorer
serve`, refused by `kv-scorer bench --mode e2e` (which runs the real peers).

* `model:vllm_kv_aware`: vllm-router's `kv_aware` policy (vllm-project/router,
  src/policies/kv_aware.rs, src/kv_index/scorer.rs, src/kv_index/index.rs). Per request:
  the longest contiguous cached prefix per worker from the KV-event index (speculative
  entries count until their TTL); the worker with the most blocks wins, ties going to the
  last such worker in worker order (Rust's `max_by_key`); if the best is 0 blocks (or the
  prompt has no full block) the worker with the fewest in-flight requests wins
  (`Worker::load()`, `min_by_key`: the first such worker); then the uncached blocks
  from the best match on are inserted speculatively for the chosen worker with one TTL.
  No load term at all once any block matches.
* `model:cache_aware`: vllm-router's `cache_aware` (src/policies/cache_aware.rs; the
  thresholds are its launcher's defaults, `vllm_router/router_args.py`, the same in
  sglang-router's), which is sglang-router's `cache_aware`:
  when in-flight requests per worker are imbalanced (max - min > `balance_abs_threshold`
  and max > `balance_rel_threshold` x min) the least loaded worker (first minimum) wins;
  otherwise an approximate radix tree of the prompts it routed gives the longest prefix
  any worker was sent, and if that prefix is more than `cache_threshold` of the prompt
  the worker that last had it routed wins (the matched node's `last_tenant`, src/tree.rs),
  else the least loaded worker. Every routed prompt is inserted for its worker.

Where the models differ from the peers (the replay's fleet, not their code): the
cache_aware tree is kept per block of the prompt (our chained block keys) instead of per
character, so a match counts whole blocks (the peers' character match also counts the
previous prompt's partial last block, at most one block more), and its LRU size bound
is not modelled (the benchmark's runs stay far below it). kv_aware's index here is ours,
fed by the simulated workers' stores and evictions like the replay's `kv`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal

from pydantic import Field

from scorer.policy.base import Policy, PolicyContext, PolicyOptions
from scorer.routing import CandidateScore, Decision, Reason, RoutingRequest

if TYPE_CHECKING:
    from scorer.pool.workers import Worker


def _first_least_loaded(candidates: Sequence[Worker]) -> int:
    """Position of the first candidate with the fewest in-flight requests (`min_by_key`)."""
    best = 0
    for k in range(1, len(candidates)):
        if candidates[k].inflight.requests < candidates[best].inflight.requests:
            best = k
    return best


def _decision(
    policy: str,
    request: RoutingRequest,
    candidates: Sequence[Worker],
    winner: int,
    reason: Reason,
    matched: Sequence[int],
) -> Decision:
    bs = request.block_size or 1
    tokens = min(matched[winner] * bs, request.prompt_tokens)
    rows = [
        CandidateScore(
            endpoint=w.endpoint,
            matched_blocks=matched[k],
            matched_tokens=min(matched[k] * bs, request.prompt_tokens),
            inflight=w.inflight.requests,
        )
        for k, w in enumerate(candidates)
    ]
    d = Decision(
        endpoints=[candidates[winner].endpoint],
        reason=reason,
        policy=policy,
        matched_tokens=tokens,
        request_tokens=request.prompt_tokens,
    )
    d.candidates = rows
    return d


class VllmKvAwareOptions(PolicyOptions):
    # vllm-router's KvAwareConfig.speculative_ttl is 2 s of wall time; the e2e benchmark
    # runs at --time-scale 5, where that is 10 s of the trace's (model) time.
    speculative_ttl_s: float = Field(10.0, ge=0)
    speculative: bool = True
    # Variants (not the peer's rule; for finding what its placement depends on): among
    # equal longest matches take the least loaded instead of the last worker, and count a
    # match of at most this many blocks as none (Mooncake's every prompt shares its first
    # block, so the faithful rule never reaches its least-load branch once any worker
    # holds it).
    tie: Literal["last", "least_loaded"] = "last"
    min_match_blocks: int = Field(0, ge=0)


class VllmKvAwareModel(Policy):
    """vllm-router `kv_aware` (see the module docstring)."""

    name = "model:vllm_kv_aware"
    Options = VllmKvAwareOptions
    options: VllmKvAwareOptions
    needs_tokens = True

    def decide(self, request: RoutingRequest, candidates: Sequence[Worker]) -> Decision:
        keys = request.block_keys or []
        index = self.ctx.parts.index
        matched = [0] * len(candidates)
        if keys and index is not None:
            got = index.match(keys, [w.endpoint for w in candidates])
            for k, w in enumerate(candidates):
                m = got.get(w.endpoint)
                matched[k] = 0 if m is None else m.blocks
        if not keys:
            return _decision(
                self.name, request, candidates, _first_least_loaded(candidates),
                Reason.LOAD, matched,
            )  # fmt: skip
        o = self.options
        best = 0
        for k in range(1, len(candidates)):
            if matched[k] >= matched[best]:  # max_by_key: the last of equal maxima
                best = k
        top = matched[best]
        if top > 0 and o.tie == "least_loaded":
            tied = [w for k, w in enumerate(candidates) if matched[k] == top]
            best = candidates.index(tied[_first_least_loaded(tied)])
        winner = best if top > o.min_match_blocks else _first_least_loaded(candidates)
        held = matched[winner]  # = top under the peer's rule (0 on its least-load branch)
        if o.speculative and held < len(keys) and not request.dry_run and index is not None:
            # The uncached rest of the prompt, for the chosen worker (kv_aware.rs).
            index.insert_speculative(candidates[winner].endpoint, keys[held:], o.speculative_ttl_s)
        return _decision(
            self.name, request, candidates, winner,
            Reason.KV_HIT if held > 0 else Reason.LOAD, matched,
        )  # fmt: skip


class CacheAwareOptions(PolicyOptions):
    # What the e2e benchmark runs: both launchers' defaults (vllm_router/router_args.py of
    # vllm-router 0.1.17, sglang_router/router_args.py of sglang-router 0.3.2), which
    # override the Rust struct's (src/policies/mod.rs CacheAwareConfig: 0.5, 32, 1.1).
    cache_threshold: float = Field(0.3, ge=0, le=1)
    balance_abs_threshold: int = Field(64, ge=0)
    balance_rel_threshold: float = Field(1.5, ge=0)


class CacheAwareModel(Policy):
    """vllm-router / sglang-router `cache_aware` (see the module docstring)."""

    name = "model:cache_aware"
    Options = CacheAwareOptions
    options: CacheAwareOptions
    needs_tokens = True

    def __init__(self, ctx: PolicyContext, options: PolicyOptions) -> None:
        super().__init__(ctx, options)
        # Block key (a chained key names its whole prefix) → worker → last insertion
        # epoch; a worker's insertion also refreshes its epoch on the prefix's nodes.
        self.tree: dict[int, OrderedDict[str, int]] = {}
        self.epoch = 0

    def _insert(self, keys: Sequence[int], endpoint: str) -> None:
        self.epoch += 1
        for key in keys:
            holders = self.tree.get(key)
            if holders is None:
                holders = self.tree[key] = OrderedDict()
            holders[endpoint] = self.epoch
            holders.move_to_end(endpoint)  # last entry: the node's last tenant

    def decide(self, request: RoutingRequest, candidates: Sequence[Worker]) -> Decision:
        o = self.options
        keys = request.block_keys or []
        loads = [w.inflight.requests for w in candidates]
        lo, hi = min(loads), max(loads)
        matched = [0] * len(candidates)
        if hi - lo > o.balance_abs_threshold and hi > lo * o.balance_rel_threshold:
            winner, reason = _first_least_loaded(candidates), Reason.LOAD
        else:
            depth = 0
            tree = self.tree
            while depth < len(keys) and keys[depth] in tree:
                depth += 1
            pos = {w.endpoint: k for k, w in enumerate(candidates)}
            tenant = ""
            if depth:
                node = tree[keys[depth - 1]]
                for k in pos:
                    if k in node:
                        matched[pos[k]] = depth
                tenant = next(reversed(node))
            rate = depth * (request.block_size or 1) / max(request.prompt_tokens, 1)
            if rate > o.cache_threshold:
                # A tenant no longer eligible: the first healthy worker (cache_aware.rs).
                winner, reason = pos.get(tenant, 0), Reason.KV_HIT
            else:
                winner, reason = _first_least_loaded(candidates), Reason.LOAD
        if not request.dry_run and keys:
            self._insert(keys, candidates[winner].endpoint)
        return _decision(self.name, request, candidates, winner, reason, matched)


MODELS: dict[str, type[Policy]] = {
    VllmKvAwareModel.name: VllmKvAwareModel,
    CacheAwareModel.name: CacheAwareModel,
}


def build_model(name: str, ctx: PolicyContext, raw: dict[str, object] | None) -> Policy:
    """The peer model `name` with its options (`policies.NAME`, validated)."""
    cls = MODELS[name]
    return cls(ctx, cls.Options.model_validate(raw or {}))
