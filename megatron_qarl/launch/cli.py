"""``qarl slurm ...``: the Slurm launchers as a ``qarl`` subcommand, so they run from any directory (the installed
command, not ``python -m launch.*``, which needs the repository root on the path).

    qarl slurm submit [--dry-run] [--sbatch-arg=ARG ...] CONFIG [key.sub=value ...]   sbatch slurm/qarl.sbatch
    qarl slurm local-cluster --root DIR --nodes N         a real Slurm on this host, for trying the above

Everything after ``slurm`` goes to the launcher's own parser (``megatron_qarl/launch/slurm.py``, whose other
commands, ``env``, ``ray-node`` and ``wait-ray``, are the job script's; ``local-cluster``:
``megatron_qarl/launch/local_slurm.py``), so its flags and ``--help`` are its own. ``python -m launch.slurm`` and
``python -m launch.local_slurm`` run the same code from the repository root.
"""

from __future__ import annotations

import argparse

LOCAL_CLUSTER = "local-cluster"


def _run(args: argparse.Namespace) -> int:
    if args.argv and args.argv[0] == LOCAL_CLUSTER:
        from megatron_qarl.launch.local_slurm import main as local_cluster

        return local_cluster(args.argv[1:])
    from megatron_qarl.launch.slurm import main as slurm

    return slurm(args.argv)


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("slurm", help="submit a run to Slurm (or start a local one to try it)",
                                   description=__doc__.splitlines()[0], epilog=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("argv", nargs=argparse.REMAINDER, metavar="submit|local-cluster ...",
                        help="the launcher's command and arguments (qarl slurm submit --help)")
    parser.set_defaults(func=_run)
    return parser
