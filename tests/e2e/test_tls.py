"""TLS on the ext_proc port (`server.tls`), both transports.

1. In process, with real gRPC clients and raw `ssl` sockets: ALPN h2, a verified channel,
   the plaintext health port, the self-signed certificate, mTLS, certificate reload for
   new connections (open ones keep working), bad configuration naming the field, and the
   handshake timeout.
2. Through a real Envoy 1.40 with an `UpstreamTlsContext` on the ext_proc cluster: without
   validation (an empty validation context, as Envoy AI Gateway and kgateway generate it),
   validating against a CA, mTLS; a wrong certificate fails the request cleanly (fail
   closed), is counted on both sides, and the scorer still serves afterwards.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest
import pytest_asyncio
import yaml
from configs import make_config
from cryptography import x509
from cryptography.hazmat.primitives import hashes
from e2e_helpers import Backend
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tls_certs import Ca, Pem

from kvscorer_tools.envoyrun import EnvoyProcess
from scorer.api.v1 import scorer_pb2, scorer_pb2_grpc
from scorer.app import App, flag_overrides, register
from scorer.config import ConfigError
from scorer.envoyproc import render_envoy_config
from scorer.extproc.tls import TLS_HANDSHAKE_FAILURES, self_signed, server_context
from scorer.extproc.transport import H2GrpcServer

pytestmark = pytest.mark.asyncio(loop_scope="module")
TRANSPORTS = ["asyncio", "grpcio"]
UPSTREAM_TLS = "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext"
BODY = json.dumps({"model": "m", "prompt": "hi"}).encode()


@pytest.fixture(scope="module")
def ca() -> Ca:
    return Ca()


@pytest.fixture(scope="module")
def server_pem(ca: Ca) -> Pem:
    return ca.issue("localhost")


@pytest_asyncio.fixture(loop_scope="module")
async def app_factory() -> AsyncIterator[Callable[..., Awaitable[App]]]:
    """`app = await app_factory(transport, tls_options, workers)`; all stopped after."""
    started: list[App] = []

    async def make(transport: str, tls: dict[str, Any], workers: list[str] | None = None) -> App:
        cfg = make_config(
            workers or ["127.0.0.1:7001"],
            server={
                "host": "127.0.0.1",
                "extproc_port": 0,
                "health_port": 0,
                "admin_port": 0,
                "grace_period_s": 0.2,
                "extproc_transport": transport,
                "tls": {"enabled": True, **tls},
            },
        )
        app = App(cfg)
        await app.start()
        started.append(app)
        return app

    try:
        yield make
    finally:
        for a in started:
            await a.stop()


def write_pair(tmp: Path, pem: Pem, stem: str = "tls") -> dict[str, str]:
    c, k = pem.write(tmp, stem)
    return {"cert_file": str(c), "key_file": str(k)}


def replace_pair(cert_file: str, key_file: str, pem: Pem) -> None:
    """Atomic replacement, as a Secret volume update is (new inode)."""
    for path, data in ((cert_file, pem.cert), (key_file, pem.key)):
        tmp = path + ".new"
        Path(tmp).write_bytes(data)
        os.replace(tmp, path)


def handshake(
    port: int,
    *,
    ca_pem: bytes | None = None,
    client: Pem | None = None,
    tmp: Path | None = None,
) -> tuple[str | None, bytes]:
    """A raw TLS handshake offering ALPN h2: (selected ALPN, server cert DER)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.set_alpn_protocols(["h2", "http/1.1"])
    if ca_pem is None:
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    else:
        ctx.load_verify_locations(cadata=ca_pem.decode())
    if client is not None:
        assert tmp is not None
        c, k = client.write(tmp, "client")
        ctx.load_cert_chain(c, k)
    with (
        socket.create_connection(("127.0.0.1", port), timeout=10) as raw,
        ctx.wrap_socket(raw, server_hostname="localhost") as s,
    ):
        der = s.getpeercert(binary_form=True)
        assert der is not None
        return s.selected_alpn_protocol(), der


def fp(der: bytes) -> bytes:
    return x509.load_der_x509_certificate(der).fingerprint(hashes.SHA256())


def channel(port: int, ca_pem: bytes, client: Pem | None = None) -> grpc.aio.Channel:
    creds = grpc.ssl_channel_credentials(
        root_certificates=ca_pem,
        private_key=client.key if client else None,
        certificate_chain=client.cert if client else None,
    )
    return grpc.aio.secure_channel(
        f"127.0.0.1:{port}", creds, options=[("grpc.ssl_target_name_override", "localhost")]
    )


