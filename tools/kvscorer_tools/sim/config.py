"""Settings of one simulated worker (the `kv-scorer sim` flags)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvscorer_tools.sim.kvevents import Era, ReplayLayout, SocketMode
from kvscorer_tools.sim.timing import TimingModel


@dataclass
class SimConfig:
    """Settings of one simulated worker (the `kv-scorer sim` flags)."""

    host: str = "127.0.0.1"
    port: int = 8000  # 0: any free port (see SimWorker.port)
    model: str = "sim-model"
    loras: tuple[str, ...] = ()  # served LoRA adapter names (lora_id = position + 1)
    block_size: int = 16
    capacity_blocks: int = 32768  # KV pool size in blocks (vLLM num_gpu_blocks)
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    # vLLM's --long-prefill-token-threshold: most prompt tokens one request takes per step
    # (0: no cap, vLLM's default with one partial prefill).
    long_prefill_token_threshold: int = 0
    max_model_len: int = 131072
    speed: float = 1.0  # wall clock runs this many times faster than model time
    seed: int = 0
    # Decode-only steps run per engine wake-up, their tokens sent as one SSE chunk per
    # stream (vLLM's --stream-interval). 1: one wake-up and one chunk per token.
    stream_interval: int = 1
    kv_events: str | None = None  # ZMQ PUB endpoint, e.g. tcp://*:5557
    kv_events_mode: SocketMode = "auto"  # auto: vLLM's rule (bind on "*", else connect)
    replay: str | None = None  # ZMQ ROUTER replay endpoint, e.g. tcp://*:5558
    era: Era = "map"
    replay_layout: ReplayLayout = "topic"
    topic: str = ""
    data_parallel_rank: int = 0
    tokenizer: str | None = None  # tokenizer.json (or its directory); None: synthetic ids
    vocab_size: int = 32000  # synthetic tokenizer only
    default_max_tokens: int = 16
    timing: TimingModel | None = None  # None: default model at `speed`
    # A file to append one JSON line per request to at its first token (timestamps, queue,
    # cache hit): the benchmark's latency breakdown. None: no log.
    request_log: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # free-form, shown in /server_info
