"""What made a policy's requests prefill longer: steps shared with other prompts' chunks.

Issue 13 (TTFT end to end). With vLLM v1's chunked prefill an engine step computes every
scheduled prompt chunk together (`vllm/v1/core/sched/scheduler.py` `schedule()`: running
requests first, then waiting ones, FIFO, while the step's token budget lasts), and every
request in the step gets its token when the whole step ends. A request's prefill stage
(admission → first token) is therefore its own chunks' time *plus* the chunks of the
other prompts it shares steps with. For each request this prints how long its prefill
took against the same request alone on its worker (its uncached tokens in budget-sized
chunks through the sims' step time, `kvscorer_tools.sim.timing`, with the decode batch it
found at arrival), and sorts the excess by what caused it:

- `short`: requests with few uncached tokens (a cached continuation) whose prefill took
  over `--slow-ms` (they shared a step with a long prompt's chunk);
- for those, whether the other prompt was prefilling before (`before`: this one waited
  behind it, the queue ahead), admitted in the same step having arrived earlier
  (`same_step`), or arrived *after* this one and still joined its first step
  (`joined_after`: a later routing decision put a long prompt beside a request that was
  waiting for its first step).

Sources: an e2e run (`kv-scorer bench --mode e2e ... --out OUT`; the per-policy request
rows carry each sim's log: arrival, admission, first token, cached tokens) or a replay
run here (deterministic, simulated time):

    .venv/bin/python bench/routing/prefill_share.py --e2e OUT/run/cap-1000 --time-scale 5
    .venv/bin/python bench/routing/prefill_share.py --replay --max-requests 800 \\
        --policies kv,round_robin [--set kv.OPTION=VALUE ...]
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from kvscorer_tools.sim.timing import DEFAULT_TIMING

BUDGET = 8192  # tokens per step: the sims' and the replay's max_num_batched_tokens


def alone_ms(uncached: int, running: int, budget: int = BUDGET) -> float:
    """Model ms of `uncached` prompt tokens prefilled alone in budget-sized steps, each
    step also decoding `running` sequences."""
    t, left = 0.0, max(uncached, 1)
    while left > 0:
        chunk = min(left, budget)
        left -= chunk
        t += DEFAULT_TIMING.prefill_ms(chunk) + DEFAULT_TIMING.decode_ms_per_token(running)
    return t


def pct(xs: list[float], p: float) -> float:
    """Nearest-rank percentile (p in 0..1); NaN when empty."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[int(p * (len(s) - 1))]


