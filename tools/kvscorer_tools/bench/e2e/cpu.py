"""CPU seconds used by the processes of a run, per role (sims, router, load generator).

On a small machine the simulated engines, the router under test and the load generator
compete for the same cores; how much each used tells whether a run measured routing or
contention. Linux /proc only (elsewhere: nothing is reported).
"""

from __future__ import annotations

import os
import resource
from collections.abc import Iterable, Mapping
from pathlib import Path

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _stat(pid: int) -> tuple[int, float] | None:
    """(parent pid, user + system CPU seconds of `pid` and its reaped children)."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # Fields after the command name (which may hold spaces), from field 3 on.
    fields = raw[raw.rindex(")") + 2 :].split()
    ppid = int(fields[1])
    utime, stime, cutime, cstime = (int(x) for x in fields[11:15])
    return ppid, (utime + stime + cutime + cstime) / _TICK


def tree_cpu_s(pids: Iterable[int]) -> float:
    """CPU seconds of `pids` and every living descendant (a launcher's workers too)."""
    stats: dict[int, tuple[int, float]] = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if entry.isdigit():
            st = _stat(int(entry))
            if st is not None:
                stats[int(entry)] = st
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in stats.items():
        children.setdefault(ppid, []).append(pid)
    total, seen = 0.0, set()
    todo = [p for p in pids if p in stats]
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        total += stats[pid][1]
        todo.extend(children.get(pid, ()))
    return total


def self_cpu_s() -> float:
    """CPU seconds of this process (the load generator runs here)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


class CpuMeter:
    """CPU seconds per role between `__init__` and `done()`."""

    def __init__(self, roles: Mapping[str, Iterable[int]]) -> None:
        self.roles = {k: list(v) for k, v in roles.items()}
        self.start = {k: tree_cpu_s(v) for k, v in self.roles.items()}
        self.start_self = self_cpu_s()

    def done(self) -> dict[str, float]:
        """{role: CPU seconds, ..., "load_generator": ...} since the start."""
        out = {k: round(tree_cpu_s(v) - self.start[k], 2) for k, v in self.roles.items()}
        out["load_generator"] = round(self_cpu_s() - self.start_self, 2)
        return out
