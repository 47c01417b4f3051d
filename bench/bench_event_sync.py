"""A scorer started next to a fleet whose replay buffers hold earlier runs' history.

    .venv/bin/python bench/bench_event_sync.py [--workers 8] [--batches 1400] [--run 100]

What the e2e routing benchmark does to a scorer (issue 13): the same `kv-scorer sim`
workers serve policy after policy, with `POST /reset_prefix_cache` (an `AllBlocksCleared`)
between runs, and vLLM never empties its replay buffer (vllm/distributed/kv_events.py
`ZmqEventPublisher`: a `deque(maxlen=buffer_steps)`). So each new scorer's sync on
connection (scorer.events.subscriber `_sync`) reads every earlier run's batches.

Here `--workers` simulated publishers (kvscorer_tools.sim.kvevents.KVEventPublisher, in a
child process, as the sims are) each hold `--batches` batches: every `--run`-th an
`AllBlocksCleared` (a reset), the others 7 `BlockRemoved` and a 15-block `BlockStored` of
512-token blocks (a prefill step of the Mooncake e2e run). One subscriber per worker
connects (one shared index, as EventIngest) and a ticker task measures the longest time
the event loop was held. Prints and writes bench/out/event_sync.json: time until every
sync is over, the longest loop stall, the syncs' outcomes, the batches they applied and
skipped, and the `AllBlocksCleared` / `BlockRemoved` reaching the index (an earlier run's).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import zmq.asyncio

from scorer.blocks import BlockHasher
from scorer.config import EventsConfig, EventsEndpointConfig, IndexConfig
from scorer.events.apply import Applier
from scorer.events.subscriber import Subscriber
from scorer.index import BlockIndex


async def _serve(workers: int, batches: int, run: int) -> None:
    """The child: publishers with full buffers; prints their addresses, waits for stdin."""
    from kvscorer_tools.sim.kvevents import (
        KVEventPublisher,
        all_blocks_cleared,
        block_removed,
        block_stored,
    )

    rng = random.Random(0)
    pubs = []
    for _ in range(workers):
        p = KVEventPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", mode="bind")
        await p.start()
        for i in range(batches):
            if i % run == 0:
                p.publish([all_blocks_cleared("map")])
                continue
            tokens = [rng.randrange(1000, 30000) for _ in range(512 * 15)]
            hashes = [rng.getrandbits(63) for _ in range(15)]
            removed = [block_removed("map", [rng.getrandbits(63)]) for _ in range(7)]
            p.publish([*removed, block_stored("map", hashes, None, tokens, 512)])
        pubs.append(p)
    print(json.dumps([[p.bound_endpoint, p.bound_replay_endpoint] for p in pubs]), flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    for p in pubs:
        await p.stop()


async def measure(workers: int, batches: int, run: int) -> dict[str, Any]:
    child = subprocess.Popen(
        [sys.executable, __file__, "--serve", str(workers), str(batches), str(run)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    ctx = zmq.asyncio.Context()
    subs: list[Subscriber] = []
    try:
        assert child.stdout is not None
        addresses = json.loads(child.stdout.readline())
        index = BlockIndex(IndexConfig())
        applier = Applier(index, BlockHasher(512))
        longest = 0.0
        done = False

        async def ticker() -> None:
            nonlocal longest
            last = time.perf_counter()
            while not done:
                await asyncio.sleep(0)
                now = time.perf_counter()
                longest = max(longest, now - last)
                last = now

        tick = asyncio.create_task(ticker())
        began = time.perf_counter()
        for i, (ep, replay) in enumerate(addresses):
            ev = EventsEndpointConfig(endpoint=ep, replay_endpoint=replay)
            sub = Subscriber(f"w{i}", ev, applier, EventsConfig(), ctx)
            await sub.start()
            subs.append(sub)
        deadline = began + 120.0
        # A sync's outcome is counted once it is over (applied included).
        while sum(sum(s.stats.syncs.values()) for s in subs) < workers:
            if time.perf_counter() > deadline:
                raise RuntimeError("syncs not over after 120 s")
            await asyncio.sleep(0.01)
        took = time.perf_counter() - began
        done = True
        await tick
        outcomes: dict[str, int] = {}
        for s in subs:
            for k, v in s.stats.syncs.items():
                outcomes[k] = outcomes.get(k, 0) + v
        return {
            "workers": workers,
            "batches": batches,
            "run": run,
            "syncs_s": round(took, 3),
            "longest_loop_stall_ms": round(longest * 1000, 1),
            "sync_outcomes": outcomes,
            "applied_batches": sum(s.stats.warm_messages for s in subs),
            "skipped_batches": sum(getattr(s.stats, "sync_skipped", 0) for s in subs),
            "cleared_applied": sum(a.cleared for a in applier.stats.values()),
            "removed_applied": sum(a.removed + a.unknown_hash for a in applier.stats.values()),
        }
    finally:
        for s in subs:
            await s.stop()
        ctx.destroy(linger=0)
        if child.stdin is not None:
            child.stdin.close()
        try:
            child.wait(10)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


def main() -> int:
    if len(sys.argv) == 5 and sys.argv[1] == "--serve":
        asyncio.run(_serve(*(int(x) for x in sys.argv[2:])))
        return 0
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--batches", type=int, default=1400, help="batches in each buffer")
    ap.add_argument("--run", type=int, default=100, help="batches per run (a clear each)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "out" / "event_sync.json"))
    a = ap.parse_args()
    got = asyncio.run(measure(a.workers, a.batches, a.run))
    for k, v in got.items():
        print(f"{k:24s} {v}")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(got, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
