"""Our policies against the models of the peers in the replay, over capacities and seeds.

Issue 13 (routing quality): is there a routing reason for `kv`'s end-to-end TTFT gap to
vllm-router `kv_aware`? The replay runs `kv`, `approx`, `round_robin` and the peer models
(`model:vllm_kv_aware`, `model:cache_aware`: tools/kvscorer_tools/bench/peer_models.py)
on the same simulated fleet, one process, one policy at a time, and prints hit rate, TTFT
p50 / p99, queue and prefill p50, imbalance per (capacity, seed, policy). `--seed` seeds
the workload as `kv-scorer bench --seed` does (Mooncake: the trace is the trace, only
the policies' random tie-breaks change; the generated workloads are drawn again).

    .venv/bin/python bench/routing/peer_compare.py --max-requests 800 \
        --capacities 500,1000,5000 --seeds 0,1,2 --out bench/out/peers-mooncake-800.json
    .venv/bin/python bench/routing/peer_compare.py --workload rag --max-requests 600
    .venv/bin/python bench/routing/peer_compare.py --max-requests 800 \
        --policies 'kv,model:vllm_kv_aware{min_match_blocks=1,tie=least_loaded}'

A policy followed by `{OPTION=VALUE,...}` runs with those options on top of `--set`.
`--table FILE...` prints `--out` files as markdown (min-max over the seeds).

Arrivals are the trace's (time scale 1): the e2e run's `--time-scale 5` speeds up the
arrivals *and* the simulated engines, so in model time it is this replay.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import yaml

from kvscorer_tools.bench import replay as rp
from kvscorer_tools.bench.cli import parse_policy_options
from kvscorer_tools.bench.workloads import load_workload

DEFAULT = "kv,approx,round_robin,model:vllm_kv_aware,model:cache_aware"
KEYS = ("hit_rate", "ttft_p50_ms", "ttft_p99_ms", "queue_p50_ms", "prefill_p50_ms", "imbalance")


def split_policies(text: str) -> list[str]:
    """`a,b{x=1,y=2},c` → ["a", "b{x=1,y=2}", "c"]: a policy with options of its own
    (a variant run beside the default) in braces."""
    out: list[str] = []
    depth = 0
    cur = ""
    for ch in text:
        if ch == "," and depth == 0:
            out.append(cur)
            cur = ""
            continue
        depth += (ch == "{") - (ch == "}")
        cur += ch
    out.append(cur)
    return [p.strip() for p in out if p.strip()]


def _span(xs: list[float], fmt: str) -> str:
    lo, hi = min(xs), max(xs)
    return format(lo, fmt) if format(lo, fmt) == format(hi, fmt) else f"{lo:{fmt}}-{hi:{fmt}}"


def table(paths: list[Path]) -> str:
    """Markdown rows from `--out` files: per (workload, capacity, policy), hit / TTFT p50
    / p99 / queue p50 / prefill p50 / imbalance, as min-max over the seeds."""
    rows: dict[tuple[str, int, str], list[dict[str, Any]]] = {}
    for path in paths:
        doc = json.loads(path.read_text())
        n = doc.get("max_requests") or "all"
        for e in doc["entries"]:
            rows.setdefault((f"{e['workload']} ({n})", e["capacity"], e["policy"]), []).append(e)
    out = [
        "| workload (requests) | blocks | policy | seeds | hit | TTFT p50 | p99 | queue p50 "
        "| prefill p50 | imbalance |",
        "| --- | ---: | --- | ---: | --- | --- | --- | --- | --- | --- |",
    ]
    fmts = (".4f", ".1f", ".0f", ".1f", ".1f", ".2f")
    for (wl, cap, pol), es in rows.items():
        cells = [_span([e[k] for e in es], f) for k, f in zip(KEYS, fmts, strict=True)]
        out.append(f"| {wl} | {cap} | `{pol}` | {len(es)} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def main() -> None:
    """CLI: see the module docstring."""
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--table", type=Path, nargs="+", help="print --out files as markdown")
    ap.add_argument("--workload", default="mooncake-conversation")
    ap.add_argument("--max-requests", type=int, default=0, help="0: the whole workload")
    ap.add_argument("--capacities", default="1000", help="blocks per worker, comma list")
    ap.add_argument("--seeds", default="0", help="comma list")
    ap.add_argument("--policies", default=DEFAULT)
    ap.add_argument("--param", action="append", default=[], help="workload KEY=VALUE")
    ap.add_argument("--set", action="append", default=[], help="POLICY.OPTION=VALUE")
    ap.add_argument("--out", type=Path, help="write every entry as JSON here")
    ap.add_argument(
        "--router-time-scale", type=float, default=1.0,
        help="the router's clock as an e2e run at --time-scale X has it (ReplaySettings)",
    )  # fmt: skip
    ap.add_argument(
        "--per-worker", action="store_true",
        help="also print each worker's requests and median TTFT",
    )  # fmt: skip
    ap.add_argument(
        "--lean-view", action="store_true",
        help="the router sees no response: prefill ends by the scrape's counters or estimate",
    )  # fmt: skip
    args = ap.parse_args()
    if args.table:
        print(table(args.table))
        return
    from kvscorer_tools.bench.cli import parse_params

    params = parse_params(args.param)
    options = parse_policy_options(None, args.set)
    policies = split_policies(args.policies)
    out: list[dict[str, Any]] = []
    print(
        f"{'cap':>5} {'seed':>4} {'policy':<28} {'hit':>6} {'p50':>6} {'p99':>6} "
        f"{'queue50':>7} {'prefill50':>9} {'imbal':>5}"
    )
    for seed in (int(s) for s in args.seeds.split(",")):
        wl = load_workload(args.workload, seed=seed, **params)
        if args.max_requests:
            wl = wl.slice(args.max_requests, 1.0)
        keys = rp.RequestKeys(wl, 512)
        for cap in (int(c) for c in args.capacities.split(",")):
            for label in policies:
                p, _, extra = label.partition("{")
                st = rp.ReplaySettings(
                    capacity_blocks=cap or None, seed=seed,
                    router_time_scale=args.router_time_scale, lean_view=args.lean_view,
                )  # fmt: skip
                st.policy_options = {k: dict(v) for k, v in options.items()}
                for kv in filter(None, extra.rstrip("}").split(",")):
                    opt, _, val = kv.partition("=")
                    st.policy_options.setdefault(p, {})[opt] = yaml.safe_load(val)
                sim = rp._Replay(wl, keys, p, st)
                r = sim.run().as_dict()
                r.pop("reasons", None)
                r.pop("prompt_tokens_per_worker", None)
                out.append({"workload": args.workload, "capacity": cap, "seed": seed,
                            "policy": label, **r})  # fmt: skip
                print(
                    f"{cap:>5} {seed:>4} {label:<28} {r['hit_rate']:>6.4f} "
                    f"{r['ttft_p50_ms']:>6.1f} {r['ttft_p99_ms']:>6.0f} {r['queue_p50_ms']:>7.1f} "
                    f"{r['prefill_p50_ms']:>9.1f} {r['imbalance']:>5.2f}",
                    flush=True,
                )
                if args.per_worker:
                    by: dict[str, list[float]] = {e: [] for e in sim.workers}
                    for q in sim.reqs:
                        if q.worker is not None and q.first >= 0:
                            by[q.worker.endpoint].append((q.first - q.arrival) * 1000.0)
                    print(
                        f"{'':40} requests {[len(v) for v in by.values()]} median TTFT "
                        f"{[round(rp.percentile(v, 50)) for v in by.values()]}"
                    )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        doc = {"workload": args.workload, "max_requests": args.max_requests,
               "params": params, "set": args.set, "entries": out,
               "router_time_scale": args.router_time_scale,
               "lean_view": args.lean_view}  # fmt: skip
        args.out.write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
