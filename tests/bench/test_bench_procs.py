"""ProcGroup (tools and the real-vLLM tier): a stopped child takes its own children with
it, a restarted name gets a fresh log, and a child ignoring SIGTERM is killed."""

from __future__ import annotations

import sys
from pathlib import Path

from pids import alive

from kvscorer_tools.bench.procs import ProcGroup, wait_until

# A parent that starts a grandchild (as vLLM's API server starts its engine core) and
# prints its pid; the grandchild ignores SIGTERM, so only a group kill ends it.
PARENT = """
import signal, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c",
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"])
print("child", child.pid, flush=True)
time.sleep(600)
"""


def _child_pid(log: Path) -> int | None:
    for line in log.read_text(errors="replace").splitlines():
        if line.startswith("child "):
            return int(line.split()[1])
    return None


def test_stop_ends_the_childs_own_children(tmp_path: Path) -> None:
    group = ProcGroup(tmp_path / "logs")
    try:
        p = group.start("parent", [sys.executable, "-c", PARENT])
        grandchild = wait_until(lambda: _child_pid(p.log), 30.0, "the grandchild", p)
        assert alive(grandchild)
        group.stop(p, grace_s=0.5)
        assert not p.alive()
        assert wait_until(lambda: not alive(grandchild), 10.0, "the grandchild gone")
    finally:
        group.stop_all(grace_s=0.5)


def test_stop_all_ends_children_and_a_restart_gets_a_fresh_log(tmp_path: Path) -> None:
    group = ProcGroup(tmp_path / "logs")
    try:
        first = group.start("parent", [sys.executable, "-c", PARENT])
        g1 = wait_until(lambda: _child_pid(first.log), 30.0, "the grandchild", first)
        group.stop(first, grace_s=0.5)
        again = group.start("parent", [sys.executable, "-c", PARENT])
        assert again.log.name == "parent.2.log" and first.log.name == "parent.log"
        g2 = wait_until(lambda: _child_pid(again.log), 30.0, "the grandchild", again)
        assert g2 != g1 and _child_pid(first.log) == g1
        group.stop_all(grace_s=0.5)
        assert group.procs == [] and not again.alive()
        assert wait_until(lambda: not alive(g2), 10.0, "the grandchild gone")
        pids = (tmp_path / "logs" / "pids").read_text().split()
        assert pids == [str(first.pid), "parent", str(again.pid), "parent"]
    finally:
        group.stop_all(grace_s=0.5)
