"""Worker churn: a removed worker's slot is released, its bits leave every entry, and a
worker that reuses the slot (bit) inherits none of its blocks."""

from __future__ import annotations

import asyncio
from array import array
from typing import Any

import pytest
from hypo import scaled
from hypothesis import example, given, settings
from hypothesis import strategies as st

from scorer.blocks import BlockHasher
from scorer.config import Config, IndexConfig
from scorer.events.ingest import EventIngest
from scorer.index import MEDIA, BlockIndex, block_index
from scorer.pool import Pool

KEYS = BlockHasher(4).keys(list(range(4 * 12)))
NATIVE = pytest.mark.parametrize("native", [False, True], ids=["py", "native"])


def _bits_held(idx: BlockIndex) -> dict[int, int]:
    """Slot bit → entries whose mask has it, over every medium and speculative entry."""
    out: dict[int, int] = {}
    for d in [*(idx._media[m] for m in MEDIA), idx._spec]:
        for m in d.values():
            while m:
                low = m & -m
                b = low.bit_length() - 1
                out[b] = out.get(b, 0) + 1
                m ^= low
    return out


def _check_bits(idx: BlockIndex) -> None:
    """Every bit in a stored mask belongs to a live slot, whose counts are exact."""
    table = idx._table
    live = {s.bit: s for s in table.slots.values()}
    held = _bits_held(idx)
    assert set(held) <= set(live), "an entry carries the bit of a released slot"
    for b, s in live.items():
        stored = sum(1 for m in MEDIA for mask in idx._media[m].values() if mask >> b & 1)
        assert stored == sum(s.counts.values()), (s.endpoint, s.rank)
    assert table.all_mask == sum(1 << b for b in live)


@NATIVE
def test_churn_reuses_slots(native: bool) -> None:
    # A rolling update replaces every pod many times over: slots stay as many as the live
    # workers, not the workers ever seen.
    idx = BlockIndex(native=native)
    idx.add("stable", 0, range(12), KEYS)
    for i in range(3000):
        ep = f"10.0.{i // 250}.{i % 250}:8000"
        idx.add(ep, 0, range(6), KEYS[:6])
        idx.insert_speculative(ep, KEYS[6:])
        assert set(idx.match(KEYS)) == {"stable", ep}
        idx.release(ep)
    assert len(idx._table.by_bit) == 2
    assert idx.endpoints() == ["stable"] and idx.ranks("10.0.0.0:8000") == 0
    assert idx.total_entries() == 12 and not idx._spec
    assert len(idx._masks) <= 2  # canonical masks of released bits were dropped
    _check_bits(idx)


@NATIVE
def test_reused_slot_inherits_no_block(native: bool) -> None:
    idx = BlockIndex(native=native)
    idx.add("old", 0, [1, 2], KEYS[:2])
    idx.add("old", 0, [1], [KEYS[5]])  # engine key 1 now names another block
    idx.add("old", 1, [7], [KEYS[7]], "CPU")
    idx.add("peer", 0, range(4), KEYS[:4])
    old_bits = {s.bit for s in idx._table.of("old")}
    idx.release("old")
    idx.add("new", 0, [9], [KEYS[9]])
    assert idx._table.slots["new", 0].bit in old_bits
    for k in (KEYS[0], KEYS[1], KEYS[5], KEYS[7]):
        assert "new" not in idx.match([k]) and "old" not in idx.match([k])
    assert idx.match(KEYS[:4])["peer"].blocks == 4
    assert idx.stats("new")["blocks"] == {"GPU": 1, "CPU": 0, "DISK": 0}
    _check_bits(idx)


@NATIVE
def test_purge_forgets_a_block_whose_engine_key_was_reused(native: bool) -> None:
    # An engine key re-sent for another block leaves the first block unreachable from the
    # engine map; purge (forget everything) must still forget it.
    idx = BlockIndex(native=native)
    idx.add("a", 0, [1], [KEYS[0]])
    idx.add("a", 0, [1], [KEYS[1]])
    idx.purge("a")
    assert idx.match([KEYS[0]]) == {} and idx.total_entries() == 0
    _check_bits(idx)


