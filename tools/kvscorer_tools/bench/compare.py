"""Per-request comparison of a replay with an end-to-end run's joined rows (issue 13).

The e2e run writes one joined row per request (`OUT/run/cap-N/requests/POLICY.jsonl`:
worker, the sim's cached tokens, arrival, prefill step; keyed by the prompt's token ids).
This replays the same requests with the same policy and joins both per request, then
says where hit rate was lost: for each request whose prompt continues an earlier one
(its "parent": the earlier request sharing the longest prefix of blocks: a Mooncake
trace's hash ids, any other workload's full-block keys), whether it
went to the parent's worker, and how many of the shared tokens were found cached.

    .venv/bin/python -m kvscorer_tools.bench.compare \\
        --rows bench/out/e2e-mooncake/run/cap-1000/requests --max-requests 800
    .venv/bin/python -m kvscorer_tools.bench.compare --workload rag \\
        --rows bench/out/e2e-rag/run/cap-1000/requests --max-requests 600

It also replays the e2e run's own routing (each request sent to the worker the e2e run
chose) to check the replay's engine and cache model against the e2e sims per request,
prints what that routing's TTFT, queue and prefill are on the replay's engines (also for
the peers' rows: a placement-only comparison, without the machine or the proxy path),
and asks the policy, as a dry run at each request, where it would have sent it with that
fleet state and a timely index. With the run's results.json beside it, it also shows
each run's KV-event path in the scorer (`event_path`: speculative blocks never confirmed,
an earlier run's events re-applied, gaps, replays, purges). Deterministic; prints a table,
`--json` writes it.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvscorer_tools.bench.replay import MODEL, ReplaySettings, RequestKeys, _Replay, percentile
from kvscorer_tools.bench.workloads import Workload, load_workload
from kvscorer_tools.sim.scheduler import Admission
from scorer.routing import RoutingRequest


def _run_rows(rep: _Replay) -> list[dict[str, Any]]:
    """Run `rep`; one row per request: worker index, cached tokens at admission,
    arrival/admitted/first (s)."""
    cached: dict[int, int] = {}
    for w in rep.workers.values():
        orig = w._admitted

        def hook(a: Admission[Any], orig: Any = orig) -> None:
            cached[a.request.idx] = a.cached_tokens
            orig(a)

        w._admitted = hook  # type: ignore[method-assign]
    rep.run()
    order = list(rep.workers)
    return [
        {
            "worker": order.index(r.worker.endpoint) if r.worker else -1,
            "cached_tokens": cached.get(r.idx, 0),
            "prompt_tokens": r.prompt_tokens,
            "arrival": r.arrival,
            "admitted": r.admitted,
            "first": r.first,
        }
        for r in rep.reqs
    ]


def replay_rows(
    wl: Workload, keys: RequestKeys, policy: str, settings: ReplaySettings
) -> list[dict[str, Any]]:
    """One row per request: worker index, cached tokens, arrival/admitted/first (s)."""
    rep = _Replay(wl, keys, policy, settings)
    return _run_rows(rep)


class _Follow(_Replay):
    """A replay whose requests go where the e2e run sent them (`workers[i]`), and that
    asks the policy, as a dry run, where it would have sent each one: with the same
    routing, the simulated caches are the e2e fleet's (if the models agree), so a
    disagreement is what the e2e router saw differently (late events, load, timing)."""

    def __init__(self, *args: Any, workers: list[int], **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.forced = workers
        self.would: list[int] = []
        self.order = list(self.workers)

    def route(self, r: Any, token_ids: Any, session: str | None) -> None:
        def req(subset: frozenset[str] | None) -> RoutingRequest:
            q = RoutingRequest(
                request_id=r.rid,
                model=MODEL,
                path="/v1/completions",
                session_id=session,
                block_size=self.settings.block_size,
                prompt_tokens=r.prompt_tokens,
                subset=subset,
            )
            if self.policy.needs_tokens:
                q.token_ids = token_ids()
                q.block_keys = r.keys
            return q

        dry = self.director.decide_prepared(req(None), dry_run=True)
        self.would.append(self.order.index(dry.endpoints[0]) if dry.endpoints else -1)
        ep = self.order[self.forced[r.idx]]
        d = self.director.decide_prepared(req(frozenset({ep})))
        if not d.endpoints:
            self.error(r, self.now)
            return
        w = self.workers[d.endpoints[0]]
        r.worker = w
        w.arrive(r, self.now)


def follow_rows(
    wl: Workload,
    keys: RequestKeys,
    policy: str,
    settings: ReplaySettings,
    e2e: list[dict[str, Any] | None],
) -> tuple[list[dict[str, Any]], list[int]]:
    """Replay with the e2e run's routing: rows as `replay_rows` and the policy's own
    (dry-run) choice per request."""
    forced = [(-1 if row is None else int(row["worker"])) for row in e2e]
    rep = _Follow(wl, keys, policy, settings, workers=[max(f, 0) for f in forced])
    return _run_rows(rep), rep.would


def e2e_rows(path: Path, wl: Workload) -> list[dict[str, Any] | None]:
    """The e2e rows in the workload's request order (None: not answered)."""
    by_key: dict[int, list[int]] = defaultdict(list)
    for i, br in enumerate(wl.requests):
        by_key[hash(tuple(br.token_ids()))].append(i)
    out: list[dict[str, Any] | None] = [None] * len(wl.requests)
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    rows.sort(key=lambda r: r["sent"])
    matched = 0
    for row in rows:
        idxs = by_key.get(int(row["key"]))
        if idxs:
            out[idxs.pop(0)] = row
            matched += 1
    if not matched and rows:
        # A peer that gets the prompt as words (sglang-router): its sim saw other token
        # ids, so the rows are paired by length in send order (the generator sends in arrival
        # order, nearly: concurrent sends interleave), each the earliest unpaired
        # request of the same prompt length.
        by_len: dict[int, list[int]] = defaultdict(list)
        for i, br in enumerate(wl.requests):
            by_len[br.prompt_tokens].append(i)
        for row in rows:
            idxs = by_len.get(int(row["prompt_tokens"]))
            if idxs:
                out[idxs.pop(0)] = row
    return out


