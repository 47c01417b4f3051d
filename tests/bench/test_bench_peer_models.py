"""The replay's models of the peers' routing rules (tools/kvscorer_tools/bench/peer_models.py).

Each rule is checked on a hand-built fleet: which worker wins, what the model writes into
the index or its tree, and that a dry run writes nothing. The sources the rules come
from are named in the module's docstring (vllm-project/router, src/policies/).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
from configs import make_config

from kvscorer_tools.bench.peer_models import MODELS, build_model
from kvscorer_tools.bench.replay import ReplaySettings, RequestKeys, run_replay
from kvscorer_tools.bench.workloads import load_workload
from scorer.cli import main
from scorer.index import BlockIndex
from scorer.policy.base import Policy, PolicyContext
from scorer.policy.parts import Parts
from scorer.pool.workers import Pool
from scorer.routing import Reason, RoutingRequest

BLOCK = 16


def _fleet(
    n: int, name: str, options: dict[str, Any] | None = None
) -> tuple[Pool, BlockIndex, Policy]:
    cfg = make_config(
        [{"endpoint": f"10.0.0.{i + 1}:8000"} for i in range(n)], pool={"block_size": BLOCK}
    )
    pool = Pool.from_config(cfg)
    index = BlockIndex(cfg.index)
    ctx = PolicyContext(pool=pool, config=cfg, rng=random.Random(1), parts=Parts(index=index))
    return pool, index, build_model(name, ctx, options)


def _req(keys: list[int], dry_run: bool = False) -> RoutingRequest:
    return RoutingRequest(
        request_id="r", model="m", block_keys=keys, block_size=BLOCK,
        prompt_tokens=len(keys) * BLOCK, dry_run=dry_run,
    )  # fmt: skip


def _hold(index: BlockIndex, ep: str, keys: list[int]) -> None:
    index.add(ep, None, [k ^ 0x5A5A for k in keys], keys, "GPU")


def _busy(pool: Pool, ep: str, requests: int) -> None:
    pool.workers[ep].inflight.requests = requests


def _decide(pool: Pool, policy: Policy, req: RoutingRequest) -> Any:
    return policy.decide(req, list(pool))


def test_kv_aware_longest_match_wins_whatever_the_load_ties_go_to_the_last() -> None:
    pool, index, pol = _fleet(4, "model:vllm_kv_aware")
    eps = list(pool.workers)
    prompt = [1, 2, 3, 4]
    _hold(index, eps[0], prompt[:2])
    _hold(index, eps[2], prompt[:3])
    _busy(pool, eps[2], 50)  # no load term once anything matches
    d = _decide(pool, pol, _req(prompt, dry_run=True))
    assert d.endpoints == [eps[2]] and d.reason == Reason.KV_HIT
    _hold(index, eps[1], prompt[:3])
    _hold(index, eps[3], prompt[:3])
    # Equal longest matches on 1, 2 and 3: Rust's max_by_key keeps the last.
    assert _decide(pool, pol, _req(prompt, dry_run=True)).endpoints == [eps[3]]


def test_kv_aware_no_match_is_the_first_least_loaded_and_its_blocks_become_speculative() -> None:
    pool, index, pol = _fleet(4, "model:vllm_kv_aware", {"speculative_ttl_s": 10})
    eps = list(pool.workers)
    for ep, n in zip(eps, (3, 1, 1, 2), strict=True):
        _busy(pool, ep, n)
    prompt = [7, 8, 9]
    # A dry run decides the same and writes nothing.
    assert _decide(pool, pol, _req(prompt, dry_run=True)).endpoints == [eps[1]]
    assert index.match(prompt, eps) == {}
    d = _decide(pool, pol, _req(prompt))
    assert d.endpoints == [eps[1]] and d.reason == Reason.LOAD  # min_by_key: the first of 1, 2
    m = index.match(prompt, eps)
    assert set(m) == {eps[1]} and m[eps[1]].blocks == 3
    # The same prompt again goes there by its (speculative) match, even if busier now.
    _busy(pool, eps[1], 9)
    assert _decide(pool, pol, _req(prompt)).endpoints == [eps[1]]


def test_kv_aware_shared_first_block_piles_and_the_variants_do_not() -> None:
    """Every prompt sharing one block (Mooncake's hash id 0) goes where that block is."""
    pool, index, pol = _fleet(4, "model:vllm_kv_aware")
    eps = list(pool.workers)
    got = []
    for i in range(6):
        d = _decide(pool, pol, _req([1, 100 + i, 200 + i]))
        _busy(pool, d.endpoints[0], pool.workers[d.endpoints[0]].inflight.requests + 1)
        got.append(d.endpoints[0])
    assert got == [eps[0]] * 6
    pool, index, var = _fleet(
        4, "model:vllm_kv_aware", {"min_match_blocks": 1, "tie": "least_loaded"}
    )
    got = []
    for i in range(4):
        d = _decide(pool, var, _req([1, 100 + i, 200 + i]))
        _busy(pool, d.endpoints[0], pool.workers[d.endpoints[0]].inflight.requests + 1)
        got.append(d.endpoints[0])
    assert got == eps  # a one-block match counts as none: least loaded each time
    # ... and a longer match still wins, the least loaded of the equal holders.
    _hold(index, eps[1], [1, 101])
    _hold(index, eps[3], [1, 101])
    _busy(pool, eps[3], 0)
    assert _decide(pool, var, _req([1, 101, 5])).endpoints == [eps[3]]


def test_cache_aware_threshold_last_tenant_and_imbalance() -> None:
    pool, _, pol = _fleet(3, "model:cache_aware")
    eps = list(pool.workers)
    _busy(pool, eps[0], 1)
    # Nothing routed yet: the least loaded (the first of eps[1] and eps[2]).
    assert _decide(pool, pol, _req([1, 2, 3, 4])).endpoints == [eps[1]]
    # 2 of 4 blocks routed before (> cache_threshold 0.3): the tenant that had them.
    _busy(pool, eps[1], 5)
    assert _decide(pool, pol, _req([1, 2, 8, 9])).endpoints == [eps[1]]
    # 1 of 4 is not more than 0.3: the least loaded, which becomes [1]'s last tenant.
    assert _decide(pool, pol, _req([1, 20, 21, 22])).endpoints == [eps[2]]
    assert _decide(pool, pol, _req([1, 30, 31])).endpoints == [eps[2]]  # 1 of 3 > 0.3
    # eps[1] is sent [1, 2, 3] again: now it is the last tenant of [1].
    assert _decide(pool, pol, _req([1, 2, 3, 5])).endpoints == [eps[1]]
    assert _decide(pool, pol, _req([1, 40, 41])).endpoints == [eps[1]]
    # Imbalanced (max - min > 64 and max > 1.5 x min): least loaded whatever the tree says.
    _busy(pool, eps[2], 50)  # 49 apart: still balanced
    assert _decide(pool, pol, _req([1, 2, 3, 4])).endpoints == [eps[1]]
    _busy(pool, eps[2], 70)
    assert _decide(pool, pol, _req([1, 2, 3, 4])).endpoints == [eps[0]]
    # A dry run leaves the tree as it was.
    n = len(pol.tree)  # type: ignore[attr-defined]
    _decide(pool, pol, _req([50, 51], dry_run=True))
    assert len(pol.tree) == n  # type: ignore[attr-defined]


def test_models_run_in_the_replay_deterministically() -> None:
    wl = load_workload("shared-prefix", groups=4, prompts_per_group=4, rate=2.0)
    s = ReplaySettings(workers=4, capacity_blocks=40, block_size=512, seed=3)
    keys = RequestKeys(wl, 512)
    for name in MODELS:
        a = run_replay(wl, name, s, keys).as_dict()
        b = run_replay(wl, name, s, keys).as_dict()
        a.pop("wall_s"), b.pop("wall_s")
        assert a == b and a["requests"] == 16 and a["errors"] == 0
        assert a["hit_rate"] > 0.3  # each group's system prompt is found again


@pytest.mark.slow
def test_cli_models_replay_only(tmp_path: Path) -> None:
    base = ["bench", "--out", str(tmp_path), "--workload", "shared-prefix", "--param", "groups=2"]
    assert main([*base, "--mode", "e2e", "--policies", "model:cache_aware"]) == 2
    assert main([*base, "--policies", "kv,model:vllm_kv_aware"]) == 0