@NATIVE
def test_an_engine_key_sent_again_names_one_block(native: bool) -> None:
    # A publisher that sends one engine key again and again with other blocks: each send
    # replaces the block the key named, so the worker's entries stay within its bound (its
    # engine map's size) instead of growing by one unreachable entry per send.
    idx = BlockIndex(IndexConfig(max_blocks_per_worker=4), native=native)
    many = BlockHasher(4).keys(list(range(4 * 200)))
    idx.add("peer", 0, [1], [many[0]])
    for i, k in enumerate(many):
        idx.add("a", 0, array("Q", [7]) if i % 2 else [7], array("Q", [k]) if i % 2 else [k])
    assert idx.total_entries() == 2  # "a" holds only the last block, "peer" its own
    assert set(idx.match([many[-1]])) == {"a"}
    assert set(idx.match([many[0]])) == {"peer"}  # dropped from "a" only
    # A block sent under two engine keys in one event, one of which named another block:
    # kept (this event stores it).
    idx.add("a", 0, [8, 7], [many[5], many[5]])
    assert set(idx.match([many[5]])) == {"a"} and idx.stats("a")["blocks"]["GPU"] == 1
    # More blocks than engine keys: the extra ones are not stored (nothing could remove them).
    idx.add("b", 0, [1], [many[1], many[2]])
    assert idx.stats("b")["blocks"]["GPU"] == 1 and idx.match([many[2]]) == {}
    _check_bits(idx)


class _Watched(dict[int, int]):
    """A medium dict that counts full scans."""

    scans = 0

    def items(self) -> Any:
        self.scans += 1
        return super().items()


def test_release_reads_only_the_workers_own_entries() -> None:
    # A worker leaving the pool costs its own entries, never a scan of every entry (it
    # used to, when an engine key had been sent again for another block).
    idx = BlockIndex(native=False)
    gpu = _Watched()
    idx._media["GPU"] = idx._gpu = gpu
    big = BlockHasher(4).keys(list(range(10_000, 10_000 + 4 * 300)))
    idx.add("big", 0, range(300), big)
    idx.add("a", 0, [1, 2], KEYS[:2])
    idx.add("a", 0, [1], [KEYS[5]])  # engine key 1 now names another block
    idx.release("a")
    assert gpu.scans == 0
    assert idx.total_entries() == 300 and set(idx.match(KEYS[:1])) == set()
    _check_bits(idx)


