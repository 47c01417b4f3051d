"""`kv-scorer demo --small` end to end: real Envoy, scorer and simulated workers.

Runs the demo as a child process (its own session, so signals reach only it), checks
the table, results.json and the PNG, and that every process it started is gone — after
a normal run and after Ctrl-C in the middle of one.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from pids import alive

from kvscorer_tools.bench.report import check_results_shape

# Both tests run the demo: real Envoy in a child process, tens of seconds each.
pytestmark = [pytest.mark.envoy, pytest.mark.slow]


def _pids(out: Path) -> list[int]:
    return [int(line.split()[0]) for line in (out / "logs" / "pids").read_text().splitlines()]


# Ctrl-C as in a terminal even when the tests run as a background job (whose children
# inherit SIGINT ignored, and Python then installs no KeyboardInterrupt handler).
_CLI = (
    "import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
    "from scorer.cli import main; sys.exit(main())"
)


def _demo(out: Path, *extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", _CLI, "demo", "--small", "--out", str(out), *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def test_small_demo_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    proc = _demo(out)
    try:
        stdout, _ = proc.communicate(timeout=300)  # a hang guard, generous under load
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, stdout
    doc = json.loads((out / "results.json").read_text())
    assert check_results_shape(doc) == [], doc
    pols = doc["policies"]
    assert set(pols) == {"kv", "approx", "round_robin", "oracle"}
    for name in ("kv", "approx", "round_robin"):
        assert pols[name]["errors"] == 0 and pols[name]["requests"] == 16
        assert pols[name]["ttft_p50_ms"] > 0 and pols[name]["throughput_rps"] > 0
    # 4 system prompts over 4 workers: the cache-aware policies reuse them, round robin
    # recomputes each one on every worker (the workers' own counters say so).
    assert pols["kv"]["hit_rate"] > pols["round_robin"]["hit_rate"]
    assert pols["kv"]["reasons"].get("kv_hit", 0) > 0
    chat = doc["chat"]["policies"]
    assert chat["session"]["errors"] == 0 and chat["session"]["requests"] == 9
    assert chat["session"]["reasons"].get("session", 0) > 0
    assert (out / "demo.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "hit rate" in stdout and "round_robin" in stdout and "TTFT p99" in stdout
    assert "kv" in stdout and "[##########" in stdout  # progress line reached the end
    # The demo's Envoy is shaped like Envoy AI Gateway's: TLS to every scorer it ran.
    serving = [
        line
        for f in sorted((out / "logs").glob("*"))
        if f.is_file()
        for line in f.read_text(errors="replace").splitlines()
        if "kv-scorer serving" in line
    ]
    assert len(serving) >= 4 and all("ext_proc_tls=self-signed" in ln for ln in serving), serving
    pids = _pids(out)
    assert len(pids) >= 4 + 5  # 4 sims + a scorer per run
    assert not [p for p in pids if alive(p)]


def test_demo_stops_everything_on_ctrl_c(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    proc = _demo(out, "--no-chat")
    try:
        # The demo bounds its own start-up (it exits when a worker or the scorer does not
        # come up); this outer bound only catches a hang, so it is generous for a loaded
        # 2-core machine.
        deadline = time.monotonic() + 240
        pids: list[int] = []
        # Wait until the simulated workers, a scorer and its Envoy are up (the pids file
        # grows), so the interrupt lands mid-run.
        while time.monotonic() < deadline and proc.poll() is None:
            if (out / "logs" / "pids").exists():
                pids = _pids(out)
                if len(pids) >= 6:
                    break
            time.sleep(0.05)
        assert len(pids) >= 6 and proc.poll() is None, proc.poll()
        proc.send_signal(signal.SIGINT)
        # Stopping is SIGTERM then SIGKILL after 5 s per child group: bounded well inside.
        stdout, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, stdout
    assert "interrupted" in stdout
    assert not [p for p in _pids(out) if alive(p)]
