"""`kv_overlap`: the share of the prompt a worker holds cached, weighted by medium."""

from __future__ import annotations

from scorer.policy.plugin import Cycle, Scorer, plugin


@plugin("kv_overlap")
class KvOverlap(Scorer):
    """Cached leading blocks in the event-fed index (GPU 1.0, CPU 0.3, disk 0.05 per
    block by `index.medium_weights`) over the prompt's blocks: 0..1. The precise
    prefix scorer of llm-d, without any load term (combine it with load scorers)."""

    consumes = frozenset({"tokens", "index"})

    def prepare(self, cycle: Cycle) -> None:
        if not cycle.shown_matches:
            cycle.shown_matches = cycle.matches(self.ctx.parts.index)

    def score(self, cycle: Cycle) -> list[float]:
        matches = cycle.matches(self.ctx.parts.index)
        if not matches:
            return [0.0] * len(cycle.eligible)
        unit = max(cycle.request_blocks, 1.0)
        cands = cycle.candidates
        out = []
        for i in cycle.eligible:
            m = matches.get(cands[i].endpoint)
            out.append(0.0 if m is None else min(m.weighted / unit, 1.0))
        return out
