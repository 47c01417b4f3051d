"""How long a big worker's purge, clear or release holds the event loop.

    .venv/bin/python bench/bench_index_purge.py [--entries 1000000] [--workers 8] [--pure]

One worker holds `--entries` blocks (its own, the worst case: every entry leaves), the
other workers a few each. On a running asyncio loop the worker is purged (restart, health
ejection), cleared (AllBlocksCleared) or released (left the pool); a ticker task records
the gaps between its loop turns until the index has cleared every old entry. Reported:
the call itself (ms), the longest and p99 gap between turns after it (ms: the longest time
anything else on the loop waited), and the wall time until the old entries are gone.
`in place` rows run the same purge/clear with the chunking off (RELEASE_CHUNK above the
worker's entries: the slot emptied in one piece, as before fresh-slot purges). Prints a
table, writes bench/out/index_purge.json.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import statistics
import sys
import time
from array import array
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scorer.index import BlockIndex, block_index
from scorer.native import NATIVE


def build(entries: int, workers: int, native: bool | None) -> BlockIndex:
    idx = BlockIndex(native=native)
    step = 10_000
    for lo in range(0, entries, step):
        hi = min(entries, lo + step)
        # Packed keys on the compiled path, as the event applier hands them over.
        ks = array("Q", range(10**9 + lo, 10**9 + hi))
        eks = array("Q", range(lo + 1, hi + 1))
        idx.add("big", 0, eks, ks)
    for w in range(workers - 1):
        idx.add(f"w{w}", 0, [1, 2], [5, 6])
    return idx


async def measure(idx: BlockIndex, op: str) -> dict[str, float]:
    gaps: list[float] = []
    t0 = time.perf_counter()
    getattr(idx, op)("big")
    call = time.perf_counter() - t0
    last = time.perf_counter()
    for _ in range(10_000_000):  # bounded; ends when the old entries are gone
        if not idx._leaving:
            break
        await asyncio.sleep(0)
        now = time.perf_counter()
        gaps.append(now - last)
        last = now
    total = time.perf_counter() - t0
    gaps.sort()
    return {
        "call_ms": call * 1e3,
        "max_gap_ms": (gaps[-1] if gaps else 0.0) * 1e3,
        "p99_gap_ms": (gaps[int(0.99 * (len(gaps) - 1))] if gaps else 0.0) * 1e3,
        "turns": len(gaps),
        "done_ms": total * 1e3,
        "median_gap_ms": (statistics.median(gaps) if gaps else 0.0) * 1e3,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--entries", type=int, default=1_000_000)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--pure", action="store_true", help="the pure-Python reference code")
    ap.add_argument("--out", default=str(Path(__file__).parent / "out" / "index_purge.json"))
    args = ap.parse_args()
    native = False if args.pure else None
    impl = "compiled" if NATIVE is not None and not args.pure else "pure"
    chunk = block_index.RELEASE_CHUNK
    rows: list[dict[str, Any]] = []
    cases = [("purge", True), ("purge", False), ("clear", False), ("release", False)]
    print(f"{args.entries:,} entries of one worker, {args.workers} workers, {impl}")
    head = ("op", "call ms", "max gap", "p99 gap", "turns", "done ms", "median gap")
    print("{:>16} {:>8} {:>8} {:>8} {:>6} {:>8} {:>10}".format(*head))
    for op, in_place in cases:
        idx = build(args.entries, args.workers, native)
        gc.collect()
        block_index.RELEASE_CHUNK = args.entries + 1 if in_place else chunk
        try:
            r = asyncio.run(measure(idx, op))
        finally:
            block_index.RELEASE_CHUNK = chunk
        assert idx.total_entries() == 2 * (args.workers - 1)
        name = f"{op} (in place)" if in_place else op
        rows.append({"op": name, "impl": impl, "entries": args.entries, **r})
        print(
            f"{name:>16} {r['call_ms']:8.1f} {r['max_gap_ms']:8.1f} {r['p99_gap_ms']:8.1f}"
            f" {r['turns']:6d} {r['done_ms']:8.1f} {r['median_gap_ms']:10.1f}"
        )
        del idx
    print("gap: time between two turns of another task on the loop while the entries leave")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"entries": args.entries, "rows": rows}, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
