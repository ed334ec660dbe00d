"""The `qarl` command.

Each subcommand lives in the module that owns the concept and exposes
``register(subparsers)``, which adds its parser and sets ``func`` (called with the parsed
namespace, returning an exit code). Only subcommands that work are listed here; each is registered under
the name its module gives it, which must be its key in ``SUBCOMMANDS``.
"""

from __future__ import annotations

import argparse
import importlib
import sys

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


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv[0] if argv else None).parse_args(argv)
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
