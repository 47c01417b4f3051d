"""The committed scorer.v1 stubs are what `make proto` generates from proto/."""

from __future__ import annotations

from pathlib import Path

from scorer.api import protogen


def test_committed_stubs_are_fresh(tmp_path: Path) -> None:
    written = protogen.generate(tmp_path)
    names = sorted(p.name for p in written)
    assert names == ["__init__.py", "scorer_pb2.py", "scorer_pb2.pyi", "scorer_pb2_grpc.py"]
    for p in written:
        committed = protogen.DEFAULT_OUT / p.name
        assert committed.exists(), f"{committed} missing: run make proto"
        assert committed.read_bytes() == p.read_bytes(), f"{committed} is stale: run make proto"
