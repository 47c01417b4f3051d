"""Profiles users compose in config: plugins by name, weights, pickers, dry runs, errors."""

from __future__ import annotations

import random
from typing import Any

import pytest
from kvpolicy_helpers import endpoint, hold, keys, make, request

from scorer.app import make_policy
from scorer.config import ConfigError, load_config
from scorer.policy.base import PolicyContext
from scorer.policy.parts import Parts
from scorer.policy.registry import PLUGINS, by_kind
from scorer.pool.workers import Pool
from scorer.routing import Reason

EPS = [endpoint(i) for i in range(3)]


def build(profile: dict[str, Any], **extra: Any) -> Any:
    cfg = load_config(
        overrides={
            "pool": {"workers": EPS, "block_size": 16},
            "policy": "mine",
            "profiles": {"mine": profile},
            **extra,
        },
        environ={},
    )
    pool = Pool.from_config(cfg)
    return cfg, pool, make_policy(cfg, pool, Parts())


def test_registry_lists_each_plugin_once_by_kind() -> None:
    names = [(p.kind, p.name) for p in PLUGINS]
    assert len(names) == len(set(names))
    assert {"busy", "lora"} <= set(by_kind("filter"))
    assert {"dynamo_cost", "kv_overlap", "queue_depth", "kv_usage", "inflight"} <= set(
        by_kind("scorer")
    )
    assert {"max_score", "round_robin", "random"} <= set(by_kind("picker"))


def test_weighted_scorers_trade_cache_against_queue() -> None:
    s = make(3, policy="kv")
    parts = s.ctx.parts
    k = keys(10)
    hold(s.index, endpoint(0), k)  # worker 0 holds the whole prompt
    hold(s.index, endpoint(1), k[:5])
    now = 1000.0
    for i, waiting in enumerate([6.0, 0.0, 0.0]):  # ...but worker 0 has a queue
        sc = s.pool.workers[endpoint(i)].scraped
        sc.waiting, sc.at = waiting, now

    def policy(weights: tuple[float, float]) -> Any:
        raw = {
            "scorers": [
                {"type": "kv_overlap", "weight": weights[0]},
                {"type": "queue_depth", "weight": weights[1]},
            ]
        }
        cfg = s.config.model_copy(update={"policy": "p", "profiles": {"p": raw}})
        ctx = PolicyContext(pool=s.pool, config=cfg, rng=random.Random(1), parts=parts)
        from scorer.policy.base import build_policy

        pol = build_policy("p", ctx, None)
        pol.clock = lambda: now  # type: ignore[attr-defined]
        return pol

    # Cache dominates: 1.0*2 + 1/7 > 0.5*2 + 1.
    d = policy((2.0, 1.0)).decide(request(k), list(s.pool))
    assert d.endpoint == endpoint(0) and d.reason is Reason.KV_HIT and d.policy == "p"
    # Queue dominates: 1.0 + 1/7*4 < 0.5 + 1*4.
    d = policy((1.0, 4.0)).decide(request(k), list(s.pool))
    assert d.endpoint == endpoint(1)
    rows = {c.endpoint: c for c in d.candidates}
    assert rows[endpoint(1)].cost == pytest.approx(-(0.5 * 1.0 + 1.0 * 4.0))
    assert rows[endpoint(0)].matched_blocks == 10


def test_busy_filter_and_lora_filter_compose() -> None:
    _cfg, pool, pol = build(
        {
            "filters": [{"type": "busy", "busy_inflight": 2}, {"type": "lora"}],
            "scorers": [{"type": "inflight"}],
        }
    )
    w = pool.workers
    w[EPS[0]].inflight.requests = 5  # busy
    w[EPS[2]].scraped.lora_running = ["ad"]  # the only one with the adapter loaded
    r = request(None, lora="ad")
    d = pol.decide(r, list(pool))
    assert d.endpoint == EPS[2]
    rows = {c.endpoint: c for c in d.candidates}
    assert rows[EPS[0]].filtered == "busy_inflight"
    assert rows[EPS[1]].filtered == "lora_not_loaded"
    # Nobody has the adapter: every non-busy worker stays.
    w[EPS[2]].scraped.lora_running = []
    w[EPS[2]].inflight.requests = 1
    assert pol.decide(request(None, lora="ad"), list(pool)).endpoint == EPS[1]


def test_session_affinity_scorer_sticks_and_dry_run_binds_nothing() -> None:
    _cfg, pool, pol = build(
        {
            "scorers": [
                {"type": "session_affinity", "weight": 100, "header": "X-Conv"},
                {"type": "inflight"},
            ]
        }
    )
    first = pol.decide(request(None, headers={"x-conv": "c1"}), list(pool)).endpoint
    pool.workers[first].inflight.requests = 3  # now the most loaded: still chosen
    assert pol.decide(request(None, headers={"x-conv": "c1"}), list(pool)).endpoint == first
    dry = request(None, headers={"x-conv": "c2"}, dry_run=True)
    pol.decide(dry, list(pool))
    assert pol.plugin("session_affinity").bindings.keys() == {"c1"}  # type: ignore[union-attr]


def test_temperature_picker_samples_and_random_among_ties() -> None:
    _cfg, pool, pol = build({"scorers": [{"type": "inflight"}], "picker": {"type": "random"}})
    seen = {pol.decide(request(None), list(pool)).endpoint for _ in range(60)}
    assert seen == set(EPS)
    d = pol.decide(request(None), list(pool))
    assert d.reason is Reason.RANDOM


@pytest.mark.parametrize(
    ("profile", "field"),
    [
        ({"scorers": [{"type": "nope"}]}, "profiles.mine.scorers[0].type: unknown scorer 'nope'"),
        ({"scorers": [{"type": "inflight", "weight": -1}]}, "profiles.mine.scorers[0].weight"),
        (
            {"filters": [{"type": "busy", "busy_waiting": "lots"}]},
            "profiles.mine.filters[0].busy_waiting",
        ),
        ({"picker": {"type": "max_score", "temprature": 1}}, "profiles.mine.picker.temprature"),
        ({"scorer": []}, "profiles.mine.scorer"),
    ],
)
def test_bad_profile_stops_start_up_naming_the_field(profile: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError) as e:
        build(profile)
    assert field in str(e.value)


def test_shipped_name_cannot_be_redefined() -> None:
    with pytest.raises(ConfigError) as e:
        load_cfg = load_config(
            overrides={"pool": {"workers": EPS}, "policy": "kv", "profiles": {"kv": {}}},
            environ={},
        )
        make_policy(load_cfg, Pool.from_config(load_cfg), Parts())
    assert "profiles.kv" in str(e.value)


def test_docs_worked_example_scorer_is_one_file_and_one_registry_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The scorer shown in docs/policy.md works as written once listed in PLUGINS."""
    import re
    import types
    from pathlib import Path

    from scorer.policy import registry

    doc = (Path(__file__).resolve().parents[2] / "docs" / "policy.md").read_text()
    code = re.search(r"```python\n# scorer/policy/scorers/running.py\n(.*?)```", doc, re.S)
    assert code is not None
    mod = types.ModuleType("running_example")
    exec(compile(code.group(1), "running.py", "exec"), mod.__dict__)
    monkeypatch.setattr(registry, "PLUGINS", (*registry.PLUGINS, mod.Running))
    _cfg, pool, pol = build({"scorers": [{"type": "running", "cap": 10}]})
    pool.workers[EPS[0]].scraped.running = 9
    pool.workers[EPS[1]].scraped.running = 2
    pool.workers[EPS[2]].scraped.running = 5
    assert pol.decide(request(None), list(pool)).endpoint == EPS[1]
