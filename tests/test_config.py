"""Configuration: file, then KV_SCORER_* env, then flags; errors name the field."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from scorer.app import App, config_from_args, make_policy, register
from scorer.config import ConfigError, load_config
from scorer.pool.workers import Pool


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    register(p.add_subparsers())
    return p.parse_args(["serve", *argv])


def test_flags_override_env_override_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    f = tmp_path / "c.yaml"
    f.write_text(
        "server: {extproc_port: 9100, health_port: 9101, admin_port: 9102}\n"
        "pool: {workers: ['10.0.0.1:8000']}\n"
        "policy: random\n"
    )
    monkeypatch.setenv("KV_SCORER_SERVER__HEALTH_PORT", "9201")
    monkeypatch.setenv("KV_SCORER_SERVER__ADMIN_PORT", "9202")
    monkeypatch.setenv("KV_SCORER_EXTPROC__TRACK_RESPONSES", "false")
    cfg = config_from_args(parse(["--config", str(f), "--admin-port", "9302"]))
    assert cfg.server.extproc_port == 9100  # file
    assert cfg.server.health_port == 9201  # env over file
    assert cfg.server.admin_port == 9302  # flag over env
    assert cfg.extproc.track_responses is False
    assert cfg.policy == "random"
    assert [w.endpoint for w in cfg.pool.workers] == ["10.0.0.1:8000"]


def test_quick_start_flags_without_file(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KV_SCORER_CONFIG", raising=False)
    args = parse(
        ["--worker", "127.0.0.1:8001", "--worker", "127.0.0.1:8002", "--policy", "round_robin"]
    )
    cfg = config_from_args(args)
    assert [w.endpoint for w in cfg.pool.workers] == ["127.0.0.1:8001", "127.0.0.1:8002"]
    assert cfg.policy == "round_robin"
    assert cfg.pool.models == []  # a pool listing no models accepts any model


def test_bad_worker_flag_names_the_field() -> None:
    with pytest.raises(ConfigError, match=r"pool\.workers\.0\.endpoint"):
        config_from_args(parse(["--worker", "not-an-endpoint"]))


def test_env_config_path(tmp_path: Path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text("policy: least_loaded\nextproc: {decision_headers: true}\n")
    cfg = load_config(environ={"KV_SCORER_CONFIG": str(f)})
    assert cfg.extproc.decision_headers is True


def test_policy_options_error_names_policies_field() -> None:
    cfg = load_config(
        overrides={"policy": "round_robin", "policies": {"round_robin": {"fallbacks": "many"}}},
        environ={},
    )
    with pytest.raises(ConfigError, match=r"policies\.round_robin\.fallbacks"):
        make_policy(cfg, Pool.from_config(cfg), {})
    cfg2 = load_config(
        overrides={"policy": "round_robin", "policies": {"round_robin": {"bogus": 1}}},
        environ={},
    )
    with pytest.raises(ConfigError, match=r"policies\.round_robin\.bogus"):
        App(cfg2)


def test_unknown_policy_is_config_error() -> None:
    cfg = load_config(overrides={"policy": "nope"}, environ={})
    with pytest.raises(ConfigError, match="unknown policy 'nope'"):
        App(cfg)


def test_policy_options_reach_the_policy() -> None:
    cfg = load_config(
        overrides={"policy": "least_loaded", "policies": {"least_loaded": {"fallbacks": 2}}},
        environ={},
    )
    app = App(cfg)
    assert app.policy.name == "least_loaded"
    assert app.policy.options.fallbacks == 2  # type: ignore[attr-defined]


def test_event_loop_is_validated_and_defaults_to_uvloop() -> None:
    assert load_config(None).server.event_loop == "uvloop"
    assert (
        load_config(None, overrides={"server": {"event_loop": "asyncio"}}).server.event_loop
        == "asyncio"
    )
    with pytest.raises(ConfigError, match=r"server\.event_loop"):
        load_config(None, overrides={"server": {"event_loop": "trio"}})
