"""Where the rag workload's hit rate goes: `kv`'s placement against forced placements.

Replays the rag workload (8 workers, 1,000 blocks of 512 tokens) with the `kv` policy and
with fixed routings through the same simulated engines and caches (compare.py's
`_Follow`: each request sent to a given worker), and prints per routing the hit rate,
the imbalance, the (app, worker) pairs it opened and at which request, and the tokens of
the apps' system prompts computed again (one copy per pair):

- `pile`: every request of app i on worker i (what sglang-router's and vllm-router's
  `cache_aware` do end to end: their hit rate and imbalance are this routing's);
- `partition`: apps on disjoint groups of workers in proportion to their traffic (4 / 2 /
  2), sessions round robin within the group;
- `partition+passage`: the same, a session's worker chosen by its first passage (requests
  sharing the system prompt and first passage on one worker).

With `--rows RUN/requests/kv.jsonl` (an e2e run's joined rows) it prints the same for
the e2e run's own routing. Deterministic.

    .venv/bin/python bench/routing/rag_placement.py --max-requests 600 [--set shared_copy=4]
"""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path
from typing import Any

from kvscorer_tools.bench.compare import _Follow, _run_rows, e2e_rows, replay_rows
from kvscorer_tools.bench.replay import ReplaySettings, RequestKeys
from kvscorer_tools.bench.workloads import Workload, load_workload


def report(name: str, wl: Workload, app: list[int], rows: list[dict[str, Any]]) -> None:
    """Print one routing's hit rate, imbalance, pairs and system-prompt recompute."""
    total = sum(r.prompt_tokens for r in wl.requests)
    hit = sum(x["cached_tokens"] for x in rows) / total
    load: Counter[int] = Counter()
    first: dict[tuple[int, int], int] = {}
    sys_missed = 0
    for i, (r, x) in enumerate(zip(wl.requests, rows, strict=True)):
        load[x["worker"]] += r.prompt_tokens
        first.setdefault((app[i], x["worker"]), i)
        full = r.segments[0][1] // 512 * 512  # the system prompt's full blocks
        sys_missed += max(full - x["cached_tokens"], 0)
    imbalance = max(load.values()) / (sum(load.values()) / 8)
    print(
        f"{name:18s} hit {hit:.4f}  imbalance {imbalance:.2f}  (app, worker) pairs"
        f" {len(first):2d}, opened at requests {sorted(first.values())}; system-prompt"
        f" tokens computed again {sys_missed} ({sys_missed / total:.4f} of all)"
    )


def main() -> None:
    """CLI: see the module docstring."""
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--max-requests", type=int, default=600)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--set", action="append", default=[], help="kv OPTION=VALUE")
    ap.add_argument("--rows", type=Path, help="an e2e run's requests/kv.jsonl")
    args = ap.parse_args()
    opts: dict[str, Any] = {}
    for kv in args.set:
        k, v = kv.split("=", 1)
        opts[k] = float(v)
    wl = load_workload("rag", seed=args.seed).slice(args.max_requests, 1.0)
    keys = RequestKeys(wl, 512)
    st = ReplaySettings(capacity_blocks=1000, seed=0, policy_options={"kv": opts})
    apps = sorted({r.segments[0][0] for r in wl.requests})
    app = [apps.index(r.segments[0][0]) for r in wl.requests]

    def forced(assign: list[int]) -> list[dict[str, Any]]:
        return _run_rows(_Follow(wl, keys, "kv", st, workers=assign))

    report("kv", wl, app, replay_rows(wl, keys, "kv", st))
    report("pile", wl, app, forced(app))
    groups = {0: [0, 1, 2, 3], 1: [4, 5], 2: [6, 7]}
    for name, by_passage in (("partition", False), ("partition+passage", True)):
        sess: dict[str | None, int] = {}
        opened: Counter[int] = Counter()
        assign = []
        for i, r in enumerate(wl.requests):
            if r.session not in sess:
                g = groups[app[i]]
                n = r.segments[1][0] if by_passage else opened[app[i]]
                sess[r.session] = g[n % len(g)]
                opened[app[i]] += 1
            assign.append(sess[r.session])
        report(name, wl, app, forced(assign))
    if args.rows:
        got = e2e_rows(args.rows, wl)
        report("e2e run", wl, app, [x or {"worker": -1, "cached_tokens": 0} for x in got])


if __name__ == "__main__":
    main()
