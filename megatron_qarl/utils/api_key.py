"""The rollout API key's way to every process of a run: the environment, or a file only the run's user can read;
never an argv, which every user of a node sees (``ps``, /proc/PID/cmdline, a Slurm job's log).

- ``qarl train`` / ``qarl preflight``: ``rollout.api_key`` from the config, else ``$QARL_API_KEY``
  (``config.RolloutConfig``); the Slurm job makes one per job and exports it (launch/slurm.py ``job_env``).
  The key is never written out with the config (``config.yaml``, checkpoints).
- the embedded server (``qarl serve``): ``$QARL_API_KEY`` (``--api-key`` remains for a server started by hand).
- SGLang 0.5.23 reads its key from ``--api-key`` only, and no environment variable; it reads any flag from a YAML
  file given as ``--config FILE`` (sglang/srt/server_args.py ``prepare_server_args``, its
  ``ConfigArgumentMerger``), so the key goes into such a file, mode 0600 (``sglang_key_file``).
- vLLM reads ``$VLLM_API_KEY`` (rollout/vllm_launcher.py ``vllm_env``).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from pathlib import Path

import yaml

ENV = "QARL_API_KEY"


def from_env(env: Mapping[str, str] = os.environ) -> str | None:
    """The key the environment carries, None when unset or empty."""
    return env.get(ENV) or None


def sglang_key_file(key: str, directory: str | Path, name: str) -> Path:
    """``directory/name``: the YAML file SGLang's ``--config`` reads, holding only ``api-key``; readable and
    writable by this user alone (0600), written whole under another name and renamed into place, so a server that
    starts meanwhile reads the old file or the new one, never an empty one (SGLang takes an empty YAML for no
    settings: a server without its key)."""
    path = Path(directory) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{name}.")  # mkstemp: 0600
    try:
        with os.fdopen(fd, "w") as f:
            f.write(yaml.safe_dump({"api-key": key}))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
