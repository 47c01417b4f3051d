"""BlockIndex: which worker holds which prompt blocks, on which medium (see the package
docstring for the layout)."""

from __future__ import annotations

import asyncio
import itertools
import time
import weakref
from array import array
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from operator import or_
from typing import Any

from prometheus_client import Gauge

from scorer.config import IndexConfig
from scorer.index import match as _match
from scorer.index.bounds import over_bound, take_oldest
from scorer.index.masks import MaskCache
from scorer.index.match import Match
from scorer.index.slots import MEDIA, EngineMapLike, PyEngineMap, Slot, SlotTable
from scorer.index.speculative import SpeculativeEntries
from scorer.native import NATIVE

# Entries a released (or big cleared) worker's slots leave per event-loop turn (~3 ms of
# work compiled).
RELEASE_CHUNK = 5_000

INDEX_ENTRIES = Gauge(
    "kv_scorer_index_entries", "Stored (block, worker) entries in the block index", ["medium"]
)
# The entries gauge is read at scrape time from the live indexes (no per-event metric
# update on the ingest path).
_LIVE: weakref.WeakSet[BlockIndex] = weakref.WeakSet()


def _entries_of(medium: str) -> Callable[[], float]:
    return lambda: float(sum(ix.entries(medium) for ix in list(_LIVE)))


for _m in MEDIA:
    INDEX_ENTRIES.labels(_m).set_function(_entries_of(_m))


