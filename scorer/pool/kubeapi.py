"""Kubernetes API access: client configuration and one list-then-watch loop per object kind.

Uses `kubernetes_asyncio` (the community asyncio port of the official client, generated
from the same OpenAPI spec): its calls run on our event loop over aiohttp, so a slow or
unreachable API server never occupies a thread or blocks a request. Objects are kept as
the API's JSON dicts (`_preload_content=False`, `Watch(return_type="object")`): the
generated models cost far more to build than the few fields we read.

`Informer` follows client-go's reflector protocol (k8s.io/client-go/tools/cache/
reflector.go): list (paged) → watch from the list's resourceVersion with
`allowWatchBookmarks`; each event or bookmark advances the resourceVersion; a watch that
ends (server-side `timeoutSeconds`) or stalls is resumed from it; `410 Gone` (the version
was compacted away) means list again; any other error backs off exponentially.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import aiohttp
from kubernetes_asyncio import config as kube_config
from kubernetes_asyncio.client import ApiClient, Configuration
from kubernetes_asyncio.client.exceptions import ApiException
from kubernetes_asyncio.watch import Watch
from prometheus_client import Counter

from scorer.tasks import cancel_and_wait

log = logging.getLogger(__name__)

WATCH_EVENTS = Counter(
    "kv_scorer_discovery_watch_events_total",
    "Watch events from the Kubernetes API, by resource and type",
    ["resource", "type"],
)
API_ERRORS = Counter(
    "kv_scorer_discovery_api_errors_total",
    "Failed list/watch calls to the Kubernetes API, by resource and kind",
    ["resource", "kind"],
)
RELISTS = Counter(
    "kv_scorer_discovery_relists_total",
    "Full lists of a resource, by cause (start, gone, error)",
    ["resource", "cause"],
)

# Label keys and values (k8s.io/apimachinery/pkg/util/validation: qualified names, 63-char
# values); only equality-based selectors, the form InferencePool matchLabels produce.
_LABEL_KEY = re.compile(
    r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
)
_LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?$")

# A list body larger than this is parsed in a thread (a 1,000-pod list is a few MB).
_PARSE_INLINE = 256 * 1024


def parse_selector(text: str) -> dict[str, str]:
    """`app=vllm,tier==a` → {"app": "vllm", "tier": "a"}; ValueError names the bad term."""
    out: dict[str, str] = {}
    for term in text.split(","):
        term = term.strip()
        if not term:
            continue
        key, sep, value = term.partition("==") if "==" in term else term.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or "!" in key or not _LABEL_KEY.match(key) or len(key) > 317:
            raise ValueError(f"selector term {term!r}: expected key=value")
        if not _LABEL_VALUE.match(value) or len(value) > 63:
            raise ValueError(f"selector term {term!r}: invalid label value")
        out[key] = value
    if not out:
        raise ValueError("selector is empty")
    return out


def selector_string(labels: Mapping[str, str]) -> str:
    """{"app": "vllm"} → "app=vllm" (sorted, for the API's labelSelector parameter)."""
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items()))


def matches(labels: Mapping[str, str], selector: Mapping[str, str]) -> bool:
    """Equality selector match (an empty selector matches nothing: never the whole
    namespace by accident)."""
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


async def make_api_client(kubeconfig: str | None = None) -> ApiClient:
    """An ApiClient configured like every Kubernetes tool (controller-runtime's order):
    an explicit kubeconfig, else env KUBECONFIG, else the in-cluster service account
    (KUBERNETES_SERVICE_HOST), else ~/.kube/config."""
    cfg = Configuration()
    path = kubeconfig or os.environ.get("KUBECONFIG")
    if path:
        await kube_config.load_kube_config(config_file=path, client_configuration=cfg)
    elif os.environ.get("KUBERNETES_SERVICE_HOST"):
        # Re-reads the projected token file as it rotates (bound service account tokens).
        kube_config.load_incluster_config(client_configuration=cfg)  # type: ignore[no-untyped-call]
    else:
        await kube_config.load_kube_config(client_configuration=cfg)
    return ApiClient(configuration=cfg)


class Clock(Protocol):
    """Time for watch stalls and back-off; tests substitute simulated time."""

    def now(self) -> float: ...

    async def sleep(self, seconds: float) -> None: ...


class LoopClock:
    """Real time."""

    def now(self) -> float:
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


@dataclass(slots=True)
class WatchSettings:
    """Timing of one informer (from DiscoveryConfig)."""

    watch_timeout_s: int = 300
    stall_timeout_s: float = 60.0
    backoff_initial_s: float = 0.5
    backoff_max_s: float = 30.0
    page_size: int = 500


@dataclass(slots=True)
class InformerStats:
    """Counters for /debug/discovery and the tests."""

    lists: int = 0
    watches: int = 0
    events: int = 0
    bookmarks: int = 0
    gone: int = 0
    stalls: int = 0
    errors: int = 0
    last_error: str | None = None
    by_type: dict[str, int] = field(default_factory=dict)


class _Stalled(Exception):
    pass


ListFn = Callable[..., Awaitable[Any]]


