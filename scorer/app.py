"""Assemble and run the service: Config → Pool → components → Policy → Director → servers.

Servers (the inference extension's ports by default):
  9002  gRPC: envoy.service.ext_proc.v3.ExternalProcessor, scorer.v1.Scorer, grpc.health.v1
  9003  gRPC: grpc.health.v1 ("", "liveness", "readiness", the ext_proc service name)
  9090  HTTP: /metrics, /healthz, /readyz, /debug/decisions and component routes

Lifecycle: components start (in order) → servers bind → readiness SERVING once the
start-up gate opens (scorer/api/readiness.py: the pool has workers and every KV-event
stream connected or `server.readiness_events_timeout_s` passed). On SIGTERM or
SIGINT: readiness NOT_SERVING → `server.drain_delay_s` → new ext_proc streams refused,
in-flight ones get `server.grace_period_s` to finish → components stop (reverse order) →
exit 0.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import logging
import signal
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
from grpc_health.v1.health_pb2 import HealthCheckRequest
from pydantic import ValidationError

from scorer.api.admin import AdminServer, Route
from scorer.api.auth import BearerToken, GuardedScorer, TokenError
from scorer.api.health import Health
from scorer.api.inference_metrics import POOLS, observe_completion
from scorer.api.readiness import ReadinessGate
from scorer.api.score import ScorerService
from scorer.api.score import add_to_server as add_scorer
from scorer.api.v1.scorer_pb2 import ScoreRequest
from scorer.config import Config, ConfigError, load_config
from scorer.decisions import DecisionLog
from scorer.director import Director, RequestPreparer
from scorer.extproc import accesslog
from scorer.extproc.servicer import ExtProcServicer
from scorer.extproc.servicer import add_to_h2_server as add_extproc_h2
from scorer.extproc.servicer import add_to_server as add_extproc
from scorer.extproc.tls import TLS_HANDSHAKE_FAILURES, TlsMaterial
from scorer.extproc.transport import H2GrpcServer, unary
from scorer.policy.base import Policy, PolicyContext, build_policy
from scorer.policy.parts import Parts
from scorer.pool.workers import Pool

if TYPE_CHECKING:
    from scorer.events.ingest import EventIngest
    from scorer.pool.health import HealthMonitor

log = logging.getLogger("scorer.app")

# Envoy's BUFFERED mode sends up to its buffer limit in one message; full-duplex chunks are
# small. Leave room above extproc.max_body_bytes for the protobuf framing.
_MAX_MESSAGE = 80 * 1024 * 1024


def build_components(
    config: Config, pool: Pool
) -> tuple[list[Any], Parts, EventIngest, HealthMonitor]:
    """Construct the optional parts of the service.

    Returns (components, parts, the event ingest, the worker health monitor).

    A component is any object with optional `async start()`, `async stop()` and
    `routes() -> [(method, path, aiohttp handler)]`. `parts` are handed to policies
    through `PolicyContext.parts` (typed): hasher (scorer.blocks.BlockHasher), index
    (scorer.index.BlockIndex), events (scorer.events.EventIngest), tokens
    (scorer.tokens.Tokenization, also the Director's RequestPreparer), scrape. The
    health monitor (scorer.pool.health) is the app's, not a policy part.

    This is the one place where the KV parts are wired in: components start in list
    order and stop in reverse.
    """
    # Imported here so that `kv-scorer serve --policy round_robin` on a pool without KV
    # parts still starts quickly; every part is cheap to build when unused.
    from scorer.blocks import BlockHasher
    from scorer.events.ingest import EventIngest
    from scorer.index import BlockIndex
    from scorer.pool.health import HealthMonitor
    from scorer.pool.scrape import LoadScraper
    from scorer.tokens.service import NoTokenizer, Tokenization

    hasher = BlockHasher(config.pool.block_size, config.index.hash)
    index = BlockIndex(config.index)
    tokens = Tokenization(config, hasher)

    def debug_tokenize(model: str | None, body: dict[str, Any]) -> list[int] | None:
        # /debug/score with "prompt"/"messages": the same tokens the data path would use.
        try:
            return tokens.tokenize_body(model, body).token_ids
        except NoTokenizer:
            return None

    events = EventIngest(config, pool, index, hasher, tokenize=debug_tokenize)
    scraper = LoadScraper(config, pool)
    # First in the list: it starts before (and stops after) every part that reports evidence.
    health = HealthMonitor(config, pool, index)
    components: list[Any] = [health, tokens, scraper]
    if config.pool.discovery.enabled:
        from scorer.pool.discovery import PoolDiscovery

        # Last to start (after the event subscriptions exist), first to stop.
        components.append(PoolDiscovery(config, pool))
    if config.events.enabled:
        components.insert(2, events)
        if config.events.bind:
            from scorer.events.pool_socket import PoolEventSocket

            # One SUB socket for every engine of the pool (topic names the worker).
            components.insert(3, PoolEventSocket(config, pool, events))
    parts = Parts(index=index, events=events, tokens=tokens, hasher=hasher, scrape=scraper)
    return components, parts, events, health


def make_policy(config: Config, pool: Pool, parts: Parts) -> Policy:
    """Build `config.policy` (options `policies.NAME`, or a profile `profiles.NAME`);
    ConfigError names the field."""
    name = config.policy
    ctx = PolicyContext(pool=pool, config=config, parts=parts)
    try:
        return build_policy(name, ctx, config.policies.get(name))
    except ValidationError as e:
        lines = [
            f"policies.{name}.{'.'.join(str(p) for p in err['loc'])}: {err['msg']}"
            for err in e.errors()
        ]
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(lines)) from e
    except ValueError as e:
        raise ConfigError(str(e)) from e


async def _maybe_call(obj: Any, name: str) -> None:
    fn = getattr(obj, name, None)
    if fn is None:
        return
    result = fn()
    if inspect.isawaitable(result):
        await result


class App:
    """The whole service in one object: build with a Config, `await start()`, `await stop()`."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.pool = Pool.from_config(config)
        self.components, self.parts, self.events, self.health_monitor = build_components(
            config, self.pool
        )
        self.policy = make_policy(config, self.pool, self.parts)
        preparer: RequestPreparer | None = self.parts.tokens
        self.decisions = DecisionLog(config.decisions.log_size)
        self.director = Director(config, self.pool, self.policy, self.decisions, preparer)
        self.events.dry_run = self.director.dry_run
        self.health = Health()
        events = self.events
        # Components with a first sync to finish (Kubernetes discovery) hold readiness.
        syncing = [c for c in self.components if hasattr(c, "synced")]
        self.readiness = ReadinessGate(
            self.pool,
            lambda: {ep: sub.status.connected for ep, sub in events.subscribers.items()},
            config.server.readiness_events_timeout_s,
            synced=lambda: all(c.synced.is_set() for c in syncing),
        )
        self._ready_task: asyncio.Task[None] | None = None
        self.extproc = ExtProcServicer(config, self.director)
        # The lean envoy.yaml logs upstream failures here (health evidence).
        self.failure_log = accesslog.UpstreamFailureLog(self.pool)
        self.scorer = ScorerService(self.director, self.parts.hasher)
        # The inference extension's request families, once per finished request.
        self.director.completion_hooks.append(observe_completion)
        # Requests that failed on a worker are health evidence (scorer.pool.health).
        self.director.completion_hooks.append(self.health_monitor.on_completion)
        # server.auth_token_file guards Score, /metrics and /debug/* (scorer.api.auth).
        token = None
        if config.server.auth_token_file:
            try:
                token = BearerToken(config.server.auth_token_file)
            except TokenError as e:
                raise ConfigError(str(e)) from e
        self.scorer_rpc: Any = GuardedScorer(self.scorer, token) if token else self.scorer
        routes: list[Route] = []
        for c in self.components:
            if hasattr(c, "routes"):
                routes.extend(c.routes())
        s = config.server
        self.admin = AdminServer(
            s.host,
            s.admin_port,
            self.decisions,
            routes,
            token=token,
            debug_endpoints=s.debug_endpoints,
        )
        self.extproc_server: grpc.aio.Server | None = None
        self.extproc_h2: H2GrpcServer | None = None
        self.health_server: grpc.aio.Server | None = None
        self.extproc_port = s.extproc_port
        # TLS material is read (or made) here so that a bad server.tls stops start-up.
        self.tls = TlsMaterial(s.tls) if s.tls.enabled else None
        self.health_port = s.health_port
        self.admin_port = s.admin_port
        self._started: list[Any] = []

    async def start(self) -> None:
        """Start components, bind the servers, then report ready."""
        s = self.config.server
        await self.health.set_ready(False)
        for c in self.components:
            await _maybe_call(c, "start")
            self._started.append(c)
        opts = [
            ("grpc.so_reuseport", 1 if s.reuse_port else 0),
            ("grpc.max_receive_message_length", _MAX_MESSAGE),
            ("grpc.max_send_message_length", _MAX_MESSAGE),
        ]
        self.health_server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        self.health.add_to_server(self.health_server)
        if s.extproc_transport == "asyncio":
            # Our HTTP/2 server: ext_proc, Score and health Check (Watch, a server stream,
            # only on the health port).
            self.extproc_h2 = H2GrpcServer(max_message=_MAX_MESSAGE)
            add_extproc_h2(self.extproc, self.extproc_h2)
            accesslog.add_to_h2_server(self.failure_log, self.extproc_h2)
            self.extproc_h2.add_handler(
                "/scorer.v1.Scorer/Score", unary(self.scorer_rpc.Score), ScoreRequest.FromString
            )
            self.extproc_h2.add_handler(
                "/grpc.health.v1.Health/Check",
                unary(self.health.servicer.Check),
                HealthCheckRequest.FromString,
            )
            tls = self.tls
            self.extproc_port = await self.extproc_h2.start(
                s.host,
                s.extproc_port,
                s.reuse_port,
                tls=tls.ssl_context if tls is not None else None,
                on_tls_failure=lambda reason: TLS_HANDSHAKE_FAILURES.labels(reason).inc(),
            )
        else:
            self.extproc_server = grpc.aio.server(options=opts)
            add_extproc(self.extproc, self.extproc_server)
            accesslog.add_to_server(self.failure_log, self.extproc_server)
            add_scorer(self.scorer_rpc, self.extproc_server)
            self.health.add_to_server(self.extproc_server)
            addr = f"{s.host}:{s.extproc_port}"
            if self.tls is not None:
                creds = self.tls.grpc_credentials()
                self.extproc_port = self.extproc_server.add_secure_port(addr, creds)
            else:
                self.extproc_port = self.extproc_server.add_insecure_port(addr)
            await self.extproc_server.start()
        if self.tls is not None:
            await self.tls.start()
        # Plaintext always: kubelet gRPC probes do not speak TLS (as the reference picker).
        self.health_port = self.health_server.add_insecure_port(f"{s.host}:{s.health_port}")
        await self.health_server.start()
        self.admin_port = await self.admin.start()
        # Label `name` of inference_pool_*: the InferencePool followed, else pool.name.
        pool_name = self.config.pool.discovery.pool_name or self.config.pool.name
        POOLS.add(pool_name, self.pool, self.config.load.stale_after_s)
        self.readiness.start()
        if not await self._open_gate():
            self._ready_task = asyncio.create_task(self._wait_ready(), name="readiness")
        log.warning(
            "kv-scorer serving ext_proc=%s:%d health=%s:%d admin=%s:%d policy=%s workers=%d "
            "ext_proc_tls=%s loop=%s",
            s.host,
            self.extproc_port,
            s.host,
            self.health_port,
            s.host,
            self.admin_port,
            self.policy.name,
            len(self.pool),
            "off" if self.tls is None else "self-signed" if self.tls.self_signed else "on",
            running_loop_kind(),
        )

    async def _open_gate(self) -> bool:
        """Report ready when the start-up gate is open; else say why on /readyz."""
        state = self.readiness.check()
        if state.ready:
            await self.set_ready(True)
        else:
            self.admin.not_ready_reason = state.reason
        return state.ready

    async def _wait_ready(self) -> None:
        # Re-evaluated every 50 ms: the gate reads in-memory state only (pool size, the
        # subscribers' socket-monitor flags), so polling costs next to nothing.
        logged = ""
        while not await self._open_gate():
            if self.admin.not_ready_reason != logged:
                logged = self.admin.not_ready_reason
                log.warning("not ready: %s", logged)
            await asyncio.sleep(0.05)

    async def set_ready(self, ready: bool) -> None:
        self.admin.ready = ready
        if ready:
            self.admin.not_ready_reason = ""
        await self.health.set_ready(ready)

    async def stop(self) -> None:
        """Graceful stop: readiness down, drain delay, refuse new streams, let in-flight ones
        finish within the grace period, stop components, close the remaining servers."""
        s = self.config.server
        if self._ready_task is not None:
            self._ready_task.cancel()
            self._ready_task = None
        self.admin.not_ready_reason = "shutting down"
        await self.set_ready(False)
        if s.drain_delay_s > 0:
            await asyncio.sleep(s.drain_delay_s)
        self.extproc.draining = True
        # Streams only waiting for their response's end are closed with OK now; streams
        # still in their request phase get the grace period to be answered.
        released = self.extproc.release_streams()
        self.failure_log.release()
        if released:
            log.warning("released %d streams waiting for their response to end", released)
        if self.extproc_server is not None:
            await self.extproc_server.stop(s.grace_period_s)
            self.extproc_server = None
        if self.extproc_h2 is not None:
            await self.extproc_h2.stop(s.grace_period_s)
            self.extproc_h2 = None
        if self.tls is not None:
            await self.tls.stop()
        for c in reversed(self._started):
            try:
                await _maybe_call(c, "stop")
            except Exception:
                log.exception("stopping %r failed", c)
        self._started.clear()
        if self.health_server is not None:
            await self.health_server.stop(0)
            self.health_server = None
        await self.admin.stop()
        POOLS.remove(self.pool)


def loop_factory(kind: str) -> Callable[[], asyncio.AbstractEventLoop]:
    """A new-event-loop function for `server.event_loop` ("uvloop" or "asyncio")."""
    if kind == "uvloop":
        import uvloop  # imported only when selected

        return uvloop.new_event_loop
    return asyncio.new_event_loop


def running_loop_kind() -> str:
    """ "uvloop" or "asyncio": the event loop this coroutine runs on (start-up log line)."""
    module = type(asyncio.get_running_loop()).__module__
    return "uvloop" if module.startswith("uvloop") else "asyncio"


async def serve(config: Config) -> int:
    """Run until SIGTERM/SIGINT, then stop gracefully. Returns the exit code."""
    try:
        app = App(config)
    except ConfigError as e:
        print(f"kv-scorer: {e}", file=sys.stderr)
        return 2
    await app.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
        log.warning("kv-scorer shutting down (grace %.1fs)", config.server.grace_period_s)
    finally:
        await app.stop()
    log.warning("kv-scorer stopped")
    return 0


# ------------------------------------------------------------------------------ CLI


def register(subparsers: Any) -> None:
    """Add `kv-scorer serve`."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "serve",
        help="run the endpoint picker (ext_proc, health, admin)",
        description=(
            "Run the endpoint picker. Configuration: --config FILE, then KV_SCORER_* "
            "environment (e.g. KV_SCORER_SERVER__EXTPROC_PORT=9100), then these flags."
        ),
    )
    p.add_argument("--config", help="YAML configuration file (env KV_SCORER_CONFIG)")
    p.add_argument(
        "--worker",
        action="append",
        metavar="IP:PORT",
        help="a worker endpoint (repeatable; replaces pool.workers)",
    )
    k = p.add_argument_group(
        "Kubernetes discovery (pool.discovery; the reference endpoint picker's flags)"
    )
    k.add_argument("--pool-name", help="InferencePool to follow (pool.discovery.pool_name)")
    k.add_argument(
        "--pool-namespace", help="its namespace (default: env NAMESPACE, then 'default')"
    )
    k.add_argument("--pool-group", help="InferencePool API group (inference.networking.k8s.io)")
    k.add_argument(
        "--endpoint-selector",
        metavar="LABELS",
        help="standalone mode without the CRD: pods matching e.g. app=vllm",
    )
    k.add_argument(
        "--endpoint-target-ports",
        metavar="PORTS",
        help="standalone mode: comma-separated ports per pod, e.g. 8000 or 8000,8001",
    )
    k.add_argument("--kubeconfig", help="kubeconfig file (default: env KUBECONFIG, in-cluster)")
    p.add_argument("--policy", help="routing policy (round_robin, random, least_loaded, ...)")
    p.add_argument("--host", help="listen address (server.host)")
    p.add_argument("--extproc-port", type=int, help="ext_proc gRPC port (default 9002)")
    p.add_argument("--health-port", type=int, help="gRPC health port (default 9003)")
    p.add_argument("--admin-port", type=int, help="admin HTTP port (default 9090)")
    p.add_argument(
        "--secure-serving",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="TLS on the ext_proc port (server.tls.enabled; self-signed without --cert-path)",
    )
    p.add_argument(
        "--cert-path",
        metavar="DIR",
        help="directory with tls.crt and tls.key (server.tls.cert_file / key_file), "
        "as the reference picker's --cert-path",
    )
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    p.set_defaults(func=run)


def flag_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """Flags → a config overlay (only the flags given)."""
    over: dict[str, Any] = {}
    server: dict[str, Any] = {}
    for flag, key in (
        ("host", "host"),
        ("extproc_port", "extproc_port"),
        ("health_port", "health_port"),
        ("admin_port", "admin_port"),
    ):
        v = getattr(args, flag, None)
        if v is not None:
            server[key] = v
    tls: dict[str, Any] = {}
    if getattr(args, "secure_serving", None) is not None:
        tls["enabled"] = args.secure_serving
    if getattr(args, "cert_path", None):
        tls["cert_file"] = str(Path(args.cert_path) / "tls.crt")
        tls["key_file"] = str(Path(args.cert_path) / "tls.key")
    if tls:
        server["tls"] = tls
    if server:
        over["server"] = server
    if getattr(args, "worker", None):
        over["pool"] = {"workers": list(args.worker)}
    discovery: dict[str, Any] = {}
    for flag in ("pool_name", "pool_namespace", "pool_group", "endpoint_selector", "kubeconfig"):
        v = getattr(args, flag, None)
        if v is not None:
            discovery[flag] = v
    ports = getattr(args, "endpoint_target_ports", None)
    if ports is not None:
        discovery["endpoint_target_ports"] = [p.strip() for p in ports.split(",") if p.strip()]
    if discovery:
        over.setdefault("pool", {})["discovery"] = discovery
    if getattr(args, "policy", None):
        over["policy"] = args.policy
    if getattr(args, "log_level", None):
        over["log_level"] = args.log_level
    return over


def config_from_args(args: argparse.Namespace) -> Config:
    """File, then env, then flags; raises ConfigError."""
    return load_config(getattr(args, "config", None), overrides=flag_overrides(args))


def run(args: argparse.Namespace) -> int:
    """`kv-scorer serve`: exit 0 after a graceful stop, 2 on a configuration error."""
    try:
        config = config_from_args(args)
    except ConfigError as e:
        print(f"kv-scorer: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=config.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    with asyncio.Runner(loop_factory=loop_factory(config.server.event_loop)) as runner:
        return runner.run(serve(config))


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m scorer.app ...` (same as `kv-scorer serve ...`)."""
    parser = argparse.ArgumentParser(prog="kv-scorer")
    sub = parser.add_subparsers(dest="command", required=True)
    register(sub)
    args = parser.parse_args(["serve", *(sys.argv[1:] if argv is None else argv)])
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
