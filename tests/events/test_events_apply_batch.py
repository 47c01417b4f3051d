"""Applying a batch at once (pending stores handed to the index in one add) means exactly
what applying its events one by one means."""

from __future__ import annotations

from typing import Any

import pytest
from hypo import scaled
from hypothesis import given, settings
from hypothesis import strategies as st

from scorer.blocks import BlockHasher
from scorer.events.apply import Applier
from scorer.events.decode import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
    EventBatch,
)
from scorer.index import BlockIndex

BS = 4

_op = st.one_of(
    # (kind, n blocks / hashes, parent choice, medium, token seed)
    st.tuples(
        st.just("store"),
        st.integers(1, 3),
        st.integers(-1, 12),
        st.sampled_from(["GPU", "CPU", "DISK"]),
        st.integers(0, 3),
    ),
    st.tuples(st.just("remove"), st.integers(0, 12), st.sampled_from(["GPU", "CPU"])),
    st.just(("clear",)),
)


def _events(ops: list[tuple[Any, ...]]) -> list[Event]:
    """Turn ops into events; store hashes are fresh ints, parents point at earlier ones."""
    events: list[Event] = []
    next_hash = 100
    issued: list[int] = []
    for op in ops:
        if op[0] == "store":
            _, n, pchoice, medium, seed = op
            parent = issued[pchoice % len(issued)] if issued and pchoice >= 0 else None
            hashes = list(range(next_hash, next_hash + n))
            next_hash += n
            issued += hashes
            toks = [(seed * 31 + i) % 50 for i in range(n * BS)]
            events.append(BlockStored(hashes, parent, toks, BS, medium=medium))
        elif op[0] == "remove":
            _, i, medium = op
            if issued:
                events.append(BlockRemoved([issued[i % len(issued)]], medium=medium))
        else:
            events.append(AllBlocksCleared())
    return events


def _state(idx: BlockIndex) -> Any:
    return (
        {m: dict(d) for m, d in idx._media.items()},
        {k: (dict(s.emap), dict(s.counts)) for k, s in idx._slots.items()},
    )


@pytest.mark.slow
@settings(max_examples=scaled(200))
@given(st.lists(_op, max_size=14))
def test_batch_equals_one_by_one(ops: list[tuple[Any, ...]]) -> None:
    events = _events(ops)
    hasher = BlockHasher(BS)
    whole, single = BlockIndex(), BlockIndex()
    a1, a2 = Applier(whole, hasher), Applier(single, hasher)
    a1.apply("w", EventBatch(0.0, events))
    for ev in events:
        a2.apply("w", EventBatch(0.0, [ev]))
    assert _state(whole) == _state(single)
    assert a1.stats.get("w") == a2.stats.get("w") or not events


def test_interleaved_chains_in_one_batch() -> None:
    """Two requests' decode steps interleaved in one message: each continues its own chain
    (parents pending in the same batch), and a medium switch splits the pending run."""
    hasher = BlockHasher(BS)
    idx = BlockIndex()
    ap = Applier(idx, hasher)
    a = list(range(0, 3 * BS))
    b = list(range(50, 50 + 3 * BS))
    events: list[Event] = [
        BlockStored([1], None, a[:BS], BS),
        BlockStored([11], None, b[:BS], BS),
        BlockStored([2], 1, a[BS : 2 * BS], BS),
        BlockStored([12], 11, b[BS : 2 * BS], BS, medium="CPU"),
        BlockStored([3], 2, a[2 * BS :], BS),
        BlockStored([13], 12, b[2 * BS :], BS),
    ]
    ap.apply("w", EventBatch(0.0, events))
    assert idx.match(hasher.keys(a))["w"].blocks == 3
    mb = idx.match(hasher.keys(b))["w"]
    assert mb.blocks == 3 and mb.by_medium == {"GPU": 2, "CPU": 1}
    assert ap.stats["w"].stored == 6 and ap.stats["w"].unknown_parent == 0


@pytest.mark.parametrize("native", [False, None])
def test_blocks_pending_when_a_batch_raised_never_reach_the_next_one(
    native: bool | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    hasher = BlockHasher(BS)
    index = BlockIndex()
    applier = Applier(index, hasher, native=native)
    if native is None and applier._fused is None:
        pytest.skip("scorer.native is not built")
    tokens = list(range(BS))
    # A store is pending when the next one (its parent unknown: looked up) raises.
    monkeypatch.setattr(index, "lookup_engine", lambda *a: (_ for _ in ()).throw(RuntimeError("x")))
    batch = [BlockStored([7], None, tokens, BS), BlockStored([9], 12345, tokens, BS)]
    with pytest.raises(RuntimeError):
        applier.apply("a", EventBatch(1.0, batch))
    monkeypatch.undo()
    # The next batch (another worker's, one store of its own) adds only its own block.
    applier.apply("b", EventBatch(1.0, [BlockStored([8], None, tokens[::-1], BS)]))
    assert index.stats("b")["blocks"]["GPU"] == 1
    assert index.lookup_engine("b", None, 7) is None
