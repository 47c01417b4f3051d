"""Decoding and applying with the compiled hot paths (scorer.native) means exactly what the
pure-Python reference means: same events, same errors, same index afterwards, for every
vLLM release's vectors, generated event streams and hostile frames."""

from __future__ import annotations

import base64
import json
from array import array
from dataclasses import replace
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypo import scaled
from hypothesis import example, given, settings
from hypothesis import strategies as st

from scorer.blocks import BlockHasher
from scorer.events.apply import Applier
from scorer.events.decode import BlockStored, DecodeError, EventBatch, decode_message
from scorer.index import BlockIndex

BS = 4
VECTORS = json.loads(
    (Path(__file__).parents[1] / "fixtures" / "vectors" / "vllm-kv-events.json").read_text()
)
VECTOR_FRAMES = [
    [base64.b64decode(p) for p in m["parts_b64"]]
    for v in VECTORS["versions"]
    for c in v["cases"]
    for m in c.get("messages", [])
]


def _norm(batch: EventBatch) -> Any:
    """A batch with token ids and block hashes as lists (the compiled decoder gives
    array('I') / array('Q'))."""
    evs = [
        replace(e, token_ids=list(e.token_ids), block_hashes=list(e.block_hashes))
        if isinstance(e, BlockStored)
        else e
        for e in batch.events
    ]
    return (batch.ts, evs, batch.dp_rank, [(e.kind, e.detail) for e in batch.errors])


def _decode(frames: list[bytes], native: bool) -> Any:
    try:
        return decode_message(frames, native=native)
    except DecodeError as e:
        return e.kind


class Side:
    """One index + applier, pure-Python or compiled."""

    def __init__(self, native: bool, bs: int = BS, max_blocks: int = 10**9) -> None:
        self.native = native
        self.index = BlockIndex(native=native)
        self.index.max_blocks = max_blocks
        self.applier = Applier(self.index, BlockHasher(bs, native=native), native=native)
        self.drops: dict[str, int] = {}

    def feed(self, endpoint: str, frames: list[bytes]) -> Any:
        msg = _decode(frames, self.native)
        if isinstance(msg, str):  # a malformed frame: counted and dropped
            self.drops[msg] = self.drops.get(msg, 0) + 1
            return msg
        self.applier.apply(endpoint, msg.batch)
        return (msg.topic, msg.seq, _norm(msg.batch))

    def state(self) -> Any:
        idx = self.index
        return (
            {m: dict(d) for m, d in idx._media.items()},
            {
                k: (sorted(s.emap.items()), dict(s.counts), s.evictions)
                for k, s in idx._slots.items()
            },
            {ep: st for ep, st in self.applier.stats.items()},
            self.drops,
        )


def _same(streams: list[tuple[str, list[bytes]]], bs: int = BS, max_blocks: int = 10**9) -> None:
    pure, nat = Side(False, bs, max_blocks), Side(True, bs, max_blocks)
    for ep, frames in streams:
        assert nat.feed(ep, frames) == pure.feed(ep, frames)
    assert nat.state() == pure.state()
    keys = [k for d in pure.index._media.values() for k in d][:64]
    assert nat.index.match(keys) == pure.index.match(keys)


def test_every_vector_means_the_same() -> None:
    assert VECTOR_FRAMES
    for frames in VECTOR_FRAMES:
        _same([("w", frames)], bs=16)
    _same([("w", f) for f in VECTOR_FRAMES], bs=16)


def _frames(events: list[Any], rank: int | None = 0, seq: int = 0) -> list[bytes]:
    batch: list[Any] = [1.5, events] + ([] if rank is None else [rank])
    return [b"t", seq.to_bytes(8, "big"), msgspec.msgpack.encode(batch)]


_tok = st.integers(0, 60) | st.sampled_from([2**32 - 1, 2**32, -1, 2**40])
_stored = st.tuples(
    st.integers(1, 4),  # blocks
    st.integers(-1, 30),  # parent choice (-1: none)
    st.lists(_tok, min_size=0, max_size=3),  # token overrides (bad ids, short lists)
    st.sampled_from([None, "GPU", "CPU", "cpu", "STORAGE"]),
    st.sampled_from([BS, BS, 8]),  # block_size (8: mismatch)
    st.sampled_from([None, None, "lora-a"]),
    st.booleans(),  # map-shaped (0.24+) or positional
    # extra keys: absent; one None per block (vLLM >= 0.20, with kv_cache_spec_kind in a
    # map, >= 0.22); the last block's own key (multimodal); an empty list
    st.sampled_from(["absent", "none", "none", "mixed", "empty"]),
)
_op = st.one_of(
    st.tuples(st.just("store"), _stored),
    st.tuples(st.just("remove"), st.integers(0, 40), st.sampled_from([None, "GPU", "CPU"])),
    st.tuples(st.just("clear")),
    st.tuples(st.just("junk"), st.binary(max_size=24)),
    st.tuples(st.just("cut"), st.integers(1, 200)),
)


