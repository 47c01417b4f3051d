"""Where an option's hit rate went: per request, the cached tokens a replay found with
the default and with the option, sorted by what the option's decision saw.

Issue 13 (the step-sharing term). Replays `kv` twice on the same trace and seed (the
default, then `--set` options), pairs each request's cached tokens and classes every
difference over `--min-tokens` by: the request went to the same worker or another
(`same` / `moved`), what the conversation view called it with the option (`new` /
`continued`), and whether its previous worker still held its own context (`evicted`:
`continuity_evicted` applied, the index showed none of it). A loss in
`moved continued evicted` is a conversation whose context was evicted between its turns
*under the option*, while the default kept it: the option changed where other prompts
were written, not where this turn went.

    .venv/bin/python bench/routing/hit_diff.py --seed 1 --set kv.step_share=0
    .venv/bin/python bench/routing/hit_diff.py --max-requests 800 --set kv.conversation_spread=0
"""

from __future__ import annotations

import argparse
from collections import Counter
from typing import Any

import scorer.decisions as decisions
from kvscorer_tools.bench import replay as rp
from kvscorer_tools.bench.cli import parse_policy_options
from kvscorer_tools.bench.workloads import load_workload


class _Kept(decisions.DecisionLog):
    """A decision log that keeps every decision by request id (the director's own is a
    1,000-entry ring)."""

    def __init__(self) -> None:
        super().__init__(0)
        self.by_id: dict[str, Any] = {}

    def add(self, decision: Any) -> None:
        self.by_id[decision.request_id] = decision


def run(args: argparse.Namespace, sets: list[str]) -> tuple[Any, dict[str, Any]]:
    """One replay of `kv`: the finished replay and its decisions by request id."""
    wl = load_workload(args.workload)
    if args.max_requests:
        wl = wl.slice(args.max_requests, 1.0)
    st = rp.ReplaySettings(capacity_blocks=args.capacity_blocks, seed=args.seed)
    st.policy_options = parse_policy_options(None, sets)
    sim = rp._Replay(wl, rp.RequestKeys(wl, st.block_size), "kv", st)
    kept = sim.director.decisions = _Kept()
    res = sim.run()
    print(f"{sets or 'default'}: hit {res.hit_rate:.4f} TTFT p50 {res.ttft_p50_ms:.1f}")
    return sim, kept.by_id


def kind(d: Any) -> str:
    """`new` / `continued` (+ ` evicted`) as the decision's cost saw the request."""
    for row in d.candidates:
        if row.terms is not None:
            f = row.terms[0].fleet
            if f is None:
                return "-"
            return f"{f.conversation}{' evicted' if f.evicted else ''}"
    return "-"


def main() -> None:
    """CLI: see the module docstring."""
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--workload", default="mooncake-conversation")
    ap.add_argument("--max-requests", type=int, default=0, help="0: the whole trace")
    ap.add_argument("--capacity-blocks", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--set", action="append", default=[], help="kv.OPTION=VALUE")
    ap.add_argument("--min-tokens", type=int, default=2000)
    args = ap.parse_args()
    a, _ = run(args, [])
    b, db = run(args, args.set)
    lost: Counter[str] = Counter()
    won: Counter[str] = Counter()
    for ra, rb in zip(a.reqs, b.reqs, strict=True):
        ca = ra.progress.cached_tokens if ra.progress else 0
        cb = rb.progress.cached_tokens if rb.progress else 0
        if abs(cb - ca) <= args.min_tokens or rb.rid not in db:
            continue
        moved = (
            "same"
            if ra.worker is rb.worker
            or (ra.worker and rb.worker and ra.worker.endpoint == rb.worker.endpoint)
            else "moved"
        )
        (won if cb > ca else lost)[f"{moved} {kind(db[rb.rid])}"] += cb - ca
    print(f"cached tokens, option - default (differences over {args.min_tokens} tokens):")
    for k in sorted(set(lost) | set(won)):
        print(f"  {k:28s} lost {lost[k]:>10,}  won {won[k]:>10,}")
    print(f"  {'total':28s} lost {sum(lost.values()):>10,}  won {sum(won.values()):>10,}")


if __name__ == "__main__":
    main()
