"""The simulated workers of a run: `kv-scorer sim` child processes and their counters."""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from kvscorer_tools.bench.e2e.settings import MODEL, E2ESettings
from kvscorer_tools.bench.procs import (
    Proc,
    ProcError,
    ProcGroup,
    free_port,
    http_get,
    kv_scorer_argv,
    metric_sums,
    wait_until,
)

HITS = "vllm:prefix_cache_hits"
QUERIES = "vllm:prefix_cache_queries"
TTFT_SUM = "vllm:time_to_first_token_seconds_sum"
TTFT_COUNT = "vllm:time_to_first_token_seconds_count"
# A sim that lost a picked port to another process has this in its log (errno EADDRINUSE
# from aiohttp, which ends it, or from ZMQ, which may not); it is started again on fresh
# ports.
_ADDR_IN_USE = "address already in use"
_BIND_ATTEMPTS = 3


@dataclass(slots=True)
class SimSpec:
    """One simulated worker's addresses."""

    port: int
    events_port: int
    replay_port: int
    host: str = "127.0.0.1"

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def events(self) -> str:
        return f"tcp://{self.host}:{self.events_port}"

    @property
    def replay(self) -> str:
        return f"tcp://{self.host}:{self.replay_port}"


class SimFleet:
    """`kv-scorer sim` workers as child processes."""

    def __init__(self, group: ProcGroup, settings: E2ESettings) -> None:
        self.group = group
        self.settings = settings
        self.specs: list[SimSpec] = []
        self.procs: list[Proc] = []
        # Per worker index, its `--request-log` file (none when the settings say so).
        self.request_logs: list[Path] = []

    def argv(self, spec: SimSpec, index: int = 0) -> list[str]:
        s = self.settings
        cap = s.capacity_blocks or 10_000_000  # "unbounded"
        extra: list[str] = []
        if s.request_log:
            log = (s.run_dir / "requests" / f"sim{index}.jsonl").resolve()
            log.parent.mkdir(parents=True, exist_ok=True)
            log.unlink(missing_ok=True)
            while len(self.request_logs) <= index:
                self.request_logs.append(log)
            self.request_logs[index] = log
            extra = ["--request-log", str(log)]
        return kv_scorer_argv(
            "sim",
            "--host",
            "127.0.0.1",
            "--port",
            str(spec.port),
            "--model",
            MODEL,
            "--block-size",
            str(s.block_size),
            "--capacity-blocks",
            str(cap),
            "--max-num-seqs",
            str(s.max_num_seqs),
            "--max-num-batched-tokens",
            str(s.max_num_batched_tokens),
            "--max-model-len",
            str(s.max_model_len),
            "--speed",
            str(s.speed),
            "--stream-interval",
            str(s.stream_interval),
            # Bind on loopback (vLLM's rule would connect for a non-* host).
            "--kv-events",
            spec.events,
            "--kv-events-mode",
            "bind",
            "--replay",
            spec.replay,
            "--seed",
            str(s.seed),
            "--log-level",
            "warning",
            *extra,
        )

    def start(self, timeout_s: float = 60.0) -> None:
        """Start every worker, then wait for all of them to answer /health.

        Ports are picked free (bind to 0) and then bound by the child, so another process
        can take one in between (outgoing connections draw from the same ephemeral range).
        A worker that exits on such a bind error is started again on fresh ports, at most
        `_BIND_ATTEMPTS` times.
        """
        for i in range(self.settings.workers):
            spec = SimSpec(free_port(), free_port(), free_port())
            self.specs.append(spec)
            self.procs.append(
                self.group.start(f"sim{i}", self.argv(spec, i), nice=self.settings.sim_nice)
            )
        for i in range(self.settings.workers):
            for attempt in range(1, _BIND_ATTEMPTS + 1):
                spec, p = self.specs[i], self.procs[i]
                try:
                    wait_until(
                        lambda spec=spec, p=p: _healthy(spec, p),  # type: ignore[misc]
                        timeout_s,
                        f"{p.name} /health",
                        p,
                    )
                    break
                except ProcError:
                    if _ADDR_IN_USE not in p.log_tail().lower() or attempt == _BIND_ATTEMPTS:
                        raise
                # A lost HTTP port ends the sim; a lost ZMQ port can leave it running
                # without its event socket: stop it either way, start again elsewhere.
                self.group.stop(p)
                spec = SimSpec(free_port(), free_port(), free_port())
                self.specs[i] = spec
                self.procs[i] = self.group.start(
                    f"sim{i}-retry{attempt}", self.argv(spec, i), nice=self.settings.sim_nice
                )

    def reset(self) -> None:
        """Drop every worker's prefix cache (vLLM's POST /reset_prefix_cache)."""
        for spec in self.specs:
            deadline = time.monotonic() + 30.0
            while True:
                status, done = reset_prefix_cache(spec.url)
                if status == 200 and done:
                    break
                # vLLM (and the sim) refuse while requests hold blocks. Retry briefly.
                if time.monotonic() > deadline:
                    raise ProcError(f"reset_prefix_cache on {spec.endpoint}: HTTP {status}")
                time.sleep(0.2)

    def counters(self) -> list[tuple[float, ...]]:
        """Per worker: (prefix-cache queries, hits) in tokens, and the engine's own TTFT
        histogram (sum in model seconds, count) when it exports one."""
        out: list[tuple[float, ...]] = []
        for spec in self.specs:
            status, text = http_get(spec.url + "/metrics", 5.0)
            if status != 200:
                raise ProcError(f"{spec.endpoint}/metrics: HTTP {status}")
            m = metric_sums(text, [QUERIES, HITS, TTFT_SUM, TTFT_COUNT])
            out.append((m[QUERIES], m[HITS], m[TTFT_SUM], m[TTFT_COUNT]))
        return out


def _healthy(spec: SimSpec, p: Proc) -> bool:
    """/health answers 200; ProcError at once when the sim lost a port (see start)."""
    if _ADDR_IN_USE in p.log_tail(5).lower():
        raise ProcError(f"{p.name}: {_ADDR_IN_USE}")
    return http_get(spec.url + "/health", 1.0)[0] == 200


def reset_prefix_cache(url: str) -> tuple[int, bool]:
    """POST /reset_prefix_cache: (status, reset done). vLLM answers 200 even when it refuses
    (blocks in use); the sim says which in `X-Reset-Prefix-Cache: true|false`."""
    req = urllib.request.Request(url + "/reset_prefix_cache", data=b"", method="POST")
    try:
        with urllib.request.urlopen(req, timeout=5.0) as r:
            return int(r.status), r.headers.get("X-Reset-Prefix-Cache", "true") != "false"
    except urllib.error.HTTPError as e:
        return int(e.code), False
    except (urllib.error.URLError, OSError):
        return 0, False
