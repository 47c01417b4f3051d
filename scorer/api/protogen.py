"""Regenerate the scorer.v1 gRPC stubs: `python -m scorer.api.protogen [OUT_DIR]`.

Stubs are committed under scorer/api/v1/ (tests/test_proto_stubs.py regenerates them
into a temporary directory and fails when the committed ones differ).
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROTO_ROOT = ROOT / "proto"
PROTOS = ["scorer/v1/scorer.proto"]
DEFAULT_OUT = ROOT / "scorer" / "api" / "v1"
_IMPORT = b"from scorer.v1 import scorer_pb2 as scorer_dot_v1_dot_scorer__pb2"
_FIXED = b"from scorer.api.v1 import scorer_pb2 as scorer_dot_v1_dot_scorer__pb2"


def generate(out_dir: Path) -> list[Path]:
    """Run grpc_tools.protoc into `out_dir`; return the files written."""
    from grpc_tools import protoc  # dev dependency only

    tmp = out_dir / "_gen"
    tmp.mkdir(parents=True, exist_ok=True)
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"--python_out={tmp}",
        f"--pyi_out={tmp}",
        f"--grpc_python_out={tmp}",
        *[str(PROTO_ROOT / p) for p in PROTOS],
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    written = []
    for f in sorted((tmp / "scorer" / "v1").iterdir()):
        if f.suffix not in (".py", ".pyi"):
            continue
        # protoc writes package-relative imports (`from scorer.v1 import ...`); our stubs
        # live in scorer/api/v1.
        data = f.read_bytes().replace(_IMPORT, _FIXED)
        target = out_dir / f.name
        target.write_bytes(data)
        written.append(target)
    for f in sorted(tmp.rglob("*"), reverse=True):
        f.unlink() if f.is_file() else f.rmdir()
    tmp.rmdir()
    init = out_dir / "__init__.py"
    init.write_text('"""Generated scorer.v1 stubs (python -m scorer.api.protogen)."""\n')
    written.append(init)
    return written


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    out = Path(argv[0]) if argv else DEFAULT_OUT
    out.mkdir(parents=True, exist_ok=True)
    for f in generate(out):
        print(f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
