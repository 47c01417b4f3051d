"""Suite-wide settings: hypothesis profiles (`make test` derandomized, `make fuzz` random)."""

from __future__ import annotations

from hypothesis import HealthCheck, settings

# `make test`: every property test runs the same examples on every run (derandomize, no
# example database), so the suite passes or fails the same way on any clone. A
# counterexample found by `make fuzz` is kept in its test as an `@example`.
settings.register_profile(
    "ci",
    derandomize=True,
    database=None,
    print_blob=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
# `make fuzz` (--hypothesis-profile=fuzz): random exploration, `hypo.scaled` examples per
# test, failures printed with a reproduction blob.
settings.register_profile(
    "fuzz",
    derandomize=False,
    print_blob=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile("ci")
