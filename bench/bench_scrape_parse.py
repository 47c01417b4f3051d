"""CPU per metrics page of the load scraper's parse (`scorer.pool.scrape.parse_metrics`),
against prometheus_client's text parser on the same page.

    .venv/bin/python bench/bench_scrape_parse.py [--iterations 3000]

The scorer scrapes every worker's Prometheus page every `load.scrape_interval_s` (0.2 s), on
its event loop: 8 workers are 40 pages a second. The page is a simulated worker's
(`kv-scorer sim`, vLLM v1's names, labels and histograms), idle and after 200 requests.
`library` parses the page's lines of the families we read with
`prometheus_client.parser.text_string_to_metric_families` (what parse_metrics did before);
`parse_metrics` is the scraper's own reading. Median µs per page of 5 runs. Prints a table
and writes bench/out/scrape_parse.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from kvscorer_tools.sim.metrics import SimMetrics
from scorer.pool.scrape import _WANTED, parse_metrics

ROOT = Path(__file__).resolve().parents[1]


def library(page: str) -> list[Any]:
    """The wanted families' lines through prometheus_client's parser (the old reading)."""
    keep = []
    for line in page.splitlines():  # the old prefilter: our families and their # lines
        if line.startswith("#"):
            parts = line.split(None, 3)
            if len(parts) >= 3 and parts[2].startswith(_WANTED):
                keep.append(line)
        elif line.startswith(_WANTED):
            keep.append(line)
    return [s for fam in text_string_to_metric_families("\n".join(keep)) for s in fam.samples]


def per_call_us(fn: Callable[[str], object], page: str, n: int) -> float:
    runs = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(n):
            fn(page)
        runs.append((time.perf_counter() - t) / n * 1e6)
    return statistics.median(runs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iterations", type=int, default=3000)
    ap.add_argument("--out", type=Path, default=ROOT / "bench/out/scrape_parse.json")
    args = ap.parse_args()
    m = SimMetrics("bench-model", 512, 1000, 4)
    pages = {"idle": m.exposition().decode()}
    for i in range(200):
        m.finished("stop")
        m.set_lora_state([], [f"adapter-{i % 3}"])
    pages["after 200 requests"] = m.exposition().decode()
    out: dict[str, Any] = {}
    print(f"{'page':<20} {'bytes':>7} {'library µs':>11} {'parse_metrics µs':>17}")
    for name, page in pages.items():
        row = {
            "bytes": len(page),
            "library_us": round(per_call_us(library, page, args.iterations), 2),
            "parse_metrics_us": round(per_call_us(parse_metrics, page, args.iterations), 2),
        }
        out[name] = row
        print(f"{name:<20} {row['bytes']:>7} {row['library_us']:>11} {row['parse_metrics_us']:>17}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
