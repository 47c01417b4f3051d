"""Admin HTTP (aiohttp): /metrics, /healthz, /readyz, /debug/decisions, component routes."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest

from scorer.api.auth import BearerToken, admin_middleware
from scorer.decisions import DecisionLog
from scorer.errors import json_error

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Route = tuple[str, str, Handler]


class AdminServer:
    """The admin HTTP server. `ready` drives /readyz (503 while starting or draining)."""

    def __init__(
        self,
        host: str,
        port: int,
        decisions: DecisionLog,
        extra_routes: Iterable[Route] = (),
        token: BearerToken | None = None,
        debug_endpoints: bool = True,
    ) -> None:
        self.host = host
        self.port = port
        self.decisions = decisions
        self.ready = False
        # Why /readyz answers 503 (the start-up gate's reason, or "shutting down").
        self.not_ready_reason = "starting"
        # server.auth_token_file: /metrics and /debug/* need the bearer token.
        self.app = web.Application(middlewares=[admin_middleware(token)] if token else [])
        self.app.router.add_get("/metrics", self.metrics)
        self.app.router.add_get("/healthz", self.healthz)
        self.app.router.add_get("/readyz", self.readyz)
        routes: list[Route] = [("GET", "/debug/decisions", self.debug_decisions)]
        routes.extend(extra_routes)
        for method, path, handler in routes:
            # server.debug_endpoints: false leaves every /debug/* route out (404).
            if debug_endpoints or not path.startswith("/debug/"):
                self.app.router.add_route(method, path, handler)
        self._runner: web.AppRunner | None = None

    async def start(self) -> int:
        """Bind and serve; returns the bound port (useful with port 0)."""
        self._runner = web.AppRunner(self.app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        # aiohttp has no public accessor for the bound socket (port 0 → real port).
        sockets = getattr(site._server, "sockets", None)
        if sockets:
            self.port = int(sockets[0].getsockname()[1])
        return self.port

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def metrics(self, request: web.Request) -> web.Response:
        body = generate_latest(REGISTRY)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def healthz(self, request: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    async def readyz(self, request: web.Request) -> web.Response:
        if self.ready:
            return web.Response(text="ready\n")
        return web.Response(status=503, text=f"not ready: {self.not_ready_reason}\n")

    async def debug_decisions(self, request: web.Request) -> web.Response:
        """`?limit=&model=&endpoint=&reason=`: newest first."""
        q = request.query
        try:
            limit = int(q.get("limit", "100"))
        except ValueError:
            return json_error(400, "limit must be an integer", param="limit")
        items = self.decisions.query(
            limit=max(0, min(limit, 10_000)),
            model=q.get("model"),
            endpoint=q.get("endpoint"),
            reason=q.get("reason"),
        )
        return web.json_response({"decisions": items, "count": len(items)})
