"""A run: the fleet up, each policy (ours through Envoy + scorer, peers) in turn, all stopped."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from kvscorer_tools.bench.e2e import peers
from kvscorer_tools.bench.e2e.breakdown import add_breakdown, log_marks
from kvscorer_tools.bench.e2e.cpu import CpuMeter
from kvscorer_tools.bench.e2e.fleet import SimFleet
from kvscorer_tools.bench.e2e.load import run_load
from kvscorer_tools.bench.e2e.scorer import DIAGNOSTICS, ScorerRun
from kvscorer_tools.bench.e2e.settings import E2ESettings, Log
from kvscorer_tools.bench.e2e.summary import combine_repeats, summarize
from kvscorer_tools.bench.procs import ProcError, ProcGroup
from kvscorer_tools.bench.workloads import Workload

# Send lag (wall ms, p99) above which a run is flagged: the load generator could not fire
# requests on time, so the machine, not the router, set the latencies.
LAG_WARN_WALL_MS = 50.0


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
        # What the scorer did before the load (its replay syncs): an earlier run's events
        # applied here would show as events / sync_messages at start.
        out_start = {k: start[k] for k in ("events", "syncs", "sync_messages") if start.get(k)}
        marks = log_marks(fleet.request_logs)
        router = [p.pid for p in (run.scorer,) if p is not None]
        if run.envoy is not None and run.envoy.proc is not None:
            router.append(run.envoy.proc.pid)
        cpu = CpuMeter({"sims": [p.pid for p in fleet.procs], "router": router})
        res = run_load(run.url, wl, settings, policy)
        cpu_s = cpu.done()
        after = fleet.counters()
        out = summarize(res, before, after, settings.speed, len(wl))
        add_breakdown(out, res, fleet, marks, settings.speed, policy)
        out["cpu_s"] = cpu_s
        saved = run.save_decisions(settings.run_dir / "decisions")
        if saved is not None:
            out["decisions_file"] = str(saved)
        if out_start:
            out["at_start"] = out_start
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
    wl: Workload,
    policies: Sequence[str],
    settings: E2ESettings,
    log: Log = print,
    repeats: int = 1,
) -> dict[str, dict[str, Any]]:
    """Every policy (ours and peers) on the same fleet, `repeats` times, interleaved.

    Repeat r runs every policy once (A B C A B C ...), so a slow drift of the machine's
    load spreads over all policies instead of landing on one. Each entry is the median
    over the repeats with its [min, max] spread (summary.combine_repeats); a policy whose
    every repeat failed gets {"error"}.
    """
    group = ProcGroup(settings.run_dir / "logs")
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in policies}
    missing: set[str] = set()
    try:
        fleet = SimFleet(group, settings)
        fleet.start()
        log(f"{len(fleet.specs)} simulated workers up")
        for rep in range(repeats):
            for name in policies:
                if name in missing:
                    continue
                t = time.perf_counter()
                r = run_one(group, fleet, wl, name, settings)
                runs[name].append(r)
                tag = f"  {name}" + (f" [{rep + 1}/{repeats}]" if repeats > 1 else "")
                if "error" in r:
                    log(f"{tag}: error: {str(r['error']).splitlines()[0][:200]}")
                else:
                    log(
                        f"{tag}: hit {r['hit_rate']:.3f}  p50 {r['ttft_p50_ms']:.0f} ms  "
                        f"p99 {r['ttft_p99_ms']:.0f} ms  errors {r['errors']}  "
                        f"send lag p99 {r.get('send_lag_p99_ms', 0):.0f} ms  "
                        f"({time.perf_counter() - t:.0f}s)"
                    )
                    lag_wall_ms = r.get("send_lag_p99_ms", 0.0) / settings.speed
                    if lag_wall_ms > LAG_WARN_WALL_MS:
                        log(
                            f"  warning: requests went out up to {lag_wall_ms:.0f} ms (wall) "
                            "late: this machine did not keep up with --time-scale "
                            f"{settings.speed:g}; latencies are inflated (lower it)"
                        )
                if "error" in r and "not installed" in str(r["error"]):
                    missing.add(name)  # no use trying it again in the next repeats
    finally:
        group.stop_all()
    return {name: combine_repeats(rs) for name, rs in runs.items()}


def run_one(
    group: ProcGroup, fleet: SimFleet, wl: Workload, name: str, settings: E2ESettings
) -> dict[str, Any]:
    """One repeat of one policy or peer; {"error"} when it could not run."""
    try:
        if name in peers.PEER_POLICIES:
            return peers.run_peer(name, group, fleet, wl, settings)
        return run_ours(group, fleet, wl, name, settings)
    except (ProcError, peers.PeerError, OSError) as e:
        return {"error": str(e)[:2000]}
