"""The compiled index lookup (scorer/native/_speedups.pyx `gpu_depths`) against its Python
reference (scorer.index.masks.depths over BlockIndex.match's gathered masks), and the
compiled BlockIndex against BlockIndex(native=False): the same depths in the same order, the
same Matches, on every width of holder mask (one 64-bit word, several, past the stack
buffer) and with speculative, CPU and disk holders."""

from __future__ import annotations

from typing import Any

import pytest
from hypo import scaled
from hypothesis import example, given, settings
from hypothesis import strategies as st

from scorer.blocks import BlockHasher
from scorer.config import IndexConfig
from scorer.index import MEDIA, BlockIndex
from scorer.index.masks import depths
from scorer.index.match import MATCH_CACHE, MatchCache, from_depths, media_depths
from scorer.native import NATIVE

KEYS = BlockHasher(4).keys(list(range(4 * 40)))


def _death(masks: list[int], allowed: int) -> int:
    """Position of the first block no allowed slot still counts (the last one if none)."""
    alive = allowed
    for i, m in enumerate(masks):
        alive &= m
        if not alive:
            return i
    return len(masks) - 1


@st.composite
def _lookups(draw: Any) -> dict[str, Any]:
    slots = draw(st.sampled_from([1, 3, 63, 64, 65, 130, 300]))
    n = draw(st.integers(0, 30))
    keys = KEYS[:n]
    # Each slot holds a prefix of the prompt (the shape events make), plus noise: holes and
    # holders of later blocks only.
    depth = draw(st.lists(st.integers(0, n), min_size=slots, max_size=slots))
    noise = draw(st.lists(st.tuples(st.integers(0, 39), st.integers(0, slots - 1)), max_size=20))
    masks = [sum(1 << s for s in range(slots) if depth[s] > i) for i in range(len(KEYS))]
    for pos, s in noise:
        masks[pos] ^= 1 << s
    # Copies offloaded: a prefix holder's block moved from GPU to CPU (True) or disk.
    moved: dict[bool, dict[int, int]] = {True: {}, False: {}}
    for s, pos, to_cpu in draw(
        st.lists(st.tuples(st.integers(0, slots - 1), st.integers(0, 39), st.booleans()))
    ):
        if depth[s] > pos:
            masks[pos] &= ~(1 << s)
            moved[to_cpu][pos] = moved[to_cpu].get(pos, 0) | 1 << s
    # Equal masks as one shared object (the index's MaskCache), or as equal copies.
    canon: dict[int, int] = {}
    share = draw(st.booleans())
    gpu = {
        k: (canon.setdefault(m, m) if share else int(str(m)))
        for k, m in zip(KEYS, masks, strict=True)
        if m
    }
    spec = {
        KEYS[p]: 1 << s
        for p, s in draw(
            st.lists(st.tuples(st.integers(0, 39), st.integers(0, slots - 1)), max_size=6)
        )
    }
    # CPU/disk holders: a prefix holder's copy moved off GPU, or any slots.
    slot_sets = st.sets(st.integers(0, slots - 1), min_size=1, max_size=4)
    for to_cpu, n_pos in ((True, 3), (False, 2)):
        for p, ss in draw(st.lists(st.tuples(st.integers(0, 39), slot_sets), max_size=n_pos)):
            moved[to_cpu][p] = moved[to_cpu].get(p, 0) | sum(1 << s for s in ss)
    cpu = {KEYS[p]: m for p, m in moved[True].items()}
    disk = {KEYS[p]: m for p, m in moved[False].items()}
    allowed = draw(
        st.sampled_from([(1 << slots) - 1, 0, 1, 1 << (slots - 1)])
        | st.integers(0, (1 << slots) - 1)
    )
    return {"keys": keys, "gpu": gpu, "spec": spec, "cpu": cpu, "disk": disk, "allowed": allowed}