async def score_ok(ch: grpc.aio.Channel) -> None:
    r = await scorer_pb2_grpc.ScorerStub(ch).Score(scorer_pb2.ScoreRequest(model="m"), timeout=10)
    assert r.status == 200


def failures(reason: str) -> float:
    return TLS_HANDSHAKE_FAILURES.labels(reason)._value.get()  # type: ignore[attr-defined]


# ---------------------------------------------------------------- in process


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_verified_channel_alpn_h2_and_plaintext_health(
    transport: str, app_factory: Any, ca: Ca, server_pem: Pem, tmp_path: Path
) -> None:
    app = await app_factory(transport, write_pair(tmp_path, server_pem))
    alpn, der = await asyncio.to_thread(handshake, app.extproc_port, ca_pem=ca.pem)
    assert alpn == "h2" and fp(der) == server_pem.fingerprint()
    async with channel(app.extproc_port, ca.pem) as ch:
        await score_ok(ch)
    # The health port stays plaintext (kubelet gRPC probes).
    async with grpc.aio.insecure_channel(f"127.0.0.1:{app.health_port}") as hc:
        r = await health_pb2_grpc.HealthStub(hc).Check(health_pb2.HealthCheckRequest(service=""))
        assert r.status == health_pb2.HealthCheckResponse.SERVING
    # A plaintext client on the TLS port gets no service.
    async with grpc.aio.insecure_channel(f"127.0.0.1:{app.extproc_port}") as plain:
        with pytest.raises(grpc.aio.AioRpcError):
            await scorer_pb2_grpc.ScorerStub(plain).Score(
                scorer_pb2.ScoreRequest(model="m"), timeout=3
            )


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_self_signed_when_no_files(transport: str, app_factory: Any) -> None:
    app = await app_factory(transport, {})
    assert app.tls is not None and app.tls.self_signed
    alpn, der = await asyncio.to_thread(handshake, app.extproc_port)
    cert = x509.load_der_x509_certificate(der)
    assert alpn == "h2" and cert.issuer == cert.subject
    assert fp(der) == x509.load_pem_x509_certificate(app.tls.cert_pem).fingerprint(hashes.SHA256())
    # Trusting exactly that certificate, a gRPC client verifies and calls.
    creds = grpc.ssl_channel_credentials(root_certificates=app.tls.cert_pem)
    async with grpc.aio.secure_channel(
        f"127.0.0.1:{app.extproc_port}",
        creds,
        options=[("grpc.ssl_target_name_override", "kv-scorer")],
    ) as ch:
        await score_ok(ch)


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_mtls_requires_a_client_certificate_from_the_ca(
    transport: str, app_factory: Any, ca: Ca, server_pem: Pem, tmp_path: Path
) -> None:
    (tmp_path / "ca.pem").write_bytes(ca.pem)
    app = await app_factory(
        transport, {**write_pair(tmp_path, server_pem), "client_ca_file": str(tmp_path / "ca.pem")}
    )
    async with channel(app.extproc_port, ca.pem, client=ca.issue("envoy", client=True)) as ch:
        await score_ok(ch)
    before = failures("certificate")
    for client in (None, Ca("another CA").issue("envoy", client=True)):
        async with channel(app.extproc_port, ca.pem, client=client) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as ei:
                await scorer_pb2_grpc.ScorerStub(ch).Score(
                    scorer_pb2.ScoreRequest(model="m"), timeout=5
                )
            assert ei.value.code() == grpc.StatusCode.UNAVAILABLE
    if transport == "asyncio":
        assert app.extproc_h2 is not None
        assert app.extproc_h2.tls_failures.get("certificate", 0) >= 2
        assert failures("certificate") >= before + 2
    # Still serving a good client.
    async with channel(app.extproc_port, ca.pem, client=ca.issue("envoy", client=True)) as ch:
        await score_ok(ch)


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_certificate_reload_applies_to_new_connections(
    transport: str, app_factory: Any, ca: Ca, server_pem: Pem, tmp_path: Path
) -> None:
    files = write_pair(tmp_path, server_pem)
    app = await app_factory(transport, {**files, "reload_interval_s": 0.05})
    assert app.tls is not None
    _, der = await asyncio.to_thread(handshake, app.extproc_port, ca_pem=ca.pem)
    assert fp(der) == server_pem.fingerprint()
    async with channel(app.extproc_port, ca.pem) as old:
        await score_ok(old)
        # A half-done rotation (new cert, old key) is refused and the current one kept.
        rotated = ca.issue("localhost")
        Path(files["cert_file"] + ".new").write_bytes(rotated.cert)
        os.replace(files["cert_file"] + ".new", files["cert_file"])
        assert app.tls.check() is False and app.tls.generation == 0
        _, der = await asyncio.to_thread(handshake, app.extproc_port, ca_pem=ca.pem)
        assert fp(der) == server_pem.fingerprint()
        # The whole pair: the poll picks it up.
        app.tls.reloaded.clear()
        replace_pair(files["cert_file"], files["key_file"], rotated)
        await asyncio.wait_for(app.tls.reloaded.wait(), 10)
        assert app.tls.generation == 1
        _, der = await asyncio.to_thread(handshake, app.extproc_port, ca_pem=ca.pem)
        assert fp(der) == rotated.fingerprint()
        await score_ok(old)  # the connection opened before keeps working
    async with channel(app.extproc_port, ca.pem) as new:
        await score_ok(new)


