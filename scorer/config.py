"""One typed configuration: YAML file, then `KV_SCORER_*` environment, then CLI flags.

Validated at start-up; an error names the field (`pool.workers.0.endpoint: ...`) and stops
the process. Every field's default is documented in the README's configuration reference.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

ENV_PREFIX = "KV_SCORER_"


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TlsConfig(Strict):
    """TLS on the ext_proc port (both transports; ALPN h2). The health port stays plaintext
    (kubelet gRPC probes do not speak TLS), as the reference picker's."""

    # Off: plaintext h2c. On without cert_file/key_file: a self-signed certificate is made
    # at start-up (the reference picker's --secure-serving without --cert-path).
    enabled: bool = False
    cert_file: str | None = None  # PEM chain; re-read when it changes (cert-manager)
    key_file: str | None = Field(None, validate_default=True)  # PEM key, re-read with cert_file
    # PEM CA bundle: clients must present a certificate it signed (mTLS).
    client_ca_file: str | None = None
    # How often cert_file / key_file are checked for a change; new connections get the
    # new certificate, open ones keep theirs.
    reload_interval_s: float = Field(5.0, gt=0)

    @field_validator("key_file", mode="after")
    @classmethod
    def _pair(cls, v: str | None, info: ValidationInfo) -> str | None:
        if (v is None) != (info.data.get("cert_file") is None):
            raise ValueError("cert_file and key_file are set together (or neither)")
        return v


class ServerConfig(Strict):
    """Listening addresses (the inference extension's ports by default)."""

    host: str = "0.0.0.0"
    extproc_port: int = Field(9002, ge=0, le=65535)
    health_port: int = Field(9003, ge=0, le=65535)
    admin_port: int = Field(9090, ge=0, le=65535)
    # Seconds in-flight ext_proc streams get to finish after SIGTERM.
    grace_period_s: float = Field(10.0, ge=0)
    # Seconds readiness reports NOT_SERVING before the servers stop accepting streams.
    drain_delay_s: float = Field(0.0, ge=0)
    # Set SO_REUSEPORT on the ext_proc port so several `kv-scorer serve` processes share
    # it (each keeps its own in-flight view and index; see docs/envoy.md).
    reuse_port: bool = False
    # ext_proc port server: "asyncio" (our HTTP/2 gRPC server, scorer/extproc/transport/:
    # 2-3x less CPU per stream) or "grpcio" (grpc.aio). Both serve ext_proc, scorer.v1
    # Score and health Check there; health Watch only on the health port with "asyncio".
    extproc_transport: Literal["asyncio", "grpcio"] = "asyncio"
    # Event loop the whole process runs on: "uvloop" (libuv; about half the CPU per socket
    # wake-up of asyncio's, bench/bench_loop_floor.py) or "asyncio" (the standard library's).
    event_loop: Literal["asyncio", "uvloop"] = "uvloop"
    tls: TlsConfig = Field(default_factory=TlsConfig)
    # Readiness (gRPC health "", "readiness", "inference-extension", the ext_proc name;
    # /readyz) waits at start-up until the pool has a worker and every KV-event stream
    # has connected, or this many seconds have passed since the servers bound (then it
    # reports ready with the streams still connecting). Keep it below the liveness
    # probe's budget: the reference charts probe "inference-extension" for liveness too.
    readiness_events_timeout_s: float = Field(10.0, ge=0)
    # A file holding a bearer token: when set, /metrics, /debug/* and scorer.v1 Score need
    # `Authorization: Bearer <token>` (re-read when the file changes). Off by default.
    auth_token_file: str | None = None
    # false: no /debug/* routes on the admin server (404).
    debug_endpoints: bool = True


