"""Paged prefix cache of the simulated worker, and vLLM's block hash chain.

`PrefixCache` models vLLM v1's GPU block pool (vllm/v1/core/block_pool.py) at the level a
router can observe: a fixed number of KV blocks; full prompt blocks are cached under their
block hash; blocks of a running request are pinned (reference counted) and never evicted;
unreferenced cached blocks are evicted least-recently-freed first. Like vLLM, a request's
blocks are freed tail first, so the end of a prompt is evicted before its shared start.
Eviction reports the hashes (for `BlockRemoved`), admission returns the newly stored
hashes (for `BlockStored`).

Hashes are opaque ints: the worker uses `vllm_block_hashes` (vLLM's own sha256 chain), the
routing benchmark may use any key it likes (e.g. Mooncake hash ids).
"""

from __future__ import annotations

import hashlib
import pickle
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

__all__ = [
    "NONE_HASH",
    "CacheFullError",
    "PrefixCache",
    "VllmBlockHash",
    "block_hash_int",
    "vllm_block_hashes",
]


class CacheFullError(RuntimeError):
    """Raised by `PrefixCache.admit` when the blocks cannot fit even after eviction."""


def _sha256_pickle(obj: object) -> bytes:
    # vLLM's "sha256" prefix-caching hash (vllm/utils/hashing.py `sha256`): sha256 over
    # pickle.dumps(obj, protocol=HIGHEST_PROTOCOL). Same bytes here → same block hashes.
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


# vLLM >= 0.30 seeds the chain with hash("vllm-none-hash") when PYTHONHASHSEED is unset
# (vllm/v1/core/kv_cache_utils.py `init_none_hash`), so hashes are stable across restarts.
# Checked against ../shared/vectors block_hash_examples (tests/sim/test_sim_vectors.py).
NONE_HASH: bytes = _sha256_pickle("vllm-none-hash")


def block_hash_int(digest: bytes) -> int:
    """The uint64 vLLM puts on the wire for a 32-byte block hash: its low 64 bits.

    (vllm/distributed/kv_events.py, VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1, the default.)
    """
    return int.from_bytes(digest[-8:], "big")


@dataclass(frozen=True, slots=True)
class VllmBlockHash:
    """One full block of a prompt: its 32-byte chained hash and its 64-bit event id."""

    digest: bytes
    value: int  # low 64 bits of digest, the id in KV events
    extra: tuple[object, ...] | None  # extra keys hashed with this block


