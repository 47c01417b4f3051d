"""The scheduling pipeline: profiles of filters, scorers and a picker (plugin.py,
profile.py, registry.py, profiles.py), the cost function (cost.py), session affinity
(session.py) and decision metrics (metrics.py)."""

from scorer.policy.base import (
    POLICIES,
    Policy,
    PolicyContext,
    PolicyOptions,
    build_policy,
    policy_names,
    register,
)
from scorer.policy.parts import Parts

__all__ = [
    "POLICIES",
    "Parts",
    "Policy",
    "PolicyContext",
    "PolicyOptions",
    "build_policy",
    "policy_names",
    "register",
]
