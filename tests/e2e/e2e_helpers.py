"""Small real HTTP backends (aiohttp) that say which backend answered, for e2e tests."""

from __future__ import annotations

import asyncio
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web


@dataclass
class Backend:
    name: str
    runner: web.AppRunner
    port: int
    host: str = "127.0.0.1"
    release: asyncio.Event = field(default_factory=asyncio.Event)
    seen: list[dict[str, str]] = field(default_factory=list)

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"


async def start_backend(name: str, host: str = "127.0.0.1") -> Backend:
    """An echo backend: JSON with its name, the body's size and sha256, and the headers it
    got. `/sse` streams one event, waits for `release`, then sends the last one."""
    app = web.Application(client_max_size=64 * 1024 * 1024)
    holder: dict[str, Backend] = {}

    async def echo(request: web.Request) -> web.StreamResponse:
        b = holder["b"]
        body = await request.read()
        b.seen.append(dict(request.headers))
        if request.path == "/sse":
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            await resp.write(f"data: first from {b.name}\n\n".encode())
            try:
                await asyncio.wait_for(b.release.wait(), 10)
                await resp.write(b"data: [DONE]\n\n")
            finally:
                b.release.clear()
            await resp.write_eof()
            return resp
        if request.path == "/stream":
            # A long SSE stream with known bytes (sse_events), flushed event by event.
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for ev in sse_events(int(request.query.get("n", "100")), b.name):
                await resp.write(ev)
            await resp.write_eof()
            return resp
        if request.path == "/slow":
            await asyncio.sleep(float(request.query.get("s", "1")))
        return web.json_response(
            {
                "backend": b.name,
                "path": request.path,
                "method": request.method,
                "len": len(body),
                "sha256": hashlib.sha256(body).hexdigest(),
                "destination": request.headers.get("x-gateway-destination-endpoint"),
            }
        )

    app.router.add_route("*", "/{tail:.*}", echo)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    b = Backend(name, runner, port, host)
    holder["b"] = b
    return b


def sse_events(n: int, name: str) -> list[bytes]:
    """The events `/stream?n=N` sends: N chunks of an OpenAI-style completion stream, the
    last one with `usage`, then `[DONE]` (clients compare every byte)."""
    out = []
    for i in range(n):
        chunk: dict[str, Any] = {
            "id": "s",
            "object": "text_completion",
            "choices": [{"text": f"t{i} "}],
        }
        if i == n - 1:
            chunk["usage"] = {"prompt_tokens": 5, "completion_tokens": n, "total_tokens": n + 5}
        out.append(b"data: " + json.dumps(chunk).encode() + b"\n\n")
    out.append(f"data: [DONE] {name}\n\n".encode())
    return out


SUBSET_FILTER = {
    # Stands in for a gateway that sets the subset hint: header → envoy.lb.subset_hint.
    "name": "envoy.filters.http.header_to_metadata",
    "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.header_to_metadata.v3.Config",
        "request_rules": [
            {
                "header": "x-test-subset",
                "on_header_present": {
                    "metadata_namespace": "envoy.lb.subset_hint",
                    "key": "x-gateway-destination-endpoint-subset",
                    "type": "STRING",
                },
                "remove": True,
            }
        ],
    },
}
