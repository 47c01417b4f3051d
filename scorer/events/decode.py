"""Wire decoding of KV-cache events for every vLLM / SGLang era.

Wire format (vLLM `vllm/distributed/kv_events.py`, 0.9.0 → 0.33; see
tests/fixtures/vectors/README.md for what each release sends):

* a ZMQ message has 3 frames: ``[topic, seq (8-byte big-endian unsigned), payload]``;
* payload = msgpack batch ``[ts, events]`` (0.9.0) or ``[ts, events, data_parallel_rank]``
  (0.9.1+); a map ``{"ts", "events", "data_parallel_rank"}`` is tolerated too;
* events are positional arrays ``["BlockStored", block_hashes, parent_block_hash, token_ids,
  block_size, lora_id, medium, lora_name, extra_keys, group_idx, ...]`` up to 0.23 (fields
  were only ever appended, so we read by position and ignore extras) and tagged maps
  ``{"type": "BlockStored", ...}`` from 0.24 (read by name, unknown fields ignored;
  ``omit_defaults`` drops fields left at their default);
* block hashes are uint64, negative int64 (builtin ``hash()`` before 0.10.2) or bytes
  (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``);
* ``medium`` is spelled GPU, CPU, cpu (LMCache), FS / OBJ (0.26), STORAGE (0.27+),
  CPU_PINNED / DISK / EXTERNAL (SGLang), or absent. SGLang's map events may carry a
  ``cache_salt`` field.

A malformed message raises `DecodeError` with a `kind`; a malformed or unknown event inside
a good batch is skipped and reported in `EventBatch.errors`, so the rest still applies.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any

import msgspec

from scorer.native import NATIVE

# The replay socket's end marker: seq 0xFF x 8 (i.e. -1 as a signed int64), empty payload.
END_SEQ = b"\xff" * 8

Hash = int | bytes

# Every spelling seen on the wire → the index's three media. (vLLM MEDIUM_* constants,
# LMCache's lower-case "cpu", SGLang's HiCache tiers.)
_MEDIA = {
    "GPU": "GPU",
    "CPU": "CPU",
    "CPU_PINNED": "CPU",
    "DISK": "DISK",
    "FS": "DISK",
    "OBJ": "DISK",
    "STORAGE": "DISK",
    "EXTERNAL": "DISK",
}

ERROR_KINDS = (
    "frames",  # not 3 frames / not bytes
    "seq",  # sequence frame is not 8 bytes
    "topic",  # topic is not UTF-8
    "msgpack",  # payload is not msgpack
    "batch",  # payload is not a batch [ts, events(, rank)]
    "event",  # an event has the wrong shape or field types
    "unknown_type",  # an event type we do not know (skipped)
    "depth",  # nested deeper than the decoder recurses (RecursionError)
    "size",  # a frame over events.max_message_bytes (replay replies)
)


class DecodeError(ValueError):
    """A message or event we cannot read. `kind` is one of ERROR_KINDS (a metric label)."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind = kind
        self.detail = detail


def normalize_medium(raw: object) -> str:
    """GPU / CPU / DISK from any spelling; absent or unknown → GPU (vllm-router v0.13's choice)."""
    if raw is None:
        return "GPU"
    if isinstance(raw, bytes):
        raw = raw.decode("utf-8", "replace")
    return _MEDIA.get(str(raw).upper(), "GPU")


@dataclass(slots=True)
class BlockStored:
    # A list, or an array('Q') from the compiled decoder (scorer.native): equal hashes.
    block_hashes: Sequence[Hash]
    parent_block_hash: Hash | None
    # A list, or an array('I') from the compiled decoder (scorer.native): equal ids.
    token_ids: Sequence[int]
    block_size: int
    lora_id: int | None = None
    medium: str = "GPU"  # normalised
    medium_raw: str | None = None  # as sent (None when absent)
    lora_name: str | None = None
    extra_keys: list[Any] | None = None  # one entry per block (tuple/list or None)
    group_idx: int | None = None
    cache_salt: str | None = None  # SGLang


@dataclass(slots=True)
class BlockRemoved:
    block_hashes: list[Hash]
    medium: str = "GPU"
    medium_raw: str | None = None
    group_idx: int | None = None


@dataclass(slots=True)
class AllBlocksCleared:
    medium: str | None = None


