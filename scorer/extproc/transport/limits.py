"""Resource bounds of the asyncio HTTP/2 server: `Limits`, the defaults of `H2GrpcServer`
(see docs/envoy.md, "Resource bounds"). Each bound is O(1) to check per frame."""

from __future__ import annotations

from dataclasses import dataclass

# What we let a peer send before we return credit (RFC 9113 §6.9): per stream, and per
# connection (the WINDOW_UPDATE sent with our SETTINGS). Credit is returned as message
# bytes are taken into memory, within MAX_BUFFERED, so messages of any size up to
# max_message complete whatever the windows.
RECV_WINDOW = 8 * 1024 * 1024
CONN_RECV_WINDOW = 16 * 1024 * 1024
READ_BUFFER = 64 * 1024  # bytes per socket read (one buffer per connection, reused)
OUR_MAX_FRAME = 1024 * 1024  # fewer frames for large bodies (peer default is 16,384)
# Largest gRPC message accepted (the App sets it above extproc.max_body_bytes).
MAX_MESSAGE = 80 * 1024 * 1024

# Streams open at once per connection, advertised as SETTINGS_MAX_CONCURRENT_STREAMS;
# one more is refused with RST_STREAM(REFUSED_STREAM) before any handler runs (RFC 9113
# §5.1.2). Envoy opens one stream per request on a pool of connections.
MAX_STREAMS = 1024
# Header section bound, advertised as SETTINGS_MAX_HEADER_LIST_SIZE (RFC 9113 §6.5.2,
# RFC 7541 §4.1 sizes: name + value + 32 per field). It bounds both the compressed
# HEADERS + CONTINUATION block we buffer (checked before buffering a frame, against
# CONTINUATION floods, CVE-2024-27316) and the decoded list (hpack's decoder limit).
# Exceeding either is a connection error GOAWAY(ENHANCE_YOUR_CALM): the block cannot be
# skipped undecoded without losing the HPACK dynamic table state. Envoy's ext_proc
# request headers are ~200 bytes.
MAX_HEADER_LIST = 64 * 1024
# Rapid reset (CVE-2023-44487): a client reset of a stream whose handler had started
# and which got no response yet costs one unit of a per-connection balance; each answered
# stream earns one back, time earns RESET_REFILL_PER_S; the balance is capped at
# RESET_BUDGET. Below zero: GOAWAY(ENHANCE_YOUR_CALM), no new streams, the connection
# closes once its open streams end. Envoy resets followed streams only after our answer.
RESET_BUDGET = 1000
RESET_REFILL_PER_S = 100.0
# A TLS client has this long to complete its handshake before the socket is closed.
TLS_HANDSHAKE_TIMEOUT = 10.0


@dataclass(frozen=True)
class Limits:
    """Per-server and per-connection bounds (keyword arguments of H2GrpcServer)."""

    max_streams: int = MAX_STREAMS
    max_header_list: int = MAX_HEADER_LIST
    reset_budget: int = RESET_BUDGET
    reset_refill_per_s: float = RESET_REFILL_PER_S
    tls_handshake_timeout: float = TLS_HANDSHAKE_TIMEOUT
    # Connections open at once; one more is closed at accept (counted).
    max_connections: int = 1024
    # The client's preface and first SETTINGS must arrive within this (RFC 9113 §3.4).
    handshake_timeout: float = 10.0
    # A connection with no open stream and nothing received for this long gets
    # GOAWAY(NO_ERROR) and is closed; one whose peer has not read what we sent for this
    # long is closed. Longer than Envoy's own upstream idle_timeout (1 h default,
    # HttpProtocolOptions.idle_timeout): Envoy closes its idle connections first, so a
    # request never races our GOAWAY; this only ends connections nobody closes.
    idle_timeout: float = 3900.0
    # Message bytes a connection holds (partial messages and messages its handlers have
    # not read yet) before flow-control credit is withheld: the peer then stops at its
    # windows. One stream at a time may go past it to complete a message of up to
    # max_message. Memory per connection: about max_buffered + max_message +
    # CONN_RECV_WINDOW, plus the socket's write buffer (reading stops while the peer does
    # not read what we send: PING and SETTINGS answers cannot pile up).
    max_buffered: int = 16 * 1024 * 1024
    # PING and SETTINGS frames (each answered by us): a balance like the rapid reset one.
    control_budget: int = 200
    control_refill_per_s: float = 50.0
    # SETTINGS entries in one frame (a real peer sends under 10).
    max_settings_entries: int = 64
    # CONTINUATION frames in one header block (empty ones included).
    max_continuations: int = 32
    # Bytes of header blocks decoded (cache misses only: Envoy repeats one block), a
    # balance refilled per second: bounds HPACK's CPU (~0.3 µs per byte).
    hpack_budget: int = 1024 * 1024
    hpack_refill_per_s: float = 256 * 1024.0
