"""The ext_proc messages of the hot path read and written as protobuf wire bytes, no
protobuf objects: a streamed response-body chunk (one per SSE event) is recognised from
its bytes and answered with pre-encoded bytes. `protocol.py` (protobuf objects) stays the
reference; tests/extproc/test_wire.py checks both give the same bytes for the same input.

Field numbers: Envoy v3 API `envoy/service/ext_proc/v3/external_processor.proto`
(ProcessingRequest: response_headers 3, response_body 5, response_trailers 7,
metadata_context 8,
observability_mode 10; the oneof `request` is fields 2-7; HttpBody: body 1,
end_of_stream 2, end_of_stream_without_message 3, grpc_message_compressed 4;
ProcessingResponse: request_body 3, response_body 4; BodyResponse.response 1;
CommonResponse.body_mutation 3; BodyMutation.streamed_response 3; StreamedBodyResponse:
body 1, end_of_stream 2). Wire format: protobuf encoding guide (varints, tags
`field << 3 | wire type`, length-delimited fields, unknown fields skipped by wire type).

Reading is deliberately narrow: anything but the plain shape Envoy sends (a oneof member
other than the one asked for, the same sub-message twice, groups, a malformed varint or
length, an unknown field of a bad wire type) returns None and the caller uses the
protobuf path, which then accepts, merges or rejects exactly as before.
"""

from __future__ import annotations

from scorer.extproc.protocol import BODY_CHUNK_BYTES

# ProcessingRequest fields (external_processor.proto).
REQ_RESPONSE_HEADERS = 3
REQ_RESPONSE_BODY = 5
REQ_RESPONSE_TRAILERS = 7
REQ_METADATA_CONTEXT = 8
REQ_OBSERVABILITY_MODE = 10
_ONEOF = frozenset((2, 3, 4, 5, 6, 7))  # the `request` oneof
# ProcessingResponse fields: which body answer.
RESP_REQUEST_BODY = 3
RESP_RESPONSE_BODY = 4

_VARINT, _I64, _LEN, _I32 = 0, 1, 2, 5
# First byte of a message whose first field is that oneof member (tag field << 3 | LEN).
TAG_RESPONSE_HEADERS = (REQ_RESPONSE_HEADERS << 3) | _LEN
TAG_RESPONSE_TRAILERS = (REQ_RESPONSE_TRAILERS << 3) | _LEN
_TAG_METADATA = (REQ_METADATA_CONTEXT << 3) | _LEN


def varint(n: int) -> bytes:
    """Protobuf base-128 varint of a non-negative int."""
    if n < 0x80:
        return _SMALL[n]
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


_SMALL = [bytes((i,)) for i in range(0x80)]


def _read_varint(buf: bytes, pos: int, end: int) -> tuple[int, int]:
    """(value, next position); ValueError when truncated or longer than 10 bytes."""
    b = buf[pos] if pos < end else -1
    if 0 <= b < 0x80:  # one byte: tags and small lengths
        return b, pos + 1
    result = 0
    shift = 0
    while True:
        if pos >= end or shift > 63:
            raise ValueError("bad varint")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if b < 0x80:
            if result >> 64:
                raise ValueError("varint past 64 bits")
            return result, pos
        shift += 7


def _skip(buf: bytes, pos: int, end: int, wt: int) -> int:
    """Position after an unknown field's value; ValueError for groups and truncation."""
    if wt == _VARINT:
        return _read_varint(buf, pos, end)[1]
    if wt == _LEN:
        n, pos = _read_varint(buf, pos, end)
        pos += n
    elif wt == _I64:
        pos += 8
    elif wt == _I32:
        pos += 4
    else:
        raise ValueError("group or bad wire type")
    if pos > end:
        raise ValueError("truncated field")
    return pos


def request_kind(raw: bytes) -> int:
    """The field number of the `request` oneof member a ProcessingRequest carries, when it
    carries exactly one (0 otherwise, or when the bytes are not a plain message). Other
    fields are skipped unread."""
    kind = 0
    pos = 0
    end = len(raw)
    try:
        while pos < end:
            tag, pos = _read_varint(raw, pos, end)
            field, wt = tag >> 3, tag & 7
            if field in _ONEOF:
                if kind or wt != _LEN:
                    return 0
                kind = field
            elif field == 0:
                return 0
            pos = _skip(raw, pos, end, wt)
    except ValueError:
        return 0
    return kind