async def test_bad_tls_config_stops_start_up_naming_the_field(tmp_path: Path, ca: Ca) -> None:
    good = ca.issue("localhost")
    pair = write_pair(tmp_path, good)
    (tmp_path / "garbage").write_bytes(b"not a pem\n")
    other_key = write_pair(tmp_path, Ca().issue("localhost"), "o")["key_file"]
    cases: list[tuple[dict[str, Any], str]] = [
        ({"cert_file": str(tmp_path / "missing.crt"), "key_file": pair["key_file"]}, "cert_file"),
        ({"cert_file": pair["cert_file"]}, "server.tls.key_file"),
        ({"cert_file": str(tmp_path / "garbage"), "key_file": pair["key_file"]}, "cert_file"),
        ({"cert_file": pair["cert_file"], "key_file": str(tmp_path / "garbage")}, "key_file"),
        (
            {
                "cert_file": pair["cert_file"],
                "key_file": other_key,
            },
            "server.tls.cert_file / server.tls.key_file",
        ),
        ({"client_ca_file": str(tmp_path / "garbage")}, "server.tls.client_ca_file"),
        ({"client_ca_file": str(tmp_path / "nope.pem")}, "server.tls.client_ca_file"),
    ]
    for tls, field in cases:
        with pytest.raises(ConfigError) as ei:
            App(make_config(["127.0.0.1:7001"], server={"tls": {"enabled": True, **tls}}))
        assert field in str(ei.value), (tls, str(ei.value))


async def test_cli_secure_serving_and_cert_path() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["serve", "--secure-serving", "--cert-path", "/etc/tls"])
    assert flag_overrides(args)["server"]["tls"] == {
        "enabled": True,
        "cert_file": "/etc/tls/tls.crt",
        "key_file": "/etc/tls/tls.key",
    }
    args = parser.parse_args(["serve", "--no-secure-serving"])
    assert flag_overrides(args)["server"]["tls"] == {"enabled": False}
    assert "server" not in flag_overrides(parser.parse_args(["serve"]))


async def test_tls_handshake_timeout_closes_and_counts() -> None:
    cert, key = self_signed()
    ctx = server_context(cert, key, None)
    server = H2GrpcServer(tls_handshake_timeout=0.2)
    port = await server.start("127.0.0.1", 0, tls=lambda: ctx)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        # Says nothing: the server closes it once the handshake timeout passes.
        assert await asyncio.wait_for(reader.read(), 10) == b""
        writer.close()
        assert server.tls_failures == {"timeout": 1}
    finally:
        await server.stop(0)


# ---------------------------------------------------------------- through Envoy


def tls_socket(
    *, ca_file: str | None = None, client: tuple[str, str] | None = None
) -> dict[str, Any]:
    """The ext_proc cluster's transport socket (envoy.extensions.transport_sockets.tls.v3)."""
    common: dict[str, Any] = {"validation_context": {}}  # empty: no validation (AI Gateway)
    if ca_file is not None:
        common["validation_context"] = {
            "trusted_ca": {"filename": ca_file},
            "match_typed_subject_alt_names": [
                {"san_type": "DNS", "matcher": {"exact": "localhost"}}
            ],
        }
    if client is not None:
        common["tls_certificates"] = [
            {"certificate_chain": {"filename": client[0]}, "private_key": {"filename": client[1]}}
        ]
    return {
        "name": "envoy.transport_sockets.tls",
        "typed_config": {
            "@type": UPSTREAM_TLS,
            "sni": "localhost",
            "common_tls_context": common,
        },
    }


