"""`kv-scorer demo` (`make demo`): see what cache-aware routing does, in one command.

On loopback it starts 4 simulated vLLM workers (`kv-scorer sim`), then for each policy a
scorer (`kv-scorer serve`) and a real Envoy in front of it, replays a shared-prefix
workload through Envoy (progress line), and prints one table: hit rate from the workers'
own counters, TTFT p50/p99, throughput, load imbalance. The `session` policy is shown on a
multi-turn chat workload. Results go to OUT/results.json and OUT/demo.png; logs of every
process to OUT/logs/. Every process it started is stopped at the end, on error and on
Ctrl-C.

`--target URL --worker-url URL...` skips starting anything: it replays the workload against
an existing gateway (e.g. the docker-compose one) and reads the given workers' counters.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import time
from pathlib import Path
from types import FrameType
from typing import Any

from kvscorer_tools.bench import report
from kvscorer_tools.bench.cli import parse_policy_options
from kvscorer_tools.bench.e2e import (
    E2ESettings,
    SimFleet,
    SimSpec,
    generate_load,
    progress_printer,
    run_ours,
    summarize,
)
from kvscorer_tools.bench.procs import ProcError, ProcGroup, http_get, wait_until
from kvscorer_tools.bench.workloads import Workload, load_workload, oracle_block_hit_rate

POLICIES = ("kv", "approx", "round_robin")


# The gateways send response bodies FULL_DUPLEX_STREAMED; so does the demo's Envoy.
DEMO_RESPONSE_BODY_MODE = "FULL_DUPLEX_STREAMED"


def demo_workloads(small: bool, seed: int) -> tuple[Workload, Workload]:
    """(shared-prefix, chat) sized for the demo (`small`: a few seconds, for tests).

    Shared prefix: 16 system prompts of 4,096 tokens, 12 questions each, Poisson at
    10 req/s model time. With 4 workers of 1,500 16-token blocks, one worker holds ~5
    system prompts: round robin cycles all 16 through every worker and keeps evicting them;
    a cache-aware router keeps each on one worker.
    """
    if small:
        sp = load_workload(
            "shared-prefix",
            seed=seed,
            groups=4,
            prompts_per_group=4,
            system_tokens=1024,
            question_tokens=64,
            output_tokens=8,
            rate=40.0,
        )
        chat = load_workload(
            "chat",
            seed=seed,
            sessions=3,
            turns=3,
            system_tokens=256,
            user_tokens=32,
            reply_tokens=8,
            think_s=0.2,
        )
        return sp, chat
    sp = load_workload(
        "shared-prefix",
        seed=seed,
        groups=16,
        prompts_per_group=12,
        system_tokens=4096,
        question_tokens=128,
        output_tokens=64,
        rate=10.0,
    )
    chat = load_workload(
        "chat",
        seed=seed,
        sessions=12,
        turns=5,
        system_tokens=1024,
        user_tokens=128,
        reply_tokens=64,
        think_s=1.0,
    )
    return sp, chat


def register(subparsers: Any) -> None:
    """Add `kv-scorer demo`."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "demo",
        help="Envoy + scorer + 4 simulated workers: compare policies in one command",
        description=__doc__.split("\n\n")[1] if __doc__ else None,
    )
    p.add_argument("--out", default="demo-out", help="output directory (default demo-out/)")
    p.add_argument("--small", action="store_true", help="a few-second version (tests)")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--capacity-blocks", type=int, default=None, help="KV blocks per worker")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument(
        "--speed",
        type=float,
        default=None,
        help="simulated workers run this many times faster than model time (default 2)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--policies",
        default=",".join(POLICIES),
        help="policies for the shared-prefix workload (default kv,approx,round_robin)",
    )
    p.add_argument("--no-chat", action="store_true", help="skip the session/chat part")
    p.add_argument(
        "--gateway",
        default="envoy-ai-gateway",
        choices=["local", "istio", "envoy-ai-gateway", "kgateway"],
        help="configure Envoy as this gateway configures its endpoint picker (TLS to the "
        "scorer for envoy-ai-gateway and kgateway); local = envoy/envoy.yaml's shape "
        "(default envoy-ai-gateway)",
    )
    p.add_argument(
        "--policy-config",
        default=None,
        help="YAML/JSON file of policy options by name, e.g. bench/routing/kv-tuned.yaml",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="POLICY.OPTION=VALUE",
        help="one policy option (repeatable), e.g. --set kv.prefill_load_scale=10",
    )
    p.add_argument("--target", help="replay against this existing gateway URL instead")
    p.add_argument(
        "--worker-url",
        action="append",
        default=[],
        help="with --target: a worker base URL whose /metrics to read (repeatable)",
    )
    p.set_defaults(func=run)


class _Interrupted(Exception):
    """SIGTERM arrived: unwind through `finally` like Ctrl-C does."""


def _on_term(signum: int, frame: FrameType | None) -> None:
    raise _Interrupted(f"signal {signum}")


