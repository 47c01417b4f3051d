"""bench/profile_envoy_phases.py's Envoy config and bench/bench_loop_floor.py's run."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import yaml

from scorer.envoyproc import render_envoy_config

ROOT = Path(__file__).resolve().parents[2]


def load(name: str) -> ModuleType:
    sys.path.insert(0, str(ROOT / "bench"))
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def test_phases_config_adds_a_direct_listener_and_access_logs(tmp_path: Path) -> None:
    pe = load("profile_envoy_phases")
    base = render_envoy_config(0, 9002, 0)
    cfg = yaml.safe_load(pe.with_access_logs(base, tmp_path, ["127.0.0.1:7001", "127.0.0.1:7002"]))
    listeners = {lst["name"]: lst for lst in cfg["static_resources"]["listeners"]}
    assert set(listeners) == {"main", "direct"}

    def hcm(name: str) -> Any:
        return listeners[name]["filter_chains"][0]["filters"][0]["typed_config"]

    # `direct` has no ext_proc and routes round robin to the backends; `main` is unchanged.
    assert [f["name"] for f in hcm("direct")["http_filters"]] == ["envoy.filters.http.router"]
    assert any("ext_proc" in f["name"] for f in hcm("main")["http_filters"])
    cluster = next(c for c in cfg["static_resources"]["clusters"] if c["name"] == "bench_direct")
    ports = [
        e["endpoint"]["address"]["socket_address"]["port_value"]
        for e in cluster["load_assignment"]["endpoints"][0]["lb_endpoints"]
    ]
    assert ports == [7001, 7002]
    route = hcm("direct")["route_config"]["virtual_hosts"][0]["routes"][0]["route"]
    assert route["cluster"] == "bench_direct"
    # Both log Envoy's timestamps; only `main` the ext_proc filter's call latencies.
    # `main` keeps the lean shape's upstream-failure log first; `direct` logs only times.
    assert hcm("main")["access_log"][0]["name"] == "envoy.access_loggers.http_grpc"
    assert len(hcm("direct")["access_log"]) == 1
    for name in ("main", "direct"):
        log = hcm(name)["access_log"][-1]
        fmt = log["typed_config"]["log_format"]["json_format"]
        assert fmt["us_tx"] == "%COMMON_DURATION(DS_RX_BEG:US_TX_BEG:us)%"
        assert log["typed_config"]["path"] == str(tmp_path / f"access-{name}.log")
        has_ext = "request_body_total_latency_us" in fmt
        assert has_ext == (name == "main")


def test_loop_floor_counts_every_message_on_each_loop(tmp_path: Path) -> None:
    lf = load("bench_loop_floor")
    out = tmp_path / "floor.json"
    loops = "asyncio,asyncio+buffered,uvloop+buffered"
    assert lf.main(["--messages", "30", "--gap-us", "0", "--loops", loops, "--out", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    assert set(results) == set(loops.split(","))
    for r in results.values():
        assert r["messages"] == 30
        assert r["server_cpu_us_per_message"] >= 0
