"""Rewards for RL on math: the last ``\\boxed{...}`` answer of a response, checked against the ground truth.

Two kinds: ``exact`` (string equality of the boxed answer, in-process, the synthetic task's own reward) and
``math_verify`` (symbolic equivalence with the math-verify library: "0.5" matches "\\frac{1}{2}", "936.0"
matches "936"). math-verify runs sympy, which can take unbounded time on a pathological answer
("\\boxed{9^{9^{9}}}"), and its own timeouts use ``signal.alarm``, which only works in a main thread.

So ``RewardScorer`` verifies in a small pool of worker processes (plain ``python -c`` subprocesses, so no
``fork`` of a threaded trainer and no re-import of the caller's ``__main__``), each talking over a socket
pair. A deadline is enforced twice: inside the worker by an interval timer (``timeout_s``; interrupts sympy's
Python code, the worker lives on), and by the parent (``timeout_s + kill_grace_s``; catches code that
ignores signals, e.g. a long C-level big-integer operation): the stuck worker is killed and replaced.
Either way the item gets the incorrect reward and the ``timeouts`` counter goes up; ``score`` never hangs.
"""

from __future__ import annotations

import importlib
import json
import logging
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from megatron_qarl.data.math_task import extract_boxed
from megatron_qarl.utils.processes import reap

Verdict = Literal["correct", "incorrect", "timeout", "error"]
STAT_KEYS: tuple[str, ...] = ("timeouts", "no_answer", "errors", "workers_replaced")
# a worker must import sympy and math-verify and say "ready" within this many seconds
_WORKER_START_TIMEOUT_S = 120.0


class RewardConfig(BaseModel):
    """How responses are scored."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["math_verify", "exact"] = Field("math_verify", description="math-verify equivalence or exact match")
    timeout_s: float = Field(5.0, gt=0, description="per-response verification deadline (math_verify)")
    kill_grace_s: float = Field(1.0, gt=0, description="after timeout_s + this, a stuck worker is killed")
    workers: int = Field(1, ge=1, le=64, description="verification worker processes (math_verify)")
    correct_reward: float = Field(1.0, description="reward of a correct boxed answer")
    incorrect_reward: float = Field(0.0, description="reward of a wrong, missing, timed-out or failed answer")
    shuffle: bool = Field(False, description="control runs only: the update sees each group's rewards in a "
                          "seeded random order (shuffle_rewards_in_groups); evaluation and reward/* metrics "
                          "stay true")

    @model_validator(mode="after")
    def _check(self) -> RewardConfig:
        if self.correct_reward <= self.incorrect_reward:
            raise ValueError(f"correct_reward ({self.correct_reward}) must exceed incorrect_reward "
                             f"({self.incorrect_reward})")
        return self


def shuffle_rewards_in_groups(rewards: Sequence[float], group_size: int, seed: int, step: int) -> list[float]:
    """The shuffled-reward control (``reward.shuffle``): each group of ``group_size`` consecutive rewards
    (the G samples of one prompt) permuted by a generator seeded with (seed, step).

    A group keeps its multiset of rewards, so the advantages have the same magnitudes and the same groups
    are all-equal (A = 0) as with true rewards; only which response gets which reward is random. Training
    on this measures what the update does without a reward signal (drift, or quantization adaptation).
    """
    import random

    if group_size < 1 or len(rewards) % group_size:
        raise ValueError(f"{len(rewards)} rewards do not split into groups of {group_size}")
    rng = random.Random(f"reward-shuffle:{seed}:{step}")
    out: list[float] = []
    for i in range(0, len(rewards), group_size):
        group = list(rewards[i : i + group_size])
        rng.shuffle(group)
        out.extend(group)
    return out


class _QuietTimeoutWarning(logging.Filter):
    """Drops math-verify's "Timeout is disabled" warning: we disable its alarms because we run our own."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Timeout is disabled")


for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_QuietTimeoutWarning())


def _gold_latex(ground_truth: str) -> str:
    """The ground truth as math-verify's parser expects it: in ``$...$`` unless it is already delimited."""
    gt = ground_truth.strip()
    return gt if ("$" in gt or "\\boxed" in gt) else f"${gt}$"


def verify_boxed(boxed: str, ground_truth: str) -> bool:
    """Whether the boxed answer ``boxed`` is equivalent to ``ground_truth`` according to math-verify.

    No timeout of its own (math-verify's alarms are off so they cannot cancel the caller's timer): call it
    through ``judge`` or ``RewardScorer``.
    """
    from math_verify import parse, verify

    gold = parse(_gold_latex(ground_truth), parsing_timeout=None)
    pred = parse(f"\\boxed{{{boxed}}}", parsing_timeout=None)
    if not gold or not pred:
        return False
    return bool(verify(gold, pred, timeout_seconds=None))


