"""The decision log: the last N decisions, for `GET /debug/decisions`."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

from scorer.routing import Decision


def _drop(decision: Decision) -> None:
    """A disabled log's add."""


class DecisionLog:
    """A bounded ring of recent decisions, newest last."""

    def __init__(self, size: int = 1000) -> None:
        self._ring: deque[Decision] = deque(maxlen=max(size, 0) or None)
        self._enabled = size > 0
        # add(decision): the ring's own append when the log is on (once per decision: a C
        # call, no Python frame), else nothing is kept.
        self.add: Callable[[Decision], None] = self._ring.append if self._enabled else _drop

    def query(
        self,
        limit: int = 100,
        model: str | None = None,
        endpoint: str | None = None,
        reason: str | None = None,
    ) -> list[dict[str, Any]]:
        """Newest first, filtered by model, endpoint (primary) and reason."""
        out: list[dict[str, Any]] = []
        for d in reversed(self._ring):
            if model is not None and d.model != model:
                continue
            if endpoint is not None and d.endpoint != endpoint:
                continue
            if reason is not None and str(d.reason) != reason:
                continue
            out.append(d.as_dict())
            if len(out) >= limit:
                break
        return out

    def __len__(self) -> int:
        return len(self._ring)