def vllm_block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    *,
    lora_name: str | None = None,
    cache_salt: str | None = None,
    parent: bytes | None = None,
) -> list[VllmBlockHash]:
    """vLLM's chained block hashes of the FULL blocks of `token_ids`.

    hash_i = sha256(pickle((hash_{i-1} or NONE_HASH, tuple(tokens of block i), extra_i)))
    with extra_i = (lora_name,) for a LoRA request, cache_salt appended on block 0 only,
    or None — the pre-0.31 layout, which is also what vLLM publishes as `extra_keys` in
    events (vllm/v1/core/kv_cache_utils.py `hash_block_tokens`, `generate_block_hash_extra_keys`).
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be > 0, got {block_size}")
    out: list[VllmBlockHash] = []
    prev = NONE_HASH if parent is None else parent
    for i in range(len(token_ids) // block_size):
        keys: list[object] = []
        if lora_name is not None:
            keys.append(lora_name)
        if cache_salt is not None and i == 0 and parent is None:
            keys.append(cache_salt)  # vLLM: lora keys + mm keys + [cache_salt]
        extra = tuple(keys) if keys else None
        block = tuple(int(t) for t in token_ids[i * block_size : (i + 1) * block_size])
        digest = _sha256_pickle((prev, block, extra))
        out.append(VllmBlockHash(digest, block_hash_int(digest), extra))
        prev = digest
    return out


def _unique(hashes: Iterable[int]) -> list[int]:
    # A request holds one block per hash; dict keeps the first-seen order.
    return list(dict.fromkeys(hashes))


class PrefixCache:
    """A fixed pool of KV blocks with prefix caching, pinning and LRU eviction.

    Blocks are either cached (keyed by hash; pinned while a running request references
    them, evictable otherwise) or anonymous (`extra_blocks`: a partial last block or
    decode tokens, pinned by their request, never cached). `capacity_blocks` bounds the sum.
    """

    def __init__(
        self,
        capacity_blocks: int,
        block_size: int,
        on_evict: Callable[[list[int]], None] | None = None,
    ) -> None:
        if capacity_blocks <= 0:
            raise ValueError(f"capacity_blocks must be > 0, got {capacity_blocks}")
        if block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {block_size}")
        self.capacity_blocks = capacity_blocks
        self.block_size = block_size
        self.on_evict = on_evict
        # hash -> number of running requests holding the block (0 = evictable).
        self._refs: dict[int, int] = {}
        # Evictable blocks, least recently freed first.
        self._lru: OrderedDict[int, None] = OrderedDict()
        self._anon = 0
        # Blocks promised to running requests (chunked prefill), not taken from the pool yet.
        self._reserved = 0
        # Counters in tokens, as vLLM's vllm:prefix_cache_queries / _hits count them.
        self.queries_tokens = 0
        self.hits_tokens = 0
        self.evictions = 0  # blocks evicted since start
        self.last_evicted: list[int] = []  # blocks evicted by the last admit()

    # --- read-only views -------------------------------------------------------------

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._refs

    def __len__(self) -> int:
        """Number of cached (hashed) blocks, pinned or not."""
        return len(self._refs)

    @property
    def pinned_blocks(self) -> int:
        """Blocks held by running requests (cached and anonymous)."""
        return len(self._refs) - len(self._lru) + self._anon

    @property
    def reserved_blocks(self) -> int:
        """Blocks promised to running requests and not allocated yet (`start`)."""
        return self._reserved

    @property
    def free_blocks(self) -> int:
        """Blocks a new request may take: never used plus evictable (vLLM's free queue),
        less the blocks promised to running requests."""
        return self.capacity_blocks - self.pinned_blocks - self._reserved

    @property
    def usage(self) -> float:
        """Fraction of blocks pinned by running requests (vLLM's kv_cache_usage_perc)."""
        return self.pinned_blocks / self.capacity_blocks

    def cached_hashes(self) -> list[int]:
        """All cached block hashes (pinned and evictable), for debugging and tests."""
        return list(self._refs)

    def is_pinned(self, block_hash: int) -> bool:
        """True when a running request references the block."""
        return self._refs.get(block_hash, 0) > 0

    def match(self, hashes: Sequence[int]) -> int:
        """Number of leading blocks of `hashes` that are cached. Changes nothing."""
        n = 0
        for h in hashes:
            if h not in self._refs:
                break
            n += 1
        return n

    def lookup(self, hashes: Sequence[int], prompt_tokens: int) -> int:
        """`match` plus the prefix-cache counters: queries += prompt_tokens, hits += matched.

        Hits are counted in tokens (matched blocks x block_size, at most prompt_tokens), as
        vLLM's scheduler does when it first schedules a request.
        """
        n = self.match(hashes)
        self.queries_tokens += max(prompt_tokens, 0)
        self.hits_tokens += min(n * self.block_size, max(prompt_tokens, 0))
        return n

    def blocks_needed(self, hashes: Sequence[int], extra_blocks: int = 0) -> int:
        """New blocks `admit(hashes, extra_blocks)` would allocate."""
        return sum(1 for h in _unique(hashes) if h not in self._refs) + max(extra_blocks, 0)

    def can_admit(self, hashes: Sequence[int], extra_blocks: int = 0) -> bool:
        """True when `admit` would succeed now (evicting unpinned blocks if needed)."""
        uniq = _unique(hashes)
        need = sum(1 for h in uniq if h not in self._refs) + max(extra_blocks, 0)
        # Evictable blocks this request would itself pin cannot make room for it.
        own_evictable = sum(1 for h in uniq if h in self._lru)
        return need <= self.free_blocks - own_evictable

    def can_start(self, hashes: Sequence[int], matched: int, extra_blocks: int = 0) -> bool:
        """True when `start(hashes, matched, extra_blocks)` would succeed now."""
        need = len(hashes) - matched + max(extra_blocks, 0)
        # Evictable blocks this request would itself pin cannot make room for it.
        own_evictable = sum(1 for h in _unique(hashes[:matched]) if h in self._lru)
        return need <= self.free_blocks - own_evictable

    # --- mutations -------------------------------------------------------------------

    def start(self, hashes: Sequence[int], matched: int, extra_blocks: int = 0) -> int:
        """Admit a request with chunked prefill: pin its cached prefix `hashes[:matched]`
        and reserve one block for each other key and each extra block; returns the number
        reserved. Blocks come out of the reservation with `commit`
        as the request's chunks are scheduled. Raises `CacheFullError` (changing nothing)
        when the request cannot fit.
        """
        if not self.can_start(hashes, matched, extra_blocks):
            raise CacheFullError(
                f"need {len(hashes) - matched + max(extra_blocks, 0)} blocks, "
                f"{self.free_blocks} free of {self.capacity_blocks}"
            )
        for h in hashes[:matched]:
            self._pin(h)
        reserved = len(hashes) - matched + max(extra_blocks, 0)
        self._reserved += reserved
        return reserved

    def commit(self, hashes: Sequence[int], extra_blocks: int = 0) -> list[int]:
        """Cache the blocks a scheduled chunk fills, one reserved block each, and take
        `extra_blocks` reserved blocks as anonymous ones (a prompt's last chunk: partial
        block and output); returns the newly stored hashes (for `BlockStored`).

        A hash already cached (another request computed it meanwhile) is pinned instead.
        New blocks come from the pool, evicting least recently freed blocks when it is full
        (reported via `on_evict` and `last_evicted`, before the store), as vLLM allocates a
        chunk's blocks before `cache_blocks` stores them.
        """
        fresh: dict[int, None] = {}
        for h in hashes:  # pin what is cached first so eviction cannot take it
            if h in self._refs:
                self._pin(h)
            else:
                fresh[h] = None
        extra = max(extra_blocks, 0)
        self._reserved -= len(hashes) + extra
        self._make_room(len(fresh) + extra)
        for h in hashes:
            if h in fresh and h not in self._refs:
                self._refs[h] = 1
            elif h in fresh:
                self._refs[h] += 1  # the same block twice in one chunk
        self._anon += extra
        return list(fresh)

    def release_blocks(
        self, hashes: Sequence[int], extra_blocks: int = 0, reserved: int = 0
    ) -> None:
        """Unpin what `start`/`commit` gave a request: one reference per
        key of `hashes` (tail first, vLLM `free_blocks`), `extra_blocks` anonymous blocks
        and `reserved` unused reserved blocks."""
        for h in reversed(hashes):
            refs = self._refs.get(h)
            if refs is None or refs == 0:
                continue  # not pinned: nothing to release (e.g. after a reset)
            refs -= 1
            self._refs[h] = refs
            if refs == 0:
                self._lru[h] = None
        self._anon = max(self._anon - max(extra_blocks, 0), 0)
        self._reserved = max(self._reserved - max(reserved, 0), 0)

    def _pin(self, h: int) -> None:
        if self._refs[h] == 0:
            del self._lru[h]
        self._refs[h] += 1

    def _make_room(self, n: int) -> None:
        # Evict least recently freed blocks until `n` more fit in the pool.
        overflow = len(self._refs) + self._anon + n - self.capacity_blocks
        evicted: list[int] = []
        while overflow > 0:
            victim, _ = self._lru.popitem(last=False)
            del self._refs[victim]
            evicted.append(victim)
            overflow -= 1
        self.last_evicted = evicted
        if evicted:
            self.evictions += len(evicted)
            if self.on_evict is not None:
                self.on_evict(evicted)

    def admit(self, hashes: Sequence[int], extra_blocks: int = 0) -> list[int]:
        """Pin the blocks of a request that starts running; returns newly stored hashes.

        Cached blocks are re-used (hit); missing ones are allocated, evicting the least
        recently freed unpinned blocks when the pool is full (reported via `on_evict`
        and `last_evicted`, before the store). Raises `CacheFullError` (changing nothing)
        when the request cannot fit.
        """
        if not self.can_admit(hashes, extra_blocks):
            raise CacheFullError(
                f"need {self.blocks_needed(hashes, extra_blocks)} new blocks, "
                f"{self.free_blocks} free of {self.capacity_blocks}"
            )
        uniq = _unique(hashes)
        new = [h for h in uniq if h not in self._refs]
        for h in uniq:  # pin what is cached first so eviction cannot take it
            if h in self._refs:
                self._pin(h)
        self._make_room(len(new) + max(extra_blocks, 0))
        for h in new:
            self._refs[h] = 1
        self._anon += max(extra_blocks, 0)
        return new

    def release(self, hashes: Sequence[int], extra_blocks: int = 0) -> None:
        """Unpin a finished request's blocks; they stay cached and become evictable.

        Freed tail first (vLLM `free_blocks` reverses the request's blocks) so that a
        prompt's shared beginning outlives its unique end.
        """
        self.release_blocks(_unique(hashes), extra_blocks)

    def reset(self) -> bool:
        """Drop every cached block, as vLLM's reset_prefix_cache.

        Like vLLM, refuses (returns False, changes nothing) while any block is pinned or
        reserved (a request is running).
        """
        if self.pinned_blocks > 0 or self._reserved > 0:
            return False
        self._refs.clear()
        self._lru.clear()
        return True
