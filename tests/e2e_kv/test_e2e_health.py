"""Dead workers through a real Envoy: ejected on evidence, the others serve, readmitted.

Two simulated vLLM workers (kvscorer_tools.sim, in process: HTTP API, prefix cache, vLLM-format
KV events over ZMQ, vLLM metrics) and a third pool entry whose port is closed (a worker
that died before the scorer started: no events, no metrics, only failed requests reveal
it). The scorer runs in process with the `kv` policy; Envoy in front is
envoy/envoy-full.yaml rendered with run-time ports. Outcomes only, no timing: which
requests failed, which worker served the rest, what /debug/pool says, what the index
still holds.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
from ports import HeldPort

from kvscorer_tools.bench.e2e import write_stub_tokenizer
from kvscorer_tools.envoyrun import EnvoyProcess
from kvscorer_tools.sim.worker import SimConfig, SimWorker
from scorer.app import App
from scorer.config import load_config
from scorer.envoyproc import render_envoy_config
from scorer.pool.health import HealthMonitor

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.envoy]

MODEL = "sim-model"
BLOCK = 16


def _sim_config(http_port: int, zmq_port: int) -> SimConfig:
    return SimConfig(
        port=http_port,
        model=MODEL,
        block_size=BLOCK,
        kv_events=f"tcp://127.0.0.1:{zmq_port}",
        kv_events_mode="bind",
        speed=50.0,
    )


def _served(sim: SimWorker) -> float:
    """Requests the simulated engine finished (its vllm:request_success counter)."""
    return sim.metrics.value("vllm:request_success_total")


@dataclass
class Stack:
    sims: list[SimWorker]
    ports: list[tuple[int, int]]  # (http, zmq) per sim, kept for a restart on the same ports
    ghost: str  # a pool entry whose port is closed
    app: App
    envoy: EnvoyProcess

    @property
    def health(self) -> HealthMonitor:
        h = self.app.health_monitor
        assert isinstance(h, HealthMonitor)
        return h


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Stack]:
    tok = write_stub_tokenizer(Path(tmp_path_factory.mktemp("tok")) / "tokenizer.json")
    # Every port stays held (bound, not listening, tests/ports.py) for the whole module:
    # the ghost's, so nothing started later takes it, e.g. an Envoy listener on port 0
    # (seen: Envoy then reached itself through the ghost and answered 502); the workers'
    # (HTTP, ZMQ), so the port of a worker a test kills is still free for its restart.
    held = [HeldPort() for _ in range(5)]
    ports = [(held[0].port, held[1].port), (held[2].port, held[3].port)]
    sims = [SimWorker(_sim_config(h, z)) for h, z in ports]
    ghost = held[4].endpoint
    started: list[SimWorker] = []
    app: App | None = None
    try:
        for s in sims:
            await s.start()
            started.append(s)
        workers: list[dict[str, Any]] = [
            {
                "endpoint": s.endpoint,
                "events": s.events_endpoint,
                "metrics_url": s.url + "/metrics",
            }
            for s in sims
        ]
        workers.append({"endpoint": ghost})
        config = load_config(
            overrides={
                "server": {
                    "host": "127.0.0.1",
                    "extproc_port": 0,
                    "health_port": 0,
                    "admin_port": 0,
                    "grace_period_s": 0.5,
                },
                "pool": {
                    "workers": workers,
                    "block_size": BLOCK,
                    "health": {"probe_interval_s": 0.1, "probe_max_interval_s": 0.5},
                },
                "tokens": {"models": {MODEL: {"tokenizer": str(tok)}}},
                "policy": "kv",
                "log_level": "warning",
            },
            environ={},
        )
        app = App(config)
        await app.start()
        # envoy/envoy-full.yaml's shape: the ghost (no metrics, no events) is only revealed
        # by the 503s Envoy answers for it, which the lean envoy.yaml does not report.
        cfg = render_envoy_config(0, app.extproc_port, 0, response_headers=True)
        async with EnvoyProcess(cfg) as envoy:
            yield Stack(sims, ports, ghost, app, envoy)
    finally:
        if app is not None:
            await app.stop()
        # `sims` holds a restarted worker in place of the one the test killed.
        for s in {id(s): s for s in [*started, *sims]}.values():
            await s.stop()
        for h in held:
            h.close()


async def _complete(stack: Stack, prompt: list[int]) -> int:
    url = f"http://127.0.0.1:{stack.envoy.listener_port}/v1/completions"
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "stream": False}
    async with aiohttp.ClientSession() as s, s.post(url, json=body) as r:
        await r.read()
        return r.status


async def _pool_view(stack: Stack) -> dict[str, dict[str, Any]]:
    url = f"http://127.0.0.1:{stack.app.admin_port}/debug/pool"
    async with aiohttp.ClientSession() as s, s.get(url) as r:
        doc = await r.json()
    return {w["endpoint"]: w for w in doc["workers"]}


def _prompt(tag: int, n_blocks: int = 4) -> list[int]:
    """Token ids of a prompt of its own (distinct per tag, inside the sim's 32k vocabulary)."""
    return [1 + tag * 64 + i for i in range(n_blocks * BLOCK)]


async def test_worker_that_never_answered_is_ejected_by_failed_requests(stack: Stack) -> None:
    """No events, no metrics: only requests that failed on it reveal the ghost. The index
    says the ghost holds a prefix (as it would for a worker that died warm), so `kv` sends
    that prefix there until the failure is seen."""
    cached = _prompt(100)
    keys = stack.app.parts.hasher.keys(cached)
    stack.app.parts.index.insert_speculative(stack.ghost, keys, ttl_s=3600)
    first = await _complete(stack, cached)
    assert first == 503  # the revealing request: Envoy could not connect
    health = stack.health
    ghost = stack.app.pool.get(stack.ghost)
    assert ghost is not None
    assert await health.wait_until(lambda: not ghost.healthy, 10)
    assert stack.ghost not in stack.app.parts.index.match(keys)
    assert [await _complete(stack, cached) for _ in range(4)] == [200] * 4
    view = await _pool_view(stack)
    assert view[stack.ghost]["health"]["reason"] == "request_failed"
    assert view[stack.ghost]["healthy"] is False
    # From now on every request is served.
    assert [await _complete(stack, _prompt(200 + i)) for i in range(6)] == [200] * 6


async def test_killed_worker_is_ejected_and_the_other_serves_then_readmitted(
    stack: Stack,
) -> None:
    warm = _prompt(7)
    assert await _complete(stack, warm) == 200
    index = stack.app.parts.index
    keys = stack.app.parts.hasher.keys(warm)
    # Wait (bounded) until the serving worker's BlockStored events reached the index.
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 10
    holders: dict[str, Any] = {}
    while loop.time() < deadline:
        holders = {ep: m for ep, m in index.match(keys).items() if m.blocks >= 4}
        if holders:
            break
        await asyncio.sleep(0.02)
    assert len(holders) == 1
    warm_ep = next(iter(holders))
    victim_i = next(i for i, s in enumerate(stack.sims) if s.endpoint == warm_ep)
    victim, survivor = stack.sims[victim_i], stack.sims[1 - victim_i]

    await victim.stop()  # its HTTP port and its KV-event socket close
    # The warm prefix would go to the victim: requests that reveal its death may fail...
    revealing = [await _complete(stack, warm) for _ in range(3)]
    assert set(revealing) <= {200, 503}
    w = stack.app.pool.get(warm_ep)
    assert w is not None
    assert await stack.health.wait_until(lambda: not w.healthy, 10)
    assert w.health.reason in ("events_dropped", "request_failed", "metrics_refused")
    assert warm_ep not in index.match(keys)  # its index entries were dropped
    assert w.inflight.requests == 0

    # ...every request after them is served by the survivor.
    before = _served(survivor)
    statuses = [await _complete(stack, warm if i % 2 else _prompt(300 + i)) for i in range(8)]
    assert statuses == [200] * 8
    assert _served(survivor) == before + 8

    # Back on the same ports: readmitted (probes with backoff), starting from an empty index.
    h, z = stack.ports[victim_i]
    revived = SimWorker(_sim_config(h, z))
    await revived.start()
    stack.sims[victim_i] = revived
    assert await stack.health.wait_until(lambda: w.healthy, 15)
    view = await _pool_view(stack)
    assert view[warm_ep]["healthy"] is True
    assert view[warm_ep]["health"]["ejections"] == 1
    assert warm_ep not in index.match(keys)
    assert await _complete(stack, _prompt(400)) == 200
