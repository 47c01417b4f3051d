"""What streaming response bodies through ext_proc costs, per chunk.

    .venv/bin/python bench/bench_response_chunks.py [--quick] [--chunks 1000] [--streams 5]
        [--concurrency 1] [--transport asyncio,grpcio] [--event-loop uvloop,asyncio]

Processes (all real, loopback): an SSE backend that sends `--chunks` events paced
~0.2 ms apart (each event is one chunk; it carries its send time), `kv-scorer serve`
(its own process, so its CPU time is read from /proc) and two Envoys in front of it:
`bodies` (response_body_mode FULL_DUPLEX_STREAMED: every chunk goes to the scorer and
back) and `no-bodies` (response_body_mode NONE, otherwise identical). The two are run in
alternating rounds so machine noise hits both; `--concurrency N` runs N streams at once
in each round (one scorer connection per Envoy worker carries them all, so several
chunks can share one socket wake-up, as under load). Once per `--transport`
(`server.extproc_transport`) and per `--event-loop` (`server.event_loop` of the scorer
process; default uvloop, as `kv-scorer serve`; `uvloop,asyncio` is an A/B in one run).

Per setting: per-chunk latency (client arrival - backend send, p50/p99 over all chunks),
the scorer's CPU time per stream, the ext_proc messages Envoy sent per stream; derived:
added latency per chunk (bodies - no-bodies, p50) and scorer CPU per response chunk
((CPU bodies - CPU no-bodies) / body messages). Prints a table and writes
bench/out/response_chunks.json. `--quick`: 500 chunks, 3 streams. Targets (issue 10):
≤ 15 µs scorer CPU per chunk; added latency ≤ 2x Envoy's own per-chunk time (the no-bodies p50).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import itertools
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvscorer_tools.envoyrun import EnvoyProcess  # noqa: E402
from scorer.envoyproc import render_envoy_config  # noqa: E402

_spec = importlib.util.spec_from_file_location("bench_extproc", ROOT / "bench" / "bench_extproc.py")
assert _spec is not None and _spec.loader is not None
bx = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bx)


def backend_main(port: int, chunks: int) -> None:
    """SSE backend (own process): `chunks` events, each with its monotonic send time."""
    from aiohttp import web

    async def handle(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(chunks):
            await resp.write(b'data: {"i": %d, "t": %.9f}\n\n' % (i, time.monotonic()))
            await asyncio.sleep(0.0002)  # one event per chunk (Envoy reads them apart)
        usage = b'{"choices": [], "usage": {"prompt_tokens": 8, "completion_tokens": %d}}' % chunks
        await resp.write(b"data: " + usage + b"\n\ndata: [DONE]\n\n")
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    bx.serve_app(app, port)


async def one_stream(port: int) -> list[float]:
    """Per-chunk latency (s) of one streamed completion through Envoy."""
    import aiohttp

    lat: list[float] = []
    body = json.dumps({"model": "m", "prompt": "p", "stream": True}).encode()
    async with (
        aiohttp.ClientSession() as s,
        s.post(f"http://127.0.0.1:{port}/v1/completions", data=body) as r,
    ):
        assert r.status == 200, r.status
        async for line in r.content:
            if line.startswith(b'data: {"i"'):
                lat.append(time.monotonic() - json.loads(line[6:])["t"])
    return lat


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q / 100 * len(xs)))]


def msgs_sent(envoy: EnvoyProcess) -> int:
    return sum(v for k, v in envoy.stats().items() if k.endswith("ext_proc.stream_msgs_sent"))


async def bench_transport(
    transport: str, event_loop: str, backend: str, streams: int, chunks: int, concurrency: int = 1
) -> dict[str, Any]:
    scorer, extproc_port = bx.start_scorer(backend, True, transport, event_loop)
    try:
        envoys = {
            mode: EnvoyProcess(render_envoy_config(0, extproc_port, 0, response_body_mode=m))
            for mode, m in (("bodies", "FULL_DUPLEX_STREAMED"), ("no-bodies", "NONE"))
        }
        for e in envoys.values():
            await e.__aenter__()
        try:
            lat: dict[str, list[float]] = {m: [] for m in envoys}
            cpu: dict[str, float] = dict.fromkeys(envoys, 0.0)
            sys_cpu: dict[str, float] = dict.fromkeys(envoys, 0.0)  # of which in the kernel
            msgs: dict[str, int] = dict.fromkeys(envoys, 0)
            for e in envoys.values():  # warm-up
                await one_stream(e.listener_port)
            for _ in range(streams):
                for mode, e in envoys.items():
                    m0, (u0, s0) = msgs_sent(e), bx.cpu_split(scorer.pid)
                    got = await asyncio.gather(
                        *(one_stream(e.listener_port) for _ in range(concurrency))
                    )
                    for g in got:
                        lat[mode] += g
                    u1, s1 = bx.cpu_split(scorer.pid)
                    cpu[mode] += u1 - u0 + s1 - s0
                    sys_cpu[mode] += s1 - s0
                    msgs[mode] += msgs_sent(e) - m0
        finally:
            for e in envoys.values():
                await e.__aexit__(None, None, None)
    finally:
        bx.stop(scorer)
    out: dict[str, Any] = {
        "transport": transport,
        "event_loop": event_loop,
        "streams": streams,
        "concurrency": concurrency,
        "chunks": chunks,
    }
    streams *= concurrency  # per-stream figures below are per response stream
    for mode in lat:
        out[mode] = {
            "chunk_latency_p50_us": round(statistics.median(lat[mode]) * 1e6, 1),
            "chunk_latency_p99_us": round(pct(lat[mode], 99) * 1e6, 1),
            "scorer_cpu_ms_per_stream": round(cpu[mode] / streams * 1e3, 2),
            "extproc_msgs_per_stream": round(msgs[mode] / streams, 1),
        }
    body_msgs = (msgs["bodies"] - msgs["no-bodies"]) / streams
    out["body_msgs_per_stream"] = round(body_msgs, 1)
    out["added_latency_per_chunk_p50_us"] = round(
        out["bodies"]["chunk_latency_p50_us"] - out["no-bodies"]["chunk_latency_p50_us"], 1
    )
    extra_cpu = (cpu["bodies"] - cpu["no-bodies"]) / streams
    out["scorer_cpu_us_per_chunk"] = round(extra_cpu / body_msgs * 1e6, 2) if body_msgs else None
    extra_sys = (sys_cpu["bodies"] - sys_cpu["no-bodies"]) / streams
    out["scorer_sys_cpu_us_per_chunk"] = (
        round(extra_sys / body_msgs * 1e6, 2) if body_msgs else None
    )
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunks", type=int, default=1000)
    ap.add_argument("--streams", type=int, default=5)
    ap.add_argument("--concurrency", type=int, default=1, help="streams at once per round")
    ap.add_argument("--quick", action="store_true", help="--chunks 500 --streams 3")
    ap.add_argument("--transport", default="asyncio,grpcio")
    ap.add_argument(
        "--event-loop",
        default="uvloop",
        help="server.event_loop values of the scorer, comma list (uvloop,asyncio: an A/B)",
    )
    ap.add_argument("--serve-backend", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.quick:
        args.chunks, args.streams = 500, 3
    if args.serve_backend:
        backend_main(0, args.chunks)
        return 0
    p = subprocess.Popen(
        [sys.executable, __file__, "--serve-backend", "--chunks", str(args.chunks)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert p.stdout is not None
        backend = f"127.0.0.1:{int(p.stdout.readline().split()[1])}"
        results = []
        transports = [x.strip() for x in args.transport.split(",") if x.strip()]
        loops = [x.strip() for x in args.event_loop.split(",") if x.strip()]
        for loop, t in itertools.product(loops, transports):
            r = asyncio.run(
                bench_transport(t, loop, backend, args.streams, args.chunks, args.concurrency)
            )
            results.append(r)
            print(
                f"{t:8s} {loop:7s} c={args.concurrency} "
                f"chunk p50 bodies {r['bodies']['chunk_latency_p50_us']:8.1f} µs  "
                f"no-bodies {r['no-bodies']['chunk_latency_p50_us']:8.1f} µs  "
                f"added {r['added_latency_per_chunk_p50_us']:7.1f} µs  "
                f"scorer CPU/chunk {r['scorer_cpu_us_per_chunk']} µs "
                f"(kernel {r['scorer_sys_cpu_us_per_chunk']})  "
                f"body msgs/stream {r['body_msgs_per_stream']}",
                flush=True,
            )
    finally:
        bx.stop(p)
    out = ROOT / "bench" / "out"
    out.mkdir(parents=True, exist_ok=True)
    (out / "response_chunks.json").write_text(json.dumps({"results": results}, indent=2))
    print(f"wrote {out / 'response_chunks.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
