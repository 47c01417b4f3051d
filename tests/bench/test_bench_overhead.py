"""bench/bench_overhead.py's arithmetic: added latency against each adjacent baseline."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]


def load() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "bench_overhead", ROOT / "bench" / "bench_overhead.py"
    )
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_overhead"] = mod
    spec.loader.exec_module(mod)
    return mod


def sample(ms: float, n: int = 100, wall: float = 1.0) -> dict[str, Any]:
    return {"lat": [ms / 1e3] * n, "wall": wall, "errors": 0, "first_status": 0}


def test_added_latency_against_each_baseline_is_the_median_over_repeats() -> None:
    bo = load()
    cell = bo.Cell()
    # Three repeats; the machine gets slower between them, every path alike.
    for drift, cpu in ((0.0, 30.0), (5.0, 50.0), (1.0, 40.0)):
        bases = {"direct": sample(10 + drift), "envoy": sample(10.5 + drift, n=90)}
        cell.add(sample(11.2 + drift, n=60), cpu, bases)
    out = cell.result()
    assert out["repeats"] == 3 and out["requests"] == 180
    assert abs(out["added_p50_ms"] - 1.2) < 1e-9  # vs direct: drift cancels
    assert abs(out["added_p50_ms_vs_envoy"] - 0.7) < 1e-9
    assert abs(out["added_p50_spread_ms_vs_envoy"]) < 1e-9
    assert abs(out["rps_ratio_vs_envoy"] - 60 / 90) < 1e-9
    assert abs(out["p50_ms"] - 12.2) < 1e-9 and abs(out["p50_spread_ms"] - 5.0) < 1e-9
    assert out["scorer_cpu_us_per_req"] == 40.0 and out["scorer_cpu_spread_us"] == 20.0


def test_a_path_that_fails_every_request_has_no_added_figures() -> None:
    bo = load()
    cell = bo.Cell()
    cell.add({"lat": [], "wall": 1.0, "errors": 5, "first_status": 422}, None,
             {"direct": sample(10)})  # fmt: skip
    out = cell.result()
    assert out["errors"] == 5 and out["first_status"] == 422
    assert "added_p50_ms" not in out and "p50_ms" not in out
    lines: list[str] = []
    bo.print_table({"peer:x": {"cells": {"ids/c1": out}}}, [1], lines.append)
    assert "every request failed (HTTP 422)" in lines[-1]


def test_cpu_breakdown_is_per_request_and_the_median_over_repeats() -> None:
    bo = load()
    a = ({"scorer": 1.0, "envoy": 2.0, "sims": 3.0}, (100, 1000))
    b = ({"scorer": 1.03, "envoy": 2.01, "sims": 3.09}, (850, 2000))
    got = bo.CpuMeter.per_request(a, b, 100)
    assert abs(got["scorer_us"] - 300.0) < 1e-6 and abs(got["envoy_us"] - 100.0) < 1e-6
    assert abs(got["sims_us"] - 900.0) < 1e-6 and abs(got["machine_busy"] - 0.75) < 1e-9
    cell = bo.Cell()
    for scorer_us in (300.0, 100.0, 200.0):
        cell.add(sample(11.0), scorer_us, {})
        cell.breakdown.append({"scorer_us": scorer_us, "machine_busy": 0.5})
    out = cell.result()
    assert out["cpu_breakdown"] == {"machine_busy": 0.5, "scorer_us": 200.0}
    lines: list[str] = []
    bo.print_table({"kv-scorer:kv:local": {"cells": {"ids/c8": out}}}, [8], lines.append)
    assert "busy 0.50 | total 200 | scorer 200" in lines[-1]


def test_machine_ticks_count_busy_within_total() -> None:
    busy, total = load().machine_ticks()
    assert 0 < busy < total


@pytest.mark.envoy
def test_a_peer_behind_envoy_is_reached_through_an_envoy_of_its_own(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import threading
    import urllib.request
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    from types import SimpleNamespace

    from kvscorer_tools.bench.procs import ProcGroup

    bo = load()

    class Peer(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Length", "4")
            self.end_headers()
            self.wfile.write(b"peer")

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Peer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    peer_port = server.server_address[1]
    group = ProcGroup(tmp_path / "logs")

    # The stand-in peer: an idle process (what start_path stops) at the server's address.
    def stand_in(name: str, group: Any, fleet: Any, settings: Any) -> Any:
        idle = group.start(name, [sys.executable, "-c", "import time; time.sleep(60)"])
        return idle, f"http://127.0.0.1:{peer_port}"

    monkeypatch.setattr(bo.peer_mod, "start_peer", stand_in)
    try:
        path = bo.start_path("peer-envoy:x", group, SimpleNamespace(specs=[]), tmp_path)
        with path as target:
            [port] = target.ports
            assert port != peer_port and set(target.procs) == {"router", "envoy"}
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=10) as r:
                assert r.read() == b"peer"
        with bo.start_path("peer:x", group, SimpleNamespace(specs=[]), tmp_path) as target:
            assert target.ports == [peer_port] and set(target.procs) == {"router"}
    finally:
        group.stop_all()
        server.shutdown()
