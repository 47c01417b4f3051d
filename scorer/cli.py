"""`kv-scorer` command line: a thin dispatcher; each subcommand lives with its module.

A subcommand module exposes `register(subparsers)`, which adds its parser and sets
`func=run` where `run(args) -> int`.

The runtime's own subcommands are listed here. The development tooling (`sim`, `bench`,
`demo`) is a separate distribution, `kv-scorer-tools` (tools/ in the repository), which
registers its modules in the `kv_scorer.commands` entry-point group; where it is not
installed those subcommands say what to install. A subcommand whose module fails to
import is a bug and fails loudly (the traceback), never hidden.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from importlib.metadata import entry_points
from types import ModuleType

# (module, subcommand) — imported lazily so `kv-scorer events ...` does not load gRPC.
SUBCOMMANDS: list[tuple[str, str]] = [
    ("scorer.app", "serve"),
    ("scorer.events.cli", "events"),
    ("scorer.tokens.cli", "tokens"),
]
ENTRY_POINT_GROUP = "kv_scorer.commands"
# Subcommands the tooling distribution provides, with what each does (for the hint).
TOOLING: dict[str, str] = {
    "sim": "simulated vLLM worker",
    "bench": "routing benchmark",
    "demo": "Envoy + scorer + simulated workers, policies compared",
}
TOOLING_HINT = (
    "`kv-scorer {name}` is part of the development tooling, not the runtime: install the "
    "kv-scorer-tools distribution from a kv-scorer checkout (`pip install -e ./tools`, "
    "or `make` there, which does it), or use the tooling image (tools/Dockerfile)."
)


def tooling_modules() -> dict[str, str]:
    """Subcommand name → module, from the installed `kv_scorer.commands` entry points."""
    return {ep.name: ep.value for ep in entry_points(group=ENTRY_POINT_GROUP)}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The full parser; with `only`, the other subcommands are placeholders (not imported)."""
    parser = argparse.ArgumentParser(
        prog="kv-scorer", description="KV-cache-aware endpoint picker for Envoy (ext_proc)."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    plugins = dict(sorted(tooling_modules().items()))
    builtin = {name for _, name in SUBCOMMANDS}
    commands = SUBCOMMANDS + [(m, n) for n, m in plugins.items() if n not in builtin]
    for module, name in commands:
        if only is not None and name != only:
            sub.add_parser(name, help=f"(see kv-scorer {name} --help)", add_help=False)
            continue
        # No try/except: an import error here is a bug in that subcommand; show it.
        mod: ModuleType = importlib.import_module(module)
        mod.register(sub)
    for name, what in TOOLING.items():
        if name in plugins:
            continue
        # Listed in --help; `main` answers with what to install before parsing.
        sub.add_parser(name, help=f"{what} (needs kv-scorer-tools)", add_help=False)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse `argv` (default: sys.argv[1:]) and run the chosen subcommand."""
    argv = list(sys.argv[1:] if argv is None else argv)
    first = next((a for a in argv if not a.startswith("-")), None)
    plugins = tooling_modules()
    if first in TOOLING and first not in plugins:
        print(TOOLING_HINT.format(name=first), file=sys.stderr)
        return 2
    known = {name for _, name in SUBCOMMANDS} | set(plugins)
    parser = build_parser(first if first in known else None)
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