class Informer:
    """Keeps `items` (object name → the API's JSON object) equal to the server's view of
    one list call's result set, and calls `on_change(name)` after every change of one
    object, `on_change(None)` after a full list."""

    def __init__(
        self,
        resource: str,
        list_fn: ListFn,
        kwargs: Mapping[str, Any],
        on_change: Callable[[str | None], None],
        settings: WatchSettings | None = None,
        clock: Clock | None = None,
    ) -> None:
        self.resource = resource
        self.list_fn = list_fn
        self.kwargs = dict(kwargs)
        self.on_change = on_change
        self.settings = settings or WatchSettings()
        self.clock = clock or LoopClock()
        self.items: dict[str, dict[str, Any]] = {}
        self.resource_version: str | None = None
        self.synced = False  # a full list has been seen (items are the server's truth)
        self.stats = InformerStats()
        self._last_activity = 0.0
        self._backoff = self.settings.backoff_initial_s
        self._logged: set[str] = set()

    # ---- the loop ----------------------------------------------------------------------

    async def run(self) -> None:
        """List, then watch forever (until cancelled); never raises otherwise."""
        cause = "start"
        while True:
            try:
                if self.resource_version is None:
                    await self._list(cause)
                await self._watch_guarded()
                cause = "error"
            except asyncio.CancelledError:
                raise
            except ApiException as e:
                if e.status == 410:
                    # The resourceVersion was compacted away: the only way back is a list.
                    self.stats.gone += 1
                    self.resource_version = None
                    cause = "gone"
                    continue
                await self._failed(f"HTTP {e.status} {e.reason}", f"http_{e.status}")
            except _Stalled:
                continue  # resume from the same resourceVersion
            except (aiohttp.ClientError, OSError, TimeoutError) as e:
                await self._failed(f"{type(e).__name__}: {e}", "connection")
            except Exception as e:  # malformed response: keep going, never die
                await self._failed(f"{type(e).__name__}: {e}", "malformed")

    async def _failed(self, message: str, kind: str) -> None:
        self.stats.errors += 1
        self.stats.last_error = message
        API_ERRORS.labels(self.resource, kind).inc()
        if kind not in self._logged:
            self._logged.add(kind)
            hint = " (RBAC: get/list/watch needed)" if kind in ("http_401", "http_403") else ""
            log.warning("%s list/watch failed: %s%s; retrying", self.resource, message, hint)
        delay = self._backoff
        self._backoff = min(self._backoff * 2, self.settings.backoff_max_s)
        await self.clock.sleep(delay)

    def _ok(self) -> None:
        self._backoff = self.settings.backoff_initial_s
        self._last_activity = self.clock.now()

    # ---- list --------------------------------------------------------------------------

    async def _list(self, cause: str) -> None:
        items: dict[str, dict[str, Any]] = {}
        token: str | None = None
        rv: str | None = None
        while True:
            kwargs: dict[str, Any] = dict(self.kwargs, limit=self.settings.page_size)
            if token:
                kwargs["_continue"] = token
            resp = await self.list_fn(**kwargs, _preload_content=False)
            try:
                body = await resp.read()
                status = resp.status
            finally:
                resp.release()
            if status != 200:
                reason = body[:200].decode("utf-8", "replace")
                raise ApiException(status=status, reason=reason)
            if len(body) > _PARSE_INLINE:
                data = await asyncio.to_thread(json.loads, body)
            else:
                data = json.loads(body)
            for obj in data.get("items") or []:
                items[obj["metadata"]["name"]] = obj
            meta = data.get("metadata") or {}
            rv = meta.get("resourceVersion")
            token = meta.get("continue") or None
            if not token:
                break
        self.items = items
        self.resource_version = rv
        self.synced = True
        self.stats.lists += 1
        RELISTS.labels(self.resource, cause).inc()
        self._ok()
        self.on_change(None)

    # ---- watch -------------------------------------------------------------------------

    async def _watch_guarded(self) -> None:
        """One watch request, restarted by the watchdog when nothing arrives for
        `stall_timeout_s` (a half-open connection looks exactly like a quiet one)."""
        self._last_activity = self.clock.now()
        task = asyncio.create_task(self._watch())
        dog = asyncio.create_task(self._watchdog(task))
        try:
            await task
        except asyncio.CancelledError:
            if dog.done() and not dog.cancelled() and dog.result():
                raise _Stalled() from None
            raise
        finally:
            await cancel_and_wait(dog)

    async def _watchdog(self, task: asyncio.Task[None]) -> bool:
        while True:
            quiet = self.clock.now() - self._last_activity
            if quiet >= self.settings.stall_timeout_s:
                self.stats.stalls += 1
                self._log_once("stall", f"{self.resource} watch silent for {quiet:.0f}s")
                task.cancel()
                return True
            await self.clock.sleep(self.settings.stall_timeout_s - quiet)

    def _log_once(self, kind: str, text: str) -> None:
        if kind not in self._logged:
            self._logged.add(kind)
            log.warning("%s; restarting it (logged once)", text)

    async def _watch(self) -> None:
        self.stats.watches += 1
        async with Watch(return_type="object") as w:
            stream = w.stream(
                self.list_fn,
                **self.kwargs,
                resource_version=self.resource_version,
                allow_watch_bookmarks=True,
                timeout_seconds=self.settings.watch_timeout_s,
            )
            async for event in stream:
                self._event(event)

    def _event(self, event: Mapping[str, Any]) -> None:
        kind = str(event.get("type", ""))
        obj = event.get("raw_object")
        if not isinstance(obj, dict):
            raise ValueError(f"watch event {kind} without an object")
        meta = obj.get("metadata") or {}
        self._ok()
        WATCH_EVENTS.labels(self.resource, kind).inc()
        self.stats.by_type[kind] = self.stats.by_type.get(kind, 0) + 1
        rv = meta.get("resourceVersion")
        if rv:
            self.resource_version = str(rv)
        if kind == "BOOKMARK":
            self.stats.bookmarks += 1
            return
        name = meta.get("name")
        if not isinstance(name, str):
            raise ValueError(f"watch event {kind} without metadata.name")
        self.stats.events += 1
        if kind in ("ADDED", "MODIFIED"):
            self.items[name] = obj
        elif kind == "DELETED":
            self.items.pop(name, None)
        else:
            return
        self.on_change(name)
