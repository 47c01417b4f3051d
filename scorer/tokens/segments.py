"""Segment-wise encoding: split a prompt at added tokens, encode each text piece once.

HuggingFace `tokenizers` first cuts its input at the added-vocabulary tokens (special
tokens such as ``<|im_start|>`` and non-special added tokens such as ``<think>``), then
normalizes, pre-tokenizes and encodes every piece between them on its own (tokenizers'
``AddedVocabulary::extract_and_normalize``). So the ids of a prompt are the concatenation
of the ids of its pieces, and a piece's ids depend only on its text. We cut the same way
(leftmost-longest match of the added tokens' literal content), look every text piece up in
a content-addressed LRU cache, encode only the misses, and join.

This holds only when the added tokens are matched on the raw text and do not eat their
neighbours: `AddedToken.lstrip/rstrip/single_word` change the pieces, and `normalized=True`
tokens are matched after normalization. `segment_safe` checks those flags and
`LocalTokenizer` then runs a probe comparison at load; a tokenizer that fails either is
encoded whole (exact, no cache). The hypothesis property test in
tests/tokens/test_tokens_segments.py checks the equality on random text.
"""

from __future__ import annotations

import re
import sys
import threading
import time
import weakref
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence

from prometheus_client import REGISTRY, Gauge
from prometheus_client.core import CounterMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import CollectorRegistry


class SegmentCounts:
    """`kv_scorer_token_segment_cache_hits` / `_misses`, read at scrape time: each cache
    counts its lookups in a cell of its own under the lock it already holds (lookups run
    in the tokens pool's threads and on the loop), and a scrape sums the cells, plus what
    the caches gone since had counted. prometheus_client's Counter.inc cost ~4,600
    instructions each (its own lock and value object), two per lookup."""

    HITS = "kv_scorer_token_segment_cache_hits"
    MISSES = "kv_scorer_token_segment_cache_misses"

    def __init__(self, registry: CollectorRegistry | None = REGISTRY) -> None:
        self._cells: dict[int, list[int]] = {}  # id(cell) -> [hits, misses] of a live cache
        self._retired = [0, 0]
        self._lock = threading.Lock()
        self._created = time.time()
        if registry is not None:
            registry.register(self)

    def cell(self, owner: object) -> list[int]:
        """A new [hits, misses] cell counted until `owner` is gone, then kept in the total."""
        cell = [0, 0]
        with self._lock:
            self._cells[id(cell)] = cell
        weakref.finalize(owner, self._retire, cell)
        return cell

    def _retire(self, cell: list[int]) -> None:
        with self._lock:
            self._cells.pop(id(cell), None)
            self._retired[0] += cell[0]
            self._retired[1] += cell[1]

    def totals(self) -> tuple[int, int]:
        """(hits, misses) over every cache so far."""
        with self._lock:
            hits, misses = self._retired
            cells = list(self._cells.values())
        for c in cells:
            hits += c[0]
            misses += c[1]
        return hits, misses

    def _families(self, hits: float | None, misses: float | None) -> Iterator[Metric]:
        for name, doc, value in (
            (self.HITS, "Prompt text segments whose token ids came from the segment cache.", hits),
            (self.MISSES, "Prompt text segments that had to be encoded by the tokenizer.", misses),
        ):
            fam = CounterMetricFamily(name, doc)
            if value is not None:
                fam.add_metric([], value, created=self._created)
            yield fam

    def describe(self) -> Iterator[Metric]:
        """The families without samples (the registry checks names against them)."""
        return self._families(None, None)

    def collect(self) -> Iterator[Metric]:
        hits, misses = self.totals()
        return self._families(float(hits), float(misses))


SEGMENT_COUNTS = SegmentCounts()
SEGMENT_BYTES = Gauge(
    "kv_scorer_token_segment_cache_bytes",
    "Approximate bytes held by the token segment caches (text + ids + overhead).",
)

# Per-entry bookkeeping cost on top of the text and the ids (dict slot, OrderedDict
# links, the bytes and str object headers): an estimate, the bound is approximate.
ENTRY_OVERHEAD = 160
_BIG = sys.byteorder == "big"


