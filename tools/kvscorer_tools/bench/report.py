"""Benchmark and demo output: a text table, results.json and PNG charts (matplotlib Agg)."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

# The keys every policy entry of results.json carries (the oracle only has hit_rate).
RESULT_KEYS = (
    "hit_rate",
    "ttft_p50_ms",
    "ttft_p99_ms",
    "throughput_rps",
    "imbalance",
    "requests",
    "errors",
)
ORACLE = "oracle"


def _fmt(v: Any, key: str) -> str:
    if v is None:
        return "-"
    if isinstance(v, float) and math.isnan(v):
        return "-"
    if key == "hit_rate":
        return f"{float(v):.3f}"
    if key in ("ttft_p50_ms", "ttft_p99_ms"):
        return f"{float(v):.0f}"
    if key in ("throughput_rps", "imbalance"):
        return f"{float(v):.2f}"
    return str(v)


# Figures shown with their spread over repeats (the [min, max] of each entry's "spread").
SPREAD_SHOWN = ("hit_rate", "ttft_p50_ms", "ttft_p99_ms")
SWEEP_TABLES = (
    ("hit_rate", "hit rate"),
    ("ttft_p50_ms", "TTFT p50 ms"),
    ("ttft_p99_ms", "TTFT p99 ms"),
    ("imbalance", "imbalance"),
)


def _range(r: Mapping[str, Any], key: str) -> str:
    lo_hi = r.get("spread", {}).get(key)
    if not lo_hi:
        return "-"
    lo, hi = lo_hi
    return f"{_fmt(lo, key)}-{_fmt(hi, key)}"


def format_table(policies: Mapping[str, Mapping[str, Any]], title: str | None = None) -> str:
    """One row per policy; a peer that failed shows its error instead of numbers.

    When entries were repeated (an e2e run with --repeats > 1), hit rate and TTFT p50/p99
    are medians and each is followed by its min-max over the repeats."""
    repeated = any(int(r.get("repeats", 1)) > 1 for r in policies.values())
    headers = ["policy", "hit rate", "TTFT p50 ms", "TTFT p99 ms", "req/s", "imbalance"]
    if repeated:
        headers = [
            "policy", "hit rate", "(min-max)", "TTFT p50 ms", "(min-max)",
            "TTFT p99 ms", "(min-max)", "req/s", "imbalance",
        ]  # fmt: skip
    headers += ["requests", "errors"]
    rows: list[list[str]] = []
    for name, r in policies.items():
        if "error" in r and "hit_rate" not in r:
            rows.append([name, f"error: {str(r['error'])[:70]}"])
            continue
        cells = [name]
        for k in RESULT_KEYS:
            cells.append(_fmt(r.get(k), k))
            if repeated and k in SPREAD_SHOWN:
                cells.append(_range(r, k))
        rows.append(cells)
    widths = [len(h) for h in headers]
    for row in rows:
        if len(row) == len(headers):
            widths = [max(w, len(c)) for w, c in zip(widths, row, strict=True)]
    lines = []
    if title:
        lines.append(title)
    lines.append(
        "  ".join(
            h.rjust(w) if i else h.ljust(w)
            for i, (h, w) in enumerate(zip(headers, widths, strict=True))
        )
    )
    lines.append("  ".join("-" * w for w in widths))
    for row in rows:
        if len(row) != len(headers):
            lines.append(f"{row[0].ljust(widths[0])}  {row[1]}")
            continue
        lines.append(
            "  ".join(
                c.rjust(w) if i else c.ljust(w)
                for i, (c, w) in enumerate(zip(row, widths, strict=True))
            )
        )
    return "\n".join(lines)


def format_breakdown(policies: Mapping[str, Mapping[str, Any]]) -> str | None:
    """Where each policy's TTFT went (e2e runs with the sims' request logs; see
    kvscorer_tools.bench.e2e.breakdown): real p50/p99 are medians over the repeats, the
    legs and CPU come from the last repeat; None when no entry has a breakdown.

    `real` counts the proxy legs once in wall time (the client's TTFT multiplies them by
    the time scale); `to engine` is the router's path in wall ms; queue and prefill are
    the engine's model ms; CPU is the seconds the router (Envoy + scorer, or the peer)
    and the eight sims used during the run."""
    headers = [
        "policy", "real p50", "real p99", "to engine p50 (wall)", "queue p50", "queue p99",
        "prefill p50", "router CPU s", "sims CPU s",
    ]  # fmt: skip
    rows: list[list[str]] = []
    for name, r in policies.items():
        last = (r.get("runs") or [r])[-1]
        b = last.get("breakdown")
        if not b:
            continue
        legs, cpu = b.get("legs", {}), last.get("cpu_s", {})

        def leg(key: str, q: str, legs: Mapping[str, Any] = legs) -> str:
            v = legs.get(key, {}).get(q)
            return "-" if v is None else f"{float(v):.0f}"

        rows.append(
            [
                name,
                # Medians over the repeats (as the main table's TTFT), the legs: last repeat.
                _fmt(r.get("ttft_real_p50_ms", last.get("ttft_real_p50_ms")), "ttft_p50_ms"),
                _fmt(r.get("ttft_real_p99_ms", last.get("ttft_real_p99_ms")), "ttft_p99_ms"),
                leg("to_engine_wall_ms", "p50"),
                leg("queue_ms", "p50"),
                leg("queue_ms", "p99"),
                leg("prefill_ms", "p50"),
                str(cpu.get("router", "-")),
                str(cpu.get("sims", "-")),
            ]
        )
    if not rows:
        return None
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(headers)]
    lines = ["where TTFT went (ms; real: median of the repeats, the rest: last repeat)"]
    for row in [headers, ["-" * w for w in widths], *rows]:
        lines.append(
            "  ".join(
                c.rjust(w) if i else c.ljust(w)
                for i, (c, w) in enumerate(zip(row, widths, strict=True))
            )
        )
    return "\n".join(lines)


def format_sweep(sweep: Mapping[str, Any]) -> str:
    """The capacity sweep as a table per figure (hit rate, TTFT p50 and p99, imbalance;
    those it has): one row per policy, one column per capacity; with the repeats'
    min-max when the sweep has them."""
    caps = [str(c) for c in sweep["capacities"]]
    lines: list[str] = []
    for key, label in SWEEP_TABLES:
        rows = sweep.get(key, {})
        if not rows:
            continue
        ranges = sweep.get(key + "_range", {})
        width = 19 if ranges else 11
        if lines:
            lines.append("")
        lines.append(f"capacity sweep ({label}; blocks per worker)")
        lines.append("policy".ljust(24) + "".join(c.rjust(width) for c in caps))
        for name, vals in rows.items():
            cells = []
            for i, v in enumerate(vals):
                cell = "-" if v is None else _fmt(float(v), key)
                rng = (ranges.get(name) or [None] * len(vals))[i]
                if v is not None and rng:
                    cell += f" ({_fmt(rng[0], key)}-{_fmt(rng[1], key)})"
                cells.append(cell.rjust(width))
            lines.append(name.ljust(24) + "".join(cells))
    return "\n".join(lines)


def results_doc(
    workload: str,
    policies: Mapping[str, Mapping[str, Any]],
    settings: Mapping[str, Any] | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """The results.json document: {"workload", "settings"?, "policies", ...extra}."""
    doc: dict[str, Any] = {"workload": workload}
    if settings is not None:
        doc["settings"] = dict(settings)
    doc["policies"] = {k: dict(v) for k, v in policies.items()}
    doc.update(extra)
    return doc


def write_json(path: Path, doc: Mapping[str, Any]) -> Path:
    """Write `doc` as indented JSON (creating the directory)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2, sort_keys=False) + "\n")
    return path


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # no display: files only
    import matplotlib.pyplot as plt

    return plt


