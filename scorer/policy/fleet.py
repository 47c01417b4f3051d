"""What a routing decision does to the fleet: cache life per worker, chain ages, the
previous turn's worker. Read and written by the `dynamo_cost` scorer (scorer.policy.cost
prices it); kept outside the block index on purpose (its own small bounded structures).

Expected life of a cached block. A worker's prefix cache is LRU (vLLM's free-block queue
evicts the least recently freed block first: vllm docs/design/prefix_caching.md,
vllm/v1/core/kv_cache_utils.py FreeKVCacheBlockQueue; SGLang's radix cache evicts the
least recently used leaves: python/sglang/srt/mem_cache/radix_cache.py `evict`). Once it
is full, every new block written evicts one: the worker's eviction rate (what its
`BlockRemoved` events count) equals the rate at which new blocks are written there. A
block last touched `age` seconds ago has had about `age x rate` blocks written after it,
so it is evicted when that reaches the capacity:

    life_s = capacity_blocks / eviction_rate        remaining_s = life_s - age

`eviction_rate` is an exponentially weighted rate (time constant `window_s`) of either
(`rate_from`):

* `events`: the GPU blocks the worker's own `BlockRemoved` events removed (the index
  counts them per worker as it applies them: `BlockIndex.removed_total`), sampled at each
  decision that reads the worker's life; every router's traffic and the engine's real
  evictions count, nothing is assumed about fullness;
* `routed` (no event stream: `approx`): the blocks this router wrote to the worker (the
  uncached blocks of the requests it sent there: exactly the blocks the engine stores,
  and, once the cache is full, removes as many of) while the worker's cache is full (the
  index holds at least `full_fraction` of its capacity).

Until the worker evicts the rate is 0 and blocks live forever.

Coarse chain ages. For each worker, the time this router last routed a request through
a block is remembered at every `stride`-th block of the request and at its last block
(a bounded LRU map, `max_entries`); the age of a candidate's matched chain is read at the
deepest remembered position within the match. Unknown (another router's traffic, or
forgotten): no age, full value.

Previous turn. The last worker of each session id (bounded LRU, `max_sessions`, idle
entries older than `session_ttl_s` dropped); without a session id, the candidate holding
the longest cached prefix, when it covers at least `min_match` of the prompt (a
conversation's next turn starts with the previous turn's whole prompt and answer). A
request whose session id is new has no previous turn (its prefix may be a system prompt
shared with other sessions).

Live sessions per worker. A new session's later turns follow it wherever it lands (the
continuity term keeps them there) and grow its context there, so placing it also places
its future load and cache footprint. The map sums, per worker, the sessions whose last
request went there, each weighing 1 or its context's blocks (`session_weight`); the
`session_spread` term spreads new sessions by it (docs/policy.md, "Session spread");
`session_rebalance` moves a continuing session off a worker whose weight runs well over
the mean.

Conversations without a session id (`infer_conversations`). A chat client resends the
whole history each turn, so turn t+1's prompt starts with turn t's whole prompt: its
block chain extends turn t's, and turn t's last full block key (its tip) sits in the
new prompt at the same position. `Conversations` remembers, per routed request, (tip,
length, conversation) under the key at an anchor position: the deepest position of a
fixed grid (every 16th block up to 256, then 4 per doubling) within the prompt. A new
prompt of N blocks looks its grid positions below N - 1 up, deepest first (~N/16, at
most ~40 lookups however long), and continues the conversation whose record its chain
extends: same tip at the record's length, strictly longer, and the record is that
conversation's latest turn. The last two conditions keep a shared system prompt from
naming a conversation: independent requests behind it do not extend each other's
whole prompts (they diverge after the shared part), a prompt that is only the shared
part is extended at most once (a second extension is a fork: a new conversation), and
a prompt no longer than the record is no continuation, and a chain on which two
conversations end, neither continued past it, is a shared prefix that names neither.
Each anchor keeps its last `bucket` records; anchors and conversations are least
recently used bounded.
Inferred conversations share `Sessions` with named ones (int ids, never a header's str):
they count in each worker's live weight and remember their previous worker.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from scorer.policy.parts import MatchLike


class CacheLife:
    """Per worker: smoothed eviction rate, expected block life, coarse chain ages."""

    def __init__(
        self,
        window_s: float = 60.0,
        stride: int = 16,
        max_entries: int = 200_000,
        full_fraction: float = 0.9,
        rate_from: str = "routed",
    ) -> None:
        self.window_s = window_s
        # "events": the rate comes from `removed` (BlockRemoved counts); "routed": from the
        # written blocks `routed` is told of.
        self.from_events = rate_from == "events"
        self._removed: dict[str, int] = {}  # endpoint -> BlockRemoved count last seen
        self.stride = max(stride, 1)
        self.max_entries = max_entries
        self.full_fraction = full_fraction
        # endpoint -> (rate in blocks/s at time t, t)
        self._rate: dict[str, tuple[float, float]] = {}
        # (endpoint, block key) -> last routed time; oldest first.
        self._seen: OrderedDict[tuple[str, int], float] = OrderedDict()

    def routed(
        self,
        endpoint: str,
        keys: Sequence[int],
        written: float,
        now: float,
        full: bool,
    ) -> None:
        """A request was routed to `endpoint`: its chain's time is refreshed and, with
        `rate_from: routed`, its `written` new blocks count towards the eviction rate when
        its cache is `full`."""
        if not self.from_events:
            self._add(endpoint, written if full else 0.0, now)
        n = len(keys)
        if not n:
            return
        seen = self._seen
        stride = self.stride
        for j in range(stride - 1, n - 1, stride):
            k = (endpoint, keys[j])
            seen[k] = now
            seen.move_to_end(k)
        k = (endpoint, keys[n - 1])
        seen[k] = now
        seen.move_to_end(k)
        while len(seen) > self.max_entries:
            seen.popitem(last=False)

    def _add(self, endpoint: str, blocks: float, now: float) -> None:
        """`blocks` evictions at `now` into `endpoint`'s smoothed rate."""
        rate, t = self._rate.get(endpoint, (0.0, now))
        rate *= math.exp(-max(now - t, 0.0) / self.window_s)
        if blocks > 0.0:
            rate += blocks / self.window_s
        self._rate[endpoint] = (rate, now)

    def removed(self, endpoint: str, total: int, now: float) -> None:
        """`endpoint`'s engine has reported `total` GPU blocks removed (BlockRemoved) so
        far: the ones since the last call count as evicted now (`rate_from: events`)."""
        last = self._removed.get(endpoint, 0)
        if total == last and endpoint in self._rate:
            return
        self._removed[endpoint] = total
        # A smaller total: the index forgot the worker (purge, restart); start again.
        self._add(endpoint, float(total - last if total >= last else total), now)

    def eviction_rate(self, endpoint: str, now: float) -> float:
        """Smoothed blocks evicted per second on `endpoint` (0: cache not full)."""
        got = self._rate.get(endpoint)
        if got is None:
            return 0.0
        rate, t = got
        return rate * math.exp(-max(now - t, 0.0) / self.window_s)

    def life_s(self, endpoint: str, capacity: float, now: float) -> float | None:
        """Expected seconds a block lives in `endpoint`'s cache after its last use (None:
        nothing is being evicted, or the capacity is unknown)."""
        rate = self.eviction_rate(endpoint, now)
        if rate <= 1e-9 or capacity <= 0.0:
            return None
        return capacity / rate

    def age_s(self, endpoint: str, keys: Sequence[int], depth: int, now: float) -> float | None:
        """Seconds since this router last routed through the first `depth` blocks of
        `keys` to `endpoint`, at the deepest remembered position (None: unknown)."""
        if depth <= 0:
            return None
        seen = self._seen
        t = seen.get((endpoint, keys[depth - 1]))
        if t is None:
            stride = self.stride
            j = (depth // stride) * stride - 1
            while j >= 0 and t is None:
                t = seen.get((endpoint, keys[j]))
                j -= stride
        return None if t is None else max(now - t, 0.0)

    def forget(self, endpoint: str) -> None:
        """`endpoint` left the pool: drop its eviction rate and BlockRemoved count, so this
        state is bounded by the live pool, not by every endpoint ever seen (a worker that
        joins again at that address starts from no rate, as its index slot does). Its chain
        ages are left to `max_entries` (the LRU bound): finding them is a scan of them all."""
        self._rate.pop(endpoint, None)
        self._removed.pop(endpoint, None)

    def is_full(self, held_blocks: float, capacity: float) -> bool:
        """Whether a cache holding `held_blocks` of `capacity` evicts on every write."""
        return capacity > 0.0 and held_blocks >= self.full_fraction * capacity


def life_factor(remaining_s: float, wait_s: float, life_s: float, fade: float) -> float:
    """Worth of a cached chain (0..1) that has `remaining_s` of life left when the request
    reaches it after `wait_s`: full while more than `fade x life_s` is left then, falling
    linearly to 0 at eviction."""
    left = remaining_s - wait_s
    span = fade * life_s
    if span <= 0.0:
        return 1.0 if left > 0.0 else 0.0
    f = left / span
    if f < 0.0:  # min(max(f, 0.0), 1.0), as the builtins choose (no keyword parse)
        f = 0.0
    if f > 1.0:
        f = 1.0
    return f


def own_blocks(previous: str, matches: Mapping[str, MatchLike], endpoints: Iterable[str]) -> int:
    """Blocks of the prompt the previous turn's worker holds beyond every other one of
    `endpoints` (its cached prefix minus the longest other): the conversation's own
    context there, what moving the turn would prefill again. 0 when all it holds is also
    held elsewhere (a shared system prompt): the turn can move at no loss of cache."""
    m = matches.get(previous)
    if m is None:
        return 0
    # max over the others' blocks (0 when none holds any), max(own - that, 0): a loop, no
    # generator and no max() (a keyword parse each) on the decision path.
    other: int | None = None
    get = matches.get
    for e in endpoints:
        if e != previous:
            x = get(e)
            if x and (other is None or x.blocks > other):
                other = x.blocks
    d = m.blocks - (0 if other is None else other)
    return d if d > 0 else 0


SessionId = str | int


class Sessions:
    """Session id -> the worker of its last request (bounded, least recently used out,
    forgotten after `ttl_s` idle), and per worker the summed weight (1 each, or its
    context's blocks) of the live sessions: those whose last request is at most `live_s`
    old (a session idle that long has most likely ended; it is still remembered for
    continuity until `ttl_s`)."""

    def __init__(
        self, max_sessions: int = 100_000, ttl_s: float = 600.0, live_s: float | None = None
    ) -> None:
        self.max_sessions = max_sessions
        self.ttl_s = ttl_s
        self.live_s = ttl_s if live_s is None else min(live_s, ttl_s)
        # Ids: a session header's str, or an inferred conversation's int (Conversations).
        self._last: OrderedDict[SessionId, tuple[str, float]] = OrderedDict()  # -> (worker, t)
        # Live sessions, oldest last request first: id -> (worker, t, weight).
        self._active: OrderedDict[SessionId, tuple[str, float, float]] = OrderedDict()
        self._live: dict[str, float] = {}  # endpoint -> weight of its live sessions

    def live(self, endpoint: str) -> float:
        """Summed weight of the live sessions last served by `endpoint` (as of the last
        `expire` or `put`)."""
        return self._live.get(endpoint, 0.0)

    def _count(self, endpoint: str, d: float) -> None:
        n = self._live.get(endpoint, 0.0) + d
        if n > 1e-9:
            self._live[endpoint] = n
        else:
            self._live.pop(endpoint, None)

    def expire(self, now: float) -> None:
        """Stop counting the sessions idle for more than `live_s`."""
        active = self._active
        while active:
            ep, t, w = next(iter(active.values()))
            if now - t <= self.live_s:
                break
            active.popitem(last=False)
            self._count(ep, -w)

    def weight(self, session_id: SessionId) -> float:
        """`session_id`'s weight while it is live (0: not live)."""
        got = self._active.get(session_id)
        return 0.0 if got is None else got[2]

    def get(self, session_id: SessionId, now: float) -> str | None:
        """The worker that served `session_id`'s previous request, if recent."""
        got = self._last.get(session_id)
        if got is None or now - got[1] > self.ttl_s:
            return None
        return got[0]

    def put(self, session_id: SessionId, endpoint: str, now: float, weight: float = 1.0) -> None:
        """`session_id`'s request went to `endpoint`; the session now weighs `weight`."""
        active = self._active
        old = active.pop(session_id, None)
        if old is not None:
            self._count(old[0], -old[2])
        active[session_id] = (endpoint, now, weight)
        self._count(endpoint, weight)
        last = self._last
        last[session_id] = (endpoint, now)
        last.move_to_end(session_id)
        while last and (
            len(last) > self.max_sessions or now - next(iter(last.values()))[1] > self.ttl_s
        ):
            gone = active.pop(last.popitem(last=False)[0], None)
            if gone is not None:
                self._count(gone[0], -gone[2])
        self.expire(now)


def _grid(limit: int = 1 << 24) -> tuple[int, ...]:
    """Anchor positions (block indices): every 16th block up to 256, then 4 a doubling
    (256, 320, 384, 448, 512, 640, ...), and the first few for short prompts."""
    g = {0, 3, 7, *range(15, 256, 16)}
    e = 6
    while (4 << e) <= limit:
        g.update((m << e) - 1 for m in (4, 5, 6, 7))
        e += 1
    return tuple(sorted(g))


_GRID = _grid()
# _GRID[:j] deepest first, per j (a lookup's positions below its prompt's end, in order).
_DOWN = tuple(tuple(reversed(_GRID[:j])) for j in range(len(_GRID) + 1))


class Conversations:
    """Conversations without a session id, recognised by their prompts' block chains
    (module doc, "Conversations without a session id"). Bounded: at most `max_entries`
    anchors of `bucket` records each, and `max_entries` conversations' latest tips."""

    def __init__(self, max_entries: int = 100_000, bucket: int = 4, scan: int = 4) -> None:
        self.max_entries = max_entries
        self.bucket = bucket
        self.scan = scan  # anchors with records looked at per lookup, deepest first
        # anchor block key -> [(tip key, prompt blocks, conversation)], oldest first.
        self._anchors: OrderedDict[int, list[tuple[int, int, int]]] = OrderedDict()
        self._latest: OrderedDict[int, int] = OrderedDict()  # conversation -> its tip key
        self._next = 0

    def __len__(self) -> int:
        return len(self._latest)

    def find(self, keys: Sequence[int]) -> int | None:
        """The conversation whose latest turn's prompt `keys` strictly extends (None:
        none; the request opens a conversation)."""
        n = len(keys)
        anchors = self._anchors
        latest = self._latest
        looked = 0
        # (a previous prompt is at most n - 1 blocks)
        for g in _DOWN[bisect_right(_GRID, n - 2)]:
            b = anchors.get(keys[g])
            if b is None:
                continue
            for tip, m, conv in reversed(b):
                if m < n and keys[m - 1] == tip and latest.get(conv) == tip:
                    return conv
            looked += 1
            if looked >= self.scan:
                break
        return None

    def new(self) -> int:
        """A fresh conversation id."""
        self._next += 1
        return self._next

    def record(self, keys: Sequence[int], conv: int) -> None:
        """`keys` (a routed prompt, at least one block) is `conv`'s latest turn."""
        n = len(keys)
        tip = keys[n - 1]
        anchor = keys[_GRID[bisect_right(_GRID, n - 1) - 1]]
        anchors = self._anchors
        b = anchors.get(anchor)
        if b is None:
            anchors[anchor] = [(tip, n, conv)]
            if len(anchors) > self.max_entries:
                anchors.popitem(last=False)
        else:
            latest = self._latest
            for t, _, c in b:
                if t == tip and c != conv and latest.get(c) == tip:
                    break
            else:
                c = conv
            if c != conv:
                # Two conversations end on the same chain, neither continued past it: it
                # is a shared prefix (a system prompt alone), no conversation's own; it
                # names none again. (One that went on: this one restarts from its turn.)
                b[:] = [(t, m, -1 if t == tip else c) for t, m, c in b]
                conv = -1
            b.append((tip, n, conv))
            if len(b) > self.bucket:
                del b[0]
            anchors.move_to_end(anchor)
        if conv < 0:
            return
        latest = self._latest
        latest[conv] = tip
        latest.move_to_end(conv)
        if len(latest) > self.max_entries:
            latest.popitem(last=False)
