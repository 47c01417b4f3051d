"""HPACK as this server uses it (RFC 7541).

Out: the few fixed header blocks we send (`:status 200`, `content-type`, gRPC status
trailers), encoded by hand without the dynamic table, so the peer's HEADER_TABLE_SIZE does
not concern us. In: `HeaderDecoder`, the `hpack` library's decoder plus a cache of
decoded blocks that is valid while the dynamic table is unchanged (Envoy sends the same
block for every ext_proc stream).
"""

from __future__ import annotations

from typing import cast

from hpack import Decoder as HpackDecoder  # type: ignore[import-untyped]
from hpack import OversizedHeaderListError

__all__ = [
    "OK_TRAILERS",
    "RESPONSE_HEADERS",
    "HeaderDecoder",
    "OversizedHeaderListError",
    "hpack_int",
    "literal",
    "status_trailers",
    "table_neutral",
]


def hpack_int(value: int, prefix_bits: int, first: int) -> bytes:
    """HPACK integer (RFC 7541 §5.1) with `first` holding the pattern bits above the prefix."""
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes([first | value])
    out = bytearray([first | limit])
    value -= limit
    while value >= 128:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def literal(name: bytes, value: bytes) -> bytes:
    """Literal header field without indexing, new name, no Huffman (RFC 7541 §6.2.2)."""
    return b"\x00" + hpack_int(len(name), 7, 0) + name + hpack_int(len(value), 7, 0) + value


# `:status: 200` is static index 8 (indexed field 0x88); `content-type` is static name
# index 31, sent as a literal without indexing (RFC 7541 Appendix A, §6.2.2).
RESPONSE_HEADERS = b"\x88" + hpack_int(31, 4, 0) + hpack_int(16, 7, 0) + b"application/grpc"
OK_TRAILERS = literal(b"grpc-status", b"0")


def _skip_int(block: bytes, i: int, prefix_bits: int) -> tuple[int, int]:
    """Decode an HPACK integer at block[i] (RFC 7541 §5.1): (value, next index)."""
    limit = (1 << prefix_bits) - 1
    value = block[i] & limit
    i += 1
    if value < limit:
        return value, i
    shift = 0
    while True:
        b = block[i]
        i += 1
        value += (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return value, i


def table_neutral(block: bytes) -> bool:
    """True when decoding `block` leaves the HPACK dynamic table unchanged: only indexed
    fields and literals without / never indexing (RFC 7541 §6.1, §6.2.2, §6.2.3); false
    for incremental indexing (§6.2.1) and table size updates (§6.3)."""
    i = 0
    n = len(block)
    try:
        while i < n:
            b = block[i]
            if b & 0x80:  # indexed field
                _, i = _skip_int(block, i, 7)
                continue
            if b & 0xE0 != 0:  # 01xxxxxx incremental indexing, 001xxxxx size update
                return False
            name_index, i = _skip_int(block, i, 4)
            if name_index == 0:  # literal name
                length, i = _skip_int(block, i, 7)
                i += length
            length, i = _skip_int(block, i, 7)
            i += length
        return i == n
    except IndexError:
        return False


def _percent_encode(text: str) -> bytes:
    """grpc-message encoding: bytes outside 0x20-0x7E and '%' as %XX (PROTOCOL-HTTP2.md)."""
    out = bytearray()
    for b in text.encode("utf-8"):
        if 0x20 <= b <= 0x7E and b != 0x25:
            out.append(b)
        else:
            out += b"%%%02X" % b
    return bytes(out)


def status_trailers(code: int, message: str | None = None) -> bytes:
    """The HPACK block of `grpc-status` (+ `grpc-message`)."""
    if code == 0 and not message:
        return OK_TRAILERS
    block = literal(b"grpc-status", str(code).encode())
    if message:
        block += literal(b"grpc-message", _percent_encode(message))
    return block


class HeaderDecoder:
    """One connection's request-header decoder. The decoder must see every block in
    order (it keeps the dynamic table); a block that does not change the table decodes
    to the same headers for as long as the table is unchanged, so those are cached."""

    __slots__ = ("_cache", "_decoder", "_gen", "decoded_bytes")

    CACHE_ENTRIES = 64

    def __init__(self, max_header_list: int) -> None:
        self._decoder = HpackDecoder(max_header_list_size=max_header_list)
        self._cache: dict[bytes, tuple[int, list[tuple[str, str]]]] = {}
        self._gen = 0  # bumped whenever a block may have changed the dynamic table
        self.decoded_bytes = 0  # bytes of blocks decoded (cache misses): their CPU cost

    def decode(self, block: bytes) -> list[tuple[str, str]]:
        """Decoded (name, value) pairs. Raises OversizedHeaderListError past the list
        bound, another hpack error for a malformed block."""
        cached = self._cache.get(block)
        if cached is not None and cached[0] == self._gen:
            return cached[1]
        self.decoded_bytes += len(block)
        headers = cast(list[tuple[str, str]], self._decoder.decode(block, raw=False))
        if table_neutral(block):
            if len(self._cache) >= self.CACHE_ENTRIES:
                self._cache.clear()
            self._cache[block] = (self._gen, headers)
        else:
            self._gen += 1  # entries decoded before may now mean something else
        return headers
