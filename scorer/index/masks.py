"""Holder bitmasks: one bit per worker slot, set bits and per-worker prefix depths.

A block's holders are one python int (bit i = slot i). Equal masks share one int object
(`MaskCache`), so a block held by the same set of workers as its neighbours costs no mask
memory of its own.
"""

from __future__ import annotations

import itertools
from operator import ne

# Bound on canonical multi-holder masks: with many workers the number of distinct holder
# sets can grow without limit; past the bound masks are stored as they come.
MASK_CACHE = 1 << 16

# _BYTE_BITS[j][v]: the bit indices set in byte value v at byte position j (slots 0-127).
_BYTE_BITS = [
    [tuple(8 * j + i for i in range(8) if v >> i & 1) for v in range(256)] for j in range(16)
]


def bits(mask: int) -> list[int]:
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


def depths(masks: list[int], allowed: int) -> tuple[dict[int, int], list[int], list[int]]:
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
                for b in bits(alive & ~nxt):
                    counts[b] = st
            alive = nxt
            if not alive:
                del starts[len(run_alive) :]
                return counts, starts, run_alive
        run_alive.append(alive)
    for b in bits(alive):
        counts[b] = n
    return counts, starts, run_alive


class MaskCache(dict[int, int]):
    """mask → its one shared int object (bounded by `MASK_CACHE`).

    Read with `.get(m) or .canon(m)` on the hot path: the C-level `dict.get` hits for
    every mask already seen."""

    def canon(self, mask: int) -> int:
        """The shared int object for `mask` (cached while the cache is under its bound)."""
        c = self.get(mask)
        if c is not None:
            return c
        if len(self) < MASK_CACHE:
            self[mask] = mask
        return mask

    def drop_bits(self, bits_mask: int) -> None:
        """Forget the masks that have any of `bits_mask`'s bits (released slots)."""
        for m in [m for m in self if m & bits_mask]:
            del self[m]
