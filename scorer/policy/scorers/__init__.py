"""Scorer plugins (listed in scorer.policy.registry)."""
