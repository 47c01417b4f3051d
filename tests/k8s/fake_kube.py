"""An in-process fake Kubernetes API server (aiohttp) speaking the real list/watch wire format.

What it implements is what the client library (kubernetes_asyncio) and scorer.pool.discovery
use, as the real API server does it (k8s.io/apiserver, apimachinery `metav1.ListMeta`,
`metav1.WatchEvent`, `metav1.Status`):

* `GET /api/v1/namespaces/{ns}/pods` and `GET /apis/{group}/{version}/namespaces/{ns}/{plural}`
  with `labelSelector` (equality terms), `fieldSelector` (`metadata.name=`), `limit` /
  `continue` paging, `resourceVersion`;
* `watch=true`: a chunked stream of one JSON `WatchEvent` per line (ADDED, MODIFIED, DELETED,
  BOOKMARK with `allowWatchBookmarks`, ERROR with a Status), starting after the given
  resourceVersion; a version older than the compaction point gets ERROR 410 "Expired";
  an object that stops (starts) matching the label selector is sent as DELETED (ADDED),
  like the watch cache's filtered watch; `timeoutSeconds` ends the stream;
* bearer-token auth (401 Status otherwise), as a kubeconfig `token` user sends it.

Test controls: `put` / `delete` objects, `bookmark()`, `compact()`, `end_watches()` (server
timeout), `stall_watches()` (connections stay open and go silent), `restart()` (the
process goes away and comes back on the same port, its store intact like etcd's).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import copy
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

TOKEN = "fake-token"
POOL_GROUP = "inference.networking.k8s.io"


def kubeconfig(path: Path, port: int, namespace: str = "llm") -> Path:
    """A kubeconfig for the fake server (token user, plain HTTP on loopback)."""
    path.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "fake", "cluster": {"server": f"http://127.0.0.1:{port}"}}],
                "users": [{"name": "fake", "user": {"token": TOKEN}}],
                "contexts": [
                    {
                        "name": "fake",
                        "context": {"cluster": "fake", "user": "fake", "namespace": namespace},
                    }
                ],
                "current-context": "fake",
            }
        )
    )
    return path


def _status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


def _labels_match(obj: dict[str, Any], selector: dict[str, str]) -> bool:
    labels = obj["metadata"].get("labels") or {}
    return all(labels.get(k) == v for k, v in selector.items())


def _bool(value: str | None) -> bool:
    """Go's strconv.ParseBool, as the API server parses query booleans."""
    return value in ("1", "t", "T", "true", "TRUE", "True")


def _parse_selector(text: str) -> dict[str, str]:
    out = {}
    for term in filter(None, (t.strip() for t in text.split(","))):
        k, _, v = term.partition("==") if "==" in term else term.partition("=")
        out[k] = v
    return out


@dataclass
class _Change:
    rv: int
    kind: str  # resource key, e.g. "pods" or "inference.networking.k8s.io/inferencepools"
    type: str  # ADDED, MODIFIED, DELETED
    obj: dict[str, Any]
    old: dict[str, Any] | None  # the object before (for selector transitions)


@dataclass
class _Watch:
    kind: str
    namespace: str
    labels: dict[str, str]
    name: str | None
    bookmarks: bool
    queue: asyncio.Queue[dict[str, Any] | None] = field(default_factory=asyncio.Queue)
    stalled: bool = False


