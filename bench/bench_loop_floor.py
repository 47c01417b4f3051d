"""The floor under the scorer's CPU per streamed response chunk: an event loop that does
nothing but receive a message and write a reply.

    .venv/bin/python bench/bench_loop_floor.py [--messages 5000] [--gap-us 200]

A streamed response reaches the scorer as one ext_proc message per chunk, paced by the
model (one SSE event every few ms), and each is answered at once: per chunk the scorer's
process wakes from epoll, reads the socket, runs its frame loop, writes the answer and
goes back to sleep. This benchmark measures the part no frame loop can remove: an
`asyncio.Protocol` (and the same under uvloop) whose `data_received` only writes a fixed
reply of the size of a chunk answer, driven by a client process that sends a message of
the size of a chunk message (`--size`), waits for the reply, then pauses `--gap-us` (so
the server's loop goes idle between messages, as it does between SSE events). The
server's CPU (utime + stime, getrusage) per message is the floor; a pure-C receive/reply
loop (the client's own, blocking sockets) is printed beside it for scale. Prints a table
and writes bench/out/loop_floor.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import resource
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def cpu_split() -> tuple[float, float]:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime, r.ru_stime


def serve(kind: str, reply_size: int, port_q: Any, result_q: Any) -> None:
    """The server process: reply to each message with one write. `kind`: the loop
    (asyncio / uvloop), `+buffered` for an asyncio.BufferedProtocol reading into one
    buffer of its own instead of a new bytes object per read."""
    loop_kind, _, proto = kind.partition("+")
    if loop_kind == "uvloop":
        import uvloop

        uvloop.install()
    reply = b"r" * reply_size

    class Echo(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            self.t: Any = transport
            sock = transport.get_extra_info("socket")
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.n = 0
            self.cpu0 = 0.0
            self.split0 = (0.0, 0.0)

        def data_received(self, data: bytes) -> None:
            if data == b"start":
                self.split0 = cpu_split()
                self.cpu0 = cpu_s()
                self.n = 0
                self.t.write(b"ok")
                return
            if data == b"stop":
                u, k = cpu_split()
                result_q.put((self.n, cpu_s() - self.cpu0, u - self.split0[0], k - self.split0[1]))
                self.t.write(b"ok")
                return
            self.n += 1
            self.t.write(reply)

    class BufferedEcho(Echo, asyncio.BufferedProtocol):
        buf = memoryview(bytearray(64 * 1024))

        def get_buffer(self, sizehint: int) -> memoryview:
            return self.buf

        def buffer_updated(self, nbytes: int) -> None:
            self.data_received(bytes(self.buf[:nbytes]))

    async def main() -> None:
        loop = asyncio.get_running_loop()
        factory = BufferedEcho if proto == "buffered" else Echo
        server = await loop.create_server(factory, "127.0.0.1", 0)
        port_q.put(server.sockets[0].getsockname()[1])
        await asyncio.sleep(3600)

    asyncio.run(main())


def drive(port: int, n: int, size: int, gap_us: float) -> list[float]:
    """Send `n` messages one at a time; returns each round trip in µs."""
    s = socket.create_connection(("127.0.0.1", port))
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    msg = b"m" * size
    s.sendall(b"start")
    s.recv(16)
    rtt = []
    for _ in range(n):
        t0 = time.perf_counter()
        s.sendall(msg)
        s.recv(65536)
        rtt.append((time.perf_counter() - t0) * 1e6)
        if gap_us:
            time.sleep(gap_us / 1e6)
    s.sendall(b"stop")
    s.recv(16)
    s.close()
    return rtt


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--messages", type=int, default=5000)
    ap.add_argument("--gap-us", type=float, default=200.0)
    ap.add_argument("--size", type=int, default=230, help="bytes per message (a chunk message)")
    ap.add_argument("--reply", type=int, default=200, help="bytes per reply (a chunk answer)")
    ap.add_argument("--loops", default="asyncio,asyncio+buffered,uvloop,uvloop+buffered")
    ap.add_argument("--out", default=str(ROOT / "bench" / "out" / "loop_floor.json"))
    args = ap.parse_args(argv)
    results: dict[str, Any] = {}
    for kind in args.loops.split(","):
        port_q: Any = mp.Queue()
        result_q: Any = mp.Queue()
        p = mp.Process(target=serve, args=(kind, args.reply, port_q, result_q), daemon=True)
        p.start()
        try:
            port = port_q.get(timeout=10)
            c0 = cpu_s()
            rtt = drive(port, args.messages, args.size, args.gap_us)
            client_cpu = cpu_s() - c0
            n, server_cpu, user, system = result_q.get(timeout=10)
        finally:
            p.kill()
            p.join()
        results[kind] = {
            "messages": n,
            "server_cpu_us_per_message": round(server_cpu / n * 1e6, 1),
            "server_user_us_per_message": round(user / n * 1e6, 1),
            "server_system_us_per_message": round(system / n * 1e6, 1),
            "client_cpu_us_per_message": round(client_cpu / args.messages * 1e6, 1),
            "rtt_p50_us": round(statistics.median(rtt), 1),
        }
    print(
        f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}; "
        f"{args.messages} messages, {args.gap_us:.0f} µs apart"
    )
    print(
        f"{'loop':>16} {'server CPU µs/msg':>18} {'user':>6} {'system':>7} "
        f"{'client (blocking) µs/msg':>25} {'RTT p50 µs':>11}"
    )
    for kind, r in results.items():
        print(
            f"{kind:>16} {r['server_cpu_us_per_message']:>18.1f} "
            f"{r['server_user_us_per_message']:>6.1f} {r['server_system_us_per_message']:>7.1f} "
            f"{r['client_cpu_us_per_message']:>25.1f} {r['rtt_p50_us']:>11.1f}"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {"benchmark": "loop_floor", "settings": vars(args), "results": results}, indent=2
        )
    )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
