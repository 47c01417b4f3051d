"""Worker slots: one per (endpoint, dp_rank), each owning one bit of the holder masks."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

MEDIA = ("GPU", "CPU", "DISK")


@dataclass(slots=True, eq=False)
class Slot:
    """One (endpoint, dp_rank): its bit, engine-key map, per-medium counts, speculation."""

    endpoint: str
    rank: int
    bit: int
    # engine key → our key; insertion-ordered, so the oldest entries are evicted first.
    emap: dict[int, int] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(MEDIA, 0))
    spec: dict[int, float] = field(default_factory=dict)  # our key → expiry (monotonic)
    evictions: int = 0
    purges: int = 0


class SlotTable:
    """(endpoint, rank) → Slot, bit → Slot, endpoint → mask of its slots' bits.

    Bits are never reused: a slot stays allocated (empty after a purge) so masks stored
    in the index never point at another worker."""

    def __init__(self) -> None:
        self.slots: dict[tuple[str, int], Slot] = {}
        self.by_bit: list[Slot] = []
        self.bit_ep: list[str] = []  # slot bit → endpoint
        self.bit_obj: list[int] = []  # one shared int object per slot bit
        self.ep_mask: dict[str, int] = {}
        self.ep_slots: dict[str, int] = {}  # endpoint → number of its slots (dp ranks)
        self.all_mask = 0
        self.ranked = False  # True once an endpoint has a second slot (dp rank)

    def get(self, endpoint: str, rank: int | None) -> Slot | None:
        """The slot of (endpoint, rank), or None."""
        return self.slots.get((endpoint, rank or 0))

    def ensure(self, endpoint: str, rank: int | None) -> Slot:
        """The slot of (endpoint, rank), allocated with the next bit when new."""
        key = (endpoint, rank or 0)
        s = self.slots.get(key)
        if s is None:
            bit = len(self.by_bit)
            s = Slot(endpoint, rank or 0, bit)
            self.slots[key] = s
            self.by_bit.append(s)
            self.bit_ep.append(endpoint)
            if endpoint in self.ep_mask:
                self.ranked = True
            self.bit_obj.append(1 << bit)
            self.ep_mask[endpoint] = self.ep_mask.get(endpoint, 0) | (1 << bit)
            self.ep_slots[endpoint] = self.ep_slots.get(endpoint, 0) + 1
            self.all_mask |= 1 << bit
        return s

    def of(self, endpoint: str) -> list[Slot]:
        """Every slot (rank) of one endpoint."""
        return [s for s in self.slots.values() if s.endpoint == endpoint]

    def allowed(self, endpoints: Iterable[str] | None) -> int:
        """Mask of the slots of `endpoints`, or of every slot when None."""
        if endpoints is None:
            return self.all_mask
        mask = 0
        epm = self.ep_mask
        for ep in endpoints:
            mask |= epm.get(ep, 0)
        return mask