def ids_to_bytes(ids: Sequence[int]) -> bytes:
    """Token ids as little-endian uint32 bytes (scorer.blocks' packed form)."""
    arr = array("I", ids)
    if _BIG:
        arr.byteswap()
    return arr.tobytes()


def ids_array(buf: bytes) -> array[int]:
    """Packed ids as an `array("I")`: a sequence of ints at the cost of one copy (a list
    costs ~15 ns per id to build)."""
    arr = array("I")
    arr.frombytes(buf)
    if _BIG:
        arr.byteswap()
    return arr


def bytes_to_ids(buf: bytes) -> list[int]:
    """The inverse of `ids_to_bytes`."""
    return ids_array(buf).tolist()


class SegmentCache:
    """Text segment → packed token ids, LRU, bounded by an approximate byte budget.

    Shared by the tokenization threads, so every operation takes a lock (held for dict
    operations only, never while encoding).
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        # [hits, misses], counted under the lock; exported by SEGMENT_COUNTS at scrape time.
        self._counts = SEGMENT_COUNTS.cell(self)
        self._data: OrderedDict[tuple[int, str], bytes] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._data)

    @property
    def hits(self) -> int:
        """Lookups of a segment found in the cache, so far."""
        return self._counts[0]

    @property
    def misses(self) -> int:
        """Lookups of a segment not in the cache, so far."""
        return self._counts[1]

    @staticmethod
    def _cost(text: str, ids: bytes) -> int:
        return len(text) + len(ids) + ENTRY_OVERHEAD

    def lookup(self, space: int, texts: Sequence[str]) -> list[bytes | None]:
        """Cached ids for each text (None for a miss); hits become most recent."""
        out: list[bytes | None] = []
        data = self._data
        hits = 0
        counts = self._counts
        with self._lock:
            for t in texts:
                key = (space, t)
                v = data.get(key)
                if v is not None:
                    data.move_to_end(key)
                    hits += 1
                out.append(v)
            counts[0] += hits
            counts[1] += len(texts) - hits
        return out

    def missing_chars(self, space: int, texts: Iterable[str]) -> int:
        """Characters of `texts` not in the cache (what encoding them would take); a peek:
        no recency change, no hit or miss counted."""
        data = self._data
        with self._lock:
            return sum(len(t) for t in texts if t and (space, t) not in data)

    def store(self, space: int, items: Iterable[tuple[str, bytes]]) -> None:
        """Remember encoded segments, evicting least recently used ones over budget."""
        if self.max_bytes <= 0:
            return
        delta = 0
        data = self._data
        with self._lock:
            for text, ids in items:
                cost = self._cost(text, ids)
                if cost > self.max_bytes:
                    continue  # larger than the whole budget: never cached
                key = (space, text)
                old = data.pop(key, None)
                if old is not None:
                    delta -= self._cost(text, old)
                data[key] = ids
                delta += cost
            self.bytes += delta
            while self.bytes > self.max_bytes and data:
                (_, t), v = data.popitem(last=False)
                c = self._cost(t, v)
                self.bytes -= c
                delta -= c
        if delta:
            SEGMENT_BYTES.inc(delta)

    def clear(self) -> None:
        """Drop everything (and give the bytes back to the gauge)."""
        with self._lock:
            freed = self.bytes
            self._data.clear()
            self.bytes = 0
        if freed:
            SEGMENT_BYTES.dec(freed)


def added_token_pattern(contents: Iterable[str]) -> re.Pattern[str] | None:
    """A regex matching the added tokens leftmost-longest, captured (for `re.split`).

    Python's alternation is leftmost-first; listing longer tokens first makes it
    leftmost-longest among tokens starting at the same place, like tokenizers'
    Aho-Corasick `MatchKind::LeftmostLongest`.
    """
    toks = sorted({c for c in contents if c}, key=lambda s: (-len(s), s))
    if not toks:
        return None
    return re.compile("(" + "|".join(re.escape(t) for t in toks) + ")")
