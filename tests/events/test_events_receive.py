"""The receive path: `Reader` hands a socket's messages to a handler from the loop's reader
callback, and `Subscriber.offer` handles each at once or queues it behind what is in
progress (a sync, a gap's replay, earlier queued messages).

What these pin: every message, in order; the loop yielded after each burst; a message that
arrives after the queue was drained still wakes the reader (ZMQ's FD only signals changes);
a full handler stops the reader until resumed, losing nothing; `close()` stops it at once;
a lone message is applied within the read that brings it; a message never overtakes one
still waiting on the async path.
"""

from __future__ import annotations

import asyncio
import select
import time
from collections.abc import AsyncIterator

import msgspec
import pytest
import zmq
import zmq.asyncio
from kvev_publisher import Publisher, stored, until

from scorer.blocks import BlockHasher
from scorer.config import EventsConfig, EventsEndpointConfig, IndexConfig
from scorer.events.apply import Applier
from scorer.events.decode import Message
from scorer.events.subscriber import BURST, Reader, Subscriber
from scorer.index import BlockIndex
from scorer.tasks import cancel_and_wait

BS = 16


class Pair:
    """An inproc PUSH → PULL pair; `send` does not yield the loop."""

    def __init__(self, ctx: zmq.asyncio.Context, name: str) -> None:
        self.name = name
        self.push, self.pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
        self.push.bind(f"inproc://{name}")
        self.pull.connect(f"inproc://{name}")
        self._send = zmq.Socket.shadow(self.push.underlying).send_multipart

    def send(self, i: int) -> None:
        self._send([b"t", str(i).encode()])

    def close(self) -> None:
        self.push.close(linger=0)
        self.pull.close(linger=0)


@pytest.fixture
async def pair(ctx: zmq.asyncio.Context, request: pytest.FixtureRequest) -> AsyncIterator[Pair]:
    p = Pair(ctx, request.node.name)
    yield p
    p.close()


async def turns(n: int) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


async def test_queued_and_later_messages_all_arrive_in_order_with_the_loop_yielded(
    pair: Pair,
) -> None:
    got: list[int] = []
    ticks = 0
    seen_ticks: list[int] = []  # the ticker's count at each message
    want = asyncio.Event()
    target = 0

    def handle(frames: list[bytes]) -> bool:
        got.append(int(frames[1]))
        seen_ticks.append(ticks)
        if len(got) >= target:
            want.set()
        return True

    async def ticker() -> None:  # runs only when the reader yields the loop
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    first = 3 * BURST + 5
    for i in range(first):  # queued before the reader exists: no FD signal for them
        pair.send(i)
    target = first
    task = asyncio.create_task(Reader(pair.pull, handle).run())
    tick = asyncio.create_task(ticker())
    try:
        async with asyncio.timeout(10):
            await want.wait()
        assert got == list(range(first))
        # The loop was given up between bursts: the ticker moved inside the run.
        assert len(set(seen_ticks)) >= first // BURST
        # The queue is empty now; later messages must still wake the reader, one at a time
        # and several at once.
        for round_, n in enumerate((1, 1, 3, 1)):
            want.clear()
            target = len(got) + n
            for j in range(n):
                pair.send(first + 10 * round_ + j)
            async with asyncio.timeout(10):
                await want.wait()
        assert got[first:] == [first, first + 10, first + 20, first + 21, first + 22, first + 30]
    finally:
        await cancel_and_wait(task, tick)


