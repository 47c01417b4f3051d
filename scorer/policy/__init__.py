"""Routing policies. Importing this package registers the built-in ones."""

from scorer.policy import approx, kv, session, simple  # noqa: F401
from scorer.policy.base import (
    POLICIES,
    Policy,
    PolicyContext,
    PolicyOptions,
    build_policy,
    register,
)

__all__ = ["POLICIES", "Policy", "PolicyContext", "PolicyOptions", "build_policy", "register"]
