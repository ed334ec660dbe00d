"""preflight/probe.py running in another environment, as a server would run there: its argv is the servers'
interpreter (``rollout.launch_prefix`` + ``rollout.server_python``) and the probe file, its environment the servers'
(launch/fleet.py ``server_env``); its answers read one at a time, so the learner can act between them."""

from __future__ import annotations

import json
import shlex
import subprocess
import tempfile
import threading
from pathlib import Path

from megatron_qarl.preflight import probe

PROBE_FILE = Path(probe.__file__).resolve()


class ProbeProcess:
    """preflight/probe.py running in an environment (``interpreter``: its argv, prefix included), told ``task``;
    its answers one at a time (``next``), killed after ``timeout_s``."""

    def __init__(self, interpreter: list[str], env: dict[str, str], task: dict, timeout_s: float):
        self.cmd = [*interpreter, "-c", probe.RUN, str(PROBE_FILE)]
        self.stderr = tempfile.TemporaryFile(mode="w+")  # a backend's logs: never a pipe that can fill up
        self.proc = subprocess.Popen(self.cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr,
                                     text=True, env=env)
        self.proc.stdin.write(json.dumps(task))
        self.proc.stdin.close()
        self.proc.stdin = None  # written and closed: communicate() in close() would flush it (ValueError)
        self.killed = ""  # why this side killed it, for ``failure``
        self.timer = threading.Timer(timeout_s, self._kill, args=(f"killed after {timeout_s:.0f} s",))
        self.timer.daemon = True
        self.timer.start()
        self.timeout_s = timeout_s

    def next(self) -> dict | None:
        """The probe's next answer, or None once it has ended."""
        for line in self.proc.stdout:
            if line.startswith(probe.MARK):
                return json.loads(line[len(probe.MARK):])
        return None

    def failure(self) -> str:
        """How the probe ended, for a problem: exit code (or killed after the timeout) and its stderr's tail."""
        self.close()
        self.stderr.seek(0)
        tail = " | ".join(self.stderr.read().strip().splitlines()[-4:])
        how = self.killed or f"exit {self.proc.returncode}"
        return f"{shlex.join(self.cmd)}: {how}{': ' + tail if tail else ''}"

    def _kill(self, why: str) -> None:
        self.killed = self.killed or why
        self.proc.kill()

    def close(self) -> None:
        """Stop listening: the probe gets 5 s to exit on its own once this side is done with it, its output drained
        meanwhile (a full pipe would block it), then it is killed and drained again, 10 s at most."""
        self.timer.cancel()
        try:
            self.proc.communicate(timeout=5.0)
        except subprocess.TimeoutExpired:
            self._kill("killed 5 s after its last answer was read")
            try:
                self.proc.communicate(timeout=10.0)
            except subprocess.TimeoutExpired:
                pass  # stuck in the kernel even after SIGKILL: nothing more to wait for