def _streams(ops: list[tuple[Any, ...]], workers: int = 2) -> list[tuple[str, list[bytes]]]:
    out: list[tuple[str, list[bytes]]] = []
    issued: list[int] = []
    nxt = 1000
    for i, op in enumerate(ops):
        ep = f"w{i % workers}"
        if op[0] == "store":
            n, pchoice, over, medium, bs, lora, as_map, *more = op[1]
            extras = more[0] if more else "absent"
            parent = issued[pchoice % len(issued)] if issued and pchoice >= 0 else None
            hashes = list(range(nxt, nxt + n))
            nxt += n
            issued += hashes
            toks = [(nxt * 7 + j) % 50 for j in range(n * BS)]
            toks[: len(over)] = over
            ek = {"none": [None] * n, "mixed": [None] * (n - 1) + [["mm"]], "empty": []}
            if as_map:
                ev: Any = {"type": "BlockStored", "block_hashes": hashes,
                           "parent_block_hash": parent, "token_ids": toks, "block_size": bs,
                           "medium": medium, "lora_name": lora}  # fmt: skip
                if extras != "absent":
                    ev.update(extra_keys=ek[extras], group_idx=0)
                    ev["kv_cache_spec_kind"] = "full_attention"
            else:
                ev = ["BlockStored", hashes, parent, toks, bs, None, medium, lora]
                if extras != "absent":
                    ev += [ek[extras], 0]
            out.append((ep, _frames([ev])))
        elif op[0] == "remove":
            h = issued[op[1] % len(issued)] if issued else op[1]
            out.append((ep, _frames([["BlockRemoved", [h], op[2]]])))
        elif op[0] == "clear":
            out.append((ep, _frames([["AllBlocksCleared"]])))
        elif op[0] == "junk":
            out.append((ep, [b"t", bytes(8), op[1]]))
        elif out:  # a truncated copy of the previous payload
            topic, seq, payload = out[-1][1]
            out.append((ep, [topic, seq, payload[: max(0, len(payload) - op[1])]]))
    return out


@pytest.mark.slow
@settings(max_examples=scaled(150))
@given(st.lists(_op, max_size=16), st.integers(1, 3))
@example(
    [
        ("store", (2, -1, [], None, BS, None, True)),
        ("store", (1, 1, [2**32], "CPU", BS, None, False)),
        ("cut", 5),
        ("remove", 0, None),
        ("store", (3, 0, [], None, BS, None, True)),
    ],
    1,
)
@example(
    [
        ("store", (4, -1, [-1], None, BS, None, True)),
        ("junk", b"\x92\xcb"),
        ("store", (2, -1, [], None, 8, "lora-a", False)),
        ("clear",),
    ],
    2,
)
@example([("store", (4, -1, [2**32 - 1], "STORAGE", BS, None, True)), ("cut", 1)], 1)
@example(
    [
        ("store", (2, -1, [], None, BS, None, True, "none")),
        ("store", (1, 1, [], None, BS, None, False, "none")),
        ("store", (2, 2, [], "CPU", BS, None, True, "mixed")),
        ("store", (1, 0, [], None, BS, "lora-a", False, "none")),
        ("store", (1, 3, [], None, BS, None, True, "empty")),
    ],
    1,
)
def test_event_streams_mean_the_same(ops: list[tuple[Any, ...]], workers: int) -> None:  # fmt: skip
    _same(_streams(ops, workers))


def test_eviction_order_is_the_same() -> None:
    # A worker past max_blocks_per_worker evicts its oldest entries: the compiled engine-key
    # map must pick the same ones as the dict.
    ops: list[tuple[Any, ...]] = [("store", (4, -1, [], None, BS, None, True))] * 40
    ops += [("remove", i, None) for i in range(0, 60, 7)]
    ops += [("store", (4, 3, [], None, BS, None, False))] * 20
    _same(_streams(ops, 1), max_blocks=64)


