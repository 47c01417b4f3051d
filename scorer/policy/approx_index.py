"""The decision-fed index of fleets that publish no KV events.

When a request is routed to a worker, its block keys are remembered for that worker for
`ttl_s` (default 120 s, Dynamo's ApproxKvIndexer window for `--no-kv-events`). A later
request sharing the prefix then matches as in the event-fed index, every remembered block
counted as a GPU block.

Memory: at most `max_keys` keys (oldest-touched evicted first), each with at most as many
holders as there were live workers when it was last touched. A key's holders are
`_Holder` tokens, one per worker *incarnation*: a worker that leaves (`forget`, on the
pool's removal notice) has its token killed at once (no lookup counts it, and a worker
that joins again at that address gets a new token, so it inherits nothing); a touched key
with more holders than live workers drops its dead and expired ones, so a hot key never
grows with every pod ever routed to it. (No scan of every key at a departure: a million
keys would hold the event loop for tens of ms.)
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


class _Holder:
    """One worker incarnation: live until the worker leaves the pool."""

    __slots__ = ("endpoint", "live")

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.live = True


class ApproxIndex:
    """key -> {holder: expiry}; bounded, oldest-touched keys evicted first."""

    def __init__(self, ttl_s: float, max_keys: int, clock: Callable[[], float]) -> None:
        self.ttl_s = ttl_s
        self.max_keys = max_keys
        self.clock = clock
        self._entries: OrderedDict[int, dict[_Holder, float]] = OrderedDict()
        self._holders: dict[str, _Holder] = {}  # endpoint -> its live holder

    def __len__(self) -> int:
        return len(self._entries)

    def holders(self) -> int:
        """(key, holder) pairs stored, dead and expired ones not yet dropped included."""
        return sum(map(len, self._entries.values()))

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
            cur = {h.endpoint for h, exp in holders.items() if exp > now and h.live}
            alive = (cur if allowed is None else cur & allowed) if alive is None else alive & cur
            if not alive:
                break
            for ep in alive:
                depth[ep] = i + 1
        return {ep: ApproxMatch(n, {"GPU": n}, float(n)) for ep, n in depth.items()}

    def insert(self, endpoint: str, keys: Sequence[int], ttl_s: float | None = None) -> None:
        """Remember that `endpoint` holds `keys` until now + ttl."""
        now = self.clock()
        expiry = now + (self.ttl_s if ttl_s is None else ttl_s)
        me = self._holders.get(endpoint)
        if me is None:
            me = self._holders[endpoint] = _Holder(endpoint)
        live = len(self._holders)
        entries = self._entries
        get, to_end = entries.get, entries.move_to_end
        for k in keys:
            holders = get(k)
            if holders is None:
                entries[k] = {me: expiry}
            else:
                holders[me] = expiry
                if len(holders) > live:
                    # More holders than live workers: some are dead ones (`me` stays).
                    for h in [h for h, exp in holders.items() if exp <= now or not h.live]:
                        del holders[h]
                to_end(k)
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

    def forget(self, endpoint: str) -> None:
        """`endpoint` left the pool: no lookup counts what it was sent from now on, and a
        worker joining again there starts empty. O(1): its holders leave a key when the key
        is next touched (see `insert`) or evicted, not in a scan of every key."""
        h = self._holders.pop(endpoint, None)
        if h is not None:
            h.live = False
