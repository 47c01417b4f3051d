"""`kv-scorer` command line: a thin dispatcher; each subcommand lives with its module.

A subcommand module exposes `register(subparsers)`, which adds its parser and sets
`func=run` where `run(args) -> int`.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# (module, subcommand) — imported lazily so `kv-scorer events ...` does not load gRPC.
SUBCOMMANDS: list[tuple[str, str]] = [
    ("scorer.app", "serve"),
    ("scorer.events.cli", "events"),
    ("scorer.tokens.cli", "tokens"),
    ("scorer.sim.cli", "sim"),
    ("scorer.demo", "demo"),
    ("scorer.bench.cli", "bench"),
]


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kv-scorer", description="KV-cache-aware endpoint picker for Envoy (ext_proc)."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module, name in SUBCOMMANDS:
        if only is not None and name != only:
            sub.add_parser(name, help=f"(see kv-scorer {name} --help)", add_help=False)
            continue
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name is not None and e.name.startswith("scorer"):
                continue  # subcommand not built yet
            raise
        mod.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    first = next((a for a in argv if not a.startswith("-")), None)
    known = {name for _, name in SUBCOMMANDS}
    parser = build_parser(first if first in known else None)
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