Event = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(slots=True)
class EventBatch:
    ts: float
    events: list[Event]
    dp_rank: int | None = None
    errors: list[DecodeError] = field(default_factory=list)  # events skipped


@dataclass(slots=True)
class Message:
    topic: str
    seq: int
    batch: EventBatch


_decoder = msgspec.msgpack.Decoder()


# ---- typed fast path ----------------------------------------------------------------------
# A well-formed batch is decoded in C by msgspec straight into typed Structs (one decoder per
# era: msgspec unions cannot mix array-like and map-like Structs), then turned into the event
# dataclasses below. Anything the typed schema rejects (a map-shaped batch, a bad or unknown
# event, bytes where a str belongs, ...) falls back to the generic path, which reports
# per-event errors and keeps the good events: the fast path never changes the meaning.

_PosInt = Annotated[int, msgspec.Meta(ge=1)]


class _AStored(msgspec.Struct, tag="BlockStored", array_like=True):
    # vLLM 0.9-0.23 positional order; extra trailing fields are ignored by msgspec.
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: _PosInt
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None


class _ARemoved(msgspec.Struct, tag="BlockRemoved", array_like=True):
    block_hashes: list[int | bytes]
    medium: str | None = None
    group_idx: int | None = None


class _ACleared(msgspec.Struct, tag="AllBlocksCleared", array_like=True):
    medium: str | None = None


class _ABatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[_AStored | _ARemoved | _ACleared]
    data_parallel_rank: int | None = None


class _MStored(msgspec.Struct, tag="BlockStored", tag_field="type"):
    # vLLM 0.24+ tagged maps (unknown fields ignored), plus SGLang's cache_salt.
    block_hashes: list[int | bytes]
    token_ids: list[int]
    block_size: _PosInt
    parent_block_hash: int | bytes | None = None
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    cache_salt: str | None = None


class _MRemoved(msgspec.Struct, tag="BlockRemoved", tag_field="type"):
    block_hashes: list[int | bytes]
    medium: str | None = None
    group_idx: int | None = None


class _MCleared(msgspec.Struct, tag="AllBlocksCleared", tag_field="type"):
    medium: str | None = None


class _MBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[_MStored | _MRemoved | _MCleared]
    data_parallel_rank: int | None = None


_typed: list[msgspec.msgpack.Decoder[Any]] = [
    msgspec.msgpack.Decoder(_MBatch),
    msgspec.msgpack.Decoder(_ABatch),
]
_GPU_ONLY = {None: "GPU", "GPU": "GPU"}


def _fast_payload(payload: bytes) -> EventBatch | None:
    """The typed decode of a well-formed batch, or None (then the generic path runs)."""
    return _typed_batch(payload, _typed, _MStored, _AStored, None)


def _typed_batch(
    payload: bytes,
    decoders: list[msgspec.msgpack.Decoder[Any]],
    m_stored: type[_MStored],
    a_stored: type[_AStored],
    tokens: Callable[[Any], Any] | None,
    hashes: Callable[[Any], Any] | None = None,
) -> EventBatch | None:
    """The typed decode loop both fast paths share: `decoders` (map era, array era: the
    one that worked last goes first), the BlockStored struct of each era, and `tokens` /
    `hashes` turning a struct's token_ids / block_hashes into the event's (None: kept as
    decoded; a None result makes the whole decode return None)."""
    for i, dec in enumerate(decoders):
        try:
            raw = dec.decode(payload)
        except (msgspec.DecodeError, ValueError, TypeError):
            continue
        except RecursionError:  # a hostile frame nested thousands deep
            raise DecodeError("depth", "payload nested too deep") from None
        if i:  # the other era is probably what this publisher sends next time as well
            decoders.reverse()
        out: list[Event] = []
        append = out.append
        for e in raw.events:
            if type(e) is m_stored or type(e) is a_stored:
                toks = e.token_ids
                if tokens is not None:
                    toks = tokens(toks)
                    if toks is None:
                        return None
                hs = e.block_hashes
                if hashes is not None:
                    hs = hashes(hs)
                    if hs is None:
                        return None
                mraw = e.medium
                append(
                    BlockStored(
                        hs,
                        e.parent_block_hash,
                        toks,
                        e.block_size,
                        e.lora_id,
                        _GPU_ONLY.get(mraw) or normalize_medium(mraw),
                        mraw,
                        e.lora_name,
                        e.extra_keys,
                        e.group_idx,
                        e.cache_salt if type(e) is m_stored else None,
                    )
                )
            elif type(e) is _MRemoved or type(e) is _ARemoved:
                mraw = e.medium
                med = _GPU_ONLY.get(mraw) or normalize_medium(mraw)
                append(BlockRemoved(e.block_hashes, med, mraw, e.group_idx))
            else:
                m = e.medium
                append(AllBlocksCleared(None if m is None else normalize_medium(m)))
        return EventBatch(raw.ts, out, raw.data_parallel_rank)
    return None


