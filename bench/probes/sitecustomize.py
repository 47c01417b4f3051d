"""Scorer-side timing probes for `bench/profile_envoy_phases.py --scorer-probes` (bench
only; nothing in the scorer imports this).

Python imports `sitecustomize` at start-up from PYTHONPATH. With KVSCORER_PROBES_DIR set,
this one wraps the ext_proc connection's `data_received` and `flush` in the process it runs
in and, at exit, writes `probes-<pid>.json` there: one row per answered read, (kind, µs
from the read reaching `H2Connection.data_received` to the answer's `transport.write`, µs
in that write, wall-clock time). Kinds: `response` (answered inside the read, in the frame
loop: the response messages), `request` (answered by the stream's handler at the end of
the read: the routing answer, decision included), `end` (the stream's trailers). Reads answered by
nothing (WINDOW_UPDATEs, Envoy's reset at the stream's end) are not rows.
"""

from __future__ import annotations

import os
from collections.abc import Callable


def _install(out_dir: str) -> Callable[[], None]:
    """Wrap the connection's methods; returns the function that writes the rows."""
    import json
    import time
    from pathlib import Path

    from scorer.extproc.transport.connection import H2Connection

    clock = time.perf_counter
    rows: list[tuple[str, float, float, float]] = []
    started = [0.0]  # when the last read reached data_received (0: answered already)
    receive = H2Connection.data_received
    flush = H2Connection.flush
    inside = [False]  # in data_received

    def data_received(self: H2Connection, data: bytes) -> None:
        started[0] = clock()
        inside[0] = True
        try:
            receive(self, data)
        finally:
            inside[0] = False

    def timed_flush(self: H2Connection) -> None:
        t0 = started[0]
        # The response path defers the director's work until its answers are written; a
        # flush carrying a HEADERS frame with END_STREAM ends a stream (its trailers); one
        # carrying DATA otherwise is the routing answer (its handler runs at the end of the
        # read: H2Stream.step). Each queued piece starts with a frame header (type: byte 3).
        kind: str | None = None
        if inside[0] and self.deferred:
            kind = "response"
        elif any(len(b) > 4 and b[3] == 1 and b[4] & 1 for b in self.out):
            kind = "end"
        elif any(len(b) > 4 and b[3] == 0 for b in self.out):
            kind = "request"
        if not t0 or not self.out or kind is None:
            flush(self)  # nothing measured (control frames only)
            return
        t1 = clock()
        flush(self)
        rows.append((kind, (t1 - t0) * 1e6, (clock() - t1) * 1e6, time.time()))
        started[0] = 0.0

    def dump() -> None:
        if rows:
            Path(out_dir, f"probes-{os.getpid()}.json").write_text(json.dumps(rows))

    H2Connection.data_received = data_received  # type: ignore[method-assign]
    H2Connection.flush = timed_flush  # type: ignore[method-assign]
    return dump


_dir = os.environ.get("KVSCORER_PROBES_DIR")
if _dir:
    import atexit

    atexit.register(_install(_dir))