def test_hostile_frames_are_dropped_the_same_way() -> None:
    good = _frames([["BlockStored", [1, 2], None, list(range(2 * BS)), BS]])
    payload = good[2]
    hostile: list[list[bytes]] = [
        [b"t", bytes(8)],  # two frames
        [b"t", bytes(7), payload],  # short seq
        [b"\xff", bytes(8), payload],  # topic not UTF-8
        [b"t", bytes(8), b"\xc1"],  # never-used msgpack byte
        [b"t", bytes(8), b"\x91" * 5000 + b"\x90"],  # nested deep
        [b"t", bytes(8), msgspec.msgpack.encode([0.0, "events"])],
        # a token array header that claims 4G items
        [b"t", bytes(8), payload.replace(b"\x98", b"\xdd\xff\xff\xff\xff", 1)],
        # huge: 200k tokens in one event (applied, same keys), and 200k ids past uint32
        _frames([["BlockStored", list(range(50_000)), None, list(range(200_000)), BS]]),
        _frames([["BlockStored", [7], None, [2**33] * 200_000, BS]]),
    ]
    for i in range(1, len(payload)):
        hostile.append([b"t", bytes(8), payload[:i]])
    _same([("w", f) for f in [good, *hostile, good]])


# ---- the fused batch decoder (scorer.native decode_batch) and the packed apply path ------


def _fused(payload: bytes) -> Any:
    from scorer.events import decode as d
    from scorer.native import NATIVE

    assert NATIVE is not None
    return NATIVE.decode_batch(
        payload, d.BlockStored, d.BlockRemoved, d.AllBlocksCleared, d.normalize_medium
    )


def test_fused_decoder_takes_the_common_shapes_of_every_era() -> None:
    # Plain BlockStored / BlockRemoved / AllBlocksCleared, positional (0.9-0.23) and tagged
    # maps (0.24+): one C pass, packed hashes and ids, the reference meaning.
    stored_a = ["BlockStored", [1, 2**64 - 1], None, list(range(2 * BS)), BS, None, "CPU"]
    stored_m = {"type": "BlockStored", "block_hashes": [3], "parent_block_hash": 2**64 - 1,
                "token_ids": [2**32 - 1] * BS, "block_size": BS, "lora_id": None,
                "medium": "GPU", "lora_name": None, "extra_keys": None, "group_idx": 0}  # fmt: skip
    # vLLM >= 0.20: one None extra key per block and a group_idx; 0.22+ maps add
    # kv_cache_spec_kind (and the sliding window, nil), 0.30+ may add a session_id.
    stored_a21 = [*stored_a, None, [None, None], 0]
    stored_m25 = {**stored_m, "extra_keys": [None], "kv_cache_spec_kind": "full_attention",
                  "kv_cache_spec_sliding_window": None, "session_id": "s-1"}  # fmt: skip
    stored_m_window = {**stored_m25, "kv_cache_spec_sliding_window": 128, "session_id": None}
    for events in (
        [stored_a, ["BlockRemoved", [1], "cpu"], ["AllBlocksCleared"]],
        [stored_m, {"type": "BlockRemoved", "block_hashes": [3]}, {"type": "AllBlocksCleared"}],
        [stored_a21, ["BlockRemoved", [1], "GPU", 0]],
        [stored_m25, stored_m_window, {"type": "BlockRemoved", "block_hashes": [3]}],
    ):
        for rank in (None, 0, 3):
            payload = _frames(events, rank)[2]
            got = _fused(payload)
            assert got is not None
            ref = decode_message([b"t", bytes(8), payload], native=False).batch
            assert _norm(EventBatch(got[0], got[1], got[2])) == _norm(ref)
            assert type(got[1][0].block_hashes).__name__ == "array"


