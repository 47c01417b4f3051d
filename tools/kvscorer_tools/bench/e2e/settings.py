"""What an end-to-end run is configured with: the fleet and the load generator."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MODEL = "bench-model"

Log = Callable[[str], None]

# The peer routers the harness can start: name -> (module, --policy). Here (no imports)
# so the CLI can validate names without loading the harness; peers.py starts them.
PEER_POLICIES: dict[str, tuple[str, str]] = {
    "sglang_round_robin": ("sglang_router", "round_robin"),
    "sglang_cache_aware": ("sglang_router", "cache_aware"),
    "vllm_router_round_robin": ("vllm_router", "round_robin"),
    "vllm_router_cache_aware": ("vllm_router", "cache_aware"),
    "vllm_router_kv_aware": ("vllm_router", "kv_aware"),
}
# The routers users would pick instead of ours, run beside our policies in every e2e run.
ROUTING_PEERS = ("sglang_cache_aware", "vllm_router_cache_aware", "vllm_router_kv_aware")


@dataclass(slots=True)
class E2ESettings:
    """The fleet and the load generator."""

    workers: int = 8
    capacity_blocks: int | None = 1000
    block_size: int = 512
    speed: float = 1.0  # sims' --speed; arrivals are already divided by it
    max_num_seqs: int = 256
    # Sims' --stream-interval: merged decode steps and coalesced SSE chunks cut their CPU
    # (bench/bench_sim_cpu.py) without moving TTFT, events or load (docs/sim.md).
    stream_interval: int = 8
    # The sims' CPU priority (nice value, 0-19). They stand in for GPU engines, which do
    # not take the router's CPU in a deployment; on this benchmark's shared cores every
    # extra process hop of a router (Envoy -> picker -> Envoy) otherwise waits behind 8
    # busy sims, and that wait is multiplied by the time scale into model-time TTFT.
    # Applies to every router alike (ours and the peers run at 0). 0 = no priority.
    sim_nice: int = 10
    max_num_batched_tokens: int = 8192
    max_model_len: int = 262144  # Mooncake prompts reach 126k tokens
    seed: int = 0
    concurrency: int = 256
    # Envoy's worker threads in front of our scorer (`--concurrency`; Envoy's own default is
    # one per hardware thread, gateways size it from the pod's CPU).
    envoy_concurrency: int = 1
    policy_options: dict[str, dict[str, Any]] = field(default_factory=dict)
    run_dir: Path = field(default_factory=lambda: Path("bench/out/e2e-run"))
    request_timeout_s: float = 600.0
    progress: bool = False  # print a progress line while a policy runs
    # Envoy in front of the scorer: None = the local envoy/envoy.yaml shape (plaintext);
    # a gateway name (scorer.envoyproc.GATEWAYS) = Envoy configured as that gateway
    # configures its picker filter, with TLS to the scorer where the gateway uses TLS.
    gateway: str | None = None
    # Response bodies sent to the scorer (the gateways send FULL_DUPLEX_STREAMED).
    response_body_mode: str = "NONE"
    # Local shape only: send the response headers too (envoy/envoy-full.yaml) instead of
    # the lean envoy/envoy.yaml.
    response_headers: bool = False
    # Each sim logs its requests (`kv-scorer sim --request-log`) and each policy's entry
    # gets the TTFT breakdown per leg and per worker (breakdown.py).
    request_log: bool = True
    # The peers behind an Envoy of their own (a plain route, no ext_proc, as many worker
    # threads as ours): the install a user with a gateway would run, gateway -> router ->
    # engines, so every router's path has Envoy's hop in it and only the picking differs.
    # Off: the load goes straight to the peer, the peers' lightest setup.
    peers_behind_envoy: bool = False
