"""The inference extension's data-plane conformance scenarios, reproduced without
Kubernetes: kv-scorer processes as the pools' pickers, a real Envoy 1.40 shaped like each
gateway (scorer.envoyproc.render_gateway_config), real HTTP backends.

Each test names the upstream test it mirrors (gateway-api-inference-extension v1.5.0
`conformance/tests/*.go`). The endpoint picker's role is played by kv-scorer itself; the
gateway's by Envoy with the configuration the gateway generates.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import pytest
from configs import make_config
from e2e_helpers import Backend, start_backend

from kvscorer_tools.envoyrun import EnvoyProcess
from scorer.app import App
from scorer.envoyproc import GATEWAYS, GatewayPool, render_gateway_config

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.envoy]
BODY = json.dumps({"model": "m", "prompt": "Write as if you were a critic: San Francisco"})

# Each shape as its gateway generates it: response bodies FULL_DUPLEX_STREAMED, TLS to
# the picker where the gateway uses it (Envoy AI Gateway and kgateway: always).
SHAPE: dict[str, str] = {}
SELECTION = "test-epp-endpoint-selection"
SERVED = "x-conformance-test-served-endpoint"


def tls_server(gateway: str, transport: str = "asyncio") -> dict[str, Any]:
    """`server` config for a picker behind `gateway`: TLS where the gateway's default
    picker connection is TLS (self-signed, as the reference picker's default)."""
    server = make_config([]).server.model_dump()
    server["tls"] = {"enabled": gateway != "istio"}
    server["extproc_transport"] = transport
    return server


@asynccontextmanager
async def picker(name: str, endpoints: list[str], gateway: str) -> AsyncIterator[App]:
    """A kv-scorer process-alike (in this process) picking for one pool."""
    app = App(
        make_config(
            endpoints, pool={"name": name, "workers": endpoints}, server=tls_server(gateway)
        )
    )
    await app.start()
    try:
        yield app
    finally:
        await app.stop()


async def post(s: aiohttp.ClientSession, url: str, **kw: Any) -> tuple[int, str | None]:
    async with s.post(url, data=BODY, **kw) as r:
        if r.status != 200:
            return r.status, None
        return r.status, (await r.json())["backend"]


@pytest.mark.parametrize("gateway", GATEWAYS)
async def test_weighted_across_two_pools(gateway: str, backends: list[Backend]) -> None:
    """GatewayWeightedAcrossTwoInferencePools: one route, two InferencePools as weighted
    backends (70/30), each with its own picker; every request lands on an endpoint of the
    pool its weighted cluster belongs to, and the split follows the weights."""
    a, b = [x.endpoint for x in backends[:2]], [backends[2].endpoint]
    names = {x.endpoint: x.name for x in backends}
    async with picker("pool-a", a, gateway) as pa, picker("pool-b", b, gateway) as pb:
        cfg = render_gateway_config(
            gateway,  # type: ignore[arg-type]
            listener_port=0,
            admin_port=0,
            pools=[
                GatewayPool("a", a, pa.extproc_port, weight=70),
                GatewayPool("b", b, pb.extproc_port, weight=30),
            ],
            # Envoy draws the split from this header (value % total weight) instead of
            # its random generator, so the 70/30 split is exact and the test deterministic.
            weighted_random_header="x-test-split",
            **SHAPE,  # type: ignore[arg-type]
        )
        async with EnvoyProcess(cfg) as envoy, aiohttp.ClientSession() as s:
            url = f"http://127.0.0.1:{envoy.listener_port}/weighted-two-pools-test"
            hits: Counter[str] = Counter()
            for i in range(200):
                status, backend = await post(s, url, headers={"x-test-split": str(i)})
                assert status == 200
                assert backend is not None
                pool = "a" if i % 100 < 70 else "b"
                allowed = {names[e] for e in (a if pool == "a" else b)}
                assert backend in allowed, (i, backend, pool)  # no endpoint leaks across
                hits[pool] += 1
        assert hits == {"a": 140, "b": 60}
        # Each picker decided only its own pool's requests.
        assert len(pa.decisions.query(limit=1000)) == 140
        assert len(pb.decisions.query(limit=1000)) == 60


@pytest.mark.parametrize("gateway", GATEWAYS)
async def test_multiple_rules_different_pools(gateway: str, backends: list[Backend]) -> None:
    """InferencePoolMultipleRulesDifferentPools / HTTPRouteMultipleRulesDifferentPools:
    two route rules, each to its own InferencePool and picker; no cross-talk."""
    a, b = [backends[0].endpoint], [x.endpoint for x in backends[1:]]
    names = {x.endpoint: x.name for x in backends}
    async with picker("pool-a", a, gateway) as pa, picker("pool-b", b, gateway) as pb:
        cfg = render_gateway_config(
            gateway,  # type: ignore[arg-type]
            listener_port=0,
            admin_port=0,
            pools=[
                GatewayPool("a", a, pa.extproc_port, path_prefix="/a"),
                GatewayPool("b", b, pb.extproc_port, path_prefix="/b"),
            ],
            **SHAPE,  # type: ignore[arg-type]
        )
        async with EnvoyProcess(cfg) as envoy, aiohttp.ClientSession() as s:
            base = f"http://127.0.0.1:{envoy.listener_port}"
            for _ in range(4):
                assert await post(s, base + "/a/v1/completions") == (200, names[a[0]])
                status, backend = await post(s, base + "/b/v1/completions")
                assert status == 200 and backend in {names[e] for e in b}


# What each gateway shape does when its picker is unreachable and the pool says
# `failureMode: FailOpen` (failure_mode_allow: true), measured with Envoy 1.40:
# (gateway, request body mode) -> (POST with a body, GET without one).
FAIL_OPEN = {
    # Istio: the request continues without a destination; override_host falls back to
    # round robin over the pool: served.
    ("istio", "BUFFERED"): (200, 200),
    # FULL_DUPLEX_STREAMED: Envoy 1.40 does not fail open once the body is streaming to
    # the picker: a request with a body gets 500; one without a body still fails open.
    ("istio", "FULL_DUPLEX_STREAMED"): (500, 200),
    # kgateway (ORIGINAL_DST on the header): fails open into a cluster that has no
    # destination for the request: 503.
    ("kgateway", "BUFFERED"): (503, 503),
    ("kgateway", "FULL_DUPLEX_STREAMED"): (500, 503),
}


@pytest.mark.parametrize(("gateway", "body_mode"), list(FAIL_OPEN))
async def test_fail_open_when_the_picker_is_down(
    gateway: str, body_mode: str, backends: list[Backend]
) -> None:
    """EppUnAvailableFailOpen: requests succeed through the picker, then the picker goes
    away. Upstream expects 200 after that; here each shape's real outcome is asserted
    (FAIL_OPEN above; Envoy AI Gateway always fails closed, so it has no row)."""
    eps = [x.endpoint for x in backends]
    app = App(make_config(eps, server=tls_server(gateway)))
    await app.start()
    stopped = False
    try:
        cfg = render_gateway_config(
            gateway,  # type: ignore[arg-type]
            eps,
            listener_port=0,
            admin_port=0,
            extproc_port=app.extproc_port,
            failure_mode_allow=True,
            request_body_mode=body_mode,
            **SHAPE,  # type: ignore[arg-type]
        )
        async with EnvoyProcess(cfg) as envoy, aiohttp.ClientSession() as s:
            url = f"http://127.0.0.1:{envoy.listener_port}"
            assert (await post(s, url + "/v1/completions"))[0] == 200  # phase 1
            await app.stop()
            stopped = True
            got_post = (await post(s, url + "/v1/completions"))[0]
            async with s.get(url + "/v1/models") as r:
                got_get = r.status
            stats = envoy.stats("http.main.ext_proc.")
        assert (got_post, got_get) == FAIL_OPEN[(gateway, body_mode)]
        assert stats["http.main.ext_proc.failure_mode_allowed"] >= 1
    finally:
        if not stopped:
            await app.stop()


@asynccontextmanager
async def hosts(ips: list[str], ranks: int) -> AsyncIterator[list[Backend]]:
    """Backends on distinct loopback IPs, `ranks` ports each (data-parallel ranks)."""
    started: list[Backend] = []
    try:
        for i, ip in enumerate(ips):
            for r in range(ranks):
                started.append(await start_backend(f"pod{i}-rank{r}", host=ip))
        yield started
    finally:
        for b in started:
            await b.runner.cleanup()


@asynccontextmanager
async def conformance_setup(
    gateway: str, pods: list[Backend], transport: str = "asyncio"
) -> AsyncIterator[tuple[App, EnvoyProcess]]:
    eps = [b.endpoint for b in pods]
    app = App(
        make_config(
            eps,
            extproc={"test_endpoint_selection": True, "echo_served_endpoint": True},
            server=tls_server(gateway, transport),
        )
    )
    await app.start()
    try:
        cfg = render_gateway_config(
            gateway,  # type: ignore[arg-type]
            eps,
            listener_port=0,
            admin_port=0,
            extproc_port=app.extproc_port,
            **SHAPE,  # type: ignore[arg-type]
        )
        async with EnvoyProcess(cfg) as envoy:
            yield app, envoy
    finally:
        await app.stop()


IPS = ["127.0.0.2", "127.0.0.3", "127.0.0.4"]


@pytest.mark.parametrize("transport", ["asyncio", "grpcio"])
@pytest.mark.parametrize("gateway", GATEWAYS)
async def test_following_epp_routing(gateway: str, transport: str) -> None:
    """GatewayFollowingEPPRouting: with the conformance picker's selection header naming
    1, 2 or 3 pods, every request is served by one of them (and round robin reaches each);
    the served endpoint is echoed (GatewayDestinationEndpointServed) where Envoy reports it."""
    async with (
        hosts(IPS, 1) as pods,
        conformance_setup(gateway, pods, transport) as (app, envoy),
    ):
        url = f"http://127.0.0.1:{envoy.listener_port}/primary-gateway-test"
        async with aiohttp.ClientSession() as s:
            for n in (1, 2, 3):
                allowed = pods[:n]
                header = ",".join(b.host for b in allowed)
                seen: Counter[str] = Counter()
                for _ in range(12):
                    async with s.post(url, data=BODY, headers={SELECTION: header}) as r:
                        assert r.status == 200
                        name = (await r.json())["backend"]
                        echo = r.headers.get(SERVED)
                    seen[name] += 1
                    b = next(p for p in pods if p.name == name)
                    if gateway == "istio":
                        # override_host reports the host it used: echoed exactly.
                        assert echo == b.endpoint
                    else:
                        # ORIGINAL_DST reports no served endpoint; the echo says so,
                        # as the reference verifier does.
                        assert echo is not None and echo.startswith("fail: missing")
                assert set(seen) == {p.name for p in allowed}, (n, seen)
            # A selection naming no pod of the pool: nothing eligible, 503.
            async with s.post(url, data=BODY, headers={SELECTION: "10.9.9.9"}) as r:
                assert r.status == 503
    assert len(app.pool.inflight) == 0


@pytest.mark.parametrize("gateway", GATEWAYS)
async def test_following_epp_routing_with_data_parallelism(gateway: str) -> None:
    """GatewayFollowingEPPRoutingWithDataParallelism: three pods with three ranks (ports)
    each; an IP entry allows every rank of that pod, an IP:port entry one rank."""
    async with hosts(IPS, 3) as pods, conformance_setup(gateway, pods) as (_, envoy):
        by_ip: dict[str, list[Backend]] = {}
        for p in pods:
            by_ip.setdefault(p.host, []).append(p)
        r0, r1, r2 = (by_ip[ip] for ip in IPS)
        cases = [
            # (header, allowed backends)
            (IPS[1], r1),
            (f"{IPS[0]},{r2[1].endpoint}", [*r0, r2[1]]),
            (f"{IPS[0]},{r1[0].endpoint},{r1[2].endpoint},{IPS[2]}", [*r0, r1[0], r1[2], *r2]),
        ]
        url = f"http://127.0.0.1:{envoy.listener_port}/primary-gateway-dp-test"
        async with aiohttp.ClientSession() as s:
            for header, allowed in cases:
                names = {b.name for b in allowed}
                seen: set[str] = set()
                for _ in range(2 * len(allowed)):
                    status, name = await post(s, url, headers={SELECTION: header})
                    assert status == 200 and name in names, (header, name)
                    seen.add(name)
                # Round robin over the allowed ranks reaches every one of them.
                assert seen == names
