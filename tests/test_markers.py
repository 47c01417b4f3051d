"""The `envoy` marker cannot be forgotten: conftest puts it on users of Envoy fixtures, and
starting Envoy in an unmarked test fails (tests/conftest.py, kvscorer_tools.envoyrun)."""

from __future__ import annotations

import os
from typing import Any

import pytest

from kvscorer_tools.envoyrun import FORBID_ENVOY_ENV, EnvoyError, EnvoyProcess, validate_config


@pytest.fixture
def envoy_starter() -> Any:
    """Looks like an Envoy fixture to conftest (it would call EnvoyProcess); starts none."""
    return lambda config: EnvoyProcess(config)


def test_starting_envoy_in_an_unmarked_test_fails(request: pytest.FixtureRequest) -> None:
    assert request.node.get_closest_marker("envoy") is None
    assert os.environ[FORBID_ENVOY_ENV] == request.node.nodeid
    with pytest.raises(EnvoyError, match="not marked `envoy`"):
        EnvoyProcess("{}").start()
    with pytest.raises(EnvoyError, match="not marked `envoy`"):
        validate_config("/nonexistent.yaml")


def test_users_of_an_envoy_fixture_are_marked(
    envoy_starter: Any, request: pytest.FixtureRequest
) -> None:
    assert request.node.get_closest_marker("envoy") is not None
    assert FORBID_ENVOY_ENV not in os.environ
