"""What the ext_proc data path costs: Envoy + kv-scorer vs Envoy straight to the backend.

    .venv/bin/python bench/bench_extproc.py [--seconds 3] [--quick] [--transport asyncio,grpcio]
        [--event-loop uvloop,asyncio]
    .venv/bin/python bench/bench_extproc.py --cpu 3000     # CPU µs per stream only (low noise)

Processes (all real, all on loopback): one aiohttp echo backend, `kv-scorer serve`
(separate process, round_robin, so its CPU time can be read from /proc), and one Envoy
with two listeners: `main` (ext_proc FULL_DUPLEX_STREAMED → scorer → ORIGINAL_DST) and
`direct` (static cluster → the same backend). The two are measured in the same run,
interleaved in rounds so machine noise hits both. The scorer runs twice: with
`extproc.track_responses` on (stream kept open to the end of the response) and off
(stream closed right after the routing answer), once per `server.extproc_transport`
(asyncio: our HTTP/2 server; grpcio: grpc.aio) and per `--event-loop` (`server.event_loop`
of the scorer process: uvloop, the default, and/or asyncio; A/B in one run).

Cells: body 2 KB / 32 KB x concurrency 1 / 16. Reports p50/p99 latency of each path, the
added p50/p99 (main - direct), requests/s, scorer CPU µs per request (utime+stime
from /proc/PID/stat over the main-path requests) and the ext_proc messages per request
each way (Envoy's stream_msgs_sent / stream_msgs_received). Writes
bench/out/extproc.json.

`--cpu N`: only the scorer's CPU per stream, the number to compare variants on a noisy
machine: per transport x track_responses x body mode, N sequential requests (one
connection) through Envoy, repeated `--reps` times; reports the minimum and median
(CPU time is far less sensitive to other load than latency; the minimum is the run least
disturbed). Writes bench/out/extproc_cpu.json.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Literal

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvscorer_tools.envoyrun import EnvoyProcess  # noqa: E402
from scorer.envoyproc import render_envoy_config  # noqa: E402

CLK_TCK = os.sysconf("SC_CLK_TCK")
BodyMode = Literal["FULL_DUPLEX_STREAMED", "BUFFERED"]
READY = re.compile(r"ext_proc=[\d.]+:(\d+) health=[\d.]+:(\d+) admin=[\d.]+:(\d+)")


# ------------------------------------------------------------------ processes


def backend_main(port: int) -> None:
    """A minimal aiohttp backend (its own process): answers a small JSON document."""
    from aiohttp import web

    async def handle(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=b'{"ok":true}', content_type="application/json")

    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_route("*", "/{tail:.*}", handle)
    serve_app(app, port)


def serve_app(app: Any, port: int) -> None:
    """Serve an aiohttp `app` on loopback `port` (0: any), print `PORT n`, run forever."""
    from aiohttp import web

    async def run() -> None:
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", port)
        await site.start()
        p = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        print(f"PORT {p}", flush=True)
        await asyncio.Event().wait()

    asyncio.run(run())


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (and its threads), from /proc/PID/stat."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def start_backend() -> tuple[subprocess.Popen[str], int]:
    p = subprocess.Popen(
        [sys.executable, __file__, "--serve-backend"], stdout=subprocess.PIPE, text=True
    )
    assert p.stdout is not None
    line = p.stdout.readline()
    return p, int(line.split()[1])


def cpu_split(pid: int) -> tuple[float, float]:
    """(utime, stime) in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) / CLK_TCK, int(fields[12]) / CLK_TCK


def start_scorer(
    backend: str, track: bool, transport: str = "asyncio", event_loop: str | None = None
) -> tuple[subprocess.Popen[str], int]:
    """`kv-scorer serve` (round_robin) in its own process; `event_loop` None: the default."""
    env = dict(os.environ)
    env["KV_SCORER_EXTPROC__TRACK_RESPONSES"] = "true" if track else "false"
    env["KV_SCORER_SERVER__EXTPROC_TRANSPORT"] = transport
    if event_loop is not None:
        env["KV_SCORER_SERVER__EVENT_LOOP"] = event_loop
    env["KV_SCORER_DECISIONS__LOG_SIZE"] = "1000"
    custom = os.environ.get("BENCH_SCORER_CMD")  # experiments: another ext_proc server
    cmd = [*custom.split(), backend] if custom else [
        sys.executable, "-m", "scorer.cli", "serve", "--worker", backend,
        "--policy", "round_robin", "--host", "127.0.0.1", "--extproc-port", "0",
        "--health-port", "0", "--admin-port", "0", "--log-level", "warning",
    ]  # fmt: skip
    p = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=env)
    assert p.stderr is not None
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        line = p.stderr.readline()
        m = READY.search(line)
        if m:
            return p, int(m.group(1))
        if not line and p.poll() is not None:
            break
    p.kill()
    raise RuntimeError("kv-scorer serve did not start")