class FakeKubeAPI:
    """The fake API server; `await start()`, then point a kubeconfig at `port`."""

    def __init__(self) -> None:
        self.objects: dict[str, dict[str, dict[str, Any]]] = {}  # kind → "ns/name" → obj
        self.rv = 100
        self.history: list[_Change] = []
        self.compacted = 0  # watches from below this resourceVersion get 410
        self.watches: list[_Watch] = []
        self.requests: list[str] = []  # "LIST pods", "WATCH pods rv=…" (for assertions)
        self.port = 0
        self._runner: web.AppRunner | None = None
        self._uid = 0

    # ---- server lifecycle --------------------------------------------------------------

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/api/v1/namespaces/{ns}/{plural}", self._handle_core)
        app.router.add_get("/apis/{group}/{version}/namespaces/{ns}/{plural}", self._handle_group)
        self._runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=0.1)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", self.port, reuse_address=True)
        await site.start()
        if not self.port:
            server = site._server
            assert server is not None
            self.port = server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    async def stop(self) -> None:
        for w in self.watches:
            w.queue.put_nowait(None)
        self.watches.clear()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def restart(self) -> None:
        """The API server process goes away (connections reset) and comes back."""
        await self.stop()
        await self.start()

    # ---- store -------------------------------------------------------------------------

    def _next_rv(self) -> int:
        self.rv += 1
        return self.rv

    def put(self, kind: str, obj: dict[str, Any]) -> dict[str, Any]:
        """Create or replace an object (kind "pods" or "<group>/<plural>")."""
        obj = copy.deepcopy(obj)
        meta = obj.setdefault("metadata", {})
        meta.setdefault("namespace", "llm")
        key = f"{meta['namespace']}/{meta['name']}"
        store = self.objects.setdefault(kind, {})
        old = store.get(key)
        if old is not None:
            meta["uid"] = old["metadata"]["uid"]
        elif "uid" not in meta:
            self._uid += 1
            meta["uid"] = f"uid-{self._uid}"
        meta["resourceVersion"] = str(self._next_rv())
        store[key] = obj
        self._publish(_Change(self.rv, kind, "MODIFIED" if old else "ADDED", obj, old))
        return obj

    def delete(self, kind: str, namespace: str, name: str) -> None:
        old = self.objects.get(kind, {}).pop(f"{namespace}/{name}", None)
        if old is None:
            return
        obj = copy.deepcopy(old)
        obj["metadata"]["resourceVersion"] = str(self._next_rv())
        self._publish(_Change(self.rv, kind, "DELETED", obj, old))

    def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        return self.objects.get(kind, {}).get(f"{namespace}/{name}")

    def compact(self) -> None:
        """Forget history up to now (etcd compaction): older watches get 410 Gone."""
        self.compacted = self.rv
        self.history.clear()

    def bookmark(self) -> None:
        """Send a BOOKMARK at the current resourceVersion to every watch that asked."""
        for w in self.watches:
            if w.bookmarks and not w.stalled:
                w.queue.put_nowait(self._bookmark_event(w.kind))

    def end_watches(self) -> None:
        """Every open watch ends as on its server-side timeout."""
        for w in self.watches:
            w.queue.put_nowait(None)

    def stall_watches(self) -> None:
        """Open watches stay connected and never send again (a half-open connection)."""
        for w in self.watches:
            w.stalled = True

    def open_watches(self, kind: str) -> int:
        return sum(1 for w in self.watches if w.kind == kind and not w.stalled)

    def _bookmark_event(self, kind: str) -> dict[str, Any]:
        k = "Pod" if kind == "pods" else "InferencePool"
        api = "v1" if kind == "pods" else f"{POOL_GROUP}/v1"
        return {
            "type": "BOOKMARK",
            "object": {"kind": k, "apiVersion": api, "metadata": {"resourceVersion": str(self.rv)}},
        }

    def _publish(self, ch: _Change) -> None:
        self.history.append(ch)
        for w in self.watches:
            ev = self._event_for(w, ch)
            if ev is not None and not w.stalled:
                w.queue.put_nowait(ev)

    def _visible(self, w: _Watch, obj: dict[str, Any] | None) -> bool:
        if obj is None:
            return False
        meta = obj["metadata"]
        if meta.get("namespace") != w.namespace:
            return False
        if w.name is not None and meta.get("name") != w.name:
            return False
        return _labels_match(obj, w.labels)

    def _event_for(self, w: _Watch, ch: _Change) -> dict[str, Any] | None:
        if ch.kind != w.kind:
            return None
        now = self._visible(w, ch.obj) if ch.type != "DELETED" else False
        before = self._visible(w, ch.old)
        if ch.type == "DELETED":
            return {"type": "DELETED", "object": ch.obj} if before else None
        if now and before:
            return {"type": "MODIFIED", "object": ch.obj}
        if now:
            return {"type": "ADDED", "object": ch.obj}
        if before:
            # Left the selector: the watch cache reports it as deleted (at the new version).
            return {"type": "DELETED", "object": ch.obj}
        return None

    # ---- HTTP --------------------------------------------------------------------------

    async def _handle_core(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, request.match_info["plural"])

    async def _handle_group(self, request: web.Request) -> web.StreamResponse:
        info = request.match_info
        if info["version"] != "v1":
            return web.json_response(_status(404, "NotFound", "no such version"), status=404)
        return await self._handle(request, f"{info['group']}/{info['plural']}")

    async def _handle(self, request: web.Request, kind: str) -> web.StreamResponse:
        if request.headers.get("Authorization") != f"Bearer {TOKEN}":
            return web.json_response(_status(401, "Unauthorized", "Unauthorized"), status=401)
        q = request.query
        ns = request.match_info["ns"]
        labels = _parse_selector(q.get("labelSelector", ""))
        name = None
        fs = q.get("fieldSelector", "")
        if fs:
            field_name, _, value = fs.partition("=")
            if field_name != "metadata.name":
                return web.json_response(
                    _status(400, "BadRequest", f"field label not supported: {field_name}"),
                    status=400,
                )
            name = value
        if _bool(q.get("watch")):
            return await self._watch(request, kind, ns, labels, name)
        return self._list(kind, ns, labels, name, q)

    def _matching(
        self, kind: str, ns: str, labels: dict[str, str], name: str | None
    ) -> Iterator[dict[str, Any]]:
        w = _Watch(kind, ns, labels, name, False)
        for key in sorted(self.objects.get(kind, {})):
            obj = self.objects[kind][key]
            if self._visible(w, obj):
                yield obj

    def _list(
        self, kind: str, ns: str, labels: dict[str, str], name: str | None, q: Any
    ) -> web.Response:
        self.requests.append(f"LIST {kind}")
        items = list(self._matching(kind, ns, labels, name))
        rv = self.rv
        offset = 0
        if q.get("continue"):
            token = json.loads(base64.b64decode(q["continue"]))
            if token["rv"] < self.compacted:
                return web.json_response(
                    _status(410, "Expired", "continue token expired"), status=410
                )
            offset = token["offset"]
        limit = int(q.get("limit", "0") or 0)
        page = items[offset : offset + limit] if limit else items[offset:]
        meta: dict[str, Any] = {"resourceVersion": str(rv)}
        if limit and offset + limit < len(items):
            meta["continue"] = base64.b64encode(
                json.dumps({"rv": rv, "offset": offset + limit}).encode()
            ).decode()
        list_kind = "PodList" if kind == "pods" else "InferencePoolList"
        return web.json_response(
            {"kind": list_kind, "apiVersion": "v1", "metadata": meta, "items": page}
        )

    async def _watch(
        self,
        request: web.Request,
        kind: str,
        ns: str,
        labels: dict[str, str],
        name: str | None,
    ) -> web.StreamResponse:
        q = request.query
        rv = int(q.get("resourceVersion") or 0)
        self.requests.append(f"WATCH {kind} rv={rv}")
        w = _Watch(kind, ns, labels, name, _bool(q.get("allowWatchBookmarks")))
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        if rv and rv < self.compacted:
            msg = f"too old resource version: {rv} ({self.compacted})"
            await resp.write(
                json.dumps({"type": "ERROR", "object": _status(410, "Expired", msg)}).encode()
                + b"\n"
            )
            return resp
        if rv:
            for ch in self.history:
                if ch.rv > rv:
                    ev = self._event_for(w, ch)
                    if ev is not None:
                        w.queue.put_nowait(ev)
        else:
            for obj in self._matching(kind, ns, labels, name):
                w.queue.put_nowait({"type": "ADDED", "object": obj})
        self.watches.append(w)
        timeout = float(q.get("timeoutSeconds") or 0) or None
        try:
            async with asyncio.timeout(timeout):
                while True:
                    ev = await w.queue.get()
                    if ev is None:
                        break
                    if w.stalled:
                        continue
                    await resp.write(json.dumps(ev).encode() + b"\n")
        except (TimeoutError, ConnectionResetError):
            pass
        finally:
            with contextlib.suppress(ValueError):
                self.watches.remove(w)
        return resp


