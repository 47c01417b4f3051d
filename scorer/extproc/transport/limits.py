"""Resource bounds of the asyncio HTTP/2 server (defaults of `H2GrpcServer`; see
docs/envoy.md, "Resource bounds")."""

from __future__ import annotations

# What we let a peer send before we return credit: big enough that an 8 MB body never
# waits, bounded so a peer cannot queue unbounded data we have not read yet.
RECV_WINDOW = 16 * 1024 * 1024
CONN_RECV_WINDOW = 64 * 1024 * 1024
OUR_MAX_FRAME = 1024 * 1024  # fewer frames for large bodies (peer default is 16,384)

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
# Largest gRPC message accepted (server.max_message_bytes).
MAX_MESSAGE = 80 * 1024 * 1024
# A TLS client has this long to complete its handshake before the socket is closed.
TLS_HANDSHAKE_TIMEOUT = 10.0
