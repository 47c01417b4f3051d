"""End-to-end benchmark: real HTTP through a real Envoy, the scorer and simulated workers.

Topology per run (all on 127.0.0.1, ports chosen at run time):

    load generator ──HTTP──▶ Envoy ──ext_proc──▶ `kv-scorer serve` (policy under test)
                               └──ORIGINAL_DST──▶ `kv-scorer sim` x N ──ZMQ KV events──▶ scorer

Peers (sglang-router `cache_aware`, vllm-router `kv_aware`) front the same simulated
workers directly (see kvscorer_tools.bench.peers). Between policies every worker's prefix cache
is reset (`POST /reset_prefix_cache`), so each policy starts cold.

Time: the simulated workers run `speed` times faster than their model's time
(`kv-scorer sim --speed`), arrivals are compressed by the same factor, and measured
latencies are multiplied back, so TTFT is reported in *model* milliseconds comparable with
the replay. Proxy and scorer overheads are multiplied too: at --time-scale 20 a 2 ms hop
costs 40 model ms — a handicap every router in the run pays alike.

Hit rate comes from the workers' own counters (`vllm:prefix_cache_hits` /
`vllm:prefix_cache_queries`, deltas over the run); imbalance from the per-worker query
counters (= prompt tokens each worker received).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from kvscorer_tools.bench.procs import (
    Proc,
    ProcError,
    ProcGroup,
    free_port,
    http_get,
    kv_scorer_argv,
    metric_sums,
    scorer_ports,
    wait_until,
)
from kvscorer_tools.bench.replay import imbalance, percentile
from kvscorer_tools.bench.workloads import BenchRequest, Workload

MODEL = "bench-model"
SESSION_HEADER = "x-session-affinity"  # scorer.extproc.protocol.SESSION_HEADER
HITS = "vllm:prefix_cache_hits"
QUERIES = "vllm:prefix_cache_queries"
TTFT_SUM = "vllm:time_to_first_token_seconds_sum"
TTFT_COUNT = "vllm:time_to_first_token_seconds_count"

Log = Callable[[str], None]


@dataclass(slots=True)
class E2ESettings:
    """The fleet and the load generator."""

    workers: int = 8
    capacity_blocks: int | None = 1000
    block_size: int = 512
    speed: float = 1.0  # sims' --speed; arrivals are already divided by it
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 262144  # Mooncake prompts reach 126k tokens
    seed: int = 0
    concurrency: int = 256
    policy_options: dict[str, dict[str, Any]] = field(default_factory=dict)
    run_dir: Path = field(default_factory=lambda: Path("bench/out/e2e-run"))
    request_timeout_s: float = 600.0
    progress: bool = False  # print a progress line while a policy runs


@dataclass(slots=True)
class LoadResult:
    """What the load generator measured (wall clock)."""

    ttft_s: list[float] = field(default_factory=list)
    errors: int = 0
    done: int = 0
    first_error: str | None = None
    t_start: float = 0.0
    t_end: float = 0.0


def completion_body(r: BenchRequest, stream: bool = True, text: bool = False) -> dict[str, Any]:
    """An OpenAI /v1/completions body with a token-id prompt.

    `text`: the same prompt as text, one word "t<id>" per token, for routers that accept
    only text prompts (sglang-router); the simulated worker's synthetic tokenizer makes
    one token of each word, so equal prefixes stay equal and lengths do not change.
    """
    ids = r.token_ids()
    body: dict[str, Any] = {
        "model": MODEL,
        "prompt": " ".join(f"t{t}" for t in ids) if text else ids,
        "max_tokens": r.output_tokens,
        "ignore_eos": True,  # vLLM extension: generate exactly max_tokens
        "temperature": 0.0,
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


PREENCODE_BYTES = 1 << 30  # bodies encoded ahead of the run, at most (then on the fly)


def encode_body(r: BenchRequest, text: bool = False) -> bytes:
    """The JSON body of `r` (see completion_body)."""
    return json.dumps(completion_body(r, text=text)).encode()


async def _one(
    http: aiohttp.ClientSession,
    url: str,
    r: BenchRequest,
    res: LoadResult,
    timeout_s: float,
    text: bool = False,
    data: bytes | None = None,
) -> None:
    headers = {"content-type": "application/json"}
    if r.session:
        headers[SESSION_HEADER] = r.session
    if data is None:
        data = encode_body(r, text)
    t0 = time.perf_counter()
    first: float | None = None
    try:
        async with http.post(
            url, data=data, headers=headers, timeout=aiohttp.ClientTimeout(total=timeout_s)
        ) as resp:
            if resp.status != 200:
                detail = (await resp.text())[:200]
                raise RuntimeError(f"HTTP {resp.status}: {detail}")
            async for line in resp.content:
                if first is None and line.startswith(b"data:") and b"[DONE]" not in line:
                    first = time.perf_counter()
            if first is None:
                raise RuntimeError("stream ended without a token")
    except (aiohttp.ClientError, TimeoutError, RuntimeError) as e:
        res.errors += 1
        if res.first_error is None:
            res.first_error = f"{type(e).__name__}: {e}"
        return
    res.ttft_s.append(first - t0)
    res.done += 1


async def generate_load(
    url: str,
    requests: Sequence[BenchRequest],
    concurrency: int,
    timeout_s: float = 600.0,
    progress: Callable[[int, int], None] | None = None,
    text: bool = False,
) -> LoadResult:
    """Send every request at its arrival time (open loop, at most `concurrency` in flight).

    TTFT = first SSE data line - request start (wall clock). Bodies are encoded before
    the clock starts (up to PREENCODE_BYTES), so building a burst of big prompts does not
    hold the event loop while responses wait to be read.
    """
    res = LoadResult()
    bodies: list[bytes | None] = [None] * len(requests)
    size = 0
    for i, r in enumerate(requests):
        if size > PREENCODE_BYTES:
            break
        b = encode_body(r, text)
        bodies[i] = b
        size += len(b)
    sem = asyncio.Semaphore(concurrency)
    conn = aiohttp.TCPConnector(limit=concurrency, force_close=False)
    total = len(requests)
    finished = 0

    async with aiohttp.ClientSession(connector=conn) as http:
        res.t_start = time.perf_counter()

        async def fire(i: int, r: BenchRequest) -> None:
            nonlocal finished
            delay = res.t_start + r.arrival_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            async with sem:
                await _one(http, url, r, res, timeout_s, text, bodies[i])
                bodies[i] = None
            finished += 1
            if progress is not None:
                progress(finished, total)

        await asyncio.gather(*(fire(i, r) for i, r in enumerate(requests)))
        res.t_end = time.perf_counter()
    return res


# ------------------------------------------------------------------------------ fleet


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

    def argv(self, spec: SimSpec) -> list[str]:
        s = self.settings
        cap = s.capacity_blocks or 10_000_000  # "unbounded"
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
        )

    def start(self, timeout_s: float = 60.0) -> None:
        """Start every worker, then wait for all of them to answer /health."""
        for i in range(self.settings.workers):
            spec = SimSpec(free_port(), free_port(), free_port())
            self.specs.append(spec)
            self.procs.append(self.group.start(f"sim{i}", self.argv(spec)))
        for spec, p in zip(self.specs, self.procs, strict=True):
            wait_until(
                lambda spec=spec: http_get(spec.url + "/health", 1.0)[0] == 200,  # type: ignore[misc]
                timeout_s,
                f"{p.name} /health",
                p,
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


def summarize(
    res: LoadResult,
    before: Sequence[tuple[float, ...]],
    after: Sequence[tuple[float, ...]],
    speed: float,
    requests: int,
) -> dict[str, Any]:
    """The results.json entry of one policy (times converted to model time)."""
    dq = [a[0] - b[0] for a, b in zip(after, before, strict=True)]
    dh = [a[1] - b[1] for a, b in zip(after, before, strict=True)]
    q = sum(dq)
    ttft_ms = [t * 1000.0 * speed for t in res.ttft_s]
    span = (res.t_end - res.t_start) * speed
    out: dict[str, Any] = {
        "hit_rate": round(sum(dh) / q, 4) if q else 0.0,
        "ttft_p50_ms": round(percentile(ttft_ms, 50), 2),
        "ttft_p99_ms": round(percentile(ttft_ms, 99), 2),
        "throughput_rps": round(res.done / span, 3) if span > 0 else 0.0,
        "imbalance": round(imbalance(dq), 3),
        "requests": requests,
        "errors": res.errors,
        "prompt_tokens_per_worker": [int(x) for x in dq],
    }
    if len(after[0]) >= 4:
        # The workers' own TTFT (model time, from arrival at the engine): the routing
        # effect without the proxy and load-generator overheads.
        n = sum(a[3] - b[3] for a, b in zip(after, before, strict=True))
        t = sum(a[2] - b[2] for a, b in zip(after, before, strict=True))
        if n > 0:
            out["ttft_engine_mean_ms"] = round(t / n * 1000.0, 2)
    out["ttft_mean_ms"] = round(sum(ttft_ms) / len(ttft_ms), 2) if ttft_ms else 0.0
    if res.first_error:
        out["first_error"] = res.first_error
    return out


# ------------------------------------------------------------------------------ scorer


def write_stub_tokenizer(path: Path) -> Path:
    """A tiny tokenizer.json: the scorer needs *a* tokenizer for the model even though
    every benchmark prompt is token ids (taken as they are, never re-encoded)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    tok = Tokenizer(WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return path


def scorer_config(
    fleet: SimFleet, policy: str, settings: E2ESettings, tokenizer: Path
) -> dict[str, Any]:
    """The `kv-scorer serve` configuration for one policy over the fleet."""
    return {
        "server": {
            "host": "127.0.0.1",
            "extproc_port": 0,
            "health_port": 0,
            "admin_port": 0,
            "grace_period_s": 1.0,
        },
        "pool": {
            "workers": [
                {
                    "endpoint": s.endpoint,
                    "events": {"endpoint": s.events, "replay_endpoint": s.replay},
                    "metrics_url": s.url + "/metrics",
                }
                for s in fleet.specs
            ],
            "block_size": settings.block_size,
        },
        "tokens": {"models": {MODEL: {"tokenizer": str(tokenizer)}}},
        "policy": policy,
        "policies": settings.policy_options,
        "log_level": "warning",
    }


class ScorerRun:
    """`kv-scorer serve` + Envoy for one policy.

    `launch()` starts the scorer process and returns at once, `ready()` waits for it and
    starts Envoy in front of it, so several scorers can boot in parallel. Also a context
    manager (launch + ready on enter, `close()` on exit).
    """

    def __init__(
        self, group: ProcGroup, fleet: SimFleet, policy: str, settings: E2ESettings
    ) -> None:
        self.group = group
        self.fleet = fleet
        self.policy = policy
        self.settings = settings
        self.scorer: Proc | None = None
        self.envoy: Any = None
        self.url = ""
        self.admin_url = ""

    def launch(self) -> ScorerRun:
        """Write the config and start `kv-scorer serve` (does not wait)."""
        d = self.settings.run_dir
        tok = write_stub_tokenizer(d / "tokenizer" / "tokenizer.json")
        cfg_path = d / f"scorer-{self.policy}.yaml"
        cfg = scorer_config(self.fleet, self.policy, self.settings, tok)
        cfg_path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        self.scorer = self.group.start(
            f"scorer-{self.policy}", kv_scorer_argv("serve", "--config", str(cfg_path))
        )
        return self

    def ready(self, timeout_s: float = 60.0) -> ScorerRun:
        """Wait for the scorer's ports, then start Envoy in front of it."""
        from kvscorer_tools.envoyrun import EnvoyProcess
        from scorer.envoyproc import render_envoy_config

        if self.scorer is None:
            self.launch()
        assert self.scorer is not None
        log = self.scorer.log
        extproc, _, admin = wait_until(
            lambda: scorer_ports(log), timeout_s, f"scorer-{self.policy}", self.scorer
        )
        self.admin_url = f"http://127.0.0.1:{admin}"
        self.envoy = EnvoyProcess(render_envoy_config(0, extproc, 0))
        self.envoy.start()
        if self.envoy.proc is not None:
            self.group.record(self.envoy.proc.pid, f"envoy-{self.policy}")
        self.url = f"http://127.0.0.1:{self.envoy.listener_port}/v1/completions"
        return self

    def close(self) -> None:
        """Stop Envoy and the scorer (idempotent)."""
        if self.envoy is not None:
            with contextlib.suppress(Exception):
                self.envoy.stop()
            self.envoy = None
        if self.scorer is not None:
            self.group.stop(self.scorer)
            self.scorer = None

    def __enter__(self) -> ScorerRun:
        try:
            return self.launch().ready()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc: object) -> None:
        self.close()

    def decision_reasons(self) -> dict[str, int]:
        """Decisions by reason, from the scorer's kv_scorer_decisions_total counter."""
        return self.counter("kv_scorer_decisions_total", ("reason",))

    def counter(self, name: str, labels: Sequence[str]) -> dict[str, int]:
        """A labelled counter of the scorer (see `counter_totals`); {} when unreachable."""
        status, text = http_get(self.admin_url + "/metrics", 5.0)
        return counter_totals(text, name, labels) if status == 200 else {}


