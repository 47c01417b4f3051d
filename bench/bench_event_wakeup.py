"""CPU and instructions per KV-event message when each message wakes the scorer alone.

    .venv/bin/python bench/bench_event_wakeup.py [--messages 3000] [--gap-ms 1]
        [--kinds empty,stored1] [--burst 1] [--instructions]

vLLM publishes one message per engine step, so in production almost every message arrives
alone on its socket and costs a whole wake-up of the event loop: the SUB socket's reader,
the receive loop, the subscriber's handling (sequence check, decode, apply). This process
is the worker (a `kv-scorer sim` KVEventPublisher, vLLM's map era, bound on loopback TCP);
a child process is the scorer side: a real `Subscriber` (connect mode, the default events
config, a BlockIndex) on uvloop, nothing else on its loop. After a warm-up, `--messages`
messages are published `--gap-ms` apart (each handled before the next arrives), `--burst`
at a time (1: the one-message-per-wake-up case; 32: a queued burst, BURST messages per
wake-up). Kinds: `empty`, a batch with no event (the receive path alone: wake-up, read,
sequence check, decode of an empty batch), and `stored1`, one BlockStored of one 16-token
block chained to the previous one (a decode step's completed block).

Reported per message: the child's process CPU (its ZMQ I/O thread included; ±50 % run to
run on a shared VM) and, with `--instructions`, the instructions (Ir) the child executes,
counted by callgrind (the child runs under `valgrind --tool=callgrind`; counts zeroed
after the warm-up, dumped after the window, an idle window as long subtracted; `--gap-ms`
is then raised to 20 so that valgrind's ~50x slow-down still handles each message alone,
and the child's `time.monotonic` runs `--clock-scale` (50) times slower: the receive
loop's 2 ms slice would otherwise end after every message under valgrind, a yield and a
re-read that native runs never make, before this branch and after).
Instructions do not swing: the A/B figure. Run it on another tree's code with
`PYTHONPATH=<that tree>`. Writes bench/out/event_wakeup.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import queue
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

# (this script's folder is on sys.path as it runs: bench/callgrind.py imports nothing of
# the project, so PYTHONPATH=<another tree> still picks that tree's scorer)
from callgrind import control, instructions

ROOT = Path(__file__).resolve().parents[1]


# ---- the scorer side (child) ----------------------------------------------------------------


async def _subscriber(endpoint: str) -> None:
    """Follow `endpoint` with a real Subscriber; answer the parent's commands on stdin:
    `report` → `<messages handled> <user CPU s> <system CPU s>`; `wait N` → the same once N are
    handled; `quit`. Handled messages are counted by `on_message` (once each, applied)."""
    import zmq.asyncio

    scale = float(os.environ.get("KVS_WAKEUP_CLOCK_SCALE", "1"))
    if scale != 1.0:
        # The receive path's slice bound (BURST messages or 2 ms) reads time.monotonic;
        # under callgrind every message would take past 2 ms, which native runs never do.
        real = time.monotonic
        time.monotonic = lambda: real() / scale

    from scorer.blocks import BlockHasher
    from scorer.config import EventsConfig, EventsEndpointConfig, IndexConfig
    from scorer.events.apply import Applier
    from scorer.events.subscriber import Subscriber
    from scorer.index import BlockIndex

    loop = asyncio.get_running_loop()
    count = 0
    waiting: int | None = None
    stop = loop.create_future()

    def answer() -> None:
        t = resource.getrusage(resource.RUSAGE_SELF)  # µs resolution (os.times: 10 ms)
        sys.stdout.write(f"{count} {t.ru_utime} {t.ru_stime}\n")
        sys.stdout.flush()

    def on_message(_msg: object) -> None:
        nonlocal count, waiting
        count += 1
        if waiting is not None and count >= waiting:
            waiting = None
            answer()

    buf = b""

    def on_stdin() -> None:
        nonlocal buf, waiting
        data = os.read(0, 4096)
        if not data:
            stop.set_result(None)
            return
        buf += data
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            cmd = line.decode().split()
            if cmd[0] == "report":
                answer()
            elif cmd[0] == "wait":
                waiting = int(cmd[1])
                if count >= waiting:
                    waiting = None
                    answer()
            elif cmd[0] == "quit" and not stop.done():
                stop.set_result(None)

    ctx = zmq.asyncio.Context()
    sub = Subscriber(
        "w0",
        EventsEndpointConfig(endpoint=endpoint),
        Applier(BlockIndex(IndexConfig()), BlockHasher(16)),
        EventsConfig(),
        ctx,
        on_message=on_message,
    )
    await sub.start()
    loop.add_reader(0, on_stdin)
    try:
        await stop
    finally:
        loop.remove_reader(0)
        await sub.stop()
        ctx.term()


# ---- the worker side (this process) -------------------------------------------------------


class Child:
    """The scorer-side process, its stdout read by a thread (lines → a queue)."""

    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
        )
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)

    def ask(self, cmd: str, timeout: float = 300.0) -> tuple[int, float, float]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        return self.reply(timeout)

    def reply(self, timeout: float = 300.0) -> tuple[int, float, float]:
        line = self.lines.get(timeout=timeout)
        n, user, system = line.split()
        return int(n), float(user), float(system)

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            with_quit = True
            try:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.flush()
            except BrokenPipeError:
                with_quit = False
            try:
                self.proc.wait(timeout=120 if with_quit else 5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


async def measure(kind: str, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """One child, warmed up, then `args.messages` messages `args.burst` at a time."""
    from kvscorer_tools.sim.kvevents import KVEventPublisher, block_stored

    pub = KVEventPublisher("tcp://127.0.0.1:0", mode="bind")
    await pub.start()
    assert pub.bound_endpoint is not None
    env = dict(os.environ)
    if args.instructions:
        env["KVS_WAKEUP_CLOCK_SCALE"] = str(args.clock_scale)
    argv = [sys.executable, __file__, "--child", pub.bound_endpoint]
    out_file = tmp / f"callgrind-{kind}.out"
    if args.instructions:
        argv = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out_file}", *argv]
    child = Child(argv, env)
    parent: int | None = None
    tokens = 0

    def publish() -> None:
        nonlocal parent, tokens
        if kind == "empty":
            pub.publish([])
            return
        h = (pub.next_seq + 1) * 0x9E3779B97F4A7C15 % (1 << 63)
        ids = list(range(tokens, tokens + 16))
        tokens += 16
        pub.publish([block_stored("map", [h], parent, ids, 16)])
        parent = h

    gap = args.gap_ms / 1000
    try:
        # Warm-up: publish until the subscription is through and `--warmup` are handled.
        handled = 0
        deadline = time.monotonic() + 600
        while handled < args.warmup:
            if time.monotonic() > deadline:
                raise RuntimeError("warm-up not over in 600 s")
            for _ in range(8):
                publish()
                await asyncio.sleep(gap)
            handled, _, _ = child.ask("report")
        c0, u0, s0 = child.ask("report")
        if args.instructions:
            control(child.proc.pid, "--zero")
        began = time.perf_counter()
        sent = 0
        while sent < args.messages:
            for _ in range(min(args.burst, args.messages - sent)):
                publish()
                sent += 1
            await asyncio.sleep(gap)
        c1, u1, s1 = child.ask(f"wait {c0 + args.messages}")
        took = time.perf_counter() - began
        row: dict[str, Any] = {
            "kind": kind,
            "burst": args.burst,
            "messages": c1 - c0,
            "gap_ms": args.gap_ms,
            "cpu_us_per_message": round((u1 + s1 - u0 - s0) / (c1 - c0) * 1e6, 2),
            "user_us_per_message": round((u1 - u0) / (c1 - c0) * 1e6, 2),
            "system_us_per_message": round((s1 - s0) / (c1 - c0) * 1e6, 2),
        }
        if args.instructions:
            control(child.proc.pid, "--dump=measured")
            ir = instructions(out_file.with_name(out_file.name + ".1"))
            control(child.proc.pid, "--zero")
            await asyncio.sleep(took)  # the same time idle: what the loop costs anyway
            control(child.proc.pid, "--dump=idle")
            idle = instructions(out_file.with_name(out_file.name + ".2"))
            if args.keep:
                keep = Path(args.keep)
                keep.mkdir(parents=True, exist_ok=True)
                shutil.copy(out_file.with_name(out_file.name + ".1"), keep / f"{kind}.measured")
                shutil.copy(out_file.with_name(out_file.name + ".2"), keep / f"{kind}.idle")
            row.update(
                ir_total=ir,
                ir_idle_same_time=idle,
                ir_per_message=round((ir - idle) / (c1 - c0)),
            )
        return row
    finally:
        child.close()
        await pub.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--messages", type=int, default=3000)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--gap-ms", type=float, default=None, help="1; 20 with --instructions")
    ap.add_argument("--burst", type=int, default=1, help="messages published back to back")
    ap.add_argument("--kinds", default="empty,stored1")
    ap.add_argument("--repeats", type=int, default=1, help="alternated runs (median CPU)")
    ap.add_argument("--instructions", action="store_true", help="count Ir with callgrind")
    ap.add_argument(
        "--clock-scale",
        type=float,
        default=50.0,
        help="with --instructions: the child's time.monotonic runs this much slower",
    )
    ap.add_argument("--out", type=Path, default=ROOT / "bench/out/event_wakeup.json")
    ap.add_argument("--keep", metavar="DIR", help="copy the callgrind dumps here")
    ap.add_argument("--child", metavar="ENDPOINT", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        import uvloop

        uvloop.run(_subscriber(args.child))
        return 0
    if args.gap_ms is None:
        args.gap_ms = 20.0 if args.instructions else 1.0
    if args.instructions and shutil.which("valgrind") is None:
        print("valgrind (callgrind) is not installed", file=sys.stderr)
        return 2
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="kvs-wakeup-") as tmp:
        for _ in range(args.repeats):
            for kind in args.kinds.split(","):
                row = asyncio.run(measure(kind, args, Path(tmp)))
                rows.append(row)
                ir = f"{row['ir_per_message']:>9,} Ir" if "ir_per_message" in row else ""
                print(
                    f"{kind:>8} burst {args.burst:>3}: {row['cpu_us_per_message']:8.2f} µs CPU "
                    f"({row['user_us_per_message']:.2f} user, "
                    f"{row['system_us_per_message']:.2f} system) "
                    f"{ir} per message ({row['messages']} messages)",
                    flush=True,
                )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"benchmark": "event_wakeup", "rows": rows}, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
