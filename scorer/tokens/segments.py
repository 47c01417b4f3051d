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
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence

from prometheus_client import Counter, Gauge

SEGMENT_HITS = Counter(
    "kv_scorer_token_segment_cache_hits",
    "Prompt text segments whose token ids came from the segment cache.",
)
SEGMENT_MISSES = Counter(
    "kv_scorer_token_segment_cache_misses",
    "Prompt text segments that had to be encoded by the tokenizer.",
)
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
        self.hits = 0
        self.misses = 0
        self._data: OrderedDict[tuple[int, str], bytes] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._data)

    @staticmethod
    def _cost(text: str, ids: bytes) -> int:
        return len(text) + len(ids) + ENTRY_OVERHEAD

    def lookup(self, space: int, texts: Sequence[str]) -> list[bytes | None]:
        """Cached ids for each text (None for a miss); hits become most recent."""
        out: list[bytes | None] = []
        data = self._data
        hits = 0
        with self._lock:
            for t in texts:
                key = (space, t)
                v = data.get(key)
                if v is not None:
                    data.move_to_end(key)
                    hits += 1
                out.append(v)
            self.hits += hits
            self.misses += len(texts) - hits
        if hits:
            SEGMENT_HITS.inc(hits)
        if len(texts) - hits:
            SEGMENT_MISSES.inc(len(texts) - hits)
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
