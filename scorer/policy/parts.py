"""The shared parts a policy may read, typed (no string-keyed service dict).

Built once by `scorer.app.build_components`; tests and the replay benchmark fill only what
they have. Every field may be None: a plugin that consumes a missing part degrades (a
cache scorer with no index scores by load), it never fails a request.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from scorer.blocks import BlockHasher
    from scorer.pool.prefill import PrefillModel
    from scorer.pool.scrape import LoadScraper
    from scorer.tokens.service import Tokenization


class MatchLike(Protocol):
    """scorer.index.Match as the policies read it."""

    @property
    def blocks(self) -> int: ...

    @property
    def by_medium(self) -> dict[str, int]: ...

    @property
    def weighted(self) -> float: ...


class IndexLike(Protocol):
    """The part of scorer.index.BlockIndex the policies use."""

    def match(
        self, keys: Sequence[int], endpoints: Iterable[str] | None = None
    ) -> Mapping[str, MatchLike]: ...

    def insert_speculative(
        self,
        endpoint: str,
        keys: Sequence[int],
        ttl_s: float | None = None,
        wait_s: float = 0.0,
        block_s: float = 0.0,
        step_blocks: int = 0,
    ) -> None: ...


class StreamStatusLike(Protocol):
    """scorer.events.subscriber.StreamStatus as the policies read it."""

    @property
    def last_event_at(self) -> float | None: ...

    @property
    def unrecovered_gap(self) -> bool: ...


class EventsLike(Protocol):
    """scorer.events.EventIngest as the policies read it: per-worker stream health."""

    def status(self, endpoint: str) -> StreamStatusLike: ...


@dataclass
class Parts:
    """What the scheduling pipeline may read besides the pool (the load view)."""

    index: IndexLike | None = None  # the event-fed block index (scorer.index)
    events: EventsLike | None = None  # event-stream health (scorer.events)
    tokens: Tokenization | None = None  # tokenizers (scorer.tokens)
    hasher: BlockHasher | None = None  # the one hash space (scorer.blocks)
    scrape: LoadScraper | None = None  # scraped engine metrics (scorer.pool.scrape)
    # The data path's fitted prefill-time model (scorer.pool.prefill; set by the director).
    prefill: PrefillModel | None = None