async def test_a_full_handler_stops_the_reader_until_resumed_and_nothing_is_lost(
    pair: Pair,
) -> None:
    got: list[int] = []
    full = True

    def handle(frames: list[bytes]) -> bool:
        got.append(int(frames[1]))
        return not full  # the first message fills the handler

    class Counted(Reader):
        wakeups = 0

        def _drain(self) -> None:
            Counted.wakeups += 1
            super()._drain()

    reader = Counted(pair.pull, handle)
    task = asyncio.create_task(reader.run())
    try:
        for i in range(5):
            pair.send(i)
        await until(lambda: got == [0])
        for i in range(5, 8):  # more arrivals while stopped: still not read
            pair.send(i)
        # A new peer is a command on the socket's mailbox: the FD signals while stopped.
        pair.pull.bind(f"inproc://{pair.name}-2")
        other = zmq.Context.shadow(pair.push.context.underlying).socket(zmq.PUSH)
        other.connect(f"inproc://{pair.name}-2")
        before = Counted.wakeups
        await turns(50)
        assert got == [0]
        # ...and the signal is cleared: no wake-up per loop turn (a busy loop).
        assert 0 < Counted.wakeups - before < 10
        full = False
        reader.resume()
        await until(lambda: len(got) == 8)
        assert got == list(range(8))
        pair.send(8)  # and it reads on its own again
        await until(lambda: len(got) == 9)
    finally:
        await cancel_and_wait(task)
        other.close(linger=0)


async def test_close_stops_the_reader_at_once(pair: Pair) -> None:
    got: list[int] = []

    def handle(frames: list[bytes]) -> bool:
        got.append(int(frames[1]))
        return True

    reader = Reader(pair.pull, handle)
    task = asyncio.create_task(reader.run())
    pair.send(0)
    await until(lambda: got == [0])
    for i in range(1, 2 * BURST):
        pair.send(i)
    reader.close()  # before the loop runs again: not one more message
    async with asyncio.timeout(10):
        await task  # run() returns
    await turns(20)
    assert got == [0]


async def test_a_failing_handler_ends_run_with_its_error(pair: Pair) -> None:
    def handle(frames: list[bytes]) -> bool:
        raise RuntimeError("injected")

    task = asyncio.create_task(Reader(pair.pull, handle).run())
    pair.send(0)
    with pytest.raises(RuntimeError, match="injected"):
        async with asyncio.timeout(10):
            await task


# ---- Subscriber.offer: at once, or in order behind what is in progress ----------------------


def batch_frames(seq: int, block: int, parent: int | None, rank: int = 0) -> list[bytes]:
    tokens = list(range(block * BS, (block + 1) * BS))
    payload = msgspec.msgpack.encode([time.time(), [stored([block + 1], parent, tokens)], rank])
    return [b"", seq.to_bytes(8, "big"), payload]


def subscriber(
    ctx: zmq.asyncio.Context, replay: str | None = None, endpoint: str = "tcp://127.0.0.1:1"
) -> tuple[Subscriber, list[int]]:
    """A Subscriber without a socket of its own (as the pool socket's), recording the seq
    of every message it applies."""
    applied: list[int] = []

    def on_message(msg: Message) -> None:
        applied.append(msg.seq)

    ev = EventsEndpointConfig(endpoint=endpoint, replay_endpoint=replay)
    sub = Subscriber(
        "w0",
        ev,
        Applier(BlockIndex(IndexConfig()), BlockHasher(BS)),
        EventsConfig(replay_timeout_s=2.0),
        ctx,
        on_message=on_message,
    )
    return sub, applied


async def test_a_lone_message_is_applied_within_the_read(ctx: zmq.asyncio.Context) -> None:
    sub, applied = subscriber(ctx)
    try:
        assert sub.offer(batch_frames(0, 0, None))
        assert applied == [0]  # no await in between: no task, no loop turn
        assert sub.offer(batch_frames(1, 1, 1))
        assert applied == [0, 1]
        assert sub.stats.last_seq == {0: 1} and sub.stats.messages == 2
        assert sub.offer([b"", b"\x00" * 8, b"not msgpack"])  # counted and dropped
        assert sub.stats.decode_errors == {"msgpack": 1} and applied == [0, 1]
    finally:
        await sub.stop()


