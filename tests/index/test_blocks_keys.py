"""The one hash space: keys equal a straightforward reference, namespaces never collide."""

from __future__ import annotations

import random
import struct

import pytest
import xxhash

from scorer.blocks import BlockHasher, engine_key, fnv1a64, namespace_key

RNG = random.Random(7)
TOKENS = [RNG.randrange(200_000) for _ in range(16 * 20 + 5)]  # 20 full blocks + 5


def ref_xxh3(tokens: list[int], bs: int, ns: int = 0, parent: int | None = None) -> list[int]:
    prev = ((parent or 0) ^ ns) & (2**64 - 1)
    out = []
    for i in range(len(tokens) // bs):
        data = b"".join(struct.pack("<I", t) for t in tokens[i * bs : (i + 1) * bs])
        prev = xxhash.xxh3_64_intdigest(data, seed=prev)
        out.append(prev)
    return out


def ref_fnv(tokens: list[int], bs: int) -> list[int]:
    prev = 0
    out = []
    for i in range(len(tokens) // bs):
        data = prev.to_bytes(8, "little") + struct.pack(f"<{bs}I", *tokens[i * bs : (i + 1) * bs])
        h = 0xCBF29CE484222325
        for b in data:
            h = ((h ^ b) * 0x100000001B3) % 2**64
        prev = h
        out.append(h)
    return out


@pytest.mark.parametrize("bs", [1, 16, 64])
def test_buffer_hashing_equals_reference(bs: int) -> None:
    h = BlockHasher(bs)
    assert h.keys(TOKENS) == ref_xxh3(TOKENS, bs)
    ns = namespace_key("lora-a")
    assert h.keys(TOKENS, ns) == ref_xxh3(TOKENS, bs, ns)
    assert h.keys(TOKENS, 0, parent=12345) == ref_xxh3(TOKENS, bs, 0, 12345)


def test_only_full_blocks_and_chaining() -> None:
    h = BlockHasher(16)
    keys = h.keys(TOKENS)
    assert len(keys) == 20
    assert h.keys(TOKENS[:15]) == []
    # Continuing a chain from a parent key gives the same keys as hashing the whole prompt.
    assert h.keys(TOKENS[16 * 5 : 16 * 9], parent=keys[4]) == keys[5:9]
    # A different earlier block changes every later key (prefix semantics).
    other = [TOKENS[0] + 1, *TOKENS[1:]]
    assert not set(h.keys(other)) & set(keys)


def test_namespaces_never_match_the_base_chain() -> None:
    h = BlockHasher(16)
    base = set(h.keys(TOKENS))
    spaces = [
        namespace_key("lora-a"),
        namespace_key("lora-b"),
        namespace_key(None, "tenant-1"),
        namespace_key("lora-a", "tenant-1"),
        namespace_key(None, None, ["mm-hash"]),
    ]
    assert namespace_key() == 0 and namespace_key(None, None, []) == 0
    assert len(set(spaces)) == len(spaces) and 0 not in spaces
    seen = set(base)
    for ns in spaces:
        keys = set(h.keys(TOKENS, ns))
        assert not keys & seen
        seen |= keys
    # The salt and the LoRA name are not interchangeable.
    assert namespace_key("x") != namespace_key(None, "x")


def test_fnv1a_option() -> None:
    h = BlockHasher(16, "fnv1a")
    assert h.keys(TOKENS[:64]) == ref_fnv(TOKENS[:64], 16)
    assert fnv1a64(b"") == 0xCBF29CE484222325
    assert fnv1a64(b"a") == 0xAF63DC4C8601EC8C  # the published FNV-1a 64 test vector
    assert h.keys(TOKENS[:64]) != BlockHasher(16).keys(TOKENS[:64])


def test_bad_input() -> None:
    with pytest.raises(ValueError):
        BlockHasher(0)
    with pytest.raises(ValueError):
        BlockHasher(16, "md5")  # type: ignore[arg-type]
    with pytest.raises(OverflowError):
        BlockHasher(1).keys([-1])


def test_engine_key_canonical() -> None:
    assert engine_key(-1) == engine_key(2**64 - 1)
    assert engine_key(5) == 5
    assert engine_key(b"\x01" * 32) == engine_key(bytearray(b"\x01" * 32))
    assert engine_key(b"\x01" * 32) != engine_key(b"\x02" * 32)
    assert all(0 <= engine_key(v) < 2**60 for v in (-(2**63), 2**64 - 1, b"\xff" * 32))
