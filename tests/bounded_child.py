"""A test's work in a child process that cannot hang the suite: ``run_in_child(fn, *args, timeout_s=, name=)``.

The child is a fresh interpreter (spawn) that leads its own process group and registers faulthandler on SIGUSR1.
Past ``timeout_s`` without a result the parent asks it for every thread's stack (SIGUSR1), then SIGKILLs it and
every process under it (its servers, its Ray, its ranks: read from /proc through psutil before the kill, since a
server leads a session of its own), and raises ``ChildTimeout`` naming the run and where it was waiting. The same
kill runs on every other way out (the child died, the test was interrupted, pytest-timeout fired), so nothing it
started outlives the test.
"""

from __future__ import annotations

import faulthandler
import multiprocessing
import os
import pickle
import signal
import tempfile
import time
import traceback
from pathlib import Path

import psutil

STACK_GRACE_S = 3.0  # how long the child gets to write its stacks after SIGUSR1


class ChildTimeout(AssertionError):
    """A child gave no result within its bound; the message holds its stacks."""


def _entry(fn, args, conn, stacks_path: str) -> None:
    os.setsid()  # its own process group: the parent ends it and what it started at once
    stacks = open(stacks_path, "w")  # noqa: SIM115 - open for the process's life, written by faulthandler
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    try:
        conn.send(("ok", pickle.dumps(fn(*args))))
    except BaseException:  # noqa: BLE001 - every failure goes to the parent
        conn.send(("error", traceback.format_exc()[-8000:]))
    finally:
        conn.close()


def kill_tree(pid: int) -> list[int]:
    """SIGKILL ``pid``, every process under it and every process left in its process group (the child leads one:
    what it started and left behind, re-parented elsewhere once it exited); the pids killed."""
    procs = []
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        pass
    for p in psutil.process_iter():
        try:
            if p.pid != os.getpid() and os.getpgid(p.pid) == pid and p not in procs:
                procs.append(p)
        except (ProcessLookupError, psutil.Error):
            pass
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=10)
    return [p.pid for p in procs]


def run_in_child(fn, *args, timeout_s: float, name: str):
    """``fn(*args)`` in a fresh child process; its result (picklable), its exception re-raised here as a
    RuntimeError with the child's traceback, or ``ChildTimeout`` after ``timeout_s`` with its stacks."""
    ctx = multiprocessing.get_context("spawn")
    recv, send = ctx.Pipe(duplex=False)
    fd, stacks_path = tempfile.mkstemp(prefix="child-stacks-", suffix=".txt")
    os.close(fd)
    proc = ctx.Process(target=_entry, args=(fn, args, send, stacks_path), name=name, daemon=False)
    started = time.monotonic()
    proc.start()
    send.close()
    try:
        if not recv.poll(timeout_s):
            stacks = _stacks(proc.pid, stacks_path)
            killed = kill_tree(proc.pid)
            raise ChildTimeout(f"{name}: no result within {timeout_s:.0f} s; killed it and its {len(killed) - 1} "
                               f"descendant process(es). Where it waited (every thread's stack):\n{stacks}")
        try:
            status, value = recv.recv()
        except EOFError:
            proc.join(10)
            raise RuntimeError(f"{name}: the child exited (code {proc.exitcode}) after "
                               f"{time.monotonic() - started:.0f} s without a result") from None
        if status == "error":
            raise RuntimeError(f"{name} failed in its child process:\n{value}")
        return pickle.loads(value)
    finally:
        proc.join(10)
        kill_tree(proc.pid)  # anything still running under it (a server it left, its Ray)
        recv.close()
        Path(stacks_path).unlink(missing_ok=True)


def _stacks(pid: int, path: str) -> str:
    """Ask the child for every thread's stack (SIGUSR1: faulthandler) and read what it wrote once it stops
    growing, STACK_GRACE_S at most."""
    try:
        os.kill(pid, signal.SIGUSR1)
    except ProcessLookupError:
        return "(the child had already exited)"
    deadline, size = time.monotonic() + STACK_GRACE_S, -1
    while time.monotonic() < deadline:
        time.sleep(0.3)
        now = Path(path).stat().st_size
        if now and now == size:
            break
        size = now
    return Path(path).read_text(errors="replace")[-12000:] or "(no stacks written)"
