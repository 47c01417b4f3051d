"""A run: the fleet up, each policy (ours through Envoy + scorer, peers) in turn, all stopped."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from kvscorer_tools.bench.e2e import peers
from kvscorer_tools.bench.e2e.fleet import SimFleet
from kvscorer_tools.bench.e2e.load import run_load
from kvscorer_tools.bench.e2e.scorer import DIAGNOSTICS, ScorerRun
from kvscorer_tools.bench.e2e.settings import E2ESettings, Log
from kvscorer_tools.bench.e2e.summary import summarize
from kvscorer_tools.bench.procs import ProcError, ProcGroup
from kvscorer_tools.bench.workloads import Workload


def run_ours(
    group: ProcGroup,
    fleet: SimFleet,
    wl: Workload,
    policy: str,
    settings: E2ESettings,
    run: ScorerRun | None = None,
) -> dict[str, Any]:
    """One of our policies through Envoy + the scorer (`run`, or one started here)."""
    fleet.reset()
    own = run is None
    if run is None:
        run = ScorerRun(group, fleet, policy, settings).__enter__()
    try:
        before = fleet.counters()
        counted = {"reasons": ("kv_scorer_decisions_total", ("reason",)), **DIAGNOSTICS}
        start = {key: run.counter(*spec) for key, spec in counted.items()}
        res = run_load(run.url, wl, settings, policy)
        after = fleet.counters()
        out = summarize(res, before, after, settings.speed, len(wl))
        for key, spec in counted.items():
            now = run.counter(*spec)
            delta = {k: v - start[key].get(k, 0) for k, v in now.items()}
            if any(delta.values()):
                out[key] = {k: v for k, v in delta.items() if v}
    finally:
        if own:
            run.close()
    return out


def run_e2e(
    wl: Workload, policies: Sequence[str], settings: E2ESettings, log: Log = print
) -> dict[str, dict[str, Any]]:
    """Every policy (ours and peers) on the same fleet; peers that fail get {"error"}."""

    group = ProcGroup(settings.run_dir / "logs")
    results: dict[str, dict[str, Any]] = {}
    try:
        fleet = SimFleet(group, settings)
        fleet.start()
        log(f"{len(fleet.specs)} simulated workers up")
        for name in policies:
            t = time.perf_counter()
            try:
                if name in peers.PEERS:
                    results[name] = peers.run_peer(name, group, fleet, wl, settings)
                else:
                    results[name] = run_ours(group, fleet, wl, name, settings)
            except (ProcError, peers.PeerError, OSError) as e:
                results[name] = {"error": str(e)[:2000]}
            r = results[name]
            if "error" in r:
                log(f"  {name}: error: {str(r['error']).splitlines()[0][:200]}")
            else:
                log(
                    f"  {name}: hit {r['hit_rate']:.3f}  p50 {r['ttft_p50_ms']:.0f} ms  "
                    f"p99 {r['ttft_p99_ms']:.0f} ms  errors {r['errors']}  "
                    f"({time.perf_counter() - t:.0f}s)"
                )
    finally:
        group.stop_all()
    return results
