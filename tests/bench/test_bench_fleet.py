"""SimFleet: a sim that loses its picked port to another process is started again."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvscorer_tools.bench.e2e import fleet as fleet_mod
from kvscorer_tools.bench.e2e.fleet import SimFleet
from kvscorer_tools.bench.e2e.settings import E2ESettings
from kvscorer_tools.bench.procs import ProcGroup, free_port


def test_sim_that_lost_its_port_is_restarted_on_fresh_ports(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Another process holds the HTTP port the fleet picks first: the sim exits with
    # "address already in use" and must come up on the next ports it is given.
    taken = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    picks: Iterator[int] = iter([taken.getsockname()[1]])
    monkeypatch.setattr(fleet_mod, "free_port", lambda: next(picks, None) or free_port())
    group = ProcGroup(tmp_path / "logs")
    settings = E2ESettings(workers=1, capacity_blocks=64, block_size=16, run_dir=tmp_path)
    fleet = SimFleet(group, settings)
    try:
        fleet.start(timeout_s=60.0)
        assert fleet.specs[0].port != taken.getsockname()[1]
        assert fleet.procs[0].alive()
        # retry1 at least: a fresh port can be taken again by another process meanwhile
        # (free_port's race), and the fleet then retries once more.
        assert fleet.procs[0].name.startswith("sim0-retry")
    finally:
        group.stop_all()
        taken.close()


def test_sim_that_lost_its_event_port_is_restarted_on_fresh_ports(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The ZMQ events port is taken: the sim may stay up without its event socket; the
    # fleet must notice from its log (not wait out the timeout) and start it elsewhere.
    taken = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    picks: Iterator[int] = iter([free_port(), taken.getsockname()[1]])
    monkeypatch.setattr(fleet_mod, "free_port", lambda: next(picks, None) or free_port())
    group = ProcGroup(tmp_path / "logs")
    settings = E2ESettings(workers=1, capacity_blocks=64, block_size=16, run_dir=tmp_path)
    fleet = SimFleet(group, settings)
    try:
        fleet.start(timeout_s=60.0)
        assert fleet.specs[0].events_port != taken.getsockname()[1]
        assert fleet.procs[0].name.startswith("sim0-retry") and fleet.procs[0].alive()
        assert len([p for p in group.procs if p.alive()]) == 1  # the first one stopped
    finally:
        group.stop_all()
        taken.close()


def test_sims_get_the_stream_interval_of_the_settings(tmp_path: Path) -> None:
    # The e2e default merges decode steps in the sims (their CPU falls ~3x); 1 restores a
    # chunk per token. The flag must reach each sim's command line.
    group = ProcGroup(tmp_path / "logs")
    for interval in (8, 1):
        settings = E2ESettings(workers=1, run_dir=tmp_path, stream_interval=interval)
        argv = SimFleet(group, settings).argv(
            fleet_mod.SimSpec(port=1, events_port=2, replay_port=3), 0
        )
        i = argv.index("--stream-interval")
        assert argv[i + 1] == str(interval)
    assert E2ESettings().stream_interval == 8


def test_sims_run_at_the_nice_value_of_the_settings(tmp_path: Path) -> None:
    # The sims stand in for GPU engines: below the routers' CPU priority by default, at
    # theirs with sim_nice=0. The value must reach the sim process (and its threads).
    assert E2ESettings().sim_nice == 10
    group = ProcGroup(tmp_path / "logs")
    try:
        for nice in (7, 0):
            settings = E2ESettings(
                workers=1, capacity_blocks=64, block_size=16, run_dir=tmp_path, sim_nice=nice
            )
            fleet = SimFleet(group, settings)
            fleet.start(timeout_s=60.0)
            pid = fleet.procs[0].pid
            own = os.getpriority(os.PRIO_PROCESS, 0)
            for tid in os.listdir(f"/proc/{pid}/task"):
                stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
                assert int(stat.rsplit(")", 1)[1].split()[16]) == min(own + nice, 19)
            group.stop_all()
    finally:
        group.stop_all()
