"""Scheduling plugins: filters, scorers and pickers (the inference extension's scheduler
framework, pkg/epp/scheduling/framework, in Python).

A plugin is one file: a class derived from `Filter`, `Scorer` or `Picker`, decorated with
`@plugin("name")`, with its options as a pydantic model (`Options`). It is listed once in
`scorer.policy.registry.PLUGINS`. A profile (`scorer.policy.profile`) runs, per decision:

    filters (drop candidates, with a reason) → scorers (a value per remaining candidate,
    higher is better, each times its weight, summed) → picker (the winner) → commit
    (state changes, never in a dry run)

`Cycle` is the per-decision scratch space every plugin reads: the request, the
candidates, the clock, and the shared numbers computed once (load table, index matches).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from operator import attrgetter
from typing import TYPE_CHECKING, ClassVar, TypeVar

from scorer.policy.base import PolicyOptions
from scorer.policy.cost import BusyRule, CostTable, LoadTable, load_table
from scorer.policy.parts import IndexLike, MatchLike
from scorer.routing import Reason, RoutingRequest

if TYPE_CHECKING:
    from scorer.policy.base import PolicyContext
    from scorer.pool.workers import Worker


class PluginOptions(PolicyOptions):
    """Base of a plugin's options (a pydantic model; unknown keys fail naming the field).
    Options shared with the shipped policies' sections derive from PolicyOptions."""


# The empty lookup (no index, no block keys); shared, never changed.
NO_MATCHES: Mapping[str, MatchLike] = {}
# Worker.endpoint, one C-level getter over all candidates.
_endpoint = attrgetter("endpoint")


class Cycle:
    """One decision's state, shared by its plugins.

    `load` and `endpoints` are plain attributes, computed at construction (every profile
    reads both; a property call per read cost more than building them up front).
    """

    __slots__ = (
        "_last_got",
        "_last_index",
        "_matches",
        "all_filtered",
        "block_size",
        "busy",
        "candidates",
        "cost",
        "eligible",
        "endpoints",
        "filtered",
        "load",
        "now",
        "request",
        "request_blocks",
        "shown_matches",
        "stale_after_s",
        "stale_any",
        "waiting_request_blocks",
    )

    request: RoutingRequest
    candidates: Sequence[Worker]
    now: float
    block_size: int
    request_blocks: float  # the prompt in blocks (from prompt_tokens, else block keys)
    stale_after_s: float  # load.stale_after_s: older scrapes are ignored
    waiting_request_blocks: float  # blocks per request in a scraped engine queue
    # Why each candidate was filtered (None: kept). Set by filters.
    filtered: list[str | None]
    # Indices of the candidates the scorers and the picker see (after the filters).
    eligible: list[int]
    all_filtered: bool  # every candidate was filtered: all are scored anyway
    # The cost term by term (scorer dynamo_cost), for the explanation rows: the same
    # numbers the cost used.
    cost: CostTable | None
    # The index lookup the explanation rows show (the first cache scorer's; assigned,
    # never changed in place: the default is one shared empty mapping).
    shown_matches: Mapping[str, MatchLike]
    # Busy thresholds applied while building the load table (the profile's busy filter's).
    busy: BusyRule | None
    stale_any: bool  # a cost row's credit was cut for a stale event stream
    # Every candidate's load terms (load_table with `busy`, as of the construction).
    load: LoadTable
    # The candidates' endpoints (parallel to `candidates`).
    endpoints: list[str]
    _matches: dict[int, Mapping[str, MatchLike]] | None
    # The last index looked up and its answer (a decision asks the same index 3-4 times).
    _last_index: IndexLike | None
    _last_got: Mapping[str, MatchLike]

    def __init__(
        self,
        request: RoutingRequest,
        candidates: Sequence[Worker],
        now: float,
        block_size: int,
        request_blocks: float,
        stale_after_s: float,
        waiting_request_blocks: float,
        filtered: list[str | None] | None = None,
        eligible: list[int] | None = None,
        all_filtered: bool = False,
        cost: CostTable | None = None,
        shown_matches: Mapping[str, MatchLike] = NO_MATCHES,
        busy: BusyRule | None = None,
        stale_any: bool = False,
    ) -> None:
        self.request = request
        self.candidates = candidates
        self.now = now
        self.block_size = block_size
        self.request_blocks = request_blocks
        self.stale_after_s = stale_after_s
        self.waiting_request_blocks = waiting_request_blocks
        self.filtered = [] if filtered is None else filtered
        self.eligible = [] if eligible is None else eligible
        self.all_filtered = all_filtered
        self.cost = cost
        self.shown_matches = shown_matches
        self.busy = busy
        self.stale_any = stale_any
        self.load = load_table(candidates, now, stale_after_s, waiting_request_blocks, busy)
        self.endpoints = list(map(_endpoint, candidates))
        self._matches = None
        self._last_index = None  # (index None: NO_MATCHES, as below)
        self._last_got = NO_MATCHES

    def matches(self, index: IndexLike | None) -> Mapping[str, MatchLike]:
        """Each candidate's cached prefix in `index` (one lookup per index per decision)."""
        if index is self._last_index:
            return self._last_got
        keys = self.request.block_keys
        if index is None or not keys:
            return NO_MATCHES
        cache = self._matches
        if cache is None:
            cache = self._matches = {}
        got = cache.get(id(index))
        if got is None:
            got = cache[id(index)] = index.match(keys, self.endpoints)
        self._last_index, self._last_got = index, got
        return got


