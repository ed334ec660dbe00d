"""The `qarl` dispatcher: each subcommand is registered under its key in ``cli.SUBCOMMANDS``, `qarl --help` lists
them all, and a subcommand imports its own module only (a rollout server's `qarl serve` none of the trainer's)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from megatron_qarl import cli


def test_each_module_registers_the_subcommand_of_its_key():
    for name in cli.SUBCOMMANDS:
        parser = cli.build_parser(name)
        (action,) = [a for a in parser._actions if a.dest == "command"]
        assert list(action.choices) == [name]


def test_help_and_a_typo_see_every_subcommand(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = capsys.readouterr().out
    assert all(name in out for name in cli.SUBCOMMANDS)
    with pytest.raises(SystemExit):
        cli.main(["trian"])
    err = capsys.readouterr().err
    assert "invalid choice: 'trian'" in err and "'train'" in err


def test_qarl_serve_imports_no_other_subcommands_module():
    code = ("import sys; from megatron_qarl import cli; cli.build_parser('serve'); "
            "print(sorted(m for m in cli.SUBCOMMANDS.values() if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split("\n")[-2] == "['megatron_qarl.serve.cli']"