@settings(max_examples=scaled(400))
@given(_lookups(), st.booleans())
@example(  # one slot, every block held: the depth is the prompt
    {
        "keys": KEYS[:3],
        "gpu": dict.fromkeys(KEYS[:3], 1),
        "spec": {},
        "cpu": {},
        "disk": {},
        "allowed": 1,
    },
    False,
)
@example(  # slot 64 (a second word) drops first, slot 0 at the end; a CPU copy after both
    {
        "keys": KEYS[:4],
        "gpu": {KEYS[0]: 1 | 1 << 64, KEYS[1]: 1, KEYS[2]: 1},
        "spec": {},
        "cpu": {KEYS[3]: 1},
        "disk": {},
        "allowed": 1 | 1 << 64,
    },
    False,
)
@example(  # a speculative holder extends a GPU one between two equal shared masks
    {
        "keys": KEYS[:3],
        "gpu": dict.fromkeys(KEYS[:3], 3),
        "spec": {KEYS[1]: 4},
        "cpu": {},
        "disk": {},
        "allowed": 7,
    },
    False,
)
@example(  # the block where the last slot drops has a disk copy: the media path decides
    {
        "keys": KEYS[:3],
        "gpu": {KEYS[0]: 1},
        "spec": {},
        "cpu": {},
        "disk": {KEYS[1]: 2},
        "allowed": 1,
    },
    True,
)
def test_gpu_depths_is_the_reference(case: dict[str, Any], as_tuple: bool) -> None:
    assert NATIVE is not None
    keys, gpu, spec, cpu, disk, allowed = (
        case[k] for k in ("keys", "gpu", "spec", "cpu", "disk", "allowed")
    )
    got = NATIVE.gpu_depths(tuple(keys) if as_tuple else keys, gpu, spec, cpu, disk, allowed)
    masks = [gpu.get(k, 0) | spec.get(k, 0) for k in keys]
    want = depths(masks, allowed)[0] if keys and allowed else {}
    if keys and allowed:
        read = keys[: _death(masks, allowed) + 1]
        if any(k in cpu or k in disk for k in read):
            assert got is None
            return
    assert got is not None
    assert list(got.items()) == list(want.items())


@settings(max_examples=scaled(400))
@given(_lookups(), st.booleans())
@example(  # slot 64 holds block 1 on disk only, slot 0 on CPU and GPU: GPU counts
    {
        "keys": KEYS[:3],
        "gpu": {KEYS[0]: 1 | 1 << 64, KEYS[1]: 1, KEYS[2]: 1},
        "spec": {},
        "cpu": {KEYS[1]: 1},
        "disk": {KEYS[1]: 1 << 64},
        "allowed": 1 | 1 << 64,
    },
    False,
)
@example(  # a CPU-only holder of block 0 drops at block 1; a speculative GPU copy of block 2
    {
        "keys": KEYS[:4],
        "gpu": {KEYS[1]: 1},
        "spec": {KEYS[2]: 1},
        "cpu": {KEYS[0]: 3, KEYS[3]: 2},
        "disk": {KEYS[0]: 1},
        "allowed": 3,
    },
    True,
)
@example(  # slot 62 of 64 offloaded block 1 to CPU: a CPU block of a high bit
    {
        "keys": KEYS[:5],
        "gpu": {k: (1 << 64) - 1 - (1 << 62 if i == 1 else 0) for i, k in enumerate(KEYS[:5])},
        "spec": {},
        "cpu": {KEYS[1]: 1 << 62},
        "disk": {},
        "allowed": (1 << 64) - 1,
    },
    False,
)
def test_media_depths_is_the_reference(case: dict[str, Any], as_tuple: bool) -> None:
    assert NATIVE is not None
    keys, gpu, spec, cpu, disk, allowed = (
        case[k] for k in ("keys", "gpu", "spec", "cpu", "disk", "allowed")
    )
    counts, n_cpu, n_disk = NATIVE.media_depths(
        tuple(keys) if as_tuple else keys, gpu, spec, cpu, disk, allowed
    )
    g = [gpu.get(k, 0) | spec.get(k, 0) for k in keys]
    c = [cpu.get(k, 0) for k in keys] if cpu else None
    d = [disk.get(k, 0) for k in keys] if disk else None
    if not keys or not allowed:
        assert (counts, n_cpu, n_disk) == ({}, {}, {})
        return
    want = media_depths(g, c, d, allowed)
    assert list(counts.items()) == list(want[0].items())
    assert (n_cpu, n_disk) == (want[1], want[2])


