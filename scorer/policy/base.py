"""The Policy interface: given eligible workers and a request, pick endpoints and say why.

`policy: NAME` resolves, in order, to a profile the user composed (`profiles.NAME`,
scorer.policy.profile), a shipped profile (`kv`, `approx`, `least_loaded`, `round_robin`,
`random`: scorer.policy.profiles), `session` (layered over any of them), or a Policy class
registered with `@register` (a whole custom decision). New scoring logic is normally a
plugin (scorer.policy.plugin), not a Policy. The Envoy config never changes.
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import BaseModel, ConfigDict

from scorer.policy.parts import Parts
from scorer.routing import Decision, RoutingRequest

if TYPE_CHECKING:
    from scorer.config import Config
    from scorer.pool.workers import Pool, Worker


class PolicyOptions(BaseModel):
    """Base for a policy's options (the `policies.NAME` config section). Unknown keys fail.

    Frozen: plugins read the values they need on every decision once, at construction
    (an attribute of a pydantic model goes through its `__getattr__` hook, ~350
    instructions a read), so a value changed afterwards would not be seen; it raises
    instead."""

    model_config = ConfigDict(extra="forbid", frozen=True)


@dataclass
class PolicyContext:
    """What a policy may read: the pool (workers and their load view), the config, the
    shared parts (typed: index, events, tokens, hasher, scrape) and the random source."""

    pool: Pool
    config: Config
    rng: random.Random = field(default_factory=random.Random)
    parts: Parts = field(default_factory=Parts)


class Policy(ABC):
    """Pick an endpoint among eligible candidates. Must not block or touch the network."""

    name: str = ""
    Options: ClassVar[type[PolicyOptions]] = PolicyOptions
    # True when decide() wants request.token_ids / block_keys filled (KV-aware policies).
    needs_tokens: bool = False

    def __init__(self, ctx: PolicyContext, options: PolicyOptions) -> None:
        self.ctx = ctx
        self.options = options

    @abstractmethod
    def decide(self, request: RoutingRequest, candidates: Sequence[Worker]) -> Decision:
        """Rank `candidates` (non-empty, already filtered by model, health and subset)."""

    def fallbacks(self, winner: str, candidates: Sequence[Worker], n: int) -> list[str]:
        """Up to `n` other endpoints, least loaded first, for Envoy to retry on."""
        if n <= 0:
            return []
        rest = [w for w in candidates if w.endpoint != winner]
        rest.sort(key=lambda w: (w.inflight.requests, w.inflight.prefill_tokens))
        return [w.endpoint for w in rest[:n]]


POLICIES: dict[str, type[Policy]] = {}


def register(cls: type[Policy]) -> type[Policy]:
    """Class decorator: make a policy selectable by its `name` in the config."""
    POLICIES[cls.name] = cls
    return cls


def policy_names() -> list[str]:
    """Every selectable policy name without a config: the shipped profiles, `session`
    and registered Policy classes (a config adds its `profiles`)."""
    from scorer.policy.profiles import SHIPPED

    return sorted({*SHIPPED, "session", *POLICIES})


def build_policy(name: str, ctx: PolicyContext, raw_options: dict[str, Any] | None) -> Policy:
    """Build policy `name` (see the module docstring) with validated options.

    Raises pydantic's ValidationError for `policies.NAME` options, ValueError naming the
    field for everything else.
    """
    from scorer.policy.profile import Profile, spec_from_config
    from scorer.policy.profiles import SHIPPED
    from scorer.policy.session import SessionPolicy

    profiles = ctx.config.profiles
    for pname in profiles:
        if pname in SHIPPED or pname == "session" or pname in POLICIES:
            raise ValueError(f"profiles.{pname}: the name of a shipped policy; pick another")
    if name in profiles:
        return Profile(ctx, name, spec_from_config(name, profiles[name]))
    shipped = SHIPPED.get(name)
    if shipped is not None:
        return Profile(ctx, name, shipped(raw_options or {}))
    if name == "session":
        return SessionPolicy(ctx, SessionPolicy.Options.model_validate(raw_options or {}))
    cls = POLICIES.get(name)
    if cls is None:
        known = sorted({*POLICIES, *SHIPPED, "session", *profiles})
        raise ValueError(f"policy: unknown policy {name!r} (known: {', '.join(known)})")
    options = cls.Options.model_validate(raw_options or {})
    return cls(ctx, options)
