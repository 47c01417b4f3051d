"""What following the pool costs the event loop: discovery's reconcile per pod event and
per full list, at 100 / 1,000 / 5,000 pods.

    .venv/bin/python bench/bench_discovery.py [--pods 100,1000,5000] [--events 400]

In process, no API server: PoolDiscovery with its pod informer's items set directly, the
Pool with every listener the app wires (EventIngest with the pool socket, the scraper, the
health monitor, via build_components). Measures: the first full list (every worker
added), a re-list with nothing changed (a 410 Gone), and one pod event (a pod going
NotReady, then Ready again: a remove and an add with every listener). Each of these runs
on the event loop. Writes bench/out/discovery.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from typing import Any

from scorer.app import build_components
from scorer.config import Config
from scorer.pool import Pool
from scorer.pool.discovery import PoolDiscovery, PoolSpec
from scorer.pool.kubeapi import Informer

OUT = Path(__file__).resolve().parent / "out"


def pod(i: int, ready: bool = True) -> dict[str, Any]:
    ip = f"10.{i // 65536}.{(i // 256) % 256}.{i % 256}"
    return {
        "metadata": {
            "name": f"p{i}",
            "namespace": "llm",
            "uid": f"u{i}",
            "labels": {"app": "vllm"},
            "resourceVersion": str(1000 + 2 * i + (0 if ready else 1)),
        },
        "status": {
            "podIP": ip,
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        },
    }


async def measure(n: int, events: int) -> dict[str, Any]:
    cfg = Config.model_validate(
        {
            "pool": {"discovery": {"pool_name": "vllm", "pool_namespace": "llm"}},
            "events": {"bind": "tcp://127.0.0.1:0"},
        }
    )
    pool = Pool.from_config(cfg)
    components, _ = build_components(cfg, pool)
    (d,) = [c for c in components if isinstance(c, PoolDiscovery)]
    d.spec = PoolSpec({"app": "vllm"}, (8000,))
    inf = Informer("pods", None, {}, d._pods_changed)
    inf.synced = True
    inf.items = {f"p{i}": pod(i) for i in range(n)}
    d.pod_informer = inf
    t = time.perf_counter()
    d._pods_changed(None)
    first = time.perf_counter() - t
    t = time.perf_counter()
    d._pods_changed(None)
    relist = time.perf_counter() - t
    k = min(n, events // 2)
    t = time.perf_counter()
    for i in range(k):
        inf.items[f"p{i}"] = pod(i, ready=False)
        d._pods_changed(f"p{i}")
        inf.items[f"p{i}"] = pod(i, ready=True)
        d._pods_changed(f"p{i}")
    per_event = (time.perf_counter() - t) / (2 * k)
    assert len(pool) == n
    return {
        "pods": n,
        "first_list_ms": round(first * 1000, 2),
        "relist_unchanged_ms": round(relist * 1000, 2),
        "pod_event_us": round(per_event * 1e6, 1),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--pods", default="100,1000,5000")
    p.add_argument("--events", type=int, default=400)
    args = p.parse_args()
    rows = [asyncio.run(measure(int(n), args.events)) for n in args.pods.split(",")]
    for r in rows:
        print(
            f"pods={r['pods']:>5}  first list {r['first_list_ms']:>8.1f} ms  "
            f"re-list {r['relist_unchanged_ms']:>7.1f} ms  pod event {r['pod_event_us']:>6.1f} us"
        )
    OUT.mkdir(exist_ok=True)
    (OUT / "discovery.json").write_text(json.dumps({"results": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
