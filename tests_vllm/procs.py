"""Child processes of the tier: start with a log file, wait, stop by pid (never by name).

Each child runs in its own session so a terminal Ctrl-C reaches only the driver, which
then stops them. vLLM's API server is stopped with SIGTERM: it then shuts its engine-core
child down; a SIGKILL would leave that child holding the ports. A process that ignores
SIGTERM past its grace period gets SIGKILL on its whole process group (the group is its
own, so this reaches only what it started).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any


class TierError(RuntimeError):
    """A process did not start, exited early, or a wait timed out (message has its log)."""


def free_port() -> int:
    """A loopback port the OS reports free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http(method: str, url: str, body: Any = None, timeout: float = 60.0) -> tuple[int, bytes]:
    """(status, body bytes); status 0 when nothing answers."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    if data is not None:
        req.add_header("content-type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return int(r.status), r.read()
    except urllib.error.HTTPError as e:
        return int(e.code), e.read()
    except (urllib.error.URLError, OSError, TimeoutError):
        return 0, b""


def get_json(url: str, timeout: float = 10.0) -> Any:
    status, body = http("GET", url, timeout=timeout)
    if status != 200:
        raise TierError(f"GET {url}: {status} {body[:200]!r}")
    return json.loads(body)


def post_json(url: str, body: Any, timeout: float = 60.0) -> Any:
    status, raw = http("POST", url, body, timeout=timeout)
    if status != 200:
        raise TierError(f"POST {url}: {status} {raw[:300]!r}")
    return json.loads(raw)


def wait_until(
    check: Callable[[], Any],
    timeout_s: float,
    what: str,
    proc: Proc | None = None,
    interval_s: float = 0.1,
) -> Any:
    """Poll `check()` until truthy; TierError on timeout or when `proc` exits."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = check()
        if got:
            return got
        if proc is not None and not proc.alive():
            raise TierError(
                f"{proc.name} exited ({proc.popen.returncode}) before {what}:\n" + proc.tail()
            )
        if time.monotonic() > deadline:
            tail = ("\n" + proc.tail()) if proc is not None else ""
            raise TierError(f"timed out after {timeout_s:.0f}s waiting for {what}{tail}")
        time.sleep(interval_s)


class Proc:
    """One child process and its log."""

    def __init__(self, name: str, popen: subprocess.Popen[bytes], log: Path) -> None:
        self.name = name
        self.popen = popen
        self.log = log

    def alive(self) -> bool:
        return self.popen.poll() is None

    def tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


class Procs:
    """Everything the tier started; `stop_all()` runs from `finally`."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.procs: list[Proc] = []
        self._files: list[IO[bytes]] = []
        self._names: dict[str, int] = {}

    def start(self, name: str, argv: Sequence[str], env: dict[str, str] | None = None) -> Proc:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        # A fresh log per start: readers parse it (e.g. the scorer's ports line).
        n = self._names[name] = self._names.get(name, 0) + 1
        log = self.log_dir / (f"{name}.log" if n == 1 else f"{name}.{n}.log")
        f = log.open("wb")
        self._files.append(f)
        full = dict(os.environ)
        full["PYTHONUNBUFFERED"] = "1"
        full.update(env or {})
        popen = subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=f,
            stderr=subprocess.STDOUT,
            env=full,
            start_new_session=True,
        )
        p = Proc(name, popen, log)
        self.procs.append(p)
        with (self.log_dir / "pids").open("a") as pf:
            pf.write(f"{popen.pid} {name}\n")
        return p

    def stop(self, p: Proc, grace_s: float = 30.0) -> None:
        """SIGTERM; after `grace_s` SIGKILL to the child's own process group."""
        if p.alive():
            with contextlib.suppress(ProcessLookupError):
                p.popen.send_signal(signal.SIGTERM)
            try:
                p.popen.wait(grace_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(p.popen.pid, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.popen.wait(10.0)
        # Children of the child (vLLM's engine core) share its process group: make sure
        # none outlives it (they hold the ports).
        self._reap_group(p, grace_s)
        if p in self.procs:
            self.procs.remove(p)

    def _reap_group(self, p: Proc, grace_s: float) -> None:
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            try:
                os.killpg(p.popen.pid, 0)
            except (ProcessLookupError, PermissionError):
                return
            time.sleep(0.2)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(p.popen.pid, signal.SIGKILL)

    def stop_all(self) -> None:
        for p in reversed(list(self.procs)):
            self.stop(p)
        for f in self._files:
            with contextlib.suppress(OSError):
                f.close()
        self._files.clear()
