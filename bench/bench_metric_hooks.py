"""Per-request cost of the metric hooks on the request path, µs per call (min of repeats).

* `observe_decision` (scorer.policy.metrics): every decision — decisions counter, the
  stage histograms, the matched-token ratio;
* `observe_completion` (scorer.api.inference_metrics): every finished request — the
  inference_objective_* families;
* `count_tokens`: the director's kv_scorer_response_tokens_total of a response's usage.

The shapes are the lean data path's (`bench/profile_datapath.py --shape lean`): a routed
decision with parse, tokenize, hash, match, score, explain, total and policy stages; a
routed completion with request bytes and a duration. Prints and writes
bench/out/metric_hooks.json.

    .venv/bin/python bench/bench_metric_hooks.py [--number 20000] [--repeat 7]
"""

from __future__ import annotations

import argparse
import json
import sys
import timeit
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scorer.api.inference_metrics import observe_completion  # noqa: E402
from scorer.config import load_config  # noqa: E402
from scorer.director import Completion, Director  # noqa: E402
from scorer.policy.base import PolicyContext, build_policy  # noqa: E402
from scorer.policy.metrics import observe_decision  # noqa: E402
from scorer.pool.workers import Pool  # noqa: E402
from scorer.routing import Decision, Reason  # noqa: E402
from scorer.usage import Usage  # noqa: E402

EP = "10.0.0.1:8000"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--number", type=int, default=20000)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--out", default=str(ROOT / "bench" / "out" / "metric_hooks.json"))
    args = ap.parse_args()

    stages = ("parse", "tokenize", "hash", "match", "score", "explain", "total", "policy")
    d = Decision([EP], Reason.KV_HIT, "kv", matched_tokens=160, request_tokens=288)
    d.stages = {s: 1e-5 * (i + 1) for i, s in enumerate(stages)}
    c = Completion("r1", "model-a", EP, True, None, False, 0.05, 2048)
    cfg = load_config(overrides={"pool": {"workers": [EP]}, "policy": "round_robin"}, environ={})
    pool = Pool.from_config(cfg)
    director = Director(
        cfg, pool, build_policy("round_robin", PolicyContext(pool=pool, config=cfg), {})
    )
    usage = Usage(288, 16, 160)
    calls: dict[str, Any] = {
        "observe_decision": lambda: observe_decision(d),
        "observe_completion": lambda: observe_completion(c),
        "count_tokens": lambda: director._count_tokens("model-a", EP, usage),
    }
    results = {}
    for name, fn in calls.items():
        best = min(timeit.repeat(fn, number=args.number, repeat=args.repeat))
        results[name] = best / args.number * 1e6
        print(f"{name:>20}: {results[name]:.2f} µs")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"benchmark": "metric_hooks", "us_per_call": results}, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
