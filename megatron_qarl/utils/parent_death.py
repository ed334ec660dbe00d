"""Child processes that must not outlive the process that started them."""

from __future__ import annotations


def die_with_parent() -> None:
    """Run in a child (``preexec_fn``, a multiprocessing initializer): it gets SIGKILL when its parent dies
    (Linux ``PR_SET_PDEATHSIG``; elsewhere nothing). A ``kill -9`` of a trainer then leaves no rollout server
    or checkpoint-writer process behind holding ports and memory."""
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass
