"""One rollout server as a supervised child process: the embedded ``qarl serve`` or SGLang's launcher.

``ServerProcess`` starts the command, waits for ``/health``, says whether it is still alive and
restarts it on the same port. The launchers (megatron_qarl/launch/: local.py directly, ray_launcher.py inside a
Ray actor) own one per server; the trainer only sees URLs.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from megatron_qarl.errors import UserError
from megatron_qarl.utils.http import tls_context
from megatron_qarl.utils.parent_death import die_with_parent
from megatron_qarl.utils.processes import reap


def embedded_command(model_dir: str, port: int, *, host: str = "127.0.0.1", dtype: str = "bfloat16",
                     max_batch_size: int = 128, max_seq_len: int | None = None,
                     return_routed_experts: bool = False, python: str = sys.executable,
                     numerics: str = "default", kv_cache_dtype: str = "auto") -> list[str]:
    """``qarl serve`` for a Hugging Face directory (BF16 or a qat/ export), run by ``python``. Its API key goes in
    its environment ($QARL_API_KEY, ``launch.fleet.server_env``), never this argv."""
    cmd = [python, "-m", "megatron_qarl.cli", "serve", "--model", model_dir, "--host", host,
           "--port", str(port), "--dtype", dtype, "--max-batch-size", str(max_batch_size)]
    cmd += ["--max-seq-len", str(max_seq_len)] if max_seq_len else []
    cmd += ["--enable-return-routed-experts"] if return_routed_experts else []
    cmd += ["--numerics", numerics] if numerics != "default" else []
    cmd += ["--kv-cache-dtype", kv_cache_dtype] if kv_cache_dtype != "auto" else []
    return cmd


class ServerProcess:
    """A rollout server command, its log file and its URL."""

    def __init__(self, command: list[str], url: str, log_path: str | Path, *, env: dict[str, str] | None = None,
                 startup_timeout_s: float = 300.0, secret: str | None = None):
        """``secret``: the server's API key, which SGLang writes into its log with its other settings: the log is
        readable by this user only, and ``log_tail`` (what errors quote) masks it."""
        self.command, self.url, self.log_path = list(command), url, Path(log_path)
        self.secret = secret
        self.env = dict(os.environ, **(env or {}))
        self.startup_timeout_s = startup_timeout_s
        self.proc: subprocess.Popen | None = None
        self.spawned_at = 0.0

    def start(self) -> str:
        """Start (or restart) the server and wait until /health answers 200; return its URL."""
        self.spawn()
        return self.wait_ready()

    def spawn(self) -> None:
        """Start the server process and return at once (``wait_ready`` waits for it): a launcher starts every
        server, and builds its learner, while they load."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.fchmod(fd, 0o600)  # also a log an earlier run created
        with os.fdopen(fd, "ab") as log:
            # its own process group: a server's helper processes (vLLM's engine core and workers) are stopped with
            # it, also when the server itself died by SIGKILL (they would outlive it, holding memory and cores)
            self.proc = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                         preexec_fn=die_with_parent, start_new_session=True)
        self.spawned_at = time.monotonic()

    def wait_ready(self) -> str:
        """Wait until the spawned server's /health answers 200 (rollout.startup_timeout_s from its spawn); return
        its URL. A server that exits or stays unhealthy is a UserError with the last lines of its log."""
        if self.proc is None:
            raise RuntimeError(f"rollout server {self.url}: wait_ready() before spawn()")
        deadline = self.spawned_at + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise UserError(f"rollout server {self.url} exited with code {self.proc.returncode} while starting; "
                                f"last lines of {self.log_path}:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2.0, verify=tls_context()).status_code == 200:
                    return self.url
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise UserError(f"rollout server {self.url} not healthy after {self.startup_timeout_s:.0f} s; "
                        f"see {self.log_path}:\n{self.log_tail()}")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def restart(self) -> str:
        self.stop()
        return self.start()

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL after 10 s), then whatever is left of its process group."""
        if self.proc is None:
            return
        reap(self.proc, f"rollout server {self.url}", grace_s=10.0)
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the group's id is the server's pid (start_new_session)
        except (ProcessLookupError, PermissionError):
            pass  # nothing left of it
        self.proc = None

    def log_tail(self, lines: int = 20) -> str:
        try:
            tail = "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"
        return tail.replace(self.secret, "***") if self.secret else tail