# ---- compiled fast path (scorer.native) ---------------------------------------------------
# The same typed decode, except that a BlockStored's token_ids and block_hashes stay msgpack
# bytes (msgspec.Raw, no copy) and the compiled `msgpack_uint32s` / `msgpack_uint64s` turn
# them into array('I') / array('Q') without making one Python int per token or block (apply's
# fused path hashes and indexes straight from them). Any list they do not take (an id outside
# uint32, a negative or bytes hash, a non-int) sends the payload to the typed list path, then
# the generic one, which give the reference meaning (event error / bad_tokens).
# gc=False: these short-lived structs hold no cycles (lists of ints/bytes, Raw views), so the
# collector need not track them (fewer collections while a large index is built).


class _AStoredRaw(_AStored, tag="BlockStored", array_like=True, gc=False):
    block_hashes: msgspec.Raw  # type: ignore[assignment]
    token_ids: msgspec.Raw  # type: ignore[assignment]


class _ABatchRaw(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[_AStoredRaw | _ARemoved | _ACleared]
    data_parallel_rank: int | None = None


class _MStoredRaw(_MStored, tag="BlockStored", tag_field="type", gc=False):
    block_hashes: msgspec.Raw  # type: ignore[assignment]
    token_ids: msgspec.Raw  # type: ignore[assignment]


class _MBatchRaw(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[_MStoredRaw | _MRemoved | _MCleared]
    data_parallel_rank: int | None = None


_typed_raw: list[msgspec.msgpack.Decoder[Any]] = [
    msgspec.msgpack.Decoder(_MBatchRaw),
    msgspec.msgpack.Decoder(_ABatchRaw),
]


def _fast_payload_native(payload: bytes) -> EventBatch | None:
    """`_fast_payload` with token ids and block hashes unpacked by the compiled code into
    packed arrays (array('I') / array('Q'): apply's fused path takes them without one
    Python int per block), or None. Requires `scorer.native`."""
    assert NATIVE is not None
    return _typed_batch(
        payload,
        _typed_raw,
        _MStoredRaw,
        _AStoredRaw,
        NATIVE.msgpack_uint32s,
        NATIVE.msgpack_uint64s,
    )


def _hash(v: object, what: str) -> Hash:
    if isinstance(v, bool) or not isinstance(v, int | bytes):
        raise DecodeError("event", f"{what}: expected int or bytes, got {type(v).__name__}")
    return v


def _hashes(v: object) -> list[Hash]:
    if not isinstance(v, list):
        raise DecodeError("event", f"block_hashes: expected a list, got {type(v).__name__}")
    # Items are checked when mapped to engine keys (apply), not here: a per-item check
    # would be paid again for every block.
    return v


def _opt_int(v: object, what: str) -> int | None:
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise DecodeError("event", f"{what}: expected int, got {type(v).__name__}")
    return v


def _opt_str(v: object, what: str) -> str | None:
    if v is None:
        return None
    if isinstance(v, bytes):
        return v.decode("utf-8", "replace")
    if not isinstance(v, str):
        raise DecodeError("event", f"{what}: expected str, got {type(v).__name__}")
    return v


def _stored(
    hashes: object,
    parent: object,
    tokens: object,
    block_size: object,
    lora_id: object = None,
    medium: object = None,
    lora_name: object = None,
    extra_keys: object = None,
    group_idx: object = None,
    cache_salt: object = None,
) -> BlockStored:
    hs = _hashes(hashes)
    if not isinstance(tokens, list):
        raise DecodeError("event", "token_ids: expected a list of ints")
    # Items are checked when hashed (array('I') rejects non-ints and out-of-range ids in C);
    # a per-token Python check here would cost more than the hashing itself.
    bs = _opt_int(block_size, "block_size")
    if bs is None or bs < 1:
        raise DecodeError("event", f"block_size: expected a positive int, got {block_size!r}")
    if extra_keys is not None and not isinstance(extra_keys, list):
        raise DecodeError("event", "extra_keys: expected a list")
    mraw = _opt_str(medium, "medium")
    return BlockStored(
        block_hashes=hs,
        parent_block_hash=None if parent is None else _hash(parent, "parent_block_hash"),
        token_ids=tokens,
        block_size=bs,
        lora_id=_opt_int(lora_id, "lora_id"),
        medium=normalize_medium(mraw),
        medium_raw=mraw,
        lora_name=_opt_str(lora_name, "lora_name"),
        extra_keys=extra_keys,
        group_idx=_opt_int(group_idx, "group_idx"),
        cache_salt=_opt_str(cache_salt, "cache_salt"),
    )


def _removed(hashes: object, medium: object = None, group_idx: object = None) -> BlockRemoved:
    mraw = _opt_str(medium, "medium")
    return BlockRemoved(
        block_hashes=_hashes(hashes),
        medium=normalize_medium(mraw),
        medium_raw=mraw,
        group_idx=_opt_int(group_idx, "group_idx"),
    )


def _cleared(medium: object = None) -> AllBlocksCleared:
    mraw = _opt_str(medium, "medium")
    return AllBlocksCleared(medium=None if mraw is None else normalize_medium(mraw))


def decode_event(raw: object) -> Event:
    """One event, positional-array or tagged-map form."""
    if isinstance(raw, list):
        if not raw or not isinstance(raw[0], str):
            raise DecodeError("event", "array event without a type tag")
        tag, f = raw[0], raw[1:]
        if tag == "BlockStored":
            if len(f) < 4:
                raise DecodeError("event", f"BlockStored with {len(f)} fields (need >= 4)")
            # Positions 0..8 are the vLLM fields in order; later appended fields are ignored.
            return _stored(*f[:9])
        if tag == "BlockRemoved":
            if len(f) < 1:
                raise DecodeError("event", "BlockRemoved without block_hashes")
            return _removed(*f[:3])
        if tag == "AllBlocksCleared":
            return _cleared(f[0] if f else None)
        raise DecodeError("unknown_type", f"event type {tag[:40]!r}")
    if isinstance(raw, dict):
        mtag: object = raw.get("type")
        g = raw.get
        if mtag == "BlockStored":
            if "block_hashes" not in raw or "token_ids" not in raw or "block_size" not in raw:
                raise DecodeError("event", "BlockStored map without its required fields")
            return _stored(
                g("block_hashes"),
                g("parent_block_hash"),
                g("token_ids"),
                g("block_size"),
                g("lora_id"),
                g("medium"),
                g("lora_name"),
                g("extra_keys"),
                g("group_idx"),
                g("cache_salt"),
            )
        if mtag == "BlockRemoved":
            if "block_hashes" not in raw:
                raise DecodeError("event", "BlockRemoved map without block_hashes")
            return _removed(g("block_hashes"), g("medium"), g("group_idx"))
        if mtag == "AllBlocksCleared":
            return _cleared(g("medium"))
        if isinstance(mtag, str):
            raise DecodeError("unknown_type", f"event type {mtag[:40]!r}")
        raise DecodeError("event", "map event without a string 'type'")
    raise DecodeError("event", f"event is a {type(raw).__name__}")


def decode_payload(payload: bytes, native: bool | None = None) -> EventBatch:
    """A msgpack batch → EventBatch. Bad events are skipped into `errors`.

    `native`: decode token ids with the compiled code (None: when `scorer.native` is
    available; False: the pure-Python reference). Same events either way."""
    fast = None
    if NATIVE is not None and native is not False:
        # One C pass for the common shapes, then the typed msgspec paths for the rest.
        got = NATIVE.decode_batch(
            payload, BlockStored, BlockRemoved, AllBlocksCleared, normalize_medium
        )
        if got is not None:
            return EventBatch(got[0], got[1], got[2])
        fast = _fast_payload_native(payload)
    if fast is None:  # (compiled: hashes that are not all uint64, e.g. vLLM < 0.10.2's)
        fast = _fast_payload(payload)
    return fast if fast is not None else decode_payload_generic(payload)


def decode_payload_generic(payload: bytes) -> EventBatch:
    """`decode_payload` without the typed fast path: generic msgpack, field by field."""
    try:
        raw = _decoder.decode(payload)
    except (msgspec.DecodeError, ValueError, TypeError) as e:
        raise DecodeError("msgpack", str(e)[:200]) from None
    except RecursionError:
        raise DecodeError("depth", "payload nested too deep") from None
    rank: object = None
    if isinstance(raw, list):
        if len(raw) < 2:
            raise DecodeError("batch", f"batch array of {len(raw)} items (need >= 2)")
        ts, events = raw[0], raw[1]
        if len(raw) > 2:
            rank = raw[2]
    elif isinstance(raw, dict):
        ts, events, rank = raw.get("ts"), raw.get("events"), raw.get("data_parallel_rank")
    else:
        raise DecodeError("batch", f"batch is a {type(raw).__name__}")
    if isinstance(ts, bool) or not isinstance(ts, int | float):
        raise DecodeError("batch", f"ts: expected a number, got {type(ts).__name__}")
    if not isinstance(events, list):
        raise DecodeError("batch", f"events: expected a list, got {type(events).__name__}")
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int)):
        raise DecodeError("batch", f"data_parallel_rank: expected int, got {type(rank).__name__}")
    out: list[Event] = []
    errors: list[DecodeError] = []
    for ev in events:
        try:
            out.append(decode_event(ev))
        except DecodeError as e:
            errors.append(e)
        except (TypeError, ValueError) as e:  # e.g. too many map/array items to unpack
            errors.append(DecodeError("event", str(e)[:200]))
    return EventBatch(float(ts), out, rank, errors)


