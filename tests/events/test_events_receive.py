"""`scorer.events.subscriber.receive`: the loop that hands a socket's messages to a handler.

Queued messages are read with plain non-blocking calls on a shadow of the asyncio socket;
these tests pin what that must not break: every message, in order, the loop yielded after
each burst, and a message that arrives after the queue was drained still wakes it (the
asyncio layer is not told about the shadow's reads).
"""

from __future__ import annotations

import asyncio

import zmq
import zmq.asyncio

from scorer.events.subscriber import BURST, receive
from scorer.tasks import cancel_and_wait


async def test_queued_and_later_messages_all_arrive_in_order_with_the_loop_yielded() -> None:
    ctx = zmq.asyncio.Context()
    push, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    push.bind("inproc://receive-test")
    pull.connect("inproc://receive-test")
    got: list[int] = []
    ticks = 0
    seen_ticks: list[int] = []  # the ticker's count at each message
    want = asyncio.Event()
    target = 0

    async def handle(frames: list[bytes]) -> None:
        got.append(int(frames[1]))
        seen_ticks.append(ticks)
        if len(got) >= target:
            want.set()

    async def ticker() -> None:  # runs only when receive() yields the loop
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    first = 3 * BURST + 5
    for i in range(first):  # queued before the receiver runs: read by the drain
        await push.send_multipart([b"t", str(i).encode()])
    target = first
    task = asyncio.create_task(receive(pull, handle))
    tick = asyncio.create_task(ticker())
    try:
        async with asyncio.timeout(10):
            await want.wait()
        assert got == list(range(first))
        # The loop was given up between bursts: the ticker moved inside the run.
        assert len(set(seen_ticks)) >= first // BURST
        # The queue is empty now; later messages must still wake the receiver.
        for round_ in range(3):
            want.clear()
            target = len(got) + 1
            await push.send_multipart([b"t", str(first + round_).encode()])
            async with asyncio.timeout(10):
                await want.wait()
        assert got == list(range(first + 3))
    finally:
        await cancel_and_wait(task, tick)
        push.close(linger=0)
        pull.close(linger=0)
        ctx.term()