async def test_messages_arriving_while_the_lock_is_held_wait_and_keep_their_order(
    ctx: zmq.asyncio.Context,
) -> None:
    sub, applied = subscriber(ctx)
    ticks = 0
    seen: list[int] = []

    n = 3 * BURST + 5
    late = n + 1

    def on_message(msg: Message) -> None:
        applied.append(msg.seq)
        seen.append(ticks)

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            if applied and len(applied) < n and not injected:
                # The backlog's worker yielded between bursts (the lock is free).
                injected.append(sub.offer(batch_frames(0, n, None, rank=1)))
            await asyncio.sleep(0)

    injected: list[bool] = []
    sub.on_message = on_message
    tick = asyncio.create_task(ticker())
    try:
        await sub._lock.acquire()  # what a sync holds while it runs
        full = [sub.offer(batch_frames(i, i, i or None)) for i in range(n)]
        # The backlog asks the reader to stop once full (the rest would wait in ZMQ).
        assert full.index(False) == BURST - 1
        await turns(20)
        assert applied == []
        sub._lock.release()
        await until(lambda: len(applied) == n + 1)
        assert injected and applied == [*range(n), 0]
        assert sub.stats.gaps == 0 and sub.stats.purges == {}
        assert len(set(seen)) >= n // BURST  # the loop was yielded between bursts
        # Idle again: the next message is applied at once.
        assert sub.offer(batch_frames(n, late, n))
        assert applied[-1] == n
    finally:
        await cancel_and_wait(tick)
        await sub.stop()


async def test_messages_after_a_gap_wait_for_its_replay(ctx: zmq.asyncio.Context) -> None:
    pub = Publisher(ctx)
    for i in range(8):  # the worker's replay buffer
        await pub.publish([stored([i + 1], i or None, list(range(i * BS, (i + 1) * BS)))])
    sub, applied = subscriber(ctx, pub.replay_endpoint)
    live = {s: [b"", s.to_bytes(8, "big"), p] for s, p in pub.buffer}
    try:
        assert sub.offer(live[0]) and applied == [0]
        # 1-3 lost: 4 shows the gap and waits for its replay; 5-7 must wait behind it, and
        # so must another rank's first message (not a gap by itself).
        for s in (4, 5, 6, 7):
            sub.offer(live[s])
        other = msgspec.msgpack.encode([time.time(), [stored([99], None, list(range(BS)))], 1])
        sub.offer([b"", (0).to_bytes(8, "big"), other])
        assert applied == [0]
        await until(lambda: len(applied) == 9)
        assert applied == [*range(8), 0]
        assert sub.stats.last_seq == {0: 7, 1: 0}
        assert sub.stats.gaps == 1 and sub.stats.replays == {"ok": 1}
        assert pub.replay_requests == [1] and sub.stats.purges == {}
    finally:
        await sub.stop()
        await pub.close()


async def test_a_cancelled_subscriber_applies_nothing_more(ctx: zmq.asyncio.Context) -> None:
    sub, applied = subscriber(ctx)
    try:
        await sub._lock.acquire()
        for i in range(3):
            sub.offer(batch_frames(i, i, i or None))
        sub.cancel()  # the worker left the pool
        sub._lock.release()
        await turns(20)
        assert sub.offer(batch_frames(3, 3, 3))
        await turns(5)
        assert applied == []
    finally:
        await sub.stop()


async def test_cancel_stops_the_reader_before_its_task_sees_the_cancel(
    ctx: zmq.asyncio.Context,
) -> None:
    pub = Publisher(ctx)
    sub, applied = subscriber(ctx, endpoint=pub.endpoint)
    await sub.start()
    try:
        await pub.wait_subscribed()
        await pub.publish([stored([1], None, list(range(BS)))])
        await until(lambda: applied == [0])
        payload = pub.encode([stored([2], 1, list(range(BS, 2 * BS)))])
        zmq.Socket.shadow(pub.pub.underlying).send_multipart([b"", (1).to_bytes(8, "big"), payload])
        assert sub._sub is not None
        # The SUB's FD signals the arrival: the reader's callback would run on the next turn.
        readable, _, _ = select.select([sub._sub.FD], [], [], 10.0)
        assert readable
        sub.cancel()  # the worker left the pool: nothing of it applies from here on
        await turns(20)
        assert applied == [0]
    finally:
        await sub.stop()
        await pub.close()
