"""Record every routing decision of the shipped policies on the replay workloads.

The recordings pin decisions across refactors: the same workload, settings and seed must
give the same endpoint, reason and notes for every request. `tests/policy/
test_recorded_decisions.py` replays the reduced set in `make test`; the full set is
checked by hand after a change that must not move decisions:

    python bench/record_decisions.py --set full --check   # compare with the recording
    python bench/record_decisions.py --set full            # (re)write the recording
    python bench/record_decisions.py --set full --policies kv   # re-record kv only,
                                                    # keeping the others' recording

Recordings: tests/fixtures/decisions/<set>.json.gz (one line per decision,
"<worker index> <reason> <notes>", in arrival order).
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
import time
from pathlib import Path
from typing import Any

from kvscorer_tools.bench.replay import ReplaySettings, RequestKeys, record_decisions
from kvscorer_tools.bench.workloads import Workload, load_workload

POLICIES = ("kv", "approx", "session", "least_loaded", "round_robin")
OUT_DIR = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "decisions"

# name -> (workload builder, settings). The reduced set runs in seconds (make test); it
# has small caches so evictions, busy workers and speculative entries all occur.
SETS: dict[str, dict[str, tuple[Any, dict[str, Any]]]] = {
    "reduced": {
        "shared-prefix": (
            lambda: load_workload("shared-prefix", groups=8, prompts_per_group=8, rate=2.0),
            dict(workers=4, capacity_blocks=20, block_size=512, seed=3),
        ),
        "prefix-groups": (
            lambda: load_workload("prefix-groups", groups=12, prompts_per_group=5, rate=8.0),
            dict(workers=4, capacity_blocks=60, block_size=512, seed=1),
        ),
        "chat": (
            lambda: load_workload("chat", sessions=8, turns=4, think_s=0.5),
            dict(workers=3, capacity_blocks=24, block_size=128, seed=2),
        ),
        "mooncake-conversation": (
            lambda: load_workload("mooncake-conversation").slice(max_requests=150),
            dict(workers=8, capacity_blocks=200, block_size=512, seed=0),
        ),
    },
    "full": {
        "shared-prefix": (
            lambda: load_workload("shared-prefix"),
            dict(workers=8, capacity_blocks=1000, block_size=512, seed=0),
        ),
        "prefix-groups": (
            lambda: load_workload("prefix-groups"),
            dict(workers=8, capacity_blocks=1000, block_size=512, seed=0),
        ),
        "chat": (
            lambda: load_workload("chat"),
            dict(workers=8, capacity_blocks=1000, block_size=512, seed=0),
        ),
        "mooncake-conversation": (
            lambda: load_workload("mooncake-conversation"),
            dict(workers=8, capacity_blocks=1000, block_size=512, seed=0),
        ),
    },
}


def record(set_name: str, policies: tuple[str, ...] = POLICIES) -> dict[str, Any]:
    """Replay every workload of `set_name` under each policy; return the recording."""
    out: dict[str, Any] = {"set": set_name, "workloads": {}}
    for wl_name, (build, kw) in SETS[set_name].items():
        wl: Workload = build()
        settings = ReplaySettings(**kw)
        keys = RequestKeys(wl, settings.block_size)
        endpoints = [f"10.0.{i // 250}.{i % 250 + 1}:8000" for i in range(settings.workers)]
        index = {e: str(i) for i, e in enumerate(endpoints)}
        per: dict[str, list[str]] = {}
        for p in policies:
            t = time.perf_counter()
            rows = record_decisions(wl, p, settings, keys)
            per[p] = [f"{index.get(e, '-')} {r} {n}".rstrip() for e, r, n in rows]
            print(f"  {wl_name} {p}: {len(rows)} decisions ({time.perf_counter() - t:.1f}s)")
        out["workloads"][wl_name] = {"settings": kw, "requests": len(wl), "decisions": per}
    return out


def path_of(set_name: str) -> Path:
    return OUT_DIR / f"{set_name}.json.gz"


def load(set_name: str) -> dict[str, Any]:
    """The committed recording of `set_name`."""
    with gzip.open(path_of(set_name), "rt") as f:
        data: dict[str, Any] = json.load(f)
    return data


def diff(expected: dict[str, Any], got: dict[str, Any], limit: int = 10) -> list[str]:
    """Human-readable differences (first `limit`), empty when identical."""
    problems: list[str] = []
    for wl_name, exp in expected["workloads"].items():
        g = got["workloads"].get(wl_name)
        if g is None:
            problems.append(f"{wl_name}: missing")
            continue
        for p, rows in exp["decisions"].items():
            grows = g["decisions"].get(p)
            if grows is None:
                problems.append(f"{wl_name}/{p}: missing")
                continue
            if len(grows) != len(rows):
                problems.append(f"{wl_name}/{p}: {len(grows)} decisions, expected {len(rows)}")
            for i, (a, b) in enumerate(zip(rows, grows, strict=False)):
                if a != b:
                    problems.append(f"{wl_name}/{p} request {i}: expected {a!r}, got {b!r}")
                    break
            if len(problems) >= limit:
                return problems
    return problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--set", choices=sorted(SETS), default="reduced")
    ap.add_argument("--check", action="store_true", help="compare with the recording")
    ap.add_argument(
        "--policies",
        default=",".join(POLICIES),
        help="comma-separated policies to replay (default: all); when writing, the other "
        "policies' recorded decisions are kept as they are",
    )
    args = ap.parse_args(argv)
    policies = tuple(p for p in args.policies.split(",") if p)
    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        ap.error(f"unknown policies: {', '.join(unknown)}")
    got = record(args.set, policies)
    if args.check:
        expected = load(args.set)
        for exp in expected["workloads"].values():
            exp["decisions"] = {p: r for p, r in exp["decisions"].items() if p in policies}
        problems = diff(expected, got)
        for line in problems:
            print(line)
        print("identical" if not problems else f"{len(problems)} difference(s)")
        return 1 if problems else 0
    if set(policies) != set(POLICIES):
        # Keep the other policies' recorded decisions, in the usual policy order.
        kept = load(args.set)
        for wl_name, g in got["workloads"].items():
            old = kept["workloads"][wl_name]["decisions"]
            g["decisions"] = {
                p: g["decisions"][p] if p in policies else old[p] for p in POLICIES if p in old
            }
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    # mtime=0: the same decisions give the same bytes.
    with gzip.GzipFile(path_of(args.set), "wb", mtime=0) as f:
        f.write(json.dumps(got, indent=0, sort_keys=True).encode())
    print(f"wrote {path_of(args.set)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
