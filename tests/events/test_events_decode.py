"""The decoder against every vLLM release's real messages, plus fuzzing."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypo import scaled
from hypothesis import given, settings
from hypothesis import strategies as st

from scorer.blocks import BlockHasher
from scorer.events.apply import Applier
from scorer.events.decode import (
    END_SEQ,
    ERROR_KINDS,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    DecodeError,
    EventBatch,
    _fast_payload,
    decode_message,
    decode_payload_generic,
    normalize_medium,
    split_replay_reply,
)
from scorer.index import BlockIndex

VECTORS = json.loads(
    (Path(__file__).parents[1] / "fixtures" / "vectors" / "vllm-kv-events.json").read_text()
)
CASES = [(v["vllm_version"], c) for v in VECTORS["versions"] for c in v["cases"]]
MESSAGES = [
    (f"{ver}/{c['name']}/{i}", m) for ver, c in CASES for i, m in enumerate(c.get("messages", []))
]
REPLAYS = [(f"{ver}/{c['name']}", c) for ver, c in CASES if "reply_messages_b64" in c]


def _unjson(v: Any) -> Any:
    if isinstance(v, dict) and set(v) == {"bytes_hex"}:
        return bytes.fromhex(v["bytes_hex"])
    if isinstance(v, list):
        return [_unjson(x) for x in v]
    return v


def _frames(parts: list[str]) -> list[bytes]:
    return [base64.b64decode(p) for p in parts]


@pytest.mark.parametrize(("name", "m"), MESSAGES, ids=[n for n, _ in MESSAGES])
def test_every_vector_decodes_to_its_meaning(name: str, m: dict[str, Any]) -> None:
    msg = decode_message(_frames(m["parts_b64"]))
    want = m["decoded"]
    assert msg.seq == m["seq"] and msg.topic == m["topic"]
    assert msg.batch.ts == want["ts"]
    rank = want["data_parallel_rank"]
    assert msg.batch.dp_rank == (None if rank == "FIELD_ABSENT_IN_THIS_VERSION" else rank)
    assert msg.batch.errors == []
    assert len(msg.batch.events) == len(want["events"])
    for got, exp in zip(msg.batch.events, want["events"], strict=True):
        assert type(got).__name__ == exp["type"]
        if isinstance(got, BlockStored):
            assert list(got.block_hashes) == _unjson(exp["block_hashes"])
            assert got.parent_block_hash == _unjson(exp["parent_block_hash"])
            assert list(got.token_ids) == exp["token_ids"]
            assert got.block_size == exp["block_size"]
            assert got.lora_id == exp.get("lora_id")
            assert got.medium_raw == exp.get("medium")
            assert got.medium == normalize_medium(exp.get("medium"))
            assert got.lora_name == exp.get("lora_name")
            assert got.extra_keys == _unjson(exp.get("extra_keys"))
            assert got.group_idx == exp.get("group_idx")
        elif isinstance(got, BlockRemoved):
            assert got.block_hashes == _unjson(exp["block_hashes"])
            assert got.medium_raw == exp.get("medium")
            assert got.group_idx == exp.get("group_idx")
        else:
            assert isinstance(got, AllBlocksCleared)


@pytest.mark.parametrize(("name", "c"), REPLAYS, ids=[n for n, _ in REPLAYS])
def test_replay_replies_split(name: str, c: dict[str, Any]) -> None:
    for frames_b64, meaning in zip(
        c["reply_messages_b64"], c["reply_messages_meaning"], strict=True
    ):
        topic, seq_b, payload = split_replay_reply(_frames(frames_b64))
        assert (seq_b == END_SEQ) == meaning["is_end_marker"]
        if meaning["is_end_marker"]:
            assert payload == b""
        else:
            assert int.from_bytes(seq_b, "big") == meaning["seq"]
        if meaning["topic"] == "NO_TOPIC_FRAME_IN_THIS_VERSION":
            assert topic is None
        else:
            assert topic == meaning["topic"]


def test_vectors_apply_in_our_hash_space() -> None:
    """Chained BlockStored of every era lands on the same keys as hashing the prompt."""
    hasher = BlockHasher(16)
    keys = hasher.keys(list(range(1, 49)))
    for ver, c in CASES:
        if c["name"] != "mixed_batch":
            continue
        idx = BlockIndex()
        ap = Applier(idx, hasher)
        msg = decode_message(_frames(c["messages"][0]["parts_b64"]))
        msg.batch.events = msg.batch.events[:2]  # the two stores, not the removal/clear
        ap.apply("w", msg.batch)
        assert idx.match(keys)["w"].blocks == 3, ver


@pytest.mark.parametrize(
    ("raw", "want"),
    [
        ("GPU", "GPU"), ("CPU", "CPU"), ("cpu", "CPU"), ("CPU_PINNED", "CPU"), ("FS", "DISK"),
        ("OBJ", "DISK"), ("STORAGE", "DISK"), ("DISK", "DISK"), ("EXTERNAL", "DISK"),
        (None, "GPU"), ("HBM-9000", "GPU"), (b"cpu", "CPU"),
    ],
)  # fmt: skip
def test_medium_spellings(raw: object, want: str) -> None:
    assert normalize_medium(raw) == want


def test_map_shaped_batch_and_extra_positional_fields() -> None:
    ev = ["BlockStored", [1], None, list(range(16)), 16, None, "GPU", None, None, 0, "x", 5]
    payload = msgspec.msgpack.encode({"ts": 1.5, "events": [ev], "data_parallel_rank": 2})
    msg = decode_message([b"t", (7).to_bytes(8, "big"), payload])
    assert msg.batch.dp_rank == 2 and msg.seq == 7
    (got,) = msg.batch.events
    assert isinstance(got, BlockStored) and got.group_idx == 0


def test_sglang_cache_salt_field() -> None:
    ev = {"type": "BlockStored", "block_hashes": [5], "parent_block_hash": None,
          "token_ids": list(range(16)), "block_size": 16, "medium": "CPU_PINNED",
          "cache_salt": "tenant-b", "brand_new_field": [1, 2]}  # fmt: skip
    msg = decode_message([b"", bytes(8), msgspec.msgpack.encode([0.0, [ev]])])
    (got,) = msg.batch.events
    assert isinstance(got, BlockStored)
    assert got.cache_salt == "tenant-b" and got.medium == "CPU"


# ---- fuzzing -----------------------------------------------------------------------------

_GOOD = [_frames(m["parts_b64"]) for _, m in MESSAGES]


def _check(frames: list[bytes]) -> None:
    """Decoding + applying never raises anything but DecodeError; errors carry a known kind."""
    idx = BlockIndex()
    ap = Applier(idx, BlockHasher(16))
    try:
        msg = decode_message(frames)
    except DecodeError as e:
        assert e.kind in ERROR_KINDS
        return
    for err in msg.batch.errors:
        assert err.kind in ERROR_KINDS
    ap.apply("w", msg.batch)


@pytest.mark.slow
@settings(max_examples=scaled(150))
@given(st.lists(st.binary(max_size=64), min_size=0, max_size=5))
def test_fuzz_random_frames(frames: list[bytes]) -> None:
    _check(frames)


@settings(max_examples=scaled(250))
@given(
    st.sampled_from(range(len(_GOOD))),
    st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), max_size=6),
    st.integers(0, 10_000),
)
@pytest.mark.slow
def test_fuzz_mutated_frames(i: int, flips: list[tuple[int, int]], cut: int) -> None:
    topic, seq, payload = _GOOD[i]
    p = bytearray(payload)
    for pos, val in flips:
        if p:
            p[pos % len(p)] = val
    if cut % 3 == 0 and p:
        p = p[: cut % len(p)]
    _check([topic, seq, bytes(p)])


_leaf = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(allow_nan=False),
    st.text(max_size=8), st.binary(max_size=8),
)  # fmt: skip
_any = st.recursive(
    _leaf,
    lambda c: st.lists(c, max_size=5) | st.dictionaries(st.text(max_size=6), c, max_size=5),
    max_leaves=20,
)
_event = st.one_of(
    st.lists(_any, max_size=11).map(lambda f: ["BlockStored", *f]),
    st.lists(_any, max_size=4).map(lambda f: ["BlockRemoved", *f]),
    st.dictionaries(st.sampled_from(["block_hashes", "parent_block_hash", "token_ids",
                    "block_size", "medium", "group_idx", "extra_keys", "lora_name"]), _any)
    .map(lambda d: {"type": "BlockStored", **d}),
    _any,
)  # fmt: skip


@pytest.mark.slow
@settings(max_examples=scaled(150))
@given(st.floats(allow_nan=False) | _any, st.lists(_event, max_size=4), _any)
def test_fuzz_structured_batches(ts: Any, events: list[Any], rank: Any) -> None:
    payload = msgspec.msgpack.encode([ts, events, rank])
    _check([b"", bytes(8), payload])


@pytest.mark.parametrize("bad", [2**40, -1, "x", 1.5, None])
def test_bad_token_ids_are_counted_not_raised(bad: Any) -> None:
    ev = ["BlockStored", [1], None, [*range(15), bad], 16, None, None]
    msg = decode_message([b"", bytes(8), msgspec.msgpack.encode([0.0, [ev]])])
    idx = BlockIndex()
    ap = Applier(idx, BlockHasher(16))
    ap.apply("w", msg.batch)
    assert ap.stats["w"].bad_tokens == 1
    assert idx.total_entries() == 0


# ---- the typed fast path means exactly what the generic path means ------------------------


def _same_as_generic(payload: bytes) -> None:
    fast = _fast_payload(payload)
    try:
        slow: EventBatch | str = decode_payload_generic(payload)
    except DecodeError as e:
        slow = e.kind
    if fast is None:
        return  # the generic path runs: nothing to compare
    assert fast == slow


@pytest.mark.parametrize(("name", "m"), MESSAGES, ids=[n for n, _ in MESSAGES])
def test_fast_path_takes_every_clean_vector(name: str, m: dict[str, Any]) -> None:
    payload = _frames(m["parts_b64"])[2]
    fast = _fast_payload(payload)
    assert fast is not None and fast == decode_payload_generic(payload)


def test_fast_path_falls_back_on_odd_shapes() -> None:
    # bytes medium, unknown type, map-shaped batch, block_size 0: generic path, same meaning.
    ev = ["BlockStored", [1], None, list(range(16)), 16, None, b"cpu"]
    for batch in (
        [0.0, [ev]],
        [0.0, [["Mystery", 1], ev]],
        {"ts": 1.0, "events": [ev]},
        [0.0, [["BlockStored", [1], None, [1], 0]]],
        [True, [ev]],
    ):
        payload = msgspec.msgpack.encode(batch)
        assert _fast_payload(payload) is None
        _same_as_generic(payload)
    good = msgspec.msgpack.encode([2, [["BlockRemoved", [-5]], ["AllBlocksCleared"]], 1])
    got = _fast_payload(good)
    assert got == EventBatch(2.0, [BlockRemoved([-5]), AllBlocksCleared()], 1)


@pytest.mark.slow
@settings(max_examples=scaled(200))
@given(st.floats(allow_nan=False) | _any, st.lists(_event, max_size=4), _any)
def test_fuzz_fast_path_agrees(ts: Any, events: list[Any], rank: Any) -> None:
    _same_as_generic(msgspec.msgpack.encode([ts, events, rank]))
    _same_as_generic(msgspec.msgpack.encode([ts, events]))


_hash_st = st.integers(-(2**63), 2**64 - 1) | st.binary(min_size=1, max_size=32)
_medium_st = st.sampled_from([None, "GPU", "CPU", "cpu", "FS", "OBJ", "STORAGE", "CPU_PINNED",
                              "DISK", "EXTERNAL", "HBM"])  # fmt: skip
_opt_int_st = st.none() | st.integers(0, 3)
_valid_stored = st.tuples(
    st.lists(_hash_st, max_size=3), st.none() | _hash_st,
    st.lists(st.integers(0, 2**32 - 1), max_size=40), st.integers(1, 32), _opt_int_st,
    _medium_st, st.none() | st.text(max_size=4),
    st.none() | st.lists(st.none() | st.lists(st.text(max_size=3), max_size=2), max_size=3),
    _opt_int_st,
)  # fmt: skip
_NAMES = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
          "medium", "lora_name", "extra_keys", "group_idx")  # fmt: skip


def _named(fields: tuple[Any, ...]) -> dict[str, Any]:
    return dict(zip(_NAMES, fields, strict=True))


@settings(max_examples=scaled(200))
@given(
    st.lists(
        st.one_of(
            _valid_stored.map(lambda f: ["BlockStored", *f]),
            _valid_stored.map(lambda f: {"type": "BlockStored", **_named(f)}),
            st.tuples(st.lists(_hash_st, max_size=3), _medium_st, _opt_int_st).map(
                lambda f: ["BlockRemoved", *f]
            ),
            _medium_st.map(lambda m: {"type": "AllBlocksCleared", "medium": m}),
        ),
        max_size=4,
    ),
    st.none() | st.integers(0, 3),
)
@pytest.mark.slow
def test_fuzz_valid_batches_agree(events: list[Any], rank: int | None) -> None:
    _same_as_generic(msgspec.msgpack.encode([1.5, events, rank]))