def test_compiled_depths_refuse_a_negative_mask() -> None:
    assert NATIVE is not None
    for f in (NATIVE.gpu_depths, NATIVE.media_depths):
        with pytest.raises(ValueError):
            f(KEYS[:1], {}, {}, {}, {}, -1)


_hold = st.tuples(
    st.integers(0, 69),  # endpoint: past 64 workers the masks take a second word
    st.integers(0, 1),  # dp rank
    st.sampled_from(MEDIA),
    st.integers(0, 12),  # leading blocks held
    st.sets(st.integers(0, 11), max_size=3),  # holes
)


@settings(max_examples=scaled(200))
@given(
    st.lists(_hold, max_size=24),
    st.lists(st.tuples(st.integers(0, 69), st.integers(1, 12)), max_size=3),
    st.integers(0, 12),
    st.none() | st.sets(st.integers(0, 69), max_size=8),
    st.sampled_from([0, 60, 64, 130]),
)
@example(
    holds=[(0, 0, "GPU", 5, set()), (1, 0, "CPU", 3, set())], spec=[], plen=6, eps=None, first=0
)
@example(
    holds=[(66, 1, "GPU", 4, {2}), (66, 0, "GPU", 6, set())],
    spec=[(3, 2)],
    plen=8,
    eps=None,
    first=64,
)
def test_compiled_index_matches_the_reference_index(
    holds: list[tuple[int, int, str, int, set[int]]],
    spec: list[tuple[int, int]],
    plen: int,
    eps: set[int] | None,
    first: int,
) -> None:
    """`first`: slots made before the holders' (their bits start there: past one word)."""
    cfg = IndexConfig.model_validate({"medium_weights": {"GPU": 1.0, "CPU": 0.3, "DISK": 0.05}})
    nat, ref = BlockIndex(cfg), BlockIndex(cfg, native=False)
    assert nat.native and not ref.native
    for idx in (nat, ref):
        for f in range(first):
            idx.add(f"idle{f}", 0, [], [])
        for w, rank, medium, n, holes in holds:
            pos = [p for p in range(n) if p not in holes]
            idx.add(f"w{w}", rank, [KEYS[p] ^ 0x55 for p in pos], [KEYS[p] for p in pos], medium)
        for w, n in spec:
            idx.insert_speculative(f"w{w}", KEYS[:n])
    endpoints = None if eps is None else [f"w{w}" for w in sorted(eps)]
    for prompt in (KEYS[:plen], KEYS[1 : plen + 1]):
        a, b = nat.match(prompt, endpoints), ref.match(prompt, endpoints)
        assert list(a.items()) == list(b.items())
        # Twice: the second lookup takes its Matches from the cache.
        assert nat.match(prompt, endpoints) == a


def test_match_cache_is_bounded_and_shared() -> None:
    cache = MatchCache(0.5)
    m = cache.make(7)
    assert cache.make(7) is m and (m.blocks, m.by_medium, m.weighted) == (7, {"GPU": 7}, 3.5)
    for c in range(MATCH_CACHE + 10):
        cache.make(c)
    assert len(cache) <= MATCH_CACHE


@settings(max_examples=scaled(100))
@given(
    st.dictionaries(st.integers(0, 70), st.integers(1, 40), max_size=20),
    st.sampled_from([1.0, 0.5]),
)
@example(counts={3: 2, 0: 2, 64: 7}, wg=1.0)
def test_depth_matches_is_from_depths(counts: dict[int, int], wg: float) -> None:
    # One endpoint per slot (no dp ranks): the compiled loop over the depths.
    assert NATIVE is not None
    bit_ep = [f"w{b}" for b in range(71)]
    cache = MatchCache(wg)
    got = NATIVE.depth_matches(counts, bit_ep, cache, cache.make)
    want = from_depths(counts, bit_ep, False, wg)
    assert list(got.items()) == list(want.items())
    again = NATIVE.depth_matches(counts, bit_ep, cache, cache.make)
    assert all(again[e] is got[e] for e in got)  # kept: the same objects
