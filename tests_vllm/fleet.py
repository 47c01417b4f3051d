"""The tier's fleet: 2 real vLLM workers (CPU), kv-scorer, Envoy, the peer routers.

Runs in kv-scorer's `.venv` (`sys.executable`); vLLM and the peers run from the tier's own
`.venv-vllm`. Every port is chosen at run time and bound on 127.0.0.1.

KV events: vLLM's ZMQ publisher binds only wildcard/ipc endpoints and *connects* to any
other (`vllm/distributed/kv_events.py`, `ZmqEventPublisher._is_bind_endpoint`), so to stay
on loopback the workers connect to `tcp://127.0.0.1:PORT` and the listener binds it —
kv-scorer with `events.mode: bind` (llm-d's topology: engines connect to the picker). The
replay ROUTER is always bound by vLLM, here on 127.0.0.1.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kvscorer_tools.bench.procs import (
    Proc,
    ProcError,
    ProcGroup,
    free_port,
    http_get,
    http_post,
    metric_sums,
    scorer_ports,
    wait_until,
)
from tests_vllm.workload import MODEL

BLOCK_SIZE = 32  # vLLM's CPU attention needs a multiple of 32


@dataclass
class VllmSettings:
    """How each vLLM worker is started."""

    python: Path
    model_dir: Path
    num_blocks: int = 96
    max_model_len: int = 2048
    max_num_seqs: int = 8
    start_timeout_s: float = 900.0


@dataclass
class Worker:
    """One vLLM OpenAI API server with its KV-event publisher and replay socket."""

    index: int
    settings: VllmSettings
    port: int = field(default_factory=free_port)
    events_port: int = field(default_factory=free_port)
    replay_port: int = field(default_factory=free_port)
    proc: Proc | None = None
    starts: int = 0

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def events(self) -> str:
        return f"tcp://127.0.0.1:{self.events_port}"

    @property
    def replay(self) -> str:
        return f"tcp://127.0.0.1:{self.replay_port}"

    def argv(self) -> list[str]:
        s = self.settings
        kv_events = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": self.events,
            "replay_endpoint": self.replay,
        }
        return [
            str(s.python),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(s.model_dir),
            "--served-model-name",
            MODEL,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--block-size",
            str(BLOCK_SIZE),
            "--enable-prefix-caching",
            "--num-gpu-blocks-override",
            str(s.num_blocks),
            "--max-model-len",
            str(s.max_model_len),
            "--max-num-seqs",
            str(s.max_num_seqs),
            "--max-num-batched-tokens",
            str(s.max_model_len),
            "--dtype",
            "float32",
            "--enforce-eager",
            # An explicit KV size instead of --gpu-memory-utilization: on CPU that is a share
            # of the NUMA node's memory (/sys/devices/system/node), which on a VM can be far
            # below `free`'s total, and start-up fails when the share minus the process's RSS
            # is negative (vllm/v1/worker/cpu_worker.py determine_available_memory). The
            # blocks are --num-gpu-blocks-override's anyway; this only has to cover them.
            "--kv-cache-memory-bytes",
            str(256 << 20),
            "--seed",
            "0",
            "--kv-events-config",
            json.dumps(kv_events),
            "--disable-uvicorn-access-log",
        ]

    def env(self) -> dict[str, str]:
        return {
            # One core per worker (the machine has 2).
            "VLLM_CPU_OMP_THREADS_BIND": str(self.index),
            # POST /reset_prefix_cache (a cold cache between benchmark runs).
            "VLLM_SERVER_DEV_MODE": "1",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "VLLM_LOGGING_LEVEL": "INFO",
        }

    def start(self, procs: ProcGroup) -> None:
        self.starts += 1
        self.proc = procs.start(f"vllm{self.index}-{self.starts}", self.argv(), self.env())

    def wait_ready(self) -> None:
        assert self.proc is not None
        wait_until(
            lambda: http_get(self.url + "/health", timeout=2)[0] == 200,
            self.settings.start_timeout_s,
            f"vllm worker {self.index} /health",
            self.proc,
            1.0,
        )

    def stop(self, procs: ProcGroup) -> None:
        if self.proc is not None:
            procs.stop(self.proc, grace_s=60.0)
            self.proc = None

    def counters(self) -> dict[str, float]:
        """vllm:prefix_cache_queries / hits (token counts) and request totals."""
        status, body = http_get(self.url + "/metrics", timeout=10)
        if status != 200:
            raise ProcError(f"worker {self.index} /metrics: {status}")
        return metric_sums(
            body,
            ["vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:prompt_tokens"],
        )

    def reset_cache(self) -> None:
        status, body = http_post(self.url + "/reset_prefix_cache", timeout=30)
        if status != 200:
            raise ProcError(f"worker {self.index} reset_prefix_cache: {status} {body[:200]!r}")


class Scorer:
    """`kv-scorer serve` with a config written for the fleet; ports read from its log."""

    def __init__(
        self,
        out: Path,
        workers: list[Worker],
        model_dir: Path,
        policy: str,
        scrape_interval_s: float = 1.0,
    ) -> None:
        self.out = out
        self.workers = workers
        self.model_dir = model_dir
        self.policy = policy
        self.scrape_interval_s = scrape_interval_s
        self.proc: Proc | None = None
        self.extproc_port = 0
        self.admin_port = 0
        self.starts = 0
        self.config_path = out / f"scorer-{policy}.yaml"

    def config(self) -> dict[str, Any]:
        return {
            "server": {
                "host": "127.0.0.1",
                "extproc_port": self.extproc_port,
                "health_port": 0,
                "admin_port": 0,
            },
            "policy": self.policy,
            "pool": {
                "block_size": BLOCK_SIZE,
                "models": [MODEL],
                "workers": [
                    {
                        "endpoint": w.endpoint,
                        "events": {
                            "endpoint": w.events,
                            "mode": "bind",
                            "replay_endpoint": w.replay,
                        },
                        "metrics_url": w.url + "/metrics",
                    }
                    for w in self.workers
                ],
            },
            # 1 s scrapes by default: 5 a second flood vLLM's log and cost CPU the
            # workers need (the load phase asks for faster ones; see phase_load).
            "load": {"scrape_interval_s": self.scrape_interval_s, "stale_after_s": 5.0},
            "tokens": {"models": {MODEL: {"tokenizer": str(self.model_dir)}}},
            "decisions": {"log_size": 5000},
        }

    def start(self, procs: ProcGroup, keep_port: bool = False) -> None:
        if not keep_port:
            self.extproc_port = 0
        self.out.mkdir(parents=True, exist_ok=True)
        self.config_path.write_text(yaml.safe_dump(self.config(), sort_keys=False))
        self.starts += 1
        self.proc = procs.start(
            f"scorer-{self.policy}-{self.starts}",
            [sys.executable, "-m", "scorer.cli", "serve", "--config", str(self.config_path)],
        )
        proc = self.proc
        # Its bind sockets (events) are on fixed ports: a scorer that failed to start must
        # not outlive this call holding them.
        try:
            self._wait_started(proc)
        except BaseException:
            self.stop(procs)
            raise

    def _wait_started(self, proc: Proc) -> None:
        ports = wait_until(lambda: scorer_ports(proc.log), 120.0, "kv-scorer start", proc)
        self.extproc_port, _, self.admin_port = ports
        wait_until(
            lambda: http_get(self.admin + "/readyz", timeout=2)[0] == 200,
            60.0,
            "kv-scorer /readyz",
            proc,
        )

        # Every event socket bound (a leftover listener on the port would starve it).
        def bound() -> bool:
            streams = [w.get("stream") or {} for w in self.index()["workers"].values()]
            return all(s.get("bind_error") is None for s in streams)

        wait_until(bound, 30.0, "kv-scorer's event sockets bound", proc)

    @property
    def admin(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}"

    def stop(self, procs: ProcGroup) -> None:
        if self.proc is not None:
            procs.stop(self.proc, grace_s=20.0)
            self.proc = None

    def index(self) -> dict[str, Any]:
        return dict(get_json(self.admin + "/debug/index"))

    def blocks(self) -> dict[str, int]:
        """Indexed blocks per worker (all media; /debug/index gives them by medium)."""
        out = {}
        for ep, w in self.index()["workers"].items():
            b = w["blocks"]
            out[ep] = int(sum(b.values())) if isinstance(b, dict) else int(b)
        return out

    def last_decision(self) -> dict[str, Any] | None:
        got = get_json(self.admin + "/debug/decisions?limit=1")
        items = got if isinstance(got, list) else got.get("decisions", [])
        return dict(items[0]) if items else None

    def settle(self, quiet_s: float = 0.6, timeout_s: float = 20.0) -> None:
        """Wait until no worker's event stream has delivered anything for `quiet_s`.

        The engine publishes a step's events before the step's output reaches the API
        server, so once the client has its response, the events are on the wire; this
        waits for them to arrive and be applied (bounded)."""
        deadline = time.monotonic() + timeout_s
        last: tuple[int, ...] | None = None
        since = time.monotonic()
        while time.monotonic() < deadline:
            idx = self.index()["workers"]
            msgs = tuple(int((w.get("stream") or {}).get("messages", 0)) for w in idx.values())
            if msgs != last:
                last, since = msgs, time.monotonic()
            elif time.monotonic() - since >= quiet_s:
                return
            time.sleep(0.1)


# Each peer's launcher module and its name for the warning log level.
_PEER_LAUNCHERS = {
    "sglang-router": ("sglang_router.launch_router", "warn"),
    "vllm-router": ("vllm_router.launch_router", "warning"),
}


def peer_argv(name: str, python: Path, workers: list[Worker], port: int) -> list[str]:
    """sglang-router 0.3.2 / vllm-router 0.1.17, policy cache_aware, before the workers.

    Flags from each launcher's --help (`python -m sglang_router.launch_router`,
    `python -m vllm_router.launch_router`); both default to a fixed Prometheus port, so
    one is chosen here."""
    if name not in _PEER_LAUNCHERS:
        raise ValueError(name)
    module, log_level = _PEER_LAUNCHERS[name]
    return [
        str(python),
        "-m",
        module,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--worker-urls",
        *[w.url for w in workers],
        "--policy",
        "cache_aware",
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        str(free_port()),
        "--log-level",
        log_level,
    ]


def peer_ready(base: str, workers: list[Worker]) -> bool:
    """True once the peer router has registered every worker as healthy.

    Both routers answer /health before their (asynchronous) worker registration is done
    (a request then gets 503 `no_available_workers`). sglang-router 0.3.2 and vllm-router
    0.1.17 both list workers at GET /workers (`workers[].url`, `is_healthy`); vllm-router
    also at GET /list_workers (`urls`) — read off the running routers."""
    want = {w.url for w in workers}
    status, body = http_get(base + "/workers", timeout=2)
    if status == 200:
        try:
            doc = json.loads(body)
            got = {x["url"] for x in doc.get("workers", []) if x.get("is_healthy", True)}
            return want <= got
        except (ValueError, KeyError, TypeError, AttributeError):
            pass
    status, body = http_get(base + "/list_workers", timeout=2)
    if status == 200:
        try:
            return want <= set(json.loads(body).get("urls", []))
        except (ValueError, TypeError, AttributeError):
            return False
    return False


def get_json(url: str, timeout: float = 10.0) -> Any:
    """GET `url`'s JSON body; ProcError unless 200."""
    status, body = http_get(url, timeout=timeout)
    if status != 200:
        raise ProcError(f"GET {url}: {status} {body[:200]!r}")
    return json.loads(body)


def post_json(url: str, body: Any, timeout: float = 60.0) -> Any:
    """POST `body` as JSON, return the JSON answer; ProcError unless 200."""
    status, raw = http_post(url, json.dumps(body).encode(), timeout=timeout)
    if status != 200:
        raise ProcError(f"POST {url}: {status} {raw[:300]!r}")
    return json.loads(raw)
