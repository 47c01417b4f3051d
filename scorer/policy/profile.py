"""A scheduling profile: filters → weighted scorers → picker, as one Policy.

The shipped policies (`kv`, `approx`, `least_loaded`, `round_robin`, `random`) are profiles
(scorer.policy.profiles); users compose their own under `profiles.NAME` in the config and
select it with `policy: NAME`:

    profiles:
      cache-and-queue:
        filters: [{type: busy, busy_waiting: 8}]
        scorers:
          - {type: kv_overlap, weight: 2}
          - {type: queue_depth, weight: 1}
        picker: {type: max_score}

Every plugin entry is `type` (a name in scorer.policy.registry), `weight` (scorers only,
default 1) and the plugin's own options; a bad entry stops start-up naming the field
(`profiles.cache-and-queue.scorers[1].weight: ...`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from operator import attrgetter
from typing import TYPE_CHECKING, Any

from pydantic import Field, ValidationError

from scorer.policy.base import Policy, PolicyContext, PolicyOptions
from scorer.policy.cost import CostTable, LoadTable
from scorer.policy.filters.busy import BusyFilter
from scorer.policy.parts import MatchLike
from scorer.policy.plugin import NO_MATCHES, Cycle, Filter, Picker, Plugin, Scorer
from scorer.policy.registry import by_kind
from scorer.routing import CandidateScore, Decision, Reason, RoutingRequest, refuse

if TYPE_CHECKING:
    from scorer.pool.workers import Worker


@dataclass
class ProfileSpec:
    """A profile's plugins with validated options (what a profile config becomes)."""

    filters: list[tuple[type[Filter], PolicyOptions]] = field(default_factory=list)
    scorers: list[tuple[type[Scorer], PolicyOptions, float]] = field(default_factory=list)
    picker: tuple[type[Picker], PolicyOptions] | None = None
    fallbacks: int = 0
    waiting_request_blocks: float | None = None
    # The options section it was built from (`policies.kv` of a shipped profile).
    options: PolicyOptions | None = None


class ProfileConfig(PolicyOptions):
    """`profiles.NAME`: the plugins by name, with their options inline."""

    filters: list[dict[str, Any]] = Field(default_factory=list)
    scorers: list[dict[str, Any]] = Field(default_factory=list)
    picker: dict[str, Any] = Field(default_factory=lambda: {"type": "max_score"})
    # Extra endpoints (next best first) after the winner, for Envoy to retry on.
    fallbacks: int = Field(0, ge=0, le=8)
    # Blocks per request in a scraped engine queue (None: the request's own size).
    waiting_request_blocks: float | None = Field(None, ge=0)


def _plugin(kind: str, entry: Any, where: str, scorer: bool = False) -> tuple[Any, ...]:
    if not isinstance(entry, dict):
        raise ValueError(f"{where}: must be a mapping with a `type`")
    raw = dict(entry)
    name = raw.pop("type", None)
    known = by_kind(kind)
    cls = known.get(name) if isinstance(name, str) else None
    if cls is None:
        raise ValueError(
            f"{where}.type: unknown {kind} {name!r} (known: {', '.join(sorted(known))})"
        )
    weight = raw.pop("weight", 1.0) if scorer else None
    if scorer and (not isinstance(weight, int | float) or isinstance(weight, bool) or weight < 0):
        raise ValueError(f"{where}.weight: must be a number >= 0")
    try:
        opts = cls.Options.model_validate(raw)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(p) for p in err["loc"])
        raise ValueError(f"{where}.{loc}: {err['msg']}") from None
    return (cls, opts, float(weight or 0.0)) if scorer else (cls, opts)


def spec_from_config(name: str, raw: dict[str, Any]) -> ProfileSpec:
    """Validate `profiles.NAME`; ValueError names the field."""
    where = f"profiles.{name}"
    try:
        pc = ProfileConfig.model_validate(raw)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(p) for p in err["loc"])
        raise ValueError(f"{where}.{loc}: {err['msg']}") from None
    spec = ProfileSpec(fallbacks=pc.fallbacks, waiting_request_blocks=pc.waiting_request_blocks)
    for k, entry in enumerate(pc.filters):
        spec.filters.append(_plugin("filter", entry, f"{where}.filters[{k}]"))  # type: ignore[arg-type]
    for k, entry in enumerate(pc.scorers):
        spec.scorers.append(_plugin("scorer", entry, f"{where}.scorers[{k}]", scorer=True))  # type: ignore[arg-type]
    spec.picker = _plugin("picker", pc.picker, f"{where}.picker")  # type: ignore[assignment]
    return spec


