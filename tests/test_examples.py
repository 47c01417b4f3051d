"""Every config in examples/ loads, and its policy (with its options) builds."""

from __future__ import annotations

from pathlib import Path

import pytest

from scorer.app import make_policy
from scorer.config import load_config
from scorer.pool import Pool

EXAMPLES = sorted((Path(__file__).resolve().parents[1] / "examples").glob("*.yaml"))


def test_there_are_examples() -> None:
    assert {p.name for p in EXAMPLES} >= {"two-sims.yaml", "full.yaml"}


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_loads_and_builds_its_policy(path: Path) -> None:
    config = load_config(path, environ={})
    assert config.pool.workers, "an example without workers routes nothing"
    policy = make_policy(config, Pool.from_config(config), {})
    assert policy.name == config.policy