# ---- objects ---------------------------------------------------------------------------


def pod(
    name: str,
    ip: str | None,
    labels: dict[str, str] | None = None,
    ready: bool = True,
    deleting: bool = False,
    namespace: str = "llm",
    annotations: dict[str, str] | None = None,
) -> dict[str, Any]:
    """A Pod as the API returns it (the fields discovery reads, plus realistic others)."""
    meta: dict[str, Any] = {
        "name": name,
        "namespace": namespace,
        "labels": dict(labels or {"app": "vllm"}),
        "creationTimestamp": "2026-11-24T00:00:00Z",
    }
    if annotations:
        meta["annotations"] = annotations
    if deleting:
        meta["deletionTimestamp"] = "2026-11-24T00:05:00Z"
        meta["deletionGracePeriodSeconds"] = 30
    status: dict[str, Any] = {
        "phase": "Running" if ip else "Pending",
        "conditions": [
            {"type": "Initialized", "status": "True"},
            {"type": "Ready", "status": "True" if ready else "False"},
            {"type": "ContainersReady", "status": "True" if ready else "False"},
            {"type": "PodScheduled", "status": "True"},
        ],
    }
    if ip:
        status["podIP"] = ip
        status["podIPs"] = [{"ip": ip}]
    return {
        "kind": "Pod",
        "apiVersion": "v1",
        "metadata": meta,
        "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai"}]},
        "status": status,
    }


def inference_pool(
    name: str,
    selector: dict[str, str],
    ports: list[int],
    namespace: str = "llm",
) -> dict[str, Any]:
    """An InferencePool v1 object."""
    return {
        "kind": "InferencePool",
        "apiVersion": f"{POOL_GROUP}/v1",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "selector": {"matchLabels": selector},
            "targetPorts": [{"number": p} for p in ports],
            "endpointPickerRef": {"name": "kv-scorer", "port": {"number": 9002}},
        },
    }


POOLS = f"{POOL_GROUP}/inferencepools"