def parents(wl: Workload, keys: RequestKeys | None = None) -> list[tuple[int, int]]:
    """Per request: (earlier request sharing the longest prefix of blocks, shared blocks).
    The blocks are a Mooncake trace's hash ids, else (every other workload) the prompts'
    full-block keys from `keys`."""
    if wl.hash_ids is not None:
        chains: Sequence[Sequence[int]] = wl.hash_ids
    else:
        assert keys is not None, "a workload without hash ids needs its block keys"
        chains = keys.keys
    seen: dict[tuple[int, ...], int] = {}  # prefix -> latest request holding it
    out: list[tuple[int, int]] = []
    for i, chain in enumerate(chains):
        h = tuple(chain)
        best = (-1, 0)
        for n in range(len(h), 0, -1):
            j = seen.get(h[:n])
            if j is not None:
                best = (j, n)
                break
        out.append(best)
        for n in range(1, len(h) + 1):
            seen[h[:n]] = i
    return out


def continuations(
    wl: Workload, rows: Sequence[dict[str, Any] | None], par: Sequence[tuple[int, int]]
) -> dict[str, Any]:
    """Hit rate, and for the requests continuing an earlier one by >= 2 hash ids (a
    conversation's next turn): how many stayed on the parent's worker, the tokens shared
    with the parent and the hits found, staying and moved. Other requests' hits apart."""
    bt = int(wl.params.get("segment_tokens", 512))
    c = dict(q=0, hits=0, turns=0, stayed=0, shared_stayed=0, hit_stayed=0)
    c.update(shared_moved=0, hit_moved=0, hit_other=0)
    for i, row in enumerate(rows):
        if row is None:
            continue
        c["q"] += row["prompt_tokens"]
        c["hits"] += row["cached_tokens"]
        j, n = par[i]
        prow = rows[j] if j >= 0 else None
        if n < 2 or prow is None:
            c["hit_other"] += row["cached_tokens"]
            continue
        shared = min(n * bt, row["prompt_tokens"] - 1)
        got = min(row["cached_tokens"], shared)
        c["turns"] += 1
        if row["worker"] == prow["worker"]:
            c["stayed"] += 1
            c["shared_stayed"] += shared
            c["hit_stayed"] += got
        else:
            c["shared_moved"] += shared
            c["hit_moved"] += got
    out: dict[str, Any] = dict(c)
    out["hit_rate"] = round(c["hits"] / c["q"], 4) if c["q"] else 0.0
    return out


