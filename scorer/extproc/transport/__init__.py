"""A minimal gRPC-over-HTTP/2 server on asyncio, for the ext_proc stream (and the unary
Score / health Check methods on the same port).

Why: grpcio's per-stream cost (completion-queue batches handed from its poller thread to
the event loop, ~70 µs each, 7-8 per stream) is 500-700 µs of CPU per ext_proc stream on
our 2-core bench, against 50-60 µs for our own routing. This server speaks just what
Envoy's gRPC client needs for a bidi stream, parses frames with `struct` and decodes
request headers with `hpack`, and writes all frames produced in one event-loop turn (or
one `data_received`) with one `transport.write`. A handler may answer messages inside the
frame loop, without a task switch (`H2Stream.on_message`: the ext_proc response path).
`server.extproc_transport: grpcio` keeps the grpcio server.

One job per module (uvicorn's protocols/http/ layout):
- frames.py      HTTP/2 wire format: types, flags, codes, building frames (RFC 9113)
- hpack_codec.py HPACK: the blocks we send, the cached request-header decoder (RFC 7541)
- limits.py      resource bounds (defaults of H2GrpcServer)
- connection.py  one HTTP/2 connection: frame loop, streams, SETTINGS, flow control
- stream.py      one gRPC call: message framing, status trailers, StreamContext
- server.py      listen/accept, run handlers, graceful stop

Not supported (Envoy does not use them towards ext_proc): message compression (a
compressed message ends the stream with UNIMPLEMENTED), server push.
"""

from scorer.extproc.transport.connection import H2Connection
from scorer.extproc.transport.server import H2GrpcServer
from scorer.extproc.transport.stream import (
    EOF,
    AbortStream,
    H2Stream,
    Handler,
    StreamContext,
    unary,
)

__all__ = [
    "EOF",
    "AbortStream",
    "H2Connection",
    "H2GrpcServer",
    "H2Stream",
    "Handler",
    "StreamContext",
    "unary",
]