def envoy_config(extproc_port: int, transport_socket: dict[str, Any]) -> str:
    doc = yaml.safe_load(render_envoy_config(0, extproc_port, 0))
    for c in doc["static_resources"]["clusters"]:
        if c["name"] == "kv_scorer":
            c["transport_socket"] = transport_socket
    return yaml.safe_dump(doc, sort_keys=False)


async def post(port: int) -> tuple[int, str]:
    url = f"http://127.0.0.1:{port}/v1/completions"
    async with aiohttp.ClientSession() as s, s.post(url, data=BODY) as r:
        return r.status, await r.text()


async def served(e: EnvoyProcess, n: int = 3) -> set[str]:
    seen = set()
    for _ in range(n):
        status, text = await post(e.listener_port)
        assert status == 200, text
        seen.add(json.loads(text)["backend"])
    return seen


@pytest.mark.envoy
@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_envoy_tls_without_validation_then_with_ca_then_mtls(
    transport: str,
    app_factory: Any,
    backends: list[Backend],
    ca: Ca,
    server_pem: Pem,
    tmp_path: Path,
) -> None:
    workers = [b.endpoint for b in backends]
    # 1. Self-signed scorer, Envoy without validation (Envoy AI Gateway / kgateway shape).
    app = await app_factory(transport, {}, workers)
    async with EnvoyProcess(envoy_config(app.extproc_port, tls_socket())) as e:
        assert await served(e) == {"b0", "b1", "b2"}
        stats = await asyncio.to_thread(e.stats, "cluster.kv_scorer.ssl.")
        assert stats.get("cluster.kv_scorer.ssl.handshake", 0) >= 1
    # 2. CA-issued certificate, Envoy validating chain and SAN; 3. mTLS.
    (tmp_path / "ca.pem").write_bytes(ca.pem)
    ca_file = str(tmp_path / "ca.pem")
    app = await app_factory(transport, write_pair(tmp_path, server_pem), workers)
    async with EnvoyProcess(envoy_config(app.extproc_port, tls_socket(ca_file=ca_file))) as e:
        assert len(await served(e)) == 3
    client = ca.issue("envoy", client=True).write(tmp_path, "envoy-client")
    app = await app_factory(
        transport, {**write_pair(tmp_path, server_pem), "client_ca_file": ca_file}, workers
    )
    sock = tls_socket(ca_file=ca_file, client=(str(client[0]), str(client[1])))
    async with EnvoyProcess(envoy_config(app.extproc_port, sock)) as e:
        assert len(await served(e)) == 3


@pytest.mark.envoy
@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_envoy_wrong_certificate_fails_closed_and_is_counted(
    transport: str,
    app_factory: Any,
    backends: list[Backend],
    ca: Ca,
    tmp_path: Path,
) -> None:
    workers = [b.endpoint for b in backends]
    (tmp_path / "ca.pem").write_bytes(ca.pem)
    ca_file = str(tmp_path / "ca.pem")
    # The scorer's certificate comes from a CA Envoy does not trust.
    stranger = Ca("not trusted").issue("localhost")
    app = await app_factory(transport, write_pair(tmp_path, stranger), workers)
    before = failures("certificate")
    async with EnvoyProcess(envoy_config(app.extproc_port, tls_socket(ca_file=ca_file))) as e:
        status, _ = await post(e.listener_port)
        assert status == 500  # fail closed: Envoy's local reply, no request reaches a backend
        stats = await asyncio.to_thread(e.stats, "cluster.kv_scorer.ssl.")
        assert stats["cluster.kv_scorer.ssl.fail_verify_error"] >= 1
    if transport == "asyncio":
        assert failures("certificate") > before  # Envoy's alert, seen by our handshake
    # mTLS scorer, Envoy presents no client certificate: refused, counted, still serving.
    app = await app_factory(
        transport,
        {**write_pair(tmp_path, ca.issue("localhost")), "client_ca_file": ca_file},
        workers,
    )
    before = failures("certificate")
    async with EnvoyProcess(envoy_config(app.extproc_port, tls_socket(ca_file=ca_file))) as e:
        status, _ = await post(e.listener_port)
        assert status == 500
    if transport == "asyncio":
        assert failures("certificate") > before
    client = ca.issue("envoy", client=True).write(tmp_path, "envoy-client")
    sock = tls_socket(ca_file=ca_file, client=(str(client[0]), str(client[1])))
    async with EnvoyProcess(envoy_config(app.extproc_port, sock)) as e:
        assert len(await served(e)) == 3