def run(args: argparse.Namespace) -> int:
    """`kv-scorer demo`: 0 on success, 1 when something failed, 130 on Ctrl-C."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sp, chat = demo_workloads(args.small, args.seed)
    speed = args.speed or (10.0 if args.small else 2.0)
    cap = args.capacity_blocks or (100 if args.small else 1500)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    try:
        policy_options = parse_policy_options(args.policy_config, args.set)
    except ValueError as e:
        print(f"kv-scorer demo: {e}", file=sys.stderr)
        return 2
    settings = E2ESettings(
        workers=args.workers,
        capacity_blocks=cap,
        block_size=args.block_size,
        speed=speed,
        seed=args.seed,
        concurrency=256,
        run_dir=out,
        progress=True,
        policy_options=policy_options,
        gateway=None if args.gateway == "local" else args.gateway,
        response_body_mode=DEMO_RESPONSE_BODY_MODE,
    )
    sp = sp.slice(None, speed)
    chat = chat.slice(None, speed)
    old_term = signal.signal(signal.SIGTERM, _on_term)
    t0 = time.perf_counter()
    try:
        if args.target:
            doc = _run_external(args, sp, settings)
        else:
            doc = _run_local(args, sp, chat, policies, settings)
    except (KeyboardInterrupt, _Interrupted):
        print("\ninterrupted: every process the demo started has been stopped", flush=True)
        return 130
    except (ProcError, OSError) as e:
        print(f"\nkv-scorer demo: {e}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGTERM, old_term)
    report.write_json(out / "results.json", doc)
    title = f"{sp.name}: {len(sp)} requests, {args.workers} workers x {cap} blocks"
    print()
    print(report.format_table(doc["policies"], title))
    if "chat" in doc:
        print()
        print(report.format_table(doc["chat"]["policies"], f"chat: {len(chat)} turns"))
    report.plot_policies(doc["policies"], out / "demo.png", title)
    print(
        f"\nwrote {out / 'results.json'} and {out / 'demo.png'} in {time.perf_counter() - t0:.0f}s"
    )
    return 0


def _settings_doc(args: argparse.Namespace, settings: E2ESettings) -> dict[str, Any]:
    return {
        "mode": "e2e",
        "workers": settings.workers,
        "capacity_blocks": settings.capacity_blocks,
        "block_size": settings.block_size,
        "time_scale": settings.speed,
        "seed": settings.seed,
        "small": bool(args.small),
        "policy_options": settings.policy_options,
    }


def _run_local(
    args: argparse.Namespace,
    sp: Workload,
    chat: Workload,
    policies: list[str],
    settings: E2ESettings,
) -> dict[str, Any]:
    group = ProcGroup(settings.run_dir / "logs")
    results: dict[str, dict[str, Any]] = {}
    chat_results: dict[str, dict[str, Any]] = {}
    try:
        fleet = SimFleet(group, settings)
        print(
            f"starting {settings.workers} simulated workers, Envoy and the scorer "
            f"(logs in {settings.run_dir / 'logs'})",
            flush=True,
        )
        fleet.start()
        print(
            f"shared-prefix workload: {len(sp)} requests, "
            f"{sp.params['groups']} system prompts of {sp.params['system_tokens']} tokens",
            flush=True,
        )
        for name in policies:
            results[name] = run_ours(group, fleet, sp, name, settings)
        results["oracle"] = {"hit_rate": round(oracle_block_hit_rate(sp, settings.block_size), 4)}
        if not args.no_chat:
            print(
                f"chat workload: {len(chat)} turns in {chat.params['sessions']} sessions",
                flush=True,
            )
            for name in ("session", "round_robin"):
                chat_results[name] = run_ours(group, fleet, chat, name, settings)
    finally:
        group.stop_all()
    doc = report.results_doc(sp.name, results, _settings_doc(args, settings))
    doc["workload_params"] = sp.params
    if chat_results:
        doc["chat"] = {"workload": chat.name, "policies": chat_results, "params": chat.params}
    return doc


def _run_external(args: argparse.Namespace, sp: Workload, settings: E2ESettings) -> dict[str, Any]:
    if not args.worker_url:
        raise ProcError("--target needs --worker-url for every worker (hit rate, imbalance)")
    fleet = SimFleet(ProcGroup(settings.run_dir / "logs"), settings)
    for u in args.worker_url:
        host, _, port = u.rstrip("/").rsplit("//", 1)[-1].rpartition(":")
        if not host or not port.isdigit():
            raise ProcError(f"--worker-url {u!r}: expected http://HOST:PORT")
        fleet.specs.append(SimSpec(int(port), 0, 0, host=host))
    # Compose starts everything at once: wait until the gateway routes (GET /v1/models).
    models = args.target.split("/v1/", 1)[0] + "/v1/models"
    wait_until(lambda: http_get(models, 2.0)[0] == 200, 120.0, f"the gateway ({models})")
    before = fleet.counters()
    res = asyncio.run(
        generate_load(
            args.target, sp.requests, settings.concurrency, 600.0, progress_printer("gateway")
        )
    )
    after = fleet.counters()
    results = {"gateway": summarize(res, before, after, settings.speed, len(sp))}
    return report.results_doc(sp.name, results, _settings_doc(args, settings))
