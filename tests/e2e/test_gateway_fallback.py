"""Fallback lists (`policies.NAME.fallbacks`), through a real Envoy 1.40.

An `override_host` cluster (Istio's shape, Envoy >= 1.35) takes the comma list: the first
endpoint is used, the next ones by the route's retries, and Envoy reports the host it
used in `envoy.lb/x-gateway-destination-endpoint-served`, which the scorer counts in
`kv_scorer_extproc_served_elsewhere_total` and moves its in-flight accounting to.
An ORIGINAL_DST cluster reads exactly one `ip:port`: a list is no address (503).
"""

from __future__ import annotations

import json
from collections.abc import Callable

import aiohttp
import pytest
from configs import make_config
from e2e_helpers import Backend
from prometheus_client import REGISTRY

from kvscorer_tools.envoyrun import EnvoyProcess
from scorer.app import App
from scorer.envoyproc import render_envoy_config, render_gateway_config

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.envoy]
BODY = json.dumps({"model": "m", "prompt": "hello"}).encode()


def served_elsewhere() -> float:
    return REGISTRY.get_sample_value("kv_scorer_extproc_served_elsewhere_total") or 0.0


async def test_override_host_serves_the_fallback_when_the_primary_is_down(
    backends: list[Backend], closed_port: Callable[[], int]
) -> None:
    dead = f"127.0.0.1:{closed_port()}"
    live = backends[0]
    # round_robin over [dead, live] with one fallback: every other request has the dead
    # endpoint first and the live one as its fallback.
    app = App(make_config([dead, live.endpoint], policies={"round_robin": {"fallbacks": 1}}))
    await app.start()
    try:
        cfg = render_gateway_config(
            "istio",
            [dead, live.endpoint],
            listener_port=0,
            admin_port=0,
            extproc_port=app.extproc_port,
            # Until the scorer answers streamed response bodies (issue 10 item 1).
            response_body_mode="NONE",
        )
        before = served_elsewhere()
        async with EnvoyProcess(cfg) as envoy:
            url = f"http://127.0.0.1:{envoy.listener_port}/v1/completions"
            async with aiohttp.ClientSession() as s:
                for _ in range(6):
                    async with s.post(url, data=BODY) as r:
                        assert r.status == 200, await r.text()
                        assert (await r.json())["backend"] == live.name
            stats = envoy.stats("cluster.pool.")
        decisions = app.decisions.query(limit=6)
        primaries = [d["endpoints"][0] for d in decisions]
        assert all(len(d["endpoints"]) == 2 for d in decisions)
        assert primaries.count(dead) == 3
        # Measured in the served-endpoint metric: exactly the requests whose primary was
        # down were served elsewhere (Envoy said so in envoy.lb metadata).
        assert served_elsewhere() - before == 3
        assert stats["cluster.pool.upstream_rq_retry"] >= 3
        assert len(app.pool.inflight) == 0
        assert app.pool.inflight.loads[live.endpoint].routed_total >= 6
    finally:
        await app.stop()


async def test_original_dst_takes_exactly_one_endpoint(backends: list[Backend]) -> None:
    """The local envoy/envoy.yaml shape (ORIGINAL_DST on envoy.lb): a comma list is not
    an address, so a non-zero `fallbacks` makes every request fail. This is why fallbacks
    default to 0 and the docs reserve lists for override_host clusters."""
    eps = [b.endpoint for b in backends[:2]]
    app = App(make_config(eps, policies={"round_robin": {"fallbacks": 1}}))
    await app.start()
    try:
        cfg = render_envoy_config(0, app.extproc_port, 0)
        async with EnvoyProcess(cfg) as envoy:
            url = f"http://127.0.0.1:{envoy.listener_port}/v1/completions"
            async with aiohttp.ClientSession() as s, s.post(url, data=BODY) as r:
                assert r.status == 503
    finally:
        await app.stop()
