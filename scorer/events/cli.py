"""`kv-scorer events listen`: print a worker's KV events as JSON lines (an operator tool).

    kv-scorer events listen --connect tcp://10.0.0.5:5557 [--topic T] [--count N]
    kv-scorer events listen --bind tcp://*:5557
    kv-scorer events listen --replay-from 0 --replay-endpoint tcp://10.0.0.5:5558 --count 20

One line per event with exactly the keys of `FIELDS` (absent → null, hashes as integers,
bytes hashes as hex). Malformed messages go to stderr and listening goes on.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
from typing import Any, TextIO

import zmq
import zmq.asyncio

from scorer.events.decode import (
    END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    DecodeError,
    Event,
    Message,
    decode_message,
    decode_payload,
    decode_seq,
    split_replay_reply,
)

FIELDS = (
    "seq",
    "topic",
    "dp_rank",
    "type",
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
)


def _json_safe(v: Any) -> Any:
    if isinstance(v, bytes | bytearray):
        return bytes(v).hex()
    if isinstance(v, list | tuple):
        return [_json_safe(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _json_safe(x) for k, x in v.items()}
    return v


def event_record(msg: Message, ev: Event) -> dict[str, Any]:
    """One event as the JSON object `listen` prints."""
    rec: dict[str, Any] = dict.fromkeys(FIELDS)
    rec.update(seq=msg.seq, topic=msg.topic, dp_rank=msg.batch.dp_rank, type=type(ev).__name__)
    if isinstance(ev, BlockStored):
        rec.update(
            block_hashes=_json_safe(list(ev.block_hashes)),  # list or array('Q')
            parent_block_hash=_json_safe(ev.parent_block_hash),
            token_ids=list(ev.token_ids),
            block_size=ev.block_size,
            medium=ev.medium_raw,
            lora_name=ev.lora_name,
            extra_keys=_json_safe(ev.extra_keys),
            group_idx=ev.group_idx,
        )
    elif isinstance(ev, BlockRemoved):
        rec.update(
            block_hashes=_json_safe(ev.block_hashes), medium=ev.medium_raw, group_idx=ev.group_idx
        )
    elif isinstance(ev, AllBlocksCleared):
        rec.update(medium=ev.medium)
    return rec


class Printer:
    """Prints event lines until `count` events were printed (0: forever)."""

    def __init__(self, out: TextIO, count: int) -> None:
        self.out = out
        self.count = count
        self.printed = 0

    @property
    def done(self) -> bool:
        return self.count > 0 and self.printed >= self.count

    def message(self, msg: Message) -> None:
        for err in msg.batch.errors:
            print(f"skipped event: {err}", file=sys.stderr)
        for ev in msg.batch.events:
            if self.done:
                return
            self.out.write(json.dumps(event_record(msg, ev)) + "\n")
            self.printed += 1
        self.out.flush()


async def replay(
    ctx: zmq.asyncio.Context, endpoint: str, start: int, printer: Printer, timeout: float
) -> None:
    """Ask a replay ROUTER for everything from `start` and print it."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    try:
        dealer.connect(endpoint)
        await dealer.send_multipart([b"", start.to_bytes(8, "big")])
        while not printer.done:
            try:
                async with asyncio.timeout(timeout):
                    frames = await dealer.recv_multipart()
            except TimeoutError:
                print(f"replay: no answer from {endpoint} within {timeout}s", file=sys.stderr)
                return
            try:
                topic, seq_b, payload = split_replay_reply(frames)
                if seq_b == END_SEQ:
                    return
                msg = Message(topic or "", decode_seq(seq_b), decode_payload(payload))
            except DecodeError as e:
                print(f"bad replay message: {e}", file=sys.stderr)
                continue
            printer.message(msg)
    finally:
        dealer.close(linger=0)


async def listen(args: argparse.Namespace, out: TextIO = sys.stdout) -> int:
    """Run `events listen` until --count events were printed (or forever)."""
    ctx = zmq.asyncio.Context()
    printer = Printer(out, args.count)
    sub = None
    try:
        if args.connect or args.bind:
            sub = ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.SUBSCRIBE, args.topic.encode())
            try:
                if args.bind:
                    sub.bind(args.bind)
                else:
                    sub.connect(args.connect)
            except zmq.ZMQError as e:
                print(f"cannot open {args.bind or args.connect}: {e}", file=sys.stderr)
                return 2
        if args.replay_from is not None:
            await replay(ctx, args.replay_endpoint, args.replay_from, printer, args.timeout)
        while sub is not None and not printer.done:
            frames = await sub.recv_multipart()
            try:
                msg = decode_message(frames)
            except DecodeError as e:
                print(f"bad message: {e}", file=sys.stderr)
                continue
            printer.message(msg)
        return 0
    finally:
        if sub is not None:
            sub.close(linger=0)
        ctx.destroy(linger=0)  # never blocks on a socket a cancelled task left open


def register(subparsers: Any) -> None:
    """Add `kv-scorer events listen`."""
    p = subparsers.add_parser("events", help="KV-event tools (listen to a worker's stream)")
    sub = p.add_subparsers(dest="events_command", metavar="ACTION", required=True)
    lp = sub.add_parser("listen", help="print a worker's KV events as JSON lines")
    where = lp.add_mutually_exclusive_group()
    where.add_argument(
        "--connect", metavar="ENDPOINT", help="connect to a bound PUB (tcp://HOST:PORT)"
    )
    where.add_argument(
        "--bind", metavar="ENDPOINT", help="bind, for engines that connect (tcp://*:PORT)"
    )
    lp.add_argument("--topic", default="", help="topic prefix to subscribe to (default: all)")
    lp.add_argument("--count", type=int, default=0, help="stop after N events (0: never)")
    lp.add_argument(
        "--replay-from", type=int, metavar="SEQ", help="first replay the buffer from SEQ"
    )
    lp.add_argument("--replay-endpoint", metavar="ENDPOINT", help="the worker's replay ROUTER")
    lp.add_argument("--timeout", type=float, default=2.0, help="replay reply timeout (s)")
    lp.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Entry point of `kv-scorer events listen`."""
    if args.replay_from is not None and not args.replay_endpoint:
        print("--replay-from needs --replay-endpoint", file=sys.stderr)
        return 2
    if not (args.connect or args.bind or args.replay_from is not None):
        print("give --connect, --bind or --replay-from", file=sys.stderr)
        return 2
    with contextlib.suppress(KeyboardInterrupt):
        return asyncio.run(listen(args))
    return 130