class Plugin:
    """Common base: a name, validated options, what the plugin reads, a commit hook."""

    name: ClassVar[str] = ""
    kind: ClassVar[str] = ""
    Options: ClassVar[type[PolicyOptions]] = PluginOptions
    # What the plugin reads: "tokens" (block keys: the director tokenizes first),
    # "index", "events", "load" (the load view), "headers". Documentation and the
    # tokenize decision; a plugin reads parts only through `ctx.parts` and the Cycle.
    consumes: ClassVar[frozenset[str]] = frozenset()

    def __init__(
        self, ctx: PolicyContext, options: PolicyOptions, clock: Callable[[], float]
    ) -> None:
        self.ctx = ctx
        self.options = options
        self.clock = clock

    def prepare(self, cycle: Cycle) -> None:
        """Called before the filters (e.g. to look the prompt up in an index)."""

    def commit(self, cycle: Cycle, winner: int) -> None:
        """The request goes to candidate `winner`: update state. Never in a dry run."""


class Filter(Plugin):
    """Drops candidates: sets `cycle.filtered[i]` to a reason for each one it drops."""

    kind = "filter"

    def sheds(self) -> bool:
        """When every candidate is filtered, a sheddable request is refused (429) if a
        filter says so; otherwise all candidates are scored (reason busy_all)."""
        return False

    def filter(self, cycle: Cycle) -> None:
        raise NotImplementedError


class Scorer(Plugin):
    """A value per eligible candidate (parallel to `cycle.eligible`), higher is better."""

    kind = "scorer"

    def score(self, cycle: Cycle) -> list[float]:
        raise NotImplementedError

    def costs(self, cycle: Cycle) -> list[float]:
        """The same values negated (lower is better). A scorer that computes costs
        natively overrides this; a profile with this scorer alone at weight 1 calls it."""
        return [0.0 - s for s in self.score(cycle)]


class Picker(Plugin):
    """Chooses among the eligible candidates given their total scores."""

    kind = "picker"
    # The decision's reason when the picker alone decides (round robin, random).
    reason: ClassVar[Reason | None] = None

    def pick(self, cycle: Cycle, costs: list[float]) -> int:
        """Position in `cycle.eligible` of the winner. `costs` are the negated total
        scores (lower is better), parallel to `cycle.eligible`."""
        raise NotImplementedError

    def order(self, cycle: Cycle, costs: list[float]) -> list[int]:
        """Positions in `cycle.eligible`, best first (for fallback endpoints)."""
        return sorted(range(len(costs)), key=lambda k: (costs[k], k))


P = TypeVar("P", bound=type[Plugin])


def plugin(name: str) -> Callable[[P], P]:
    """Class decorator: the plugin's config name (`type:` in a profile)."""

    def deco(cls: P) -> P:
        cls.name = name
        return cls

    return deco
