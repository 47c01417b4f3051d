"""Filter plugins (listed in scorer.policy.registry)."""