class ExtProcConfig(Strict):
    """Envoy data-path behaviour."""

    # Keep the stream open for response headers and end of stream (in-flight accounting).
    # Off: answer at end of request and close the stream (cheaper; least_loaded then
    # only sees scraped load).
    track_responses: bool = True
    # Add x-kv-scorer-reason / x-kv-scorer-matched-tokens request headers to the backend.
    decision_headers: bool = False
    # Largest request body read (bytes); bigger bodies get 413 in the OpenAI error shape.
    max_body_bytes: int = Field(64 * 1024 * 1024, ge=1024)
    # Request header that marks a request sheddable (value "true"/"1") for 429 on busy_all.
    sheddable_header: str = "x-kv-scorer-sheddable"
    # Conformance test devices (scorer/extproc/conformance.py), never for real traffic:
    # restrict picks to the request header `test-epp-endpoint-selection` (IP or IP:port
    # list), and echo the endpoint Envoy served as `x-conformance-test-served-endpoint`.
    test_endpoint_selection: bool = False
    echo_served_endpoint: bool = False


class EventsEndpointConfig(Strict):
    """A worker's ZMQ KV-event publisher (vLLM `--kv-events-config`)."""

    endpoint: str  # tcp://host:port
    # connect: we connect to the engine's bound PUB (vLLM `tcp://*:PORT`);
    # bind: we bind and the engine connects (vLLM `tcp://host:PORT`);
    # pool: the engine publishes to the pool socket (`events.bind`) with topic
    # `kv@<ip>:<port>@<model>`; `endpoint` is then unused, `replay_endpoint` still applies.
    mode: Literal["connect", "bind", "pool"] = "connect"
    replay_endpoint: str | None = None  # vLLM `replay_endpoint` (ROUTER)
    topic: str = ""


class WorkerConfig(Strict):
    """One model server."""

    endpoint: str  # ip:port Envoy connects to
    events: EventsEndpointConfig | None = None
    metrics_url: str | None = None  # http://ip:port/metrics
    models: list[str] = Field(default_factory=list)  # empty: whatever the pool serves

    @field_validator("endpoint")
    @classmethod
    def _endpoint(cls, v: str) -> str:
        from scorer.pool.workers import normalize_endpoint

        return normalize_endpoint(v)

    @field_validator("events", mode="before")
    @classmethod
    def _events_str(cls, v: Any) -> Any:
        return {"endpoint": v} if isinstance(v, str) else v


class DiscoveryConfig(Strict):
    """Workers from the Kubernetes API (scorer.pool.discovery): an InferencePool's pods, or
    pods matching a label selector (standalone). The reference picker's flags, same names."""

    # InferencePool to follow (--pool-name). Set this or endpoint_selector, not both.
    pool_name: str | None = None
    # Namespace of the pool and its pods (--pool-namespace); None: env NAMESPACE, then
    # "default" (gateway-api-inference-extension cmd/epp/runner/runner.go).
    pool_namespace: str | None = None
    pool_group: str = "inference.networking.k8s.io"
    # Standalone mode without the CRD: "app=vllm,tier=a" and the ports to route to.
    endpoint_selector: str | None = None
    endpoint_target_ports: list[int] = Field(default_factory=list, max_length=8)
    # KUBECONFIG file; None: env KUBECONFIG, then the in-cluster service account, then
    # ~/.kube/config (controller-runtime's order).
    kubeconfig: str | None = None
    # Scrape http://podIP:<metrics_port or the target port><metrics_path> per worker.
    metrics_path: str = "/metrics"
    metrics_port: int | None = Field(None, ge=1, le=65535)
    # Per-worker KV events in connect mode: tcp://podIP:<events_port>; replay (vLLM
    # replay_endpoint) on tcp://podIP:<events_replay_port>. Port annotations on the pod
    # (kv-scorer.io/events-port, kv-scorer.io/events-replay-port) override these. Leave
    # events_port unset when the pods publish to the pool socket (events.bind).
    events_port: int | None = Field(None, ge=1, le=65535)
    events_replay_port: int | None = Field(None, ge=1, le=65535)
    # Models each discovered worker serves (empty: whatever the pool serves).
    models: list[str] = Field(default_factory=list)
    # Watch hygiene: server-side timeout of one watch request; a watch that delivers
    # nothing (not even a bookmark) for stall_timeout_s is restarted from its
    # resourceVersion; API errors back off exponentially from backoff_initial_s.
    watch_timeout_s: int = Field(300, ge=1)
    stall_timeout_s: float = Field(60.0, gt=0)
    backoff_initial_s: float = Field(0.5, gt=0)
    backoff_max_s: float = Field(30.0, gt=0)
    list_page_size: int = Field(500, ge=1)

    @field_validator("endpoint_target_ports")
    @classmethod
    def _ports(cls, v: list[int]) -> list[int]:
        for p in v:
            if not 0 < p < 65536:
                raise ValueError(f"port {p} out of range 1..65535")
        if len(set(v)) != len(v):
            raise ValueError("ports must be unique")
        return v

    @field_validator("endpoint_selector")
    @classmethod
    def _selector(cls, v: str | None) -> str | None:
        if v is not None:
            from scorer.pool.kubeapi import parse_selector

            parse_selector(v)
        return v

    @property
    def enabled(self) -> bool:
        return bool(self.pool_name or self.endpoint_selector)

    def namespace(self, environ: Mapping[str, str] | None = None) -> str:
        """pool_namespace, else env NAMESPACE, else "default"."""
        env = os.environ if environ is None else environ
        return self.pool_namespace or env.get("NAMESPACE") or "default"


