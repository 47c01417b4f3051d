"""End-to-end benchmark: real HTTP through a real Envoy, the scorer and simulated workers.

Topology per run (all on 127.0.0.1, ports chosen at run time):

    load generator ──HTTP──▶ Envoy ──ext_proc──▶ `kv-scorer serve` (policy under test)
                               └──ORIGINAL_DST──▶ `kv-scorer sim` x N ──ZMQ KV events──▶ scorer

Peers (sglang-router `cache_aware`, vllm-router `kv_aware`) front the same simulated
workers directly (see peers.py). Between policies every worker's prefix cache
is reset (`POST /reset_prefix_cache`), so each policy starts cold.

Time: the simulated workers run `speed` times faster than their model's time
(`kv-scorer sim --speed`), arrivals are compressed by the same factor, and measured
latencies are multiplied back, so TTFT is reported in *model* milliseconds comparable with
the replay. Proxy and scorer overheads are multiplied too: at --time-scale 20 a 2 ms hop
costs 40 model ms — a handicap every router in the run pays alike.

Hit rate comes from the workers' own counters (`vllm:prefix_cache_hits` /
`vllm:prefix_cache_queries`, deltas over the run); imbalance from the per-worker query
counters (= prompt tokens each worker received).

Modules: settings (E2ESettings), load (bodies, the load generator, progress line),
fleet (the simulated workers), scorer (`kv-scorer serve` + Envoy per policy), peers
(sglang-router, vllm-router), summary (results.json entry), run (the whole run).
"""

from __future__ import annotations

from kvscorer_tools.bench.e2e.fleet import SimFleet, SimSpec, reset_prefix_cache
from kvscorer_tools.bench.e2e.load import (
    LoadResult,
    completion_body,
    generate_load,
    progress_printer,
    run_load,
)
from kvscorer_tools.bench.e2e.run import run_e2e, run_ours
from kvscorer_tools.bench.e2e.scorer import (
    ScorerRun,
    counter_totals,
    scorer_config,
    start_scorers,
    write_stub_tokenizer,
)
from kvscorer_tools.bench.e2e.settings import MODEL, E2ESettings, Log
from kvscorer_tools.bench.e2e.summary import summarize

__all__ = [
    "MODEL",
    "E2ESettings",
    "LoadResult",
    "Log",
    "ScorerRun",
    "SimFleet",
    "SimSpec",
    "completion_body",
    "counter_totals",
    "generate_load",
    "progress_printer",
    "reset_prefix_cache",
    "run_e2e",
    "run_load",
    "run_ours",
    "scorer_config",
    "start_scorers",
    "summarize",
    "write_stub_tokenizer",
]