# The reasons a decision names, read once: each `Reason.X` goes through EnumType's
# __getattr__ hook (~1,000 instructions a read).
_NO_BODY = Reason.NO_BODY
_TOKENIZE_ERROR = Reason.TOKENIZE_ERROR
_NO_TOKENIZER = Reason.NO_TOKENIZER
_BUSY_ALL = Reason.BUSY_ALL
_STALE_EVENTS = Reason.STALE_EVENTS
_STALE_NOTE = str(Reason.STALE_EVENTS)
_KV_HIT = Reason.KV_HIT
_LOAD = Reason.LOAD


def no_token_reason(request: RoutingRequest) -> Reason | None:
    """Why a request has no block keys (routed by load), or None when it has them."""
    if request.block_keys is not None:
        return None
    if request.body is None:
        return _NO_BODY
    if request.tokenize_error is not None:
        return _TOKENIZE_ERROR
    return _NO_TOKENIZER


class Profile(Policy):
    """Runs one ProfileSpec per decision (see the module docstring)."""

    def __init__(self, ctx: PolicyContext, name: str, spec: ProfileSpec) -> None:
        super().__init__(ctx, spec.options if spec.options is not None else PolicyOptions())
        self.name = name
        self.clock: Callable[[], float] = time.monotonic

        def clock() -> float:
            return self.clock()  # plugins follow a clock swapped in later (tests, replay)

        self.filters = [cls(ctx, o, clock) for cls, o in spec.filters]
        self.scorers = [cls(ctx, o, clock) for cls, o, _ in spec.scorers]
        self.weights = [w for _, _, w in spec.scorers]
        if spec.picker is not None:
            pcls, popts = spec.picker
        else:
            pcls = by_kind("picker")["max_score"]  # type: ignore[assignment]
            popts = pcls.Options()
        self.picker: Picker = pcls(ctx, popts, clock)
        self.plugins: list[Plugin] = [*self.filters, *self.scorers, self.picker]
        self.needs_tokens = any("tokens" in p.consumes for p in self.plugins)
        self.fallback_count = spec.fallbacks
        self.waiting_request_blocks = spec.waiting_request_blocks
        # The single-scorer, weight-1 case skips the weighted sum (the shipped profiles).
        self._plain = len(self.scorers) == 1 and self.weights[0] == 1.0
        self._shedders = [f for f in self.filters if f.sheds()]
        # The first busy filter's thresholds are applied while the load table is built.
        self._busy = next((f.rule for f in self.filters if isinstance(f, BusyFilter)), None)
        # The plugins with a commit of their own (the base class's does nothing).
        self._committers = [p for p in self.plugins if type(p).commit is not Plugin.commit]
        # Per-decision constants, read once (an attribute of a config model goes through
        # pydantic's __getattr__ hook, ~350 instructions a read).
        self._block_size = ctx.config.pool.block_size
        self._ranges: dict[int, list[int]] = {}
        self._stale_after_s = ctx.config.load.stale_after_s

    def _everyone(self, n: int) -> list[int]:
        """[0, ..., n - 1], a new list (range() costs ~1,400 instructions; a copy of one kept
        per fleet size ~150)."""
        got = self._ranges.get(n)
        if got is None:
            if len(self._ranges) > 64:
                self._ranges.clear()  # (bounded: fleet sizes seen lately)
            got = self._ranges[n] = list(range(n))
        return got[:]

    def plugin(self, name: str) -> Plugin | None:
        """This profile's plugin named `name` (first match), for tests and tools."""
        return next((p for p in self.plugins if p.name == name), None)

    def decide(self, request: RoutingRequest, candidates: Sequence[Worker]) -> Decision:
        """Filters → scorers → picker → explanation → commit (not in a dry run)."""
        t0 = time.perf_counter()
        block_size = request.block_size or self._block_size
        keys = request.block_keys
        if request.prompt_tokens:
            req_blocks = float(math.ceil(request.prompt_tokens / block_size))
        else:
            req_blocks = float(len(keys or ()))
        wrb = self.waiting_request_blocks
        if wrb is None:
            wrb = 1.0 if req_blocks < 1.0 else req_blocks  # max(req_blocks, 1.0)
        n = len(candidates)
        cycle = Cycle(
            request,
            candidates,
            self.clock(),
            block_size,
            req_blocks,
            self._stale_after_s,
            wrb,
            [None] * n,
            None,
            False,
            None,
            NO_MATCHES,
            self._busy,
        )
        for p in self.scorers:
            p.prepare(cycle)
        t_match = time.perf_counter()

        for f in self.filters:
            f.filter(cycle)
        filtered = cycle.filtered
        # (A filtered candidate's entry is its reason, a non-empty string.)
        eligible = _kept(filtered) if any(filtered) else self._everyone(n)
        all_filtered = not eligible
        if all_filtered:
            if request.sheddable and self._shedders:
                d = refuse(self.name, Reason.SHED, "every eligible worker is busy")
                d.candidates = explanation_rows(cycle, None, None)
                t_score = time.perf_counter()
                d.stages["match"] = t_match - t0
                d.stages["score"] = t_score - t_match
                d.stages["explain"] = time.perf_counter() - t_score
                return d
            eligible = list(range(n))
        cycle.eligible = eligible
        cycle.all_filtered = all_filtered

        scorers = self.scorers
        if self._plain:
            costs = scorers[0].costs(cycle)
        elif not scorers:  # the picker alone decides (round robin, random)
            costs = [0.0] * len(eligible)
        else:
            total = [0.0] * len(eligible)
            for s, w in zip(scorers, self.weights, strict=True):
                if w:
                    for k, v in enumerate(s.score(cycle)):
                        total[k] += w * v
            costs = [0.0 - t for t in total]
        j = self.picker.pick(cycle, costs)
        t_score = time.perf_counter()

        win = eligible[j]
        eps = cycle.endpoints
        endpoints = [eps[win]]
        if self.fallback_count:
            endpoints += _fallbacks(
                self.picker.order(cycle, costs), j, eps, eligible, self.fallback_count
            )
        # (no cost table and nothing shown: nothing held, without the call)
        held = cycle.cost is not None or cycle.shown_matches
        win_blocks = _held_blocks(cycle, win) if held else 0
        notes: list[str]
        if self.picker.reason is not None:  # the picker alone decides (round robin, ...)
            reason, notes = self.picker.reason, []
        else:
            reason, notes = self._reason(cycle, win, win_blocks)
        # The rows are built when first read (/debug/decisions, the Score RPC), from this
        # decision's numbers: in-flight counts as they are now, before the commit.
        rows = explanation_rows(cycle, costs if scorers else None, _requests(candidates))
        if not request.dry_run:
            for plug in self._committers:
                plug.commit(cycle, win)
        # (positional: endpoints, reason, policy, matched_tokens, request_tokens, status,
        # message, param, notes; keywords cost a dict per call)
        d = Decision(
            endpoints,
            reason,
            self.name,
            win_blocks * block_size,
            request.prompt_tokens,
            200,
            "",
            None,
            notes,
        )
        d._rows = rows  # (the `candidates` setter's slot, without the property call)
        stages = d.stages
        stages["match"] = t_match - t0
        stages["score"] = t_score - t_match
        stages["explain"] = time.perf_counter() - t_score
        return d

    def _reason(self, cycle: Cycle, win: int, win_blocks: int) -> tuple[Reason, list[str]]:
        """Why candidate `win` won (holding `win_blocks` of the prompt), and the secondary
        reasons."""
        notes: list[str] = []
        if self.picker.reason is not None:
            return self.picker.reason, notes
        fallback = no_token_reason(cycle.request) if self.needs_tokens else None
        stale_any = cycle.stale_any
        if cycle.all_filtered:
            reason = _BUSY_ALL
            if fallback is not None:
                notes.append(str(fallback))
        elif fallback is not None:
            reason = fallback
        elif stale_any and (
            _stale_row(cycle, win)
            or any(
                _stale_row(cycle, i) and _held_blocks(cycle, i) > win_blocks for i in cycle.eligible
            )
        ):
            reason = _STALE_EVENTS
        elif win_blocks > 0:
            reason = _KV_HIT
        else:
            reason = _LOAD
        if stale_any and reason is not _STALE_EVENTS:
            notes.append(_STALE_NOTE)
        filtered = cycle.filtered
        if not cycle.all_filtered and any(filtered):
            # A filtered worker held more of the prompt than the winner: say it spilled
            # (the first of the filtered holding the most).
            top, why = -1, None
            for i, f in enumerate(filtered):
                if f is not None and (b := _held_blocks(cycle, i)) > top:
                    top, why = b, f
            if top > win_blocks:
                notes.append(f"spilled:{why}")
        return reason, notes


