"""The decision-fed index of fleets that publish no KV events.

When a request is routed to a worker, its block keys are remembered for that worker for
`ttl_s` (default 120 s, Dynamo's ApproxKvIndexer window for `--no-kv-events`). A later
request sharing the prefix then matches as in the event-fed index, every remembered block
counted as a GPU block.

Memory: at most `max_keys` keys (oldest-touched evicted first), each with at most one
holder per live worker. A key's holders are `_Holder` tokens, one per worker *incarnation*:
a worker that leaves (`forget`) has its token killed at once (no lookup counts it, and a
worker that joins again at that address gets a new token, so it inherits nothing); dead
and expired holders leave a key when it is touched once it has more holders than there
are live workers, and every key once a sweep after a departure passes it (`SWEEP_CHUNK`
keys per event-loop turn, so a million keys never hold the loop in one piece).
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

# Keys a departure sweep visits per event-loop turn (~2 ms).
SWEEP_CHUNK = 20_000


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
        self._sweep: list[int] | None = None  # keys a departure sweep has still to visit
        self._sweep_again = False  # a worker left while a sweep ran

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
        for k in keys:
            holders = entries.get(k)
            if holders is None:
                entries[k] = {me: expiry}
            else:
                n = len(holders)
                if n > live or (n == live and me not in holders):
                    # More holders than live workers once `me` is in: some are dead ones.
                    for h in [h for h, exp in holders.items() if exp <= now or not h.live]:
                        del holders[h]
                holders[me] = expiry
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

    def forget(self, endpoint: str) -> None:
        """`endpoint` left the pool: no lookup counts what it was sent from now on (a worker
        joining again there starts empty); its holders leave every key in a sweep of
        `SWEEP_CHUNK` keys per event-loop turn (all at once with no running loop)."""
        h = self._holders.pop(endpoint, None)
        if h is None:
            return
        h.live = False
        if self._sweep is not None:
            self._sweep_again = True
            return
        self._sweep = list(self._entries)
        self._sweep_step()

    def _sweep_step(self) -> None:
        try:
            loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        while self._sweep is not None:
            todo = self._sweep
            n = len(todo) if loop is None else min(SWEEP_CHUNK, len(todo))
            entries = self._entries
            for k in todo[len(todo) - n :]:
                holders = entries.get(k)
                if holders is not None:
                    for h in [h for h in holders if not h.live]:
                        del holders[h]
                    if not holders:
                        del entries[k]
            del todo[len(todo) - n :]
            if todo:
                assert loop is not None
                loop.call_soon(self._sweep_step)
                return
            self._sweep = None
            if self._sweep_again:
                self._sweep_again = False
                self._sweep = list(self._entries)
