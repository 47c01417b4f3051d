"""The discrete-event replay: deterministic, real policies and index, sensible numbers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvscorer_tools.bench.replay import (
    ReplaySettings,
    RequestKeys,
    oracle_token_hit_rate,
    run_replay,
)
from kvscorer_tools.bench.report import check_results_shape
from kvscorer_tools.bench.workloads import load_workload, mooncake_conversation
from scorer.cli import main


def _small() -> tuple[object, ReplaySettings]:
    wl = load_workload("shared-prefix", groups=8, prompts_per_group=8, rate=2.0)
    return wl, ReplaySettings(workers=4, capacity_blocks=20, block_size=512, seed=3)


def test_same_seed_same_results_and_kv_beats_round_robin() -> None:
    wl, s = _small()
    keys = RequestKeys(wl, s.block_size)  # type: ignore[arg-type]
    a = run_replay(wl, "kv", s, keys).as_dict()  # type: ignore[arg-type]
    b = run_replay(wl, "kv", s, keys).as_dict()  # type: ignore[arg-type]
    a.pop("wall_s"), b.pop("wall_s")
    assert a == b
    rr = run_replay(wl, "round_robin", s, keys)  # type: ignore[arg-type]
    assert a["requests"] == rr.requests == 64 and a["errors"] == rr.errors == 0
    # 8 system prompts of 4 blocks, 4 workers of 20 blocks: round robin churns them all
    # through every worker; kv mostly keeps a group where its prefix is.
    assert a["hit_rate"] > rr.hit_rate + 0.1
    assert a["reasons"].get("kv_hit", 0) > 30
    assert a["ttft_mean_ms"] < rr.extra["ttft_mean_ms"]
    # Token-level ceiling: every request after a group's first one could hit 4 of ~4.25 blocks.
    assert a["hit_rate"] <= oracle_token_hit_rate(wl, keys) + 1e-9  # type: ignore[arg-type]


def test_tiny_capacity_evicts_and_prompts_too_big_are_errors() -> None:
    wl, s = _small()
    s.capacity_blocks = 3  # a 2176-token prompt needs 5 blocks (4 full + partial/decode)
    res = run_replay(wl, "round_robin", s)  # type: ignore[arg-type]
    assert res.errors == res.requests == 64
    s.capacity_blocks = 6
    res = run_replay(wl, "kv", s)  # type: ignore[arg-type]
    assert res.errors == 0 and res.extra["evictions"] > 0


@pytest.mark.slow
def test_mooncake_slice_kv_vs_round_robin() -> None:
    wl = mooncake_conversation().slice(max_requests=400)
    s = ReplaySettings(workers=8, capacity_blocks=1000, block_size=512, seed=0)
    keys = RequestKeys(wl, 512)
    kv = run_replay(wl, "kv", s, keys)
    rr = run_replay(wl, "round_robin", s, keys)
    assert kv.hit_rate > 1.5 * rr.hit_rate
    assert kv.imbalance < 1.6
    assert kv.throughput_rps > 0 and kv.ttft_p99_ms >= kv.ttft_p50_ms > 0


@pytest.mark.slow
def test_cli_writes_results_json_and_plots(tmp_path: Path, capsys: object) -> None:
    out = tmp_path / "o"
    rc = main([
        "bench", "--workload", "shared-prefix", "--mode", "replay", "--out", str(out),
        "--workers", "4", "--capacity-blocks", "40", "--seed", "5",
        "--param", "groups=4", "--param", "prompts_per_group=4",
        "--policies", "kv,round_robin,sglang_cache_aware", "--set", "kv.credit_decay=0.2",
        "--sweep-capacity",
    ])  # fmt: skip
    assert rc == 0
    doc = json.loads((out / "results.json").read_text())
    assert check_results_shape(doc) == []
    assert doc["workload"] == "shared-prefix"
    assert doc["settings"]["workers"] == 4 and doc["settings"]["seed"] == 5
    assert doc["settings"]["policy_options"] == {"kv": {"credit_decay": 0.2}}
    assert set(doc["policies"]) == {"kv", "round_robin", "sglang_cache_aware", "oracle"}
    assert "error" in doc["policies"]["sglang_cache_aware"]  # peers are e2e only
    assert set(doc["policies"]["oracle"]) >= {"hit_rate"}
    sweep = doc["capacity_sweep"]
    assert sweep["capacities"] == [500, 1000, 5000, "unbounded"]
    for key in ("hit_rate", "ttft_p50_ms", "ttft_p99_ms", "imbalance"):
        assert len(sweep[key]["kv"]) == 4, key
    for p50, p99 in zip(sweep["ttft_p50_ms"]["kv"], sweep["ttft_p99_ms"]["kv"], strict=True):
        assert 0 < p50 <= p99
    for png in ("policies.png", "capacity_sweep.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out  # type: ignore[attr-defined]
    assert "hit rate" in printed and "round_robin" in printed


def test_cli_rejects_bad_flags(tmp_path: Path) -> None:
    base = ["bench", "--out", str(tmp_path), "--workload", "shared-prefix"]
    assert main([*base, "--policies", "kv,nope"]) == 2
    assert main([*base, "--set", "kv"]) == 2
    assert main([*base, "--param", "colour=red"]) == 2
    assert not (tmp_path / "results.json").exists()


def _prefill_views(settings: ReplaySettings, counters: bool = True) -> list[tuple[int, int]]:
    """At each decision: (requests the router counts before their first byte, requests
    really routed and without their first token). `counters`: False drops the pages'
    first-token counts (`before_first`), as an engine without them."""
    from kvscorer_tools.bench.replay import _Replay

    wl = mooncake_conversation().slice(max_requests=60)
    sim = _Replay(wl, RequestKeys(wl, 512), "kv", settings)
    if not counters:
        scrape = sim.scrape

        def no_counts() -> None:
            scrape()
            for w in sim.pool:
                w.scraped.before_first = None

        sim.scrape = no_counts  # type: ignore[method-assign]
    seen: list[tuple[int, int]] = []
    decide = sim.director.decide_prepared

    def spy(req: object, *a: object, **k: object) -> object:
        counted = sum(w.inflight.prefill_requests for w in sim.pool)
        real = sum(1 for r in sim.reqs if r.worker is not None and r.first < 0 and r.done < 0)
        seen.append((counted, real))
        return decide(req, *a, **k)  # type: ignore[arg-type]

    sim.director.decide_prepared = spy  # type: ignore[method-assign]
    sim.run()
    return seen


def test_router_view_of_an_e2e_run_lags_the_engines() -> None:
    """By default the router ends a request's prefill at its first token (exact); with
    the e2e run's view (its clock 5x slower, no response seen) it counts requests
    prefilling after their first token until the scrape's counters or its estimate end
    them, and its scrapes come five times less often in model time."""
    s = ReplaySettings(workers=8, capacity_blocks=1000, block_size=512, seed=0)
    exact = _prefill_views(s)
    assert all(c == r for c, r in exact)
    s.router_time_scale, s.lean_view = 5.0, True
    lean = _prefill_views(s)
    assert all(c >= r for c, r in lean)
    phantoms = sum(c - r for c, r in lean)
    assert phantoms >= 5
    # The pages' first-token counters end them: without, far more linger.
    blind = _prefill_views(s, counters=False)
    assert sum(c - r for c, r in blind) > 2 * phantoms


def test_router_time_scale_stretches_the_routers_clock_and_scrapes() -> None:
    from kvscorer_tools.bench.replay import CLOCK_BASE, _Replay

    wl = mooncake_conversation().slice(max_requests=40)
    keys = RequestKeys(wl, 512)
    pages = []
    for scale in (1.0, 5.0):
        s = ReplaySettings(capacity_blocks=1000, seed=0, router_time_scale=scale)
        sim = _Replay(wl, keys, "kv", s)
        sim.run()
        assert sim.clock() == pytest.approx(CLOCK_BASE + sim.now / scale)
        pages.append(next(iter(sim.pool)).scraped.pages)
    assert pages[1] == pytest.approx(pages[0] / 5, abs=2)
