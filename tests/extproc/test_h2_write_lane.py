"""The compiled answer lane (scorer/native/_speedups.pyx `write_lane`) against
`H2Stream.write_now`, the Python method it stands in for: from the same connection and
stream state, the same result, frames queued (and written), windows, rapid-reset balance
and flush scheduling.

Property tests are derandomized in `make test`; counterexamples are kept as @example.
"""

from __future__ import annotations

import asyncio
from typing import Any

from configs import new_default_loop
from hypo import scaled
from hypothesis import example, given, settings
from hypothesis import strategies as st

from scorer.extproc.transport import H2Connection, H2GrpcServer, H2Stream
from scorer.extproc.transport import frames as F
from scorer.native import NATIVE


class Sink(asyncio.Transport):
    """A transport that keeps what is written."""

    def __init__(self) -> None:
        super().__init__()
        self.data = bytearray()

    def write(self, data: Any) -> None:
        self.data += data

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default

    def close(self) -> None:
        pass


# What a stream answering its request normally has, and the states write_now waits in.
_GOOD = {
    "peer_max_frame": 16_384, "send_window": 1 << 20, "initial": 65_535, "send_credit": 0,
    "paused": False, "done": False, "closed": False,
}  # fmt: skip
_ASIDE = {
    "frame too large for the peer": ("peer_max_frame", 100),
    "connection window": ("send_window", 100),
    "stream window": ("send_credit", -65_535 + 100),
    "no stream window": ("initial", 0),
    "peer not reading": ("paused", True),
    "stream done": ("done", True),
    "connection closed": ("closed", True),  # sends nothing, windows still move
}
_STATE = st.fixed_dictionaries(
    {
        "size": st.sampled_from([0, 1, 94, 95, 96, 200, 3000, 16_379, 16_380]),
        "headers_sent": st.booleans(),
        "receiving": st.booleans(),
        "flush_scheduled": st.booleans(),
        "sid": st.sampled_from([1, 257, 2**31 - 1]),
        "aside": st.sampled_from([""] * 2 * len(_ASIDE) + sorted(_ASIDE)),
    }
)


def _case(loop: asyncio.AbstractEventLoop, st_: dict[str, Any]) -> tuple[Any, Any, Sink]:
    st_ = {**_GOOD, **st_}
    if st_["aside"]:
        k, v = _ASIDE[st_["aside"]]
        st_[k] = v
    conn = H2Connection(H2GrpcServer())
    sink = Sink()
    conn.connection_made(sink)
    conn.data_received(F.PREFACE + F.frame(F.SETTINGS, 0, 0))
    sink.data.clear()
    s = H2Stream(conn, st_["sid"], "/p", [], None)
    conn.streams[s.sid] = s
    conn.peer_max_frame = st_["peer_max_frame"]
    conn.send_window = st_["send_window"]
    conn.peer_initial_window = st_["initial"]
    s.send_credit = st_["send_credit"]
    if st_["paused"]:
        conn.write_paused = loop.create_future()
    s._done = st_["done"]
    s._headers_sent = st_["headers_sent"]
    conn.closed = st_["closed"]
    conn.receiving = st_["receiving"]
    conn.flush_scheduled = st_["flush_scheduled"]
    return conn, s, sink


def _snapshot(conn: Any, s: Any, sink: Sink, took: bool) -> dict[str, Any]:
    got: dict[str, Any] = {k: getattr(conn, k) for k in ("send_window", "reset_balance")}
    got["out"] = list(conn.out)
    got["flush_scheduled"] = conn.flush_scheduled
    got["s"] = (s.send_credit, s._headers_sent)
    got["took"] = took
    return got


@settings(max_examples=scaled(200))
@given(state=_STATE)
@example(  # the routing answer: the response HEADERS first, then the message
    state={
        "size": 200, "headers_sent": False, "receiving": True, "flush_scheduled": False,
        "sid": 1, "aside": "",
    },
)  # fmt: skip
@example(  # outside a read: the flush is scheduled once
    state={
        "size": 0, "headers_sent": False, "receiving": False, "flush_scheduled": False,
        "sid": 257, "aside": "",
    },
)  # fmt: skip
@example(  # exactly the frame size the peer takes (16,379 + 5 bytes)
    state={
        "size": 16_379, "headers_sent": True, "receiving": True, "flush_scheduled": False,
        "sid": 2**31 - 1, "aside": "",
    },
)  # fmt: skip
def test_compiled_write_lane_matches_write_now(state: dict[str, Any]) -> None:
    """`write_lane(s, data)` against `s.write_now(data)` from the same state (windows just
    too small, frames the peer does not take, a peer not reading, a stream done, a closed
    connection, headers sent or not, inside a read or not): the same result, frames
    queued, windows, balance, flush scheduling and bytes written after a loop turn."""
    assert NATIVE is not None  # `make` builds it (tests/index/test_native.py checks the build)
    loop = new_default_loop()
    data = bytes(i % 251 for i in range(state["size"]))

    async def one(compiled: bool) -> dict[str, Any]:
        assert NATIVE is not None
        conn, s, sink = _case(loop, state)
        took = NATIVE.write_lane(s, data) if compiled else s.write_now(data)
        got = _snapshot(conn, s, sink, took)
        conn.receiving = False
        await asyncio.sleep(0)  # a scheduled flush runs
        got["written"] = bytes(sink.data)
        conn.connection_lost(None)
        return got

    try:
        assert loop.run_until_complete(one(True)) == loop.run_until_complete(one(False))
    finally:
        loop.close()