def plot_policies(policies: Mapping[str, Mapping[str, Any]], path: Path, title: str) -> Path | None:
    """Bar charts: hit rate (with the oracle as a line) and TTFT p50/p99 per policy."""
    names = [n for n, r in policies.items() if n != ORACLE and "ttft_p50_ms" in r]
    if not names:
        return None
    plt = _plt()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    hits = [float(policies[n]["hit_rate"]) for n in names]
    x = list(range(len(names)))
    ax1.bar(x, hits, color="#4C72B0")
    oracle = policies.get(ORACLE, {}).get("hit_rate")
    if oracle is not None:
        ax1.axhline(float(oracle), color="#C44E52", linestyle="--", label=f"oracle {oracle:.3f}")
        ax1.legend(loc="upper right")
    ax1.set_xticks(x, names, rotation=20, ha="right")
    ax1.set_ylabel("prefix-cache hit rate (tokens)")
    ax1.set_title("hit rate (workers' counters)")
    for i, h in enumerate(hits):
        ax1.text(i, h, f"{h:.3f}", ha="center", va="bottom", fontsize=8)
    w = 0.38
    p50 = [float(policies[n]["ttft_p50_ms"]) for n in names]
    p99 = [float(policies[n]["ttft_p99_ms"]) for n in names]
    ax2.bar([i - w / 2 for i in x], p50, w, label="p50", color="#55A868")
    ax2.bar([i + w / 2 for i in x], p99, w, label="p99", color="#DD8452")
    ax2.set_xticks(x, names, rotation=20, ha="right")
    ax2.set_ylabel("TTFT (ms)")
    ax2.set_title("time to first token")
    ax2.legend()
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_sweep(sweep: Mapping[str, Any], path: Path, title: str) -> Path:
    """Hit rate and TTFT p99 per policy (and peer) against KV capacity per worker
    (categorical x axis); error bars span the repeats' min-max where the sweep has them."""
    plt = _plt()
    caps = [str(c) for c in sweep["capacities"]]
    panels = [("hit_rate", "prefix-cache hit rate")]
    if sweep.get("ttft_p99_ms"):
        panels.append(("ttft_p99_ms", "TTFT p99 (ms)"))
    fig, axes = plt.subplots(1, len(panels), figsize=(7 * len(panels), 4.4), squeeze=False)
    x = list(range(len(caps)))
    for ax, (key, label) in zip(axes[0], panels, strict=True):
        ranges = sweep.get(key + "_range", {})
        for name, vals in sweep[key].items():
            rng = ranges.get(name) or [None] * len(vals)
            pts = [(i, v, r) for i, v, r in zip(x, vals, rng, strict=True) if v is not None]
            if not pts:
                continue
            style = "--" if name == ORACLE else "-"
            xs, ys = [p[0] for p in pts], [float(p[1]) for p in pts]
            # Clamped: the median is rounded, the range is not.
            lo = [max(y - (p[2][0] if p[2] else y), 0.0) for y, p in zip(ys, pts, strict=True)]
            hi = [max((p[2][1] if p[2] else y) - y, 0.0) for y, p in zip(ys, pts, strict=True)]
            if any(lo) or any(hi):
                ax.errorbar(xs, ys, yerr=[lo, hi], fmt=style, marker="o", capsize=3, label=name)
            else:
                ax.plot(xs, ys, style, marker="o", label=name)
        ax.set_xticks(x, caps)
        ax.set_xlabel("KV capacity per worker (blocks)")
        ax.set_ylabel(label)
        if key == "ttft_p99_ms":
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def check_results_shape(doc: Mapping[str, Any]) -> list[str]:
    """Problems with a results.json document (empty when it has the agreed shape)."""
    problems = []
    if not isinstance(doc.get("workload"), str):
        problems.append("workload: missing or not a string")
    pols = doc.get("policies")
    if not isinstance(pols, dict) or not pols:
        return [*problems, "policies: missing or empty"]
    for name, r in pols.items():
        if not isinstance(r, dict):
            problems.append(f"policies.{name}: not an object")
            continue
        if "error" in r and "hit_rate" not in r:
            continue
        need: Sequence[str] = ("hit_rate",) if name == ORACLE else RESULT_KEYS
        for k in need:
            if not isinstance(r.get(k), int | float):
                problems.append(f"policies.{name}.{k}: missing or not a number")
    return problems
