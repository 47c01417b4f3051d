"""`kv_usage`: a worker with more free KV cache is better."""

from __future__ import annotations

from scorer.policy.plugin import Cycle, Scorer, plugin


@plugin("kv_usage")
class KvUsage(Scorer):
    """1 - scraped `vllm:kv_cache_usage_perc` (fresh scrapes only, else 1)."""

    consumes = frozenset({"load"})

    def score(self, cycle: Cycle) -> list[float]:
        ku = cycle.load.kv_usage
        return [1.0 - ku[i] for i in cycle.eligible]