class HealthConfig(Strict):
    """Worker health from evidence (scorer.pool.health): ejection and readmission."""

    # Off: workers are never ejected (every worker is always eligible).
    enabled: bool = True
    # Confirmation probe: a TCP connect to the worker's endpoint ("tcp"), or an HTTP GET of
    # `probe_path` on it that must answer 2xx ("http"). Never on the request path.
    probe: Literal["tcp", "http"] = "tcp"
    probe_path: str = "/health"
    probe_timeout_s: float = Field(1.0, gt=0)
    # Backoff of the probes of an ejected worker: first interval, doubled up to the max.
    probe_interval_s: float = Field(0.5, gt=0)
    probe_max_interval_s: float = Field(10.0, gt=0)


class PoolConfig(Strict):
    """The worker pool: a static list, or discovered from Kubernetes (pool.discovery)."""

    # The InferencePool's name: label `name` of the inference_pool_* metrics.
    name: str = Field("default", min_length=1)
    workers: list[WorkerConfig] = Field(default_factory=list)
    discovery: DiscoveryConfig = Field(default_factory=DiscoveryConfig)
    # Models served by the pool. Empty: accept any model name and let the workers answer.
    models: list[str] = Field(default_factory=list)
    # Engine block size in tokens; events and vllm:cache_config_info must agree.
    block_size: int = Field(16, ge=1, le=4096)
    health: HealthConfig = Field(default_factory=HealthConfig)

    @field_validator("workers", mode="before")
    @classmethod
    def _workers_str(cls, v: Any) -> Any:
        if isinstance(v, list):
            return [{"endpoint": w} if isinstance(w, str) else w for w in v]
        return v

    @model_validator(mode="after")
    def _one_source(self) -> PoolConfig:
        d = self.discovery
        if d.pool_name and d.endpoint_selector:
            raise ValueError("discovery: set pool_name or endpoint_selector, not both")
        if d.endpoint_selector and not d.endpoint_target_ports:
            raise ValueError("discovery: endpoint_selector needs endpoint_target_ports")
        if d.enabled and self.workers:
            raise ValueError("discovery: pool.workers must be empty when discovery is on")
        return self


class EventsConfig(Strict):
    """KV-event ingestion (scorer.events)."""

    enabled: bool = True
    # A stream with no event for this long while its worker serves requests is "stale".
    stale_after_s: float = Field(30.0, gt=0)
    replay_timeout_s: float = Field(1.0, gt=0)
    reconnect_interval_s: float = Field(0.5, gt=0)
    # Bounds per publisher (a hostile or broken publisher costs bounded memory and CPU).
    # ZMQ MAXMSGSIZE of the SUB and replay sockets: a larger frame disconnects the peer
    # before it is buffered (ZMQ reconnects; the gap is replayed).
    max_message_bytes: int = Field(16 * 1024 * 1024, ge=1024)
    # dp ranks one worker may announce; messages of further ranks are dropped (counted).
    max_ranks_per_worker: int = Field(256, ge=1)
    # Block hashes in one BlockStored/BlockRemoved event (1M tokens at block size 16 is
    # 65,536); a larger event is dropped (counted).
    max_blocks_per_event: int = Field(65_536, ge=1)
    # Events per second per worker (token bucket, one second of burst); messages past it
    # are dropped (counted).
    max_events_per_s: float = Field(200_000.0, gt=0)
    # A subscriber task that fails is restarted after this backoff (doubling up to 30 s).
    restart_backoff_s: float = Field(0.1, gt=0)
    # One SUB socket for the whole pool (llm-d's convention): every engine connects to it
    # and names itself in its topic `kv@<ip>:<port>@<model>` (scorer.events.pool_socket).
    # Empty: only per-worker sockets (pool.workers[].events or discovery.events_port).
    bind: str | None = None
    # Events from a topic that names no known worker are held this long (the pod may be
    # discovered a moment later), at most hold_max_messages per topic, then dropped.
    unknown_topic_hold_s: float = Field(5.0, ge=0)
    hold_max_messages: int = Field(256, ge=0)
    hold_max_topics: int = Field(64, ge=0)
    hold_max_bytes: int = Field(16 * 1024 * 1024, ge=0)


