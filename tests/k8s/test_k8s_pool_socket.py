"""One ZMQ SUB socket for the pool (events.bind): engines connect with topic
`kv@<ip>:<port>@<model>` and the topic names the worker (real ZMQ on loopback)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest
import pytest_asyncio
from configs import make_config
from k8s_helpers import until

from kvscorer_tools.sim.kvevents import KVEventPublisher, block_stored, encode_batch
from scorer.blocks import BlockHasher
from scorer.config import EventsEndpointConfig, WorkerConfig
from scorer.events import EventIngest
from scorer.events.pool_socket import PoolEventSocket, topic_endpoint
from scorer.events.subscriber import BURST
from scorer.index import BlockIndex
from scorer.pool import Pool

BS = 16


def stored(i: int) -> list[object]:
    """One BlockStored event for block i of a fixed chain (parent = block i-1)."""
    tokens = list(range(1000 + i * BS, 1000 + (i + 1) * BS))
    return [block_stored("map", [900 + i], None if i == 0 else 900 + i - 1, tokens, BS)]


def frames(topic: str, seq: int, i: int) -> list[bytes]:
    return [topic.encode(), seq.to_bytes(8, "big"), encode_batch(1.0, stored(i))]  # type: ignore[arg-type]


@dataclass
class Rig:
    pool: Pool
    index: BlockIndex
    ingest: EventIngest
    sock: PoolEventSocket
    now: list[float]

    def blocks(self, ep: str) -> int:
        return int(self.index.stats(ep)["blocks"]["GPU"])


@pytest_asyncio.fixture
async def rig() -> AsyncIterator[Rig]:
    config = make_config(
        ["10.0.0.1:8000"],
        pool={"block_size": BS},
        events={"bind": "tcp://127.0.0.1:0", "unknown_topic_hold_s": 5.0},
    )
    pool = Pool.from_config(config)
    index = BlockIndex()
    ingest = EventIngest(config, pool, index, BlockHasher(BS))
    now = [0.0]
    sock = PoolEventSocket(config, pool, ingest, clock=lambda: now[0])
    await ingest.start()
    await sock.start()
    yield Rig(pool, index, ingest, sock, now)
    await sock.stop()
    await ingest.stop()


def test_topic_names_the_worker() -> None:
    assert topic_endpoint(b"kv@10.0.0.5:8000@Qwen/Qwen3-8B") == ("10.0.0.5:8000", True)
    assert topic_endpoint(b"kv@[fd00::1]:8000@m") == ("[fd00::1]:8000", True)
    assert topic_endpoint(b"kv@10.0.0.5@m") == ("10.0.0.5", False)
    assert topic_endpoint(b"kv@fd00::1@m") == ("[fd00::1]", False)
    for bad in (
        b"",
        b"kv@",
        b"kv@10.0.0.5:8000",
        b"xx@10.0.0.5:8000@m",
        b"kv@host:80@m",
        b"kv@\xff@m",
    ):
        assert topic_endpoint(bad) is None, bad


async def test_engines_publish_to_one_socket_over_real_zmq(rig: Rig) -> None:
    assert rig.sock.bound_endpoint is not None
    pub = KVEventPublisher(rig.sock.bound_endpoint, topic="kv@10.0.0.1:8000@m", mode="connect")
    await pub.start()
    try:
        # A connecting PUB drops messages until the subscription reaches it: publish until
        # the first one lands (bounded), then the rest arrive in order.
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 10
        while rig.blocks("10.0.0.1:8000") == 0:
            assert loop.time() < deadline
            pub.publish(stored(0))
            await asyncio.sleep(0.01)
        for i in range(1, 4):
            pub.publish(stored(i))
        await until(lambda: rig.blocks("10.0.0.1:8000") == 4)
        status = rig.ingest.status("10.0.0.1:8000")
        assert status.connected and status.last_event_at is not None
        await until(lambda: rig.sock.report()["peers"] == 1)
    finally:
        await pub.stop()


async def test_unknown_topic_is_held_until_its_worker_appears(rig: Rig) -> None:
    topic = "kv@10.0.0.2:8000@m"
    for seq in range(3):
        await rig.sock.handle(frames(topic, seq, seq))
    assert rig.sock.report()["held"] == {topic: 3}
    assert rig.blocks("10.0.0.2:8000") == 0
    rig.pool.add(WorkerConfig(endpoint="10.0.0.2:8000"), "ready")
    await until(lambda: rig.blocks("10.0.0.2:8000") == 3)
    assert rig.sock.report()["held"] == {}
    assert rig.sock.counts["applied"] == 3
    await rig.sock.handle(frames(topic, 3, 3))
    assert rig.blocks("10.0.0.2:8000") == 4
    assert rig.ingest.subscribers["10.0.0.2:8000"].stats.gaps == 0


async def test_unknown_topic_is_dropped_after_the_hold(rig: Rig) -> None:
    await rig.sock.handle(frames("kv@10.9.9.9:8000@m", 0, 0))
    rig.now[0] = 4.0
    assert rig.sock.sweep() == 0
    rig.now[0] = 5.0
    assert rig.sock.sweep() == 1
    assert rig.sock.counts["dropped_unknown"] == 1 and rig.sock.held == {}
    rig.pool.add(WorkerConfig(endpoint="10.9.9.9:8000"), "ready")
    assert rig.blocks("10.9.9.9:8000") == 0


async def test_hold_is_bounded(rig: Rig) -> None:
    ev = rig.sock.config.events
    for t in range(ev.hold_max_topics + 3):
        await rig.sock.handle(frames(f"kv@10.1.{t // 250}.{t % 250 + 1}:8000@m", 0, 0))
    assert len(rig.sock.held) == ev.hold_max_topics
    assert rig.sock.counts["dropped_hold_full"] == 3
    for seq in range(ev.hold_max_messages + 2):
        await rig.sock.handle(frames("kv@10.1.0.1:8000@m", seq + 1, 0))
    assert len(rig.sock.held["kv@10.1.0.1:8000@m"].frames) == ev.hold_max_messages


async def test_bad_topics_and_frames_are_counted_and_dropped(rig: Rig) -> None:
    await rig.sock.handle([b"kv@nonsense@", b"\x00" * 8, b""])
    await rig.sock.handle([b"kv@10.0.0.1:8000@m", b"\x00" * 8])
    assert rig.sock.counts["bad_topic"] == 2
    await rig.sock.handle([b"kv@10.0.0.1:8000@m", b"\x00" * 8, b"not msgpack"])
    assert rig.ingest.subscribers["10.0.0.1:8000"].stats.decode_errors


async def test_gap_is_replayed_from_the_pods_replay_port(rig: Rig) -> None:
    pub = KVEventPublisher(None, "tcp://127.0.0.1:0", topic="kv@10.0.0.3:8000@m")
    await pub.start()
    try:
        assert pub.bound_replay_endpoint is not None
        ev = EventsEndpointConfig(
            endpoint="pool", mode="pool", replay_endpoint=pub.bound_replay_endpoint
        )
        rig.pool.add(WorkerConfig(endpoint="10.0.0.3:8000", events=ev), "ready")
        for i in range(3):
            pub.publish(stored(i))
        buf = list(pub._buffer)
        topic = b"kv@10.0.0.3:8000@m"
        await rig.sock.handle([topic, buf[0][0].to_bytes(8, "big"), buf[0][1]])
        # seq 1 lost on the way: seq 2 reveals the gap, seq 1 comes from the replay port.
        await rig.sock.handle([topic, buf[2][0].to_bytes(8, "big"), buf[2][1]])
        sub = rig.ingest.subscribers["10.0.0.3:8000"]
        assert sub.stats.gaps == 1 and sub.stats.replays == {"ok": 1}
        assert rig.blocks("10.0.0.3:8000") == 3
        assert not sub.status.unrecovered_gap
    finally:
        await pub.stop()


async def test_removed_worker_stream_is_closed_and_purged(rig: Rig) -> None:
    topic = "kv@10.0.0.1:8000@m"
    await rig.sock.handle(frames(topic, 0, 0))
    assert rig.blocks("10.0.0.1:8000") == 1
    rig.pool.remove("10.0.0.1:8000", "not_ready")
    assert rig.blocks("10.0.0.1:8000") == 0
    assert "10.0.0.1:8000" not in rig.ingest.subscribers
    await rig.sock.handle(frames(topic, 1, 1))  # its pod is still publishing: not applied
    assert rig.blocks("10.0.0.1:8000") == 0
    assert rig.sock.report()["held"] == {topic: 1}


async def test_restarted_engine_seq_going_back_purges(rig: Rig) -> None:
    topic = "kv@10.0.0.1:8000@m"
    for seq in range(3):
        await rig.sock.handle(frames(topic, seq, seq))
    assert rig.blocks("10.0.0.1:8000") == 3
    await rig.sock.handle(frames(topic, 0, 0))  # the engine restarted: seq from 0
    assert rig.blocks("10.0.0.1:8000") == 1
    assert rig.ingest.subscribers["10.0.0.1:8000"].stats.purges == {"restart": 1}


async def _publishing(rig: Rig, *eps: str) -> list[KVEventPublisher]:
    """A connected publisher per worker, each with its block 0 applied."""
    assert rig.sock.bound_endpoint is not None
    pubs = []
    for ep in eps:
        pub = KVEventPublisher(rig.sock.bound_endpoint, topic=f"kv@{ep}@m", mode="connect")
        await pub.start()
        pubs.append(pub)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 10
        while rig.blocks(ep) == 0:  # the subscription reaches a connecting PUB late
            assert loop.time() < deadline
            pub._seq = 0
            pub.publish(stored(0))
            await asyncio.sleep(0.01)
    return pubs


@pytest.mark.parametrize("then", ["drains", "leaves"])
async def test_a_stream_behind_a_sync_stops_the_shared_reader_until_it_drains_or_leaves(
    rig: Rig, then: str
) -> None:
    w1, w2 = "10.0.0.1:8000", "10.0.0.2:8000"
    ev = EventsEndpointConfig(endpoint="pool", mode="pool")
    rig.pool.add(WorkerConfig(endpoint=w2, events=ev), "ready")
    p1, p2 = await _publishing(rig, w1, w2)
    try:
        s1 = rig.ingest.subscribers[w1]
        await s1._lock.acquire()  # what a long sync of worker 1 holds
        for i in range(1, 2 * BURST + 1):
            p1.publish(stored(i))
        # Its backlog takes BURST messages, then the reader stops: the rest wait in ZMQ
        # (bounded by its RCVHWM), not in our memory.
        await until(lambda: len(s1._backlog) == BURST)
        p2.publish(stored(1))
        for _ in range(50):
            await asyncio.sleep(0)
        assert len(s1._backlog) == BURST
        if then == "drains":
            s1._lock.release()
            await until(lambda: rig.blocks(w1) == 2 * BURST + 1)
            assert s1.stats.last_seq == {0: 2 * BURST} and s1.stats.gaps == 0
        else:
            # Worker 1 leaves while its backlog is full: the reader goes on for the others.
            rig.pool.remove(w1, "not_ready")
            s1._lock.release()
        await until(lambda: rig.blocks(w2) == 2)
    finally:
        await p1.stop()
        await p2.stop()


def test_bad_bind_address_names_the_field() -> None:
    config = make_config(events={"bind": "tcp://256.0.0.1:1"})
    pool = Pool.from_config(config)
    sock = PoolEventSocket(config, pool, EventIngest(config, pool, BlockIndex(), BlockHasher(BS)))
    with pytest.raises(RuntimeError, match=r"events\.bind"):
        asyncio.run(sock.start())