def analyse(rows: list[dict[str, Any]], scale: float, short: int, slow_ms: float) -> str:
    """One line of figures for one policy's requests (`rows`: worker, arrival, admitted,
    first, prompt_tokens, cached_tokens, running; times in seconds, x `scale` = model)."""
    rows = [r for r in rows if r.get("first") and r.get("admitted")]
    by_worker: dict[Any, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        by_worker[r["worker"]].append(r)
    pre, excess, uncached = [], [], []
    kinds: Counter[str] = Counter()
    n_short = n_slow = 0
    for r in rows:
        u = r["prompt_tokens"] - r["cached_tokens"]
        p = (r["first"] - r["admitted"]) * 1000.0 * scale
        pre.append(p)
        uncached.append(float(u))
        excess.append(p - alone_ms(u, r["running"]))
        if u >= short:
            continue
        n_short += 1
        if p <= slow_ms:
            continue
        n_slow += 1
        for o in by_worker[r["worker"]]:
            lo, hi = max(r["admitted"], o["admitted"]), min(r["first"], o["first"])
            if o is r or hi <= lo + 1e-9:
                continue
            if o["admitted"] < r["admitted"] - 1e-9:
                kinds["before"] += 1
            elif o["arrival"] > r["arrival"]:
                kinds["joined_after"] += 1
            else:
                kinds["same_step"] += 1
    hit = sum(r["cached_tokens"] for r in rows) / max(sum(r["prompt_tokens"] for r in rows), 1)
    return (
        f"hit {hit:.3f} prefill p50 {pct(pre, 0.5):5.0f} mean {statistics.fmean(pre):5.0f}"
        f" | uncached p50 {pct(uncached, 0.5):5.0f} | excess over alone mean"
        f" {statistics.fmean(excess):5.1f} ms, > 20 ms {sum(e > 20 for e in excess):3d}"
        f" | short (< {short} tok) {n_short:3d}, prefill > {slow_ms:.0f} ms {n_slow:3d}"
        f" (other prompt: before {kinds['before']}, same_step {kinds['same_step']},"
        f" joined_after {kinds['joined_after']})"
    )


def e2e_rows(cap: Path) -> dict[str, list[dict[str, Any]]]:
    """Each policy's request rows of one e2e capacity folder (OUT/run/cap-N)."""
    out = {}
    for f in sorted((cap / "requests").glob("*.jsonl")):
        if not f.stem.startswith("sim"):
            out[f.stem] = [json.loads(x) for x in f.read_text().splitlines() if x.strip()]
    return out


def replay_rows(args: argparse.Namespace) -> dict[str, list[dict[str, Any]]]:
    """Run the replay for each policy and return its requests as rows."""
    from kvscorer_tools.bench import replay as rp
    from kvscorer_tools.bench.cli import parse_policy_options
    from kvscorer_tools.bench.workloads import load_workload

    wl = load_workload(args.workload)
    if args.max_requests:
        wl = wl.slice(args.max_requests, 1.0)
    settings = rp.ReplaySettings(capacity_blocks=args.capacity_blocks or None, seed=args.seed)
    settings.policy_options = parse_policy_options(None, args.set or [])
    keys = rp.RequestKeys(wl, settings.block_size)
    out: dict[str, list[dict[str, Any]]] = {}
    running_at: dict[int, int] = {}
    arrive = rp._SimWorker.arrive

    def spy(self: Any, r: Any, now: float) -> None:
        running_at[r.idx] = sum(
            1 for x in self.running if x.progress and x.progress.computed >= x.prompt_tokens
        )
        arrive(self, r, now)

    rp._SimWorker.arrive = spy  # type: ignore[method-assign]
    for pol in args.policies.split(","):
        running_at.clear()
        sim = rp._Replay(wl, keys, pol, settings)
        res = sim.run()
        print(
            f"{pol}: replay hit {res.hit_rate:.4f} TTFT p50 {res.ttft_p50_ms:.1f}"
            f" p99 {res.ttft_p99_ms:.0f} imbalance {res.imbalance:.3f}"
        )
        out[pol] = [
            {
                "worker": r.worker.endpoint if r.worker else "",
                "arrival": r.arrival,
                "admitted": r.admitted,
                "first": r.first,
                "prompt_tokens": r.prompt_tokens,
                "cached_tokens": r.progress.cached_tokens if r.progress else 0,
                "running": running_at.get(r.idx, 0),
            }
            for r in sim.reqs
            if r.first >= 0
        ]
    return out


def main() -> None:
    """CLI: see the module docstring."""
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--e2e", type=Path, help="an e2e run's OUT/run/cap-N folder")
    ap.add_argument("--time-scale", type=float, default=5.0, help="e2e: the run's")
    ap.add_argument("--replay", action="store_true")
    ap.add_argument("--workload", default="mooncake-conversation")
    ap.add_argument("--capacity-blocks", type=int, default=1000)
    ap.add_argument("--max-requests", type=int, default=800)
    ap.add_argument("--policies", default="kv,approx,round_robin,least_loaded")
    ap.add_argument("--set", action="append", help="POLICY.OPTION=VALUE (replay)")
    ap.add_argument("--seed", type=int, default=0, help="replay: the policies' random seed")
    ap.add_argument("--short", type=int, default=1500, help="short: fewer uncached tokens")
    ap.add_argument("--slow-ms", type=float, default=100.0)
    args = ap.parse_args()
    if args.e2e:
        rows, scale = e2e_rows(args.e2e), args.time_scale
    elif args.replay:
        rows, scale = replay_rows(args), 1.0
    else:
        ap.error("--e2e DIR or --replay")
    for pol, rs in rows.items():
        print(f"{pol:24s} {analyse(rs, scale, args.short, args.slow_ms)}")


if __name__ == "__main__":
    main()
