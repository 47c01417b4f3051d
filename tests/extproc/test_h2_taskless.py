"""Task-less handlers (`H2Stream.step`): a handler that only waits for its own stream's
messages runs inside the connection's reads, with no task; the first time it awaits
anything else its coroutine moves to a task and goes on there as it would have."""

from __future__ import annotations

import asyncio
from typing import Any

from hpack import Encoder

from scorer.extproc.transport import EOF, H2Connection, H2GrpcServer, StreamContext
from scorer.extproc.transport import frames as F
from scorer.extproc.transport.stream import H2Stream
from tests.extproc.test_h2_queue_lane import Sink, data, headers, msg

PATH = "/t.S/Run"


def rig(handler: Any) -> tuple[H2GrpcServer, H2Connection, Sink]:
    server = H2GrpcServer()
    server.add_handler(PATH, handler)
    conn = H2Connection(server)
    sink = Sink()
    conn.connection_made(sink)
    conn.data_received(F.PREFACE + F.frame(F.SETTINGS, 0, 0))
    return server, conn, sink


def frames_since(sink: Sink, mark: int) -> list[tuple[int, int, int, bytes]]:
    """(type, flags, stream, payload) of each frame written since `mark`."""
    out, b, i = [], bytes(sink.data[mark:]), 0
    while i + 9 <= len(b):
        n = int.from_bytes(b[i : i + 3], "big")
        sid = int.from_bytes(b[i + 5 : i + 9], "big") & 0x7FFFFFFF
        out.append((b[i + 3], b[i + 4], sid, b[i + 9 : i + 9 + n]))
        i += 9 + n
    assert i == len(b)
    return out


async def test_a_read_is_answered_in_that_read_without_a_task() -> None:
    """Headers and a message in one read: the handler runs at the end of that read and
    its answer leaves in the read's one write; the end of the stream finishes the call in
    its own read. No task is ever created."""
    writes: list[int] = []

    async def echo(_: Any, s: StreamContext) -> None:
        while (m := await s.read()) is not EOF:
            await s.write(b"re:" + bytes(m))

    server, conn, sink = rig(echo)
    sink_write = sink.write

    def counted(b: Any) -> None:
        writes.append(len(b))
        sink_write(b)

    sink.write = counted  # type: ignore[method-assign]
    mark = len(sink.data)
    conn.data_received(headers(Encoder(), 1, PATH) + data(1, msg(b"one")))
    # Synchronously, before any loop turn: answered, in one write.
    (s,) = server.calls
    assert isinstance(s, H2Stream) and s.task is None
    assert len(writes) == 1
    got = [p[5:] for t, _, sid, p in frames_since(sink, mark) if t == F.DATA and sid == 1]
    assert got == [b"re:one"]
    mark = len(sink.data)
    conn.data_received(data(1, msg(b"two")) + data(1, b"", F.END_STREAM))
    fs = frames_since(sink, mark)
    assert [p[5:] for t, _, sid, p in fs if t == F.DATA] == [b"re:two"]
    assert any(t == F.HEADERS and fl & F.END_STREAM for t, fl, _, _ in fs)  # grpc-status
    assert not server.calls and s.task is None


async def test_awaiting_something_else_moves_the_handler_to_a_task() -> None:
    gate: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
    seen: list[Any] = []

    async def waits(_: Any, s: StreamContext) -> None:
        m = await s.read()
        await s.write(await gate + bytes(m))  # not its stream's read: a task from here
        seen.append(await s.read())

    server, conn, sink = rig(waits)
    conn.data_received(headers(Encoder(), 1, PATH) + data(1, msg(b"x")))
    (s,) = server.calls
    assert isinstance(s, H2Stream) and s.task is not None and not s.task.done()
    mark = len(sink.data)
    gate.set_result(b"late:")
    for _ in range(20):  # bounded: the task runs in the next loop turns
        if len(sink.data) > mark:
            break
        await asyncio.sleep(0)
    assert [p[5:] for t, _, _, p in frames_since(sink, mark) if t == F.DATA] == [b"late:x"]
    conn.data_received(data(1, b"", F.END_STREAM))  # the task, parked in read(), gets EOF
    await asyncio.wait_for(s.task, 5)
    assert seen == [EOF] and not server.calls


async def test_interrupt_reaches_a_parked_handler_where_it_waits() -> None:
    """`interrupt` (how the servicer releases followed streams at shutdown) is
    Task.cancel for a task-less handler: CancelledError where it waits."""
    got: list[str] = []

    async def follows(_: Any, s: StreamContext) -> None:
        await s.read()
        await s.write(b"routed")
        try:
            await s.read()
        except asyncio.CancelledError:
            got.append("released")

    server, conn, sink = rig(follows)
    conn.data_received(headers(Encoder(), 1, PATH) + data(1, msg(b"r")))
    (s,) = server.calls
    assert isinstance(s, H2Stream) and s.task is None
    mark = len(sink.data)
    s.interrupt()
    for _ in range(20):  # bounded: the interrupt is delivered in the next loop turn
        if not server.calls and not conn.flush_scheduled:
            break
        await asyncio.sleep(0)
    assert got == ["released"] and not server.calls and s.task is None
    fs = frames_since(sink, mark)
    assert any(t == F.HEADERS and fl & F.END_STREAM for t, fl, _, _ in fs)  # OK trailers


async def test_a_reset_before_the_handler_ran_never_runs_it() -> None:
    """A stream reset in the read that started it: its handler is cancelled before its
    first step, as a task cancelled before it started."""
    ran: list[bool] = []

    async def handler(_: Any, s: StreamContext) -> None:
        ran.append(True)
        await s.read()

    server, conn, _ = rig(handler)
    conn.data_received(headers(Encoder(), 1, PATH) + data(1, msg(b"x")) + F.rst_stream(1, F.CANCEL))
    await asyncio.sleep(0)
    assert ran == [] and not server.calls and not conn.streams


async def test_a_task_cancelled_before_its_first_step_still_cancels_the_handler() -> None:
    """A handler that moved to a task and whose peer resets before the task first ran:
    the cancellation reaches the handler where it waits (`_Resumed.throw`)."""
    got: list[str] = []

    async def waits(_: Any, s: StreamContext) -> None:
        await s.read()
        try:
            await asyncio.get_running_loop().create_future()  # moves to a task
        except asyncio.CancelledError:
            got.append("cancelled")
            raise

    server, conn, _ = rig(waits)
    conn.data_received(headers(Encoder(), 1, PATH) + data(1, msg(b"x")))
    (s,) = server.calls
    assert isinstance(s, H2Stream) and s.task is not None
    conn.data_received(F.rst_stream(1, F.CANCEL))  # before the task's first step
    task = s.task
    await asyncio.wait({task}, timeout=5)
    assert got == ["cancelled"] and not server.calls
