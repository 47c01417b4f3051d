"""Where each e2e run's TTFT went, every repeat of every router, from results.json files.

Issue 13: the replay puts every policy's median queue at 2-4 ms (bench/routing/
peer_compare.py), the e2e runs at 45-70 ms. This prints, per run, the legs the harness
measured (wall ms to the engine; queue and prefill p50 in model ms) beside the CPU the
sims and the router used, so a queue that follows the machine rather than the placement
shows: the same for every policy behind one router, whatever its placement.

    .venv/bin/python bench/routing/e2e_legs.py \\
        bench/routing/results/routing-e2e-mooncake-2026-11-25-quiet8.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def main() -> None:
    """CLI: see the module docstring."""
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("results", type=Path, nargs="+")
    ap.add_argument(
        "--skip", default="sglang_cache_aware",
        help="routers left out of the correlation (sglang-router's sims tokenize text)",
    )  # fmt: skip
    args = ap.parse_args()
    skip = set(args.skip.split(","))
    pairs: list[tuple[float, float]] = []
    # Per router behind the runs: ours (any policy: Envoy + our scorer), or a peer binary.
    groups: dict[str, list[tuple[float, float, float]]] = {}
    print(
        f"{'file':34} {'policy':24} {'hit':>6} {'engine':>6} {'queue':>6} {'prefill':>7} "
        f"{'sims s':>6} {'router s':>8}"
    )
    for path in args.results:
        doc = json.loads(path.read_text())
        for name, entry in doc["policies"].items():
            for run in entry.get("runs", []):
                legs = run.get("breakdown", {}).get("legs", {})
                if not legs:
                    continue
                cpu = run.get("cpu_s", {})
                if name not in skip:
                    pairs.append((cpu.get("sims", 0.0), legs["queue_ms"]["p50"]))
                group = name.split("_")[0] if name.startswith(("vllm_router", "sglang")) else "ours"
                groups.setdefault(group, []).append(
                    (
                        cpu.get("sims", 0.0),
                        legs["to_engine_wall_ms"]["p50"],
                        legs["queue_ms"]["p50"],
                    )
                )
                print(
                    f"{path.stem[-34:]:34} {name:24} {run['hit_rate']:>6.4f} "
                    f"{legs['to_engine_wall_ms']['p50']:>6.1f} {legs['queue_ms']['p50']:>6.1f} "
                    f"{legs['prefill_ms']['p50']:>7.1f} {cpu.get('sims', 0):>6.1f} "
                    f"{cpu.get('router', 0):>8.2f}"
                )

    for group, xs in groups.items():
        n = len(xs)
        print(
            f"{group:8} {n:3} runs: sims CPU mean {sum(x[0] for x in xs) / n:.1f} s, to engine "
            f"p50 mean {sum(x[1] for x in xs) / n:.1f} ms wall, queue p50 mean "
            f"{sum(x[2] for x in xs) / n:.1f} ms model"
        )
    if len(pairs) > 2:
        r = statistics.correlation([a for a, _ in pairs], [b for _, b in pairs])
        print(f"{len(pairs)} runs: correlation of queue p50 with the sims' CPU seconds {r:.2f}")


if __name__ == "__main__":
    main()