# (Comprehensions over a function's locals make them closure cells for the whole
# function: these run in their own.)
def _kept(filtered: list[str | None]) -> list[int]:
    """Positions of the candidates no filter dropped."""
    return [i for i in range(len(filtered)) if filtered[i] is None]


def _fallbacks(order: list[int], j: int, eps: list[str], eligible: list[int], k: int) -> list[str]:
    """The `k` best endpoints after the winner (position `j`), in the picker's order."""
    rest = [i for i in order if i != j]
    return [eps[eligible[i]] for i in rest[:k]]


_inflight_requests = attrgetter("inflight.requests")


def _requests(candidates: Sequence[Worker]) -> list[int]:
    """Each candidate's in-flight requests now (the rows show them as decided)."""
    return list(map(_inflight_requests, candidates))


def _held_blocks(cycle: Cycle, i: int) -> int:
    """Candidate i's cached prefix in blocks, as its explanation row shows it: the cost's
    match when the cost scored it, else the shown lookup."""
    table = cycle.cost
    if table is not None:
        k = table.position(i)
        if k is not None and (m := table.matches[k]) is not None:
            return m.blocks
    matches = cycle.shown_matches
    mm = matches.get(cycle.endpoints[i]) if matches else None
    return 0 if mm is None else mm.blocks