class _Deadline(BaseException):
    """Raised by the interval timer; a BaseException so that library ``except Exception`` cannot swallow it."""


def judge(verify_fn: Callable[[str, str], bool], boxed: str, ground_truth: str, timeout_s: float) -> Verdict:
    """Run ``verify_fn(boxed, ground_truth)`` under a ``timeout_s`` interval timer; main thread only.

    Returns "correct"/"incorrect", "timeout" when the timer fired, or "error" when ``verify_fn`` raised.
    """
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("judge uses signal timers and must run in the main thread; use RewardScorer instead")
    armed = [True]

    def on_alarm(signum, frame):
        if armed[0]:
            raise _Deadline

    previous = signal.signal(signal.SIGALRM, on_alarm)
    try:
        try:
            signal.setitimer(signal.ITIMER_REAL, timeout_s)
            return "correct" if verify_fn(boxed, ground_truth) else "incorrect"
        finally:
            armed[0] = False
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
    except _Deadline:
        return "timeout"
    except Exception:  # a failing comparison is a wrong answer, counted by the caller
        return "error"


def _function_spec(fn: Callable[[str, str], bool]) -> str:
    """``"module:qualname"`` of a module-level function, which a worker process can import."""
    spec = f"{fn.__module__}:{fn.__qualname__}"
    if "<" in spec or fn.__module__ == "__main__":
        raise ValueError(f"verify_fn must be a module-level function of an importable module, got {spec}")
    return spec


def _import_function(spec: str) -> Callable[[str, str], bool]:
    """Inverse of ``_function_spec``."""
    module, _, qualname = spec.partition(":")
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def worker_main(fd: int, fn_spec: str) -> None:
    """Body of a verification worker: say "ready", then answer ``(item, boxed, truth, timeout_s)`` messages.

    Exits on end of input or a ``None`` message. Ignores SIGINT: the parent owns the worker's lifetime.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    conn = Connection(fd)
    verify_fn = _import_function(fn_spec)
    verify_boxed("\\frac{1}{2}", "0.5")  # pay sympy's imports and first-parse set-up before any deadline runs

    conn.send(("ready", os.getpid()))
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        if message is None:
            return
        item, boxed, ground_truth, timeout_s = message
        conn.send((item, judge(verify_fn, boxed, ground_truth, timeout_s)))


_WORKER_BOOT = (
    "import sys, json; sys.path[:] = json.loads(sys.argv[1]); "
    "from megatron_qarl.data.reward import worker_main; worker_main(int(sys.argv[2]), sys.argv[3])"
)


@dataclass(eq=False)
class _Worker:
    """One worker process, its connection, and the item it is working on."""

    proc: subprocess.Popen
    conn: Connection
    started: float
    ready: bool = False
    item: tuple[int, int] | None = None  # (call number, index in that call)
    deadline: float = math.inf

    def stop(self, kill: bool) -> None:
        """End the process (kill, or ask politely then kill after a second) and close the connection."""
        if not kill:
            try:
                self.conn.send(None)
            except OSError:
                pass
            try:
                self.proc.wait(timeout=1.0)
            except subprocess.TimeoutExpired:
                kill = True
        if kill:
            reap(self.proc, "reward worker", grace_s=0.0)
        self.conn.close()


def _start_worker(fn_spec: str) -> _Worker:
    """Start a worker process connected by a socket pair; it inherits this process's sys.path."""
    parent_sock, child_sock = socket.socketpair()
    child_fd = child_sock.fileno()
    proc = subprocess.Popen(
        [sys.executable, "-c", _WORKER_BOOT, json.dumps(sys.path), str(child_fd), fn_spec],
        pass_fds=(child_fd,), stdin=subprocess.DEVNULL,
    )
    child_sock.close()
    return _Worker(proc=proc, conn=Connection(parent_sock.detach()), started=time.monotonic())


