"""The `qarl` command.

Each subcommand lives in the module that owns the concept and exposes
``register(subparsers)``, which adds its parser and sets ``func`` (called with the parsed
namespace, returning an exit code). Only subcommands that work are listed here; each is registered under
the name its module gives it, which must be its key in ``SUBCOMMANDS``.
"""

from __future__ import annotations

import argparse
import importlib
import re
import sys
from collections.abc import Sequence

from megatron_qarl.errors import UserError
from megatron_qarl.utils import stacks

# the module of each subcommand, in the order `qarl --help` shows them
SUBCOMMANDS: dict[str, str] = {
    "train": "megatron_qarl.train.cli",
    "preflight": "megatron_qarl.preflight.cli",
    "convert": "megatron_qarl.moe.verify",
    "eval": "megatron_qarl.data.evaluate",
    "quantize": "megatron_qarl.qat.cli",
    "plan": "megatron_qarl.plan.cli",
    "serve": "megatron_qarl.serve.cli",
    "data": "megatron_qarl.data.prepare",
    "slurm": "megatron_qarl.launch.cli",
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser of ``command`` alone when it names a subcommand (only its module is imported: `qarl serve`, which
    every rollout server runs, skips the trainer's imports), else of them all (``--help``, a typo)."""
    parser = argparse.ArgumentParser(prog="qarl", description=__doc__.splitlines()[0])
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module in SUBCOMMANDS.items():
        if command not in SUBCOMMANDS or command == name:  # None (no command) is not a key
            importlib.import_module(module).register(subparsers)
    return parser


# a config override on the command line: ``key.sub=value`` (a dotted key of identifiers, then ``=``)
OVERRIDE = re.compile(r"[A-Za-z_][\w-]*(?:\.[\w-]+)*=")


def add_config_args(parser: argparse.ArgumentParser, *, required: bool = True, positional: bool = False,
                    config_help: str = "YAML run config (configs/cpu_default.yaml)") -> None:
    """The run config of a command: ``--config FILE`` and ``key.sub=value`` overrides, taken wherever they stand on
    the command line when the command line is read with ``parse_args`` below (every command that takes a run config
    takes it this way: qarl train / preflight / plan, ``python -m launch.slurm submit``, the benchmarks).
    ``positional``: the config may also be given as the first bare word (``submit CONFIG``, the older form)."""
    if positional:
        parser.add_argument("config_word", nargs="?", metavar="CONFIG", help="the run config (or --config)")
        parser.add_argument("--config", default=None, help=config_help)
        parser.set_defaults(_config_required=required)
    else:
        parser.add_argument("--config", required=required, help=config_help)
    parser.add_argument("overrides", nargs="*", metavar="key.sub=value",
                        help="config overrides, anywhere on the command line (later ones win)")


def _option_actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Every option string of ``parser`` and of its subcommands' parsers, with its action."""
    out = dict(parser._option_string_actions)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                out.update(_option_actions(sub))
    return out


def _remainder_commands(parser: argparse.ArgumentParser) -> set[str]:
    """The subcommands of ``parser`` that take the rest of the line as it is (``qarl slurm``: its launcher's own
    parser, which takes the overrides itself)."""
    out = set()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                if any(a.nargs == argparse.REMAINDER for a in sub._actions):
                    out.add(name)
    return out


def split_overrides(parser: argparse.ArgumentParser, argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """(the rest of ``argv``, the ``key.sub=value`` words in it, in order). A word is an override wherever it stands,
    except as the value of an option that takes exactly one (``--config a=b.yaml``) or after ``--``; an option whose
    value is optional (``--resume [CHECKPOINT]``) or a list takes no override-shaped word as its value."""
    actions = _option_actions(parser)
    passthrough = _remainder_commands(parser)
    rest: list[str] = []
    overrides: list[str] = []
    value_next = False  # the word before was an option that takes exactly one value (nargs None)
    for i, word in enumerate(argv):
        if word == "--" or (not rest and word in passthrough):  # a command that hands its words to its own parser
            rest += argv[i:]
            break
        if not value_next and OVERRIDE.match(word):
            overrides.append(word)
            continue
        rest.append(word)
        action = None if value_next else actions.get(word)
        value_next = action is not None and action.nargs is None
    return rest, overrides


def parse_args(parser: argparse.ArgumentParser, argv: Sequence[str] | None = None) -> argparse.Namespace:
    """``parser.parse_args(argv)``, with ``key.sub=value`` overrides taken wherever they stand
    (``qarl train --config X --no-progress a.b=1 --resume c.d=2``): they are set apart first (``split_overrides``),
    the rest is parsed, and they land in ``args.overrides`` in their order. A command that takes no overrides refuses
    them as unrecognized arguments; with ``add_config_args(positional=True)`` the config is ``--config`` or the
    first bare word, not both."""
    argv = list(sys.argv[1:] if argv is None else argv)
    rest, overrides = split_overrides(parser, argv)
    args = parser.parse_args(rest)
    if overrides:
        if not hasattr(args, "overrides"):
            parser.error(f"unrecognized arguments: {' '.join(overrides)}")
        args.overrides = [*args.overrides, *overrides]
    if hasattr(args, "config_word"):
        word = args.__dict__.pop("config_word")
        if word is not None and args.config is not None:
            parser.error(f"the config twice: --config {args.config} and {word}")
        args.config = args.config if args.config is not None else word
        if args.__dict__.pop("_config_required", False) and args.config is None:
            parser.error("the following arguments are required: --config (or CONFIG)")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(build_parser(argv[0] if argv else None), argv)
    # a run that stops moving: `kill -USR2 <pid>` prints every thread's stack to stderr (the trainer's log, a server's
    # log), the trainer's learner ranks' too (utils/stacks.py); SIGUSR1 stays Slurm's (qarl train: stop after the step)
    stacks.install()
    try:
        return int(args.func(args) or 0)
    except UserError as err:
        print(f"qarl {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
