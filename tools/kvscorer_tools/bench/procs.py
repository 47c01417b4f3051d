"""Child processes for the demo and the end-to-end benchmark: start, wait ready, stop all.

Every process is started in its own session with output to a log file under the run
directory, and `ProcGroup.stop_all()` (SIGTERM, then SIGKILL after a grace period) ends
exactly the processes this group started — by pid, never by name. A child's own children
(vLLM's engine core) share its process group, which is its own: stopping a child also waits
for that group to empty (they hold the ports) and kills what is left of it after the grace.
Also used by the real-vLLM tier (tests_vllm).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any


class ProcError(RuntimeError):
    """A child process did not start or exited early (the message has its log tail)."""


def free_port(host: str = "127.0.0.1") -> int:
    """A port the OS reports free right now (bind to 0, read it, close)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def http_get(url: str, timeout: float = 2.0) -> tuple[int, str]:
    """(status, body) of a GET; status 0 when the server is not reachable."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return int(r.status), r.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as e:
        return int(e.code), e.read().decode("utf-8", "replace")
    except (urllib.error.URLError, OSError, TimeoutError):
        return 0, ""


def http_post(url: str, body: bytes = b"", timeout: float = 5.0) -> tuple[int, str]:
    """(status, body) of a POST; status 0 when the server is not reachable."""
    req = urllib.request.Request(url, data=body, method="POST")
    req.add_header("content-type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return int(r.status), r.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as e:
        return int(e.code), e.read().decode("utf-8", "replace")
    except (urllib.error.URLError, OSError, TimeoutError):
        return 0, ""


def metric_sums(text: str, names: Sequence[str]) -> dict[str, float]:
    """Sum over all label sets of each named metric in Prometheus text format.

    A counter `x` may be exposed as `x_total` (prometheus_client) or `x`; both count,
    `x_created` does not. Parsed line by line: prometheus_client's parser mis-groups
    counter families whose names contain ':' (vLLM's `vllm:` prefix).
    """
    want: dict[str, str] = {}
    for n in names:
        want[n] = n
        want[n + "_total"] = n
    out = dict.fromkeys(names, 0.0)
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        brace = line.find("{")
        space = line.find(" ")
        end = brace if 0 <= brace < space or (brace >= 0 and space < 0) else space
        if end <= 0:
            continue
        base = want.get(line[:end])
        if base is None:
            continue
        value = line.rsplit("}", 1)[-1].split() if brace >= 0 else line[end:].split()
        try:
            out[base] += float(value[0])
        except (IndexError, ValueError):
            continue
    return out


class Proc:
    """One child process with its log file."""

    def __init__(self, name: str, popen: subprocess.Popen[bytes], log: Path) -> None:
        self.name = name
        self.popen = popen
        self.log = log

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log_tail(self, n: int = 30) -> str:
        try:
            lines = self.log.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])


class ProcGroup:
    """The processes one run started; `stop_all` ends them (also from `finally`)."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.procs: list[Proc] = []
        self._files: list[IO[bytes]] = []
        self._starts: dict[str, int] = {}

    def start(
        self,
        name: str,
        argv: Sequence[str],
        env: dict[str, str] | None = None,
        nice: int = 0,
    ) -> Proc:
        """Start `argv` with stdout+stderr to LOG_DIR/NAME.log (NAME.N.log for the Nth start
        of one name: a restarted process gets a fresh log, which readers parse). `nice` > 0
        lowers its CPU priority (os.nice in the child before exec, so every thread it
        starts inherits it)."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        n = self._starts[name] = self._starts.get(name, 0) + 1
        log = self.log_dir / (f"{name}.log" if n == 1 else f"{name}.{n}.log")
        f = log.open("wb")
        self._files.append(f)
        full_env = dict(os.environ)
        full_env.setdefault("PYTHONUNBUFFERED", "1")
        if env:
            full_env.update(env)
        popen = subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=f,
            stderr=subprocess.STDOUT,
            env=full_env,
            # Own session: a Ctrl-C in the terminal reaches only us; we stop the children.
            start_new_session=True,
            preexec_fn=(lambda: os.nice(nice)) if nice > 0 else None,
        )
        p = Proc(name, popen, log)
        self.procs.append(p)
        self.record(popen.pid, name)
        return p

    def record(self, pid: int, name: str) -> None:
        """Note a started pid in LOG_DIR/pids, so a test (or a person) can check it is gone."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        with (self.log_dir / "pids").open("a") as pf:
            pf.write(f"{pid} {name}\n")

    def stop(self, p: Proc, grace_s: float = 5.0) -> None:
        """SIGTERM, wait up to `grace_s`, then SIGKILL to its own process group; then wait
        (up to `grace_s`) for the children it started to go too."""
        if p.alive():
            with contextlib.suppress(ProcessLookupError):
                p.popen.send_signal(signal.SIGTERM)
            self._wait(p, time.monotonic() + grace_s)
        self._reap_group(p, time.monotonic() + grace_s)
        if p in self.procs:
            self.procs.remove(p)

    def stop_all(self, grace_s: float = 5.0) -> None:
        """Stop every process of the group, newest first; close the log files."""
        for p in list(self.procs):
            if p.alive():
                with contextlib.suppress(ProcessLookupError):
                    p.popen.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for p in reversed(list(self.procs)):
            self._wait(p, deadline)
        for p in reversed(list(self.procs)):
            self._reap_group(p, deadline)
        self.procs.clear()
        for f in self._files:
            with contextlib.suppress(OSError):
                f.close()
        self._files.clear()

    @staticmethod
    def _wait(p: Proc, deadline: float) -> None:
        """Wait for `p` until `deadline`, then SIGKILL its process group (its own)."""
        try:
            p.popen.wait(max(deadline - time.monotonic(), 0.05))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.popen.wait(5.0)

    @staticmethod
    def _reap_group(p: Proc, deadline: float) -> None:
        """Wait (bounded) until no process of `p`'s group is left; SIGKILL the rest."""
        while time.monotonic() < deadline:
            try:
                os.killpg(p.pid, 0)
            except (ProcessLookupError, PermissionError):
                return
            time.sleep(0.05)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(p.pid, signal.SIGKILL)


def wait_until(
    check: Callable[[], Any],
    timeout_s: float,
    what: str,
    proc: Proc | None = None,
    interval_s: float = 0.05,
) -> Any:
    """Poll `check()` until it returns something truthy; ProcError on timeout or exit."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = check()
        if got:
            return got
        if proc is not None and not proc.alive():
            raise ProcError(
                f"{proc.name} exited with {proc.popen.returncode} before {what}:\n"
                + proc.log_tail()
            )
        if time.monotonic() > deadline:
            tail = ("\n" + proc.log_tail()) if proc is not None else ""
            raise ProcError(f"timed out after {timeout_s:.0f}s waiting for {what}{tail}")
        time.sleep(interval_s)


_SERVING = re.compile(r"kv-scorer serving ext_proc=\S+:(\d+) health=\S+:(\d+) admin=\S+:(\d+)")


def scorer_ports(log: Path) -> tuple[int, int, int] | None:
    """(ext_proc, health, admin) ports from `kv-scorer serve`'s start-up log line."""
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return None
    m = _SERVING.search(text)
    if m is None:
        return None
    return int(m.group(1)), int(m.group(2)), int(m.group(3))


def kv_scorer_argv(*args: str) -> list[str]:
    """`kv-scorer ARGS` run with this interpreter (works from a venv without PATH)."""
    return [sys.executable, "-m", "scorer.cli", *args]
