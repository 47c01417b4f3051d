"""The decision-fed index of fleets that publish no KV events.

When a request is routed to a worker, its block keys are remembered for that worker for
`ttl_s` (default 120 s, Dynamo's ApproxKvIndexer window for `--no-kv-events`). A later
request sharing the prefix then matches as in the event-fed index, every remembered block
counted as a GPU block.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field


@dataclass(slots=True)
class ApproxMatch:
    """Same shape as scorer.index.Match."""

    blocks: int
    by_medium: dict[str, int] = field(default_factory=dict)
    weighted: float = 0.0


class ApproxIndex:
    """key -> {endpoint: expiry}; bounded, oldest-touched keys evicted first."""

    def __init__(self, ttl_s: float, max_keys: int, clock: Callable[[], float]) -> None:
        self.ttl_s = ttl_s
        self.max_keys = max_keys
        self.clock = clock
        self._entries: OrderedDict[int, dict[str, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def match(
        self, keys: Sequence[int], endpoints: Iterable[str] | None = None
    ) -> dict[str, ApproxMatch]:
        """Leading blocks of `keys` each endpoint was sent within the TTL (>= 1 only)."""
        now = self.clock()
        allowed = None if endpoints is None else set(endpoints)
        alive: set[str] | None = None
        depth: dict[str, int] = {}
        for i, k in enumerate(keys):
            holders = self._entries.get(k)
            if not holders:
                break
            cur = {ep for ep, exp in holders.items() if exp > now}
            alive = (cur if allowed is None else cur & allowed) if alive is None else alive & cur
            if not alive:
                break
            for ep in alive:
                depth[ep] = i + 1
        return {ep: ApproxMatch(n, {"GPU": n}, float(n)) for ep, n in depth.items()}

    def insert(self, endpoint: str, keys: Sequence[int], ttl_s: float | None = None) -> None:
        """Remember that `endpoint` holds `keys` until now + ttl."""
        expiry = self.clock() + (self.ttl_s if ttl_s is None else ttl_s)
        entries = self._entries
        for k in keys:
            holders = entries.get(k)
            if holders is None:
                entries[k] = {endpoint: expiry}
            else:
                holders[endpoint] = expiry
                entries.move_to_end(k)
        while len(entries) > self.max_keys:
            entries.popitem(last=False)

    def insert_speculative(
        self,
        endpoint: str,
        keys: Sequence[int],
        ttl_s: float | None = None,
        wait_s: float = 0.0,
        block_s: float = 0.0,
        step_blocks: int = 0,
    ) -> None:
        """`insert` (a routed prefix counts as cached for `ttl_s`; no prefill timing)."""
        self.insert(endpoint, keys, ttl_s)

    def purge(self, endpoint: str) -> None:
        """Forget everything about `endpoint`."""
        for holders in self._entries.values():
            holders.pop(endpoint, None)
