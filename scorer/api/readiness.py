"""The start-up readiness gate: when may the health names report SERVING?

The reference picker reports ready only once its pool has synced
(gateway-api-inference-extension v1.5.0 `cmd/epp/runner/health.go`: every check is
`datastore.PoolHasSynced()`). Ours waits for the same things a first request needs:

- the pool's source has synced (scorer.pool.discovery: the InferencePool and its pods
  listed once; a static pool is synced from the start), and
- the pool has at least one worker (a picker with no workers can only answer 503), and
- every KV-event stream has connected, or `server.readiness_events_timeout_s` has passed
  since the servers bound (a worker whose publisher is not up yet must not keep the
  picker out of rotation forever; its requests are routed by load until it connects).

The gate opens once and stays open: readiness afterwards only goes down for a shutdown
(a pool that later loses its workers answers 503 per request, as the reference does).
Reads in-memory state only; `check()` is cheap and runs on the event loop.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from scorer.pool.workers import Pool

# endpoint -> stream connected (the app builds it from scorer.events' subscribers).
StreamStates = Callable[[], Mapping[str, bool]]


@dataclass(frozen=True, slots=True)
class GateState:
    """One evaluation of the gate: open or not, and why (shown by /readyz)."""

    ready: bool
    reason: str


class ReadinessGate:
    """Evaluates the start-up conditions; `start()` marks the moment the timeout counts from."""

    def __init__(
        self,
        pool: Pool,
        streams: StreamStates,
        events_timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
        synced: Callable[[], bool] = lambda: True,
    ) -> None:
        self.pool = pool
        self.synced = synced
        self.streams = streams
        self.events_timeout_s = events_timeout_s
        self.clock = clock
        self.started_at: float | None = None
        self.opened = False

    def start(self) -> None:
        """The servers are bound: the event-stream timeout counts from now."""
        self.started_at = self.clock()

    def check(self) -> GateState:
        """Open (and stay open) when the pool has workers and streams are up or timed out."""
        if self.opened:
            return GateState(True, "ready")
        if not self.synced():
            return GateState(False, "waiting for the first sync of the pool from Kubernetes")
        if len(self.pool) == 0:
            return GateState(False, "waiting for workers: the pool is empty")
        states = self.streams()
        waiting = sorted(ep for ep, connected in states.items() if not connected)
        if waiting:
            started = self.started_at if self.started_at is not None else self.clock()
            elapsed = self.clock() - started
            if elapsed < self.events_timeout_s:
                shown = ", ".join(waiting[:5]) + (" ..." if len(waiting) > 5 else "")
                return GateState(
                    False,
                    f"waiting for {len(waiting)} KV-event stream(s) to connect "
                    f"({elapsed:.1f}/{self.events_timeout_s:g} s): {shown}",
                )
        self.opened = True
        return GateState(True, "ready")