@NATIVE
async def test_a_big_release_leaves_in_chunks_between_loop_turns(
    native: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # On the event loop a released worker's entries leave a chunk per loop turn: the
    # worker is gone from every answer at once, its bit is freed only when no entry has it.
    monkeypatch.setattr(block_index, "RELEASE_CHUNK", 10)
    idx = BlockIndex(native=native)
    many = BlockHasher(4).keys(list(range(4 * 100)))
    idx.add("stays", 0, [1], many[:1])
    idx.add("old", 0, range(100), many)
    bit = idx._table.slots["old", 0].bit
    idx.release("old")
    assert idx.total_entries() == 1 + 90  # one chunk went at once
    assert set(idx.match(many)) == {"stays"} and "old" not in idx.endpoints()
    idx.add("new", 0, [5], many[:1])  # the bit is not free yet: a new one is taken
    assert idx._table.slots["new", 0].bit != bit
    for _ in range(100):  # bounded: 9 more turns are needed
        if not idx._leaving:
            break
        await asyncio.sleep(0)
    assert not idx._leaving and idx.total_entries() == 2
    _check_bits(idx)
    idx.add("newer", 0, [6], many[:1])
    assert idx._table.slots["newer", 0].bit == bit  # freed once cleared
    assert {e: m.blocks for e, m in idx.match(many).items()} == {"stays": 1, "new": 1, "newer": 1}


async def test_a_worker_removed_from_the_pool_releases_its_slot() -> None:
    config = Config.model_validate(
        {"pool": {"workers": [{"endpoint": "10.0.0.1:8000"}, {"endpoint": "10.0.0.2:8000"}]}}
    )
    pool = Pool.from_config(config)
    idx = BlockIndex(config.index)
    EventIngest(config, pool, idx, BlockHasher(4))
    template = pool.workers["10.0.0.2:8000"].config
    for n in range(50):  # rolling updates: a new pod per round, the old one removed
        ep = f"10.0.1.{n}:8000"
        pool.add(template.model_copy(update={"endpoint": ep}))
        idx.add(ep, 0, range(3), KEYS[:3])
        old = f"10.0.1.{n - 1}:8000" if n else "10.0.0.2:8000"
        idx.add(old, 0, range(3), KEYS[:3])
        pool.remove(old, "deleted")
        assert set(idx.match(KEYS[:3])) == {ep}
    assert len(idx._table.by_bit) <= 3
    assert set(idx.endpoints()) == {"10.0.1.49:8000"}  # 10.0.0.1 never stored a block
    _check_bits(idx)


# ---- property: release then reuse, against the same index without the released worker ----

_EPS = ["a", "b", "c"]
# (endpoint, rank, medium, [(engine key, block position)]): few engine keys, so an engine
# key is often sent again for another block.
_add = st.tuples(
    st.just("add"),
    st.sampled_from(_EPS),
    st.integers(0, 1),
    st.sampled_from(MEDIA),
    st.lists(st.tuples(st.integers(0, 5), st.integers(0, len(KEYS) - 1)), max_size=6),
)
_remove = st.tuples(
    st.just("remove"),
    st.sampled_from(_EPS),
    st.integers(0, 1),
    st.sampled_from(MEDIA),
    st.lists(st.integers(0, 5), max_size=4),
)
_spec = st.tuples(st.just("spec"), st.sampled_from(_EPS), st.integers(1, len(KEYS)))
_clear = st.tuples(st.just("clear"), st.sampled_from(_EPS), st.integers(0, 1))
_op = st.one_of(_add, _remove, _spec, _clear)


def _apply(idx: BlockIndex, ops: list[tuple[Any, ...]], skip: str | None = None) -> None:
    for op in ops:
        if op[1] == skip:
            continue
        if op[0] == "add":
            _, ep, rank, medium, pairs = op
            idx.add(ep, rank, [e for e, _ in pairs], [KEYS[p] for _, p in pairs], medium)
        elif op[0] == "remove":
            _, ep, rank, medium, ekeys = op
            idx.remove(ep, rank, ekeys, medium)
        elif op[0] == "spec":
            idx.insert_speculative(op[1], KEYS[: op[2]])
        else:
            idx.clear(op[1], op[2])


def _view(idx: BlockIndex, prompt: list[int]) -> dict[str, tuple[int, dict[str, int]]]:
    return {ep: (m.blocks, dict(m.by_medium)) for ep, m in idx.match(prompt).items()}


@NATIVE
@settings(max_examples=scaled(200))
@given(
    st.lists(_op, max_size=12),
    st.sampled_from(_EPS),
    st.lists(st.tuples(st.integers(0, 5), st.integers(0, len(KEYS) - 1)), max_size=5),
    st.integers(1, len(KEYS)),
)
@example(  # an engine key re-sent for another block, then the worker is released
    ops=[("add", "a", 0, "GPU", [(0, 0)]), ("add", "a", 0, "GPU", [(0, 1)])],
    victim="a",
    new=[],
    plen=2,
)
@example(  # one engine key twice in one event, for two blocks: the first is replaced
    ops=[("add", "a", 0, "GPU", []), ("add", "a", 0, "GPU", [(0, 1), (0, 0)])],
    victim="a",
    new=[(0, 1)],
    plen=1,
)
@example(  # the same on a second dp rank, nothing added after the release
    ops=[("add", "a", 0, "GPU", []), ("add", "a", 1, "GPU", [(0, 0), (0, 1)])],
    victim="a",
    new=[],
    plen=1,
)
@example(  # the same block added twice in one event, held by another worker too
    ops=[("add", "b", 0, "GPU", [(1, 0)]), ("add", "a", 0, "GPU", [(0, 0), (2, 0)])],
    victim="a",
    new=[(3, 0)],
    plen=1,
)
@example(  # a live worker adds a block twice in one event, another holds it too
    ops=[("add", "a", 0, "GPU", [(1, 0)]), ("add", "b", 0, "GPU", [(0, 0), (2, 0)])],
    victim="c",
    new=[],
    plen=1,
)
@example(  # a speculative entry of the released worker, then one of the new worker
    ops=[("spec", "a", 3), ("add", "b", 1, "CPU", [(0, 0)])],
    victim="a",
    new=[],
    plen=3,
)
def test_release_then_reuse_equals_never_having_had_the_worker(
    native: bool,
    ops: list[tuple[Any, ...]],
    victim: str,
    new: list[tuple[int, int]],
    plen: int,
) -> None:
    idx = BlockIndex(native=native)
    _apply(idx, ops)
    victim_bits = {s.bit for s in idx._table.of(victim)}
    idx.release(victim)
    idx.add("new", 0, [e for e, _ in new], [KEYS[p] for _, p in new])
    if victim_bits and new:
        assert idx._table.slots["new", 0].bit in victim_bits  # the released bit is reused
    # The same history without the released worker, then the new one: same answers.
    ref = BlockIndex(native=native)
    _apply(ref, ops, skip=victim)
    ref.add("new", 0, [e for e, _ in new], [KEYS[p] for _, p in new])
    prompt = KEYS[:plen]
    assert _view(idx, prompt) == _view(ref, prompt)
    for ep in [*_EPS, "new"]:
        assert idx.stats(ep)["blocks"] == ref.stats(ep)["blocks"], ep
    assert idx.total_entries() == ref.total_entries()
    _check_bits(idx)
    assert len(idx._table.by_bit) <= len(ref._table.by_bit) + len(victim_bits)


def test_allowed_mask_follows_slots_made_and_freed() -> None:
    # The candidates' slot mask is remembered for the same endpoint list; a new slot (a dp
    # rank, a worker) or a released one must not leave a stale mask behind.
    idx = BlockIndex()
    table = idx._table
    eps = ["a", "b"]
    idx.add("a", 0, [1], KEYS[:1])
    assert table.allowed(eps) == 0b1
    idx.add("b", 0, [2], KEYS[:1])
    assert table.allowed(eps) == 0b11
    idx.add("a", 1, [3], KEYS[:1])  # a second rank of a
    assert table.allowed(list(eps)) == 0b111
    eps.append("c")  # the caller's list changed in place: still read afresh
    idx.add("c", 0, [4], KEYS[:1])
    assert table.allowed(eps) == 0b1111
    idx.release("b")
    assert table.allowed(eps) == 0b1101
    assert {e: m.blocks for e, m in idx.match(KEYS[:1], eps).items()} == {"a": 1, "c": 1}


# ---- clear / purge of a big slot: a fresh slot now, the old entries in chunks ----------


@NATIVE
async def test_a_big_purge_gives_a_fresh_slot_at_once_and_leaves_in_chunks(
    native: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A restart, health ejection or unrecoverable gap purges a worker: with more entries
    # than a loop turn clears, it gets a fresh slot (another bit) at once; events right
    # after the purge land there, and no answer counts the old entries as the worker's.
    monkeypatch.setattr(block_index, "RELEASE_CHUNK", 10)
    idx = BlockIndex(native=native)
    many = BlockHasher(4).keys(list(range(4 * 100)))
    idx.add("stays", 0, [1], many[:1])
    idx.add("w", 0, range(100), many)
    idx.remove("w", 0, [99])
    old = idx._table.slots["w", 0]
    idx.purge("w")
    assert idx.total_entries() == 1 + 99 - 10  # one chunk went at once
    assert idx._leaving and idx._leaving[0] is old
    fresh = idx._table.slots["w", 0]
    assert fresh is not old and fresh.bit != old.bit
    assert set(idx.match(many)) == {"stays"} and "w" in idx.endpoints()
    assert idx.stats("w")["purges"] == 1 and idx.removed_total("w") == 1
    assert idx.stats("w")["blocks"]["GPU"] == 0 and idx.stats("w")["engine_hashes"] == 0
    # The restarted engine stores blocks at once, reusing engine keys of its old run.
    idx.add("w", 0, range(3), many[:3])
    assert {e: m.blocks for e, m in idx.match(many).items()} == {"stays": 1, "w": 3}
    assert idx.lookup_engine("w", 0, 50) is None  # the old run's engine key is gone
    for _ in range(100):  # bounded: 9 more turns are needed
        if not idx._leaving:
            break
        await asyncio.sleep(0)
    assert not idx._leaving and idx.total_entries() == 1 + 3
    assert {e: m.blocks for e, m in idx.match(many).items()} == {"stays": 1, "w": 3}
    _check_bits(idx)
    idx.remove("w", 0, [0])  # BlockRemoved after the purge: from the fresh slot
    assert {e: m.blocks for e, m in idx.match(many).items()} == {"stays": 1}
    idx.add("new", 0, [7], many[:1])
    assert idx._table.slots["new", 0].bit == old.bit  # freed once cleared


@NATIVE
async def test_all_blocks_cleared_then_stored_in_one_batch(
    native: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The event path (Applier, compiled or not): AllBlocksCleared of one dp rank of a big
    # worker, then BlockStored in the same batch; the other rank and worker are untouched.
    from scorer.events.apply import Applier
    from scorer.events.decode import AllBlocksCleared, BlockStored, EventBatch

    monkeypatch.setattr(block_index, "RELEASE_CHUNK", 10)
    hasher = BlockHasher(4)
    idx = BlockIndex(native=native)
    ap = Applier(idx, hasher, native=native)
    toks = list(range(4 * 60))
    run = hasher.keys(toks)
    ap.apply("w", EventBatch(0.0, [BlockStored(list(range(1, 61)), None, toks, 4)], 0))
    ap.apply("w", EventBatch(0.0, [BlockStored([1, 2], None, toks[:8], 4)], 1))
    ap.apply("v", EventBatch(0.0, [BlockStored([1], None, toks[:4], 4)], 0))
    assert idx.match(run)["w"].blocks == 60
    again = [AllBlocksCleared(), BlockStored([1, 2, 3, 4], None, toks[:16], 4)]
    ap.apply("w", EventBatch(0.0, again, 0))
    assert idx._leaving  # rank 0's 60 entries leave over loop turns
    assert idx.stats("w")["ranks"] == [0, 1]
    assert {e: m.blocks for e, m in idx.match(run).items()} == {"w": 4, "v": 1}
    for _ in range(100):
        if not idx._leaving:
            break
        await asyncio.sleep(0)
    assert not idx._leaving
    assert {e: m.blocks for e, m in idx.match(run).items()} == {"w": 4, "v": 1}
    assert idx.stats("w")["blocks"]["GPU"] == 4 + 2 and idx.total_entries() == 4 + 2 + 1
    _check_bits(idx)


_purge = st.tuples(st.just("purge"), st.sampled_from(_EPS))


def _apply_all(idx: BlockIndex, ops: list[tuple[Any, ...]]) -> None:
    for op in ops:
        if op[0] == "purge":
            idx.purge(op[1])
        else:
            _apply(idx, [op])


@NATIVE
@settings(max_examples=scaled(200))
@given(st.lists(st.one_of(_op, _purge), max_size=14), st.integers(1, len(KEYS)))
@example(  # a purge of a slot holding a block another worker holds too, then a re-add
    ops=[
        ("add", "a", 0, "GPU", [(0, 0), (1, 1)]),
        ("add", "b", 0, "GPU", [(0, 0)]),
        ("purge", "a"),
        ("add", "a", 0, "GPU", [(0, 0)]),
    ],
    plen=2,
)
@example(  # one rank of two cleared, a speculative entry of the worker before it
    ops=[
        ("spec", "a", 2),
        ("add", "a", 1, "CPU", [(0, 0)]),
        ("add", "a", 0, "GPU", [(1, 0), (2, 1)]),
        ("clear", "a", 0),
        ("add", "a", 0, "DISK", [(2, 1)]),
    ],
    plen=2,
)
def test_a_slot_cleared_by_replacement_answers_as_one_cleared_in_place(
    native: bool, ops: list[tuple[Any, ...]], plen: int
) -> None:
    # Every non-empty slot cleared by replacement (RELEASE_CHUNK 0; with no running loop
    # its old entries leave at once) answers, counts and bounds as the slot emptied in place.
    ref = BlockIndex(native=native)
    _apply_all(ref, ops)
    idx = BlockIndex(native=native)
    chunk = block_index.RELEASE_CHUNK
    block_index.RELEASE_CHUNK = 0
    try:
        _apply_all(idx, ops)
    finally:
        block_index.RELEASE_CHUNK = chunk
    assert not idx._leaving
    for n in range(1, plen + 1):
        assert _view(idx, KEYS[:n]) == _view(ref, KEYS[:n])
    for ep in _EPS:
        assert idx.stats(ep) == ref.stats(ep), ep
        for r in (0, 1):
            for ek in range(6):
                assert idx.lookup_engine(ep, r, ek) == ref.lookup_engine(ep, r, ek)
    assert idx.total_entries() == ref.total_entries()
    assert list(idx._table.slots) == list(ref._table.slots)
    assert idx.endpoints() == ref.endpoints()
    _check_bits(idx)
