"""vLLM's KV-event wire format and ZMQ publisher, for the simulated worker.

Wire format (vllm/distributed/kv_events.py, checked byte for byte against
../shared/vectors in tests/sim/test_sim_vectors.py):

- PUB multipart message: [topic (utf-8, default ""), seq (8-byte big-endian, from 0),
  msgpack payload];
- payload: `KVEventBatch` = positional array [ts, events, data_parallel_rank];
- events: tagged msgspec structs. Array era (vLLM <= 0.23): positional arrays
  ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
  lora_name, extra_keys, group_idx] (0.20-0.21 field set). Map era (0.24+): maps
  {"type": "BlockStored", ...} in the same field order, with `omit_defaults` dropping
  fields that still hold their None default;
- replay: a ROUTER socket; a DEALER sends [b"", start_seq (8 bytes)] and gets, for every
  buffered message with seq >= start_seq, [b"", topic, seq, payload] (0.26+) or
  [b"", seq, payload] (up to 0.25), then the end marker with seq 0xFF x 8 and an empty
  payload;
- endpoints: vLLM binds the PUB socket when the address has "*" or "::" (or is ipc:// /
  inproc://) and connects otherwise; the replay socket always binds.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Sequence
from typing import Any, Literal

import msgspec
import zmq
import zmq.asyncio

from scorer.tasks import cancel_and_wait

log = logging.getLogger(__name__)

Era = Literal["map", "array"]
ReplayLayout = Literal["topic", "legacy"]
SocketMode = Literal["auto", "bind", "connect"]

END_SEQ = b"\xff" * 8  # replay end marker (vLLM `END_SEQ`)
BlockHash = int | bytes
ExtraKeys = list[tuple[Any, ...] | None]

# --- map era (vLLM 0.24+; field order and defaults as in 0.32) ----------------------------


class _MapEvent(msgspec.Struct, tag=True, omit_defaults=True, array_like=False):
    pass


class MapBlockStored(_MapEvent, tag="BlockStored"):
    """BlockStored as vLLM 0.24+ encodes it (a tagged map)."""

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: ExtraKeys | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class MapBlockRemoved(_MapEvent, tag="BlockRemoved"):
    """BlockRemoved as vLLM 0.24+ encodes it."""

    block_hashes: list[BlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class MapAllBlocksCleared(_MapEvent, tag="AllBlocksCleared"):
    """AllBlocksCleared (no fields)."""


# --- array era (vLLM 0.20-0.23 field set) ---------------------------------------------------


class _ArrayEvent(msgspec.Struct, tag=True, omit_defaults=True, array_like=True):
    pass


class ArrayBlockStored(_ArrayEvent, tag="BlockStored"):
    """BlockStored as vLLM <= 0.23 encodes it (a positional array)."""

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: ExtraKeys | None = None
    group_idx: int | None = None


class ArrayBlockRemoved(_ArrayEvent, tag="BlockRemoved"):
    """BlockRemoved as vLLM <= 0.23 encodes it."""

    block_hashes: list[BlockHash]
    medium: str | None
    group_idx: int | None = None


class ArrayAllBlocksCleared(_ArrayEvent, tag="AllBlocksCleared"):
    """AllBlocksCleared (no fields)."""


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    """The payload of one PUB message: [ts, events, data_parallel_rank]."""

    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


_ENCODER = msgspec.msgpack.Encoder()


def block_stored(
    era: Era,
    block_hashes: Sequence[BlockHash],
    parent_block_hash: BlockHash | None,
    token_ids: Sequence[int],
    block_size: int,
    *,
    lora_id: int | None = None,
    lora_name: str | None = None,
    extra_keys: Sequence[tuple[Any, ...] | None] | None = None,
    medium: str | None = "GPU",
    group_idx: int = 0,
) -> msgspec.Struct:
    """A BlockStored event of the given era, filled the way vLLM's GPU block pool fills it."""
    keys: ExtraKeys = list(extra_keys) if extra_keys is not None else [None] * len(block_hashes)
    if era == "array":
        return ArrayBlockStored(
            list(block_hashes), parent_block_hash, list(token_ids), block_size,
            lora_id, medium, lora_name, keys, group_idx,
        )  # fmt: skip
    return MapBlockStored(
        list(block_hashes), parent_block_hash, list(token_ids), block_size,
        lora_id, medium, lora_name, keys, group_idx,
        kv_cache_spec_kind="full_attention",  # vLLM >= 0.22 always fills it
    )  # fmt: skip


def block_removed(
    era: Era, block_hashes: Sequence[BlockHash], medium: str | None = "GPU", group_idx: int = 0
) -> msgspec.Struct:
    """A BlockRemoved event of the given era."""
    if era == "array":
        return ArrayBlockRemoved(list(block_hashes), medium, group_idx)
    return MapBlockRemoved(list(block_hashes), medium, group_idx)


def all_blocks_cleared(era: Era) -> msgspec.Struct:
    """An AllBlocksCleared event of the given era."""
    return ArrayAllBlocksCleared() if era == "array" else MapAllBlocksCleared()


def encode_batch(ts: float, events: Sequence[msgspec.Struct], dp_rank: int | None = 0) -> bytes:
    """msgpack payload of one batch, byte-identical to vLLM's publisher."""
    return _ENCODER.encode(KVEventBatch(ts, list(events), dp_rank))


