"""How low any router's TTFT p99 can go on a workload: the no-queue, perfect-cache floor.

Issue 13 asks for TTFT p99 <= 0.8x round robin's on the Mooncake conversation trace. A
request's TTFT can never be shorter than its uncached prompt prefilled alone on an idle
worker: no request queued ahead, no other prompt's chunks in its steps, the budget-sized
chunks of vLLM's chunked prefill through the sims' step time (`kvscorer_tools.sim.timing`),
split into the number of steps that costs least (the step time is convex with a fixed part,
so a few smaller chunks can cost less than budget-sized ones; any step the request shares
costs more than its own chunk alone). And its uncached prompt can never be shorter than with an
unbounded cache that every earlier request filled (the oracle's hit: its leading blocks
seen before, in arrival order). Each request's pair of those gives a TTFT no router can
beat; their p99 is the floor of every router's p99. This prints that floor beside the
replay's p99 for the policies asked (same workload, same simulated fleet) and the floor as
a share of round robin's p99: when that share is above 0.8, the target is out of reach
for any router on that workload, whatever the capacity.

    .venv/bin/python bench/routing/p99_floor.py [--workload mooncake-conversation]
        [--max-requests 800] [--capacity-blocks 500,1000,5000] [--policies kv,round_robin]

Writes bench/out/p99_floor.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from prefill_share import BUDGET, pct  # noqa: E402

from kvscorer_tools.sim.timing import DEFAULT_TIMING  # noqa: E402


def least_prefill_ms(uncached: int, budget: int = BUDGET) -> float:
    """Model ms no schedule can beat for `uncached` prompt tokens: the cheapest split into
    k >= ceil(uncached / budget) steps, relaxed to equal real-valued chunks (for a fixed
    k, equal chunks minimise the sum of a*x^2; sharing a step only adds tokens to it)."""
    t = DEFAULT_TIMING
    u = float(max(uncached, 1))
    k0 = -(-int(u) // budget)
    # a*u^2/k + k*c is convex in k: walk up from the budget's k while it falls.
    best = t.prefill_a * u * u / k0 + t.prefill_b * u + k0 * t.prefill_c
    k = k0 + 1
    while True:
        cost = t.prefill_a * u * u / k + t.prefill_b * u + k * t.prefill_c
        if cost >= best:
            return best
        best, k = cost, k + 1


def floor_ms(wl: Any, keys: Any, block_size: int) -> list[float]:
    """Per request (arrival order): its prompt's uncached part after the oracle's hit,
    prefilled alone in the cheapest split into steps, in model ms."""
    from kvscorer_tools.bench.replay import oracle_leading_blocks

    # vLLM computes at least the prompt's last token even on a full hit.
    return [
        least_prefill_ms(max(r.prompt_tokens - k * block_size, 1))
        for r, k in zip(wl.requests, oracle_leading_blocks(keys), strict=True)
    ]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--workload", default="mooncake-conversation")
    ap.add_argument("--max-requests", type=int, default=800)
    ap.add_argument("--capacity-blocks", default="500,1000,5000")
    ap.add_argument("--policies", default="kv,round_robin")
    ap.add_argument("--out", default=str(ROOT / "bench" / "out" / "p99_floor.json"))
    args = ap.parse_args()

    from kvscorer_tools.bench import replay as rp
    from kvscorer_tools.bench.workloads import load_workload

    wl = load_workload(args.workload)
    if args.max_requests:
        wl = wl.slice(args.max_requests, 1.0)
    settings = rp.ReplaySettings()
    keys = rp.RequestKeys(wl, settings.block_size)
    floor = floor_ms(wl, keys, settings.block_size)
    doc: dict[str, Any] = {
        "benchmark": "p99_floor",
        "workload": args.workload,
        "requests": len(floor),
        "floor_p50_ms": round(pct(floor, 0.5), 1),
        "floor_p99_ms": round(pct(floor, 0.99), 1),
        "capacities": {},
    }
    print(
        f"{args.workload}, {len(floor)} requests: floor (no queue, unbounded cache) "
        f"p50 {doc['floor_p50_ms']:,.0f} ms, p99 {doc['floor_p99_ms']:,.0f} ms"
    )
    for cap in (int(c) for c in args.capacity_blocks.split(",")):
        st = rp.ReplaySettings(capacity_blocks=cap)
        row: dict[str, Any] = {}
        for pol in args.policies.split(","):
            res = rp.run_replay(wl, pol, st, keys)
            row[pol] = {
                "ttft_p50_ms": round(res.ttft_p50_ms, 1),
                "ttft_p99_ms": round(res.ttft_p99_ms, 1),
            }
        rr = row.get("round_robin", {}).get("ttft_p99_ms")
        if rr:
            row["floor_over_round_robin_p99"] = round(doc["floor_p99_ms"] / rr, 3)
        doc["capacities"][str(cap)] = row
        cells = "  ".join(
            f"{p} p99 {v['ttft_p99_ms']:,.0f}" for p, v in row.items() if isinstance(v, dict)
        )
        share = f"  floor / round robin p99 = {row['floor_over_round_robin_p99']:.2f}" if rr else ""
        print(f"  {cap:>5} blocks: {cells}{share}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
