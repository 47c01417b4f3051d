"""`kv-scorer sim`: run one simulated vLLM worker until SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
from typing import Any

from kvscorer_tools.sim.config import SimConfig
from kvscorer_tools.sim.worker import SimWorker


def register(subparsers: Any) -> None:
    """Add the `sim` subcommand."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "sim",
        help="run a simulated vLLM worker (OpenAI API, prefix cache, KV events)",
        description="A stand-in for a vLLM server: OpenAI-compatible API, a paged prefix "
        "cache, KV events over ZMQ in vLLM's wire format, vLLM metrics, and a timing model.",
    )
    d = SimConfig()
    p.add_argument("--host", default=d.host, help="HTTP listen address (default %(default)s)")
    p.add_argument(
        "--port", type=int, default=d.port, help="HTTP port, 0 = any (default %(default)s)"
    )
    p.add_argument("--model", default=d.model, help="served model name (default %(default)s)")
    p.add_argument(
        "--lora",
        action="append",
        default=[],
        metavar="NAME",
        help="also serve a LoRA adapter under this model name (repeatable)",
    )
    p.add_argument("--block-size", type=int, default=d.block_size, help="tokens per KV block")
    p.add_argument(
        "--capacity-blocks",
        type=int,
        default=d.capacity_blocks,
        help="KV pool size in blocks (default %(default)s)",
    )
    p.add_argument(
        "--max-num-seqs",
        type=int,
        default=d.max_num_seqs,
        help="max running requests; more wait in a FIFO queue",
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=d.max_num_batched_tokens,
        help="token budget of an engine step (decodes and prompt chunks; vLLM's chunked "
        "prefill splits a longer prompt over several steps)",
    )
    p.add_argument(
        "--long-prefill-token-threshold",
        type=int,
        default=d.long_prefill_token_threshold,
        help="most prompt tokens one request takes per step (0, the default: no cap)",
    )
    p.add_argument("--max-model-len", type=int, default=d.max_model_len)
    p.add_argument(
        "--speed",
        type=float,
        default=d.speed,
        help="run this many times faster than the modelled GPU (default 1)",
    )
    p.add_argument(
        "--stream-interval",
        type=int,
        default=d.stream_interval,
        help="run up to N decode-only steps per wake-up and send their tokens as one SSE "
        "chunk per stream (first token always alone; default 1: one chunk per token)",
    )
    p.add_argument("--seed", type=int, default=d.seed, help="seed of generated tokens and ids")
    p.add_argument(
        "--kv-events",
        default=None,
        metavar="ENDPOINT",
        help="ZMQ PUB endpoint for KV events, e.g. tcp://*:5557 (vLLM binds on *, "
        "connects otherwise)",
    )
    p.add_argument("--kv-events-mode", choices=["auto", "bind", "connect"], default="auto")
    p.add_argument(
        "--replay",
        default=None,
        metavar="ENDPOINT",
        help="ZMQ ROUTER replay endpoint, e.g. tcp://*:5558",
    )
    p.add_argument(
        "--era",
        choices=["map", "array"],
        default=d.era,
        help="event encoding: map (vLLM >= 0.24) or array (<= 0.23)",
    )
    p.add_argument(
        "--replay-layout",
        choices=["topic", "legacy"],
        default=d.replay_layout,
        help="replay replies [b'', topic, seq, payload] (>= 0.26) or [b'', seq, payload] (legacy)",
    )
    p.add_argument("--topic", default=d.topic, help="ZMQ topic of KV events (default empty)")
    p.add_argument(
        "--tokenizer",
        default=None,
        metavar="PATH",
        help="tokenizer.json (or its directory); default: synthetic word-hash ids",
    )
    p.add_argument("--default-max-tokens", type=int, default=d.default_max_tokens)
    p.add_argument(
        "--request-log",
        default=None,
        metavar="FILE",
        help="append one JSON line per request at its first token (arrival, admission and "
        "first-token times on the monotonic clock, queue ahead, cached tokens)",
    )
    p.add_argument("--log-level", default="WARNING")
    p.set_defaults(func=run)


def config_from_args(args: argparse.Namespace) -> SimConfig:
    """SimConfig from parsed flags; raises ValueError on a bad combination."""
    for name in (
        "block_size",
        "capacity_blocks",
        "max_num_seqs",
        "max_num_batched_tokens",
        "max_model_len",
        "default_max_tokens",
    ):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    if args.long_prefill_token_threshold < 0:
        raise ValueError("--long-prefill-token-threshold must be >= 0")
    if not args.speed > 0:
        raise ValueError("--speed must be > 0")
    if args.stream_interval < 1:
        raise ValueError("--stream-interval must be >= 1")
    return SimConfig(
        host=args.host,
        port=args.port,
        model=args.model,
        loras=tuple(args.lora),
        block_size=args.block_size,
        capacity_blocks=args.capacity_blocks,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        max_model_len=args.max_model_len,
        speed=args.speed,
        seed=args.seed,
        stream_interval=args.stream_interval,
        kv_events=args.kv_events,
        request_log=args.request_log,
        kv_events_mode=args.kv_events_mode,
        replay=args.replay,
        era=args.era,
        replay_layout=args.replay_layout,
        topic=args.topic,
        tokenizer=args.tokenizer,
        default_max_tokens=args.default_max_tokens,
    )


async def serve(config: SimConfig) -> None:
    """Run a worker until SIGTERM or SIGINT, then stop it cleanly."""
    worker = SimWorker(config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await worker.start()
        print(worker.describe(), flush=True)
        await stop.wait()
    finally:
        await worker.stop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(Exception):
                loop.remove_signal_handler(sig)


def run(args: argparse.Namespace) -> int:
    """Entry point of `kv-scorer sim`."""
    logging.basicConfig(
        level=str(args.log_level).upper(), format="%(levelname)s %(name)s: %(message)s"
    )
    try:
        config = config_from_args(args)
        asyncio.run(serve(config))
    except (ValueError, OSError) as e:
        print(f"kv-scorer sim: {e}", file=sys.stderr)
        return 2
    return 0
