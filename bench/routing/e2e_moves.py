"""Why a `kv` end-to-end run moved conversation turns off the worker holding their prefix.

Issue 13 ("Phantom prefill queues", docs/policy.md). Reads one e2e run of the Mooncake
conversation workload (`kv-scorer bench --mode e2e --policies kv --out OUT`) and the
scorer's `/debug/decisions`: the harness keeps them at the end of every run of a policy
(OUT/run/cap-N/decisions/kv/<n>.json, the scorer's log holding 10,000 decisions); DIR may
also hold answers polled during a run, e.g.

    while :; do curl -sf "http://127.0.0.1:ADMIN/debug/decisions?limit=200" \\
        -o "DIR/$(date +%s%N).json"; sleep 3; done

For each request continuing an earlier one by >= 2 hash ids (a conversation's next turn)
that went to another worker than its parent, it prints the decision's rows for the
previous worker and the winner (cached prefix the index showed, credit, the router's
prefill / decode blocks, cost, duplicate blocks, continuity) beside what the previous
worker's sim really had before its first token at that instant (its request log: arrival,
admission, first token), then a summary.

    .venv/bin/python bench/routing/e2e_moves.py --run OUT --capacity-blocks 5000 \\
        --decisions DIR
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

import yaml

from kvscorer_tools.bench.compare import e2e_rows, parents
from kvscorer_tools.bench.workloads import load_workload

BLOCK = 512


def load_decisions(folder: Path) -> list[dict[str, Any]]:
    """Every decision in the folder's JSON files (each a /debug/decisions answer), once."""
    by_id: dict[str, dict[str, Any]] = {}
    for f in sorted(folder.glob("*.json")):
        try:
            doc = json.loads(f.read_text())
        except ValueError:
            continue  # a read cut short by the run's end
        for d in doc.get("decisions", []):
            by_id[d["request_id"]] = d
    return sorted(by_id.values(), key=lambda d: d["at"])


def backlog(log: list[dict[str, Any]], t: float) -> tuple[float, int]:
    """Uncached blocks and requests a sim held before their first token at time t (its
    request log's clock), counting a started prefill as linearly done."""
    blocks, n = 0.0, 0
    for s in log:
        if s["arrival"] <= t < s["first"]:
            left = (s["prompt_tokens"] - s["cached_tokens"]) / BLOCK
            if t > s["admitted"]:
                left *= (s["first"] - t) / max(s["first"] - s["admitted"], 1e-9)
            blocks += left
            n += 1
    return blocks, n


def main() -> None:
    """CLI: see the module docstring."""
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--run", type=Path, required=True, help="the e2e run's --out")
    ap.add_argument("--capacity-blocks", type=int, default=1000)
    ap.add_argument("--decisions", type=Path, required=True)
    ap.add_argument("--max-requests", type=int, default=800)
    args = ap.parse_args()
    cap = args.run / "run" / f"cap-{args.capacity_blocks}"
    wl = load_workload("mooncake-conversation").slice(args.max_requests, 1.0)
    par = parents(wl)
    rows = e2e_rows(cap / "requests" / "kv.jsonl", wl)
    cfg = yaml.safe_load((cap / "scorer-kv.yaml").read_text())
    eps = [w["endpoint"] for w in cfg["pool"]["workers"]]
    sims = [
        [json.loads(x) for x in (cap / "requests" / f"sim{k}.jsonl").read_text().splitlines()]
        for k in range(len(eps))
    ]
    # Pair decisions with rows: same prompt length, in sending order.
    waiting: dict[int, list[int]] = defaultdict(list)
    for i in sorted((i for i, r in enumerate(rows) if r), key=lambda i: rows[i]["sent"]):  # type: ignore[index]
        waiting[rows[i]["prompt_tokens"]].append(i)  # type: ignore[index]
    decision: dict[int, dict[str, Any]] = {}
    for d in load_decisions(args.decisions):
        got = waiting.get(d["request_tokens"])
        if got:
            decision[got.pop(0)] = d
    # The decision's wall clock against the rows' monotonic one.
    offset = statistics.median(d["at"] - rows[i]["sent"] for i, d in decision.items())  # type: ignore[index]
    total = sum(r["prompt_tokens"] for r in rows if r)
    moved = lost = logged = index_ok = idle = continuity = 0
    router_pf = sim_pf = 0.0
    for i, r in enumerate(rows):
        j, n = par[i]
        if r is None or n < 2 or rows[j] is None:
            continue
        prev = rows[j]["worker"]  # type: ignore[index]
        if r["worker"] == prev:
            continue
        moved += 1
        shared = min(n * BLOCK, r["prompt_tokens"] - 1)
        lost += shared - min(r["cached_tokens"], shared)
        d = decision.get(i)
        print(f"request {i}: parent {j}, {n} shared blocks, cached {r['cached_tokens']} tokens")
        if d is None:
            continue
        logged += 1
        rows_by = {eps.index(c["endpoint"]): c for c in d["candidates"]}
        win = eps.index(d["endpoint"])
        pb, pn = backlog(sims[prev], d["at"] - offset)
        for k, tag in ((prev, "previous"), (win, "winner")):
            c, t = rows_by[k], rows_by[k].get("terms") or {}
            print(
                f"  {tag:8s} w{k}: cached {c['matched_blocks']} credit {c['credit']:.2f}"
                f" prefill {c['prefill_blocks']:.0f} decode {c['decode_blocks']:.0f}"
                f" cost {c['cost']:.0f} duplicate {c['duplicate_blocks']:.0f}"
                f" continuity {t.get('previous_turn')}"
            )
        print(f"  previous worker's sim: {pb:.0f} blocks, {pn} requests before first token")
        index_ok += rows_by[prev]["matched_blocks"] >= n - 1
        idle += pn == 0
        continuity += bool((rows_by[prev].get("terms") or {}).get("previous_turn"))
        router_pf += rows_by[prev]["prefill_blocks"]
        sim_pf += pb
    print(
        f"\nmoved {moved} turns, {lost} cached tokens lost ({lost / total:.4f} of hit rate);"
        f" logged {logged}: index held the prefix on the previous worker {index_ok},"
        f" previous worker with nothing before first token {idle}, continuity {continuity},"
        f" prefill blocks there: router {router_pf:.0f}, sims {sim_pf:.0f}"
    )


if __name__ == "__main__":
    main()
