"""No wait without a bound (docs/cluster.md, "Every wait is bounded"), read from the package's source with ``ast``:
every call that waits on another process or thread (a child's ``wait``, ``subprocess.run``, a queue's or pipe's
``get`` / ``recv``, a ``join``, ``ray.get`` / ``ray.wait``, a process group made without a ``timeout``) passes its
bound, or is one of the exceptions below, each with the reason it needs none. Issue 53 found five that were not
(``sbatch`` without a timeout, ``p.wait()`` after SIGKILL in launch/local_slurm.py, ``queue.get()`` in
moe/parallelize.py, ``init_process_group`` / ``new_group`` without a timeout in gpu/smoke.py)."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SUBPROCESS_WAITS = {"run", "check_output", "check_call", "call"}
BLOCKING_METHODS = {"wait", "join", "get", "recv", "communicate", "acquire"}
GROUP_MAKERS = {"init_process_group", "new_group"}

# (file, the call as ast.unparse writes it) -> why it needs no bound
EXCEPTIONS = {
    ("megatron_qarl/data/reward.py", "conn.recv()"):
        "both: the worker's loop reads its parent, whose death is an end of file; the parent reads only after "
        "multiprocessing.connection.wait(timeout=...) said the worker's socket is ready, and the worker holds the "
        "only other end (its death is an end of file too)",
    ("megatron_qarl/moe/parallelize.py", "conn.recv()"):
        "run_ranks reads a rank's pipe after wait(timeout=...) said it is ready; the rank holds the only write end",
    ("megatron_qarl/launch/slurm.py", "running[0].wait()"):
        "`ray start --block` lives as long as the Slurm job (join_ray): Slurm's time limit and the signals it passes "
        "on end it",
    ("megatron_qarl/plan/simulate.py", "dist.init_process_group('fake', store=FakeStore(), rank=0, world_size=world)"):
        "torch's fake backend: no collective communicates",
    ("megatron_qarl/plan/simulate.py", "new_group(*args, **kwargs)"):
        "the fake backend's stand-in for Megatron's gloo side groups (no communication)",
    ("megatron_qarl/serve/scheduler.py", "self._cv.wait()"):
        "the engine thread waits for work in its own process; stop() notifies it",
    ("megatron_qarl/serve/weight_loading.py", "thread.join()"):
        "a computation on a fresh thread of this process (in_fresh_thread), not a wait on another process",
    ("megatron_qarl/sync/transport.py", "w.wait()"):
        "called only after every broadcast work reported is_completed() within the bucket's deadline",
}


def unbounded_waits(root: Path = REPO / "megatron_qarl") -> list[tuple[str, str]]:
    """(file, call) of every call under ``root`` that waits without naming a bound."""
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = str(path.relative_to(root.parent))
        for node in ast.walk(ast.parse(path.read_text(), rel)):
            if not isinstance(node, ast.Call):
                continue
            f, kws = node.func, {k.arg for k in node.keywords}
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
            base = f.value.id if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) else None
            if (base == "subprocess" and name in SUBPROCESS_WAITS and "timeout" not in kws) or \
                    (name in BLOCKING_METHODS and not node.args and not kws) or \
                    (name in GROUP_MAKERS and "timeout" not in kws) or \
                    (base == "ray" and name in ("get", "wait") and "timeout" not in kws):
                found.append((rel, ast.unparse(node)))
    return found


def test_every_wait_names_its_bound_or_says_why_it_needs_none():
    found = unbounded_waits()
    unexplained = [f"{path}: {call}" for path, call in found if (path, call) not in EXCEPTIONS]
    assert not unexplained, "waits without a bound:\n" + "\n".join(unexplained)
    stale = set(EXCEPTIONS) - set(found)
    assert not stale, f"exceptions for calls that are gone: {stale}"


def test_the_scan_sees_each_kind_of_unbounded_wait(tmp_path):
    pkg = tmp_path / "megatron_qarl"
    pkg.mkdir()
    (pkg / "m.py").write_text(
        "import subprocess, ray\nimport torch.distributed as dist\n"
        "subprocess.run(['sbatch'])\nsubprocess.run(['x'], timeout=5)\np.wait()\np.wait(timeout=1)\nq.get()\n"
        "d.get('k')\nray.get(ref)\nray.get(ref, timeout=3)\ndist.init_process_group('nccl')\n"
        "dist.new_group([0], timeout=t)\n")
    assert [call for _, call in unbounded_waits(pkg)] == [
        "subprocess.run(['sbatch'])", "p.wait()", "q.get()", "ray.get(ref)", "dist.init_process_group('nccl')"]
