"""Fixtures for the ext_proc contract tests: a real App on loopback ports + a real channel."""

from __future__ import annotations

import pytest
from extproc_helpers import harness_fixture

# `h = await harness(**config_overrides)` on the configured default transport;
# test_extproc_transport overrides it with grpcio to re-run the suites there.
harness = pytest.fixture(harness_fixture(), name="harness")
