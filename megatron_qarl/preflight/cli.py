"""``qarl preflight --config C [key.sub=value ...]``: is this run ready, before any weight loads?

Loads the config as ``qarl train`` does (same overrides; a bad key is refused naming it, exit 2), then checks on this
node and lists every finding at once, each problem naming the config key, the environment and the fix:

- the GPU memory plan (``qarl train``'s ``check_memory``: GPU runs only);
- every data source the run reads exists and its first row has the keys the loader reads (``data_finding``);
- the bounds on the run's waits, and NCCL honouring ``launch.collective_timeout_s`` (``timeouts_finding``);
- the learner's environment (this interpreter) imports Megatron-Core; the servers' environment
  (``rollout.launch_prefix`` + ``rollout.server_python``) exists and imports its backend;
- one NCCL in every member of the weight-update group; Transformer Engine inside megatron-core's tested range; the
  NVIDIA driver new enough for each environment's torch CUDA build (preflight/versions.py);
- the server command accepted by the backend's own parser inside the servers' environment;
- a weight-update round trip: a real process group between this process and one of the servers' environment
  (gloo here, NCCL on GPUs), one bucket sent and compared (preflight/roundtrip.py; ``--no-round-trip`` skips it).

Exit 0 when every check passes, 1 when any fails. ``qarl train`` runs the same checks but the round trip before it
builds anything; ``slurm/qarl.sbatch`` runs this on every node first and stops the job with its report.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys

from megatron_qarl.cli import add_config_args
from megatron_qarl.config import QarlConfig
from megatron_qarl.errors import UserError
from megatron_qarl.launch.fleet import learner_env
from megatron_qarl.moe.parallelize import nccl_timeout_problem
from megatron_qarl.preflight.data import data_finding
from megatron_qarl.preflight.environments import check_environments
from megatron_qarl.preflight.report import Finding, format_report, problems
from megatron_qarl.preflight.rules import load_config

EXIT_NOT_READY = 1


def memory_finding(cfg: QarlConfig, config: str) -> Finding:
    """``qarl train``'s refusal of a GPU run that ``qarl plan`` says does not fit, as a finding."""
    from megatron_qarl.train.cli import check_memory

    if not cfg.learner_on_gpus:
        return Finding("GPU memory plan", True, "a CPU run (no GPU memory to plan)")
    if not cfg.launch.memory_check:
        return Finding("GPU memory plan", True, "not checked: launch.memory_check=false")
    try:
        check_memory(cfg, config)
    except UserError as err:
        return Finding("GPU memory plan", False, str(err), env="the run's GPUs",
                       fix=f"qarl plan --config {config} shows the layouts that fit")
    return Finding("GPU memory plan", True, f"fits (qarl plan --config {config})")


def timeouts_finding(cfg: QarlConfig, environ=os.environ) -> Finding:
    """The run's bounds on its waits (docs/cluster.md, "Every wait is bounded"), and whether NCCL will honour
    ``launch.collective_timeout_s`` in the environment the learner ranks get (this one, which the job's Ray and a
    local Ray hand on, plus ``launch.fleet.learner_env``): with async error handling off (``moe.parallelize.
    nccl_timeout_problem``: ``TORCH_NCCL_ASYNC_ERROR_HANDLING=0``, or the legacy ``NCCL_ASYNC_ERROR_HANDLING=0``, and no
    blocking wait) torch's watchdog only logs a timed-out NCCL collective, and the ranks wait on; the Ray driver then
    waits ``launch.rank_timeout_s`` and names the call, not the collective. Each rank checks its own environment
    again before it joins its groups (``LearnerWorker.setup``)."""
    r, la = cfg.rollout, cfg.launch
    detail = (f"launch.collective_timeout_s {la.collective_timeout_s:g} s, launch.checkpoint_timeout_s "
              f"{la.checkpoint_timeout_s:g} s and the sync's peer wait {r.sync.peer_wait_s:g} s (2 x "
              f"rollout.sync.timeout_s {r.sync.timeout_s:g} s + {r.sync.peer_wait_s - 2 * r.sync.timeout_s:g} s) < "
              f"launch.rank_timeout_s {la.rank_timeout_s:g} s; rollout.startup_timeout_s {r.startup_timeout_s:g} s, "
              f"rollout.timeout_s {r.timeout_s:g} s")
    problem = nccl_timeout_problem({**environ, **learner_env(cfg)}) if cfg.learner_on_gpus else None
    if problem:
        return Finding("bounded waits", False, f"{problem} (launch.collective_timeout_s {la.collective_timeout_s:g} "
                       "s, and every other NCCL bound of the run, would not be honoured)",
                       key="launch.collective_timeout_s", env="learner",
                       fix="unset TORCH_NCCL_ASYNC_ERROR_HANDLING and NCCL_ASYNC_ERROR_HANDLING (torch's default, 3, "
                           "ends the process group) in the job's environment, which the learner ranks inherit")
    return Finding("bounded waits", True, detail)


def preflight(cfg: QarlConfig, config: str, *, round_trip: bool = True) -> list[Finding]:
    """Every check of the run on this node, as findings."""
    return [memory_finding(cfg, config), timeouts_finding(cfg), data_finding(cfg),
            *check_environments(cfg, round_trip=round_trip)]


def _run(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides)
    findings = preflight(cfg, str(args.config), round_trip=not args.no_round_trip)
    r = cfg.rollout
    title = (f"qarl preflight {args.config} on {socket.gethostname()}: rollout.backend={r.backend}, "
             f"{r.servers} server(s), learner python {sys.executable}")
    print(format_report(title, findings), flush=True)
    return EXIT_NOT_READY if problems(findings) else 0


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("preflight", help="check a run's environments before it starts",
                                   description=__doc__.splitlines()[0])
    parser.add_argument("--no-round-trip", action="store_true",
                        help="skip the weight-update round trip (what qarl train runs)")
    add_config_args(parser, config_help="YAML run config, as for qarl train")
    parser.set_defaults(func=_run)
    return parser
