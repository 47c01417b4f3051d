"""Applying decoded KV events to the block index, in OUR hash space.

For `BlockStored` we recompute our keys from `token_ids` with the shared `BlockHasher`,
chained from the parent block's key (the engine's `parent_block_hash` mapped through that
worker's engine-hash → key map). The chain's namespace comes from `lora_name` and the extra
keys: vLLM puts the LoRA name in every block's `extra_keys` and the `cache_salt` only in the
first block's (vllm/v1/core/kv_cache_utils.py `generate_block_hash_extra_keys`); SGLang sends
`cache_salt` as a field. Any other per-block extra key (multimodal hashes, prompt-embedding
hashes) is folded into that block's key: requests cannot reproduce it, so such blocks never
match, which is the safe side.
"""

from __future__ import annotations

import logging
import time
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client import Counter

from scorer.blocks import MASK60, BlockHasher, engine_key, namespace_key
from scorer.events.decode import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from scorer.histogram import LoopCounter, LoopHistogram
from scorer.index import BlockIndex
from scorer.native import NATIVE

log = logging.getLogger(__name__)


# Counted once per applied batch on the loop: LoopCounters (no lock; a prometheus_client
# Counter.inc took one, ~1 µs, and every applied batch counted two).
EVENTS_APPLIED = LoopCounter(
    "kv_scorer_events_applied_total",
    "KV events applied to the index, by type and outcome",
    ["type", "outcome"],
)
BLOCKS_APPLIED = LoopCounter(
    "kv_scorer_event_blocks_total", "Blocks carried by applied KV events", ["type"]
)
BLOCK_SIZE_MISMATCH = Counter(
    "kv_scorer_block_size_mismatch_total",
    "BlockStored events whose block_size differs from pool.block_size (not indexed)",
    ["endpoint"],
)
# Observed on the loop once per applied batch: a LoopHistogram (~0.15 µs, not ~1.3).
EVENT_LAG = LoopHistogram(
    "kv_scorer_event_lag_seconds",
    "Wall-clock delay between a batch's ts and its application",
    buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)

_APPLIED = {
    (t, o): EVENTS_APPLIED.labels(t, o)
    for t, outcomes in (
        (
            "BlockStored",
            ("ok", "unknown_parent", "block_size_mismatch", "other_group", "short", "bad_tokens"),
        ),
        ("BlockRemoved", ("ok", "unknown_hash", "other_group")),
        ("AllBlocksCleared", ("ok",)),
    )
    for o in outcomes
}
_BLOCKS = {t: BLOCKS_APPLIED.labels(t) for t in ("BlockStored", "BlockRemoved")}


@dataclass(slots=True)
class ApplyStats:
    """Per-worker counters kept for /debug/index."""

    stored: int = 0
    removed: int = 0
    cleared: int = 0
    unknown_parent: int = 0
    unknown_hash: int = 0
    other_group: int = 0
    block_size_mismatch: int = 0
    bad_tokens: int = 0
    last_block_size: int | None = None


def _extras(item: object, lora_name: str | None) -> list[Any]:
    """A block's extra keys without the LoRA name (already in the namespace)."""
    if item is None:
        return []
    seq = item if isinstance(item, list | tuple) else [item]
    return [x for x in seq if x != lora_name]


def _engine_keys(hashes: Sequence[Any]) -> list[int]:
    """`engine_key` of every hash; ints (the common case) in one comprehension."""
    if hashes and type(hashes[0]) is int:
        try:
            return [h & MASK60 for h in hashes]
        except TypeError:
            pass  # a mixed list: take the general path (raises on a bad item)
    out = []
    for h in hashes:
        if isinstance(h, bool) or not isinstance(h, int | bytes):
            raise TypeError(f"block hash of type {type(h).__name__}")
        out.append(engine_key(h))
    return out


def _engine_keys_native(hashes: Sequence[Any]) -> list[int]:
    """`_engine_keys` with the all-int case in one compiled loop (scorer.native)."""
    assert NATIVE is not None
    out: list[int] | None = NATIVE.engine_keys(hashes if type(hashes) is list else list(hashes))
    return out if out is not None else _engine_keys(hashes)


