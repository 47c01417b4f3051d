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
    if res.first_error:
        out["first_error"] = res.first_error
    return out