def decode_seq(frame: bytes) -> int:
    """The 8-byte big-endian sequence frame."""
    if len(frame) != 8:
        raise DecodeError("seq", f"sequence frame of {len(frame)} bytes (need 8)")
    return int.from_bytes(frame, "big")


_FRAME_TYPES = (bytes, bytearray, memoryview)


def decode_message(frames: Sequence[bytes], native: bool | None = None) -> Message:
    """A 3-frame ZMQ message ``[topic, seq, payload]`` → Message (`native`: as in
    `decode_payload`)."""
    if len(frames) != 3:
        raise DecodeError("frames", f"{len(frames)} frames (need 3: topic, seq, payload)")
    topic_b, seq_b, payload = frames
    if type(topic_b) is not bytes or type(seq_b) is not bytes or type(payload) is not bytes:
        # (What a socket gives is bytes: the checks and copies only for anything else.)
        if not all(isinstance(f, _FRAME_TYPES) for f in frames):
            raise DecodeError("frames", "frames must be bytes")
        topic_b, seq_b, payload = bytes(topic_b), bytes(seq_b), bytes(payload)
    try:
        topic = topic_b.decode("utf-8")
    except UnicodeDecodeError:
        raise DecodeError("topic", "topic is not UTF-8") from None
    if len(seq_b) != 8:
        raise DecodeError("seq", f"sequence frame of {len(seq_b)} bytes (need 8)")
    return Message(topic, int.from_bytes(seq_b, "big"), decode_payload(payload, native))


def split_replay_reply(frames: Sequence[bytes]) -> tuple[str | None, bytes, bytes]:
    """A replay reply as a DEALER receives it → (topic, seq frame, payload).

    ``[b"", seq, payload]`` before vLLM 0.26, ``[b"", topic, seq, payload]`` from 0.26.
    The end marker is seq == END_SEQ with an empty payload (topic b"" in the 4-frame form).
    """
    if len(frames) == 3 and len(frames[0]) == 0:
        return None, bytes(frames[1]), bytes(frames[2])
    if len(frames) == 4 and len(frames[0]) == 0:
        try:
            topic = bytes(frames[1]).decode("utf-8")
        except UnicodeDecodeError:
            raise DecodeError("topic", "replay topic is not UTF-8") from None
        return topic, bytes(frames[2]), bytes(frames[3])
    raise DecodeError("frames", f"replay reply of {len(frames)} frames")