class RewardScorer:
    """Scores batches of responses against ground-truth answers; safe to call from any thread.

    ``verify_fn`` (a module-level function ``(boxed, ground_truth) -> bool``) replaces math-verify, e.g. in
    tests. Workers start in the constructor; call ``close()`` (or use ``with``) to end them.
    """

    def __init__(self, config: RewardConfig, verify_fn: Callable[[str, str], bool] = verify_boxed) -> None:
        self.config = config
        self.totals: dict[str, int] = dict.fromkeys(STAT_KEYS, 0)
        self._fn_spec = _function_spec(verify_fn)
        self._lock = threading.Lock()
        self._workers: list[_Worker] = []
        self._closed = False
        self._calls = 0  # numbers each score() call, so a late answer from an aborted call is ignored
        if config.kind == "math_verify":
            self._workers = [_start_worker(self._fn_spec) for _ in range(config.workers)]

    def __enter__(self) -> RewardScorer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def worker_pids(self) -> list[int]:
        """Process ids of the current workers (for tests and diagnostics)."""
        return [w.proc.pid for w in self._workers]

    def score(self, responses: Sequence[str], answers: Sequence[str]) -> tuple[list[float], dict[str, int]]:
        """Rewards of ``responses[i]`` against ``answers[i]`` and this call's counters (``STAT_KEYS``)."""
        if len(responses) != len(answers):
            raise ValueError(f"{len(responses)} responses but {len(answers)} answers")
        cfg = self.config
        rewards = [cfg.incorrect_reward] * len(responses)
        stats = dict.fromkeys(STAT_KEYS, 0)
        todo: deque[tuple[int, str, str]] = deque()
        for i, (response, answer) in enumerate(zip(responses, answers, strict=True)):
            boxed = extract_boxed(response)
            if boxed is None:
                stats["no_answer"] += 1
            elif cfg.kind == "exact":
                rewards[i] = cfg.correct_reward if boxed == answer.strip() else cfg.incorrect_reward
            else:
                todo.append((i, boxed, answer))
        if todo:
            with self._lock:
                if self._closed:
                    raise RuntimeError("RewardScorer is closed")
                verdicts = self._run(todo, stats)
            for i, verdict in verdicts.items():
                rewards[i] = cfg.correct_reward if verdict == "correct" else cfg.incorrect_reward
                stats["timeouts"] += verdict == "timeout"
                stats["errors"] += verdict == "error"
        for key, value in stats.items():
            self.totals[key] += value
        return rewards, stats

    def _replace(self, worker: _Worker, stats: dict[str, int]) -> None:
        """Kill ``worker`` and start a fresh one in its place."""
        worker.stop(kill=True)
        self._workers[self._workers.index(worker)] = _start_worker(self._fn_spec)
        stats["workers_replaced"] += 1

    def _run(self, todo: deque[tuple[int, str, str]], stats: dict[str, int]) -> dict[int, Verdict]:
        """Hand items to idle workers until every item has a verdict; enforce deadlines by killing workers."""
        cfg = self.config
        verdicts: dict[int, Verdict] = {}
        total = len(todo)
        self._calls += 1
        call = self._calls
        while len(verdicts) < total:
            now = time.monotonic()
            for w in self._workers:
                if w.ready and w.item is None and todo:
                    item, boxed, answer = task = todo.popleft()
                    try:
                        w.conn.send(((call, item), boxed, answer, cfg.timeout_s))
                    except OSError:  # the idle worker died: requeue the item on a fresh one
                        todo.appendleft(task)
                        self._replace(w, stats)
                        continue
                    w.item, w.deadline = (call, item), now + cfg.timeout_s + cfg.kill_grace_s
            next_event = min(w.deadline if w.ready else w.started + _WORKER_START_TIMEOUT_S for w in self._workers)
            for conn in wait([w.conn for w in self._workers], timeout=max(0.0, next_event - now)):
                w = next(w for w in self._workers if w.conn is conn)
                try:
                    message = conn.recv()
                except (EOFError, OSError):
                    if not w.ready:
                        # it closed its socket: it is exiting; its own exit code, not SIGTERM's (-15)
                        code = reap(w.proc, "reward worker", exit_wait_s=5.0, grace_s=5.0)
                        message = f"reward worker exited during start-up (code {code}); see its stderr"
                        raise RuntimeError(message) from None
                    if w.item is not None and w.item[0] == call:
                        verdicts[w.item[1]] = "error"
                    self._replace(w, stats)
                    continue
                if message[0] == "ready":
                    w.ready = True
                else:
                    (answer_call, item), verdict = message
                    if answer_call == call:
                        verdicts[item] = verdict
                    w.item, w.deadline = None, math.inf
            now = time.monotonic()
            for w in list(self._workers):
                if w.item is not None and now >= w.deadline:
                    if w.item[0] == call:
                        verdicts[w.item[1]] = "timeout"
                    self._replace(w, stats)
                elif not w.ready and now >= w.started + _WORKER_START_TIMEOUT_S:
                    raise RuntimeError(f"reward worker did not start within {_WORKER_START_TIMEOUT_S:.0f} s")
        return verdicts

    def close(self) -> None:
        """End all workers (idempotent)."""
        with self._lock:
            for w in self._workers:
                w.stop(kill=w.item is not None)
            self._workers = []
            self._closed = True
