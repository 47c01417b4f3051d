"""`lora`: prefer workers that have the request's LoRA adapter loaded."""

from __future__ import annotations

from scorer.policy.plugin import Cycle, Filter, plugin


@plugin("lora")
class LoraFilter(Filter):
    """A request for a LoRA adapter (RoutingRequest.lora) keeps only the workers whose
    scraped `vllm:lora_requests_info` lists it running or waiting; when none does, every
    worker stays (any of them can load it)."""

    consumes = frozenset({"load"})

    def filter(self, cycle: Cycle) -> None:
        lora = cycle.request.lora
        if not lora:
            return
        cands = cycle.candidates
        have = [lora in w.scraped.lora_running or lora in w.scraped.lora_waiting for w in cands]
        if not any(have):
            return
        f = cycle.filtered
        for i, h in enumerate(have):
            if not h and f[i] is None:
                f[i] = "lora_not_loaded"
