"""A test publisher speaking vLLM's KV-event protocol over real ZMQ sockets.

3-frame messages [topic, seq 8 bytes BE, msgpack batch] on an XPUB (wire-identical to
vLLM's PUB for a SUB; XPUB lets the test wait until the subscription arrived), and a ROUTER
replay socket answering [b"", start_seq] with [b"", seq, payload] (vLLM < 0.26) or
[b"", topic, seq, payload] (0.26+), then the end marker (seq 0xFF x 8, empty payload).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Any

import msgspec
import zmq
import zmq.asyncio

END = b"\xff" * 8


async def until(cond: Callable[[], bool], timeout: float = 30.0) -> None:
    """Bounded wait for a condition the subscriber reaches asynchronously."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not cond():
        if loop.time() > end:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.01)


def stored(
    hashes: list[Any],
    parent: Any,
    tokens: list[int],
    block_size: int = 16,
    medium: str | None = "GPU",
    lora_name: str | None = None,
    extra_keys: list[Any] | None = None,
    tagged: bool = True,
) -> Any:
    if tagged:
        ev: dict[str, Any] = {
            "type": "BlockStored",
            "block_hashes": hashes,
            "parent_block_hash": parent,
            "token_ids": tokens,
            "block_size": block_size,
            "lora_id": None,
            "medium": medium,
            "lora_name": lora_name,
        }
        if extra_keys is not None:
            ev["extra_keys"] = extra_keys
        return ev
    return ["BlockStored", hashes, parent, tokens, block_size, None, medium, lora_name, extra_keys]


def removed(hashes: list[Any], medium: str | None = "GPU", tagged: bool = True) -> Any:
    if tagged:
        return {"type": "BlockRemoved", "block_hashes": hashes, "medium": medium}
    return ["BlockRemoved", hashes, medium]


def cleared(tagged: bool = True) -> Any:
    return {"type": "AllBlocksCleared"} if tagged else ["AllBlocksCleared"]


class Publisher:
    """XPUB + ROUTER replay, on 127.0.0.1 random ports (or connecting to a bound SUB)."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        topic: str = "",
        reply_layout: int = 4,
        rank: int | None = None,
        connect_to: str | None = None,
        port: int | None = None,
        replay_port: int | None = None,
    ) -> None:
        self.ctx = ctx
        self.topic = topic
        self.reply_layout = reply_layout
        self.rank = rank
        self.seq = 0
        self.buffer: list[tuple[int, bytes]] = []
        self.pub = ctx.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        if connect_to is None:
            if port is None:
                port = self.pub.bind_to_random_port("tcp://127.0.0.1")
            else:  # a restarted engine on the same address
                self.pub.bind(f"tcp://127.0.0.1:{port}")
            self.endpoint = f"tcp://127.0.0.1:{port}"
        else:
            self.pub.connect(connect_to)
            self.endpoint = connect_to
        self.router = ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        if replay_port is None:
            rport = self.router.bind_to_random_port("tcp://127.0.0.1")
        else:
            rport = replay_port
            self.router.bind(f"tcp://127.0.0.1:{rport}")
        self.replay_endpoint = f"tcp://127.0.0.1:{rport}"
        self.replay_requests: list[int] = []
        # Replies sent per replay request before the rest (end marker included) is dropped,
        # as vLLM's ROUTER drops past its send HWM; None: every reply.
        self.reply_limit: int | None = None
        self._task = asyncio.create_task(self._serve_replay())

    async def wait_subscribed(self, timeout: float = 5.0) -> None:
        """Wait for a SUB's subscription message (no message is lost to the slow joiner)."""
        msg = await asyncio.wait_for(self.pub.recv(), timeout)
        assert msg[:1] == b"\x01"

    def encode(self, events: list[Any], ts: float | None = None) -> bytes:
        batch: list[Any] = [time.time() if ts is None else ts, events]
        if self.rank is not None:
            batch.append(self.rank)
        return msgspec.msgpack.encode(batch)

    async def publish(self, events: list[Any], send: bool = True, seq: int | None = None) -> int:
        """Publish one batch (buffered for replay). send=False: buffer only (a lost message)."""
        s = self.seq if seq is None else seq
        payload = self.encode(events)
        self.buffer.append((s, payload))
        self.seq = s + 1
        if send:
            await self.pub.send_multipart([self.topic.encode(), s.to_bytes(8, "big"), payload])
        return s

    async def raw(self, frames: list[bytes]) -> None:
        await self.pub.send_multipart(frames)

    async def _serve_replay(self) -> None:
        while True:
            ident, _empty, start_b = await self.router.recv_multipart()
            start = int.from_bytes(start_b, "big")
            self.replay_requests.append(start)
            sent = 0
            for s, payload in self.buffer:
                if s < start:
                    continue
                if self.reply_limit is not None and sent >= self.reply_limit:
                    break
                sent += 1
                if self.reply_layout == 4:
                    frames = [ident, b"", self.topic.encode(), s.to_bytes(8, "big"), payload]
                else:
                    frames = [ident, b"", s.to_bytes(8, "big"), payload]
                await self.router.send_multipart(frames)
            if self.reply_limit is not None and sent >= self.reply_limit:
                continue  # the end marker is past the HWM too
            end = [ident, b"", b"", END, b""] if self.reply_layout == 4 else [ident, b"", END, b""]
            await self.router.send_multipart(end)

    async def close(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self.pub.close(linger=0)
        self.router.close(linger=0)
