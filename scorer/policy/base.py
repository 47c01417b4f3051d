"""The Policy interface: given eligible workers and a request, pick endpoints and say why.

A new policy is a class registered with `@register` plus a config entry
(`policy: NAME`, options under `policies.NAME`). The Envoy config never changes.
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import BaseModel, ConfigDict

from scorer.routing import Decision, RoutingRequest

if TYPE_CHECKING:
    from scorer.config import Config
    from scorer.pool.workers import Pool, Worker


class PolicyOptions(BaseModel):
    """Base for a policy's options (the `policies.NAME` config section). Unknown keys fail."""

    model_config = ConfigDict(extra="forbid")


@dataclass
class PolicyContext:
    """What a policy may read: the pool (with load), the config, and shared services.

    `services` holds optional parts by name (e.g. "index" for the block index) so that
    policies of later stages can find them without this interface changing.
    """

    pool: Pool
    config: Config
    rng: random.Random = field(default_factory=random.Random)
    services: dict[str, Any] = field(default_factory=dict)


class Policy(ABC):
    """Pick an endpoint among eligible candidates. Must not block or touch the network."""

    name: ClassVar[str]
    Options: ClassVar[type[PolicyOptions]] = PolicyOptions
    # True when decide() wants request.token_ids / block_keys filled (KV-aware policies).
    needs_tokens: ClassVar[bool] = False

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


def build_policy(name: str, ctx: PolicyContext, raw_options: dict[str, Any] | None) -> Policy:
    """Instantiate the named policy with validated options (raises ValueError naming the field)."""
    import scorer.policy  # noqa: F401  (registers the built-in policies)

    cls = POLICIES.get(name)
    if cls is None:
        raise ValueError(f"policy: unknown policy {name!r} (known: {', '.join(sorted(POLICIES))})")
    options = cls.Options.model_validate(raw_options or {})
    return cls(ctx, options)
