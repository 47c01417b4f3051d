"""Example counts for property tests: as written under `make test`, more under `make fuzz`."""

from __future__ import annotations

from hypothesis import settings

FUZZ_FACTOR = 10


def scaled(n: int) -> int:
    """`n` examples in the derandomized profile; `FUZZ_FACTOR` x `n` when exploring randomly.

    Read at import of the test module, after pytest has loaded the profile
    (`--hypothesis-profile`)."""
    return n if settings().derandomize else n * FUZZ_FACTOR