def _stale_row(cycle: Cycle, i: int) -> bool:
    """Whether candidate i's row carries the stale_events note (credit cut for staleness)."""
    table = cycle.cost
    if table is None or table.stale is None:
        return False
    k = table.position(i)
    return k is not None and table.matches[k] is not None and table.stale[k]


def explanation_rows(
    cycle: Cycle, costs: list[float] | None, requests: list[int] | None
) -> Callable[[], list[CandidateScore]]:
    """A function building one explanation row per candidate (filtered ones included)
    from the numbers the filters, the cost and the picker used. It holds those numbers
    only (not the request: a deferred builder stays with its decision in the log).
    `requests`: each candidate's in-flight requests at decision time (None: now)."""
    # One partial (two objects), not a closure (a cell per captured name).
    return partial(
        _build_rows,
        cycle.candidates,
        cycle.load,
        cycle.shown_matches,
        cycle.cost,
        cycle.filtered,
        cycle.block_size,
        cycle.eligible,
        _requests(cycle.candidates) if requests is None else requests,
        costs,
    )


def _build_rows(
    candidates: Sequence[Worker],
    load: LoadTable,
    matches: Mapping[str, MatchLike],
    table: CostTable | None,
    filtered: list[str | None],
    bs: int,
    eligible: list[int],
    reqs: list[int],
    costs: list[float] | None,
) -> list[CandidateScore]:
    """The explanation rows (see `explanation_rows`)."""
    pfs, dcs, wqs, kus = load.prefill, load.decode, load.waiting, load.kv_usage
    cost_of = dict(zip(eligible, costs, strict=True)) if costs is not None else {}
    n = len(candidates)
    # The cost's columns by candidate index (no cost: no cost rows).
    if table is None:
        cms: list[MatchLike | None] = [None] * n
        wts: list[float] = []
        crs: list[float] = []
        stales: list[bool] | None = None
    else:
        cms, wts, crs, stales = table.by_candidate(n)
    rows: list[CandidateScore] = []
    add = rows.append
    for i, (w, m) in enumerate(zip(candidates, cms, strict=True)):
        note: str | None = None
        if m is None:
            # No cost row for this candidate: the match shown, neutral cost terms.
            mm = matches.get(w.endpoint) if matches else None
            blocks = 0 if mm is None else mm.blocks
            by_medium = {} if mm is None else mm.by_medium
            weighted, credit = 0.0, 1.0
        else:
            blocks, by_medium = m.blocks, m.by_medium
            weighted, credit = wts[i], crs[i]
            if stales is not None and stales[i]:
                note = "stale_events"
        add(
            CandidateScore(
                w.endpoint,
                blocks,
                blocks * bs,
                by_medium,
                weighted,
                credit,
                reqs[i],
                pfs[i],
                dcs[i],
                wqs[i],
                kus[i],
                cost_of.get(i),
                filtered[i],
                note,
            )
        )
    if table is not None:
        best, held = table.best_held, table.held
        if best is not None and held is not None:
            for i, h in zip(table.eligible, held, strict=True):
                rows[i].duplicate_blocks = best - h
        if table.queue is not None:
            for i, q in zip(table.eligible, table.queue, strict=True):
                rows[i].queue_blocks = q
        if table.share is not None:
            for i, x in zip(table.eligible, table.share, strict=True):
                rows[i].share_blocks = x
        if table.copy is not None:
            for i, x in zip(table.eligible, table.copy, strict=True):
                rows[i].copy_blocks = x
        if table.fleet is not None:
            # (table, candidate index): the row's terms are built when it is shown.
            for i in table.eligible:
                rows[i].terms = (table, i)
    return rows