class BlockIndex:
    """Key → workers (medium, dp_rank, expiry), updated from KV events, read by policies."""

    def __init__(self, config: IndexConfig | None = None, native: bool | None = None) -> None:
        """`native`: the compiled engine-key maps (None: whenever `scorer.native` has them;
        False: the pure-Python reference)."""
        self.config = config or IndexConfig.model_validate({})
        w = self.config.medium_weights
        self._weights = (
            float(w.get("GPU", 1.0)),
            float(w.get("CPU", 0.3)),
            float(w.get("DISK", 0.05)),
        )
        self._wg = self._weights[0]
        self._media: dict[str, dict[int, int]] = {m: {} for m in MEDIA}
        self._gpu = self._media["GPU"]
        self._cpu = self._media["CPU"]
        self._disk = self._media["DISK"]
        emap: Callable[[], EngineMapLike] = PyEngineMap
        if NATIVE is not None and native is not False:
            emap = NATIVE.EngineMap
        elif native:
            raise RuntimeError("the compiled scorer.native module is not available")
        self.native = emap is not PyEngineMap
        self._table = SlotTable(emap)
        self._slots = self._table.slots
        self._bit_obj = self._table.bit_obj  # grows in place with the table
        self._specs = SpeculativeEntries()
        self._spec = self._specs.masks
        self._masks = MaskCache()
        self._matches = _match.MatchCache(self._wg)
        self._media_cache: dict[tuple[int, int, int], Match] = {}
        # The compiled GPU-only lookup (gather + depths in one pass) with the compiled maps.
        self._gpu_depths = getattr(NATIVE, "gpu_depths", None) if self.native else None
        self._media_depths = getattr(NATIVE, "media_depths", None) if self.native else None
        self._depth_matches = getattr(NATIVE, "depth_matches", None) if self.native else None
        self.max_blocks = self.config.max_blocks_per_worker
        # Released and replaced slots whose bit some entries still have (`release`, `clear`).
        self._leaving: deque[Slot] = deque()
        self._drain_due = False
        self.clock = time.monotonic
        _LIVE.add(self)

    # ---- slots -------------------------------------------------------------------------

    def _slot(self, endpoint: str, rank: int | None) -> Slot:
        s = self._table.ensure(endpoint, rank)
        bit = self._bit_obj[s.bit]
        self._masks.setdefault(bit, bit)
        return s

    def endpoints(self) -> list[str]:
        """Endpoints the index has seen (events or speculative inserts)."""
        return list(self._table.ep_mask)

    def has_rank(self, endpoint: str, rank: int | None) -> bool:
        """Whether (endpoint, rank) already has a slot."""
        return (endpoint, rank or 0) in self._slots

    def ranks(self, endpoint: str) -> int:
        """How many slots (dp ranks) an endpoint has. A slot lives until its worker is
        released, so callers bound new ranks per worker (events config)."""
        return self._table.ep_slots.get(endpoint, 0)

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
        """A worker stores these blocks (engine keys ↔ our keys). Returns new entries.

        An engine key sent again for another block now names that block only: the block it
        named before is dropped (unless another engine key of this add names it), so every
        entry of a slot stays reachable from its engine map, which the per-worker bound and
        `release` walk. (A second engine key for one block is not tracked: the block goes
        when the first is given another.)"""
        s = self._slots.get((endpoint, rank or 0)) or self._slot(endpoint, rank)
        if len(keys) > len(ekeys):
            keys = keys[: len(ekeys)]  # a block without an engine key is never removable
        d = self._media.get(medium)
        if d is None:
            d, medium = self._gpu, "GPU"
        bit = self._bit_obj[s.bit]
        emap = s.emap
        held: Iterable[tuple[int, int]]
        if type(keys) is array and self.native:
            # Packed keys (apply's fused path): the engine map and the dict insert in one
            # compiled loop; returns the (key, mask) pairs already held under another mask.
            assert NATIVE is not None
            added: int
            added, held, replaced = NATIVE.index_add(d, emap, ekeys, keys, bit)
            new = added
        else:
            replaced = emap.update_pairs(ekeys, keys)
            # One C-level pass inserts the absent keys with the slot's shared bit object (a
            # single-holder mask costs no memory of its own) and returns every key's mask.
            before = len(d)
            masks = list(map(d.setdefault, keys, itertools.repeat(bit)))
            new = len(d) - before
            held = () if masks.count(bit) == len(masks) else zip(keys, masks, strict=True)
        if held:
            # Some blocks are held by other workers too: add our bit to those masks.
            canon = self._masks
            for k, m in held:
                # (a key twice in one add: its second mask is stale, re-read it then)
                if not m & bit and not (m := d[k]) & bit:
                    m |= bit
                    # Equal masks share one int object (memory: one per block otherwise).
                    d[k] = canon.get(m) or canon.canon(m)
                    new += 1
        if new:
            s.counts[medium] += new
        if replaced:
            # (a replaced block another engine key of this add leads to stays)
            gone = set(replaced).difference(map(emap.get, ekeys))
            if gone:
                self._drop_keys(s, list(gone))
        if s.spec:
            self._specs.confirm(s, keys)
        if len(emap) > self.max_blocks:
            self._drop_keys(s, take_oldest(s, over_bound(s, self.max_blocks)))
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
        canon = self._masks
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
                    d[k] = canon.get(m) or canon.canon(m)
                else:
                    del d[k]
                removed += 1
            if not any(o.get(k, 0) & bit for o in others):
                del emap[ek]
        if removed:
            s.counts[medium] -= removed
            if medium == "GPU":
                s.removed += removed
        return removed, unknown

    def _unset(self, d: dict[int, int], keys: Iterable[int], bit: int) -> int:
        """Take `bit` out of the masks of `keys` in medium dict `d`; returns how many had it."""
        canon = self._masks
        n = 0
        for k in keys:
            m = d.get(k, 0)
            if m & bit:
                m ^= bit
                if m:
                    d[k] = canon.get(m) or canon.canon(m)
                else:
                    del d[k]
                n += 1
        return n

    def _drop_keys(self, s: Slot, keys: Sequence[int]) -> None:
        bit = 1 << s.bit
        for medium in MEDIA:
            if s.counts[medium]:
                s.counts[medium] -= self._unset(self._media[medium], keys, bit)

    def clear(self, endpoint: str, rank: int | None = None) -> None:
        """Forget one (endpoint, rank) (AllBlocksCleared), or every rank of it when rank is
        None. Costs the slot's own entries: each is reached through its engine map (`add`
        keeps them all reachable), no other worker's entry is read.

        A slot of up to `RELEASE_CHUNK` entries is emptied now. A bigger one is replaced by
        a fresh slot on another bit (its counters kept), which the worker's next events
        fill; the old slot leaves like a released one, a chunk per loop turn (a million
        entries held the loop for ~0.3 s in one piece). No answer counts the old entries
        for the worker from now on: no candidate mask has the old bit."""
        swapped = False
        for s in self._table.of(endpoint):
            if rank is not None and s.rank != rank:
                continue
            self._specs.drop(s)
            if len(s.emap) <= RELEASE_CHUNK:
                self._drop_keys(s, list(s.emap.values()))
                s.emap.clear()
                continue
            fresh = self._table.replace(s)
            bit = self._bit_obj[fresh.bit]
            self._masks.setdefault(bit, bit)
            self._leaving.append(s)
            swapped = True
        if swapped:
            self._drain()

    def purge(self, endpoint: str) -> None:
        """Forget everything about a worker (restart, unrecoverable gap, health ejection):
        `clear` of every rank."""
        self.clear(endpoint)
        for s in self._table.of(endpoint):
            s.purges += 1

    def release(self, endpoint: str) -> None:
        """The worker left the pool: forget it and free its slots' bits for new workers
        (no entry keeps one, so a worker reusing it inherits nothing).

        Its slots leave the table at once (no match names it from now on). Their bits leave
        the entries `RELEASE_CHUNK` entries at a time, one chunk now and, on a running event
        loop, one per loop turn after it (a worker's million entries held the loop for a
        third of a second in one piece); a bit is freed once no entry has it."""
        gone = self._table.detach(endpoint)
        for s in gone:
            self._specs.drop(s)
        self._leaving.extend(gone)
        self._drain()

    def _drain(self) -> None:
        """Clear up to RELEASE_CHUNK entries of the detached slots (all, with no running
        loop), freeing each slot's bit when it is done; schedules the rest."""
        leaving = self._leaving
        try:
            loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        budget = RELEASE_CHUNK
        while leaving and (budget > 0 or loop is None):
            s = leaving[0]
            pairs = s.emap.pop_oldest(budget if loop is not None else len(s.emap))
            budget -= len(pairs)
            if pairs:
                self._drop_keys(s, [k for _, k in pairs])
            if not len(s.emap):
                leaving.popleft()
                self._table.free(s)
                # Canonical masks naming the bit are dead: free their cache places.
                self._masks.drop_bits(1 << s.bit)
        if leaving and loop is not None and not self._drain_due:
            self._drain_due = True
            loop.call_soon(self._drain_next)

    def _drain_next(self) -> None:
        self._drain_due = False
        self._drain()

    # ---- speculative entries -----------------------------------------------------------

    def insert_speculative(
        self,
        endpoint: str,
        keys: Sequence[int],
        ttl_s: float | None = None,
        wait_s: float = 0.0,
        block_s: float = 0.0,
        step_blocks: int = 0,
    ) -> None:
        """The router just sent these blocks to `endpoint`: count them as held (GPU) until a
        confirming BlockStored replaces them or `ttl_s` (default index.speculative_ttl_s) ends.

        The engine stores them only once prefilled, step by step: with `wait_s` (predicted
        seconds before the request's prefill starts there) and `block_s` (seconds per block
        prefilled), block i's TTL starts wait_s + block_s x (i + 1) later, rounded up to the
        end of its engine step (`step_blocks` blocks), capped at index.speculative_ttl_max_s
        (scorer.index.speculative)."""
        ttl = self.config.speculative_ttl_s if ttl_s is None else ttl_s
        if ttl <= 0 or not keys:
            return
        now = self.clock()
        last = now + max(ttl, self.config.speculative_ttl_max_s)
        self._specs.insert(
            self._slot(endpoint, 0), keys, now + ttl + wait_s, self._gpu, step_blocks, block_s, last
        )

    def expire(self, now: float | None = None) -> None:
        """Drop speculative entries whose TTL has passed (match calls this)."""
        if self._specs.heap:
            self._specs.expire(self.clock() if now is None else now, self._table.by_bit)

    # ---- queries -----------------------------------------------------------------------

    def match(
        self, keys: Sequence[int], endpoints: Iterable[str] | None = None
    ) -> dict[str, Match]:
        """Per worker, the contiguous leading blocks of `keys` it holds (only workers with
        >= 1 matched block appear). Speculative blocks count as GPU. Several workers may
        share one (equal) Match object: treat the result as read-only."""
        if self._specs.heap:
            self.expire()
        allowed = self._table.allowed(endpoints)
        if not allowed or not keys:
            return {}
        table = self._table
        scan = self._gpu_depths
        if scan is not None:
            # One compiled pass (BlockIndex(native=False): the code below, the reference).
            counts = scan(keys, self._gpu, self._spec, self._cpu, self._disk, allowed)
            if counts is not None:
                by_depth = self._depth_matches
                if by_depth is not None and not table.ranked:
                    cache = self._matches
                    return by_depth(counts, table.bit_ep, cache, cache.make)  # type: ignore[no-any-return]
                return _match.from_depths(
                    counts, table.bit_ep, table.ranked, self._wg, self._matches
                )
        media = self._media_depths
        if media is not None:
            # A block read has a CPU/disk copy: the compiled split by medium.
            counts, n_cpu, n_disk = media(
                keys, self._gpu, self._spec, self._cpu, self._disk, allowed
            )
            return _match.media_matches(
                counts, n_cpu, n_disk, table.bit_ep, self._weights, self._media_cache
            )
        zero = itertools.repeat(0)
        g = list(map(self._gpu.get, keys, zero))
        spec = self._spec
        if spec and not spec.keys().isdisjoint(keys):
            g = list(map(or_, g, map(spec.get, keys, zero)))
        cpu, disk = self._cpu, self._disk
        # A prompt with no block on CPU/disk anywhere (the common case) pays one C-level
        # membership scan per non-empty slow medium and takes the GPU-only path.
        slow_c = bool(cpu) and not cpu.keys().isdisjoint(keys)
        slow_d = bool(disk) and not disk.keys().isdisjoint(keys)
        if slow_c or slow_d:
            c = list(map(cpu.get, keys, zero)) if cpu else None
            d = list(map(disk.get, keys, zero)) if disk else None
            return _match.with_media(g, c, d, allowed, table.bit_ep, self._weights)
        return _match.gpu_only(g, allowed, table.bit_ep, table.ranked, self._wg, self._matches)

    # ---- introspection -----------------------------------------------------------------

    def stats(self, endpoint: str) -> dict[str, Any]:
        """Blocks by medium, speculative entries, evictions, purges (for /debug/index)."""
        by_medium = dict.fromkeys(MEDIA, 0)
        spec = evictions = purges = engine = 0
        ranks = []
        for s in self._table.of(endpoint):
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
            "removed": sum(s.removed for s in self._table.of(endpoint)),
            "purges": purges,
            "ranks": sorted(ranks),
        }

    def removed_total(self, endpoint: str) -> int:
        """GPU blocks `endpoint`'s engine reported removed (BlockRemoved) since start: its
        eviction count (the block-life term reads its rate)."""
        return sum(s.removed for s in self._table.of(endpoint))

    def entries(self, medium: str) -> int:
        """Stored (block, worker) entries on one medium (released and replaced slots' not
        yet cleared ones included)."""
        return sum(s.counts[medium] for s in itertools.chain(self._slots.values(), self._leaving))

    def total_entries(self) -> int:
        """Stored (block, worker) entries over all media."""
        return sum(self.entries(m) for m in MEDIA)