def timing(rows: Sequence[dict[str, Any]]) -> dict[str, float]:
    """TTFT p50 / p99, queue p50 / mean and prefill p50 (model ms) of replay rows: what a
    routing costs on the replay's engines, without the machine or the proxy path."""
    done = [r for r in rows if r["first"] >= 0 and r["admitted"] >= 0]
    ttft = [(r["first"] - r["arrival"]) * 1000.0 for r in done]
    queue = [(r["admitted"] - r["arrival"]) * 1000.0 for r in done]
    prefill = [(r["first"] - r["admitted"]) * 1000.0 for r in done]
    return {
        "ttft_p50_ms": round(percentile(ttft, 50), 1),
        "ttft_p99_ms": round(percentile(ttft, 99), 1),
        "queue_p50_ms": round(percentile(queue, 50), 1),
        "queue_mean_ms": round(sum(queue) / len(queue), 1) if queue else 0.0,
        "prefill_p50_ms": round(percentile(prefill, 50), 1),
    }


def _timing_line(name: str, t: dict[str, float]) -> str:
    return (
        f"{name:30s} replayed: TTFT p50 {t['ttft_p50_ms']:.1f} p99 {t['ttft_p99_ms']:.0f}"
        f"  queue p50 {t['queue_p50_ms']:.1f} mean {t['queue_mean_ms']:.1f}"
        f"  prefill p50 {t['prefill_p50_ms']:.1f} (model ms)"
    )


def _line(name: str, c: dict[str, Any]) -> str:
    k = 1000
    return (
        f"{name:30s} hit {c['hit_rate']:.4f}  turns {c['turns']} stayed {c['stayed']}"
        f"  shared/hit stayed {c['shared_stayed'] // k}k/{c['hit_stayed'] // k}k"
        f"  moved {c['shared_moved'] // k}k/{c['hit_moved'] // k}k"
        f"  other hits {c['hit_other'] // k}k"
    )


def event_path(run: dict[str, Any]) -> dict[str, int]:
    """What happened to one e2e run's KV events in the scorer (its results.json entry):
    speculative blocks never confirmed by a BlockStored (expired, or dropped by a purge),
    events of an earlier run re-applied (AllBlocksCleared during the run, and whatever a
    replay sync applied or skipped before the load), gaps, replays and purges."""
    spec = run.get("speculative", {})
    ev = run.get("events", {})
    start = run.get("at_start", {})
    sync = start.get("sync_messages", {})
    return {
        "speculative": spec.get("inserted", 0),
        "unconfirmed": spec.get("inserted", 0) - spec.get("confirmed", 0),
        "expired": spec.get("expired", 0),
        "cleared_in_run": ev.get("AllBlocksCleared/ok", 0),
        "removed_in_run": ev.get("BlockRemoved/ok", 0) + ev.get("BlockRemoved/unknown_hash", 0),
        "sync_applied": sync.get("applied", 0),
        "sync_skipped": sync.get("skipped", 0),
        "gaps": sum(run.get("gaps", {}).values()),
        "replays": sum(run.get("replays", {}).values()),
        "purges": sum(run.get("purges", {}).values()),
    }


def _event_line(name: str, e: dict[str, int]) -> str:
    return (
        f"{name:30s} speculative {e['speculative']} unconfirmed {e['unconfirmed']}"
        f" (expired {e['expired']}); in the run: AllBlocksCleared {e['cleared_in_run']}"
        f" BlockRemoved {e['removed_in_run']}; sync before the load: applied"
        f" {e['sync_applied']} skipped {e['sync_skipped']}; gaps {e['gaps']} replays"
        f" {e['replays']} purges {e['purges']}"
    )