def stop(p: subprocess.Popen[str]) -> None:
    p.terminate()
    try:
        p.wait(10)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()


# ------------------------------------------------------------------ client


class Conn:
    """A keep-alive HTTP/1.1 connection with the least client overhead we can get."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.r = reader
        self.w = writer

    @classmethod
    async def open(cls, port: int) -> Conn:
        r, w = await asyncio.open_connection("127.0.0.1", port)
        return cls(r, w)

    async def post(self, request: bytes) -> int:
        self.w.write(request)
        head = await self.r.readuntil(b"\r\n\r\n")
        status = int(head[9:12])
        lower = head.lower()
        i = lower.find(b"content-length:")
        if i >= 0:
            n = int(lower[i + 15 : lower.index(b"\r\n", i)])
            await self.r.readexactly(n)
        else:  # chunked
            while True:
                size = int((await self.r.readuntil(b"\r\n")).strip(), 16)
                await self.r.readexactly(size + 2)
                if size == 0:
                    break
        return status

    def close(self) -> None:
        self.w.close()


def make_request(body_bytes: int) -> bytes:
    filler = "x" * max(0, body_bytes - 60)
    body = json.dumps({"model": "m", "prompt": filler, "max_tokens": 1}).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    ).encode()
    return head + body


async def run_load(port: int, request: bytes, concurrency: int, seconds: float) -> dict[str, Any]:
    conns = [await Conn.open(port) for _ in range(concurrency)]
    for c in conns:  # warm the connection (and Envoy's upstream pool)
        assert await c.post(request) == 200
    lat: list[float] = []
    errors = 0
    stop_at = time.perf_counter() + seconds

    async def worker(c: Conn) -> None:
        nonlocal errors
        while time.perf_counter() < stop_at:
            t0 = time.perf_counter()
            s = await c.post(request)
            lat.append(time.perf_counter() - t0)
            if s != 200:
                errors += 1

    t0 = time.perf_counter()
    await asyncio.gather(*(worker(c) for c in conns))
    wall = time.perf_counter() - t0
    for c in conns:
        c.close()
    return {"lat": lat, "wall": wall, "errors": errors}


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


# ------------------------------------------------------------------ benchmark


def msg_counts(envoy: EnvoyProcess) -> tuple[int, int]:
    """(messages Envoy sent to the scorer, messages it received) so far."""
    st = envoy.stats("http.main.ext_proc.")
    p = "http.main.ext_proc."
    return int(st.get(p + "stream_msgs_sent", 0)), int(st.get(p + "stream_msgs_received", 0))


async def bench_setting(
    track: bool,
    transport: str,
    sizes: list[int],
    concs: list[int],
    seconds: float,
    rounds: int,
    event_loop: str,
) -> list[dict[str, Any]]:
    backend, bport = start_backend()
    bep = f"127.0.0.1:{bport}"
    scorer, xport = start_scorer(bep, track, transport, event_loop)
    rows: list[dict[str, Any]] = []
    try:
        cfg = render_envoy_config(
            0, xport, 0, track_responses=track, direct_backends=[bep], direct_port=0
        )
        async with EnvoyProcess(cfg, concurrency=1) as envoy:
            main_port = envoy.listener_ports["main"]
            direct_port = envoy.listener_ports["direct"]
            for size in sizes:
                req = make_request(size)
                for conc in concs:
                    d_lat: list[float] = []
                    m_lat: list[float] = []
                    d_wall = m_wall = 0.0
                    cpu = 0.0
                    errors = 0
                    sent0, recv0 = msg_counts(envoy)
                    for _ in range(rounds):
                        d = await run_load(direct_port, req, conc, seconds / rounds)
                        c0 = cpu_seconds(scorer.pid)
                        m = await run_load(main_port, req, conc, seconds / rounds)
                        cpu += cpu_seconds(scorer.pid) - c0
                        d_lat += d["lat"]
                        m_lat += m["lat"]
                        d_wall += d["wall"]
                        m_wall += m["wall"]
                        errors += d["errors"] + m["errors"]
                    sent1, recv1 = msg_counts(envoy)
                    row: dict[str, Any] = {
                        "transport": transport,
                        "event_loop": event_loop,
                        "track_responses": track,
                        "body_bytes": len(req) - req.index(b"\r\n\r\n") - 4,
                        "concurrency": conc,
                        "direct_p50_ms": pct(d_lat, 0.5) * 1e3,
                        "direct_p99_ms": pct(d_lat, 0.99) * 1e3,
                        "extproc_p50_ms": pct(m_lat, 0.5) * 1e3,
                        "extproc_p99_ms": pct(m_lat, 0.99) * 1e3,
                        "added_p50_ms": (pct(m_lat, 0.5) - pct(d_lat, 0.5)) * 1e3,
                        "added_p99_ms": (pct(m_lat, 0.99) - pct(d_lat, 0.99)) * 1e3,
                        "direct_rps": len(d_lat) / d_wall,
                        "extproc_rps": len(m_lat) / m_wall,
                        "scorer_cpu_us_per_req": cpu / len(m_lat) * 1e6,
                        "requests": len(m_lat),
                        "errors": errors,
                        "mean_extproc_ms": statistics.fmean(m_lat) * 1e3,
                        # Includes each round's warm-up requests (a few per connection).
                        "msgs_to_scorer_per_req": (sent1 - sent0) / len(m_lat),
                        "msgs_from_scorer_per_req": (recv1 - recv0) / len(m_lat),
                    }
                    row["scorer_rps_per_core"] = 1e6 / max(row["scorer_cpu_us_per_req"], 1e-9)
                    rows.append(row)
                    print_row(row)
    finally:
        stop(scorer)
        stop(backend)
    return rows


HEADER = (
    f"{'transport':>9} {'loop':>7} {'track':>5} {'body':>6} {'conc':>4} | "
    f"{'direct p50':>10} {'p99':>7} | "
    f"{'extproc p50':>11} {'p99':>7} | {'added p50':>9} {'p99':>7} | "
    f"{'rps direct':>10} {'rps ext':>8} | {'CPU µs/req':>10} {'req/s/core':>10}"
)


def print_row(r: dict[str, Any]) -> None:
    print(
        f"{r['transport']:>9} {r['event_loop']:>7} {'on' if r['track_responses'] else 'off':>5} "
        f"{r['body_bytes']:>6} "
        f"{r['concurrency']:>4} | {r['direct_p50_ms']:>10.3f} {r['direct_p99_ms']:>7.3f} | "
        f"{r['extproc_p50_ms']:>11.3f} {r['extproc_p99_ms']:>7.3f} | "
        f"{r['added_p50_ms']:>9.3f} {r['added_p99_ms']:>7.3f} | "
        f"{r['direct_rps']:>10.0f} {r['extproc_rps']:>8.0f} | "
        f"{r['scorer_cpu_us_per_req']:>10.0f} {r['scorer_rps_per_core']:>10.0f}",
        flush=True,
    )


# ------------------------------------------------------------------ CPU per stream


async def cpu_setting(
    track: bool, transport: str, body_mode: BodyMode, n: int, reps: int, event_loop: str
) -> dict[str, Any]:
    """Scorer CPU per stream over `n` sequential requests, `reps` times."""
    backend, bport = start_backend()
    bep = f"127.0.0.1:{bport}"
    scorer, xport = start_scorer(bep, track, transport, event_loop)
    try:
        cfg = render_envoy_config(0, xport, 0, body_mode=body_mode, track_responses=track)
        async with EnvoyProcess(cfg, concurrency=1) as envoy:
            req = make_request(2048)
            conn = await Conn.open(envoy.listener_port)
            for _ in range(50):  # warm up: connections, caches, lazy imports
                assert await conn.post(req) == 200
            per_stream: list[float] = []
            user = system = 0.0
            sent0, recv0 = msg_counts(envoy)
            for _ in range(reps):
                u0, s0 = cpu_split(scorer.pid)
                for _ in range(n):
                    assert await conn.post(req) == 200
                u1, s1 = cpu_split(scorer.pid)
                per_stream.append((u1 - u0 + s1 - s0) / n * 1e6)
                user += u1 - u0
                system += s1 - s0
            sent1, recv1 = msg_counts(envoy)
            conn.close()
    finally:
        stop(scorer)
        stop(backend)
    return {
        "transport": transport,
        "event_loop": event_loop,
        "track_responses": track,
        "body_mode": body_mode,
        "requests": n * reps,
        "cpu_us_min": min(per_stream),
        "cpu_us_median": statistics.median(per_stream),
        "user_share": user / max(user + system, 1e-9),
        "msgs_to_scorer_per_req": (sent1 - sent0) / (n * reps),
        "msgs_from_scorer_per_req": (recv1 - recv0) / (n * reps),
    }


def cpu_main(
    args: argparse.Namespace, transports: list[str], tracks: list[bool], loops: list[str]
) -> int:
    print(f"scorer CPU µs per stream, 2 KB body, {args.cpu} sequential requests x {args.reps}")
    print(
        f"{'transport':>9} {'loop':>7} {'track':>5} {'body mode':>20} | {'min':>5} {'median':>6} "
        f"{'user %':>6} | {'msgs in':>7} {'out':>5}"
    )
    rows = []
    for loop, transport, track in itertools.product(loops, transports, tracks):
        modes: tuple[BodyMode, ...] = ("FULL_DUPLEX_STREAMED", "BUFFERED")
        for mode in modes:
            r = asyncio.run(cpu_setting(track, transport, mode, args.cpu, args.reps, loop))
            rows.append(r)
            print(
                f"{transport:>9} {loop:>7} {'on' if track else 'off':>5} {mode:>20} | "
                f"{r['cpu_us_min']:>5.0f} {r['cpu_us_median']:>6.0f} "
                f"{r['user_share'] * 100:>6.0f} | {r['msgs_to_scorer_per_req']:>7.2f} "
                f"{r['msgs_from_scorer_per_req']:>5.2f}",
                flush=True,
            )
    out = Path(args.out).with_name("extproc_cpu.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"benchmark": "extproc_cpu", "rows": rows}, indent=2))
    print(f"wrote {out}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--seconds", type=float, default=3.0, help="per path and cell")
    ap.add_argument("--rounds", type=int, default=3, help="direct/extproc alternations per cell")
    ap.add_argument("--quick", action="store_true", help="2 KB, concurrency 1 and 16, track on")
    ap.add_argument("--out", default=str(ROOT / "bench" / "out" / "extproc.json"))
    ap.add_argument(
        "--transport", default="asyncio,grpcio", help="server.extproc_transport values, comma list"
    )
    ap.add_argument(
        "--event-loop",
        default="uvloop",
        help="server.event_loop values of the scorer, comma list (uvloop,asyncio: an A/B)",
    )
    ap.add_argument("--cpu", type=int, default=0, metavar="N", help="CPU per stream only")
    ap.add_argument("--reps", type=int, default=5, help="repetitions for --cpu")
    ap.add_argument("--serve-backend", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve_backend:
        backend_main(0)
        return 0
    transports = [t.strip() for t in args.transport.split(",") if t.strip()]
    loops = [x.strip() for x in args.event_loop.split(",") if x.strip()]
    tracks = [True] if args.quick else [True, False]
    if args.cpu:
        return cpu_main(args, transports, tracks, loops)
    sizes = [2048] if args.quick else [2048, 32768]
    concs = [1, 16]
    print(f"latency in ms; {os.cpu_count()} cores; {args.seconds}s per path per cell")
    print(HEADER)
    rows: list[dict[str, Any]] = []
    for loop, transport, track in itertools.product(loops, transports, tracks):
        rows += asyncio.run(
            bench_setting(track, transport, sizes, concs, args.seconds, args.rounds, loop)
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "benchmark": "extproc",
        "cores": os.cpu_count(),
        "seconds_per_cell": args.seconds,
        "targets": {"added_p50_ms_c1": 0.6, "scorer_cpu_us_per_req": 400, "rps_per_core": 2000},
        "rows": rows,
    }
    out.write_text(json.dumps(doc, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