class IndexConfig(Strict):
    """The block index (scorer.index) and the hash space (scorer.blocks)."""

    hash: Literal["xxh3", "fnv1a"] = "xxh3"
    # Weight of a cached block by medium (vllm-router v0.13's defaults; unknown = GPU).
    medium_weights: dict[str, float] = Field(
        default_factory=lambda: {"GPU": 1.0, "CPU": 0.3, "DISK": 0.05}
    )
    speculative_ttl_s: float = Field(2.0, ge=0)
    # Cap on a speculative entry's life once the wait for its prefill is added (a long
    # prompt behind a queue is stored step by step, seconds later; scorer.index.speculative).
    speculative_ttl_max_s: float = Field(30.0, ge=0)
    max_blocks_per_worker: int = Field(2_000_000, ge=1)

    @model_validator(mode="after")
    def _ttl_max(self) -> IndexConfig:
        if self.speculative_ttl_max_s < self.speculative_ttl_s:
            raise ValueError(
                f"speculative_ttl_max_s ({self.speculative_ttl_max_s}) is below "
                f"speculative_ttl_s ({self.speculative_ttl_s})"
            )
        return self


class TokenizerModelConfig(Strict):
    tokenizer: str  # tokenizer.json, or a directory (also the HF cache layout)
    chat_template: str | None = None  # file overriding the tokenizer's template


class TokensConfig(Strict):
    """Tokenizers per model (scorer.tokens). Never the network."""

    models: dict[str, TokenizerModelConfig] = Field(default_factory=dict)
    # A model without a tokenizer: "error" stops start-up (for models in pool.models),
    # "load" routes its requests by load with reason no_tokenizer.
    on_missing: Literal["error", "load"] = "load"
    threads: int = Field(2, ge=1, le=64)
    segment_cache_bytes: int = Field(64 * 1024 * 1024, ge=0)
    # Map LoRA adapter names to their base model (they share its tokenizer).
    lora_base: dict[str, str] = Field(default_factory=dict)
    # A body's `chat_template` is code from the client: ignored (the model's template is
    # used, counted) unless allowed, like vLLM's --trust-request-chat-template. When
    # allowed it renders in the thread pool within a time and an output budget.
    allow_request_chat_template: bool = False
    request_template_timeout_s: float = Field(0.5, gt=0)
    request_template_max_chars: int = Field(4 * 1024 * 1024, ge=1024)
    # The per-request CPU budget of the tokens stage (413 `prompt_too_large` past it).
    # Prompt tokens as the engine sees them: token-id prompts are counted before hashing,
    # text prompts after tokenizing. 2**20 is at or above every served context length we
    # route for, so normal traffic never meets it.
    max_prompt_tokens: int = Field(1024 * 1024, ge=1)
    # Body bytes above which a text prompt is refused before rendering or tokenizing (the
    # work is linear in bytes). 16 MiB holds 2**20 tokens at 16 JSON bytes each (escaped
    # non-ASCII text runs ~6), so a prompt under max_prompt_tokens never meets it.
    max_tokenize_bytes: int = Field(16 * 1024 * 1024, ge=1024)

    def adapter_of(self, model: str | None) -> str | None:
        """The LoRA adapter a request's model names (its blocks live in the adapter's
        namespace), or None for a base model. The one place a model name means LoRA."""
        return model if model is not None and model in self.lora_base else None