def counter_totals(text: str, name: str, labels: Sequence[str]) -> dict[str, int]:
    """Sum a labelled Prometheus counter by the values of `labels`, keyed "a/b"."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        if not line.startswith(name + "{"):
            continue
        found = dict(_LABEL.findall(line))
        try:
            n = int(float(line.rsplit(" ", 1)[1]))
        except (IndexError, ValueError):
            continue
        if n:
            key = "/".join(found.get(k, "") for k in labels)
            out[key] = out.get(key, 0) + n
    return dict(sorted(out.items()))


# What the scorer did with the workers' KV events and its own speculative entries during a
# run: with the reasons, this tells a routing problem from an event-path problem.
_DIAGNOSTICS = {
    "events": ("kv_scorer_events_applied_total", ("type", "outcome")),
    "speculative": ("kv_scorer_index_speculative_total", ("outcome",)),
}


_LABEL = re.compile(r'(\w+)="([^"]*)"')


def start_scorers(
    group: ProcGroup, fleet: SimFleet, policies: Sequence[str], settings: E2ESettings
) -> dict[str, ScorerRun]:
    """Boot one scorer + Envoy per policy, in parallel (imports take seconds each)."""
    runs = {p: ScorerRun(group, fleet, p, settings) for p in policies}
    try:
        for r in runs.values():
            r.launch()
        for r in runs.values():
            r.ready()
    except BaseException:
        for r in runs.values():
            r.close()
        raise
    return runs


def progress_printer(name: str) -> Callable[[int, int], None]:
    """A one-line progress display (no tqdm dependency): `kv  [#####-----] 40/100`."""
    last = [-1.0]

    def show(done: int, total: int) -> None:
        now = time.monotonic()
        if done != total and now - last[0] < 0.25:
            return
        last[0] = now
        width = 30
        fill = int(width * done / max(total, 1))
        bar = "#" * fill + "-" * (width - fill)
        end = "\n" if done == total else ""
        print(f"\r  {name:<22} [{bar}] {done}/{total}", end=end, flush=True)

    return show


def run_load(
    url: str, wl: Workload, settings: E2ESettings, name: str, text: bool = False
) -> LoadResult:
    """Run the load generator to completion (its own event loop)."""
    prog = progress_printer(name) if settings.progress else None
    return asyncio.run(
        generate_load(
            url, wl.requests, settings.concurrency, settings.request_timeout_s, prog, text
        )
    )


def run_ours(
    group: ProcGroup,
    fleet: SimFleet,
    wl: Workload,
    policy: str,
    settings: E2ESettings,
    run: ScorerRun | None = None,
) -> dict[str, Any]:
    """One of our policies through Envoy + the scorer (`run`, or one started here)."""
    fleet.reset()
    own = run is None
    if run is None:
        run = ScorerRun(group, fleet, policy, settings).__enter__()
    try:
        before = fleet.counters()
        counted = {"reasons": ("kv_scorer_decisions_total", ("reason",)), **_DIAGNOSTICS}
        start = {key: run.counter(*spec) for key, spec in counted.items()}
        res = run_load(run.url, wl, settings, policy)
        after = fleet.counters()
        out = summarize(res, before, after, settings.speed, len(wl))
        for key, spec in counted.items():
            now = run.counter(*spec)
            delta = {k: v - start[key].get(k, 0) for k, v in now.items()}
            if any(delta.values()):
                out[key] = {k: v for k, v in delta.items() if v}
    finally:
        if own:
            run.close()
    return out


def run_e2e(
    wl: Workload, policies: Sequence[str], settings: E2ESettings, log: Log = print
) -> dict[str, dict[str, Any]]:
    """Every policy (ours and peers) on the same fleet; peers that fail get {"error"}."""
    from kvscorer_tools.bench import peers

    group = ProcGroup(settings.run_dir / "logs")
    results: dict[str, dict[str, Any]] = {}
    try:
        fleet = SimFleet(group, settings)
        fleet.start()
        log(f"{len(fleet.specs)} simulated workers up")
        for name in policies:
            t = time.perf_counter()
            try:
                if name in peers.PEERS:
                    results[name] = peers.run_peer(name, group, fleet, wl, settings)
                else:
                    results[name] = run_ours(group, fleet, wl, name, settings)
            except (ProcError, peers.PeerError, OSError) as e:
                results[name] = {"error": str(e)[:2000]}
            r = results[name]
            if "error" in r:
                log(f"  {name}: error: {str(r['error']).splitlines()[0][:200]}")
            else:
                log(
                    f"  {name}: hit {r['hit_rate']:.3f}  p50 {r['ttft_p50_ms']:.0f} ms  "
                    f"p99 {r['ttft_p99_ms']:.0f} ms  errors {r['errors']}  "
                    f"({time.perf_counter() - t:.0f}s)"
                )
    finally:
        group.stop_all()
    return results
