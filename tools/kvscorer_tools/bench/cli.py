"""`kv-scorer bench`: the routing-quality benchmark (replay or end-to-end).

    kv-scorer bench --workload mooncake-conversation --mode replay --out bench/out/routing
    kv-scorer bench --workload mooncake-conversation --mode e2e --time-scale 20 \\
        --max-requests 300 --out bench/out/routing-e2e

Writes DIR/results.json ({"workload", "settings", "policies": {NAME: {...}}}), DIR/*.png,
and prints a table. Every flag is recorded under "settings".
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from kvscorer_tools.bench import report
from kvscorer_tools.bench.workloads import WORKLOADS, Workload, load_workload, oracle_block_hit_rate

REPLAY_DEFAULT = "kv,approx,round_robin,least_loaded"
# Ours, then the peers (kvscorer_tools.bench.e2e.settings.ROUTING_PEERS).
E2E_DEFAULT = (
    "kv,approx,round_robin,sglang_cache_aware,vllm_router_cache_aware,vllm_router_kv_aware"
)
SWEEP_CAPACITIES: list[int | None] = [500, 1000, 5000, None]  # None = unbounded
# End to end the sweep is the three capacities (unbounded would take the longest
# and says least: every router converges to the oracle there).
E2E_SWEEP_CAPACITIES: list[int | None] = [500, 1000, 5000]
# The figures the capacity sweep keeps per policy and capacity (issue 13's targets:
# hit rate, TTFT p50 and p99, imbalance at every capacity).
SWEEP_KEYS = ("hit_rate", "ttft_p50_ms", "ttft_p99_ms", "imbalance")


def _positive_int(text: str) -> int:
    """An int ≥ 1 (argparse type)."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def register(subparsers: Any) -> None:
    """Add `kv-scorer bench`."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "bench",
        help="routing benchmark: policies vs peers vs the oracle (replay or end-to-end)",
        description=(
            "Routing-quality benchmark. --mode replay: a deterministic discrete-event "
            "replay of our policies against simulated workers (whole traces in minutes). "
            "--mode e2e: real traffic through Envoy, the scorer and `kv-scorer sim` "
            "workers, plus peer routers when installed (pip install -e './tools[peers]')."
        ),
    )
    p.add_argument(
        "--workload",
        default=None,
        choices=sorted(WORKLOADS),
        help="named workload (default mooncake-conversation; trace = --trace FILE)",
    )
    p.add_argument(
        "--trace",
        default=None,
        metavar="FILE",
        help="replay your own trace in the Mooncake format (JSON lines: timestamp ms, "
        "input_length, output_length, hash_ids, optional block_tokens and session_id); "
        "implies --workload trace",
    )
    p.add_argument("--mode", default="replay", choices=["replay", "e2e"])
    p.add_argument("--out", default="bench/out/routing", help="output directory")
    p.add_argument("--workers", type=int, default=8, help="simulated workers (default 8)")
    p.add_argument(
        "--capacity-blocks",
        type=int,
        default=1000,
        help="KV capacity per worker in --block-size blocks; 0 = unbounded (default 1000)",
    )
    p.add_argument("--block-size", type=int, default=512, help="tokens per KV block (512)")
    p.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="divide arrival times by this (e2e: also the sims' --speed); default 1",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--policies",
        default=None,
        help=f"comma list (replay: {REPLAY_DEFAULT}; e2e: {E2E_DEFAULT}); peers (e2e only): "
        "sglang_cache_aware, sglang_round_robin, vllm_router_cache_aware, "
        "vllm_router_kv_aware, vllm_router_round_robin; models of the peers (replay only): "
        "model:vllm_kv_aware, model:cache_aware",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="e2e: run every policy N times, interleaved (A B C A B C ...), and report the "
        "median with its min/max spread (default 3; replay is deterministic: 1)",
    )
    p.add_argument(
        "--param",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="workload parameter (repeatable), e.g. --param groups=8 --param rate=2",
    )
    p.add_argument("--max-requests", type=int, default=None, help="first N requests only")
    p.add_argument("--max-num-seqs", type=int, default=256, help="per-worker sequence limit")
    p.add_argument(
        "--sim-stream-interval",
        type=_positive_int,
        default=8,
        help="e2e: the sims' --stream-interval (decode steps merged per wake-up, tokens per"
        " SSE chunk after the first); TTFT, KV events and load are exact at any value, and"
        " 8 cuts the sims' CPU ~3x so the routers get the cores; 1 = a chunk per token",
    )
    p.add_argument(
        "--sim-nice",
        type=int,
        choices=range(20),
        default=10,
        metavar="0-19",
        help="e2e: the sims' CPU priority (nice); they stand in for GPU engines, which do not"
        " take a router's CPU in a deployment, so the routers (ours and the peers alike, at"
        " 0) get the shared cores first; 0 = same priority as the routers (default 10)",
    )
    p.add_argument(
        "--policy-config",
        default=None,
        help="YAML/JSON file of policy options by name ({kv: {prefill_load_scale: 2}})",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="POLICY.OPTION=VALUE",
        help="one policy option (repeatable), e.g. --set kv.credit_decay=0",
    )
    p.add_argument(
        "--sweep-capacity",
        action="store_true",
        help="also at other capacities (replay: 500/1000/5000/unbounded, e2e: "
        "500/1000/5000 blocks per worker, a fresh fleet each): tables of hit rate, TTFT "
        "p50 and p99 and imbalance, and capacity_sweep.png of hit rate and TTFT p99, per "
        "policy and peer",
    )
    p.add_argument(
        "--concurrency",
        type=int,
        default=256,
        help="e2e: most requests in flight from the load generator",
    )
    p.add_argument(
        "--envoy-concurrency",
        type=int,
        default=1,
        help="e2e: Envoy's worker threads in front of our scorer (its --concurrency)",
    )
    p.add_argument(
        "--peers-behind-envoy",
        action="store_true",
        help="e2e: put each peer router behind an Envoy of its own (a plain route, "
        "--envoy-concurrency threads), as behind a gateway a user already runs, so every "
        "path has Envoy's hop; its CPU counts as the router's. Default: straight to the peer",
    )
    p.set_defaults(func=run)


def parse_policy_options(path: str | None, sets: list[str]) -> dict[str, dict[str, Any]]:
    """Options per policy from --policy-config and --set (ValueError names the bad one)."""
    out: dict[str, dict[str, Any]] = {}
    if path:
        try:
            data = yaml.safe_load(Path(path).read_text()) or {}
        except (OSError, yaml.YAMLError) as e:
            raise ValueError(f"--policy-config {path}: {e}") from e
        if not isinstance(data, dict) or not all(isinstance(v, dict) for v in data.values()):
            raise ValueError(f"--policy-config {path}: expected {{policy: {{option: value}}}}")
        out = {str(k): dict(v) for k, v in data.items()}
    for item in sets:
        key, eq, raw = item.partition("=")
        pol, dot, opt = key.partition(".")
        if not eq or not dot or not pol or not opt:
            raise ValueError(f"--set {item!r}: expected POLICY.OPTION=VALUE")
        out.setdefault(pol, {})[opt] = yaml.safe_load(raw)
    return out


def parse_params(items: list[str]) -> dict[str, Any]:
    """--param KEY=VALUE items → keyword arguments (values parsed as YAML scalars)."""
    out: dict[str, Any] = {}
    for item in items:
        key, eq, raw = item.partition("=")
        if not eq or not key:
            raise ValueError(f"--param {item!r}: expected KEY=VALUE")
        out[key.replace("-", "_")] = yaml.safe_load(raw)
    return out


def settings_of(args: argparse.Namespace, policies: list[str]) -> dict[str, Any]:
    """Every flag, for results.json."""
    return {
        "mode": args.mode,
        "workers": args.workers,
        "capacity_blocks": args.capacity_blocks or None,
        "block_size": args.block_size,
        "time_scale": args.time_scale,
        "seed": args.seed,
        "policies": policies,
        "max_requests": args.max_requests,
        "max_num_seqs": args.max_num_seqs,
        "sim_stream_interval": args.sim_stream_interval,
        "sim_nice": args.sim_nice,
        "policy_options": args.policy_options,
        "sweep_capacity": args.sweep_capacity,
        "concurrency": args.concurrency,
        "envoy_concurrency": args.envoy_concurrency,
        "peers_behind_envoy": args.peers_behind_envoy,
        "repeats": args.repeats,
        "workload_params": parse_params(args.param),
        "trace": args.trace,
    }


def oracle_entry(wl: Workload, block_size: int, keys: Any = None) -> dict[str, Any]:
    """The oracle: infinite-cache hit ratio (block level; token level when keys given)."""
    entry: dict[str, Any] = {"hit_rate": round(oracle_block_hit_rate(wl, block_size), 4)}
    if keys is not None:
        from kvscorer_tools.bench.replay import oracle_token_hit_rate

        entry["hit_rate_tokens"] = round(oracle_token_hit_rate(wl, keys), 4)
    return entry


def run_replay_mode(args: argparse.Namespace, wl: Workload, policies: list[str]) -> dict[str, Any]:
    """All policies (and optionally the capacity sweep) in the discrete-event replay."""
    from kvscorer_tools.bench.replay import ReplaySettings, RequestKeys, run_replay

    t = time.perf_counter()
    keys = RequestKeys(wl, args.block_size)
    print(f"block keys for {len(wl)} requests in {time.perf_counter() - t:.1f}s", flush=True)

    def settings(cap: int | None) -> ReplaySettings:
        return ReplaySettings(
            workers=args.workers,
            capacity_blocks=cap,
            block_size=args.block_size,
            max_num_seqs=args.max_num_seqs,
            seed=args.seed,
            policy_options=args.policy_options,
        )

    from kvscorer_tools.bench.e2e.settings import PEER_POLICIES

    results: dict[str, Any] = {}
    for name in policies:
        if name in PEER_POLICIES:
            results[name] = {"error": "peers run in --mode e2e only"}
            continue
        res = run_replay(wl, name, settings(args.capacity_blocks or None), keys)
        results[name] = res.as_dict()
        r = results[name]
        print(
            f"  {name}: hit {r['hit_rate']:.3f}  p50 {r['ttft_p50_ms']:.0f} ms  "
            f"p99 {r['ttft_p99_ms']:.0f} ms  imbalance {r['imbalance']:.2f}  "
            f"({r['wall_s']:.1f}s)",
            flush=True,
        )
    results["oracle"] = oracle_entry(wl, args.block_size, keys)
    extra: dict[str, Any] = {}
    if args.sweep_capacity:
        ours = [p for p in policies if p not in PEER_POLICIES]
        sweep: dict[str, Any] = {
            "capacities": [c if c is not None else "unbounded" for c in SWEEP_CAPACITIES],
            **{key: {p: [] for p in ours} for key in SWEEP_KEYS},
        }
        for cap in SWEEP_CAPACITIES:
            for p in ours:
                if cap == (args.capacity_blocks or None) and p in results:
                    r = results[p]
                else:
                    r = run_replay(wl, p, settings(cap), keys).as_dict()
                    print(
                        f"  sweep {cap or 'unbounded'} {p}: hit {r['hit_rate']:.3f}  "
                        f"p50 {r['ttft_p50_ms']:.0f} ms",
                        flush=True,
                    )
                for key in SWEEP_KEYS:
                    sweep[key][p].append(r[key])
        sweep["hit_rate"]["oracle"] = [results["oracle"]["hit_rate"]] * len(SWEEP_CAPACITIES)
        extra["capacity_sweep"] = sweep
    return {"policies": results, **extra}


def run_e2e_mode(args: argparse.Namespace, wl: Workload, policies: list[str]) -> dict[str, Any]:
    """Every policy and peer end to end, `--repeats` times; with --sweep-capacity at each
    capacity of E2E_SWEEP_CAPACITIES on a fresh fleet (the sims' capacity is a flag)."""
    from kvscorer_tools.bench.e2e import E2ESettings, run_e2e

    main_cap = args.capacity_blocks or None
    caps = [main_cap]
    if args.sweep_capacity:
        caps = [*E2E_SWEEP_CAPACITIES]
        if main_cap not in caps:
            caps.append(main_cap)
    out = Path(args.out)
    by_cap: dict[int | None, dict[str, Any]] = {}
    for cap in caps:
        if len(caps) > 1:
            print(f"-- {cap or 'unbounded'} blocks per worker", flush=True)
        es = E2ESettings(
            workers=args.workers,
            capacity_blocks=cap,
            block_size=args.block_size,
            speed=args.time_scale,
            max_num_seqs=args.max_num_seqs,
            stream_interval=args.sim_stream_interval,
            sim_nice=args.sim_nice,
            seed=args.seed,
            concurrency=args.concurrency,
            envoy_concurrency=args.envoy_concurrency,
            peers_behind_envoy=args.peers_behind_envoy,
            policy_options=args.policy_options,
            run_dir=out / "run" / f"cap-{cap or 'unbounded'}",
        )
        by_cap[cap] = run_e2e(wl, policies, es, log=print, repeats=args.repeats)
    oracle = oracle_entry(wl, args.block_size)
    body: dict[str, Any] = {"policies": {**by_cap[main_cap], "oracle": oracle}}
    if args.sweep_capacity:
        body["capacity_sweep"] = sweep_doc(
            [c for c in caps if c in E2E_SWEEP_CAPACITIES], by_cap, policies, oracle
        )
        # Every figure at every capacity (the sweep keeps SWEEP_KEYS only).
        body["by_capacity"] = {str(c or "unbounded"): by_cap[c] for c in caps}
        for c in caps:
            if c != main_cap:
                print()
                print(report.format_table(by_cap[c], f"{wl.name} (e2e, {c} blocks per worker)"))
    return body


def sweep_doc(
    caps: list[int | None],
    by_cap: dict[int | None, dict[str, Any]],
    policies: list[str],
    oracle: dict[str, Any],
) -> dict[str, Any]:
    """capacity_sweep of results.json from e2e results per capacity: per policy a list
    per capacity (None where it failed), and the repeats' [min, max] in *_range."""
    sweep: dict[str, Any] = {
        "capacities": [c if c is not None else "unbounded" for c in caps],
        **{key: {} for key in SWEEP_KEYS},
        **{key + "_range": {} for key in SWEEP_KEYS},
    }
    for p in policies:
        for key in SWEEP_KEYS:
            entries = [by_cap[c].get(p, {}) for c in caps]
            sweep[key][p] = [e.get(key) for e in entries]
            sweep[key + "_range"][p] = [e.get("spread", {}).get(key) for e in entries]
    sweep["hit_rate"]["oracle"] = [oracle["hit_rate"]] * len(caps)
    return sweep


def run(args: argparse.Namespace) -> int:
    """`kv-scorer bench`: 0 on success, 2 on bad flags."""
    default = REPLAY_DEFAULT if args.mode == "replay" else E2E_DEFAULT
    policies = [p.strip() for p in (args.policies or default).split(",") if p.strip()]
    try:
        args.policy_options = parse_policy_options(args.policy_config, args.set)
        if args.workers < 1:
            raise ValueError("--workers must be >= 1")
        if args.time_scale <= 0:
            raise ValueError("--time-scale must be > 0")
        if args.block_size < 1:
            raise ValueError("--block-size must be >= 1")
        if args.capacity_blocks < 0:
            raise ValueError("--capacity-blocks must be >= 0 (0 = unbounded)")
        if args.repeats is None:
            args.repeats = 3 if args.mode == "e2e" else 1
        if args.repeats < 1:
            raise ValueError("--repeats must be >= 1")
        if args.mode == "replay" and args.repeats != 1:
            raise ValueError("--repeats: the replay is deterministic (same seed, same numbers)")
        from kvscorer_tools.bench.e2e.settings import PEER_POLICIES
        from kvscorer_tools.bench.peer_models import MODELS
        from scorer.policy import policy_names

        known_policies = [*policy_names(), *MODELS]
        if args.mode == "e2e" and (models := [p for p in policies if p in MODELS]):
            raise ValueError(
                f"{', '.join(models)}: models of the peers run in --mode replay only "
                "(end to end, run the peers themselves)"
            )

        unknown = [p for p in policies if p not in known_policies and p not in PEER_POLICIES]
        if unknown:
            known = ", ".join([*known_policies, *PEER_POLICIES])
            raise ValueError(f"unknown policies {', '.join(unknown)} (known: {known})")
        params = parse_params(args.param)
        if args.trace is not None:
            if args.workload not in (None, "trace"):
                raise ValueError(f"--trace and --workload {args.workload} are exclusive")
            args.workload = "trace"
            params["path"] = args.trace
        elif args.workload == "trace":
            raise ValueError("--workload trace needs --trace FILE")
        args.workload = args.workload or "mooncake-conversation"
        wl = load_workload(args.workload, seed=args.seed, **params)
    except ValueError as e:
        print(f"kv-scorer bench: {e}", file=sys.stderr)
        return 2
    if args.max_requests is not None or args.time_scale != 1.0:
        wl = wl.slice(args.max_requests, args.time_scale)
    out = Path(args.out)
    print(
        f"{args.mode}: {wl.name}, {len(wl)} requests over {wl.duration_s:.0f}s, "
        f"{args.workers} workers x {args.capacity_blocks or 'unbounded'} blocks of "
        f"{args.block_size}",
        flush=True,
    )
    if args.mode == "replay":
        body = run_replay_mode(args, wl, policies)
    else:
        body = run_e2e_mode(args, wl, policies)
    doc = report.results_doc(wl.name, body.pop("policies"), settings_of(args, policies), **body)
    doc["workload_params"] = wl.params
    report.write_json(out / "results.json", doc)
    title = (
        f"{wl.name} ({args.mode}, {args.workers} workers x "
        f"{args.capacity_blocks or 'unbounded'} blocks)"
    )
    print()
    print(report.format_table(doc["policies"], title))
    where = report.format_breakdown(doc["policies"])
    if where:
        print()
        print(where)
    report.plot_policies(doc["policies"], out / "policies.png", title)
    if "capacity_sweep" in doc:
        print()
        print(report.format_sweep(doc["capacity_sweep"]))
        report.plot_sweep(doc["capacity_sweep"], out / "capacity_sweep.png", wl.name)
    print(f"\nwrote {out / 'results.json'}")
    sys.stdout.flush()
    json.dumps(doc)  # fail loudly here, not in a reader, if something is not JSON
    return 0
