"""What an end-to-end run is configured with: the fleet and the load generator."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MODEL = "bench-model"

Log = Callable[[str], None]


@dataclass(slots=True)
class E2ESettings:
    """The fleet and the load generator."""

    workers: int = 8
    capacity_blocks: int | None = 1000
    block_size: int = 512
    speed: float = 1.0  # sims' --speed; arrivals are already divided by it
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 262144  # Mooncake prompts reach 126k tokens
    seed: int = 0
    concurrency: int = 256
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