class LoadConfig(Strict):
    """Metrics scraping (scorer.pool.scrape)."""

    scrape_interval_s: float = Field(0.2, gt=0)
    scrape_timeout_s: float = Field(1.0, gt=0)
    # A scrape older than this is ignored (router in-flight accounting only).
    stale_after_s: float = Field(2.0, gt=0)
    # End a routed request's prefill once the engine's counters (vLLM's TTFT histogram
    # count and request_success) show it holds fewer requests before their first token
    # than the router counts (scorer.pool.prefill, issue 13). Off: only finished requests
    # correct the prefill estimate.
    first_token_counts: bool = True
    # Fit the prefill model from the scrape correction too (scorer.pool.prefill,
    # `bracketed_prefill`): a request had its first token between the last page that
    # counted it before its first token and the first that did not. Only until a response
    # body teaches the model (exact). Off until a quiet end-to-end run shows it wins
    # (bench/routing/results.md, 23:15-23:38 UTC: within the noise of a shared machine).
    fit_prefill_from_scrapes: bool = False


class DecisionsConfig(Strict):
    log_size: int = Field(1000, ge=0)


class Config(Strict):
    """The whole configuration."""

    server: ServerConfig = Field(default_factory=ServerConfig)
    extproc: ExtProcConfig = Field(default_factory=ExtProcConfig)
    pool: PoolConfig = Field(default_factory=PoolConfig)
    events: EventsConfig = Field(default_factory=EventsConfig)
    index: IndexConfig = Field(default_factory=IndexConfig)
    tokens: TokensConfig = Field(default_factory=TokensConfig)
    load: LoadConfig = Field(default_factory=LoadConfig)
    decisions: DecisionsConfig = Field(default_factory=DecisionsConfig)
    policy: str = "least_loaded"
    # Options per policy, validated by the policy's own Options model at start-up.
    policies: dict[str, dict[str, Any]] = Field(default_factory=dict)
    # Scheduling profiles users compose (scorer.policy.profile): filters, weighted
    # scorers and a picker by plugin name; `policy: NAME` selects one.
    profiles: dict[str, dict[str, Any]] = Field(default_factory=dict)
    log_level: Literal["debug", "info", "warning", "error"] = "info"


class ConfigError(Exception):
    """A configuration problem; the message names the field."""


def _format(err: ValidationError, prefix: str = "") -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"])
        lines.append(f"{prefix}{loc}: {e['msg']}")
    return "invalid configuration:\n  " + "\n  ".join(lines)


def deep_merge(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """Merge `over` into a copy of `base`; nested dicts merge, everything else replaces."""
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), dict):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = v
    return out


def env_overrides(environ: Mapping[str, str]) -> dict[str, Any]:
    """`KV_SCORER_SERVER__EXTPROC_PORT=9100` → {"server": {"extproc_port": "9100"}}.

    `__` separates levels; values are parsed as YAML scalars/lists ("true", "[a, b]").
    """
    out: dict[str, Any] = {}
    for key, raw in environ.items():
        if not key.startswith(ENV_PREFIX) or key == ENV_PREFIX + "CONFIG":
            continue
        path = key[len(ENV_PREFIX) :].lower().split("__")
        node = out
        for p in path[:-1]:
            node = node.setdefault(p, {})
        try:
            node[path[-1]] = yaml.safe_load(raw) if raw else raw
        except yaml.YAMLError:
            node[path[-1]] = raw
    return out


def load_config(
    path: str | Path | None = None,
    overrides: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> Config:
    """Build the configuration: file, then environment, then `overrides` (from flags)."""
    environ = os.environ if environ is None else environ
    path = path or environ.get(ENV_PREFIX + "CONFIG")
    data: dict[str, Any] = {}
    if path:
        try:
            text = Path(path).read_text()
        except OSError as e:
            raise ConfigError(f"config file {path}: {e.strerror}") from e
        try:
            loaded = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {path}: not valid YAML: {e}") from e
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {path}: the top level must be a mapping")
        data = loaded
    data = deep_merge(data, env_overrides(environ))
    if overrides:
        data = deep_merge(data, overrides)
    try:
        return Config.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format(e)) from e
