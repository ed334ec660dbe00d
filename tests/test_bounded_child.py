"""The suite's bound on a child process (tests/bounded_child.py): a stuck child is killed with what it started,
and the error says where it waited."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import psutil
import pytest
from bounded_child import ChildTimeout, run_in_child


def sleep_forever_with_a_grandchild(pid_file: str) -> None:
    grandchild = subprocess.Popen(["sleep", "3600"], start_new_session=True)  # a server leads its own session
    Path(pid_file).write_text(str(grandchild.pid))
    wait_here_forever()


def wait_here_forever() -> None:
    while True:
        time.sleep(1)


def add(a: int, b: int) -> int:
    return a + b


def fail() -> None:
    raise ValueError("the child's own error")


def test_a_child_that_sleeps_forever_is_killed_within_its_bound_with_its_stack_and_its_grandchild(tmp_path):
    pid_file = tmp_path / "grandchild.pid"
    t0 = time.monotonic()
    with pytest.raises(ChildTimeout) as err:
        run_in_child(sleep_forever_with_a_grandchild, str(pid_file), timeout_s=8, name="sleeper run")
    took = time.monotonic() - t0
    assert took < 8 + 3 + 10 + 5, took  # the bound, the stack grace, the kill's wait, slack for a loaded machine
    text = str(err.value)
    assert "sleeper run: no result within 8 s" in text
    assert "wait_here_forever" in text and "sleep_forever_with_a_grandchild" in text  # where it waited
    pid = int(pid_file.read_text())
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_a_child_returns_its_result_or_raises_its_error_with_its_traceback():
    assert run_in_child(add, 2, 3, timeout_s=60, name="adder") == 5
    with pytest.raises(RuntimeError, match=r"(?s)failer failed in its child process:.*ValueError: the child's own"):
        run_in_child(fail, timeout_s=60, name="failer")