def main(argv: Sequence[str] | None = None) -> None:
    """CLI: see the module docstring."""
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--rows", type=Path, required=True, help="the e2e run's requests/ dir")
    ap.add_argument("--policies", default="kv,approx,round_robin")
    ap.add_argument(
        "--peers",
        default="sglang_cache_aware,vllm_router_cache_aware,vllm_router_kv_aware",
        help="e2e rows shown as they are (no replay)",
    )
    ap.add_argument("--workload", default="mooncake-conversation")
    ap.add_argument("--max-requests", type=int, default=800)
    ap.add_argument("--capacity-blocks", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, help="write the numbers here")
    ap.add_argument(
        "--results",
        type=Path,
        default=None,
        help="the e2e run's results.json, for its KV-event path per run (default: "
        "ROWS/../../../results.json when it exists)",
    )
    args = ap.parse_args(argv)
    results = args.results or args.rows / ".." / ".." / ".." / "results.json"
    doc: dict[str, Any] = json.loads(results.read_text()) if results.exists() else {}
    wl = load_workload(args.workload).slice(args.max_requests, 1.0)
    keys = RequestKeys(wl, 512)
    settings = ReplaySettings(capacity_blocks=args.capacity_blocks, seed=args.seed)
    par = parents(wl, keys)
    report: dict[str, Any] = {}
    for pol in [p for p in args.policies.split(",") if p]:
        own = replay_rows(wl, keys, pol, settings)
        out: dict[str, Any] = {"replay": continuations(wl, own, par), "replay_timing": timing(own)}
        print(_line(f"{pol} replay", out["replay"]))
        print(_timing_line(f"{pol} replay", out["replay_timing"]))
        path = args.rows / f"{pol}.jsonl"
        if path.exists():
            e2e = e2e_rows(path, wl)
            out["e2e"] = continuations(wl, e2e, par)
            rows, would = follow_rows(wl, keys, pol, settings, e2e)
            out["follow"] = continuations(wl, rows, par)
            joined = [(a, b, w) for a, b, w in zip(rows, e2e, would, strict=True) if b]
            out["follow_same_cached"] = sum(
                a["cached_tokens"] == b["cached_tokens"] for a, b, _ in joined
            )
            out["follow_agrees"] = sum(w == b["worker"] for _, b, w in joined)
            out["joined"] = len(joined)
            out["follow_timing"] = timing(rows)
            print(_line(f"{pol} e2e", out["e2e"]))
            print(_timing_line(f"{pol} e2e routing", out["follow_timing"]))
            print(
                f"{'':30s} e2e routing replayed: hit {out['follow']['hit_rate']:.4f}, same cached"
                f" tokens {out['follow_same_cached']}/{len(joined)}; {pol} would pick the e2e"
                f" worker {out['follow_agrees']}/{len(joined)}"
            )
        runs = doc.get("policies", {}).get(pol, {}).get("runs", [])
        if runs:
            out["event_path"] = [event_path(r) for r in runs]
            for i, e in enumerate(out["event_path"]):
                print(_event_line(f"{pol} e2e events [{i + 1}/{len(runs)}]", e))
        report[pol] = out
    for peer in [p for p in args.peers.split(",") if p]:
        path = args.rows / f"{peer}.jsonl"
        if path.exists():
            e2e = e2e_rows(path, wl)
            # The peer's placement on the replay's engines (round robin only carries the
            # forced worker through the director): its TTFT without the machine or path.
            rows, _ = follow_rows(wl, keys, "round_robin", settings, e2e)
            report[peer] = {"e2e": continuations(wl, e2e, par), "follow_timing": timing(rows)}
            print(_line(f"{peer} e2e", report[peer]["e2e"]))
            print(_timing_line(f"{peer} e2e routing", report[peer]["follow_timing"]))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
