"""Worker slots: one per (endpoint, dp_rank), each owning one bit of the holder masks."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

MEDIA = ("GPU", "CPU", "DISK")


class EngineMapLike(Protocol):
    """A slot's engine key → our key map, insertion-ordered (oldest evicted first):
    `PyEngineMap` (a dict, the reference) or the compiled `scorer.native` EngineMap."""

    def __len__(self) -> int: ...
    def __contains__(self, k: object, /) -> bool: ...
    def __getitem__(self, k: int, /) -> int: ...
    def __delitem__(self, k: int, /) -> None: ...
    def get(self, k: int, /) -> int | None: ...
    def update_pairs(self, ekeys: Sequence[int], keys: Sequence[int]) -> list[int]: ...
    def pop_oldest(self, n: int) -> list[tuple[int, int]]: ...
    def clear(self) -> None: ...
    def items(self) -> Iterable[tuple[int, int]]: ...
    def keys(self) -> Iterable[int]: ...
    def values(self) -> Iterable[int]: ...


class PyEngineMap(dict[int, int]):
    """The pure-Python engine-key map: a dict plus the two bulk operations the index uses."""

    def update_pairs(self, ekeys: Sequence[int], keys: Sequence[int]) -> list[int]:
        """Insert zip(ekeys, keys) (the shorter one bounds it), like dict.update. Returns
        the values replaced: what an engine key led to before it was given another."""
        n = min(len(ekeys), len(keys))
        if self.keys().isdisjoint(ekeys):  # the common case: only new engine keys
            before = len(self)
            self.update(zip(ekeys, keys, strict=False))
            if len(self) - before == n:
                return []
            # An engine key twice in this batch: the values before its last pair.
            return [k for ek, k in zip(ekeys, keys, strict=False) if self[ek] != k]
        replaced = []
        get = self.get
        for ek, k in zip(ekeys, keys, strict=False):
            old = get(ek)
            if old is not None and old != k:
                replaced.append(old)
            self[ek] = k
        return replaced

    def pop_oldest(self, n: int) -> list[tuple[int, int]]:
        """Remove up to `n` oldest entries; returns them as [(engine key, our key)]."""
        victims = list(itertools.islice(self.items(), n))
        for ek, _ in victims:
            del self[ek]
        return victims


@dataclass(slots=True, eq=False)
class Slot:
    """One (endpoint, dp_rank): its bit, engine-key map, per-medium counts, speculation."""

    endpoint: str
    rank: int
    bit: int
    # engine key → our key; insertion-ordered, so the oldest entries are evicted first.
    emap: EngineMapLike = field(default_factory=PyEngineMap)
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(MEDIA, 0))
    spec: dict[int, float] = field(default_factory=dict)  # our key → expiry (monotonic)
    evictions: int = 0
    purges: int = 0
    # GPU blocks the engine reported removed (BlockRemoved, applied): its eviction count,
    # read by the block-life term (scorer.policy.fleet.CacheLife).
    removed: int = 0


class SlotTable:
    """(endpoint, rank) → Slot, bit → Slot, endpoint → mask of its slots' bits.

    A cleared (purged) slot is emptied in place or, when it holds more entries than the
    index clears in one loop turn, replaced by a fresh one on another bit (`replace`). A
    released slot (its worker left the pool) and a replaced one are detached at once and
    free their bit once the index has cleared it from every entry; the next new slot takes
    it (the lowest free bit first), so masks stay as wide as the live workers however many
    came and went, and a reused bit never names another worker's block."""

    def __init__(self, emap_factory: Callable[[], EngineMapLike] = PyEngineMap) -> None:
        self.emap_factory = emap_factory
        self.slots: dict[tuple[str, int], Slot] = {}
        self.by_bit: list[Slot] = []
        self.bit_ep: list[str] = []  # slot bit → endpoint
        self.bit_obj: list[int] = []  # one shared int object per slot bit
        self.ep_mask: dict[str, int] = {}
        self.ep_slots: dict[str, int] = {}  # endpoint → number of its slots (dp ranks)
        self.all_mask = 0
        self.ranked = False  # True once an endpoint has a second slot (dp rank)
        self.free_bits: list[int] = []  # freed bits (a heap: the lowest is reused first)
        # `allowed`'s last answer: (endpoints, mask), dropped when a slot is made or freed.
        self._last: tuple[list[str], int] | None = None

    def get(self, endpoint: str, rank: int | None) -> Slot | None:
        """The slot of (endpoint, rank), or None."""
        return self.slots.get((endpoint, rank or 0))

    def ensure(self, endpoint: str, rank: int | None) -> Slot:
        """The slot of (endpoint, rank), allocated with the next bit when new."""
        key = (endpoint, rank or 0)
        s = self.slots.get(key)
        if s is None:
            s = self._new(endpoint, rank or 0)
            bit = s.bit
            self.slots[key] = s
            if endpoint in self.ep_mask:
                self.ranked = True
            self.ep_mask[endpoint] = self.ep_mask.get(endpoint, 0) | (1 << bit)
            self.ep_slots[endpoint] = self.ep_slots.get(endpoint, 0) + 1
            self.all_mask |= 1 << bit
            self._last = None
        return s

    def _new(self, endpoint: str, rank: int) -> Slot:
        """A new slot on the lowest free bit (or a new one), not yet in `slots`."""
        if self.free_bits:
            bit = heapq.heappop(self.free_bits)
            s = Slot(endpoint, rank, bit, self.emap_factory())
            self.by_bit[bit] = s
            self.bit_ep[bit] = endpoint
        else:
            bit = len(self.by_bit)
            s = Slot(endpoint, rank, bit, self.emap_factory())
            self.by_bit.append(s)
            self.bit_ep.append(endpoint)
            self.bit_obj.append(1 << bit)
        return s

    def replace(self, old: Slot) -> Slot:
        """Put a fresh slot (another bit, no entries, `old`'s counters) in `old`'s place in
        the table and return it; `old` is detached (no lookup or mask names it from now
        on), its bit taken until `free`. The endpoint keeps its place in every map."""
        s = self._new(old.endpoint, old.rank)
        s.evictions, s.purges, s.removed = old.evictions, old.purges, old.removed
        self.slots[old.endpoint, old.rank] = s
        swap = (1 << old.bit) | (1 << s.bit)
        self.ep_mask[old.endpoint] ^= swap
        self.all_mask ^= swap
        self._last = None
        return s

    def detach(self, endpoint: str) -> list[Slot]:
        """Take every slot of `endpoint` out of the table (no lookup, mask or endpoint list
        names them from now on); returns them. Their bits stay taken until `free`."""
        gone = self.of(endpoint)
        for s in gone:
            del self.slots[s.endpoint, s.rank]
            self.all_mask &= ~(1 << s.bit)
        if gone:
            self._last = None
            del self.ep_mask[endpoint]
            del self.ep_slots[endpoint]
        return gone

    def free(self, s: Slot) -> None:
        """A detached slot's bit is in no entry any more: the next new slot may take it."""
        self.bit_ep[s.bit] = ""  # `by_bit` keeps the empty slot
        s.emap = PyEngineMap()  # (for queued speculative expiries) without its memory
        heapq.heappush(self.free_bits, s.bit)

    def of(self, endpoint: str) -> list[Slot]:
        """Every slot (rank) of one endpoint."""
        return [s for s in self.slots.values() if s.endpoint == endpoint]

    def allowed(self, endpoints: Iterable[str] | None) -> int:
        """Mask of the slots of `endpoints`, or of every slot when None."""
        if endpoints is None:
            return self.all_mask
        last = self._last
        # Decisions ask for the same candidates again and again: one list comparison (its
        # strings are the same objects) instead of one lookup per endpoint.
        if last is not None and type(endpoints) is list and endpoints == last[0]:
            return last[1]
        mask = 0
        epm = self.ep_mask
        for ep in endpoints:
            mask |= epm.get(ep, 0)
        if type(endpoints) is list:
            self._last = (endpoints.copy(), mask)
        return mask
