"""Shared set-up for the policy tests: a real Config, Pool and BlockIndex."""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass
from typing import Any

from configs import make_config

from scorer.config import Config
from scorer.index import BlockIndex
from scorer.policy.base import Policy, PolicyContext, build_policy
from scorer.policy.parts import Parts
from scorer.pool.workers import Pool
from scorer.routing import RoutingRequest

BLOCK = 16
_ids = itertools.count()


@dataclass
class Setup:
    config: Config
    pool: Pool
    index: BlockIndex
    ctx: PolicyContext
    policy: Policy

    @property
    def endpoints(self) -> list[str]:
        return list(self.pool.workers)


def endpoint(i: int) -> str:
    return f"10.0.0.{i + 1}:8000"


# `kv`'s fleet terms off (the plain Dynamo cost, as `approx` has it): the worked examples
# of the cost function assume it. Tests of the fleet terms set them explicitly
# (test_policy_fleet_terms.py); `make(..., plain=False)` keeps kv's shipped defaults.
PLAIN_KV = {
    "credit_decay": 0.1,
    "duplicate_cost": 0.0,
    "continuity": 0.0,
    "session_spread": 0.0,
    "infer_conversations": False,
    "continuity_evicted": 0.0,
    "step_share": 0.0,
}


def make(
    n: int,
    policy: str = "kv",
    options: dict[str, Any] | None = None,
    seed: int = 7,
    events: bool = False,
    policies: dict[str, dict[str, Any]] | None = None,
    plain: bool = True,
    **config: Any,
) -> Setup:
    """`n` workers, a real BlockIndex, and the named policy with `options` (for `kv`,
    over PLAIN_KV unless `plain` is False)."""
    if policy == "kv" and plain:
        options = {**PLAIN_KV, **(options or {})}
    workers = []
    for i in range(n):
        w: dict[str, Any] = {"endpoint": endpoint(i)}
        if events:
            w["events"] = f"tcp://127.0.0.1:{5600 + i}"
        workers.append(w)
    pol = dict(policies or {})
    pol[policy] = options or {}
    cfg = make_config(workers, pool={"block_size": BLOCK}, policies=pol, **config)
    pool = Pool.from_config(cfg)
    index = BlockIndex(cfg.index)
    ctx = PolicyContext(pool=pool, config=cfg, rng=random.Random(seed), parts=Parts(index=index))
    return Setup(cfg, pool, index, ctx, build_policy(policy, ctx, options))


def keys(n: int, base: int = 1000) -> list[int]:
    """`n` distinct block keys (a prompt of n full blocks)."""
    return [base + i for i in range(n)]


def request(block_keys: list[int] | None, **kw: Any) -> RoutingRequest:
    """A tokenized request of len(block_keys) full blocks."""
    n = len(block_keys or [])
    fields: dict[str, Any] = {
        "request_id": f"r{next(_ids)}",
        "model": "m",
        "body": {"model": "m", "prompt": "x"},
        "block_keys": block_keys,
        "token_ids": None if block_keys is None else [0] * (n * BLOCK),
        "block_size": BLOCK,
        "prompt_tokens": n * BLOCK,
    }
    fields.update(kw)
    return RoutingRequest(**fields)


def hold(index: BlockIndex, ep: str, block_keys: list[int], medium: str = "GPU") -> None:
    """`ep` stores these blocks (as a BlockStored event would record them)."""
    index.add(ep, None, [k ^ 0x5A5A for k in block_keys], block_keys, medium)
