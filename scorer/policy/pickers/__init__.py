"""Picker plugins (listed in scorer.policy.registry)."""
