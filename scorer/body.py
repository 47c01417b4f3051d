"""A request body's JSON decode, with a large token-id `prompt` kept packed.

A completions body whose `prompt` is token ids (vLLM, Mooncake-style traces) decodes to one
Python int per id (15k ids: ~0.4 ms, 7.5 % of the scorer's CPU in the e2e Mooncake run),
which the tokens stage then packs into bytes. Here, when the compiled module is built and
the body is large, the `prompt` array's bytes go to the compiled parser
(scorer/native/_speedups.pyx `json_ids_u32`), which packs a plain JSON array of integers in
[0, 2**32) straight into little-endian uint32 (`PackedIds`) and declines anything else;
msgspec decodes the rest of the body as before (see `_packed`). Any failure on that path
decodes the whole body the reference way (`decode(body, native=False)`), so a bad body gets
today's error, byte offsets included.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterator, Sequence
from typing import Any, final, overload

import msgspec

from scorer.native import NATIVE

_decoder = msgspec.json.Decoder()
_KEY = b'"prompt"'
_MAX_TRIES = 4
# A key's string value as JSON encoders write it (compact, or Python's default spacing).
_STRING_VALUE = (b':"', b': "')
# Stands in for the packed array while msgspec decodes the rest: an integer, whose JSON
# spelling is unique (no leading zeros, no '+'; a float spelling decodes to a float), so
# one absent from the body can only come from the substitution.
_MARK = b"7952834521136472161"
_MARK_VALUE = int(_MARK)
_NATIVE_JSON_IDS = getattr(NATIVE, "json_ids_u32", None)
# Below this many body bytes the one-pass decode is as cheap. In instructions (callgrind;
# this machine's timings swing too much to compare) the packed path costs ~14,000 fixed
# and ~14 a byte, msgspec ~370 an id: 64 ids (439 B) 20,700 against 25,900, 288 ids
# (1.7 KB) 42,000 against 104,000; 32 ids (247 B) 17,700 against 14,700. In time (shared
# machine): 64 ids, ~0.6 KB, 5.0-5.8 µs both ways; 288 ids, 2.2 KB, 10.3 µs decoded and
# packed against 4.6 packed (bench/bench_tokens.py --parse measures larger prompts).
PACK_MIN_BYTES = 512


def _ids(packed: bytes) -> array[int]:
    arr = array("I")
    arr.frombytes(packed)
    if sys.byteorder == "big":  # packed is little-endian (scorer.blocks' form)
        arr.byteswap()
    return arr


@final
class PackedIds(Sequence[int]):
    """A token-id prompt as decoded from the body, packed: little-endian uint32 bytes.

    Reads like the list of ints it stands for (len, index, iterate, == a list); the tokens
    stage takes `packed` as is (scorer.tokens.service).
    """

    __slots__ = ("packed",)

    def __init__(self, packed: bytes) -> None:
        self.packed = packed

    def __len__(self) -> int:
        return len(self.packed) // 4

    @overload
    def __getitem__(self, i: int) -> int: ...
    @overload
    def __getitem__(self, i: slice) -> list[int]: ...
    def __getitem__(self, i: int | slice) -> int | list[int]:
        return self.tolist()[i]

    def __iter__(self) -> Iterator[int]:
        return iter(_ids(self.packed))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, PackedIds):
            return self.packed == other.packed
        if isinstance(other, list):
            return self.tolist() == other
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # like the list it stands for

    def tolist(self) -> list[int]:
        """The ids as the list of ints the reference decode gives."""
        return _ids(self.packed).tolist()

    def __repr__(self) -> str:
        return f"PackedIds({len(self)} ids)"


def plain(doc: Any) -> Any:
    """`doc` with a `PackedIds` prompt turned back into its list (what the reference gives)."""
    if isinstance(doc, dict) and isinstance(doc.get("prompt"), PackedIds):
        doc = dict(doc)
        doc["prompt"] = doc["prompt"].tolist()
    return doc


def decode(body: bytes, native: bool = True) -> Any:
    """The body's JSON value; a large body's token-id `prompt` as `PackedIds`.

    Raises what `msgspec.json.Decoder().decode(body)` raises for the body (the reference,
    `native=False`, is exactly that call).
    """
    if native and _NATIVE_JSON_IDS is not None and len(body) >= PACK_MIN_BYTES:
        # (find, not `in`: bytes.__contains__ tries the key as an int first and formats
        # a TypeError, ~2,300 instructions)
        at = body.find(_KEY)
        # (a string value: a text prompt, the common decline, decided without the call)
        if at >= 0 and not body.startswith(_STRING_VALUE, at + len(_KEY)):
            doc = _packed(body, at)
            if doc is not None:
                return doc
    return _decoder.decode(body)


def _packed(body: bytes, at: int) -> dict[str, Any] | None:
    """The body decoded with its prompt packed, or None (decode it the reference way).

    `at`: where `"prompt"` first occurs (not with a string value). The first `"prompt"`
    followed by `: [ids]` has its array parsed by the compiled code and replaced by a
    marker integer found nowhere else in the body; msgspec decodes the rest.
    The top-level `prompt` decoding to the marker proves the array was that key's value
    (the last `prompt` key, as msgspec keeps the last of duplicates) and not text inside a
    string or a nested object's key; the rest decoded, the whole body is valid JSON.
    """
    assert _NATIVE_JSON_IDS is not None
    got = None
    for _ in range(_MAX_TRIES):  # a "prompt" inside an earlier string or object: the next
        got = _NATIVE_JSON_IDS(body, at + len(_KEY))
        if got is not None:
            break
        at = body.find(_KEY, at + 1)
        if at < 0 or body.startswith(_STRING_VALUE, at + len(_KEY)):
            # None left, or a string value (a text prompt, the common case the compiled
            # parser would decline): the rest of the body is not searched (a token-id
            # `prompt` after a string-valued one is decoded the reference way).
            return None
    if got is None:
        return None
    packed, start, end = got
    rest = b"".join((body[:start], _MARK, body[end:]))
    # The array (ids of at most 10 digits) cannot hold the 19-digit marker: searching the
    # rest, much shorter than the body, is enough.
    if rest.count(_MARK) != 1:
        return None
    try:
        doc = _decoder.decode(rest)
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError):
        return None  # the reference decode raises its own error for it
    if not isinstance(doc, dict):
        return None
    mark = doc.get("prompt")
    if type(mark) is not int or mark != _MARK_VALUE:
        return None
    doc["prompt"] = PackedIds(packed)
    return doc
