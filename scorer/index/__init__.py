"""The block index: which worker holds which prompt blocks, on which medium.

Layout (built for 64+ workers and millions of blocks):

* every (endpoint, dp_rank) gets a *slot*: one bit in a python-int bitmask;
* one dict per medium (GPU, CPU, DISK): our block key → bitmask of the slots holding it
  (a single holder's mask is the slot's one shared bit object; equal multi-holder masks
  share one object too, up to a bounded cache, so masks cost ~no memory per block);
* one dict per slot: engine block hash (`scorer.blocks.engine_key`) → our key, to map
  `BlockRemoved` and `parent_block_hash` back into our hash space;
* speculative entries (a request just routed there; its blocks are being computed) live in
  their own key → bitmask dict with a per-slot expiry, and count as GPU blocks.

`match` looks every prompt key up in the GPU dict with C-level iteration (`map(dict.get)`),
finds where the holder mask changes in C (`map(ne)` + `compress`) and runs Python code only
per change (an AND, and the workers that drop out there), so a 256-block prompt costs ~256
dict lookups plus O(workers) whatever the worker count. The CPU and disk dicts are only
read when one of the prompt's keys is in them (one C-level `isdisjoint` scan), and then only
the positions with a CPU/disk copy get Python work: O(blocks + non-GPU holders).
A worker's count is its longest *contiguous* prefix: the first missing block freezes it.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from operator import ne, or_
from typing import Any

from prometheus_client import Counter, Gauge

from scorer.config import IndexConfig

MEDIA = ("GPU", "CPU", "DISK")
_MASK_CACHE = 1 << 16

INDEX_ENTRIES = Gauge(
    "kv_scorer_index_entries", "Stored (block, worker) entries in the block index", ["medium"]
)
INDEX_EVICTIONS = Counter(
    "kv_scorer_index_evictions_total",
    "Index entries dropped because a worker exceeded index.max_blocks_per_worker",
)
# The entries gauge is read at scrape time from the live indexes (no per-event metric
# update on the ingest path).
_LIVE: weakref.WeakSet[BlockIndex] = weakref.WeakSet()


def _entries_of(medium: str) -> Callable[[], float]:
    return lambda: float(sum(ix.entries(medium) for ix in list(_LIVE)))


for _m in MEDIA:
    INDEX_ENTRIES.labels(_m).set_function(_entries_of(_m))
SPECULATIVE = Counter(
    "kv_scorer_index_speculative_total",
    "Speculative block entries by outcome (inserted, confirmed, expired)",
    ["outcome"],
)


@dataclass(slots=True)
class Match:
    """How much of a prompt one worker holds."""

    blocks: int  # contiguous leading blocks held (any medium)
    by_medium: dict[str, int]  # those blocks split by medium ("GPU", "CPU", "DISK")
    weighted: float  # sum of medium weights over the matched blocks


@dataclass(slots=True, eq=False)
class _Slot:
    endpoint: str
    rank: int
    bit: int
    # engine key → our key; insertion-ordered, so the oldest entries are evicted first.
    emap: dict[int, int] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(MEDIA, 0))
    spec: dict[int, float] = field(default_factory=dict)  # our key → expiry (monotonic)
    evictions: int = 0
    purges: int = 0


# _BYTE_BITS[j][v]: the bit indices set in byte value v at byte position j (slots 0-127).
_BYTE_BITS = [
    [tuple(8 * j + i for i in range(8) if v >> i & 1) for v in range(256)] for j in range(16)
]


def _bits(mask: int) -> list[int]:
    """Indices of the set bits of `mask` (ascending)."""
    if not mask & (mask - 1):  # 0 or one bit: the common case of a single dropout
        return [mask.bit_length() - 1] if mask else []
    nbytes = (mask.bit_length() + 7) // 8
    if nbytes <= len(_BYTE_BITS):
        # One table lookup per byte instead of three big-int operations per bit.
        out: list[int] = []
        for j, v in enumerate(mask.to_bytes(nbytes, "little")):
            if v:
                out += _BYTE_BITS[j][v]
        return out
    res = []
    while mask:
        low = mask & -mask
        res.append(low.bit_length() - 1)
        mask ^= low
    return res


def _depths(masks: list[int], allowed: int) -> tuple[dict[int, int], list[int], list[int]]:
    """Bit index → matched blocks, from the holder masks of the prompt's blocks.

    A worker's depth is the length of the leading run of blocks whose masks all contain its
    bit. Equal consecutive masks are found in C (`map(ne)` + `compress`), so the Python loop
    runs once per *change* of mask, not once per block: O(blocks) C work + O(changes +
    workers) Python work. Also returns the run starts and the alive set of each run (the
    workers counting that run's blocks), for the media split.
    """
    n = len(masks)
    starts = [0, *itertools.compress(range(1, n), map(ne, masks, itertools.islice(masks, 1, None)))]
    counts: dict[int, int] = {}
    run_alive: list[int] = []
    alive = allowed
    for st in starts:
        nxt = alive & masks[st]
        if nxt != alive:
            if st:  # a worker without block 0 matches nothing: not in the result
                for b in _bits(alive & ~nxt):
                    counts[b] = st
            alive = nxt
            if not alive:
                del starts[len(run_alive) :]
                return counts, starts, run_alive
        run_alive.append(alive)
    for b in _bits(alive):
        counts[b] = n
    return counts, starts, run_alive


class BlockIndex:
    """Key → workers (medium, dp_rank, expiry), updated from KV events, read by policies."""

    def __init__(self, config: IndexConfig | None = None) -> None:
        self.config = config or IndexConfig.model_validate({})
        w = self.config.medium_weights
        self._wg = float(w.get("GPU", 1.0))
        self._wc = float(w.get("CPU", 0.3))
        self._wd = float(w.get("DISK", 0.05))
        self._media: dict[str, dict[int, int]] = {m: {} for m in MEDIA}
        self._gpu = self._media["GPU"]
        self._cpu = self._media["CPU"]
        self._disk = self._media["DISK"]
        self._spec: dict[int, int] = {}
        self._spec_heap: list[tuple[float, int, int, tuple[int, ...]]] = []
        self._spec_seq = itertools.count()
        self._slots: dict[tuple[str, int], _Slot] = {}
        self._by_bit: list[_Slot] = []
        self._bit_ep: list[str] = []  # slot bit → endpoint
        self._ranked = False  # True once an endpoint has a second slot (dp rank)
        self._bit_obj: list[int] = []  # one shared int object per slot bit
        # Canonical objects of multi-holder masks (bounded: with many workers the number
        # of distinct holder sets can grow without limit; past the bound masks are stored
        # as they come).
        self._masks: dict[int, int] = {}
        self._ep_mask: dict[str, int] = {}
        self._all_mask = 0
        self.max_blocks = self.config.max_blocks_per_worker
        self.clock = time.monotonic
        _LIVE.add(self)

    # ---- slots -------------------------------------------------------------------------

    def _slot(self, endpoint: str, rank: int | None) -> _Slot:
        key = (endpoint, rank or 0)
        s = self._slots.get(key)
        if s is None:
            bit = len(self._by_bit)
            s = _Slot(endpoint, rank or 0, bit)
            self._slots[key] = s
            self._by_bit.append(s)
            self._bit_ep.append(endpoint)
            if endpoint in self._ep_mask:
                self._ranked = True
            self._bit_obj.append(1 << bit)
            self._masks[1 << bit] = self._bit_obj[bit]
            self._ep_mask[endpoint] = self._ep_mask.get(endpoint, 0) | (1 << bit)
            self._all_mask |= 1 << bit
        return s

    def _canon(self, mask: int) -> int:
        """The shared int object for `mask` (cached while the cache is under its bound)."""
        c = self._masks.get(mask)
        if c is not None:
            return c
        if len(self._masks) < _MASK_CACHE:
            self._masks[mask] = mask
        return mask

    def endpoints(self) -> list[str]:
        """Endpoints the index has seen (events or speculative inserts)."""
        return list(self._ep_mask)

    def lookup_engine(self, endpoint: str, rank: int | None, ekey: int) -> int | None:
        """Our key for an engine block hash (`engine_key`) on one worker, or None."""
        s = self._slots.get((endpoint, rank or 0))
        return None if s is None else s.emap.get(ekey)

    # ---- updates (from events) ---------------------------------------------------------

    def add(
        self,
        endpoint: str,
        rank: int | None,
        ekeys: Sequence[int],
        keys: Sequence[int],
        medium: str = "GPU",
    ) -> int:
        """A worker stores these blocks (engine keys ↔ our keys). Returns new entries."""
        s = self._slots.get((endpoint, rank or 0)) or self._slot(endpoint, rank)
        d = self._media.get(medium)
        if d is None:
            d, medium = self._gpu, "GPU"
        bit = self._bit_obj[s.bit]
        emap = s.emap
        emap.update(zip(ekeys, keys, strict=False))
        # One C-level pass inserts the absent keys with the slot's shared bit object (a
        # single-holder mask costs no memory of its own) and returns every key's mask.
        before = len(d)
        masks = list(map(d.setdefault, keys, itertools.repeat(bit)))
        new = len(d) - before
        if masks.count(bit) != len(masks):
            # Some blocks are held by other workers too: add our bit to those masks.
            canon = self._masks
            for k, m in zip(keys, masks, strict=True):
                if not m & bit:
                    m |= bit
                    # Equal masks share one int object (memory: one per block otherwise).
                    d[k] = canon.get(m) or self._canon(m)
                    new += 1
        if new:
            s.counts[medium] += new
        if s.spec:
            self._confirm(s, keys)
        if len(emap) > self.max_blocks:
            self._evict(s, len(emap) - self.max_blocks + max(1, self.max_blocks // 64))
        return new

    def remove(
        self, endpoint: str, rank: int | None, ekeys: Sequence[int], medium: str = "GPU"
    ) -> tuple[int, int]:
        """A worker dropped these blocks from `medium`. Returns (removed, unknown)."""
        s = self._slots.get((endpoint, rank or 0))
        if s is None:
            return 0, len(ekeys)
        medium = medium if medium in self._media else "GPU"
        d = self._media[medium]
        bit = 1 << s.bit
        emap = s.emap
        others = [self._media[m] for m in MEDIA if m != medium and s.counts[m]]
        removed = unknown = 0
        for ek in ekeys:
            k = emap.get(ek)
            if k is None:
                unknown += 1
                continue
            m = d.get(k, 0)
            if m & bit:
                m ^= bit
                if m:
                    d[k] = self._masks.get(m) or self._canon(m)
                else:
                    del d[k]
                removed += 1
            if not any(o.get(k, 0) & bit for o in others):
                del emap[ek]
        if removed:
            s.counts[medium] -= removed
        return removed, unknown

    def _drop_keys(self, s: _Slot, keys: Sequence[int]) -> None:
        bit = 1 << s.bit
        for medium in MEDIA:
            if not s.counts[medium]:
                continue
            d = self._media[medium]
            n = 0
            for k in keys:
                m = d.get(k, 0)
                if m & bit:
                    m ^= bit
                    if m:
                        d[k] = self._masks.get(m) or self._canon(m)
                    else:
                        del d[k]
                    n += 1
            s.counts[medium] -= n

    def _evict(self, s: _Slot, n: int) -> None:
        # Oldest first: dicts keep insertion order. Batched so the scan stays amortised.
        victims = list(itertools.islice(s.emap.items(), n))
        for ek, _ in victims:
            del s.emap[ek]
        self._drop_keys(s, [k for _, k in victims])
        s.evictions += len(victims)
        INDEX_EVICTIONS.inc(len(victims))

    def clear(self, endpoint: str, rank: int | None = None) -> None:
        """Forget one (endpoint, rank) (AllBlocksCleared), or every rank of it when rank is None."""
        for s in list(self._slots.values()):
            if s.endpoint != endpoint or (rank is not None and s.rank != rank):
                continue
            self._drop_keys(s, list(s.emap.values()))
            s.emap.clear()
            self._drop_spec(s)

    def purge(self, endpoint: str) -> None:
        """Forget everything about a worker (restart, unrecoverable gap, removal)."""
        self.clear(endpoint)
        for s in self._slots.values():
            if s.endpoint == endpoint:
                s.purges += 1

    # ---- speculative entries -----------------------------------------------------------

    def insert_speculative(
        self, endpoint: str, keys: Sequence[int], ttl_s: float | None = None
    ) -> None:
        """The router just sent these blocks to `endpoint`: count them as held (GPU) until a
        confirming BlockStored replaces them or `ttl_s` (default index.speculative_ttl_s) ends."""
        ttl = self.config.speculative_ttl_s if ttl_s is None else ttl_s
        if ttl <= 0 or not keys:
            return
        s = self._slot(endpoint, 0)
        bit = 1 << s.bit
        exp = self.clock() + ttl
        spec = self._spec
        gpu = self._gpu
        new: list[int] = []
        for k in keys:
            if gpu.get(k, 0) & bit:
                continue  # already confirmed
            spec[k] = spec.get(k, 0) | bit
            s.spec[k] = exp
            new.append(k)
        if new:
            heapq.heappush(self._spec_heap, (exp, next(self._spec_seq), s.bit, tuple(new)))
            SPECULATIVE.labels("inserted").inc(len(new))

    def _spec_clear(self, k: int, bit: int) -> None:
        m = self._spec.get(k, 0)
        if m & bit:
            m ^= bit
            if m:
                self._spec[k] = m
            else:
                del self._spec[k]

    def _confirm(self, s: _Slot, keys: Sequence[int]) -> None:
        bit = 1 << s.bit
        n = 0
        for k in keys:
            if s.spec.pop(k, None) is not None:
                self._spec_clear(k, bit)
                n += 1
        if n:
            SPECULATIVE.labels("confirmed").inc(n)

    def _drop_spec(self, s: _Slot) -> None:
        bit = 1 << s.bit
        for k in s.spec:
            self._spec_clear(k, bit)
        s.spec.clear()

    def expire(self, now: float | None = None) -> None:
        """Drop speculative entries whose TTL has passed (match calls this)."""
        heap = self._spec_heap
        if not heap:
            return
        now = self.clock() if now is None else now
        n = 0
        while heap and heap[0][0] <= now:
            _, _, b, keys = heapq.heappop(heap)
            s = self._by_bit[b]
            bit = 1 << b
            for k in keys:
                exp = s.spec.get(k)
                if exp is not None and exp <= now:  # not re-inserted later
                    del s.spec[k]
                    self._spec_clear(k, bit)
                    n += 1
        if n:
            SPECULATIVE.labels("expired").inc(n)

    # ---- queries -----------------------------------------------------------------------

    def match(
        self, keys: Sequence[int], endpoints: Iterable[str] | None = None
    ) -> dict[str, Match]:
        """Per worker, the contiguous leading blocks of `keys` it holds (only workers with
        >= 1 matched block appear). Speculative blocks count as GPU. Several workers may
        share one (equal) Match object: treat the result as read-only."""
        if self._spec_heap:
            self.expire()
        if endpoints is None:
            allowed = self._all_mask
        else:
            allowed = 0
            epm = self._ep_mask
            for ep in endpoints:
                allowed |= epm.get(ep, 0)
        if not allowed or not keys:
            return {}
        cpu, disk = self._cpu, self._disk
        # A prompt with no block on CPU/disk anywhere (the common case) pays one C-level
        # membership scan per non-empty slow medium and takes the GPU-only path.
        if (cpu and not cpu.keys().isdisjoint(keys)) or (disk and not disk.keys().isdisjoint(keys)):
            return self._match_media(keys, allowed)
        zero = itertools.repeat(0)
        masks = list(map(self._gpu.get, keys, zero))
        spec = self._spec
        if spec and not spec.keys().isdisjoint(keys):
            masks = list(map(or_, masks, map(spec.get, keys, zero)))
        counts = _depths(masks, allowed)[0]
        if not counts:
            return {}
        wg = self._wg
        out: dict[str, Match] = {}
        eps = self._bit_ep
        shared: dict[int, Match] = {}  # one Match per distinct depth
        if self._ranked:  # an endpoint may have several slots (dp ranks): keep its best
            for b, c in counts.items():
                cur = out.get(eps[b])
                if cur is None or c > cur.blocks:
                    m = shared.get(c)
                    if m is None:
                        m = shared[c] = Match(c, {"GPU": c}, c * wg)
                    out[eps[b]] = m
            return out
        for b, c in counts.items():
            m = shared.get(c)
            if m is None:
                m = shared[c] = Match(c, {"GPU": c}, c * wg)
            out[eps[b]] = m
        return out

    def _match_media(self, keys: Sequence[int], allowed: int) -> dict[str, Match]:
        """`match` when some prompt block is on CPU/disk somewhere.

        A block on several media counts once, on its best one (GPU/speculative > CPU > DISK).
        Cost: a few C-level passes over the keys, then Python work only for the (position,
        worker) pairs whose copy is CPU/disk-only: O(blocks + such holders), never
        O(blocks x workers).
        """
        zero = itertools.repeat(0)
        g = list(map(self._gpu.get, keys, zero))
        spec = self._spec
        if spec and not spec.keys().isdisjoint(keys):
            g = list(map(or_, g, map(spec.get, keys, zero)))
        cpu, disk = self._cpu, self._disk
        n = len(g)
        c = list(map(cpu.get, keys, zero)) if cpu else None
        d = list(map(disk.get, keys, zero)) if disk else None
        # Positions with a CPU/disk copy anywhere (found in C); usually a few. Only those
        # get Python work: their combined mask, then their split among the alive workers.
        if c is not None and d is not None:
            slow_pos = sorted({*itertools.compress(range(n), c), *itertools.compress(range(n), d)})
        else:
            slow_pos = list(itertools.compress(range(n), c if c is not None else d or ()))
        tot = list(g)
        for i in slow_pos:
            tot[i] = g[i] | (c[i] if c is not None else 0) | (d[i] if d is not None else 0)
        counts, starts, run_alive = _depths(tot, allowed)
        if not counts:
            return {}
        n_cpu: dict[int, int] = {}
        n_disk: dict[int, int] = {}
        end = max(counts.values())
        for i in slow_pos:
            if i >= end:
                break  # past the last matched block of every worker
            ci = c[i] if c is not None else 0
            # Holders whose copy is CPU/disk-only, among the workers still counting block i
            # (the alive set of i's run).
            x = (tot[i] & ~g[i]) & run_alive[bisect.bisect_right(starts, i) - 1]
            for b in _bits(x):
                if ci >> b & 1:
                    n_cpu[b] = n_cpu.get(b, 0) + 1
                else:
                    n_disk[b] = n_disk.get(b, 0) + 1
        out: dict[str, Match] = {}
        wg, wc, wd = self._wg, self._wc, self._wd
        by_bit = self._by_bit
        shared: dict[tuple[int, int, int], Match] = {}  # one Match per distinct split
        for b, cnt in counts.items():
            nc = n_cpu.get(b, 0)
            nd = n_disk.get(b, 0)
            ep = by_bit[b].endpoint
            cur = out.get(ep)
            ng = cnt - nc - nd
            weighted = ng * wg + nc * wc + nd * wd
            # dp ranks of one endpoint keep separate caches and a request is served by one
            # of them, so the endpoint is worth its best rank: most blocks, then the best
            # media (a GPU copy on one rank beats a CPU copy on another). Never a sum.
            if cur is None or (cnt, weighted) > (cur.blocks, cur.weighted):
                m = shared.get((cnt, nc, nd))
                if m is None:
                    m = shared[cnt, nc, nd] = Match(
                        cnt,
                        {k: v for k, v in (("GPU", ng), ("CPU", nc), ("DISK", nd)) if v},
                        weighted,
                    )
                out[ep] = m
        return out

    # ---- introspection -----------------------------------------------------------------

    def stats(self, endpoint: str) -> dict[str, Any]:
        """Blocks by medium, speculative entries, evictions, purges (for /debug/index)."""
        by_medium = dict.fromkeys(MEDIA, 0)
        spec = evictions = purges = engine = 0
        ranks = []
        for s in self._slots.values():
            if s.endpoint != endpoint:
                continue
            ranks.append(s.rank)
            for m in MEDIA:
                by_medium[m] += s.counts[m]
            spec += len(s.spec)
            evictions += s.evictions
            purges = max(purges, s.purges)
            engine += len(s.emap)
        return {
            "blocks": by_medium,
            "engine_hashes": engine,
            "speculative": spec,
            "evictions": evictions,
            "purges": purges,
            "ranks": sorted(ranks),
        }

    def entries(self, medium: str) -> int:
        """Stored (block, worker) entries on one medium."""
        return sum(s.counts[medium] for s in self._slots.values())

    def total_entries(self) -> int:
        """Stored (block, worker) entries over all media."""
        return sum(s.counts[m] for s in self._slots.values() for m in MEDIA)


__all__ = ["MEDIA", "BlockIndex", "Match"]
