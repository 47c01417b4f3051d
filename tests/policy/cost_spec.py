"""The cost model written out plainly from docs/policy.md, one worker at a time.

scorer/policy/cost.py holds the one implementation (a term at a time, for speed); these
functions are its specification for the tests: on random fleets every explanation row of
a real decision must equal what they compute.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class Terms:
    prefill: float
    decode: float
    waiting: float
    kv_usage: float
    fresh: bool

    @property
    def total(self) -> float:
        return self.prefill + self.decode


def load_terms(w: Any, now: float, stale_after_s: float, waiting_request_blocks: float) -> Terms:
    """active_prefill = max(in-flight prefill, waiting * wrb); active_decode = max(in-flight
    decode, kv_usage * num_gpu_blocks); scraped values only from a fresh scrape."""
    fl, sc = w.inflight, w.scraped
    fresh = sc.at > 0.0 and now - sc.at <= stale_after_s
    if not fresh:
        return Terms(fl.prefill_blocks, fl.decode_blocks, 0.0, 0.0, False)
    prefill = max(fl.prefill_blocks, sc.waiting * waiting_request_blocks)
    decode = fl.decode_blocks
    if sc.num_gpu_blocks:
        decode = max(decode, sc.kv_usage * sc.num_gpu_blocks)
    return Terms(prefill, decode, sc.waiting, sc.kv_usage, True)


def busy_reason(w: Any, t: Terms, opts: Any) -> str | None:
    if t.fresh:
        if opts.busy_waiting is not None and t.waiting >= opts.busy_waiting:
            return "busy_waiting"
        if opts.busy_kv_usage is not None and t.kv_usage >= opts.busy_kv_usage:
            return "busy_kv_usage"
    if opts.busy_inflight is not None and w.inflight.requests >= opts.busy_inflight:
        return "busy_inflight"
    return None


def decayed_credit(load: float, load_min: float, request_blocks: float, decay: float) -> float:
    """credit = 1 / (1 + decay * (load - load_min) / max(load_min, R, 1))."""
    if decay <= 0.0 or load <= load_min:
        return 1.0
    return 1.0 / (1.0 + decay * (load - load_min) / max(load_min, request_blocks, 1.0))


def cost(
    scale: float, prefill: float, decode: float, request_blocks: float, credit: float
) -> float:
    """scale * max(prefill + R - credit, 0) + decode + R."""
    return scale * max(prefill + request_blocks - credit, 0.0) + decode + request_blocks


def duplicate_term(dup: float, best_overlap: float, overlap: float) -> float:
    """duplicate_cost x (best weighted overlap among the eligible - this one's)."""
    return dup * max(best_overlap - overlap, 0.0)


def previous_by_prefix(blocks: dict[int, int], prompt_blocks: int, min_match: float) -> int | None:
    """Without a session id: the one candidate holding the longest cached prefix, when that
    covers min_match of the prompt (several equally long: a shared prefix, no one turn)."""
    top = max(blocks.values(), default=0)
    if top <= 0 or top < min_match * prompt_blocks:
        return None
    holders = [i for i, b in blocks.items() if b == top]
    return holders[0] if len(holders) == 1 else None
