"""Workers discovered from Kubernetes: an InferencePool's Ready pods, one worker per port.

Two sources, the reference picker's (gateway-api-inference-extension v1.5.0
`cmd/epp/runner/runner.go`, `pkg/epp/controller/pod_reconciler.go`):

* `pool.discovery.pool_name` (`--pool-name`): watch that InferencePool
  (`inference.networking.k8s.io/v1`, `spec.selector.matchLabels`, `spec.targetPorts`, up
  to 8) and the pods its selector matches; a selector change re-lists the pods.
* `pool.discovery.endpoint_selector` + `endpoint_target_ports` (`--endpoint-selector
  app=vllm --endpoint-target-ports 8000`): the same without the CRD.

A pod contributes `podIP:port` for every target port while it is Ready, has an IP and is
not being deleted. Each change of the watched objects reconciles the Pool (scorer.pool
.workers): workers that left are removed with the reason (not_ready, deleting, deleted,
deselected, port_removed, pool_deleted), an address now owned by another pod (same IP,
new uid) is replaced, i.e. purged before it is added again. Everything runs in background
tasks on the event loop; the request path only ever reads the Pool.

`synced` is set after the first full sync (the pool object and its pods listed); the app
reports NOT_SERVING until then.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from scorer.config import Config, DiscoveryConfig, EventsEndpointConfig, WorkerConfig
from scorer.pool.kubeapi import (
    Clock,
    Informer,
    LoopClock,
    WatchSettings,
    make_api_client,
    matches,
    parse_selector,
    selector_string,
)
from scorer.pool.workers import Pool
from scorer.tasks import cancel_and_wait

log = logging.getLogger(__name__)

# Per-pod overrides of the discovery defaults (our convention; documented in the README).
EVENTS_PORT_ANNOTATION = "kv-scorer.io/events-port"
REPLAY_PORT_ANNOTATION = "kv-scorer.io/events-replay-port"
MAX_TARGET_PORTS = 8  # InferencePool v1 `targetPorts` maxItems

Handler = Callable[[web.Request], Any]


@dataclass(frozen=True, slots=True)
class PoolSpec:
    """What the pool object says: which pods and which ports."""

    selector: dict[str, str]
    ports: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class PodEndpoint:
    """One routable address and the pod that owns it."""

    endpoint: str
    host: str  # IP as it goes in a URL (IPv6 in brackets)
    port: int
    rank: int  # index of the port in targetPorts (data-parallel rank)
    pod: str  # namespace/name
    uid: str
    annotations: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True, slots=True)
class PodView:
    """A pod as discovery needs it: "ok" or why not, its uid, its endpoints (when ok)."""

    state: str
    uid: str
    endpoints: tuple[PodEndpoint, ...]
    resource_version: str | None = None


def pool_spec(obj: Mapping[str, Any]) -> PoolSpec:
    """Selector and target ports of an InferencePool v1 object (ValueError if unusable)."""
    spec = obj.get("spec") or {}
    sel = (spec.get("selector") or {}).get("matchLabels") or {}
    if not isinstance(sel, dict) or not sel:
        raise ValueError("spec.selector.matchLabels is empty")
    ports: list[int] = []
    for p in spec.get("targetPorts") or []:
        n = p.get("number") if isinstance(p, dict) else None
        if not isinstance(n, int) or not 0 < n < 65536:
            raise ValueError(f"spec.targetPorts: bad port {p!r}")
        if n not in ports:
            ports.append(n)
    if not ports:
        raise ValueError("spec.targetPorts is empty")
    return PoolSpec({str(k): str(v) for k, v in sel.items()}, tuple(ports[:MAX_TARGET_PORTS]))


def pod_ready(pod: Mapping[str, Any]) -> bool:
    """Condition Ready is True (kubelet: all containers ready and readiness gates met)."""
    for c in (pod.get("status") or {}).get("conditions") or []:
        if isinstance(c, dict) and c.get("type") == "Ready":
            return c.get("status") == "True"
    return False


def pod_state(pod: Mapping[str, Any], selector: Mapping[str, str]) -> str:
    """ "ok", or why the pod serves nothing: deleting, deselected, not_ready."""
    meta = pod.get("metadata") or {}
    if meta.get("deletionTimestamp"):
        return "deleting"
    if not matches(meta.get("labels") or {}, selector):
        return "deselected"
    if not pod_ready(pod) or not (pod.get("status") or {}).get("podIP"):
        return "not_ready"
    return "ok"


def pod_endpoints(pod: Mapping[str, Any], ports: tuple[int, ...]) -> list[PodEndpoint]:
    """`podIP:port` for each target port (call only for pods in state "ok")."""
    meta = pod.get("metadata") or {}
    ip = str((pod.get("status") or {}).get("podIP"))
    host = f"[{ip}]" if ":" in ip else ip
    name = f"{meta.get('namespace', '')}/{meta.get('name', '')}"
    ann = tuple(sorted((str(k), str(v)) for k, v in (meta.get("annotations") or {}).items()))
    return [
        PodEndpoint(f"{host}:{port}", host, port, rank, name, str(meta.get("uid", "")), ann)
        for rank, port in enumerate(ports)
    ]


def _port_annotation(pe: PodEndpoint, key: str) -> int | None:
    raw = dict(pe.annotations).get(key)
    if raw is None:
        return None
    try:
        port = int(raw)
    except ValueError:
        return None
    return port if 0 < port < 65536 else None


def worker_config(
    pe: PodEndpoint, d: DiscoveryConfig, pool_socket: str | None = None
) -> WorkerConfig:
    """The WorkerConfig of a discovered address: metrics URL and KV events, either its own
    publisher (connect mode, `events_port`) or the pool socket (`events.bind`, topic
    `kv@ip:port@model`), with replay from `events_replay_port`. Ports count up by the
    target port's rank (vLLM offsets its publisher ports by the data-parallel rank)."""
    metrics_port = d.metrics_port or pe.port
    events = None
    ev_port = _port_annotation(pe, EVENTS_PORT_ANNOTATION) or d.events_port
    replay_port = _port_annotation(pe, REPLAY_PORT_ANNOTATION) or d.events_replay_port
    replay = None if replay_port is None else f"tcp://{pe.host}:{replay_port + pe.rank}"
    if ev_port is not None:
        events = EventsEndpointConfig(
            endpoint=f"tcp://{pe.host}:{ev_port + pe.rank}", mode="connect", replay_endpoint=replay
        )
    elif pool_socket:
        events = EventsEndpointConfig(endpoint=pool_socket, mode="pool", replay_endpoint=replay)
    return WorkerConfig(
        endpoint=pe.endpoint,
        metrics_url=f"http://{pe.host}:{metrics_port}{d.metrics_path}",
        events=events,
        models=list(d.models),
    )