def body_chunk(raw: bytes, field: int = REQ_RESPONSE_BODY) -> tuple[bytes, bool, bytes] | None:
    """(body, end_of_stream, metadata_context bytes or b"") of a ProcessingRequest whose
    oneof is the HttpBody `field` (response_body by default), or None when the message has
    any other shape (see the module doc). `observability_mode` and unknown fields of a
    valid wire type are skipped, as the protobuf parser does; `metadata_context` is
    returned unparsed for the caller to validate (the protobuf path would reject a bad
    one)."""
    end = len(raw)
    # The shapes Envoy sends for a chunk: the HttpBody, holding a non-empty body and
    # end_of_stream when set (`{field} LEN {body 1 LEN ...} [end_of_stream 2 = 1]`) or only
    # end_of_stream (the empty last chunk), then metadata_context when the gateway forwards
    # a namespace (`8 LEN ...`); each length in one or two varint bytes. Read here
    # without the general loop.
    if end > 3 and raw[0] == (field << 3) | _LEN:
        n = raw[1]
        pos = 2
        if n >= 0x80 and raw[2] < 0x80:
            n = (n & 0x7F) | (raw[2] << 7)
            pos = 3
        hb_end = pos + n
        if (n < 0x80 or pos == 3) and n > 1 and hb_end <= end:
            meta = b""
            if hb_end < end:  # metadata_context alone after the HttpBody, or the loop
                ml = raw[hb_end + 1] if hb_end + 1 < end else -1
                s = hb_end + 2
                if ml >= 0x80:
                    if s < end and raw[s] < 0x80:
                        ml = (ml & 0x7F) | (raw[s] << 7)
                        s += 1
                    else:
                        ml = -1  # three bytes or more: the loop
                if raw[hb_end] == _TAG_METADATA and ml >= 0 and s + ml == end:
                    meta = raw[s:end]
                else:
                    hb_end = -1
            if hb_end < 0:
                pass
            elif raw[pos] == 0x0A:
                m = raw[pos + 1]
                q = pos + 2
                if m >= 0x80 and q < hb_end and raw[q] < 0x80:
                    m = (m & 0x7F) | (raw[q] << 7)
                    q += 1
                if m and (m < 0x80 or q == pos + 3):
                    after = q + m
                    if after == hb_end:
                        return raw[q:after], False, meta
                    if after + 2 == hb_end and raw[after] == 0x10 and raw[after + 1] == 1:
                        return raw[q:after], True, meta
            elif n == 2 and raw[pos] == 0x10 and raw[pos + 1] == 1:
                return b"", True, meta
    pos = 0
    body_at = -1
    meta = b""
    try:
        while pos < end:
            tag, pos = _read_varint(raw, pos, end)
            f, wt = tag >> 3, tag & 7
            if f == field and wt == _LEN:
                if body_at >= 0:
                    return None  # twice: protobuf merges the two, left to it
                n, pos = _read_varint(raw, pos, end)
                body_at = pos
                pos += n
                body_end = pos
                if pos > end:
                    return None
            elif f in _ONEOF or f == 0 or f == 9 or f == 11:
                # another oneof member (last one wins in protobuf), attributes or
                # protocol_config (not on body chunks from Envoy): the protobuf path.
                return None
            elif f == REQ_METADATA_CONTEXT:
                if meta or wt != _LEN:
                    return None
                n, pos = _read_varint(raw, pos, end)
                meta = raw[pos : pos + n]
                pos += n
                if pos > end:
                    return None
            elif f == REQ_OBSERVABILITY_MODE and wt != _VARINT:
                return None
            else:
                pos = _skip(raw, pos, end, wt)
        if body_at < 0:
            return None
        # The HttpBody itself: body 1, end_of_stream 2 (last occurrence wins, as in
        # protobuf), end_of_stream_without_message 3 and grpc_message_compressed 4
        # (not used on this path), unknown fields skipped.
        pos = body_at
        body = b""
        eos = False
        while pos < body_end:
            tag, pos = _read_varint(raw, pos, body_end)
            f, wt = tag >> 3, tag & 7
            if f == 1:
                if wt != _LEN:
                    return None
                n, pos = _read_varint(raw, pos, body_end)
                if pos + n > body_end:
                    return None
                body = raw[pos : pos + n]
                pos += n
            elif 2 <= f <= 4:
                if wt != _VARINT:
                    return None
                v, pos = _read_varint(raw, pos, body_end)
                if f == 2:
                    eos = v != 0
            elif f == 0:
                return None
            else:
                pos = _skip(raw, pos, body_end, wt)
    except ValueError:
        return None
    return body, eos, meta


def streamed_body(body: bytes, end_of_stream: bool) -> list[bytes]:
    """`protocol.streamed_body` as wire bytes: the request body back in request_body
    streamed responses of ≤ 62,000 bytes (protocol.BODY_CHUNK_BYTES), end_of_stream on
    the last; an empty body is one empty chunk."""
    n = len(body)
    chunk = BODY_CHUNK_BYTES
    if n <= chunk:
        return [streamed_body_response(body, end_of_stream, RESP_REQUEST_BODY)]
    out = []
    for start in range(0, n, chunk):
        last = start + chunk >= n
        piece = body[start : start + chunk]
        out.append(streamed_body_response(piece, end_of_stream and last, RESP_REQUEST_BODY))
    return out


def streamed_body_response(body: bytes, end_of_stream: bool, field: int) -> bytes:
    """A ProcessingResponse with `{field}.response.body_mutation.streamed_response =
    {body, end_of_stream}` (field: RESP_REQUEST_BODY or RESP_RESPONSE_BODY), encoded as
    the protobuf library encodes it (fields in number order, defaults omitted, the
    nested messages present even when empty)."""
    n = len(body)
    key = (n << 4) | (field << 1) | end_of_stream
    head = _HEADS.get(key)
    if head is None:
        head = _streamed_head(n, end_of_stream, field)
        if len(_HEADS) >= 8192:  # bounded: chunk sizes repeat, a flood of new ones does not
            _HEADS.clear()
        _HEADS[key] = head
    return head + body + b"\x10\x01" if end_of_stream else head + body


_HEADS: dict[int, bytes] = {}  # everything before the body bytes, by (size, field, end)


def _streamed_head(n: int, end_of_stream: bool, field: int) -> bytes:
    head0 = b"\x0a" + varint(n) if n else b""  # body (absent when empty)
    l0 = len(head0) + n + (2 if end_of_stream else 0)  # StreamedBodyResponse; eos: 0x10 0x01
    l1 = 1 + len(varint(l0)) + l0  # BodyMutation {streamed_response}
    l2 = 1 + len(varint(l1)) + l1  # CommonResponse {body_mutation}
    l3 = 1 + len(varint(l2)) + l2  # BodyResponse {response}
    return b"".join(
        (
            _SMALL[(field << 3) | _LEN],
            varint(l3),
            b"\x0a",
            varint(l2),
            b"\x1a",
            varint(l1),
            b"\x1a",
            varint(l0),
            head0,
        )
    )
