"""Conversation prefixes already tokenized and hashed: a new turn starts where they end.

A chat request is the previous request of its conversation plus a turn: its rendered
prompt usually starts with the previous prompt's text up to that prompt's last added
token (the generation prompt's ``<|im_start|>`` for ChatML). Splitting that text into
segments, looking each one up, joining their ids and chaining their block keys is the
same work every turn (~0.15 ms for an 8k-token conversation). A `PrefixState` keeps the
result for one prompt cut right after its last added token: the text, the packed ids up
to there and the keys of the full blocks inside them. The next request whose text starts
with that text splits, encodes and hashes only what follows.

Exact by construction: the tokenizer cuts text at added tokens scanning left to right
(scorer.tokens.segments), so the pieces of ``P + rest`` are the pieces of ``P`` followed by
the pieces of ``rest`` when ``P`` ends with an added token, unless an added token that
starts inside ``P`` could run past its end. That needs one added token to contain another
(`LocalTokenizer.prefix_safe` is False then, and this cache is not used). Block keys chain
from the previous key only, so the keys of full blocks inside ``P``'s ids hold for any
prompt that starts with ``P`` in the same namespace.

States are found by the prompt's first `HEAD_CHARS` characters (a conversation's system
prompt and first message), at most `FANOUT` per head (conversations sharing a long system
prompt), longest match first; a state is superseded by the one its conversation's next
request makes. The bound is approximate bytes, least recently used evicted.
"""

from __future__ import annotations

import sys
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

# States are kept only for prompts at least this long (shorter ones are cheap anyway).
HEAD_CHARS = 256
FANOUT = 16
_OVERHEAD = 400  # the state object, dict slots, list headers: an estimate


@dataclass(slots=True, frozen=True)
class PrefixState:
    """A prompt text cut after an added token, its packed ids and its full blocks' keys."""

    text: str
    packed: bytes  # little-endian uint32 ids, special prefix ids included
    keys: tuple[int, ...]  # keys of the full blocks of `packed`

    def cost(self) -> int:
        """Approximate bytes held."""
        return sys.getsizeof(self.text) + len(self.packed) + 40 * len(self.keys) + _OVERHEAD


Space = tuple[int, int, bool]  # (tokenizer space, block namespace, special ids added)


class PrefixStates:
    """The states, by (space, head of the text); thread-safe (one lock, dict work only)."""

    def __init__(self, max_bytes: int, on_bytes: Callable[[int], None] | None = None) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self._on_bytes = on_bytes  # told every change of `bytes` (the cache gauge)
        self._lru: OrderedDict[int, tuple[tuple[Space, str], PrefixState]] = OrderedDict()
        self._heads: dict[tuple[Space, str], list[int]] = {}
        self._next = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._lru)

    def find(self, space: Space, text: str) -> tuple[int, PrefixState] | None:
        """The longest stored state `text` starts with, as (handle, state), or None."""
        if len(text) < HEAD_CHARS or self.max_bytes <= 0:
            return None
        head = (space, text[:HEAD_CHARS])
        best: tuple[int, PrefixState] | None = None
        with self._lock:
            for h in self._heads.get(head, ()):
                st = self._lru[h][1]
                if (best is None or len(st.text) > len(best[1].text)) and text.startswith(st.text):
                    best = (h, st)
            if best is not None:
                self._lru.move_to_end(best[0])
        return best

    def store(self, space: Space, state: PrefixState, replaces: int | None = None) -> None:
        """Remember `state` (dropping `replaces`, the state it extends), evicting LRU."""
        if len(state.text) < HEAD_CHARS or self.max_bytes <= 0:
            return
        cost = state.cost()
        if cost > self.max_bytes // 4:
            return  # one huge prompt must not flush every conversation
        head = (space, state.text[:HEAD_CHARS])
        delta = 0
        with self._lock:
            if replaces is not None and replaces in self._lru:
                delta -= self._drop(replaces)
            ids = self._heads.setdefault(head, [])
            if any(self._lru[h][1].text == state.text for h in ids):
                self._adjust(delta)
                return  # already known (the same prompt again)
            h = self._next
            self._next += 1
            self._lru[h] = (head, state)
            ids.append(h)
            delta += cost
            if len(ids) > FANOUT:
                delta -= self._drop(ids[0])
            while self.bytes + delta > self.max_bytes and self._lru:
                delta -= self._drop(next(iter(self._lru)))
            self._adjust(delta)

    def clear(self) -> None:
        """Drop every state."""
        with self._lock:
            self._lru.clear()
            self._heads.clear()
            self._adjust(-self.bytes)

    def _drop(self, h: int) -> int:
        head, st = self._lru.pop(h)
        ids = self._heads[head]
        ids.remove(h)
        if not ids:
            del self._heads[head]
        return st.cost()

    def _adjust(self, delta: int) -> None:
        if delta:
            self.bytes += delta
            if self._on_bytes is not None:
                self._on_bytes(delta)
