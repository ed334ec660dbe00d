"""Ending a child process within a bound: every wait on a child in the product goes through ``reap``."""

from __future__ import annotations

import logging
import signal
import subprocess

log = logging.getLogger(__name__)


def reap(proc: subprocess.Popen, what: str, *, grace_s: float = 10.0, kill_wait_s: float = 10.0,
         exit_wait_s: float = 0.0) -> int | None:
    """End ``proc`` and collect its exit code, waiting ``exit_wait_s + grace_s + kill_wait_s`` at most: up to
    ``exit_wait_s`` for a child that is exiting by itself (its own exit code, not the signal's), then SIGTERM and up
    to ``grace_s`` for it to exit (``grace_s`` 0: SIGKILL at once), then SIGKILL and up to ``kill_wait_s``. A child
    that outlives even SIGKILL (stuck in the kernel) is logged by ``what`` and left; returns its exit code, or None
    for such a child."""
    if exit_wait_s > 0:
        try:
            return proc.wait(timeout=exit_wait_s)
        except subprocess.TimeoutExpired:
            pass
    if proc.poll() is None and grace_s > 0:
        proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
    if proc.poll() is None:
        proc.kill()
    try:
        return proc.wait(timeout=kill_wait_s)
    except subprocess.TimeoutExpired:
        log.warning("%s (pid %d) did not exit %.0f s after SIGKILL; leaving it", what, proc.pid, kill_wait_s)
        return None