class _Pending:
    """BlockStored blocks of one batch not yet handed to the index (one medium). Packed
    (array('Q')) on the fused path: the compiled code appends to them and the index reads
    them without a Python int per engine key."""

    __slots__ = ("ekeys", "endpoint", "index", "keys", "medium", "packed", "rank")

    def __init__(self, endpoint: str, rank: int | None, index: BlockIndex, packed: bool) -> None:
        self.endpoint = endpoint
        self.rank = rank
        self.index = index
        self.packed = packed
        self.medium: str | None = None
        self.ekeys: list[int] | array[int] = array("Q") if packed else []
        self.keys: list[int] | array[int] = array("Q") if packed else []

    def reset(self, endpoint: str, rank: int | None) -> None:
        """Ready for another batch (one per Applier: most batches store one or no block,
        and two fresh arrays per batch cost more than the rest of an empty one). Blocks
        left by a batch that raised half-way are dropped, never added to this one."""
        self.endpoint = endpoint
        self.rank = rank
        self.medium = None
        if self.keys or self.ekeys:
            self.ekeys = array("Q") if self.packed else []
            self.keys = array("Q") if self.packed else []

    def flush(self) -> None:
        if self.keys:
            self.index.add(self.endpoint, self.rank, self.ekeys, self.keys, self.medium or "GPU")
            self.ekeys = array("Q") if self.packed else []
            self.keys = array("Q") if self.packed else []


