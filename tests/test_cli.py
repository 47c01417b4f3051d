"""scorer.cli: tooling subcommands come from kv-scorer-tools; import failures are loud."""

from __future__ import annotations

import pytest

from scorer import cli


def test_tooling_subcommands_come_from_the_tools_distribution() -> None:
    # `make` installs kv-scorer-tools next to the runtime (tools/pyproject.toml).
    assert cli.tooling_modules() == {
        "sim": "kvscorer_tools.sim.cli",
        "bench": "kvscorer_tools.bench.cli",
        "demo": "kvscorer_tools.demo",
    }
    args = cli.build_parser("sim").parse_args(["sim", "--port", "8123"])
    assert args.port == 8123 and args.func.__module__ == "kvscorer_tools.sim.cli"


@pytest.mark.parametrize("name", ["sim", "bench", "demo"])
def test_without_the_tooling_the_subcommand_says_what_to_install(
    name: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(cli, "tooling_modules", dict)
    assert cli.main([name, "--help"]) == 2
    err = capsys.readouterr().err
    assert f"`kv-scorer {name}` is part of the development tooling" in err
    assert "kv-scorer-tools" in err and "pip install -e ./tools" in err
    # The runtime's own subcommands still parse.
    assert cli.build_parser("serve").parse_args(["serve", "--worker", "10.0.0.1:8000"])


def test_a_subcommand_that_fails_to_import_fails_loudly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cli, "SUBCOMMANDS", [*cli.SUBCOMMANDS, ("scorer.no_such_module", "x")])
    with pytest.raises(ModuleNotFoundError, match=r"scorer\.no_such_module"):
        cli.build_parser("x")
    # An installed plugin whose module is broken is not hidden either.
    monkeypatch.setattr(cli, "tooling_modules", lambda: {"sim": "kvscorer_tools.sim.nope"})
    with pytest.raises(ModuleNotFoundError, match=r"kvscorer_tools\.sim\.nope"):
        cli.main(["sim"])
