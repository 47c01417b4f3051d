"""How much of a worker's cache a scorer learns from the replay buffer alone (warm start).

    .venv/bin/python bench/bench_replay_coverage.py [--capacity 20000 100000] [--requests 20000]

vLLM keeps the last `buffer_steps` published batches for replay (`KVEventsConfig.
buffer_steps`, default 10,000, vllm/config/kv_events.py; the publisher's
`deque(maxlen=buffer_steps)` in vllm/distributed/kv_events.py `ZmqEventPublisher`). A scorer
started next to a warm worker asks for all of it (scorer.events.subscriber `_sync`) and
rebuilds what those batches stored and did not remove since. Blocks stored before the
window and still cached are not learned (the safe side: under-prediction, never a block
the worker does not hold).

Model: the simulator's paged prefix cache (kvscorer_tools.sim.cache.PrefixCache, LRU of
freed blocks) of `--capacity` blocks; requests = one of 16 shared system prefixes (32
blocks) + 8-64 unique blocks; each request publishes `b` batches (its prefill batch with
stored + evicted blocks, then b-1 batches of the decode steps it shares with other running
requests). Coverage = cached blocks the replayed window reconstructs / cached blocks, per
buffer size and b. The shared prefixes are stored once and then only hit (a hit publishes
nothing), so once they are older than the window no replay brings them back. Prints a
table, writes bench/out/replay_coverage.json.
"""

from __future__ import annotations

import argparse
import json
import random
from collections import deque
from pathlib import Path
from typing import Any

from kvscorer_tools.sim.cache import PrefixCache

Batch = tuple[list[int], list[int]]  # (stored, removed)


def run(capacity: int, requests: int, batches_per_request: int, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    cache = PrefixCache(capacity, 16)
    evicted: list[int] = []
    cache.on_evict = evicted.extend
    log: deque[Batch] = deque(maxlen=100_000)  # longest window measured
    next_id = 1 << 40
    prefixes = [[p * 1000 + i for i in range(32)] for p in range(16)]
    for _ in range(requests):
        n_unique = rng.randint(8, 64)
        hashes = prefixes[rng.randrange(16)] + list(range(next_id, next_id + n_unique))
        next_id += n_unique
        evicted.clear()
        stored = cache.admit(hashes)
        log.append((stored, list(evicted)))
        for _ in range(batches_per_request - 1):
            log.append(([], []))  # decode steps: events of other requests, none of ours
        cache.release(hashes)
    cached = set(cache.cached_hashes())
    out: dict[str, Any] = {
        "capacity_blocks": capacity,
        "requests": requests,
        "batches_per_request": batches_per_request,
        "cached_blocks": len(cached),
        "coverage": {},
    }
    for window in (1_000, 10_000, 100_000):
        known: set[int] = set()
        for stored, removed in list(log)[-window:]:
            known.difference_update(removed)
            known.update(stored)
        learned = known & cached
        out["coverage"][str(window)] = {
            "learned_blocks": len(learned),
            "fraction": round(len(learned) / max(len(cached), 1), 4),
            "not_cached": len(known - cached),  # must stay 0: replay never over-predicts
        }
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--capacity", type=int, nargs="+", default=[20_000, 100_000])
    ap.add_argument("--requests", type=int, default=20_000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", default=str(Path(__file__).parent / "out" / "replay_coverage.json"))
    a = ap.parse_args()
    rows = [run(c, a.requests, b, a.seed) for c in a.capacity for b in (1, 4, 16)]
    print(f"{'batches/req':>11} {'cached':>8}  coverage by replay buffer (batches)")
    print(f"{'':>11} {'':>8}  {'1,000':>8} {'10,000':>8} {'100,000':>8}  (not cached)")
    for r in rows:
        cov = r["coverage"]
        fr = " ".join(f"{cov[w]['fraction']:>8.1%}" for w in ("1000", "10000", "100000"))
        bad = sum(cov[w]["not_cached"] for w in cov)
        print(f"{r['batches_per_request']:>11} {r['cached_blocks']:>8}  {fr}  ({bad})")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(rows, indent=2))
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
