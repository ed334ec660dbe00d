"""The `qarl` command.

Each subcommand lives in the module that owns the concept and exposes
``register(subparsers)``, which adds its parser and sets ``func`` (called with the parsed
namespace, returning an exit code). Only subcommands that work are listed here.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from megatron_qarl.errors import UserError

# module path of each subcommand provider, in the order `qarl --help` shows them
SUBCOMMANDS: list[str] = [
    "megatron_qarl.train_cli",  # qarl train
    "megatron_qarl.moe.verify",  # qarl convert verify
    "megatron_qarl.data.evaluate",  # qarl eval
    "megatron_qarl.qat.cli",  # qarl quantize
    "megatron_qarl.plan_cli",  # qarl plan
    "megatron_qarl.rollout.serve_cli",  # qarl serve
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="qarl", description=__doc__.splitlines()[0])
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in SUBCOMMANDS:
        importlib.import_module(module).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except UserError as err:
        print(f"qarl {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
