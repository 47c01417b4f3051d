"""CPU per KV-event message of the reader that hands a ZMQ socket's queued messages to the
subscriber (`scorer.events.subscriber.Reader`), against one awaited recv per message.

    .venv/bin/python bench/bench_event_receive.py [--messages 50000] [--repeats 3]

A busy worker publishes a message per engine step; the scorer reads them on its event
loop, next to the request path. Each awaited `recv_multipart()` of pyzmq's asyncio socket
costs a Future, a timeout check and an EVENTS read; `Reader` reads from the loop's reader
callback on the socket's FD with plain non-blocking calls (BURST messages per callback).
The handler here does nothing, so the figure is the receive loop alone. `--messages`
100-byte messages are queued on an inproc PUSH/PULL pair, then read; process CPU per
message, median of the repeats, uvloop (the scorer's default). Queued bursts only: for the
message-at-a-time case (vLLM's one message per engine step), bench_event_wakeup.py.
Prints a table and writes bench/out/event_receive.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import uvloop
import zmq
import zmq.asyncio

from scorer.events.subscriber import BURST, Reader

ROOT = Path(__file__).resolve().parents[1]
Loop = Callable[[zmq.asyncio.Socket, Callable[[list[bytes]], bool]], Awaitable[None]]


async def awaited_each(sock: zmq.asyncio.Socket, handle: Callable[[list[bytes]], bool]) -> None:
    """The loop before `Reader` and its predecessor: one awaited recv per message, the
    same bursts."""
    n = 0
    start = time.monotonic()
    while True:
        handle(await sock.recv_multipart())
        n += 1
        if n >= BURST or time.monotonic() - start > 0.002:
            await asyncio.sleep(0)
            n = 0
            start = time.monotonic()


async def reader(sock: zmq.asyncio.Socket, handle: Callable[[list[bytes]], bool]) -> None:
    """The scorer's reader."""
    await Reader(sock, handle).run()


async def one(loop_fn: Loop, messages: int) -> float:
    """CPU µs per message for `loop_fn` reading `messages` queued messages."""
    ctx = zmq.asyncio.Context()
    push, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    push.sndhwm = pull.rcvhwm = 0
    push.bind("inproc://bench-event-receive")
    pull.connect("inproc://bench-event-receive")
    payload = b"x" * 100
    for i in range(messages):
        await push.send_multipart([b"kv@10.0.0.1:8000", i.to_bytes(8, "big"), payload])
    done = asyncio.Event()
    count = 0

    def handle(frames: list[bytes]) -> bool:
        nonlocal count
        count += 1
        if count == messages:
            done.set()
        return True

    t0 = time.process_time()
    task = asyncio.create_task(loop_fn(pull, handle))
    await done.wait()
    cpu = time.process_time() - t0
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    push.close(linger=0)
    pull.close(linger=0)
    ctx.term()
    return cpu / messages * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--messages", type=int, default=50_000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=ROOT / "bench/out/event_receive.json")
    args = ap.parse_args()
    runs: dict[str, list[float]] = {"awaited_each": [], "reader": []}
    for _ in range(args.repeats):  # alternated
        for name, fn in (("awaited_each", awaited_each), ("reader", reader)):
            runs[name].append(uvloop.run(one(fn, args.messages)))
    result = {name: round(statistics.median(v), 2) for name, v in runs.items()}
    print(f"{'loop':<14} CPU µs per message (median of {args.repeats})")
    for name, v in result.items():
        print(f"{name:<14} {v:8.2f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"messages": args.messages, "runs": runs, "median_us": result}))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
