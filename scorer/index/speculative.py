"""Speculative entries: blocks a request was just routed to, counted as held until a
confirming BlockStored arrives or their TTL ends."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence

from prometheus_client import Counter

from scorer.index.slots import Slot

SPECULATIVE = Counter(
    "kv_scorer_index_speculative_total",
    "Speculative block entries by outcome (inserted, confirmed, expired)",
    ["outcome"],
)


class SpeculativeEntries:
    """key → holder mask of speculative blocks, with per-slot expiry (`Slot.spec`) and a heap
    of insert batches ordered by expiry (expiring costs O(expired), not O(entries))."""

    def __init__(self) -> None:
        self.masks: dict[int, int] = {}
        self.heap: list[tuple[float, int, int, tuple[int, ...]]] = []
        self._seq = itertools.count()

    def insert(
        self,
        s: Slot,
        keys: Sequence[int],
        expiry: float,
        gpu: dict[int, int],
        step: int = 0,
        step_s: float = 0.0,
        last: float = float("inf"),
    ) -> None:
        """Count `keys` as held by slot `s` until `expiry` (keys it holds on GPU are skipped).

        Chunked (`step` > 0 keys per chunk): the engine stores a long prompt's blocks step
        by step, so chunk c (keys [c*step, (c+1)*step)) lives until `expiry` + `step_s` x
        (keys up to the chunk's end), capped at `last`: one expiry and one heap batch per
        chunk, not per key. Unchunked: every key until min(`expiry`, `last`)."""
        bit = 1 << s.bit
        masks = self.masks
        spec = s.spec
        n = len(keys)
        if step <= 0 or step_s <= 0.0:
            step = n or 1
        inserted = 0
        for lo in range(0, n, step):
            hi = min(lo + step, n)
            exp = min(expiry + step_s * hi, last)
            new: list[int] = []
            for k in keys[lo:hi]:
                if gpu.get(k, 0) & bit:
                    continue  # already confirmed
                masks[k] = masks.get(k, 0) | bit
                spec[k] = exp
                new.append(k)
            if new:
                heapq.heappush(self.heap, (exp, next(self._seq), s.bit, tuple(new)))
                inserted += len(new)
        if inserted:
            SPECULATIVE.labels("inserted").inc(inserted)

    def _clear(self, k: int, bit: int) -> None:
        m = self.masks.get(k, 0)
        if m & bit:
            m ^= bit
            if m:
                self.masks[k] = m
            else:
                del self.masks[k]

    def confirm(self, s: Slot, keys: Sequence[int]) -> None:
        """Slot `s` stored these keys for real: their speculative entries end."""
        bit = 1 << s.bit
        n = 0
        for k in keys:
            if s.spec.pop(k, None) is not None:
                self._clear(k, bit)
                n += 1
        if n:
            SPECULATIVE.labels("confirmed").inc(n)

    def drop(self, s: Slot) -> None:
        """Forget every speculative entry of slot `s`."""
        bit = 1 << s.bit
        for k in s.spec:
            self._clear(k, bit)
        s.spec.clear()

    def expire(self, now: float, by_bit: Sequence[Slot]) -> None:
        """Drop the entries whose TTL has passed (unless re-inserted later)."""
        heap = self.heap
        n = 0
        while heap and heap[0][0] <= now:
            _, _, b, keys = heapq.heappop(heap)
            s = by_bit[b]
            bit = 1 << b
            for k in keys:
                exp = s.spec.get(k)
                if exp is not None and exp <= now:  # not re-inserted later
                    del s.spec[k]
                    self._clear(k, bit)
                    n += 1
        if n:
            SPECULATIVE.labels("expired").inc(n)
