"""The command line's options: declared once as dataclass fields (`cli/options.py`), they are still exactly the
recorded ones (names, help, defaults, order) for every command; `takes` hands a command one frozen value; the
`--status` lines of every `tandem study` subcommand.

A deliberate change of an option updates the record: `./.venv/bin/python tests/test_cli_options.py --write`.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest
import typer
import typer.main
from typer.testing import CliRunner

RECORD = Path(__file__).parent / "fixtures" / "cli" / "options.json"


def describe(cmd, path: tuple[str, ...] = ()) -> dict:
    """Every command's help and options (name, flags, default, help, metavar, flag, required), by command path."""
    rows = [[p.name, list(p.opts), list(p.secondary_opts), repr(p.default), getattr(p, "help", None), p.metavar,
             getattr(p, "is_flag", None), p.required] for p in cmd.params]
    out = {" ".join(("tandem", *path)): {"help": cmd.help, "params": rows}}
    for name, sub in sorted(getattr(cmd, "commands", {}).items()):
        out.update(describe(sub, (*path, name)))
    return out


def current() -> dict:
    from cli.main import app

    return describe(typer.main.get_command(app))


def test_every_command_keeps_its_recorded_options():
    want = json.loads(RECORD.read_text())
    got = current()
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name] == want[name], name


def test_takes_hands_the_command_one_frozen_value():
    from cli.options import option, takes

    @dataclasses.dataclass(frozen=True)
    class Opts:
        count: int = option(2, "--count", "-c", help="how many")
        loud: bool = option(False, "--loud", help="shout")

    seen = []
    app = typer.Typer()

    @app.command()
    @takes(Opts)
    def cmd(o: Opts) -> None:
        seen.append(o)

    assert CliRunner().invoke(app, ["-c", "5", "--loud"]).exit_code == 0
    assert CliRunner().invoke(app, []).exit_code == 0
    assert seen == [Opts(count=5, loud=True), Opts()]
    with pytest.raises(dataclasses.FrozenInstanceError):
        seen[0].count = 1
    assert "how many" in CliRunner().invoke(app, ["--help"], env={"COLUMNS": "200"}).output

    @dataclasses.dataclass(frozen=True)
    class Bare:
        n: int = 1

    with pytest.raises(TypeError, match="option"):
        takes(Bare)


def test_status_lines(capsys):
    from cli.main import _echo_status

    rows = [{"unit": "seed 0", "arm": "tandem", "state": "trained", "step": 8, "steps": 8},
            {"unit": "V1 v1-kl0.05", "arm": "kl_reg", "state": "pending", "step": 0, "steps": None}]
    _echo_status(rows)
    assert capsys.readouterr().out.splitlines() == [
        "seed 0                 tandem        trained        8/8",
        "V1 v1-kl0.05           kl_reg        pending        "]


def test_study_recompute_stands_alone_and_help_lists_the_subcommands():
    from cli.main import app

    runner = CliRunner()
    out = runner.invoke(app, ["study"], env={"COLUMNS": "200"})
    assert out.exit_code == 0 and all(c in out.output for c in ("run", "pilot", "gate", "control", "--recompute"))
    bad = runner.invoke(app, ["study", "--out", "x", "pilot", "--status"])
    assert bad.exit_code == 2 and "alone" in bad.output


if __name__ == "__main__" and sys.argv[1:] == ["--write"]:
    RECORD.write_text(json.dumps(current(), indent=1, sort_keys=True) + "\n")