class PoolDiscovery:
    """App component: follows the pool in Kubernetes and keeps `Pool` equal to it."""

    def __init__(
        self,
        config: Config,
        pool: Pool,
        clock: Clock | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        self.config = config
        self.d = config.pool.discovery
        self.pool = pool
        self.clock = clock or LoopClock()
        self.namespace = self.d.namespace(environ)
        self.settings = WatchSettings(
            watch_timeout_s=self.d.watch_timeout_s,
            stall_timeout_s=self.d.stall_timeout_s,
            backoff_initial_s=self.d.backoff_initial_s,
            backoff_max_s=self.d.backoff_max_s,
            page_size=self.d.list_page_size,
        )
        self.synced = asyncio.Event()
        self.spec: PoolSpec | None = None
        if self.d.endpoint_selector:
            self.spec = PoolSpec(
                parse_selector(self.d.endpoint_selector), tuple(self.d.endpoint_target_ports)
            )
        self.pool_error: str | None = None
        self.pool_informer: Informer | None = None
        self.pod_informer: Informer | None = None
        self._pod_task: asyncio.Task[None] | None = None
        self._views: dict[str, PodView] = {}  # pod name → what it contributes
        self._by_pod: dict[str, set[str]] = {}  # pod name → its endpoints in the pool
        self._tasks: list[asyncio.Task[None]] = []
        self._api: Any = None
        self.reconciles = 0

    # ---- lifecycle ---------------------------------------------------------------------

    async def start(self) -> None:
        """Build the API client (kubeconfig / service account) and start watching."""
        from kubernetes_asyncio.client import CoreV1Api, CustomObjectsApi

        self._api = await make_api_client(self.d.kubeconfig)
        self._core = CoreV1Api(self._api)
        self._custom = CustomObjectsApi(self._api)
        if self.d.pool_name:
            list_fn = functools.partial(
                self._custom.list_namespaced_custom_object,
                self.d.pool_group,
                "v1",
                self.namespace,
                "inferencepools",
            )
            self.pool_informer = Informer(
                "inferencepools",
                list_fn,
                {"field_selector": f"metadata.name={self.d.pool_name}"},
                self._pool_changed,
                self.settings,
                self.clock,
            )
            self._tasks.append(asyncio.create_task(self.pool_informer.run(), name="watch pool"))
        else:
            self._start_pods()
        log.warning(
            "discovery: %s in namespace %s",
            f"InferencePool {self.d.pool_group}/{self.d.pool_name}"
            if self.d.pool_name
            else f"pods {self.d.endpoint_selector} ports {self.d.endpoint_target_ports}",
            self.namespace,
        )

    async def stop(self) -> None:
        await cancel_and_wait(*self._tasks, *([self._pod_task] if self._pod_task else []))
        self._tasks.clear()
        self._pod_task = None
        if self._api is not None:
            await self._api.close()
            self._api = None

    async def wait_synced(self) -> None:
        """Return once the first full sync is done (readiness waits on this)."""
        await self.synced.wait()

    # ---- the pool object ---------------------------------------------------------------

    def _pool_changed(self, _name: str | None = None) -> None:
        assert self.pool_informer is not None
        obj = self.pool_informer.items.get(self.d.pool_name or "")
        if obj is None:
            self.pool_error = f"InferencePool {self.namespace}/{self.d.pool_name} not found"
            if self.spec is not None or self.pool_informer.synced:
                log.warning("discovery: %s; removing its workers", self.pool_error)
            self.spec = None
            self._stop_pods()
            self._views = {}
            self._reconcile_all(pool_gone=True)
            return
        try:
            spec = pool_spec(obj)
        except ValueError as e:
            self.pool_error = f"InferencePool {self.namespace}/{self.d.pool_name}: {e}"
            log.warning("discovery: %s; keeping the last good spec", self.pool_error)
            return
        self.pool_error = None
        old, self.spec = self.spec, spec
        if old == spec:
            return
        # Judge the pods we know by the new spec now (pods the new selector no longer
        # matches leave as "deselected", dropped ports as "port_removed") ...
        known = self.pod_informer.items if self.pod_informer is not None else {}
        self._rebuild_views(known, fresh=True)
        if old is None or old.selector != spec.selector:
            # ... and list again: a new selector is a new result set (the informer's
            # resourceVersion belongs to the old query).
            self._start_pods()
        if known or old is not None:
            self._reconcile_all()

    # ---- pods --------------------------------------------------------------------------

    def _start_pods(self) -> None:
        assert self.spec is not None
        self._stop_pods()
        list_fn = functools.partial(self._core.list_namespaced_pod, self.namespace)
        informer: Informer | None = None

        def changed(name: str | None) -> None:
            if informer is self.pod_informer:  # a replaced informer's late news is void
                self._pods_changed(name)

        informer = Informer(
            "pods",
            list_fn,
            {"label_selector": selector_string(self.spec.selector)},
            changed,
            self.settings,
            self.clock,
        )
        self.pod_informer = informer
        self._pod_task = asyncio.create_task(informer.run(), name="watch pods")

    def _stop_pods(self) -> None:
        if self._pod_task is not None:
            self._pod_task.cancel()
            self._pod_task = None
        self.pod_informer = None

    # ---- reconcile ---------------------------------------------------------------------
    # Each pod is read once per change into a PodView; a pod event reconciles that pod only
    # (O(its ports)); a list, a new selector or new ports reconcile everything from views.

    def _view(self, pod: Mapping[str, Any]) -> PodView:
        assert self.spec is not None
        state = pod_state(pod, self.spec.selector)
        uid = str((pod.get("metadata") or {}).get("uid", ""))
        eps = tuple(pod_endpoints(pod, self.spec.ports)) if state == "ok" else ()
        rv = (pod.get("metadata") or {}).get("resourceVersion")
        return PodView(state, uid, eps, None if rv is None else str(rv))

    def _rebuild_views(self, pods: Mapping[str, Mapping[str, Any]], fresh: bool = False) -> None:
        """Views of `pods`; a pod whose resourceVersion is unchanged keeps its view (a re-list
        after 410 Gone re-reads only what changed) unless `fresh` (a new spec)."""
        old = {} if fresh else self._views
        views: dict[str, PodView] = {}
        for name, pod in pods.items():
            v = old.get(name)
            rv = (pod.get("metadata") or {}).get("resourceVersion")
            if v is None or v.resource_version is None or v.resource_version != str(rv):
                v = self._view(pod)
            views[name] = v
        self._views = views

    def _pods_changed(self, name: str | None) -> None:
        informer = self.pod_informer
        if informer is None or self.spec is None:
            return
        if name is None:  # a full list: the server's truth
            self._rebuild_views(informer.items)
            self._reconcile_all()
            return
        pod = informer.items.get(name)
        if pod is None:
            self._views.pop(name, None)
        else:
            self._views[name] = self._view(pod)
        self._reconcile_pod(name)

    def desired(self) -> dict[str, PodEndpoint]:
        """Every routable address the current objects describe."""
        return {
            pe.endpoint: pe for v in self._views.values() if v.state == "ok" for pe in v.endpoints
        }

    def _why_gone(self, pod_name: str, endpoint: str) -> str:
        """Why a worker's address left the desired set."""
        if self.spec is None:
            return "pool_deleted"
        v = self._views.get(pod_name)
        if v is None:
            return "deleted"
        if v.state != "ok":
            return v.state
        port = int(endpoint.rsplit(":", 1)[1])
        return "port_removed" if port not in self.spec.ports else "replaced"

    def _add(self, pod_name: str, pe: PodEndpoint) -> None:
        w = self.pool.get(pe.endpoint)
        if w is not None:
            if w.pod_uid == pe.uid:
                self._by_pod.setdefault(pod_name, set()).add(pe.endpoint)
                return
            # Same address, another pod (IP reuse): purge, then add as new.
            self.pool.remove(pe.endpoint, "replaced")
            if w.pod:
                self._by_pod.get(w.pod.split("/", 1)[-1], set()).discard(pe.endpoint)
        wc = worker_config(pe, self.d, self.config.events.bind)
        self.pool.add(wc, "ready", pod=pe.pod, pod_uid=pe.uid)
        self._by_pod.setdefault(pod_name, set()).add(pe.endpoint)

    def _reconcile_pod(self, name: str) -> None:
        self.reconciles += 1
        v = self._views.get(name)
        want = {pe.endpoint: pe for pe in v.endpoints} if v is not None else {}
        had = self._by_pod.get(name, set())
        for ep in [e for e in had if e not in want]:
            had.discard(ep)
            w = self.pool.get(ep)
            if w is not None and w.pod == f"{self.namespace}/{name}":
                self.pool.remove(ep, self._why_gone(name, ep))
        for pe in want.values():
            self._add(name, pe)
        if not self._by_pod.get(name):
            self._by_pod.pop(name, None)

    def _reconcile_all(self, pool_gone: bool = False) -> None:
        self.reconciles += 1
        want = self.desired()
        for w in list(self.pool):
            pe = want.get(w.endpoint)
            if pe is None or pe.uid != w.pod_uid:
                owner = (w.pod or "").split("/", 1)[-1]
                reason = "replaced" if pe is not None else self._why_gone(owner, w.endpoint)
                self.pool.remove(w.endpoint, reason)
        self._by_pod = {}
        for name, v in self._views.items():
            for pe in v.endpoints:
                self._add(name, pe)
        informer = self.pod_informer
        if not pool_gone and not self.synced.is_set() and informer is not None and informer.synced:
            self.synced.set()
            log.warning("discovery: first sync done, %d workers", len(self.pool))

    # ---- admin -------------------------------------------------------------------------

    def routes(self) -> list[tuple[str, str, Handler]]:
        """`GET /debug/discovery`: what is watched, its state, and the workers found."""
        return [("GET", "/debug/discovery", self._debug)]

    def report(self) -> dict[str, Any]:
        """JSON-ready state of the watches."""

        def informer(i: Informer | None) -> dict[str, Any] | None:
            if i is None:
                return None
            s = i.stats
            return {
                "synced": i.synced,
                "resource_version": i.resource_version,
                "objects": len(i.items),
                "lists": s.lists,
                "watches": s.watches,
                "events": s.events,
                "bookmarks": s.bookmarks,
                "gone": s.gone,
                "stalls": s.stalls,
                "errors": s.errors,
                "last_error": s.last_error,
            }

        return {
            "namespace": self.namespace,
            "pool": self.d.pool_name,
            "selector": None if self.spec is None else self.spec.selector,
            "target_ports": None if self.spec is None else list(self.spec.ports),
            "synced": self.synced.is_set(),
            "pool_error": self.pool_error,
            "pool_watch": informer(self.pool_informer),
            "pod_watch": informer(self.pod_informer),
            "workers": {w.endpoint: w.pod for w in self.pool},
        }

    async def _debug(self, request: web.Request) -> web.Response:
        return web.json_response(self.report())
