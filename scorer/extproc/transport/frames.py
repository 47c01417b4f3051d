"""HTTP/2 wire format (RFC 9113 §4.1, §6, §7): frame types, flags, error codes, SETTINGS
identifiers, the connection preface, and building frames.

Parsing lives in `connection.data_received` (one `struct.unpack_from` per frame header
over a memoryview, no copy per frame); what it needs is defined here.
"""

from __future__ import annotations

import struct

# Frame types and flags (RFC 9113 §6).
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY = range(8)
WINDOW_UPDATE, CONTINUATION = 8, 9
END_STREAM = 0x1
ACK = 0x1
END_HEADERS = 0x4
PADDED = 0x8
PRIORITY_FLAG = 0x20
# Error codes (RFC 9113 §7).
NO_ERROR, PROTOCOL_ERROR, FLOW_CONTROL_ERROR, REFUSED_STREAM, CANCEL = 0x0, 0x1, 0x3, 0x7, 0x8
STREAM_CLOSED = 0x5
FRAME_SIZE_ERROR, COMPRESSION_ERROR, ENHANCE_YOUR_CALM = 0x6, 0x9, 0xB
# SETTINGS identifiers (RFC 9113 §6.5.2).
S_HEADER_TABLE_SIZE, S_ENABLE_PUSH, S_MAX_CONCURRENT_STREAMS, S_INITIAL_WINDOW_SIZE = 1, 2, 3, 4
S_MAX_FRAME_SIZE, S_MAX_HEADER_LIST_SIZE = 0x5, 0x6

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
HDR = struct.Struct(">IBI")  # (length << 8 | type), flags, stream id
U32 = struct.Struct(">I")
SETTING = struct.Struct(">HI")
MAX_WINDOW = 2**31 - 1


def frame(ftype: int, flags: int, sid: int, payload: bytes = b"") -> bytes:
    """One HTTP/2 frame (RFC 9113 §4.1)."""
    return HDR.pack((len(payload) << 8) | ftype, flags, sid) + payload


def settings_payload(entries: tuple[tuple[int, int], ...]) -> bytes:
    """A SETTINGS payload: 6 bytes per (identifier, value) (RFC 9113 §6.5.1)."""
    return b"".join(SETTING.pack(k, v) for k, v in entries)


def rst_stream(sid: int, code: int) -> bytes:
    """RST_STREAM with an error code (RFC 9113 §6.4)."""
    return frame(RST_STREAM, 0, sid, U32.pack(code))


def window_update(sid: int, increment: int) -> bytes:
    """WINDOW_UPDATE (RFC 9113 §6.9)."""
    return frame(WINDOW_UPDATE, 0, sid, U32.pack(increment))


def goaway(last_sid: int, code: int, text: bytes = b"") -> bytes:
    """GOAWAY with the last stream id processed and debug text (RFC 9113 §6.8)."""
    return frame(GOAWAY, 0, 0, struct.pack(">II", last_sid, code) + text)
