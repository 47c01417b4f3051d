"""Discovery against the in-process fake API server, through the real kubernetes_asyncio
client (KUBECONFIG pointing at it): the scenarios of issue 15 with simulated time."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from configs import make_config
from fake_kube import POOLS, FakeKubeAPI, inference_pool, kubeconfig, pod
from k8s_helpers import ManualClock, until, until_advancing

from scorer.blocks import BlockHasher
from scorer.config import DiscoveryConfig
from scorer.director import Director
from scorer.events import EventIngest
from scorer.index import BlockIndex
from scorer.policy.base import PolicyContext, build_policy
from scorer.pool import Pool
from scorer.pool.discovery import PoolDiscovery, pod_endpoints, pool_spec, worker_config
from scorer.pool.workers import PoolChange
from scorer.routing import RoutingRequest

NS = "llm"


@pytest_asyncio.fixture
async def api() -> AsyncIterator[FakeKubeAPI]:
    server = FakeKubeAPI()
    await server.start()
    yield server
    await server.stop()


class Harness:
    """A Pool kept by PoolDiscovery, with every change recorded."""

    def __init__(self, api: FakeKubeAPI, tmp: Path, **discovery: Any) -> None:
        cfg = {"kubeconfig": str(kubeconfig(tmp / "kubeconfig", api.port)), **discovery}
        cfg.setdefault("pool_namespace", NS)
        if "endpoint_selector" not in cfg:
            cfg.setdefault("pool_name", "vllm")
        self.config = make_config(pool={"discovery": cfg})
        self.pool = Pool.from_config(self.config)
        self.clock = ManualClock()
        self.changes: list[tuple[str, str, str]] = []
        self.pool.subscribe(self._record)
        self.disc = PoolDiscovery(self.config, self.pool, clock=self.clock, environ={})

    def _record(self, ch: PoolChange) -> None:
        self.changes.append((ch.change, ch.worker.endpoint, ch.reason))

    def endpoints(self) -> set[str]:
        return set(self.pool.workers)

    async def wait_for(self, eps: set[str], what: str = "") -> None:
        await until(lambda: self.endpoints() == eps, what=what or f"pool == {sorted(eps)}")


@pytest_asyncio.fixture
async def harness(api: FakeKubeAPI, tmp_path: Path) -> AsyncIterator[Harness]:
    h = Harness(api, tmp_path)
    yield h
    await h.disc.stop()


def ips(n: int, base: int = 10) -> list[str]:
    return [f"10.0.{base}.{i + 1}" for i in range(n)]


def scale(api: FakeKubeAPI, n: int, base: int = 10, prefix: str = "vllm") -> set[str]:
    """Make exactly pods prefix-0..n-1 exist (Ready), delete the others; returns addresses."""
    want = {f"{prefix}-{i}": ip for i, ip in enumerate(ips(n, base))}
    for key in list(api.objects.get("pods", {})):
        name = key.split("/", 1)[1]
        if name.startswith(prefix) and name not in want:
            api.delete("pods", NS, name)
    for name, ip in want.items():
        if api.get("pods", NS, name) is None:
            api.put("pods", pod(name, ip))
    return {f"{ip}:8000" for ip in want.values()}


# ---- pure parts ------------------------------------------------------------------------


def test_pool_spec_reads_selector_and_at_most_eight_ports() -> None:
    obj = inference_pool("p", {"app": "vllm"}, list(range(8000, 8010)))
    spec = pool_spec(obj)
    assert spec.selector == {"app": "vllm"}
    assert spec.ports == tuple(range(8000, 8008))
    with pytest.raises(ValueError, match="matchLabels"):
        pool_spec(inference_pool("p", {}, [8000]))
    with pytest.raises(ValueError, match="targetPorts"):
        pool_spec(inference_pool("p", {"a": "b"}, []))


def test_pod_endpoints_one_per_port_ipv6_bracketed() -> None:
    eps = pod_endpoints(pod("a", "fd00::5"), (8000, 8001))
    assert [e.endpoint for e in eps] == ["[fd00::5]:8000", "[fd00::5]:8001"]
    assert [e.rank for e in eps] == [0, 1]


def test_worker_config_events_own_socket_or_pool_socket() -> None:
    d = DiscoveryConfig(events_replay_port=5558)
    (pe,) = pod_endpoints(pod("a", "10.0.0.7"), (8000,))
    assert worker_config(pe, d).events is None
    ev = worker_config(pe, d, "tcp://*:5557").events
    assert ev is not None and ev.mode == "pool"
    assert ev.replay_endpoint == "tcp://10.0.0.7:5558"
    # Per-pod annotations override the defaults.
    annotated = pod("b", "10.0.0.8", annotations={"kv-scorer.io/events-port": "6000"})
    (pe,) = pod_endpoints(annotated, (8000,))
    ev = worker_config(pe, d, "tcp://*:5557").events
    assert ev is not None and (ev.mode, ev.endpoint) == ("connect", "tcp://10.0.0.8:6000")


# ---- scenarios -------------------------------------------------------------------------


async def test_not_ready_until_first_sync_then_scale_2_8_1(
    api: FakeKubeAPI, harness: Harness
) -> None:
    await harness.disc.start()
    # No InferencePool yet: no workers and never synced (readiness stays NOT_SERVING).
    await until(
        lambda: harness.disc.pool_informer is not None and harness.disc.pool_informer.synced
    )
    assert not harness.disc.synced.is_set()
    assert "not found" in (harness.disc.pool_error or "")
    two = scale(api, 2)
    api.put(POOLS, inference_pool("vllm", {"app": "vllm"}, [8000]))
    await asyncio.wait_for(harness.disc.wait_synced(), 10)
    await harness.wait_for(two)
    eight = scale(api, 8)
    await harness.wait_for(eight)
    one = scale(api, 1)
    await harness.wait_for(one)
    removed = [c for c in harness.changes if c[0] == "removed"]
    assert len(removed) == 7 and {r for _, _, r in removed} == {"deleted"}
    w = harness.pool.get("10.0.10.1:8000")
    assert w is not None and w.pod == "llm/vllm-0"
    assert w.config.metrics_url == "http://10.0.10.1:8000/metrics"


async def test_rolling_restart_new_ips_and_deleting_pods_leave_first(
    api: FakeKubeAPI, harness: Harness
) -> None:
    api.put(POOLS, inference_pool("vllm", {"app": "vllm"}, [8000]))
    old = scale(api, 3)
    await harness.disc.start()
    await harness.wait_for(old)
    for i in range(3):
        # Old pod terminating (deletionTimestamp) → out at once, then gone; its successor
        # comes up with a new IP, first not Ready, then Ready.
        name = f"vllm-{i}"
        api.put("pods", pod(name, f"10.0.10.{i + 1}", deleting=True))
        await until(lambda i=i: f"10.0.10.{i + 1}:8000" not in harness.pool.workers)
        api.delete("pods", NS, name)
        api.put("pods", pod(f"vllm-new-{i}", f"10.0.20.{i + 1}", ready=False))
        api.put("pods", pod(f"vllm-new-{i}", f"10.0.20.{i + 1}", ready=True))
        await until(lambda i=i: f"10.0.20.{i + 1}:8000" in harness.pool.workers)
    await harness.wait_for({f"10.0.20.{i}:8000" for i in (1, 2, 3)})
    reasons = [r for c, _, r in harness.changes if c == "removed"]
    assert reasons == ["deleting"] * 3


@pytest.mark.slow
async def test_ip_reused_by_another_pod_is_a_new_worker_purged_first(
    api: FakeKubeAPI, harness: Harness
) -> None:
    api.put(POOLS, inference_pool("vllm", {"app": "vllm"}, [8000]))
    api.put("pods", pod("a", "10.0.0.9"))
    await harness.disc.start()
    await harness.wait_for({"10.0.0.9:8000"})
    # The real listener that follows the pool for the index and event subscriptions.
    index = BlockIndex()
    EventIngest(harness.config, harness.pool, index, BlockHasher(16))
    index.add("10.0.0.9:8000", 0, [11, 22], [1, 2])
    assert index.stats("10.0.0.9:8000")["blocks"]["GPU"] == 2
    first = harness.pool.get("10.0.0.9:8000")
    # While the API server is away, pod a is deleted and pod b gets its IP; history is
    # compacted, so the client only learns it from a re-list: same address, other uid.
    await api.stop()
    api.delete("pods", NS, "a")
    api.put("pods", pod("b", "10.0.0.9"))
    api.compact()
    await api.start()
    await until_advancing(
        harness.clock,
        lambda: (w := harness.pool.get("10.0.0.9:8000")) is not None and w is not first,
    )
    assert ("removed", "10.0.0.9:8000", "replaced") in harness.changes
    assert index.stats("10.0.0.9:8000")["blocks"]["GPU"] == 0
    w = harness.pool.get("10.0.0.9:8000")
    assert w is not None and w.pod == "llm/b" and w.inflight.requests == 0


async def test_pod_not_ready_under_load_gets_no_new_request(
    api: FakeKubeAPI, harness: Harness
) -> None:
    api.put(POOLS, inference_pool("vllm", {"app": "vllm"}, [8000]))
    eps = scale(api, 4)
    await harness.disc.start()
    await harness.wait_for(eps)
    policy = build_policy("round_robin", PolicyContext(harness.pool, harness.config, {}), None)
    director = Director(harness.config, harness.pool, policy)
    ready = set(eps)
    picked_wrong: list[str] = []
    stop = asyncio.Event()

    async def load() -> int:
        n = 0
        while not stop.is_set() and n < 1_000_000:  # bounded even when the test fails early
            d = await director.decide(RoutingRequest(request_id=f"r{n}", model="m"))
            # What is Ready by the API's latest word at the moment of the decision.
            if d.endpoints and d.endpoints[0] not in ready:
                picked_wrong.append(d.endpoints[0])
            if d.endpoints:
                harness.pool.inflight.routed(f"r{n}", d.endpoints[0], prompt_tokens=10)
            n += 1
            await asyncio.sleep(0)
        return n

    task = asyncio.create_task(load())
    await until(lambda: harness.pool.inflight.load("10.0.10.2:8000").requests > 3)
    api.put("pods", pod("vllm-1", "10.0.10.2", ready=False))
    await until(lambda: "10.0.10.2:8000" not in harness.pool.workers)
    ready.discard("10.0.10.2:8000")
    before = harness.pool.inflight.loads.get("10.0.10.2:8000")
    await until(lambda: harness.pool.inflight.load("10.0.10.3:8000").requests > 50)
    stop.set()
    assert await task > 50
    assert picked_wrong == []
    assert before is None  # its in-flight accounting was dropped with it
    assert ("removed", "10.0.10.2:8000", "not_ready") in harness.changes
    # Ready again: back in the pool, fresh.
    api.put("pods", pod("vllm-1", "10.0.10.2", ready=True))
    await harness.wait_for(eps)


@pytest.mark.slow
async def test_selector_change_relists_pods(api: FakeKubeAPI, harness: Harness) -> None:
    api.put(POOLS, inference_pool("vllm", {"app": "vllm"}, [8000]))
    blue = scale(api, 2, base=10, prefix="blue")
    for i, ip in enumerate(ips(2, base=30)):
        api.put("pods", pod(f"green-{i}", ip, labels={"app": "vllm-green"}))
    await harness.disc.start()
    await harness.wait_for(blue)
    lists_before = api.requests.count("LIST pods")
    api.put(POOLS, inference_pool("vllm", {"app": "vllm-green"}, [8000, 8001]))
    green = {f"{ip}:{p}" for ip in ips(2, base=30) for p in (8000, 8001)}
    await harness.wait_for(green)
    assert api.requests.count("LIST pods") == lists_before + 1
    assert {r for c, _, r in harness.changes if c == "removed"} == {"deselected"}
    # A pod relabelled out of the selector leaves with the same reason (filtered watch
    # sends DELETED).
    api.put("pods", pod("green-0", "10.0.30.1", labels={"app": "other"}))
    await harness.wait_for({f"10.0.30.2:{p}" for p in (8000, 8001)})
    # Fewer target ports: the dropped port's workers go.
    api.put(POOLS, inference_pool("vllm", {"app": "vllm-green"}, [8001]))
    await harness.wait_for({"10.0.30.2:8001"})
    assert harness.changes[-1] == ("removed", "10.0.30.2:8000", "port_removed")
    # The pool object deleted: every worker goes.
    api.delete(POOLS, NS, "vllm")
    await harness.wait_for(set())
    assert harness.changes[-1][2] == "pool_deleted"


@pytest.mark.slow
async def test_api_server_restart_resumes_from_resource_version(
    api: FakeKubeAPI, harness: Harness
) -> None:
    api.put(POOLS, inference_pool("vllm", {"app": "vllm"}, [8000]))
    two = scale(api, 2)
    await harness.disc.start()
    await harness.wait_for(two)
    assert api.requests.count("LIST pods") == 1
    await api.stop()
    # While it is down the client backs off (simulated time); the pool stays as it was.
    pods = harness.disc.pod_informer
    assert pods is not None
    await until_advancing(harness.clock, lambda: pods.stats.errors >= 2)
    assert harness.endpoints() == two
    three = scale(api, 3)  # changed while the server was away (etcd keeps the history)
    await api.start()
    await until_advancing(harness.clock, lambda: harness.endpoints() == three, step=5.0)
    # Resumed by watch from its resourceVersion: no second list.
    assert api.requests.count("LIST pods") == 1
    assert pods.stats.gone == 0


async def test_compacted_history_gives_410_and_a_relist(api: FakeKubeAPI, harness: Harness) -> None:
    api.put(POOLS, inference_pool("vllm", {"app": "vllm"}, [8000]))
    two = scale(api, 2)
    await harness.disc.start()
    await harness.wait_for(two)
    await api.stop()
    five = scale(api, 5)
    api.compact()
    await api.start()
    await until_advancing(harness.clock, lambda: harness.endpoints() == five, step=5.0)
    pods = harness.disc.pod_informer
    assert pods is not None and pods.stats.gone >= 1
    assert api.requests.count("LIST pods") == 2


async def test_bookmark_advances_the_resume_point(api: FakeKubeAPI, harness: Harness) -> None:
    api.put(POOLS, inference_pool("vllm", {"app": "vllm"}, [8000]))
    scale(api, 1)
    await harness.disc.start()
    await harness.wait_for({"10.0.10.1:8000"})
    await until(lambda: api.open_watches("pods") == 1)
    # Unrelated objects move the resourceVersion on; the bookmark tells the client.
    api.put("pods", pod("other", "10.9.9.9", labels={"app": "unrelated"}))
    api.bookmark()
    pods = harness.disc.pod_informer
    assert pods is not None
    await until(lambda: pods.stats.bookmarks >= 1)
    assert pods.resource_version == str(api.rv)
    rv = api.rv
    api.end_watches()  # server-side timeout: resume from the bookmark's version
    await until(lambda: f"WATCH pods rv={rv}" in api.requests)


async def test_watch_stalled_for_60s_is_restarted(api: FakeKubeAPI, harness: Harness) -> None:
    api.put(POOLS, inference_pool("vllm", {"app": "vllm"}, [8000]))
    scale(api, 2)
    await harness.disc.start()
    await harness.wait_for({"10.0.10.1:8000", "10.0.10.2:8000"})
    await until(lambda: api.open_watches("pods") == 1)
    api.stall_watches()
    four = scale(api, 4)  # never delivered on the stalled connection
    await harness.clock.advance(30)
    assert len(harness.pool) == 2
    await harness.clock.advance(31)  # 61 s of silence
    await harness.wait_for(four)
    pods = harness.disc.pod_informer
    assert pods is not None and pods.stats.stalls >= 1
    assert api.requests.count("LIST pods") == 1  # resumed, not re-listed


async def test_standalone_selector_mode_and_paging(api: FakeKubeAPI, tmp_path: Path) -> None:
    h = Harness(
        api,
        tmp_path,
        endpoint_selector="app=vllm",
        endpoint_target_ports=[8000, 8001],
        list_page_size=2,
        events_port=5557,
        events_replay_port=5558,
    )
    try:
        scale(api, 3)
        api.put("pods", pod("unready", "10.0.10.9", ready=False))
        api.put("pods", pod("pending", None))
        await h.disc.start()
        await asyncio.wait_for(h.disc.wait_synced(), 10)
        want = {f"{ip}:{p}" for ip in ips(3) for p in (8000, 8001)}
        await h.wait_for(want)
        assert api.requests.count("LIST pods") == 3  # 5 pods in pages of 2...
        w = h.pool.get("10.0.10.1:8001")
        assert w is not None and w.config.events is not None
        # ...rank 1 (second target port) → events port + 1, like vLLM's DP ranks.
        assert w.config.events.endpoint == "tcp://10.0.10.1:5558"
        assert w.config.events.replay_endpoint == "tcp://10.0.10.1:5559"
        assert w.config.events.mode == "connect"
    finally:
        await h.disc.stop()


async def test_unauthorized_backs_off_and_never_syncs(api: FakeKubeAPI, tmp_path: Path) -> None:
    h = Harness(api, tmp_path)
    cfg = (tmp_path / "kubeconfig").read_text().replace("fake-token", "wrong")
    (tmp_path / "kubeconfig").write_text(cfg)
    try:
        await h.disc.start()
        inf = h.disc.pool_informer
        assert inf is not None
        await until_advancing(h.clock, lambda: inf.stats.errors >= 3)
        assert "401" in (inf.stats.last_error or "")
        assert not h.disc.synced.is_set()
    finally:
        await h.disc.stop()
