"""The e2e harness's repeats, spread and capacity sweep (fast: processes stubbed), and one
real run through Envoy + the scorer + sims (slow, envoy)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvscorer_tools.bench import cli as bench_cli
from kvscorer_tools.bench import report
from kvscorer_tools.bench.e2e import E2ESettings
from kvscorer_tools.bench.e2e import run as e2e_run
from kvscorer_tools.bench.e2e.summary import combine_repeats
from kvscorer_tools.bench.workloads import load_workload
from scorer.cli import main


def entry(hit: float, p50: float, p99: float, errors: int = 0) -> dict[str, Any]:
    return {
        "hit_rate": hit, "ttft_p50_ms": p50, "ttft_p99_ms": p99, "throughput_rps": 2.0,
        "imbalance": 1.1, "requests": 10, "errors": errors,
    }  # fmt: skip


def test_combine_repeats_takes_medians_and_min_max() -> None:
    got = combine_repeats([entry(0.3, 100, 900), entry(0.1, 300, 700, 1), entry(0.2, 200, 800)])
    assert got["hit_rate"] == 0.2 and got["ttft_p50_ms"] == 200 and got["ttft_p99_ms"] == 800
    assert got["spread"]["hit_rate"] == [0.1, 0.3]
    assert got["spread"]["ttft_p99_ms"] == [700, 900]
    assert got["repeats"] == 3 and got["errors"] == 1 and len(got["runs"]) == 3
    assert report.check_results_shape({"workload": "w", "policies": {"kv": got}}) == []
    even = combine_repeats([entry(0.1, 100, 1), entry(0.3, 300, 3)])
    assert even["hit_rate"] == 0.2 and even["ttft_p50_ms"] == 200


def test_combine_repeats_keeps_failures_apart() -> None:
    half = combine_repeats([{"error": "boom"}, entry(0.2, 10, 20)])
    assert half["hit_rate"] == 0.2 and half["failed_repeats"] == 1
    assert half["first_failure"] == "boom"
    none = combine_repeats([{"error": "not installed"}])
    assert none == {"error": "not installed", "repeats": 1}


def test_run_e2e_interleaves_policies_over_repeats(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    order: list[str] = []
    hits = {"kv": iter([0.4, 0.2, 0.3]), "round_robin": iter([0.1, 0.1, 0.1])}

    class Fleet:
        specs = [object(), object()]

        def __init__(self, *_: object) -> None:
            pass

        def start(self) -> None:
            pass

    def one(_g: object, _f: object, _wl: object, name: str, _s: object) -> dict[str, Any]:
        order.append(name)
        if name == "vllm_router_kv_aware":
            return {"error": "vllm_router is not installed (pip install ...)"}
        return entry(next(hits[name]), 1.0, 2.0)

    monkeypatch.setattr(e2e_run, "SimFleet", Fleet)
    monkeypatch.setattr(e2e_run, "run_one", one)
    wl = load_workload("shared-prefix", groups=1, prompts_per_group=2)
    settings = E2ESettings(run_dir=tmp_path)
    out = e2e_run.run_e2e(
        wl, ["kv", "round_robin", "vllm_router_kv_aware"], settings, log=lambda _: None,
        repeats=3,
    )  # fmt: skip
    # A B C A B A B: interleaved; a peer that is not installed is not tried again.
    assert order == ["kv", "round_robin", "vllm_router_kv_aware", *["kv", "round_robin"] * 2]
    assert out["kv"]["hit_rate"] == 0.3 and out["kv"]["spread"]["hit_rate"] == [0.2, 0.4]
    assert "not installed" in out["vllm_router_kv_aware"]["error"]


def test_breakdown_pairs_repeated_prompts_in_order() -> None:
    """A prompt sent twice is joined send-by-send with its arrivals (not both with one)."""
    from kvscorer_tools.bench.e2e.breakdown import breakdown

    def line(key: int, arrival: float, admitted: float, first: float) -> dict[str, Any]:
        return {
            "key": key, "arrival": arrival, "admitted": admitted, "first": first,
            "ttft_ms": (first - arrival) * 1000 * 2, "waiting": 1, "running": 0,
        }  # fmt: skip

    sims = [
        [line(7, 10.010, 10.020, 10.050)],
        [line(7, 1.010, 1.010, 1.030), line(8, 2.0, 2.1, 2.2)],
    ]
    records = [(7, 10.0, 10.055), (7, 1.0, 1.032), (9, 3.0, 3.1)]  # key 9: never arrived
    b = breakdown(records, sims, speed=2.0)
    assert b["matched"] == 2
    assert b["per_worker"]["requests"] == [1, 1]
    legs = b["legs"]
    assert legs["to_engine_wall_ms"]["p50"] == pytest.approx(10.0)
    assert legs["back_wall_ms"]["mean"] == pytest.approx(3.5)
    assert legs["queue_ms"]["mean"] == pytest.approx(10.0)  # (0 + 10 wall ms) x 2 / 2
    # Proxy legs once in wall ms, the engine in model ms: 10 + 40 + 2 and 10 + 80 + 5.
    assert b["ttft_real_p50_ms"] == pytest.approx((52 + 95) / 2)


def test_table_and_sweep_show_the_spread(tmp_path: Path) -> None:
    kv = combine_repeats([entry(0.3, 100, 900), entry(0.1, 300, 700)])
    table = report.format_table({"kv": kv, "oracle": {"hit_rate": 0.5}})
    header = table.splitlines()[0]
    assert header.count("(min-max)") == 3
    row = next(line for line in table.splitlines() if line.startswith("kv"))
    assert "0.100-0.300" in row and "100-300" in row and "700-900" in row
    at_1000 = {
        "kv": combine_repeats([entry(0.4, 1, 50)]),
        "rr": combine_repeats([entry(0.2, 1, 60)]),
    }
    by_cap = {500: {"kv": kv, "rr": {"error": "x"}}, 1000: at_1000}
    sweep = bench_cli.sweep_doc([500, 1000], by_cap, ["kv", "rr"], {"hit_rate": 0.6})
    assert sweep["capacities"] == [500, 1000]
    assert sweep["hit_rate"] == {"kv": [0.2, 0.4], "rr": [None, 0.2], "oracle": [0.6, 0.6]}
    assert sweep["ttft_p99_ms"]["kv"] == [800, 50]
    assert sweep["ttft_p99_ms_range"]["kv"] == [[700, 900], [50, 50]]
    assert sweep["ttft_p50_ms"]["kv"] == [200, 1] and sweep["ttft_p50_ms"]["rr"] == [None, 1]
    assert sweep["ttft_p50_ms_range"]["kv"] == [[100, 300], [1, 1]]
    text = report.format_sweep(sweep)
    assert "TTFT p99 ms" in text and "0.200 (0.100-0.300)" in text
    p50 = text.split("TTFT p50 ms")[1].split("TTFT p99 ms")[0]
    assert "200 (100-300)" in p50
    png = report.plot_sweep(sweep, tmp_path / "sweep.png", "t")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_e2e_flags_are_checked(tmp_path: Path) -> None:
    base = ["bench", "--out", str(tmp_path), "--workload", "shared-prefix"]
    assert main([*base, "--mode", "replay", "--repeats", "3"]) == 2
    assert main([*base, "--mode", "e2e", "--repeats", "0"]) == 2
    assert main([*base, "--mode", "e2e", "--policies", "kv,sglang_nope"]) == 2
    assert not (tmp_path / "results.json").exists()


@pytest.mark.slow
@pytest.mark.envoy
def test_e2e_run_repeats_through_envoy_and_the_scorer(tmp_path: Path) -> None:
    out = tmp_path / "o"
    rc = main([
        "bench", "--mode", "e2e", "--workload", "shared-prefix", "--out", str(out),
        "--workers", "2", "--capacity-blocks", "64", "--block-size", "16",
        "--param", "groups=2", "--param", "prompts_per_group=3",
        "--param", "system_tokens=256", "--param", "question_tokens=32",
        "--param", "output_tokens=8", "--param", "rate=2", "--time-scale", "10",
        "--concurrency", "8",
        "--policies", "round_robin", "--repeats", "2",
    ])  # fmt: skip
    assert rc == 0
    doc = json.loads((out / "results.json").read_text())
    assert report.check_results_shape(doc) == []
    rr = doc["policies"]["round_robin"]
    assert rr["repeats"] == 2 and len(rr["runs"]) == 2 and rr["errors"] == 0
    # Each repeat starts cold (caches reset). Round robin puts two of a group's three
    # prompts on one of the two workers, so some hits, never above the oracle.
    assert [r["requests"] for r in rr["runs"]] == [6, 6]
    assert 0 < rr["hit_rate"] <= doc["policies"]["oracle"]["hit_rate"] + 1e-9
    assert doc["settings"]["repeats"] == 2 and doc["settings"]["sim_stream_interval"] == 8
    assert all(r["send_lag_p99_ms"] >= 0 for r in rr["runs"])
    # Every request found in the sims' request logs; its legs in order on one clock.
    for r in rr["runs"]:
        b = r["breakdown"]
        assert b["matched"] == 6 and sum(b["per_worker"]["requests"]) == 6
        assert b["legs"]["to_engine_wall_ms"]["p50"] > 0 and b["legs"]["queue_ms"]["p50"] >= 0
        assert r["ttft_real_p50_ms"] > 0
        # Six tiny requests can stay under one clock tick (10 ms) in a process: the roles
        # are reported, never negative; a positive figure is not guaranteed here.
        cpu = r["cpu_s"]
        assert {"sims", "router", "load_generator"} <= cpu.keys()
        assert all(v >= 0 for v in cpu.values())
        assert cpu["sims"] + cpu["router"] + cpu["load_generator"] > 0
    assert "to engine p50" in (report.format_breakdown(doc["policies"]) or "")
    # Each scorer read both workers' replay buffers before the load, skipping everything
    # up to the reset's AllBlocksCleared (the first run: the clear alone; the second: the
    # first run's events too): no earlier history reaches the index, nothing is cleared.
    skipped = []
    for r in rr["runs"]:
        start = r["at_start"]
        assert start["syncs"] == {"ok": 2} and "applied" not in start["sync_messages"]
        skipped.append(start["sync_messages"]["skipped"])
        assert "AllBlocksCleared/ok" not in r.get("events", {})
        assert "AllBlocksCleared/ok" not in start.get("events", {})
    assert skipped[0] == 2 and skipped[1] > skipped[0]
    # Each run's decisions are kept, one file per run, every request's decision in it.
    files = [Path(r["decisions_file"]) for r in rr["runs"]]
    assert [f.name for f in files] == ["1.json", "2.json"]
    for f in files:
        kept = json.loads(f.read_text())
        assert kept["count"] == 6 and {d["policy"] for d in kept["decisions"]} == {"round_robin"}


def test_e2e_capacity_sweep_runs_each_capacity_on_its_own_fleet(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import kvscorer_tools.bench.e2e as e2e_pkg

    seen: list[tuple[int | None, int, str]] = []

    def fake_run_e2e(
        wl: Any, policies: list[str], settings: E2ESettings, log: Any, repeats: int
    ) -> dict[str, Any]:
        cap = settings.capacity_blocks
        seen.append((cap, repeats, str(settings.run_dir)))
        hit = {500: 0.1, 1000: 0.2, 5000: 0.3}[cap or 0]
        return {p: combine_repeats([entry(hit, 10, 100 / hit)] * repeats) for p in policies}

    monkeypatch.setattr(e2e_pkg, "run_e2e", fake_run_e2e)
    out = tmp_path / "o"
    rc = main([
        "bench", "--mode", "e2e", "--workload", "shared-prefix", "--out", str(out),
        "--param", "groups=2", "--param", "prompts_per_group=2", "--sweep-capacity",
        "--policies", "kv,vllm_router_kv_aware",
    ])  # fmt: skip
    assert rc == 0
    assert [c for c, _, _ in seen] == [500, 1000, 5000]
    assert all(r == 3 for _, r, _ in seen)  # e2e default
    assert len({d for _, _, d in seen}) == 3  # a fleet (and its logs) per capacity
    doc = json.loads((out / "results.json").read_text())
    assert doc["capacity_sweep"]["capacities"] == [500, 1000, 5000]
    assert doc["capacity_sweep"]["hit_rate"]["vllm_router_kv_aware"] == [0.1, 0.2, 0.3]
    assert doc["capacity_sweep"]["ttft_p99_ms"]["kv"] == [1000.0, 500.0, 333.3333]
    assert doc["policies"]["kv"]["hit_rate"] == 0.2  # the --capacity-blocks (1,000) run
    assert set(doc["by_capacity"]) == {"500", "1000", "5000"}
    assert (out / "capacity_sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
@pytest.mark.envoy
def test_peers_behind_envoy_get_the_load_through_an_envoy_of_their_own(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import sys

    from kvscorer_tools.bench.e2e import peers

    # The stand-in "peer": an idle process, with the first sim's URL as its address, so the
    # run needs no peer installed; what is checked is the path in front of it.
    peer_urls: list[str] = []

    def stand_in(name: str, group: Any, fleet: Any, settings: E2ESettings) -> Any:
        proc = group.start(name, [sys.executable, "-c", "import time; time.sleep(300)"])
        peer_urls.append(fleet.specs[0].url)
        return proc, fleet.specs[0].url

    sent_to: list[str] = []
    real_run_load = peers.run_load

    def spy(url: str, *args: Any) -> Any:
        sent_to.append(url)
        return real_run_load(url, *args)

    monkeypatch.setattr(peers, "start_peer", stand_in)
    monkeypatch.setattr(peers, "run_load", spy)
    out = tmp_path / "o"
    rc = main([
        "bench", "--mode", "e2e", "--workload", "shared-prefix", "--out", str(out),
        "--workers", "2", "--capacity-blocks", "64", "--block-size", "16",
        "--param", "groups=1", "--param", "prompts_per_group=3",
        "--param", "system_tokens=64", "--param", "question_tokens=16",
        "--param", "output_tokens=4", "--param", "rate=2", "--time-scale", "10",
        "--policies", "vllm_router_kv_aware", "--repeats", "1", "--peers-behind-envoy",
    ])  # fmt: skip
    assert rc == 0
    doc = json.loads((out / "results.json").read_text())
    assert doc["settings"]["peers_behind_envoy"] is True
    r = doc["policies"]["vllm_router_kv_aware"]
    assert r["errors"] == 0 and r["requests"] == 3
    # The load went to another listener than the stand-in's (Envoy's), and every request
    # reached the sim behind the stand-in's address, none the other: Envoy forwarded them.
    [url] = sent_to
    [peer] = peer_urls
    assert url.endswith("/v1/completions") and not url.startswith(peer)
    [run] = r["runs"]
    assert run["breakdown"]["per_worker"]["requests"] == [3, 0]
