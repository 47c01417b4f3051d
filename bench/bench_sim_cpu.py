"""CPU of one `kv-scorer sim` per 1,000 streamed tokens, for each `--stream-interval`.

Starts one sim process per interval, streams `--requests` completions of `--max-tokens`
tokens with `--concurrency` in flight from this process, and reads the sim's own CPU time
(utime + stime from /proc) over the load. Wall time shows model time is kept (it should not
move with the interval). Prints one JSON line per interval, writes bench/out/sim_cpu.json.
Linux only (/proc).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _load(args: argparse.Namespace, interval: int) -> dict[str, Any]:
    port = _free_port()
    cmd = [sys.executable, "-m", "scorer.cli", "sim", "--port", str(port)]
    cmd += ["--speed", str(args.speed), "--stream-interval", str(interval)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
    try:
        async with aiohttp.ClientSession() as s:
            for _ in range(400):  # bounded wait for start-up
                try:
                    async with s.get(f"http://127.0.0.1:{port}/health") as r:
                        if r.status == 200:
                            break
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(0.05)
            cpu0, wall0 = _cpu_s(proc.pid), time.monotonic()
            chunks = 0
            sem = asyncio.Semaphore(args.concurrency)

            async def one(i: int) -> None:
                nonlocal chunks
                body = {
                    "prompt": f"request {i} " * 20,
                    "max_tokens": args.max_tokens,
                    "stream": True,
                }
                async with sem, s.post(f"http://127.0.0.1:{port}/v1/completions", json=body) as r:
                    async for line in r.content:
                        chunks += line.startswith(b"data: {")

            await asyncio.gather(*(one(i) for i in range(args.requests)))
            cpu, wall = _cpu_s(proc.pid) - cpu0, time.monotonic() - wall0
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    tokens = args.requests * args.max_tokens
    return {
        "stream_interval": interval,
        "concurrency": args.concurrency,
        "tokens": tokens,
        "sse_chunks": chunks,
        "wall_s": round(wall, 2),
        "sim_cpu_s": round(cpu, 2),
        "cpu_ms_per_1k_tokens": round(cpu / tokens * 1e6, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--intervals", default="1,8", help="comma-separated --stream-interval values")
    ap.add_argument("--concurrency", type=int, default=3)
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--speed", type=float, default=5.0)
    ap.add_argument("--out", default=str(Path(__file__).parent / "out" / "sim_cpu.json"))
    args = ap.parse_args()
    rows = []
    for interval in (int(x) for x in args.intervals.split(",")):
        row = asyncio.run(_load(args, interval))
        print(json.dumps(row))
        rows.append(row)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"speed": args.speed, "rows": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
