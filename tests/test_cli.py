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


def test_overrides_are_taken_wherever_they_stand(capsys):
    """Issue 53 item 7: before, an override after a flag that followed another override (``a=1 --no-progress
    c.d=2``) was refused as an unrecognized argument. Now every ``key.sub=value`` word is an override wherever it
    stands: the unknown key is refused by the config's validation, naming it, not by argparse."""
    rc = cli.main(["train", "--config", "configs/cpu_default.yaml", "train.steps=1", "--no-progress",
                   "nosuch.key=2"])
    err = capsys.readouterr().err
    assert rc == 2 and "nosuch: unknown key" in err and "unrecognized" not in err, err
    args = cli.parse_args(cli.build_parser("train"),
                          ["train", "a.b=1", "--config", "X", "--no-progress", "c.d=2", "--resume", "e.f=3"])
    assert (args.config, args.overrides, args.no_progress, args.resume) == ("X", ["a.b=1", "c.d=2", "e.f=3"], True,
                                                                            True)
    args = cli.parse_args(cli.build_parser("train"), ["train", "--resume", "runs/x/checkpoints/step_000002",
                                                      "--config", "X", "a.b=1"])
    assert (args.resume, args.overrides) == ("runs/x/checkpoints/step_000002", ["a.b=1"])
    assert cli.parse_args(cli.build_parser("train"), ["train", "--config", "a=b.yaml"]).config == "a=b.yaml"


def test_a_command_without_a_run_config_refuses_overrides(capsys):
    with pytest.raises(SystemExit):
        cli.main(["quantize", "--model", "m", "--scheme", "w4a16", "--out", "o", "a.b=1"])
    assert "unrecognized arguments: a.b=1" in capsys.readouterr().err


def test_every_command_that_takes_a_run_config_takes_it_as_dash_dash_config(capsys, tmp_path):
    """``python -m launch.slurm submit --config X`` was refused (it wanted the config positional); the positional form
    still works, not both at once."""
    from megatron_qarl.launch import slurm

    out = f"train.output_dir={tmp_path}"
    assert slurm.main(["submit", "--dry-run", "--config", "configs/cpu_default.yaml", out, "--sbatch-arg=--time=5",
                       "launch.nodes=2"]) == 0
    flagged = capsys.readouterr().out
    assert "--nodes=2" in flagged and flagged.rstrip().endswith(f"configs/cpu_default.yaml {out} launch.nodes=2")
    assert slurm.main(["submit", "--dry-run", "configs/cpu_default.yaml", out, "--sbatch-arg=--time=5",
                       "launch.nodes=2"]) == 0
    assert capsys.readouterr().out == flagged
    with pytest.raises(SystemExit):
        slurm.main(["submit", "--dry-run", "--config", "configs/cpu_default.yaml", "configs/cpu_grpo.yaml"])
    assert "the config twice" in capsys.readouterr().err
    for command in ("train", "preflight", "plan"):
        parser = cli.build_parser(command)
        assert "--config" in cli._option_actions(parser), command
