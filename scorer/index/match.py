"""Prefix matching over holder masks: per worker, the contiguous leading blocks it holds.

`gpu_only` is the common case (no prompt block on CPU/disk anywhere): one mask per block,
depths found where the mask changes. With the compiled module the index finds those depths
in one pass (`scorer.native` `gpu_depths`) and only `from_depths` runs here; `gpu_only` is
then its reference. `with_media` splits each worker's matched blocks by
their best medium with Python work only at the positions that have a CPU/disk copy:
O(blocks + such holders), never O(blocks x workers).
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from scorer.index.masks import bits, depths


@dataclass(slots=True)
class Match:
    """How much of a prompt one worker holds."""

    blocks: int  # contiguous leading blocks held (any medium)
    by_medium: dict[str, int]  # those blocks split by medium ("GPU", "CPU", "DISK")
    weighted: float  # sum of medium weights over the matched blocks


def gpu_only(
    masks: list[int],
    allowed: int,
    bit_ep: Sequence[str],
    ranked: bool,
    wg: float,
    cache: MatchCache | None = None,
) -> dict[str, Match]:
    """Matches from per-block GPU (and speculative) holder masks."""
    return from_depths(depths(masks, allowed)[0], bit_ep, ranked, wg, cache)


class MatchCache(dict[int, Match]):
    """depth -> the one GPU-only Match of that depth (`Match(c, {"GPU": c}, c * wg)`), kept
    across lookups: a Match is read-only, so equal ones are one object and a lookup makes
    none for depths seen before. Bounded: emptied when it reaches `MATCH_CACHE` depths."""

    def __init__(self, wg: float) -> None:
        super().__init__()
        self.wg = wg

    def make(self, c: int) -> Match:
        """The Match of depth `c` (made and kept when new)."""
        m = self.get(c)
        if m is None:
            if len(self) >= MATCH_CACHE:
                self.clear()
            m = self[c] = Match(c, {"GPU": c}, c * self.wg)
        return m


# Distinct depths kept by a MatchCache (a depth is at most a prompt's block count).
MATCH_CACHE = 4096


def from_depths(
    counts: dict[int, int],
    bit_ep: Sequence[str],
    ranked: bool,
    wg: float,
    cache: MatchCache | None = None,
) -> dict[str, Match]:
    """endpoint -> Match from slot bit -> depth (GPU only). `cache`: a MatchCache of weight
    `wg` (None: a fresh one, shared by this lookup's equal depths only)."""
    if not counts:
        return {}
    if cache is None:
        cache = MatchCache(wg)
    get, make = cache.get, cache.make
    out: dict[str, Match] = {}
    if ranked:  # an endpoint may have several slots (dp ranks): keep its best
        for b, c in counts.items():
            cur = out.get(bit_ep[b])
            if cur is None or c > cur.blocks:
                out[bit_ep[b]] = get(c) or make(c)
        return out
    for b, c in counts.items():
        out[bit_ep[b]] = get(c) or make(c)
    return out


def with_media(
    g: list[int],
    c: list[int] | None,
    d: list[int] | None,
    allowed: int,
    bit_ep: Sequence[str],
    weights: tuple[float, float, float],
) -> dict[str, Match]:
    """Matches from per-block GPU (+speculative), CPU and disk holder masks (`c`/`d` None
    when that medium is empty). A block on several media counts once, on its best one
    (GPU/speculative > CPU > DISK)."""
    return media_matches(*media_depths(g, c, d, allowed), bit_ep, weights)


def media_depths(
    g: list[int], c: list[int] | None, d: list[int] | None, allowed: int
) -> tuple[dict[int, int], dict[int, int], dict[int, int]]:
    """(slot bit -> leading blocks held on any medium, bit -> those held on CPU and not
    GPU, bit -> those held on disk only), from the per-block holder masks (the reference
    of the compiled `scorer.native` `media_depths`)."""
    n = len(g)
    # Positions with a CPU/disk copy anywhere (found in C); usually a few. Only those
    # get Python work: their combined mask, then their split among the alive workers.
    if c is not None and d is not None:
        slow_pos = sorted({*itertools.compress(range(n), c), *itertools.compress(range(n), d)})
    else:
        slow_pos = list(itertools.compress(range(n), c if c is not None else d or ()))
    tot = list(g)
    for i in slow_pos:
        tot[i] = g[i] | (c[i] if c is not None else 0) | (d[i] if d is not None else 0)
    counts, starts, run_alive = depths(tot, allowed)
    n_cpu: dict[int, int] = {}
    n_disk: dict[int, int] = {}
    if not counts:
        return counts, n_cpu, n_disk
    end = max(counts.values())
    for i in slow_pos:
        if i >= end:
            break  # past the last matched block of every worker
        ci = c[i] if c is not None else 0
        # Holders whose copy is CPU/disk-only, among the workers still counting block i
        # (the alive set of i's run).
        x = (tot[i] & ~g[i]) & run_alive[bisect.bisect_right(starts, i) - 1]
        for b in bits(x):
            if ci >> b & 1:
                n_cpu[b] = n_cpu.get(b, 0) + 1
            else:
                n_disk[b] = n_disk.get(b, 0) + 1
    return counts, n_cpu, n_disk


def media_matches(
    counts: dict[int, int],
    n_cpu: dict[int, int],
    n_disk: dict[int, int],
    bit_ep: Sequence[str],
    weights: tuple[float, float, float],
    cache: dict[tuple[int, int, int], Match] | None = None,
) -> dict[str, Match]:
    """endpoint -> Match from `media_depths`' split. `cache`: (blocks, CPU, disk) -> Match
    for these `weights`, kept across lookups (bounded by MATCH_CACHE; None: this lookup's)."""
    out: dict[str, Match] = {}
    wg, wc, wd = weights
    if cache is None:
        cache = {}
    for b, cnt in counts.items():
        nc = n_cpu.get(b, 0)
        nd = n_disk.get(b, 0)
        m = cache.get((cnt, nc, nd))
        if m is None:
            ng = cnt - nc - nd
            m = Match(
                cnt,
                {k: v for k, v in (("GPU", ng), ("CPU", nc), ("DISK", nd)) if v},
                ng * wg + nc * wc + nd * wd,
            )
            if len(cache) >= MATCH_CACHE:
                cache.clear()
            cache[cnt, nc, nd] = m
        ep = bit_ep[b]
        cur = out.get(ep)
        # dp ranks of one endpoint keep separate caches and a request is served by one of
        # them, so the endpoint is worth its best rank: most blocks, then the best media (a
        # GPU copy on one rank beats a CPU copy on another). Never a sum.
        if cur is None or (cnt, m.weighted) > (cur.blocks, cur.weighted):
            out[ep] = m
    return out
