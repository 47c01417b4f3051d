"""Chaos benchmark: routing under faults, through a real Envoy (not a test; a few minutes).

    .venv/bin/python bench/chaos.py [--workers 8] [--scrape-outage-s 60] [--out bench/out]

Starts `kv-scorer sim` x N (child processes), `kv-scorer serve` with the `kv` policy and a
real Envoy (envoy/envoy.yaml rendered with run-time ports), then runs a steady load of
shared-prefix completions and injects one fault after another:

1. `kill9`      SIGKILL the busiest worker; restart it on the same ports 8 s later;
2. `publisher`  one worker's KV-event publisher goes away for 5 s and comes back (its
                events meanwhile are lost: the scorer must replay them);
3. `drop10`     10 % of every worker's event frames are dropped for 20 s;
4. `scrape`     every worker's /metrics hangs for 60 s (longer than the scrape timeout);
5. `scorer`     SIGTERM the scorer and start it again on the same ports (last: the new
                scorer does not learn what the workers cached before it started).

Events and metrics pass through this process on their way to the scorer: a ZMQ relay per
worker (SUB from the sim's PUB, PUB to the scorer; it mirrors the upstream connection,
so a killed worker's stream drops as it would directly) and an HTTP relay for /metrics
(a refused upstream is passed on as a reset connection). Replay requests go straight to
the sims.

Per fault it reports: requests sent and failed from the fault until the next one, time
from the fault to the end of the last failed request ("back to full service", 0 when
nothing failed), the time the scorer took to eject and readmit a killed worker, and index
exactness after recovery: with the load paused and speculative entries expired, each
worker's GPU block count in the scorer's /debug/index against the block count of the
sim's own prefix cache (GET /debug/kv_cache). Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import signal
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import yaml
import zmq
import zmq.asyncio
from aiohttp import web

from kvscorer_tools.bench.e2e import write_stub_tokenizer
from kvscorer_tools.bench.procs import (
    Proc,
    ProcGroup,
    free_port,
    http_get,
    kv_scorer_argv,
    wait_until,
)
from kvscorer_tools.envoyrun import EnvoyProcess
from scorer.envoyproc import render_envoy_config

MODEL = "sim-model"
BLOCK = 16
HERE = Path(__file__).resolve().parent


# ----------------------------------------------------------------------------- relays


class EventRelay:
    """SUB from a sim's PUB, PUB to the scorer: can go down, drop frames, and mirrors the
    upstream connection (upstream gone -> our PUB closes, so the scorer sees the drop)."""

    def __init__(self, ctx: zmq.asyncio.Context, upstream: str, port: int) -> None:
        self.ctx = ctx
        self.upstream = upstream
        self.port = port
        self.drop = 0.0
        self.forced_down = False
        self.upstream_up = False
        self.pub: zmq.asyncio.Socket | None = None
        self.forwarded = 0
        self.dropped = 0
        self.rng = random.Random(port)
        self._tasks: list[asyncio.Task[None]] = []
        self._sockets: list[zmq.asyncio.Socket] = []

    @property
    def endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    def _sync(self) -> None:
        want = self.upstream_up and not self.forced_down
        if want and self.pub is None:
            pub = self.ctx.socket(zmq.PUB)
            pub.setsockopt(zmq.LINGER, 0)
            pub.bind(self.endpoint)
            self.pub = pub
        elif not want and self.pub is not None:
            self.pub.close(linger=0)
            self.pub = None

    def set_down(self, down: bool) -> None:
        self.forced_down = down
        self._sync()

    async def start(self) -> None:
        sub = self.ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.setsockopt(zmq.RECONNECT_IVL, 100)
        mon = sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        sub.connect(self.upstream)
        self._sockets = [sub, mon]
        self._tasks = [
            asyncio.create_task(self._pump(sub)),
            asyncio.create_task(self._watch(mon)),
        ]

    async def _watch(self, mon: zmq.asyncio.Socket) -> None:
        from zmq.utils.monitor import parse_monitor_message

        while True:
            ev = parse_monitor_message(await mon.recv_multipart())["event"]
            self.upstream_up = ev == zmq.EVENT_CONNECTED
            self._sync()

    async def _pump(self, sub: zmq.asyncio.Socket) -> None:
        while True:
            frames = await sub.recv_multipart()
            if self.pub is None:
                self.dropped += 1
                continue
            if self.drop > 0 and self.rng.random() < self.drop:
                self.dropped += 1
                continue
            await self.pub.send_multipart(frames)
            self.forwarded += 1

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        sub, mon = self._sockets
        with contextlib.suppress(zmq.ZMQError):
            sub.disable_monitor()
        for sock in (mon, sub):
            sock.close(linger=0)
        if self.pub is not None:
            self.pub.close(linger=0)
            self.pub = None


class MetricsRelay:
    """GET /metrics/<i> -> sim i's /metrics; hangs during an outage; resets the connection
    when the sim refuses (what the scorer would see scraping it directly)."""

    def __init__(self, urls: list[str]) -> None:
        self.urls = urls
        self.outage_until = 0.0
        self.port = 0
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5))
        app = web.Application()
        app.router.add_get("/metrics/{i}", self._get)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = int(self._runner.addresses[0][1])

    def url(self, i: int) -> str:
        return f"http://127.0.0.1:{self.port}/metrics/{i}"

    async def _get(self, request: web.Request) -> web.StreamResponse:
        now = time.monotonic()
        if now < self.outage_until:
            await asyncio.sleep(self.outage_until - now)  # hang: the scraper times out
        assert self._session is not None
        try:
            async with self._session.get(self.urls[int(request.match_info["i"])]) as r:
                text = await r.text()
                return web.Response(text=text, status=r.status, content_type="text/plain")
        except (aiohttp.ClientError, OSError, TimeoutError):
            if request.transport is not None:
                request.transport.abort()  # a reset, as the dead worker itself would give
            raise web.HTTPServiceUnavailable() from None

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()


# ----------------------------------------------------------------------------- load


@dataclass
class Req:
    start: float
    end: float
    status: int  # 0: transport error


@dataclass
class Load:
    url: str
    concurrency: int
    groups: int = 16
    prefix_blocks: int = 8
    log: list[Req] = field(default_factory=list)
    paused: bool = False
    inflight: int = 0
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)

    def _body(self, rng: random.Random) -> dict[str, Any]:
        g = rng.randrange(self.groups)
        prefix = [1 + g * 1000 + i for i in range(self.prefix_blocks * BLOCK)]
        suffix = [rng.randrange(20000, 32000) for _ in range(rng.randrange(BLOCK, 3 * BLOCK))]
        return {"model": MODEL, "prompt": prefix + suffix, "max_tokens": 4, "stream": False}

    async def _client(self, i: int, session: aiohttp.ClientSession) -> None:
        rng = random.Random(i)
        while True:
            if self.paused:
                await asyncio.sleep(0.05)
                continue
            body = self._body(rng)
            t0 = time.monotonic()
            self.inflight += 1
            try:
                async with session.post(self.url, json=body) as r:
                    await r.read()
                    status = r.status
            except (aiohttp.ClientError, OSError, TimeoutError):
                status = 0
            finally:
                self.inflight -= 1
            self.log.append(Req(t0, time.monotonic(), status))

    async def start(self, session: aiohttp.ClientSession) -> None:
        self._tasks = [
            asyncio.create_task(self._client(i, session)) for i in range(self.concurrency)
        ]

    async def quiesce(self) -> None:
        self.paused = True
        while self.inflight:
            await asyncio.sleep(0.05)

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t


# ----------------------------------------------------------------------------- the run


@dataclass
class FaultResult:
    fault: str
    requests: int
    failed: int
    back_to_full_service_s: float
    ejected_after_s: float | None = None
    readmitted_after_s: float | None = None
    index_exact_workers: int = 0
    index_workers: int = 0
    index_abs_diff_blocks: int = 0
    sim_blocks: int = 0
    per_worker: list[tuple[str, int, int]] = field(default_factory=list)  # (ep, index, sim)
    notes: str = ""


class Chaos:
    def __init__(self, args: argparse.Namespace, run_dir: Path) -> None:
        self.args = args
        self.run_dir = run_dir
        self.group = ProcGroup(run_dir / "logs")
        self.n = args.workers
        self.sim_ports = [(free_port(), free_port(), free_port()) for _ in range(self.n)]
        self.sims: list[Proc] = []
        self.scorer: Proc | None = None
        self.extproc_port = free_port()
        self.admin_port = free_port()
        self.health_port = free_port()
        self.ctx = zmq.asyncio.Context()
        self.relays: list[EventRelay] = []
        self.metrics: MetricsRelay | None = None
        self.config_path = run_dir / "scorer.yaml"

    # -- processes -----------------------------------------------------------------
    def sim_url(self, i: int) -> str:
        return f"http://127.0.0.1:{self.sim_ports[i][0]}"

    def start_sim(self, i: int) -> Proc:
        http, pub, replay = self.sim_ports[i]
        argv = kv_scorer_argv(
            "sim",
            "--host",
            "127.0.0.1",
            "--port",
            str(http),
            "--model",
            MODEL,
            "--block-size",
            str(BLOCK),
            "--capacity-blocks",
            str(self.args.capacity_blocks),
            "--speed",
            str(self.args.speed),
            "--kv-events",
            f"tcp://127.0.0.1:{pub}",
            "--kv-events-mode",
            "bind",
            "--replay",
            f"tcp://127.0.0.1:{replay}",
            "--log-level",
            "warning",
        )
        p = self.group.start(f"sim{i}", argv)
        wait_until(lambda: http_get(self.sim_url(i) + "/health", 1.0)[0] == 200, 60, f"sim{i}", p)
        return p

    def write_config(self) -> None:
        tok = write_stub_tokenizer(self.run_dir / "tokenizer" / "tokenizer.json")
        assert self.metrics is not None
        cfg = {
            "server": {
                "host": "127.0.0.1",
                "extproc_port": self.extproc_port,
                "health_port": self.health_port,
                "admin_port": self.admin_port,
                "grace_period_s": 1.0,
                "readiness_events_timeout_s": 5.0,
            },
            "pool": {
                "block_size": BLOCK,
                "workers": [
                    {
                        "endpoint": f"127.0.0.1:{self.sim_ports[i][0]}",
                        "events": {
                            "endpoint": self.relays[i].endpoint,
                            "replay_endpoint": f"tcp://127.0.0.1:{self.sim_ports[i][2]}",
                        },
                        "metrics_url": self.metrics.url(i),
                    }
                    for i in range(self.n)
                ],
            },
            "tokens": {"models": {MODEL: {"tokenizer": str(tok)}}},
            "policy": "kv",
            "log_level": "warning",
        }
        self.config_path.write_text(yaml.safe_dump(cfg))

    def start_scorer(self) -> Proc:
        p = self.group.start("scorer", kv_scorer_argv("serve", "--config", str(self.config_path)))
        wait_until(
            lambda: http_get(f"http://127.0.0.1:{self.admin_port}/readyz", 1.0)[0] == 200,
            60,
            "scorer ready",
            p,
        )
        return p

    # -- observations --------------------------------------------------------------
    async def get_json(self, session: aiohttp.ClientSession, url: str) -> Any:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=5)) as r:
            return await r.json()

    async def pool_health(self, session: aiohttp.ClientSession) -> dict[str, bool]:
        try:
            doc = await self.get_json(session, f"http://127.0.0.1:{self.admin_port}/debug/pool")
        except (aiohttp.ClientError, OSError, TimeoutError):
            return {}
        return {w["endpoint"]: bool(w["healthy"]) for w in doc["workers"]}

    async def wait_health(
        self, session: aiohttp.ClientSession, endpoint: str, healthy: bool, timeout: float
    ) -> float | None:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if (await self.pool_health(session)).get(endpoint) == healthy:
                return time.monotonic() - t0
            await asyncio.sleep(0.05)
        return None

    async def exactness(
        self, session: aiohttp.ClientSession, res: FaultResult
    ) -> tuple[int, int, int]:
        """(workers whose index block count equals the sim's, total |diff|, sim blocks)."""
        idx = await self.get_json(session, f"http://127.0.0.1:{self.admin_port}/debug/index")
        exact = diff = total = 0
        for i in range(self.n):
            ep = f"127.0.0.1:{self.sim_ports[i][0]}"
            sim = await self.get_json(session, self.sim_url(i) + "/debug/kv_cache")
            ours = int(idx["workers"].get(ep, {}).get("blocks", {}).get("GPU", 0))
            d = abs(ours - int(sim["blocks"]))
            res.per_worker.append((ep, ours, int(sim["blocks"])))
            exact += d == 0
            diff += d
            total += int(sim["blocks"])
        return exact, diff, total

    # -- faults --------------------------------------------------------------------
    async def run(self) -> list[FaultResult]:
        a = self.args
        for i in range(self.n):
            self.sims.append(self.start_sim(i))
        self.metrics = MetricsRelay([self.sim_url(i) + "/metrics" for i in range(self.n)])
        await self.metrics.start()
        for i in range(self.n):
            r = EventRelay(self.ctx, f"tcp://127.0.0.1:{self.sim_ports[i][1]}", free_port())
            await r.start()
            self.relays.append(r)
        self.write_config()
        self.scorer = self.start_scorer()
        # envoy-full.yaml's shape: Envoy's 502/503 for a dead worker reach the health
        # monitor as evidence (the lean envoy.yaml reports no status).
        envoy_cfg = render_envoy_config(0, self.extproc_port, 0, response_headers=True)
        results: list[FaultResult] = []
        async with EnvoyProcess(envoy_cfg) as envoy:
            url = f"http://127.0.0.1:{envoy.listener_port}/v1/completions"
            conn = aiohttp.TCPConnector(limit=0)
            timeout = aiohttp.ClientTimeout(total=15)
            async with aiohttp.ClientSession(connector=conn, timeout=timeout) as session:
                load = Load(url, a.concurrency)
                await load.start(session)
                await asyncio.sleep(a.warmup_s)
                # The scorer restart goes last: a restarted scorer does not learn what the
                # workers cached before it started, which would blur the later faults'
                # index exactness.
                faults = [
                    ("kill9", self.fault_kill),
                    ("publisher", self.fault_publisher),
                    ("drop10", self.fault_drop),
                    ("scrape", self.fault_scrape),
                    ("scorer", self.fault_scorer),
                ]
                for name, fn in faults:
                    if a.only and name not in a.only:
                        continue
                    load.paused = False
                    t_fault = time.monotonic()
                    n_before = len(load.log)
                    res = FaultResult(name, 0, 0, 0.0)
                    await fn(session, res)
                    await asyncio.sleep(a.settle_s)
                    await load.quiesce()
                    window = load.log[n_before:]
                    res.requests = len(window)
                    failed = [r for r in window if r.status != 200]
                    res.failed = len(failed)
                    if failed:
                        res.back_to_full_service_s = round(max(r.end for r in failed) - t_fault, 2)
                    # Speculative entries (index.speculative_ttl_s = 2) expire; events land.
                    await asyncio.sleep(2.5)
                    exact, diff, total = await self.exactness(session, res)
                    res.index_exact_workers, res.index_workers = exact, self.n
                    res.index_abs_diff_blocks, res.sim_blocks = diff, total
                    results.append(res)
                    print(
                        f"  {name}: {res.failed}/{res.requests} failed, back in "
                        f"{res.back_to_full_service_s}s, index exact {exact}/{self.n}",
                        flush=True,
                    )
                await load.stop()
        return results

    async def fault_kill(self, session: aiohttp.ClientSession, res: FaultResult) -> None:
        # The busiest worker (most requests routed so far): its death is the most visible.
        doc = await self.get_json(session, f"http://127.0.0.1:{self.admin_port}/debug/pool")
        routed = {w["endpoint"]: w["inflight"]["routed_total"] for w in doc["workers"]}
        eps = [f"127.0.0.1:{h}" for h, _, _ in self.sim_ports]
        k = max(range(self.n), key=lambda i: routed.get(eps[i], 0))
        ep = eps[k]
        self.sims[k].popen.send_signal(signal.SIGKILL)
        res.ejected_after_s = await self.wait_health(session, ep, False, 10)
        await asyncio.sleep(max(0.0, 8 - (res.ejected_after_s or 0)))
        await asyncio.to_thread(self.sims[k].popen.wait, 5)
        self.group.procs.remove(self.sims[k])
        t0 = time.monotonic()
        self.sims[k] = await asyncio.to_thread(self.start_sim, k)
        start_s = time.monotonic() - t0
        back = await self.wait_health(session, ep, True, 30)
        res.readmitted_after_s = None if back is None else round(back + start_s, 2)
        res.notes = "readmitted_after_s counts from the restart command (sim start-up included)"

    async def fault_publisher(self, session: aiohttp.ClientSession, res: FaultResult) -> None:
        r = self.relays[1]
        r.set_down(True)
        await asyncio.sleep(5)
        r.set_down(False)
        res.notes = f"event frames lost while down: {r.dropped}"

    async def fault_scorer(self, session: aiohttp.ClientSession, res: FaultResult) -> None:
        assert self.scorer is not None
        await asyncio.to_thread(self.group.stop, self.scorer, 5.0)
        self.scorer = await asyncio.to_thread(self.start_scorer)
        res.notes = "Envoy fails closed while the scorer is down"

    async def fault_drop(self, session: aiohttp.ClientSession, res: FaultResult) -> None:
        before = sum(r.dropped for r in self.relays)
        for r in self.relays:
            r.drop = 0.10
        await asyncio.sleep(20)
        for r in self.relays:
            r.drop = 0.0
        dropped = sum(r.dropped for r in self.relays) - before
        res.notes = f"event frames dropped: {dropped}"

    async def fault_scrape(self, session: aiohttp.ClientSession, res: FaultResult) -> None:
        assert self.metrics is not None
        s = self.args.scrape_outage_s
        self.metrics.outage_until = time.monotonic() + s
        ejected = False
        t_end = time.monotonic() + s
        while time.monotonic() < t_end:
            if not all((await self.pool_health(session)).values()):
                ejected = True
            await asyncio.sleep(1.0)
        res.notes = f"{s:.0f}s of hanging /metrics; a worker ejected meanwhile: {ejected}"

    async def close(self) -> None:
        for r in self.relays:
            await r.stop()
        if self.metrics is not None:
            await self.metrics.stop()
        self.group.stop_all()
        self.ctx.term()


def print_table(results: list[FaultResult]) -> None:
    head = ("fault", "requests", "failed", "back (s)", "eject (s)", "readmit (s)", "index exact")
    print("\n| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in results:
        cells = (
            r.fault,
            str(r.requests),
            str(r.failed),
            f"{r.back_to_full_service_s:.2f}",
            "-" if r.ejected_after_s is None else f"{r.ejected_after_s:.2f}",
            "-" if r.readmitted_after_s is None else f"{r.readmitted_after_s:.2f}",
            f"{r.index_exact_workers}/{r.index_workers} "
            f"(|diff| {r.index_abs_diff_blocks} of {r.sim_blocks} blocks)",
        )
        print("| " + " | ".join(cells) + " |")
    for r in results:
        if r.notes:
            print(f"- {r.fault}: {r.notes}")


async def amain(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    chaos = Chaos(args, run_dir)
    t0 = time.monotonic()
    try:
        results = await chaos.run()
    finally:
        await chaos.close()
    print_table(results)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    doc = {
        "settings": {k: v for k, v in vars(args).items() if k != "only"},
        "wall_s": round(time.monotonic() - t0, 1),
        "results": [asdict(r) for r in results],
    }
    (out / "chaos.json").write_text(json.dumps(doc, indent=2))
    print(f"\nwrote {out / 'chaos.json'} ({doc['wall_s']} s)")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--concurrency", type=int, default=8, help="closed-loop clients")
    p.add_argument("--speed", type=float, default=20.0, help="sim speed-up over the GPU model")
    p.add_argument("--capacity-blocks", type=int, default=4096)
    p.add_argument("--warmup-s", type=float, default=8.0)
    p.add_argument("--settle-s", type=float, default=3.0, help="load kept on after each fault")
    p.add_argument("--scrape-outage-s", type=float, default=60.0)
    p.add_argument("--only", action="append", help="run only these faults (repeatable)")
    p.add_argument("--out", default=str(HERE / "out"))
    p.add_argument("--run-dir", default="/tmp/kv-scorer-chaos")
    return asyncio.run(amain(p.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
