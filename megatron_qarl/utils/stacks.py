"""Every thread's Python stack of a running run, on a signal: ``kill -USR2 <pid of qarl train>`` (docs/training.md,
"A run that stops moving").

SIGUSR2, because SIGUSR1 is Slurm's: slurm/qarl.sbatch passes it on to ``qarl train`` five minutes before the time
limit, which then stops after its step and exits 75 (train/cli.py). Three parts:

- ``install`` (every ``qarl`` process, cli.py): faulthandler's C-level handler prints every thread's stack to stderr
  the moment the signal arrives, whatever the main thread is doing (a collective, ``ray.get``), then chains to a
  Python handler that runs the forwarders registered with ``forward``;
- ``dump_to_file`` (a process that is no ``qarl`` command: a learner rank's Ray actor): the same dump, into a file;
- ``forward`` (the trainer, for its learner ranks' actors, launch/ray_launcher.py): on the signal, a thread sends it on
  to each target and copies what each target's dump adds to its file into the trainer's stderr, waiting
  ``FORWARD_WAIT_S`` at most for them all (a process stuck in the kernel may never write).

With ``launch.backend: local`` the one learner rank is the trainer's own threads: ``install``'s dump holds it.
"""

from __future__ import annotations

import faulthandler
import io
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO

STACKS_SIGNAL = signal.SIGUSR2
FORWARD_WAIT_S = 10.0  # how long the trainer waits for one target's dump to reach its file
_forwarders: list[Callable[[], None]] = []


def install(file: IO[str] | None = None) -> bool:
    """This process prints every thread's stack to ``file`` (stderr) on ``STACKS_SIGNAL`` and runs the registered
    forwarders; False (nothing installed) off the main thread, where stderr is no file, or without the signal."""
    out = sys.stderr if file is None else file
    try:
        signal.signal(STACKS_SIGNAL, _on_signal)
        faulthandler.register(STACKS_SIGNAL, file=out.fileno(), all_threads=True, chain=True)
    except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
        return False
    return True


def dump_to_file(path: Path) -> IO[str]:
    """This process prints every thread's stack into ``path`` (appended) on ``STACKS_SIGNAL``; the open file, which
    the caller keeps open as long as it should (faulthandler writes to its descriptor)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    f = path.open("a")  # noqa: SIM115 - kept open for the process's life
    faulthandler.register(STACKS_SIGNAL, file=f.fileno(), all_threads=True)
    return f


def _on_signal(signum: int, frame: object) -> None:
    for forwarder in list(_forwarders):
        forwarder()


@dataclass(frozen=True)
class Target:
    """A process to ask for its stacks: its label, how to send it the signal, and the file its dump goes to."""

    label: str
    send: Callable[[], None]
    file: Path


def forward(targets: list[Target], out: IO[str] | None = None) -> Callable[[], None]:
    """On ``STACKS_SIGNAL``, send it on to ``targets`` and copy each one's dump into ``out`` (stderr); returns the
    function that stops forwarding (the cluster's close)."""

    threads: list[threading.Thread] = []

    def on_signal() -> None:  # in the signal handler: the work goes to a thread, the handler returns at once
        threads.append(threading.Thread(target=run, name="qarl-stacks", daemon=True))
        threads[-1].start()

    def stop() -> None:  # a dump under way still reaches the log: waited for, within its own bound
        if on_signal in _forwarders:
            _forwarders.remove(on_signal)
        for t in threads:  # each send waits FORWARD_WAIT_S at most, and the dumps all together as long
            t.join(timeout=FORWARD_WAIT_S * (len(targets) + 1) + 5.0)

    def run() -> None:
        stream = sys.stderr if out is None else out
        sizes = [t.file.stat().st_size if t.file.exists() else 0 for t in targets]
        for t in targets:
            try:
                t.send()
            except Exception as err:  # noqa: BLE001 - a target already gone: say so, ask the others
                print(f"stacks: {t.label}: could not signal it: {type(err).__name__}: {err}", file=stream, flush=True)
        deadline = time.monotonic() + FORWARD_WAIT_S
        for t, size in zip(targets, sizes, strict=True):
            print(f"stacks: {t.label} ({t.file}):\n{_new_text(t.file, size, deadline)}", file=stream, flush=True)

    _forwarders.append(on_signal)
    return stop


def _new_text(path: Path, size: int, deadline: float) -> str:
    """What ``path`` gained past ``size`` bytes: waited for until it stops growing, until ``deadline`` at most."""
    last = -1
    while time.monotonic() < deadline:
        now = path.stat().st_size if path.exists() else 0
        if now > size and now == last:
            break
        last = now
        time.sleep(0.2)
    if not path.exists() or path.stat().st_size <= size:
        return f"  (no dump within {FORWARD_WAIT_S:g} s)"
    with path.open() as f:
        f.seek(size)
        return f.read().rstrip("\n")