def vllm_binds(endpoint: str) -> bool:
    """vLLM's rule: bind when the address is a wildcard (or ipc/inproc), else connect."""
    return (
        "*" in endpoint
        or "::" in endpoint
        or endpoint.startswith("ipc://")
        or endpoint.startswith("inproc://")
    )


def _bindable(endpoint: str) -> str:
    # zmq wants `*` for "any port"; accept the usual port 0 too.
    if endpoint.startswith("tcp://") and endpoint.endswith(":0"):
        return endpoint[:-2] + ":*"
    return endpoint


class KVEventPublisher:
    """Publishes KV-event batches on a PUB socket and serves replays on a ROUTER socket.

    Runs inside the worker's event loop: `publish` is non-blocking (a PUB socket drops
    messages at its high-water mark, as vLLM's does), the replay server is an asyncio task.
    """

    def __init__(
        self,
        endpoint: str | None,
        replay_endpoint: str | None = None,
        *,
        era: Era = "map",
        replay_layout: ReplayLayout = "topic",
        topic: str = "",
        data_parallel_rank: int = 0,
        mode: SocketMode = "auto",
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
    ) -> None:
        if era not in ("map", "array"):
            raise ValueError(f"era must be 'map' or 'array', got {era!r}")
        if replay_layout not in ("topic", "legacy"):
            raise ValueError(f"replay_layout must be 'topic' or 'legacy', got {replay_layout!r}")
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.era: Era = era
        self.replay_layout: ReplayLayout = replay_layout
        self.topic = topic.encode()
        self.dp_rank = data_parallel_rank
        self.mode: SocketMode = mode
        self.hwm = hwm
        self.bound_endpoint: str | None = None  # actual address after bind (port resolved)
        self.bound_replay_endpoint: str | None = None
        self._seq = 0
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._ctx: zmq.Context[zmq.Socket[bytes]] | None = None
        self._actx: zmq.asyncio.Context | None = None
        self._pub: zmq.Socket[bytes] | None = None
        self._router: zmq.asyncio.Socket | None = None
        self._replay_task: asyncio.Task[None] | None = None
        self.dropped = 0

    @property
    def next_seq(self) -> int:
        """Sequence number the next published batch will carry."""
        return self._seq

    async def start(self) -> None:
        """Open the sockets (bind or connect) and start the replay server."""
        if self.endpoint is not None:
            self._ctx = zmq.Context()
            pub = self._ctx.socket(zmq.PUB)
            pub.setsockopt(zmq.SNDHWM, self.hwm)
            pub.setsockopt(zmq.LINGER, 0)
            # Kept before binding: a socket that failed to bind (port taken) must still be
            # closed by stop(), or the context's term() waits for it forever.
            self._pub = pub
            bind = self.mode == "bind" or (self.mode == "auto" and vllm_binds(self.endpoint))
            if bind:
                pub.bind(_bindable(self.endpoint))
                self.bound_endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT)
            else:
                pub.connect(self.endpoint)
                self.bound_endpoint = self.endpoint
        if self.replay_endpoint is not None:
            self._actx = zmq.asyncio.Context()
            router = self._actx.socket(zmq.ROUTER)
            router.setsockopt(zmq.LINGER, 0)
            self._router = router
            router.bind(_bindable(self.replay_endpoint))
            self.bound_replay_endpoint = router.getsockopt_string(zmq.LAST_ENDPOINT)
            self._replay_task = asyncio.create_task(self._serve_replay(), name="kv-replay")

    async def stop(self) -> None:
        """Stop the replay server and close every socket and context."""
        if self._replay_task is not None:
            # cancel_and_wait: the caller's own cancellation is not swallowed (scorer.tasks).
            await cancel_and_wait(self._replay_task)
            self._replay_task = None
        for sock in (self._pub, self._router):
            if sock is not None:
                sock.close(linger=0)
        self._pub = self._router = None
        for ctx in (self._ctx, self._actx):
            if ctx is not None:
                ctx.term()
        self._ctx = self._actx = None

    def publish(self, events: Sequence[msgspec.Struct], ts: float | None = None) -> int:
        """Send one batch; returns its sequence number. Buffered for replay."""
        payload = encode_batch(time.time() if ts is None else ts, events, self.dp_rank)
        seq = self._seq
        self._seq += 1
        self._buffer.append((seq, payload))
        if self._pub is not None:
            try:
                self._pub.send_multipart(
                    [self.topic, seq.to_bytes(8, "big"), payload], flags=zmq.NOBLOCK
                )
            except zmq.Again:
                self.dropped += 1
        return seq

    async def _serve_replay(self) -> None:
        router = self._router
        assert router is not None
        while True:
            frames = await router.recv_multipart()
            try:
                identity, _empty, start_raw = frames
                start = int.from_bytes(start_raw, "big")
            except ValueError:
                log.warning("bad replay request: %d frames", len(frames))
                continue
            for seq, payload in list(self._buffer):
                if seq >= start:
                    await router.send_multipart(self._reply(identity, seq, payload, self.topic))
            # vLLM's end marker carries an empty topic frame in the 0.26+ layout.
            await router.send_multipart(self._reply(identity, None, b"", b""))

    def _reply(self, identity: bytes, seq: int | None, payload: bytes, topic: bytes) -> list[bytes]:
        seq_b = END_SEQ if seq is None else seq.to_bytes(8, "big")
        if self.replay_layout == "topic":
            return [identity, b"", topic, seq_b, payload]
        return [identity, b"", seq_b, payload]
