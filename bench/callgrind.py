"""Driving a process under `valgrind --tool=callgrind`: zero / dump its counts
(`callgrind_control`) and read a dump's total instructions. Shared by the benchmarks that
count instructions (count_instructions.py, bench_event_wakeup.py); imports nothing of the
project, so a benchmark run against another tree (`PYTHONPATH=<tree>`) stays on that tree."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

TOTALS = re.compile(rb"^(?:summary|totals):\s+(\d+)", re.M)


def control(pid: int, *args: str) -> None:
    """`callgrind_control ARGS PID` (e.g. `--zero`, `--dump=NAME`)."""
    subprocess.run(["callgrind_control", *args, str(pid)], check=True, capture_output=True)


def instructions(dump: Path) -> int:
    """Total Ir of one callgrind dump file."""
    m = TOTALS.search(dump.read_bytes())
    if m is None:
        raise RuntimeError(f"no totals in {dump}")
    return int(m.group(1))