class Applier:
    """Applies decoded batches for any number of workers to one index."""

    def __init__(self, index: BlockIndex, hasher: BlockHasher, native: bool | None = None) -> None:
        """`native`: map engine hashes with the compiled code (None: when `scorer.native`
        is available; False: the pure-Python reference). Keys come from `hasher`."""
        self.index = index
        self.hasher = hasher
        if native and NATIVE is None:
            raise RuntimeError("the compiled scorer.native module is not available")
        use = NATIVE is not None and native is not False
        self._ekeys = _engine_keys_native if use else _engine_keys
        # The fused BlockStored path: packed hashes and tokens (the compiled decoder's)
        # chained and masked in one C loop into packed pending keys (scorer.native
        # `stored_chain`); the index inserts them in C when its maps are compiled too.
        fused = use and hasher.native and index.native
        self._fused = NATIVE.stored_chain if fused and NATIVE is not None else None
        self._run = NATIVE.stored_events if fused and NATIVE is not None else None
        self.stats: dict[str, ApplyStats] = {}
        self._pend = _Pending("", None, index, self._fused is not None)
        self._lag = EVENT_LAG.labels()

    def _st(self, endpoint: str) -> ApplyStats:
        st = self.stats.get(endpoint)
        if st is None:
            st = self.stats[endpoint] = ApplyStats()
        return st

    def apply(self, endpoint: str, batch: EventBatch, rank: int | None = None) -> None:
        """Apply every event of a batch (rank: the batch's data_parallel_rank if None)."""
        r = batch.dp_rank if rank is None else rank
        if batch.ts > 0:
            self._lag.observe(max(0.0, time.time() - batch.ts))
        st = self._st(endpoint)
        # Metrics are counted per batch, not per event: a prometheus inc takes a lock.
        ok_events = ok_blocks = 0
        # Consecutive BlockStored events of one medium go to the index in ONE add (decode
        # steps send one 1-block event per request): `pend` holds them until a different
        # event, medium or an unknown parent (maybe pending) needs the index up to date.
        pend = self._pend
        pend.reset(endpoint, r)
        stored = self._stored
        events = batch.events
        run = self._run
        slots = self.index._slots
        bs = self.hasher.block_size
        i = 0
        while i < len(events):
            ev = events[i]
            i += 1
            if type(ev) is BlockStored:
                if ev.medium != pend.medium:
                    pend.flush()
                    pend.medium = ev.medium
                if run is not None:
                    # The compiled loop takes the run of plain events from here on; it
                    # stops at the first one the reference code below must handle.
                    s = slots.get((endpoint, r or 0))
                    j, nb = run(
                        events, i - 1, BlockStored, ev.medium, bs,
                        None if s is None else s.emap, pend.keys, pend.ekeys,
                    )  # fmt: skip
                    if j >= i:
                        ok_events += j - i + 1
                        ok_blocks += nb
                        st.last_block_size = bs
                        i = j
                        continue
                n = stored(endpoint, r, ev, st, pend)
                if n:
                    ok_events += 1
                    ok_blocks += n
                continue
            pend.flush()
            if type(ev) is BlockRemoved:
                self._removed(endpoint, r, ev, st)
            elif isinstance(ev, AllBlocksCleared):
                self.index.clear(endpoint, r or 0)
                st.cleared += 1
                _APPLIED["AllBlocksCleared", "ok"].inc()
        pend.flush()
        if ok_events:
            st.stored += ok_blocks
            _APPLIED["BlockStored", "ok"].inc(ok_events)
            _BLOCKS["BlockStored"].inc(ok_blocks)

    def _fail(self, st: ApplyStats, outcome: str) -> int:
        _APPLIED["BlockStored", outcome].inc()
        if outcome != "short":
            setattr(st, outcome, getattr(st, outcome) + 1)
        return 0

    def _stored(
        self, ep: str, rank: int | None, ev: BlockStored, st: ApplyStats, pend: _Pending
    ) -> int:
        """Index one BlockStored (via `pend`); returns the blocks indexed (0: skipped)."""
        if ev.group_idx:  # hybrid models: index the first KV-cache group only
            return self._fail(st, "other_group")
        hasher = self.hasher
        bs = hasher.block_size
        st.last_block_size = ev.block_size
        if ev.block_size != bs:
            BLOCK_SIZE_MISMATCH.labels(ep).inc()
            return self._fail(st, "block_size_mismatch")
        hashes = ev.block_hashes
        tokens = ev.token_ids
        n = len(hashes)
        nt = len(tokens) // bs
        if nt < n:
            n = nt
        if n == 0:
            return self._fail(st, "short")
        index = self.index
        parent: int | None = None
        ph = ev.parent_block_hash
        if ph is not None:
            try:
                pk = ph & MASK60 if type(ph) is int else engine_key(ph)
            except TypeError:
                return self._fail(st, "unknown_parent")
            pe = pend.ekeys
            if pe and pk == pe[-1]:
                parent = pend.keys[-1]  # continues the previous event's chain (prefill)
            else:
                parent = index.lookup_engine(ep, rank, pk)
                if parent is None and pe:
                    pend.flush()  # the parent may be pending
                    parent = index.lookup_engine(ep, rank, pk)
            if parent is None:
                # A chain we cannot place (its parent was never seen or already evicted).
                return self._fail(st, "unknown_parent")
        ek = ev.extra_keys
        plain = (
            # No extra key for any block (vLLM >= 0.20 sends one None per block): the
            # namespace is the base chain's, as `_keys` would find.
            (ek is None or ek.count(None) == len(ek))
            and ev.lora_name is None
            and ev.lora_id is None
            and ev.cache_salt is None
        )
        fused = self._fused
        if (
            plain
            and fused is not None
            and type(tokens) is array
            and type(hashes) is array
            and fused(tokens, hashes, n, bs, 0 if parent is None else parent, pend.keys, pend.ekeys)
        ):
            return n
        try:
            if plain:
                # The common case: the base chain, one C pass over the tokens.
                keys = hasher.keys(tokens if n * bs == len(tokens) else tokens[: n * bs], 0, parent)
            else:
                keys = self._keys(ev, n, parent)
        except (TypeError, OverflowError, ValueError):
            return self._fail(st, "bad_tokens")
        try:
            ekeys = self._ekeys(hashes if n == len(hashes) else hashes[:n])
        except (TypeError, ValueError):
            return self._fail(st, "bad_tokens")
        pend.ekeys.extend(ekeys)
        pend.keys.extend(keys)
        return n

    def _keys(self, ev: BlockStored, n: int, parent: int | None) -> list[int]:
        """Our keys for a chain with a LoRA, a salt or extra keys (the namespace)."""
        lora = ev.lora_name
        if lora is None and ev.lora_id is not None:
            lora = f"lora-id:{ev.lora_id}"  # old events: no name, never matches a request
        ek = ev.extra_keys or []
        start = 1 if parent is None else 0
        per_block = any(_extras(x, ev.lora_name) for x in ek[start:])
        ns = 0
        if parent is None:
            first = _extras(ek[0], ev.lora_name) if ek else []
            salt = ev.cache_salt
            if salt is None and len(first) == 1 and isinstance(first[0], str):
                salt, first = first[0], []
            ns = namespace_key(lora, salt, first or None)
        hasher = self.hasher
        bs = hasher.block_size
        tokens = ev.token_ids
        if not per_block:
            return hasher.keys(tokens if n * bs == len(tokens) else tokens[: n * bs], ns, parent)
        keys: list[int] = []
        prev = parent
        for i in range(n):
            extra = _extras(ek[i], ev.lora_name) if i < len(ek) else []
            block_ns = ns if i == 0 and parent is None else 0
            if extra and not (i == 0 and parent is None):
                block_ns = namespace_key(None, None, extra)
            (k,) = hasher.keys(tokens[i * bs : (i + 1) * bs], block_ns, prev)
            keys.append(k)
            prev = k
        return keys

    def _removed(self, ep: str, rank: int | None, ev: BlockRemoved, st: ApplyStats) -> None:
        if ev.group_idx:
            st.other_group += 1
            _APPLIED["BlockRemoved", "other_group"].inc()
            return
        try:
            ekeys = self._ekeys(ev.block_hashes)
        except (TypeError, ValueError):
            st.unknown_hash += len(ev.block_hashes)
            _APPLIED["BlockRemoved", "unknown_hash"].inc()
            return
        removed, unknown = self.index.remove(ep, rank, ekeys, ev.medium)
        st.removed += removed
        _BLOCKS["BlockRemoved"].inc(len(ev.block_hashes))
        if unknown:
            st.unknown_hash += unknown
            _APPLIED["BlockRemoved", "unknown_hash"].inc()
        else:
            _APPLIED["BlockRemoved", "ok"].inc()
