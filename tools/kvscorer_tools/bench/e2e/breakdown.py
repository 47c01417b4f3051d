"""Where each request's time to first token went, from the sims' `--request-log` lines.

The load generator knows when it sent a request and when its first token came back (wall
clock); each sim logs when the request reached its engine, when its prefill step started
and when it ended (the same monotonic clock: one machine). Joined by the prompt's token ids,
one request's TTFT splits into:

- `to_engine`: client → proxy / router (Envoy + ext_proc + scorer, or a peer) → the sim's
  HTTP parse, wall ms: the router's path;
- `queue`: waiting in the engine's FIFO before its prefill step, model ms: the routing's
  load effect;
- `prefill`: its prefill step (uncached tokens of the whole step), model ms: the routing's
  cache effect;
- `back`: the first token's way back to the client, wall ms.

`ttft_real_ms` counts the engine in model time and the two wall-clock legs once, as a real
deployment would (the GPU's time is the model's; the proxies' is real): the client's
TTFT x time scale multiplies every proxy millisecond by the scale, a handicap that grows
with the number of hops and with the CPU contention of the machine, not with routing.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from kvscorer_tools.bench.replay import percentile


def log_marks(paths: Sequence[Path]) -> list[int]:
    """The current size of each sim's request log (read from there after a run)."""
    return [p.stat().st_size if p.exists() else 0 for p in paths]


def read_logs(paths: Sequence[Path], marks: Sequence[int]) -> list[list[dict[str, Any]]]:
    """Per sim, the request-log lines written since `marks`."""
    out: list[list[dict[str, Any]]] = []
    for p, m in zip(paths, marks, strict=True):
        lines: list[dict[str, Any]] = []
        if p.exists():
            with p.open("rb") as f:
                f.seek(m)
                for raw in f:
                    if raw.endswith(b"\n"):
                        lines.append(json.loads(raw))
        out.append(lines)
    return out


def _stats(xs: list[float]) -> dict[str, float]:
    if not xs:
        return {}
    return {
        "p50": round(percentile(xs, 50), 1),
        "p99": round(percentile(xs, 99), 1),
        "mean": round(sum(xs) / len(xs), 1),
    }


def breakdown(
    records: Sequence[tuple[int, float, float]],
    sims: Sequence[Sequence[dict[str, Any]]],
    speed: float,
    dump: Path | None = None,
) -> dict[str, Any]:
    """TTFT split per leg (see the module docstring) and per worker.

    `records`: the load generator's (prompt key, sent, first token) per answered request,
    wall-clock seconds; `sims`: each worker's log lines for the same run; `dump`: a file
    to write one joined row per request to (JSON lines), for a closer look.
    """
    # A prompt sent twice in one run (a trace may repeat one) is paired in order: the
    # n-th send with the n-th arrival.
    by_key: dict[int, list[tuple[int, dict[str, Any]]]] = {}
    for w, lines in enumerate(sims):
        for line in lines:
            by_key.setdefault(int(line["key"]), []).append((w, line))
    for pending in by_key.values():
        pending.sort(key=lambda h: float(h[1]["arrival"]), reverse=True)
    legs: dict[str, list[float]] = {
        k: [] for k in ("to_engine_wall_ms", "queue_ms", "prefill_ms", "back_wall_ms")
    }
    real: list[float] = []
    rows: list[dict[str, Any]] = []
    n_workers = len(sims)
    count = [0] * n_workers
    queue_sum = [0.0] * n_workers
    ahead_max = [0] * n_workers
    for key, sent, first in sorted(records, key=lambda r: r[1]):
        found = by_key.get(key)
        if not found:
            continue
        w, s = found.pop()
        to_engine = (s["arrival"] - sent) * 1000.0
        queue = (s["admitted"] - s["arrival"]) * 1000.0 * speed
        prefill = (s["first"] - s["admitted"]) * 1000.0 * speed
        back = (first - s["first"]) * 1000.0
        legs["to_engine_wall_ms"].append(to_engine)
        legs["queue_ms"].append(queue)
        legs["prefill_ms"].append(prefill)
        legs["back_wall_ms"].append(back)
        real.append(to_engine + float(s["ttft_ms"]) + max(back, 0.0))
        count[w] += 1
        if dump is not None:
            rows.append({"worker": w, "sent": sent, "client_first": first, **s})
        queue_sum[w] += queue
        ahead_max[w] = max(ahead_max[w], int(s["waiting"]))
    if dump is not None:
        dump.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out: dict[str, Any] = {"matched": len(real)}
    if real:
        out["ttft_real_p50_ms"] = round(percentile(real, 50), 2)
        out["ttft_real_p99_ms"] = round(percentile(real, 99), 2)
    out["legs"] = {k: _stats(v) for k, v in legs.items()}
    out["per_worker"] = {
        "requests": count,
        "queue_mean_ms": [
            round(q / c, 1) if c else 0.0 for q, c in zip(queue_sum, count, strict=True)
        ],
        "waiting_max": ahead_max,
    }
    return out


class _Fleet(Protocol):
    request_logs: list[Path]


class _Load(Protocol):
    records: list[tuple[int, float, float]]


def add_breakdown(
    out: dict[str, Any],
    res: _Load,
    fleet: _Fleet,
    marks: Sequence[int],
    speed: float,
    name: str,
) -> None:
    """Put the run's breakdown (and its real-time TTFT p50/p99 on top) into `out`; the
    joined rows go to `<name>.jsonl` beside the sims' logs (the last repeat's)."""
    if not fleet.request_logs or not res.records:
        return
    dump = fleet.request_logs[0].parent / f"{name}.jsonl"
    b = breakdown(res.records, read_logs(fleet.request_logs, marks), speed, dump)
    for key in ("ttft_real_p50_ms", "ttft_real_p99_ms"):
        if key in b:
            out[key] = b.pop(key)
    out["breakdown"] = b