def test_fused_decoder_leaves_every_other_shape_to_the_reference_paths() -> None:
    base = ["BlockStored", [1], None, list(range(BS)), BS]
    plain_m = {"type": "BlockStored", "block_hashes": [1], "token_ids": [1] * BS,
               "block_size": BS}  # fmt: skip
    others: list[Any] = [
        [[*base[:4], 0]],  # block_size 0
        [["BlockStored", [-1], None, list(range(BS)), BS]],  # old vLLM's negative hashes
        [["BlockStored", [b"\x01" * 32], None, list(range(BS)), BS]],  # bytes hashes
        [["BlockStored", [1], None, [2**32], BS]],  # an id past uint32
        [[*base, 7]],  # a LoRA id
        [[*base, None, None, "lora-a"]],  # a LoRA name
        [[*base, None, None, None, [["mm"]]]],  # extra keys
        [[*base, None, None, None, [None, ["mm"]]]],  # one block's extra key
        [[*base, None, None, None, [None], 0, "full_attention"]],  # a field past group_idx
        # keys the reference ignores: with a value the fused decoder does not skip, or
        # one nobody sends
        [{**plain_m, "kv_cache_spec_kind": 5}],
        [{**plain_m, "session_id": ["s"]}],
        [{**plain_m, "other": None}],
        [["BlockStored", [1], -5, list(range(BS)), BS]],  # negative parent
        [{"type": "BlockStored", "block_hashes": [1], "token_ids": [1], "cache_salt": "s"}],
        [{"block_hashes": [1], "type": "BlockStored", "token_ids": [1] * BS, "block_size": BS}],
        [{"type": "BlockStored", "block_hashes": [1], "token_ids": [1] * BS}],  # no block_size
        [["Unknown", 1]],
    ]
    for events in others:
        payload = _frames(events)[2]
        assert _fused(payload) is None, events
        _same([("w", _frames(events))])
    # A key twice (a map literal cannot say it): the reference decides.
    pairs = [*(msgspec.msgpack.encode(x) for kv in plain_m.items() for x in kv)]
    pairs += [msgspec.msgpack.encode(x) for x in ("kv_cache_spec_kind", "a") * 2]
    twice = b"\x93" + msgspec.msgpack.encode(1.5) + b"\x91\x86" + b"".join(pairs) + b"\x00"
    assert _fused(twice) is None
    _same([("w", [b"t", bytes(8), twice])])
    _same([("w", _frames([base, {"type": "AllBlocksCleared"}]))])  # eras mixed: fused, same
    good = _frames([base])[2]
    assert _fused(good) is not None
    for i in range(len(good)):  # every truncation: refused, never a crash
        assert _fused(good[:i]) is None
    assert _fused(good + b"\x00") is None
    assert _fused(good.replace(b"\x94", b"\xdd\xff\xff\xff\xff", 1)) is None  # lying header


@settings(max_examples=scaled(200))
@given(st.binary(min_size=1, max_size=4), st.integers(0, 200))
@example(b"\xc0", 3)
@example(b"\xff", 0)
def test_fused_decoder_on_corrupted_payloads_means_the_same(patch: bytes, at: int) -> None:
    good = _frames(
        [
            {"type": "BlockStored", "block_hashes": [5, 6], "parent_block_hash": None,
             "token_ids": list(range(2 * BS)), "block_size": BS, "medium": "GPU"},
            ["BlockRemoved", [5], None],
        ]
    )  # fmt: skip
    payload = good[2]
    at %= len(payload)
    bad = payload[:at] + patch + payload[at + len(patch) :]
    _same([("w", good), ("w", [b"t", bytes(8), bad]), ("w", good)])


def test_shared_chains_and_removals_mean_the_same() -> None:
    # The same chain (same engine hashes and tokens) stored by several workers, in prefill
    # pieces, then partly removed and re-stored: the packed insert's shared-mask path.
    toks = [(j * 13) % 97 for j in range(24 * BS)]
    streams: list[tuple[str, list[bytes]]] = []
    for w in range(5):
        parent = None
        for start in range(0, 24, 8):
            hashes = list(range(500 + start, 508 + start))
            ev = {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
                  "token_ids": toks[start * BS : (start + 8) * BS], "block_size": BS}  # fmt: skip
            streams.append((f"w{w}", _frames([ev, ev] if w == 2 else [ev])))
            parent = hashes[-1]
    streams.append(("w1", _frames([{"type": "BlockRemoved", "block_hashes": [503, 517]}])))
    streams.append(("w3", _frames([["AllBlocksCleared"]])))
    streams += streams[:4]
    _same(streams)
    _same(streams, max_blocks=10)  # eviction on the packed path


def test_fused_decoder_takes_every_clean_vector_of_the_plain_path() -> None:
    # Every release's plain BlockStored (no LoRA, no salt): the one-pass decode, then the
    # compiled apply loop (vLLM >= 0.20 sends one None extra key per block, which both
    # once refused: every stored block of a current vLLM took the slower paths).
    from scorer.events import decode as d
    from scorer.native import NATIVE

    assert NATIVE is not None
    taken = 0
    for v in VECTORS["versions"]:
        for c in v["cases"]:
            if c["name"] not in ("single_block_stored", "chained_multi_block_stored"):
                continue
            for m in c["messages"]:
                payload = base64.b64decode(m["parts_b64"][2])
                got = _fused(payload)
                assert got is not None, (v["vllm_version"], c["name"])
                side = Side(True, bs=16)
                pend = array("Q"), array("Q")
                j, blocks = NATIVE.stored_events(
                    got[1], 0, d.BlockStored, "GPU", 16, None, pend[0], pend[1]
                )
                ev = got[1][0]
                if ev.parent_block_hash is None:  # (a parent needs the slot's map)
                    assert (j, blocks) == (len(got[1]), len(ev.block_hashes))
                assert side.feed("w", [b"t", bytes(8), payload])
                taken += 1
    assert taken >= 8
