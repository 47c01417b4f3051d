"""Block keys: the ONE hash space shared by requests and KV events.

Block key i = H(key i-1, token ids of block i); block 0 of a chain is seeded with
(parent key or 0) XOR namespace, so every key of a chain depends on its namespace through
the chain (events continuing a chain from a known parent need no namespace: vLLM only
puts the cache_salt in the first block's extra keys).
Requests hash their prompt tokens here; the event decoder hashes `BlockStored.token_ids`
here, chained from the parent block's key. Nothing else in the project computes a key, so
the two sides always agree. Engine block hashes (sha256, cbor, builtin hash, ...) are never
compared with ours: they are opaque ids, mapped per worker by `engine_key`.

Algorithms:

* ``xxh3`` (default): ``key_i = xxh3_64(tokens_i as little-endian uint32, seed=key_{i-1})``,
  ``key_{-1} = (parent or 0) ^ ns``.
  One C call per block over a slice of one bytes buffer built once per request.
* ``fnv1a``: chained 64-bit FNV-1a over ``key_{i-1} (8 bytes LE) ‖ tokens_i (uint32 LE)``,
  the scheme
  vllm-router (vllm-project/router) uses for its block hashes.
  FNV-1a's constants are from the Fowler-Noll-Vo reference (offset basis
  0xcbf29ce484222325, prime 0x100000001b3; IETF draft-eastlake-fnv). It runs per byte in
  Python, so it is ~30x slower than xxh3: pick it only to interoperate.

The namespace folds whatever makes KV non-shareable: the LoRA adapter name, the
`cache_salt` / tenant and any extra keys. The base model's chain has namespace 0.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence
from typing import Literal

import xxhash

from scorer.native import NATIVE

HashAlgo = Literal["xxh3", "fnv1a"]

MASK64 = (1 << 64) - 1
MASK60 = (1 << 60) - 1
FNV64_OFFSET = 0xCBF29CE484222325
FNV64_PRIME = 0x100000001B3

_xxh3 = xxhash.xxh3_64_intdigest
_BIG_ENDIAN = sys.byteorder == "big"
# A tag so that a namespace can never equal a plain parent key by construction.
_NS_SEED = 0x6B762D73636F7265  # "kv-score"


def _canon(value: object) -> str:
    """A stable text form of an extra key (str, int, bytes, nested lists/tuples, None)."""
    if isinstance(value, bytes | bytearray | memoryview):
        return "b:" + bytes(value).hex()
    if isinstance(value, list | tuple):
        return "[" + ",".join(_canon(v) for v in value) + "]"
    if isinstance(value, str):
        return "s:" + value
    return repr(value)


def namespace_key(
    lora_name: str | None = None,
    cache_salt: str | None = None,
    extra: Sequence[object] | None = None,
) -> int:
    """64-bit seed for a chain; 0 when all are None (the plain base-model chain).

    Blocks of different LoRA adapters, salts or extra keys land in different namespaces, so
    they never match each other or the base chain.
    """
    if lora_name is None and cache_salt is None and not extra:
        return 0
    text = "\x1f".join(
        (
            "" if lora_name is None else "l:" + lora_name,
            "" if cache_salt is None else "s:" + cache_salt,
            "" if not extra else _canon(list(extra)),
        )
    )
    ns = _xxh3(text.encode("utf-8"), _NS_SEED)
    return ns or 1  # 0 is reserved for the base chain


def tokens_to_bytes(token_ids: Sequence[int], count: int | None = None) -> bytes:
    """The first `count` token ids (all by default) as little-endian uint32 bytes.

    One C-level conversion (array('I')); ids outside [0, 2**32) raise OverflowError.
    """
    ids = token_ids if count is None or count == len(token_ids) else token_ids[:count]
    arr = array("I", ids)  # a copy even for an array('I'): byteswap below must not leak
    if _BIG_ENDIAN:  # keys must not depend on the machine
        arr.byteswap()
    return arr.tobytes()


def fnv1a64(data: bytes, state: int = FNV64_OFFSET) -> int:
    """64-bit FNV-1a of `data`, starting from `state` (the offset basis by default)."""
    h = state
    for b in data:
        h = ((h ^ b) * FNV64_PRIME) & MASK64
    return h


class BlockHasher:
    """Turns token ids into the keys of their full blocks (see the module docstring)."""

    __slots__ = ("_native", "_stride", "algo", "block_size")

    def __init__(
        self, block_size: int, algo: HashAlgo = "xxh3", native: bool | None = None
    ) -> None:
        """`native`: hash xxh3 chains with the compiled `scorer.native` code (None: when it
        is available; False: the pure-Python reference). Same keys either way."""
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if algo not in ("xxh3", "fnv1a"):
            raise ValueError(f"unknown hash algorithm {algo!r} (xxh3 or fnv1a)")
        self.block_size = block_size
        self.algo: HashAlgo = algo
        self._stride = block_size * 4  # bytes per block (uint32 tokens)
        if native and NATIVE is None:
            raise RuntimeError("the compiled scorer.native module is not available")
        self._native = NATIVE if native is not False and algo == "xxh3" else None

    @property
    def native(self) -> bool:
        """Whether keys are computed by the compiled code."""
        return self._native is not None

    def __repr__(self) -> str:
        return f"BlockHasher(block_size={self.block_size}, algo={self.algo!r})"

    def keys(
        self, token_ids: Sequence[int], namespace: int = 0, parent: int | None = None
    ) -> list[int]:
        """Keys of the FULL blocks of `token_ids` (a trailing partial block has no key).

        key_i = H(key_{i-1}, tokens of block i) with key_{-1} = (`parent` or 0) ^ `namespace`,
        so the namespace reaches every key through the chain; uint64 python ints. One hash
        call per block over one bytes buffer.
        """
        bs = self.block_size
        nat = self._native
        if nat is not None:
            # One C loop: ids → little-endian uint32 → xxh3 per block (scorer/native).
            return nat.chain_keys(  # type: ignore[no-any-return]
                token_ids, bs, ((0 if parent is None else parent) ^ namespace) & MASK64
            )
        n = len(token_ids) // bs
        if n == 0:
            return []
        if self.algo != "xxh3" or _BIG_ENDIAN:
            return self.keys_from_bytes(tokens_to_bytes(token_ids, n * bs), namespace, parent)
        # Inlined fast path (this runs for every BlockStored and every request): one C-level
        # conversion to uint32 bytes, then one xxh3 call per block.
        buf = array("I", token_ids if n * bs == len(token_ids) else token_ids[: n * bs]).tobytes()
        prev = ((0 if parent is None else parent) ^ namespace) & MASK64
        h = _xxh3
        if n == 1:  # one block (a decode step's event): no loop
            return [h(buf, prev)]
        stride = self._stride
        return [prev := h(buf[o : o + stride], prev) for o in range(0, len(buf), stride)]

    def keys_from_bytes(
        self, buf: bytes, namespace: int = 0, parent: int | None = None
    ) -> list[int]:
        """Like `keys`, for tokens already packed as little-endian uint32 (`tokens_to_bytes`).

        Trailing bytes that do not fill a block are ignored.
        """
        stride = self._stride
        prev = ((0 if parent is None else parent) ^ namespace) & MASK64
        nat = self._native
        if nat is not None:
            return nat.chain_keys_bytes(buf, stride, prev)  # type: ignore[no-any-return]
        end = len(buf) - len(buf) % stride
        if self.algo == "xxh3":
            h = _xxh3
            return [prev := h(buf[o : o + stride], prev) for o in range(0, end, stride)]
        out: list[int] = []
        for o in range(0, end, stride):
            prev = fnv1a64(prev.to_bytes(8, "little") + buf[o : o + stride])
            out.append(prev)
        return out


def engine_key(h: int | bytes | bytearray | memoryview) -> int:
    """One canonical python int for an engine's opaque block hash (per-worker maps).

    uint64 and negative int64 (vLLM's old builtin `hash()`) are read modulo 2**64, bytes
    (sha256 digests) are folded with xxh3; the result keeps the low 60 bits so it is a
    32-byte python int instead of 36 (memory: millions live in the index). Two distinct
    engine hashes of one worker collide with probability ~n²/2⁶¹ (~4e-7 for 1M blocks).
    """
    if isinstance(h, int):
        return h & MASK60
    return _xxh3(bytes(h)) & MASK60
