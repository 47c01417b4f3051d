"""Timing model of the simulated worker (also used by the routing benchmark's replay).

All times are *model* milliseconds: what the modelled GPU would take. The worker divides
them by its speed factor (`TimingModel.speed`, `kv-scorer sim --speed`) before sleeping, so
a test can run 100x faster than real time while reporting model-time latencies.

Prefill: Dynamo's mocker polynomial, fitted on an H100 serving an 8B model (ai-dynamo,
lib/mocker perf_model.rs, `polynomial_prefill_time`):

    prefill_ms(T) = 4.209989e-07 * T**2 + 1.518344e-02 * T + 16.50142

where T is the number of *uncached* prompt tokens processed in one engine step (Dynamo feeds
the total new tokens of the batch, the GPU processing them in parallel; so do we): with
chunked prefill (`scheduler.py`) that is the sum of the step's prompt chunks, at most
`max_num_batched_tokens`, so a long prompt is costed chunk by chunk over its steps. As in
Dynamo's mocker, whose chunked prefill costs each chunk by its own new tokens
(lib/mocker/src/scheduler/vllm.rs `simulate_prefill`:
`predict_prefill_compute(Some(new_tokens_in_chunk))`), a chunk's attention over the
earlier chunks is not costed (nor is it over a cached prefix): a prompt longer than the
budget costs less than one-step prefill would (20k tokens: 415 ms in three steps against
488 ms). A fully cached prompt costs nothing here; the worker still recomputes one token,
as vLLM does.

Decode: our own linear choice, time of one decode step (one token for every running
sequence) grows with the running batch:

    decode_ms_per_token(B) = 8.0 + 0.25 * B

8 ms is a typical 8B-model inter-token latency at batch 1 on an H100; 0.25 ms per extra
sequence makes batch 64 cost 24 ms per step (about 3x batch 1), the usual shape of a
memory-bound decode. (Dynamo's mocker instead uses -25.74 p^2 + 54.01 p + 5.74 ms with p the
fraction of KV capacity in use; `dynamo_decode_ms` is provided for comparison.)
"""

from __future__ import annotations

from dataclasses import dataclass

# Dynamo mocker prefill fit (ms); see module docstring for the source.
PREFILL_A = 4.209989e-07
PREFILL_B = 1.518344e-02
PREFILL_C = 16.50142

DECODE_BASE_MS = 8.0
DECODE_PER_SEQ_MS = 0.25


@dataclass(frozen=True, slots=True)
class TimingModel:
    """Prefill/decode cost in model milliseconds, plus the wall-clock speed factor."""

    prefill_a: float = PREFILL_A
    prefill_b: float = PREFILL_B
    prefill_c: float = PREFILL_C
    decode_base_ms: float = DECODE_BASE_MS
    decode_per_seq_ms: float = DECODE_PER_SEQ_MS
    # Wall clock runs `speed` times faster than model time (1.0 = real time).
    speed: float = 1.0

    def __post_init__(self) -> None:
        if not self.speed > 0:
            raise ValueError(f"speed must be > 0, got {self.speed}")

    def prefill_ms(self, uncached_tokens: int) -> float:
        """Model ms to prefill `uncached_tokens` new tokens in one step (0 → 0 ms)."""
        if uncached_tokens <= 0:
            return 0.0
        t = float(uncached_tokens)
        return self.prefill_a * t * t + self.prefill_b * t + self.prefill_c

    def decode_ms_per_token(self, batch: int) -> float:
        """Model ms of one decode step producing one token for each of `batch` sequences."""
        if batch <= 0:
            return 0.0
        return self.decode_base_ms + self.decode_per_seq_ms * batch

    def step_ms(self, prefill_tokens: int, decode_batch: int) -> float:
        """Model ms of an engine step that prefills and decodes together."""
        return self.prefill_ms(prefill_tokens) + self.decode_ms_per_token(decode_batch)

    def wall_s(self, model_ms: float) -> float:
        """Wall-clock seconds the worker sleeps for `model_ms` model milliseconds."""
        return model_ms / 1000.0 / self.speed

    def model_s(self, wall_s: float) -> float:
        """Model seconds corresponding to `wall_s` elapsed wall-clock seconds."""
        return wall_s * self.speed


DEFAULT_TIMING = TimingModel()


def prefill_ms(uncached_tokens: int) -> float:
    """Dynamo mocker fit: 4.209989e-07·T² + 1.518344e-02·T + 16.50142 ms (0 for T <= 0)."""
    return DEFAULT_TIMING.prefill_ms(uncached_tokens)


def decode_ms_per_token(batch: int) -> float:
    """Decode step time for a running batch: 8.0 + 0.25·batch ms (0 for an empty batch)."""
    return DEFAULT_TIMING.decode_ms_per_token(batch)


def dynamo_decode_ms(active_kv_fraction: float) -> float:
    """Dynamo mocker's decode fit, for comparison: max(1, -25.74p² + 54.01p + 5.74) ms."""
    p = min(max(active_kv_fraction, 0.0), 1.0)
    return max(1.0, -25.74 * p * p + 54.01 * p + 5.74)
