"""One policy's results.json entry from the load result and the workers' counters."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvscorer_tools.bench.e2e.load import LoadResult
from kvscorer_tools.bench.replay import imbalance, percentile


def summarize(
    res: LoadResult,
    before: Sequence[tuple[float, ...]],
    after: Sequence[tuple[float, ...]],
    speed: float,
    requests: int,
) -> dict[str, Any]:
    """The results.json entry of one policy (times converted to model time)."""
    dq = [a[0] - b[0] for a, b in zip(after, before, strict=True)]
    dh = [a[1] - b[1] for a, b in zip(after, before, strict=True)]
    q = sum(dq)
    ttft_ms = [t * 1000.0 * speed for t in res.ttft_s]
    span = (res.t_end - res.t_start) * speed
    out: dict[str, Any] = {
        "hit_rate": round(sum(dh) / q, 4) if q else 0.0,
        "ttft_p50_ms": round(percentile(ttft_ms, 50), 2),
        "ttft_p99_ms": round(percentile(ttft_ms, 99), 2),
        "throughput_rps": round(res.done / span, 3) if span > 0 else 0.0,
        "imbalance": round(imbalance(dq), 3),
        "requests": requests,
        "errors": res.errors,
        "prompt_tokens_per_worker": [int(x) for x in dq],
    }
    if len(after[0]) >= 4:
        # The workers' own TTFT (model time, from arrival at the engine): the routing
        # effect without the proxy and load-generator overheads.
        n = sum(a[3] - b[3] for a, b in zip(after, before, strict=True))
        t = sum(a[2] - b[2] for a, b in zip(after, before, strict=True))
        if n > 0:
            out["ttft_engine_mean_ms"] = round(t / n * 1000.0, 2)
    out["ttft_mean_ms"] = round(sum(ttft_ms) / len(ttft_ms), 2) if ttft_ms else 0.0
    if res.send_lag_s:
        # Model ms, like the latencies: compare with TTFT to judge the time scale.
        out["send_lag_p99_ms"] = round(
            percentile([x * 1000.0 * speed for x in res.send_lag_s], 99), 2
        )
    if res.first_error:
        out["first_error"] = res.first_error
    return out


# The figures a repeated run reports as median + [min, max] over its repeats.
SPREAD_KEYS = (
    "hit_rate",
    "ttft_p50_ms",
    "ttft_p99_ms",
    "ttft_real_p50_ms",
    "ttft_real_p99_ms",
    "throughput_rps",
    "imbalance",
    "ttft_mean_ms",
    "ttft_engine_mean_ms",
    "send_lag_p99_ms",
)


def combine_repeats(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One results.json entry from the repeats of one policy.

    Each figure of SPREAD_KEYS is the median over the repeats that ran, with
    `spread[key] = [min, max]`; `errors` is the sum, `runs` keeps every repeat. A repeat
    that failed is counted in `failed_repeats`; when all failed the entry is {"error"}.
    """
    ok = [r for r in runs if "error" not in r]
    failed = [r for r in runs if "error" in r]
    if not ok:
        first = failed[0]["error"] if failed else "no repeat ran"
        return {"error": first, "repeats": len(runs)}
    out: dict[str, Any] = {}
    spread: dict[str, list[float]] = {}
    for key in SPREAD_KEYS:
        vals = sorted(float(r[key]) for r in ok if key in r)
        if not vals:
            continue
        n = len(vals)
        med = vals[n // 2] if n % 2 else (vals[n // 2 - 1] + vals[n // 2]) / 2
        out[key] = round(med, 4)
        spread[key] = [vals[0], vals[-1]]
    out["requests"] = ok[0]["requests"]
    out["errors"] = sum(int(r.get("errors", 0)) for r in ok)
    out["repeats"] = len(runs)
    out["spread"] = spread
    if failed:
        out["failed_repeats"] = len(failed)
        out["first_failure"] = str(failed[0]["error"])[:500]
    # Per-repeat details (counters, reasons) stay in `runs`.
    out["runs"] = list(runs)
    return out
